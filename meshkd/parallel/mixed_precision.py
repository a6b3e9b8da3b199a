"""Mixed precision for the student: half-precision compute on float32 master weights.

Design (FSDP2's `MixedPrecisionPolicy` as torchtitan uses it, autocast as the HF Trainer's bf16 mode). The
student's parameters stay float32, so its gradients and optimizer states are float32 too and an update much
smaller than a weight still moves it; the configured dtype is the compute dtype. The layouts
(`parallelize_student`, `StudentPipeline`) apply it:
- the laid-out model's forward runs under `torch.autocast(compute dtype)` on every layout (one process,
  DDP, TP, CP, PP, FSDP2): matmuls in the compute dtype, float32 where autocast and the model keep it
  (norms, softmax). Only the forward: backward runs each op in the dtype its forward chose, as autocast
  wants, and the gradients reach the float32 parameters as float32. Layouts without FSDP2 have no other
  way to compute in bfloat16 on float32 weights; on FSDP2 it covers what FSDP2 does not cast (parameters
  it leaves alone: experts spread over the dp ranks);
- FSDP2 / HSDP also gathers the parameters in the compute dtype (half the all-gather bytes) and
  reduce-scatters gradients in float32: `MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`. DDP
  all-reduces the float32 gradients its parameters have.
Pure half-precision parameters (`model.pure_half_precision`) skip all this; `rounded_update_share` says
how much of such a model an update of a given size cannot move.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshkd.core.agreement import group_device


def parameter_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of `module`'s trained floating-point parameters (float32 when it has none): a LoRA student's
    adapters, whose frozen base is kept in the compute dtype (`meshkd.recipe.modeling.adapters`)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point() and p.requires_grad), torch.float32)


def is_mixed(module: nn.Module, compute_dtype: torch.dtype | None) -> bool:
    """Whether `module` computes in another dtype than its parameters' (None: in theirs)."""
    return compute_dtype is not None and compute_dtype != parameter_dtype(module)


def fsdp_policy(module: nn.Module, compute_dtype: torch.dtype | None) -> dict:
    """fully_shard's keyword arguments for `compute_dtype`: gather in it, reduce in the parameters' dtype."""
    if not is_mixed(module, compute_dtype):
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=parameter_dtype(module))}


def autocast_forward(module: nn.Module, compute_dtype: torch.dtype, device: torch.device | str) -> None:
    """From now on run `module.forward` under `torch.autocast(compute_dtype)` (generation included).

    The forward is wrapped rather than each call site, so that training, evaluation, generation and a
    pipeline schedule's calls all compute alike. Forward hooks run outside it: the attention masks they
    build take the parameters' dtype, and attention casts them with its other inputs.
    """
    module.forward = torch.autocast(torch.device(device).type, dtype=compute_dtype)(module.forward)


def rounded_update_share(parameters, step: float, *, group: dist.ProcessGroup | None = None) -> float:
    """The share of `parameters`' elements that an update of size `step` would leave unchanged.

    An update rounds away when it is below half the spacing of the parameter's dtype at the weight
    (round to nearest): |w| in [2^(e-1), 2^e) has spacing eps * 2^(e-1), eps the dtype's machine epsilon.
    Zeros take any update. Each rank counts its local values; in a process group the counts are summed
    over `group` (every rank of it calls).
    """
    counts = torch.zeros(2, dtype=torch.float64)
    for parameter in parameters:
        values = parameter.detach()
        values = values.to_local() if hasattr(values, "to_local") else values
        if not values.is_floating_point() or values.numel() == 0:
            continue
        _, exponent = torch.frexp(values.float())
        half_spacing = torch.finfo(values.dtype).eps * torch.exp2(exponent.float() - 2)
        counts += torch.tensor([float(((step < half_spacing) & (values != 0)).sum()), values.numel()])
    if dist.is_initialized():
        counts = counts.to(group_device(group))
        dist.all_reduce(counts, group=group)
    return float(counts[0] / counts[1].clamp(min=1))


def rounded_update_warning(parameters, lr: float, *, dtype: str, group: dist.ProcessGroup | None) -> str | None:
    """What to tell the user of pure `dtype` weights that an update of the peak `lr` cannot move (None: all move).

    Collective over `group`, like `rounded_update_share`."""
    share = rounded_update_share(parameters, lr, group=group)
    if share == 0:
        return None
    return (f"model.pure_half_precision: the weights and optimizer states are {dtype}; an update of the peak lr "
            f"{lr:g} (an Adam step's size) is below half a {dtype} step for {share:.1%} of the loaded weights and "
            f"rounds away, so they do not learn. Without the key the student keeps float32 master weights and "
            f"computes in {dtype} (about 16 bytes a parameter with AdamW, against 8)")

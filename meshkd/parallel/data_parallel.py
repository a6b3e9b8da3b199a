"""The student's data-parallel layout and what depends on it: loss scale, full state dict, gradient norm.

`parallelize_student` lays a (non-pipelined) student out in a fixed order: tensor parallel
(`meshkd.parallel.tensor_parallel`, the model's own plan; logits stay a DTensor Shard(-1) so the loss is
vocab-parallel; MoE experts whole over the tp ranks with ep_size = tp_size, or over the dp_shard ranks with
tp_size 1 and ep_size = dp_shard_size, left out of FSDP2), then context parallel
(`meshkd.parallel.context_parallel`), then FSDP2 per decoder layer and on the root over `dp_shard` (HSDP
over (dp_replicate, dp_shard) when dp_replicate > 1), or DDP over `dp` with strategy "ddp". A compute
dtype other than the parameters' adds mixed precision (`meshkd.parallel.mixed_precision`). A pipelined
student is laid out by `meshkd.parallel.student_pipeline` with the same pieces.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshkd.core.agreement import group_device
from meshkd.core.topology import DistributedSetup, member_mesh
from meshkd.parallel.context_parallel import STUDENT_CP_AXIS, check_student_cp, enable_student_cp
from meshkd.parallel.mixed_precision import autocast_forward, fsdp_policy, is_mixed
from meshkd.parallel.stages import decoder_of
from meshkd.parallel.tensor_parallel import apply_expert_parallel, apply_tensor_parallel


def parallelize_student(model: nn.Module, setup: DistributedSetup, *,
                        compute_dtype: torch.dtype | None = None) -> nn.Module:
    """Lay the student out over `setup`: TP, then CP, then FSDP2 (or DDP); returns the model to train.

    Args:
        model: a transformers causal LM on its device, identical on every rank of the role. With
            cp_size > 1 it must already consume NEAT-packed batches (`meshkd.core.packing.configure_packing`,
            sdpa, eager or flex attention): its `attention_mask` is read as document indices.
        setup: the student's `DistributedSetup` (this rank must be a member).
        compute_dtype: the dtype to compute in, when it is not the parameters' (float32 master weights):
            the forward runs under autocast, and FSDP2 gathers in it and reduces gradients in float32.

    Returns:
        `model` itself for strategy "fsdp2" (changed in place; its logits are a DTensor Shard(-1) on the
        `tp` axis when tp_size > 1), or a `DistributedDataParallel` wrapper for strategy "ddp".

    Context parallel (cp_size > 1): feed the model batches from `shard_student_batch` (every cp rank of a
    data-parallel replica runs forward and backward together) and pair its local logits with
    `shard_teacher_logits`. FSDP2 shards over `STUDENT_CP_AXIS`; that axis is created here when the setup
    spans the whole world, otherwise every world rank must call `flatten_student_cp_axes` first (group
    creation is collective over the world). Multiply the loss by `student_loss_scale(setup)` before
    backward, and call `scale_expert_gradients(model)` after it (experts over the dp ranks need it).

    Raises:
        ValueError: for layouts this function does not lay out (pp: use `StudentPipeline`; sequence
            parallel, TP with DDP, CP with DDP, experts over dp with DDP, CP or dp_replicate), a CP student
            not configured for NEAT packing, or head counts the tp size does not divide.
    """
    mesh = member_mesh(setup)
    if setup.pp_size > 1 or setup.sequence_parallel:
        raise ValueError(
            f"parallelize_student supports tp, cp, dp_replicate and dp_shard only; got pp_size({setup.pp_size}), "
            f"sequence_parallel({setup.sequence_parallel})"
        )
    if setup.strategy == "ddp" and setup.tp_size > 1:
        raise ValueError(f"strategy 'ddp' with tp_size({setup.tp_size}) > 1 is not supported; use fsdp2")
    if setup.expert_axis == "dp_shard":
        check_experts_over_dp(setup)
    if setup.cp_size > 1:
        check_student_cp(model, setup)
    experts = []
    if setup.tp_size > 1:
        apply_tensor_parallel(model, mesh["tp"], expert_parallel=setup.expert_axis == "tp")
    elif setup.expert_axis == "dp_shard":
        experts = _spread_experts_over_dp(model, setup, mesh)
    if setup.cp_size > 1:
        enable_student_cp(model, mesh)
    policy = fsdp_policy(model, compute_dtype)
    if is_mixed(model, compute_dtype):
        autocast_forward(model, compute_dtype, mesh.device_type)
    if setup.dp_size * setup.cp_size == 1:
        return model
    if setup.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        with warnings.catch_warnings():
            # torch warns about slicing a flattened axis from the root mesh; topology keeps `dp` there.
            warnings.simplefilter("ignore")
            dp_group = mesh["dp"].get_group()
        return DistributedDataParallel(model, process_group=dp_group)

    from torch.distributed.fsdp import fully_shard

    dp_mesh = student_fsdp_mesh(setup, mesh)
    # Per-layer groups first, then the root (embedding, norm, lm_head), so each layer's parameters are
    # gathered just before it runs and freed after.
    for layer in decoder_of(model).layers:
        fully_shard(layer, mesh=dp_mesh, ignored_params=set(experts), **policy)
    fully_shard(model, mesh=dp_mesh, ignored_params=set(experts), **policy)
    return model


EXPERT_GRADIENT_SCALE = "meshkd_expert_gradient_scale"
"""Attribute of a module whose parameters are experts spread over the dp ranks: their gradients' factor."""


def _spread_experts_over_dp(model: nn.Module, setup: DistributedSetup, mesh: DeviceMesh) -> list[nn.Parameter]:
    """Whole experts over the dp_shard ranks (which hold different tokens); returns the expert parameters.

    FSDP2 leaves them alone (each rank owns its experts; nothing to shard or reduce over dp). FSDP2 averages
    the other gradients over dp, which the loss scale (`student_loss_scale`) turns into a sum; an expert's
    gradient already is the sum over every rank's tokens (the all-to-all's backward), so the same scale has
    to come off it: `scale_expert_gradients`. The factor is kept on the experts' modules, which sharded
    loading leaves in place (it gives the parameters new storage, and a hook on a parameter would go with it).
    """
    experts = apply_expert_parallel(model, mesh["dp_shard"], mesh["tp"])
    expert_ids = {id(parameter) for parameter in experts}
    for module in model.modules():
        if any(id(parameter) in expert_ids for parameter in module.parameters(recurse=False)):
            setattr(module, EXPERT_GRADIENT_SCALE, 1.0 / student_loss_scale(setup))
    return experts


def check_experts_over_dp(layout) -> None:
    """ValueError for a layout (a `DistributedSetup` or its config section) that spreads experts over the dp
    ranks together with what that does not support: cp, pp, dp_replicate or DDP."""
    unsupported = [f"{name}({getattr(layout, name)})" for name in ("cp_size", "pp_size", "dp_replicate_size")
                   if getattr(layout, name) > 1]
    unsupported += [f"strategy '{layout.strategy}'"] if layout.strategy != "fsdp2" else []
    if unsupported:
        raise ValueError(f"ep_size({layout.ep_size}) spreads experts over the data-parallel ranks, which is "
                         f"supported with FSDP2 alone (no cp, pp or dp_replicate); got {', '.join(unsupported)}")


def scale_expert_gradients(model: nn.Module) -> None:
    """Take the loss scale off the gradients of experts spread over the dp ranks (no-op for other layouts).

    Call after the step's backward passes, before clipping, when `parallelize_student` laid the student out
    with experts over the data-parallel ranks (ep_size = dp_shard_size, tp_size 1).
    """
    for module in model.modules():
        scale = getattr(module, EXPERT_GRADIENT_SCALE, None)
        if scale is not None:
            for parameter in module.parameters(recurse=False):
                if parameter.grad is not None:
                    parameter.grad.mul_(scale)


def student_fsdp_mesh(setup: DistributedSetup, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards a student over: `dp_shard`, or `STUDENT_CP_AXIS` under CP; 2-D with dp_replicate (HSDP).

    Under CP the parameters are sharded (and their gradients reduced) over dp_shard x cp together, so the
    cp ranks' partial gradients are combined by the same reduce-scatter that combines dp_shard's.
    """
    shard_axis = STUDENT_CP_AXIS if setup.cp_size > 1 else "dp_shard"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # slicing a flattened axis from the root mesh warns; it is intended
        # HSDP when replicated: shard within the shard axis, replicate across dp_replicate (a 2-D mesh).
        return mesh["dp_replicate", shard_axis] if setup.dp_replicate_size > 1 else mesh[shard_axis]


def student_loss_scale(setup: DistributedSetup) -> int:
    """Factor to multiply the student's loss by before backward: dp_size * cp_size.

    The loss of each rank is a sum over its own tokens divided by the global valid-token count, so the
    wanted gradient is the SUM of all ranks' gradients. FSDP2 (over dp_shard, or dp_shard x cp under CP;
    HSDP adds dp_replicate) and DDP (over dp) AVERAGE instead, over dp_size * cp_size ranks in total.
    Without a wrapper (dp_size = cp_size = 1) the factor is 1.
    """
    return setup.dp_size * setup.cp_size


@contextlib.contextmanager
def gradient_sync(model: nn.Module, *, enabled: bool):
    """Forward and backward inside reduce gradients over the data-parallel ranks only when `enabled`.

    For gradient accumulation: a step syncs after its last micro-batch only, so the reduction traffic does
    not grow with the number of micro-batches (DDP `no_sync`; FSDP2 `set_requires_gradient_sync`, which
    keeps the unsharded gradients until then, as torch documents). A no-op for a student without a wrapper.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if enabled:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def gather_full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The full (unsharded across TP and FSDP) state dict on the CPU, for export with HF names.

    Every rank of the model must call (the gather is collective). With `rank0_only` the tensors are
    kept on global rank 0 only and other ranks get an empty dict, which bounds host memory.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # cpu_offload=True is torch's "rank 0 only" switch for full state dicts.
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    state = get_model_state_dict(model, options=options)
    return {key: value.detach().cpu() for key, value in state.items()}


def clip_grad_norm(parameters, max_norm: float | None, *, stages_group: dist.ProcessGroup | None = None,
                   uncounted=()) -> torch.Tensor:
    """Clip gradients to a total norm of `max_norm` (None: only measure); returns the total norm, a 0-dim float64
    tensor on the gradients' device (0 on the CPU without any), so that the caller reads it when it reads the
    step's other figures: measuring and clipping wait for nothing on the host.

    Under pipeline parallel each rank holds one stage's parameters: `stages_group` (the pp group) adds up
    the stages' squared norms so that every stage clips by the same total. `uncounted` parameters are
    clipped but left out of the norm: copies of a parameter another stage counts (a tied output head).

    Gradients may mix plain tensors (e.g. replicated norms under TP without FSDP) and DTensors on different
    meshes and placements, which torch's clip_grad_norm_ cannot combine; so each (mesh, placements) group
    gets its own norm, in the same order on every rank, and the groups' squares are added in float64.
    """
    groups: dict = {}
    for parameter in parameters:
        grad = parameter.grad
        if grad is not None:
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            groups.setdefault(key, []).append(grad)
    skipped = {id(parameter.grad) for parameter in uncounted if parameter.grad is not None}
    squares = None
    for grads in groups.values():
        grads_counted = [grad for grad in grads if id(grad) not in skipped]
        if not grads_counted:
            continue
        norm = torch.nn.utils.get_total_norm(grads_counted)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        square = norm.double().square()
        squares = square if squares is None else squares + square
    if stages_group is not None:
        device = group_device(stages_group)
        summed = torch.zeros((), dtype=torch.float64, device=device) if squares is None else squares.to(device)
        dist.all_reduce(summed, group=stages_group)
        squares = summed
    if squares is None:
        return torch.zeros((), dtype=torch.float64)
    total = squares.sqrt()
    if max_norm is not None:
        # The factor where the norm exceeds max_norm, else 1 (an exact no-op), chosen on the device.
        scale = torch.where(total > max_norm, max_norm / (total + 1e-6), 1.0).float()
        for grads in groups.values():
            for grad in grads:
                grad.mul_(scale)
    return total

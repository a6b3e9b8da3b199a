"""Tensor parallel from the model's own plan.

Design. transformers ships, per model family, a tensor-parallel plan (`config.base_model_tp_plan` and the
causal LM's own entries) and the DTensor styles that carry each entry out: colwise and rowwise projections,
their gathered-output and split-input variants (Phi-3's fused projections, OLMo 2's q/k norms over all
heads), packed (fused) expert projections, MoE expert blocks, and replicated parameters whose gradient is
summed over tp (Qwen 3's per-head q/k norms). meshkd applies that plan with transformers' own
`apply_tensor_parallelism` and overrides two entries for distillation: the input embedding is sharded over
the vocabulary, and the output head keeps its logits as a DTensor Shard(-1) on the vocabulary dim, so the
vocab-parallel KD loss never gathers the vocabulary. `tensor_parallel_plan` resolves the plan for one
model instance (wildcards expanded to the modules it has, so a pipeline stage's pass-throughs are left
out); `check_tensor_parallel` refuses, before anything is sharded, what the plan cannot honour. The
experts of an MoE teacher or student may instead be spread whole over the same tp ranks by the model's
expert plan (`config.base_model_ep_plan`, transformers' expert dispatch): ep_size = tp_size. From
transformers 5.25 the families' tp plans no longer split experts (`experts_left_whole`): tp alone then keeps
every expert whole on each tp rank, and preflight suggests ep_size = tp_size.
"""

from __future__ import annotations

import inspect
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshkd.parallel.stages import decoder_of, is_pass_through, is_tied

__all__ = ["apply_expert_parallel", "apply_tensor_parallel", "check_tensor_parallel", "experts_left_whole",
           "tensor_parallel_plan"]

VOCAB_PARALLEL_HEAD = "meshkd_vocab_parallel_head"
"""Style of the output head: colwise, logits left as a DTensor Shard(-1) on the vocabulary dim."""
VOCAB_PARALLEL_EMBEDDING = "embedding_rowwise"
"""transformers' style for an embedding sharded over the vocabulary (partial lookups summed)."""
GRAD_SUMMED_REPLICA = "meshkd_replicated_grad_sum"
"""Replicated parameter whose gradient contribution is summed over tp, once per backward."""
# transformers' style for such parameters all-reduces the ACCUMULATED gradient after every backward, which
# counts earlier micro-batches again under gradient accumulation; it is replaced by GRAD_SUMMED_REPLICA.
_REPLACED_STYLES = {"replicated_with_grad_allreduce": GRAD_SUMMED_REPLICA}
# Styles after which attention sees only its local heads, so the head counts must divide by tp.
_LOCAL_HEAD_STYLES = ("colwise", "packed_colwise")
_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj")


def _styles():
    from torch.distributed.tensor import Replicate, Shard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, ColwiseParallel

    if VOCAB_PARALLEL_HEAD not in ALL_PARALLEL_STYLES:
        head = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
        ALL_PARALLEL_STYLES.register(VOCAB_PARALLEL_HEAD, head)
        ALL_PARALLEL_STYLES.register(GRAD_SUMMED_REPLICA, _GradSummedReplica())
    return ALL_PARALLEL_STYLES


def _sum_over(group):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    return hook


class _GradSummedReplica:
    """A replicated parameter that sees only this rank's heads (Qwen 3's per-head q/k norms).

    Its gradient contribution (not the accumulated .grad) is summed over tp by a tensor hook. The hook is
    (re)attached in forward, because FSDP2 hands the module a different parameter object than the one
    present when the style was applied.
    """

    # transformers passes keyword context (config, mesh_manager from 5.25) that this style does not need.
    def install_forward(self, module: nn.Module, mesh: DeviceMesh, **context) -> nn.Module:
        original_forward = module.forward
        hooked: dict[str, nn.Parameter] = {}
        group = mesh.get_group()

        def forward(*args, **kwargs):
            if torch.is_grad_enabled():
                for name, parameter in module.named_parameters(recurse=False):
                    if parameter.requires_grad and hooked.get(name) is not parameter:
                        parameter.register_hook(_sum_over(group))
                        hooked[name] = parameter
            return original_forward(*args, **kwargs)

        module.forward = forward
        return module

    def shard_param(self, module: nn.Module, parameter: str, mesh: DeviceMesh, **context) -> None:
        pass  # replicated


def _style_context(model: nn.Module) -> dict:
    """The keyword context transformers' styles take in this release, as `apply_tensor_parallelism` passes it
    (the text config and the mesh manager from 5.25, nothing before)."""
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    if "config" not in inspect.signature(TensorParallelLayer.shard_param).parameters:
        return {}
    return {"config": model.config.get_text_config(), "mesh_manager": getattr(model, "_mesh_manager", None)}


def _declared_plan(model: nn.Module, kind: str = "tp") -> dict[str, str]:
    """The model's `kind` ("tp" or "ep") plan with full names: the causal LM's entries, then its base model's."""
    decoder = decoder_of(model)
    prefix = next(name for name, module in model.named_children() if module is decoder)
    plan = dict(getattr(type(model), f"_{kind}_plan", None) or {})
    base = getattr(model.config, f"base_model_{kind}_plan", None) or {}
    plan.update({f"{prefix}.{key}": style for key, style in base.items()})
    return plan


def _expand(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """{module or parameter name of this instance: style} for plan keys with `*` standing for a layer index."""
    targets = [name for name, module in model.named_modules() if not is_pass_through(module)]
    targets += [name for name, _ in model.named_parameters()]
    resolved: dict[str, str] = {}
    for key, style in plan.items():
        pattern = re.compile(re.escape(key).replace(r"\*", r"\d+"))
        for name in targets:
            if pattern.fullmatch(name):
                resolved[name] = style
    return resolved


def tensor_parallel_plan(model: nn.Module, *, expert_parallel: bool = False) -> dict[str, str]:
    """{module or parameter name: style name} to shard `model` with, wildcards expanded.

    The model's own plan, with the input embedding sharded over the vocabulary and the output head
    vocab-parallel (`VOCAB_PARALLEL_HEAD`). Entries matching nothing in this instance (a layer another
    pipeline stage owns) are left out, and so are the experts' entries with `expert_parallel` (the expert
    plan shards them instead).
    """
    plan = _declared_plan(model)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    names = {module: name for name, module in model.named_modules()}
    overrides = {}
    if isinstance(embedding, nn.Embedding):
        overrides[names[embedding]] = VOCAB_PARALLEL_EMBEDDING
    if isinstance(head, nn.Linear):
        overrides[names[head]] = VOCAB_PARALLEL_HEAD
    plan = {key: _REPLACED_STYLES.get(style, style) for key, style in plan.items() if key not in overrides} | overrides
    resolved = _expand(model, plan)
    if expert_parallel:
        experts = tuple(_expand(model, _declared_plan(model, "ep")))
        resolved = {name: style for name, style in resolved.items() if not _under(name, experts)}
    return resolved


def check_tensor_parallel(model: nn.Module, tp_size: int, ep_size: int = 1) -> None:
    """Raise ValueError when `model` cannot be split over `tp_size` ranks by its plan (config only, no weights).

    Refused: a family without a plan; a style transformers does not implement; head counts the tp size does
    not divide where attention projections are sharded by head; with `ep_size` > 1, a model without an
    expert plan or an expert count it does not divide. The message names the module and the number.
    """
    if ep_size > 1:
        _check_expert_parallel(model, ep_size)
    if tp_size == 1:
        return
    styles = _styles()
    declared = _declared_plan(model)
    if not declared:
        raise ValueError(f"{type(model).__name__} ships no tensor-parallel plan (config.base_model_tp_plan)")
    for key, style in declared.items():
        if style not in styles:
            raise ValueError(f"{type(model).__name__}: module {key!r} has the tensor-parallel style {style!r}, "
                             "which this transformers release does not implement")
    config = model.config
    for key, style in declared.items():
        if style in _LOCAL_HEAD_STYLES and key.rsplit(".", 1)[-1] in _ATTENTION_PROJECTIONS:
            for name in ("num_attention_heads", "num_key_value_heads"):
                heads = getattr(config, name, None)
                if isinstance(heads, int) and heads % tp_size:
                    raise ValueError(f"tp_size({tp_size}) must divide {name}({heads}): {key} ({style}) splits "
                                     "attention heads whole")


def experts_left_whole(model: nn.Module) -> bool:
    """Whether tensor parallel alone leaves `model`'s experts whole on every tp rank: an MoE model (one with an
    expert plan) whose tp plan shards none of its experts, as from transformers 5.25 on (before, the tp plan
    split each expert)."""
    experts = tuple(key.replace("*", "0") for key in _declared_plan(model, "ep"))
    if not experts:
        return False
    return not any(_under(key.replace("*", "0"), experts) for key in _declared_plan(model))


def _under(name: str, modules: tuple[str, ...]) -> bool:
    """Whether `name` is one of `modules` or inside one of them."""
    return any(name == module or name.startswith(module + ".") for module in modules)


def _check_expert_parallel(model: nn.Module, ep_size: int) -> None:
    if not _declared_plan(model, "ep"):
        raise ValueError(f"ep_size({ep_size}) > 1 needs a mixture-of-experts model; {type(model).__name__} ships "
                         "no expert-parallel plan (config.base_model_ep_plan)")
    config = model.config
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        experts = getattr(config, key, None)
        if isinstance(experts, int) and experts % ep_size:
            raise ValueError(f"ep_size({ep_size}) must divide {key}({experts}): each rank holds whole experts")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, expert_parallel: bool = False) -> None:
    """Shard `model` in place over the 1-D `tp_mesh` by its own plan (`tensor_parallel_plan`).

    With `expert_parallel`, the experts follow the model's expert plan instead (`apply_expert_parallel` over
    `tp_mesh`): each rank holds 1/tp of them whole. Tied input/output embeddings stay tied: both are sharded
    Shard(0) over the vocabulary and the head is pointed back at the embedding's DTensor. Raises ValueError
    as `check_tensor_parallel`.
    """
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    tp_size = tp_mesh.size()
    check_tensor_parallel(model, tp_size, tp_size if expert_parallel else 1)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = is_tied(model)
    plan = tensor_parallel_plan(model, expert_parallel=expert_parallel)
    styles = _styles()
    # transformers shards a module entry's parameters while it loads them; these are loaded already, so
    # each is cut here to this rank's piece (no communication: every rank holds the same full tensor).
    modules = dict(model.named_modules())
    context = _style_context(model)
    for name, style in plan.items():
        if name in modules:
            for parameter in [key for key, _ in modules[name].named_parameters(recurse=False)]:
                styles[style].shard_param(modules[name], parameter, tp_mesh, **context)
    apply_tensor_parallelism(model, tp_mesh, plan)
    if expert_parallel:
        apply_expert_parallel(model, tp_mesh, tp_mesh)
    if tied:
        head.weight = embedding.weight
    local_heads = any(style in _LOCAL_HEAD_STYLES and name.rsplit(".", 1)[-1] in _ATTENTION_PROJECTIONS
                      for name, style in plan.items())
    if local_heads:
        # Attention reshapes with -1 heads in transformers 5, but a family may still read per-module head
        # counts; those must describe the local heads.
        for layer in decoder_of(model).layers:
            attention = getattr(layer, "self_attn", None)
            for key in ("num_heads", "num_key_value_heads"):
                if isinstance(getattr(attention, key, None), int):
                    setattr(attention, key, getattr(attention, key) // tp_size)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> list[nn.Parameter]:
    """Spread whole experts over the 1-D `ep_mesh` by the model's expert plan; returns the expert parameters.

    Each rank keeps 1/ep of every layer's experts (a DTensor Shard(0) over the experts). transformers' expert
    dispatch (`ep_dispatch_experts`) sends each token to the ranks of its experts and back: an all-to-all,
    differentiable, so an expert's gradient sums the contributions of every rank's tokens; when `ep_mesh` is
    `tp_mesh` (the ranks hold the same tokens) a forward without gradients sums partial outputs instead.
    Raises ValueError as `check_tensor_parallel` does for `ep_size`.
    """
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    _check_expert_parallel(model, ep_mesh.size())
    plan = _expand(model, _declared_plan(model, "ep"))
    apply_expert_parallelism(model, ep_mesh, tp_mesh, plan)
    parameters = dict(model.named_parameters())
    return [parameters[name] for name in plan if name in parameters]

"""Packing: make causal LMs consume NEAT-packed batches, one model instance at a time.

Layout. A NEAT-packed row holds several documents. `attention_mask` [batch, sequence] holds each token's
1-based document index (0 = padding) and `position_ids` restart at 0 in every document. A token attends
to the earlier-or-equal tokens of its own document only. A row holding one document is an ordinary 0/1
padding mask, so the two layouts agree there by construction.

Design. transformers builds its attention masks from a 2D 0/1 mask, but hands an already prepared 4D mask to
the sdpa, eager and flex attention functions untouched (`_preprocess_mask_arguments` in masking_utils
returns it as-is). `configure_packing` therefore registers a forward pre-hook on the model instance, and on
the transformers models inside it so that a pipeline stage calling its inner model directly works too, which
turns the indexed mask into the masks `meshkd.core.masks.layer_masks` builds before transformers sees it (4D
additive tensors, or FlexAttention BlockMasks for a model loaded with flex_attention). The outermost hook
converts; the inner ones see the prepared masks and let them pass. Under context parallel
(`enable_cp_masks`) the same hooks gather the other cp ranks' document indices first, so no second hook, and
no hook order, is involved. Nothing in transformers is patched: other instances in the process keep the
ordinary behaviour. The consumed layout is recorded on the instance and read back by `packing_layout`.

`configure_kd_teacher_packing` closes a gap of separate-mesh KD for models run by their own forward:
teacher-only ranks never see the student, so they learn its layout from the control group, configure
their teacher parts to match, and then every rank checks that both roles agree. Local failures travel
inside the same gathers, so a disagreement raises ValueError on every rank instead of leaving a peer
blocked in a collective. (`TeacherRunner` builds its masks itself and needs none of this.)
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshkd.core.agreement import gather_values, group_device
from meshkd.core.masks import attention_windows, gather_documents, layer_masks, mask_dtype, takes_block_masks

__all__ = [
    "LAYOUT_ATTR",
    "NEAT_INDEXED",
    "configure_kd_teacher_packing",
    "configure_packing",
    "enable_cp_masks",
    "packing_layout",
]

NEAT_INDEXED = "neat-indexed"
"""Layout name: `attention_mask` holds 1-based document indices, 0 for padding."""

LAYOUT_ATTR = "_meshkd_packing_layout"
"""Instance attribute recording the packed mask layout a module consumes (absent: ordinary 0/1 mask)."""

# Instance attribute holding the module's mask hook, so that `enable_cp_masks` finds it.
_HOOK_ATTR = "_meshkd_mask_hook"
# Arguments whose dim 1 is the query length; only differs from the mask length when a KV cache is used.
_QUERY_ARGUMENTS = ("input_ids", "inputs_embeds", "hidden_states")


def packing_layout(module: nn.Module) -> str | None:
    """Return the packed mask layout `module` consumes: `NEAT_INDEXED`, or None for an ordinary 0/1 mask.

    A module configured by `configure_packing`, or one that contains a configured module, consumes the NEAT
    layout. A module made to consume a layout by other means can declare it by setting `LAYOUT_ATTR`.
    """
    layout = getattr(module, LAYOUT_ATTR, None)
    if layout is not None:
        return layout
    for submodule in module.modules():
        layout = getattr(submodule, LAYOUT_ATTR, None)
        if layout is not None:
            return layout
    return None


class _MaskHook:
    """Forward pre-hook: an indexed 2D `attention_mask` argument -> the model's 4D masks (`layer_masks`).

    It holds plain data only (no module reference), so deep copies and pickles of a configured model stay
    configured and self-contained; under context parallel also the cp group, `cp` = (group, cp_size,
    cp_rank), and then the local indices [batch, local_sequence] are gathered into the whole sequence's
    (a missing mask is one document). Masks already prepared (4D, or one per kind) pass through.
    """

    def __init__(self, *, positions: dict[str, int], windows: dict[str, int | None], block: bool = False):
        self.positions = positions  # argument name -> positional index in forward
        self.windows = windows  # attention kind -> sliding window (`attention_windows`)
        # FlexAttention BlockMasks instead of 4D tensors (`takes_block_masks`); read when configured, since
        # context parallel later renames the config's attention to its own.
        self.block = block
        self.cp: tuple[dist.ProcessGroup, int, int] | None = None

    def _argument(self, args: tuple, kwargs: dict, name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        index = self.positions.get(name)
        return args[index] if index is not None and index < len(args) else None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        mask = self._argument(args, kwargs, "attention_mask")
        if isinstance(mask, dict) or (mask is not None and len(getattr(mask, "shape", ())) != 2):
            return None  # prepared by an outer module's hook, or by the caller (a 4D tensor or a BlockMask)
        # The first of input_ids / inputs_embeds / hidden_states: the queries' length, device and dtype.
        reference = next((value for value in (self._argument(args, kwargs, name) for name in _QUERY_ARGUMENTS)
                          if isinstance(value, torch.Tensor) and value.dim() >= 2), None)
        if self.cp is None:
            if not isinstance(mask, torch.Tensor):
                return None
            device = mask.device if reference is None else reference.device
            masks = layer_masks(mask.to(device), self.windows, dtype=self._dtype(module, reference, device),
                                query_length=None if reference is None else reference.shape[1], block=self.block)
        else:
            if reference is None:
                return None
            group, cp_size, cp_rank = self.cp
            local_shape, device = tuple(reference.shape[:2]), reference.device
            if mask is None:
                mask = torch.ones(local_shape, dtype=torch.int64, device=device)
            if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != local_shape:
                raise ValueError(
                    f"context-parallel student: attention_mask {tuple(getattr(mask, 'shape', ()))} must be this "
                    f"rank's share {local_shape} of the sequence; shard the batch with shard_student_batch"
                )
            documents = gather_documents(mask.to(device), group)
            masks = layer_masks(documents, self.windows, dtype=self._dtype(module, reference, device),
                                cp_size=cp_size, cp_rank=cp_rank, block=self.block)
        index = self.positions.get("attention_mask")
        if "attention_mask" in kwargs or index is None or index >= len(args):
            return args, {**kwargs, "attention_mask": masks}
        return (*args[:index], masks, *args[index + 1 :]), kwargs

    @staticmethod
    def _dtype(module: nn.Module, reference: torch.Tensor | None, device: torch.device) -> torch.dtype:
        # The attention scores' dtype: that of embeddings or hidden states when they are given.
        if reference is not None and reference.is_floating_point():
            return reference.dtype
        return mask_dtype(module, device)


def _forward_positions(module: nn.Module) -> tuple[dict[str, int], bool]:
    """Positional indices of forward's named arguments, and whether it takes `attention_mask` at all."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # builtins and some C extensions have no signature
        return {}, False
    positions: dict[str, int] = {}
    takes_mask = False
    for index, parameter in enumerate(parameters):
        if parameter.kind is inspect.Parameter.VAR_KEYWORD or parameter.name == "attention_mask":
            takes_mask = True
        if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            positions[parameter.name] = index
    return positions, takes_mask


def _hf_models(model: nn.Module) -> list[nn.Module]:
    """The transformers models inside `model` (itself included)."""
    # No transformers model can exist before transformers is imported; importing it here would cost seconds
    # on ranks that never use it.
    if "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedModel

    return [module for module in model.modules() if isinstance(module, PreTrainedModel)]


def configure_packing(model: nn.Module) -> nn.Module:
    """Make `model` consume NEAT-packed batches (`NEAT_INDEXED`); returns `model`.

    `model` is a transformers decoder-only causal LM (LlamaForCausalLM and similar), its inner decoder
    (LlamaModel), a pipeline stage holding some of the decoder layers, or any module whose forward takes
    `attention_mask` or contains such a transformers model. Its forward then accepts `attention_mask`
    [batch, sequence] of 1-based document indices (0 = padding); `position_ids` [batch, sequence] must
    restart at 0 in every document. Only this instance changes: a forward pre-hook converts the mask, and
    transformers itself is left alone. Calling it again is a no-op.

    Raises:
        ValueError: if no forward in `model` takes `attention_mask`, or a transformers config uses an
            attention implementation other than sdpa/eager/flex_attention, or a layer kind without a mask rule.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"configure_packing expects an nn.Module, got {type(model).__name__}")
    if getattr(model, LAYOUT_ATTR, None) == NEAT_INDEXED:
        return model
    hf_models = _hf_models(model)
    candidates = [model, *(module for module in hf_models if module is not model)]
    # Validate everything before registering anything, so a failure leaves the model untouched.
    plans = []
    for module in candidates:
        positions, takes_mask = _forward_positions(module)
        if not takes_mask:
            continue
        config = getattr(module, "config", None)
        if not hasattr(config, "_attn_implementation"):  # not a transformers config: a wrapper's own settings
            # A wrapper around a transformers model attends the way that model does.
            config = hf_models[0].config if hf_models else None
        windows = attention_windows(config, module) if config is not None else {"full_attention": None}
        block = config is not None and takes_block_masks(config)
        plans.append((module, _MaskHook(positions=positions, windows=windows, block=block)))
    if not plans:
        raise ValueError(
            f"cannot configure NEAT packing on {type(model).__name__}: neither its forward nor a transformers "
            f"model inside it takes an attention_mask argument"
        )
    for module, hook in plans:
        if getattr(module, LAYOUT_ATTR, None) != NEAT_INDEXED:
            module.register_forward_pre_hook(hook, with_kwargs=True)
            setattr(module, _HOOK_ATTR, hook)
            setattr(module, LAYOUT_ATTR, NEAT_INDEXED)
    setattr(model, LAYOUT_ATTR, NEAT_INDEXED)
    return model


def enable_cp_masks(model: nn.Module, group: dist.ProcessGroup, *, cp_size: int, cp_rank: int) -> None:
    """Make the packing hooks of `model` build context-parallel masks from then on.

    Its forward then takes this cp rank's head-tail share of a NEAT-packed batch (`shard_student_batch`):
    the hook all-gathers the document indices over `group`, so every cp rank must run each forward, and
    hands the model this rank's queries masked against all keys in gathered order (`layer_masks`).
    Raises ValueError when `model` is not configured by `configure_packing`.
    """
    hooks = [getattr(module, _HOOK_ATTR) for module in model.modules() if hasattr(module, _HOOK_ATTR)]
    if not hooks:
        raise ValueError(
            f"cp_size({cp_size}) > 1 reads the student's attention_mask as NEAT document indices: call "
            f"meshkd.core.packing.configure_packing(model) before parallelize_student"
        )
    for hook in hooks:
        hook.cp = (group, cp_size, cp_rank)


def _describe(layout: str | None) -> str:
    return "no packing (ordinary 0/1 mask)" if layout is None else repr(layout)


def _by_layout(records: list[tuple[str, str | None]]) -> str:
    """'layout on rank 0 part 0, rank 1 part 0; other layout on ...' from (label, layout) records."""
    groups: dict[str | None, list[str]] = {}
    for label, layout in records:
        groups.setdefault(layout, []).append(label)
    return "; ".join(f"{_describe(layout)} on {', '.join(labels)}" for layout, labels in groups.items())


def _label(rank: int | None, index: int) -> str:
    return f"part {index}" if rank is None else f"rank {rank} part {index}"


def _layouts(parts: Sequence[nn.Module], role: str) -> list[str | None]:
    if isinstance(parts, nn.Module) and not isinstance(parts, nn.ModuleList):
        raise TypeError(f"{role}_parts must be a sequence of modules (e.g. [model]), got a {type(parts).__name__}")
    layouts = []
    for index, part in enumerate(parts):
        if not isinstance(part, nn.Module):
            raise TypeError(f"{role}_parts[{index}] is a {type(part).__name__}, not an nn.Module")
        layouts.append(packing_layout(part))
    return layouts


def _student_layout(records: list[tuple[str, str | None]]) -> str | None:
    """The one layout every student part consumes; ValueError otherwise."""
    if not records:
        raise ValueError(
            "configure_kd_teacher_packing got no student parts, so the student's mask layout is unknown; "
            "separate-mesh KD passes control_group so teacher-only ranks learn it from the student ranks"
        )
    layouts = {layout for _, layout in records}
    if len(layouts) > 1:
        raise ValueError(f"student parts disagree on the packed mask layout: {_by_layout(records)}")
    (layout,) = layouts
    if layout not in (None, NEAT_INDEXED):
        raise ValueError(
            f"student parts consume the mask layout {layout!r}, which teachers cannot be configured for "
            f"(supported: {NEAT_INDEXED!r} or no packing)"
        )
    return layout


_NO_TEACHERS = (
    "configure_kd_teacher_packing got no teacher parts; same-mesh KD passes both roles' parts on every rank, "
    "separate-mesh KD passes them on their own ranks"
)


def _check_teachers(records: list[tuple[str, str | None]], student_layout: str | None) -> None:
    mismatched = [(label, layout) for label, layout in records if layout != student_layout]
    if mismatched:
        raise ValueError(
            f"teacher and student parts consume different packed mask layouts: students use "
            f"{_describe(student_layout)}, teachers use {_by_layout(mismatched)}. A teacher configured for "
            f"NEAT packing stays so: build it unconfigured, or configure the students with configure_packing."
        )


def _configure_teachers(teacher_parts: Sequence[nn.Module], student_layout: str | None) -> None:
    if student_layout == NEAT_INDEXED:
        for part in teacher_parts:
            configure_packing(part)


def configure_kd_teacher_packing(
    teacher_parts: Sequence[nn.Module],
    student_parts: Sequence[nn.Module],
    control_group: dist.ProcessGroup | None = None,
) -> None:
    """Make the teacher parts consume the students' packed mask layout and check both roles agree.

    If the student parts consume NEAT-packed batches, every teacher part is configured with
    `configure_packing`; if they use no packing, the teachers are left alone. Then every teacher part must
    consume the students' layout.

    Args:
        teacher_parts: locally owned teacher stages, empty on student-only ranks.
        student_parts: locally owned student stages, empty on teacher-only ranks.
        control_group: group shared by both roles for separate-mesh KD; all its ranks must call. The
            students' layout is gathered over it before the teachers are configured. None (same-mesh KD)
            performs only a local check.

    Raises:
        ValueError: if the layouts disagree (among the students, or between teachers and students), or a
            teacher part cannot be configured. With a control group it is raised on every member rank.
    """
    if control_group is None:
        students = [(_label(None, i), layout) for i, layout in enumerate(_layouts(student_parts, "student"))]
        teacher_layouts = _layouts(teacher_parts, "teacher")  # type errors before any change
        student_layout = _student_layout(students)
        if not teacher_layouts:
            raise ValueError(_NO_TEACHERS)
        _configure_teachers(teacher_parts, student_layout)
        teachers = [(_label(None, i), packing_layout(part)) for i, part in enumerate(teacher_parts)]
        _check_teachers(teachers, student_layout)
        return

    if dist.get_rank(control_group) < 0:
        raise ValueError(f"rank {dist.get_rank()} is not a member of control_group; only its members may call")
    rank = dist.get_rank()
    # Round 1: every rank's layouts (or why it could not read them), so all ranks decide alike.
    local: dict[str, Any] = {"rank": rank, "student": [], "teacher": [], "error": None}
    try:
        local["student"] = _layouts(student_parts, "student")
        local["teacher"] = _layouts(teacher_parts, "teacher")
    except Exception as error:  # reported to every rank below instead of raised here
        local["error"] = f"{type(error).__name__}: {error}"
    gathered = gather_values(local, control_group, device=group_device(control_group))
    _raise_errors(gathered)
    students = [(_label(r["rank"], i), layout) for r in gathered for i, layout in enumerate(r["student"])]
    student_layout = _student_layout(students)
    if not any(r["teacher"] for r in gathered):
        raise ValueError(_NO_TEACHERS)

    # Round 2: configure locally, then share the result; a rank that failed reports it to everyone.
    local = {"rank": rank, "teacher": [], "error": None}
    failure: BaseException | None = None
    try:
        _configure_teachers(teacher_parts, student_layout)
        local["teacher"] = [packing_layout(part) for part in teacher_parts]
    except Exception as error:
        failure = error
        local["error"] = f"{type(error).__name__}: {error}"
    gathered = gather_values(local, control_group, device=group_device(control_group))
    try:
        _raise_errors(gathered)
    except ValueError as error:
        raise error from failure
    _check_teachers(
        [(_label(r["rank"], i), layout) for r in gathered for i, layout in enumerate(r["teacher"])], student_layout
    )


def _raise_errors(gathered: list[dict[str, Any]]) -> None:
    errors = [f"rank {r['rank']}: {r['error']}" for r in gathered if r["error"]]
    if errors:
        raise ValueError("configure_kd_teacher_packing failed on " + "; ".join(errors))

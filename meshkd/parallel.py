"""Parallelize: lay a transformers causal LM out over its role's DeviceMesh, one function per role.

Design (torchtitan style). Model code knows nothing of parallelism and is never copied: these functions
take an ordinary transformers decoder-only LM and a `DistributedSetup` and change the instance in place,
in a fixed order: pipeline split (`meshkd.stages.ModelStage`, by the model's pipeline plan), then tensor
parallel (`meshkd.tensor_parallel`, by the model's own plan), then data parallel (student only). The
model's own forward runs on every rank. A pipelined student is laid out by
`meshkd.student_pipeline.StudentPipeline` with the same pieces; this module does the rest.

- `parallelize_student`: TP (vocab-sharded embedding, lm_head output left as a DTensor Shard(-1) so the
  loss sees vocab-sharded logits), then context parallel (below), then FSDP2 per decoder layer and on the
  root over `dp_shard` (HSDP over (dp_replicate, dp_shard) when dp_replicate > 1), or DDP over `dp` with
  strategy "ddp".
- Student context parallel (cp_size > 1, fsdp2 only): every cp rank holds the head-tail share of the
  sequence (`shard_student_batch`, `shard_teacher_logits`). The attention gathers K/V over `cp` with a
  differentiable gather (the backward sums the K/V gradient over cp and hands each rank the piece for its
  own keys/values: a reduce-scatter), then calls the attention function the model was loaded with. A
  forward pre-hook all-gathers the local NEAT document indices over `cp` and builds the masks (one per
  attention kind of the layers) from global positions, so every tensor of the local batch has the local
  length. Parameters are replicated over cp yet each cp rank sees only part of the tokens, so their
  gradients must be SUMMED over cp: FSDP2 shards over the flattened (dp_shard, cp) axis `dp_shard_cp`
  (as torchtitan does), which AVERAGES over dp_shard * cp ranks (and over dp_replicate under HSDP). The
  loss must therefore be multiplied by `student_loss_scale(setup)` = dp_size * cp_size before backward.
- `TeacherRunner`: forward only. Pipeline split, TP (with ep_size = tp_size: whole experts spread over the
  tp ranks, as the model's expert plan says), and context parallel by head-tail sharding the
  sequence with the same gathered-K/V attention (registered with transformers' `AttentionInterface`,
  selected on this instance's config only; it runs on the CPU where torch's ring attention does not).
  Pipeline stages pass activations point to point, shape metadata first. The runner builds the 4D
  attention masks itself from NEAT document indices (or an ordinary 0/1 mask), so the teacher needs no
  `configure_packing`.
- `gather_full_state_dict`: the unsharded state dict for export.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshkd.logits import cp_shard, cp_unshard, materialize_teacher_logits
from meshkd.sharded_loading import is_empty
from meshkd.stages import ModelStage, decoder_of
from meshkd.tensor_parallel import apply_tensor_parallel
from meshkd.topology import DistributedSetup, flatten_axes

CP_ATTENTION = "meshkd_cp"
"""Name under which the context-parallel attention function is registered with transformers."""

STUDENT_CP_AXIS = "dp_shard_cp"
"""Flattened (dp_shard, cp) mesh axis over which FSDP2 shards a context-parallel student."""

# Attributes on each attention module holding its cp process group and the attention function it used
# before; the registered attention function is global to transformers, so both travel with the instance.
_CP_GROUP_ATTR = "_meshkd_cp_group"
_CP_INNER_ATTR = "_meshkd_cp_inner_attention"
# Attribute set on a root mesh once `flatten_student_cp_axes` ran for it, on members and non-members alike
# (non-members cannot see the flattened axis, yet must not create its groups twice).
_FLATTENED_ATTR = "_meshkd_student_cp_flattened"
# Dtypes a pipeline activation may have; the index travels in the shape metadata.
_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Metadata sent before each activation: ok flag, batch, local sequence, hidden, padded sequence,
# unpadded sequence, dtype index.
_META_LENGTH = 7


# ---------------------------------------------------------------------------------------------------------
# Tensor parallel


# ---------------------------------------------------------------------------------------------------------
# Student


def parallelize_student(model: nn.Module, setup: DistributedSetup) -> nn.Module:
    """Lay the student out over `setup`: TP, then CP, then FSDP2 (or DDP); returns the model to train.

    Args:
        model: a transformers causal LM on its device, identical on every rank of the role. With
            cp_size > 1 it must already consume NEAT-packed batches (`meshkd.packing.configure_packing`,
            sdpa or eager attention): its `attention_mask` is read as document indices.
        setup: the student's `DistributedSetup` (this rank must be a member).

    Returns:
        `model` itself for strategy "fsdp2" (changed in place; its logits are a DTensor Shard(-1) on the
        `tp` axis when tp_size > 1), or a `DistributedDataParallel` wrapper for strategy "ddp".

    Context parallel (cp_size > 1): feed the model batches from `shard_student_batch` (every cp rank of a
    data-parallel replica runs forward and backward together) and pair its local logits with
    `shard_teacher_logits`. FSDP2 shards over `STUDENT_CP_AXIS`; that axis is created here when the setup
    spans the whole world, otherwise every world rank must call `flatten_student_cp_axes` first (group
    creation is collective over the world). Multiply the loss by `student_loss_scale(setup)` before
    backward.

    Raises:
        ValueError: for layouts this function does not lay out (pp: use `StudentPipeline`; sequence
            parallel, TP with DDP, CP with DDP), a CP student not configured for NEAT packing, or head
            counts the tp size does not divide.
    """
    mesh = _member_mesh(setup)
    if setup.pp_size > 1 or setup.sequence_parallel:
        raise ValueError(
            f"parallelize_student supports tp, cp, dp_replicate and dp_shard only; got pp_size({setup.pp_size}), "
            f"sequence_parallel({setup.sequence_parallel})"
        )
    if setup.strategy == "ddp" and setup.tp_size > 1:
        raise ValueError(f"strategy 'ddp' with tp_size({setup.tp_size}) > 1 is not supported; use fsdp2")
    if setup.cp_size > 1:
        _check_student_cp(model, setup)
    if setup.tp_size > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if setup.cp_size > 1:
        _enable_student_cp(model, mesh)
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
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


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


def _gather_documents(local: torch.Tensor, group: dist.ProcessGroup, cp_size: int) -> torch.Tensor:
    """NEAT document indices of the whole padded sequence from every cp rank's head-tail share [batch, local]."""
    gathered = _gather_sequence(local.long(), group, dim=1, differentiable=False)
    return cp_unshard(list(gathered.chunk(cp_size, dim=1)), dim=1)


def student_loss_scale(setup: DistributedSetup) -> int:
    """Factor to multiply the student's loss by before backward: dp_size * cp_size.

    The loss of each rank is a sum over its own tokens divided by the global valid-token count, so the
    wanted gradient is the SUM of all ranks' gradients. FSDP2 (over dp_shard, or dp_shard x cp under CP;
    HSDP adds dp_replicate) and DDP (over dp) AVERAGE instead, over dp_size * cp_size ranks in total.
    Without a wrapper (dp_size = cp_size = 1) the factor is 1.
    """
    return setup.dp_size * setup.cp_size


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


def _member_mesh(setup: DistributedSetup) -> DeviceMesh:
    if setup.device_mesh is None or not setup.is_member:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of this setup (ranks {setup.ranks}); call on its ranks only"
        )
    return setup.device_mesh


# ---------------------------------------------------------------------------------------------------------
# Context-parallel attention


def _cp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The model's own attention over this rank's queries and ALL cp ranks' keys/values (gathered in cp-rank order).

    query [batch, heads, local_sequence, head_dim], key/value [batch, kv_heads, local_sequence, head_dim].
    `attention_mask` [batch, 1, local_sequence, cp * local_sequence] is additive, its keys in the gathered
    order; it already encodes causality, sliding windows and document boundaries in global positions
    (`_cp_mask`). The gathered keys/values then go to the attention function the model was loaded with
    (sdpa, or the family's own eager function with its soft-capping or attention sinks). When autograd
    records (the student in training) the gather is differentiable (`_GatherSequence`): its backward sums
    every rank's gradient for this rank's keys/values and hands it back here.
    """
    group = getattr(module, _CP_GROUP_ATTR, None)
    if group is None:
        raise RuntimeError(
            f"attention {CP_ATTENTION!r} used on a module without a cp group; use TeacherRunner or parallelize_student"
        )
    if attention_mask is None or attention_mask.dim() != 4:
        raise RuntimeError(
            f"attention {CP_ATTENTION!r} needs the 4D global-position mask built by TeacherRunner or by "
            f"parallelize_student's mask hook"
        )
    differentiable = torch.is_grad_enabled() and (key.requires_grad or value.requires_grad)
    key, value = (_gather_sequence(t, group, dim=2, differentiable=differentiable) for t in (key, value))
    # The mask is not causal in the gathered key order: no attention function may assume causality.
    kwargs["is_causal"] = False
    return getattr(module, _CP_INNER_ATTR)(module, query, key, value, attention_mask, **kwargs)


def _inner_attention(module: nn.Module, implementation: str):
    """The attention function of `implementation` for `module`: the family's eager function or a registered one."""
    if implementation == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[implementation]


def _gather_sequence(
    tensor: torch.Tensor, group: dist.ProcessGroup, *, dim: int, differentiable: bool
) -> torch.Tensor:
    """All cp ranks' `tensor` concatenated along `dim` in cp-rank order (NOT the original sequence order)."""
    if differentiable:
        return _GatherSequence.apply(tensor, group, dim)
    shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return torch.cat(shards, dim=dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim` whose backward sums every rank's gradient of this rank's piece.

    torch.distributed.nn.functional.all_gather would do, but its gloo backward (scatter with a global rank
    where a group rank is meant) fails on any group that does not start at global rank 0. gloo has no
    reduce-scatter, so there the backward all-reduces the whole gradient and keeps this rank's piece.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, tensor.contiguous(), group=group)
        return torch.cat(shards, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        group, dim = ctx.group, ctx.dim
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if dist.get_backend(group) == dist.Backend.GLOO:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=group)
            return grad.chunk(size, dim=dim)[rank].contiguous(), None, None
        pieces = [piece.contiguous() for piece in grad.chunk(size, dim=dim)]
        local = torch.empty_like(pieces[rank])
        dist.reduce_scatter(local, pieces, group=group)
        return local, None, None


def _enable_cp_attention(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Select the gathered-K/V attention on this instance only (its config), with `group` on its modules."""
    from transformers import AttentionInterface

    inner = model.config._attn_implementation
    if inner == CP_ATTENTION:
        raise ValueError("context parallel is already enabled on this model")
    if inner not in ("sdpa", "eager"):
        raise ValueError(f"context parallel needs attn_implementation 'sdpa' or 'eager', got {inner!r}")
    AttentionInterface.register(CP_ATTENTION, _cp_attention)
    for layer in decoder_of(model).layers:
        attention = getattr(layer, "self_attn", None)
        if attention is not None:
            setattr(attention, _CP_GROUP_ATTR, group)
            setattr(attention, _CP_INNER_ATTR, _inner_attention(attention, inner))
    try:
        model.set_attn_implementation(CP_ATTENTION)
    except (ValueError, AttributeError, KeyError):
        # Older releases validate the name against their own list; the config field is what attention reads.
        model.config._attn_implementation = CP_ATTENTION


def _additive_mask(
    documents: torch.Tensor,
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    *,
    dtype: torch.dtype,
    sliding_window: int | None,
) -> torch.Tensor:
    """Additive mask [batch, 1, query, key] for queries/keys at the given GLOBAL sequence indices.

    documents [batch, padded_sequence]: 1-based document index per global position, 0 = padding. Same
    rule as `meshkd.packing.indexed_to_additive_mask`: same nonzero document and key not after the query
    (within the sliding window when set); a query always sees itself, so no row is fully masked.
    """
    query_documents = documents[:, query_index, None]  # [batch, query, 1]
    key_documents = documents[:, None, key_index]  # [batch, 1, key]
    distance = query_index[:, None] - key_index[None, :]  # [query, key]
    visible = distance >= 0
    if sliding_window is not None:
        visible &= distance < sliding_window
    allowed = (query_documents == key_documents) & (query_documents != 0) & visible
    allowed |= distance == 0
    additive = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=documents.device)
    return additive.masked_fill_(allowed, 0.0)[:, None]


def _padded_length(length: int, cp_size: int) -> int:
    """The sequence length rounded up to a multiple of 2 * cp_size (head-tail sharding needs equal chunks)."""
    return math.ceil(length / (2 * cp_size)) * (2 * cp_size)


def _positions_and_documents(batch: dict, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's position_ids and document indices, defaulting to one document per row in order."""
    batch_size, length = input_ids.shape
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(batch_size, length)
    documents = batch.get("attention_mask")
    if documents is None:
        documents = torch.ones_like(input_ids)
    return position_ids, documents


def _pad_and_shard(tensor: torch.Tensor, *, cp_size: int, cp_rank: int, value: float = 0) -> torch.Tensor:
    """`tensor` [batch, sequence, ...] padded on dim 1 with `value`, then this cp rank's head-tail share."""
    pad = _padded_length(tensor.shape[1], cp_size) - tensor.shape[1]
    if pad:
        shape = (tensor.shape[0], pad, *tensor.shape[2:])
        tensor = torch.cat([tensor, tensor.new_full(shape, value)], dim=1)
    return cp_shard(tensor, cp_size=cp_size, cp_rank=cp_rank, dim=1)


def _cp_mask(
    documents: torch.Tensor, *, cp_size: int, cp_rank: int, dtype: torch.dtype, windows: dict[str, int | None]
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive masks [batch, 1, local_sequence, padded_sequence] of one cp rank's queries against all keys.

    documents [batch, padded_sequence]: document indices of the whole padded sequence in original order.
    Queries are this rank's head-tail positions; keys follow the order in which `_cp_attention` gathers
    them (cp rank 0's share, then rank 1's, ...). With cp_size 1 it is the ordinary packed mask. One mask
    per attention kind of `windows` (`meshkd.packing.attention_windows`), as `masks_for_layers` returns them.
    """
    from meshkd.packing import masks_for_layers

    index = torch.arange(documents.shape[1], device=documents.device)
    if cp_size == 1:
        query_index = key_index = index
    else:
        query_index = cp_shard(index, cp_size=cp_size, cp_rank=cp_rank, dim=0)
        key_index = torch.cat([cp_shard(index, cp_size=cp_size, cp_rank=r, dim=0) for r in range(cp_size)])
    return masks_for_layers(windows, lambda window: _additive_mask(
        documents, query_index, key_index, dtype=dtype, sliding_window=window
    ))


# ---------------------------------------------------------------------------------------------------------
# Student context parallel


@dataclass(frozen=True)
class StudentShard:
    """Where a cp rank's local batch sits in the global sequence (returned by `shard_student_batch`)."""

    sequence_length: int
    """Unpadded global sequence length."""
    padded_length: int
    """Global length after padding to a multiple of 2 * cp_size (equal to `sequence_length` without CP)."""
    cp_size: int
    cp_rank: int

    def global_positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[local_sequence] global sequence index of each local position (>= sequence_length: padding)."""
        index = torch.arange(self.padded_length, device=device)
        return cp_shard(index, cp_size=self.cp_size, cp_rank=self.cp_rank, dim=0) if self.cp_size > 1 else index


def _cp_coordinate(setup: DistributedSetup) -> tuple[int, int]:
    if setup.cp_size == 1:
        return 1, 0
    return setup.cp_size, _member_mesh(setup).get_local_rank("cp")


def _shard_batch(
    batch: dict[str, Any], *, cp_size: int, cp_rank: int, ignore_index: int = -100
) -> tuple[dict[str, Any], StudentShard]:
    input_ids = batch["input_ids"]
    batch_size, length = input_ids.shape
    info = StudentShard(length, _padded_length(length, cp_size) if cp_size > 1 else length, cp_size, cp_rank)
    if cp_size == 1:
        return dict(batch), info
    position_ids, documents = _positions_and_documents(batch, input_ids)
    local = dict(batch)
    # Padding is document 0 (attends to itself only, seen by nobody) and its labels are ignored.
    sharded = {"input_ids": (input_ids, 0), "position_ids": (position_ids, 0), "attention_mask": (documents, 0)}
    if batch.get("labels") is not None:
        sharded["labels"] = (batch["labels"], ignore_index)
    for key, (tensor, value) in sharded.items():
        if tuple(tensor.shape) != (batch_size, length):
            raise ValueError(f"batch[{key!r}] has shape {tuple(tensor.shape)}; expected {(batch_size, length)}")
        local[key] = _pad_and_shard(tensor, cp_size=cp_size, cp_rank=cp_rank, value=value)
    return local, info


def shard_student_batch(
    batch: dict[str, Any], setup: DistributedSetup, *, ignore_index: int = -100
) -> tuple[dict[str, Any], StudentShard]:
    """This cp rank's share of a student micro-batch; the batch itself when cp_size is 1.

    Args:
        batch: `input_ids` [batch, sequence]; optional `labels` (aligned with the positions),
            `position_ids` (default 0..sequence-1) and `attention_mask` (NEAT document indices, 0 =
            padding; default one document). Every cp rank of a replica passes the same batch.
        setup: the student's setup (this rank must be a member when cp_size > 1).
        ignore_index: label given to padding positions.

    Returns:
        (local batch, `StudentShard`). The sequence is padded to a multiple of 2 * cp_size (input 0,
        label `ignore_index`, position 0, document 0) and the four tensors above are cut to this rank's
        head-tail share [batch, padded_sequence / cp_size]; other entries are passed through untouched.
        The local `attention_mask` holds only the local document indices: the model's mask hook gathers
        the others over `cp`, so every cp rank must run the forward.
    """
    cp_size, cp_rank = _cp_coordinate(setup)
    return _shard_batch(batch, cp_size=cp_size, cp_rank=cp_rank, ignore_index=ignore_index)


def shard_teacher_logits(logits: torch.Tensor, setup: DistributedSetup) -> torch.Tensor:
    """Full teacher logits [batch, sequence, vocab] cut like `shard_student_batch` cuts the student's batch.

    Returns [batch, padded_sequence / cp_size, vocab] (padding rows are zeros; their labels are ignored),
    so position i of the local teacher logits is the teacher's distribution for the student's local
    position i. Any [batch, sequence, ...] tensor (e.g. a top-k encoding's parts) is cut the same way.
    Returns `logits` itself when cp_size is 1.
    """
    cp_size, cp_rank = _cp_coordinate(setup)
    if cp_size == 1:
        return logits
    if logits.dim() < 2:
        raise ValueError(f"expected teacher logits [batch, sequence, ...], got shape {tuple(logits.shape)}")
    return _pad_and_shard(logits, cp_size=cp_size, cp_rank=cp_rank)


def flatten_student_cp_axes(setup: DistributedSetup) -> None:
    """Create the student's `STUDENT_CP_AXIS` (dp_shard x cp) view; every WORLD rank must call this.

    Needed before `parallelize_student` when cp_size > 1 and the student does not span the whole world
    (separate meshes): the process groups behind a flattened axis are created collectively over the
    whole world, and teacher-only ranks never call `parallelize_student`. Non-members make the same
    group-creation calls from the mesh layout (as `meshkd.topology` does for `dp`). Calling it again, or
    with cp_size 1, does nothing.
    """
    mesh = setup.device_mesh
    if mesh is None:
        raise ValueError("flatten_student_cp_axes needs a built setup (create_kd_distributed_setups)")
    if setup.cp_size == 1 or getattr(mesh, _FLATTENED_ATTR, False):
        return
    flatten_axes(mesh, ("dp_shard", "cp"), STUDENT_CP_AXIS)
    setattr(mesh, _FLATTENED_ATTR, True)


def _check_student_cp(model: nn.Module, setup: DistributedSetup) -> None:
    """Validate a cp_size > 1 student before anything changes; creates the flattened axis when possible."""
    from meshkd.packing import NEAT_INDEXED, packing_layout

    if setup.strategy == "ddp":
        raise ValueError(f"strategy 'ddp' with cp_size({setup.cp_size}) > 1 is not supported; use fsdp2")
    if packing_layout(model) != NEAT_INDEXED:
        raise ValueError(
            f"cp_size({setup.cp_size}) > 1 reads the student's attention_mask as NEAT document indices: call "
            f"meshkd.packing.configure_packing(model) before parallelize_student"
        )
    _ensure_student_cp_axis(setup)


def _ensure_student_cp_axis(setup: DistributedSetup) -> None:
    """The flattened `STUDENT_CP_AXIS`: created here when the student spans the world, else it must exist."""
    if not getattr(setup.device_mesh, _FLATTENED_ATTR, False):
        if setup.world_size != dist.get_world_size():
            raise ValueError(
                f"the student spans {setup.world_size} of {dist.get_world_size()} ranks: call "
                f"flatten_student_cp_axes(setup) on every rank of the world before laying out the student"
            )
        flatten_student_cp_axes(setup)  # every rank is a student here, so every rank takes part


class _StudentCPMaskHook:
    """Forward pre-hook: local NEAT `attention_mask` [batch, local_sequence] -> 4D cp mask (`_cp_mask`).

    The document indices of the other cp ranks are all-gathered over `cp`, so the whole padded sequence is
    known; registered ahead of `configure_packing`'s hook, which then sees a 4D mask and lets it pass.
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup,
        cp_size: int,
        cp_rank: int,
        windows: dict[str, int | None],
        positions: dict[str, int],
    ):
        self.group = group
        self.cp_size = cp_size
        self.cp_rank = cp_rank
        self.windows = windows
        self.positions = positions

    def _argument(self, args: tuple, kwargs: dict, name: str) -> Any:
        from meshkd.packing import forward_argument

        return forward_argument(args, kwargs, self.positions, name)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        from meshkd.packing import _compute_dtype

        mask = self._argument(args, kwargs, "attention_mask")
        if isinstance(mask, dict) or (isinstance(mask, torch.Tensor) and mask.dim() == 4):
            return None  # already converted by an outer module's hook
        inputs = self._argument(args, kwargs, "input_ids")
        embeds = self._argument(args, kwargs, "inputs_embeds")
        reference = inputs if isinstance(inputs, torch.Tensor) else embeds
        if not isinstance(reference, torch.Tensor):
            return None
        batch_size, local_length = reference.shape[:2]
        if mask is None:
            mask = torch.ones(batch_size, local_length, dtype=torch.int64, device=reference.device)
        if tuple(mask.shape) != (batch_size, local_length):
            raise ValueError(
                f"context-parallel student: attention_mask {tuple(mask.shape)} must be this rank's share "
                f"{(batch_size, local_length)} of the sequence; shard the batch with shard_student_batch"
            )
        documents = _gather_documents(mask, self.group, self.cp_size)
        if isinstance(embeds, torch.Tensor) and embeds.is_floating_point():
            dtype = embeds.dtype
        else:
            dtype = _compute_dtype(module, reference.device)
        converted = _cp_mask(
            documents, cp_size=self.cp_size, cp_rank=self.cp_rank, dtype=dtype, windows=self.windows
        )
        index = self.positions.get("attention_mask")
        if "attention_mask" in kwargs or index is None or index >= len(args):
            return args, {**kwargs, "attention_mask": converted}
        return (*args[:index], converted, *args[index + 1 :]), kwargs


def _enable_student_cp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Gathered-K/V attention with a differentiable gather, and the cp mask hook on the model."""
    from meshkd.packing import _forward_positions, attention_windows

    # Read before the attention implementation changes: the check knows sdpa/eager only.
    windows = attention_windows(model.config, model)
    group = mesh.get_group("cp")
    _enable_cp_attention(model, group)
    cp_size = mesh.size(mesh.mesh_dim_names.index("cp"))
    options = dict(group=group, cp_size=cp_size, cp_rank=mesh.get_local_rank("cp"), windows=windows)
    # The inner decoder too, so that calling it directly works; prepend so the packing hook sees 4D.
    for module in (model, decoder_of(model)):
        positions, _ = _forward_positions(module)
        module.register_forward_pre_hook(
            _StudentCPMaskHook(positions=positions, **options), with_kwargs=True, prepend=True
        )


# ---------------------------------------------------------------------------------------------------------
# Teacher


class TeacherRunner:
    """Forward-only teacher over its `DistributedSetup`: pipeline split, TP, CP; full logits out.

    Construction changes `model` in place (the pipeline split of `meshkd.stages.ModelStage`, TP by the
    model's own plan, the CP attention selected) and puts it in eval mode. The model's own forward runs on
    every stage. `logits(batch)` must be called by every rank of the teacher replica with the same batch
    (on pipeline stages after the first the batch is not read and may be None: inputs travel with the
    activations).

    Batch: `input_ids` [batch, sequence]; optional `position_ids` [batch, sequence] (restarting per
    document for NEAT packing; default 0..sequence-1) and `attention_mask` [batch, sequence] (1-based
    document index, 0 = padding; an ordinary 0/1 mask is the one-document case). Other keys are ignored.

    The model must use sdpa or eager attention (the runner hands the model prepared 4D masks, one per
    attention kind of its layers; under CP the gathered-K/V attention calls the model's own attention).
    Teacher weights are replicated across dp: no FSDP here. `is_first` / `is_last` tell whether this rank
    holds the first / last pipeline stage.
    """

    def __init__(self, model: nn.Module, setup: DistributedSetup, *, device: torch.device | str):
        from meshkd.packing import attention_windows

        mesh = _member_mesh(setup)
        self.setup = setup
        self.device = torch.device(device)
        self.mesh = mesh
        self.windows = attention_windows(model.config, model)

        self.pp_size = setup.pp_size
        self.pp_rank = mesh.get_local_rank("pp")
        self.pp_group = mesh.get_group("pp") if self.pp_size > 1 else None
        self.cp_size = setup.cp_size
        self.cp_rank = mesh.get_local_rank("cp")
        # Pipeline split first, so TP only touches what this stage keeps.
        self.stage = ModelStage(model, pp_size=self.pp_size, pp_rank=self.pp_rank)
        self.is_first, self.is_last = self.stage.is_first, self.stage.is_last
        if not is_empty(model):  # else `load_shards` gives it storage on the device once laid out
            model.to(self.device)
        if setup.tp_size > 1:
            apply_tensor_parallel(model, mesh["tp"], expert_parallel=setup.ep_size > 1)
        if self.cp_size > 1:
            _enable_cp_attention(model, mesh.get_group("cp"))
        model.eval()
        self.model = model
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())

    # -- inputs ----------------------------------------------------------------------------------------

    def _prepare(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(local input_ids, local position_ids, padded documents [batch, padded_sequence], sequence length)."""
        input_ids = batch["input_ids"].to(self.device)
        length = input_ids.shape[1]
        position_ids, documents = _positions_and_documents(batch, input_ids)
        position_ids, documents = position_ids.to(self.device).long(), documents.to(self.device).long()
        if self.cp_size > 1:
            # Head-tail sharding needs 2 * cp equal chunks; padding is document 0, so nothing attends to it.
            shard = dict(cp_size=self.cp_size, cp_rank=self.cp_rank)
            input_ids, position_ids = _pad_and_shard(input_ids, **shard), _pad_and_shard(position_ids, **shard)
            documents = nn.functional.pad(documents, (0, _padded_length(length, self.cp_size) - length))
        return input_ids, position_ids, documents, length

    # -- pipeline transport ----------------------------------------------------------------------------

    def _send(self, meta: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        peer = self.pp_rank + 1
        dist.send(meta, group_dst=peer, group=self.pp_group)
        for tensor in tensors:
            dist.send(tensor.contiguous(), group_dst=peer, group=self.pp_group)

    def _send_error(self) -> None:
        self._send(torch.zeros(_META_LENGTH, dtype=torch.int64, device=self.device), [])

    def _receive(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(hidden, local position_ids, padded documents, sequence length) from the previous stage.

        The shapes come first on every call: sequence lengths may change from batch to batch.
        """
        peer = self.pp_rank - 1
        meta = torch.empty(_META_LENGTH, dtype=torch.int64, device=self.device)
        dist.recv(meta, group_src=peer, group=self.pp_group)
        ok, batch_size, local_length, hidden_size, padded_length, length, dtype_index = meta.tolist()
        if not ok:
            if not self.is_last:
                self._send_error()  # pass the failure down so later stages do not wait forever
            raise RuntimeError(f"pipeline stage {peer} failed on this batch; see its error")
        hidden = torch.empty(batch_size, local_length, hidden_size, dtype=_WIRE_DTYPES[dtype_index], device=self.device)
        position_ids = torch.empty(batch_size, local_length, dtype=torch.int64, device=self.device)
        documents = torch.empty(batch_size, padded_length, dtype=torch.int64, device=self.device)
        for tensor in (hidden, position_ids, documents):
            dist.recv(tensor, group_src=peer, group=self.pp_group)
        return hidden, position_ids, documents, length

    # -- forward ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, batch: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        """Full teacher logits [batch, sequence, vocab] on every rank of the last stage; None elsewhere.

        The result is identical on all tp and cp ranks of the last stage (gathered over both).
        """
        try:
            if self.is_first:
                if batch is None:
                    raise ValueError("TeacherRunner.logits needs the batch on the first pipeline stage")
                inputs, position_ids, documents, length = self._prepare(batch)
            else:
                inputs, position_ids, documents, length = self._receive()
            masks = _cp_mask(documents, cp_size=self.cp_size, cp_rank=self.cp_rank, dtype=self.dtype,
                             windows=self.windows)
            output = self.stage.run(inputs, attention_mask=masks, position_ids=position_ids)
        except BaseException:
            if not self.is_last:
                self._send_error()
            raise
        if not self.is_last:
            meta = torch.tensor(
                [1, *output.shape, documents.shape[1], length, _WIRE_DTYPES.index(output.dtype)],
                dtype=torch.int64,
                device=self.device,
            )
            self._send(meta, [output, position_ids, documents])
            return None
        return materialize_teacher_logits(output, self.mesh, length)

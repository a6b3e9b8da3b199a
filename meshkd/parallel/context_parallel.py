"""Context parallel: head-tail sequence shards, K/V gathered over `cp`, the model's own attention after.

Every cp rank holds the head-tail share of the sequence (2 * cp chunks, rank r keeping chunks r and
2cp-1-r, so causal work is balanced). The attention gathers K/V over `cp` (differentiably when autograd
records: the backward sums the K/V gradient over cp and hands each rank the piece for its own keys/values,
a reduce-scatter), then calls the attention function the model was loaded with (sdpa, flex attention, or
the family's eager function with its soft-capping or attention sinks). It is registered with transformers'
`AttentionInterface` and selected on one instance's config only; it runs on the CPU, where torch's ring
attention does not. Masks are built from GLOBAL positions of NEAT document indices
(`meshkd.core.masks.layer_masks`: additive tensors, or BlockMasks whose tiles follow the gathered key
order), so document boundaries and sliding windows hold across shards.

Student: `shard_student_batch` / `shard_teacher_logits` cut a micro-batch and its teacher logits; the
model's packing hook (`meshkd.core.packing.enable_cp_masks`) all-gathers the local document indices over
`cp` and builds the masks. Parameters are
replicated over cp yet each cp rank sees only part of the tokens, so their gradients must be SUMMED over
cp: FSDP2 shards over the flattened (dp_shard, cp) axis `STUDENT_CP_AXIS` (as torchtitan does), which
averages, hence `meshkd.parallel.data_parallel.student_loss_scale`. The teacher (`TeacherRunner`) pads and
shards its own inputs with the same functions.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshkd.core.logits import cp_shard, pad_and_shard, padded_length
from meshkd.core.masks import SUPPORTED_ATTENTION, positions_and_documents
from meshkd.core.packing import NEAT_INDEXED, enable_cp_masks, packing_layout
from meshkd.core.topology import DistributedSetup, flatten_axes, member_mesh
from meshkd.parallel.stages import decoder_of

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
    `attention_mask` [batch, 1, local_sequence, cp * local_sequence] (additive, or a BlockMask for flex
    attention) has its keys in the gathered order; it already encodes causality, sliding windows and
    document boundaries in global positions (`meshkd.core.masks.layer_masks`). The gathered keys/values then
    go to the attention function the model was loaded with (sdpa, flex, or the family's own eager function
    with its soft-capping or attention sinks). When autograd records (the student in training) the gather
    is differentiable (`_GatherSequence`): its backward sums every rank's gradient for this rank's
    keys/values and hands it back here.
    """
    group = getattr(module, _CP_GROUP_ATTR, None)
    if group is None:
        raise RuntimeError(
            f"attention {CP_ATTENTION!r} used on a module without a cp group; use TeacherRunner or parallelize_student"
        )
    if attention_mask is None or len(attention_mask.shape) != 4:  # a 4D tensor or a FlexAttention BlockMask
        raise RuntimeError(
            f"attention {CP_ATTENTION!r} needs the 4D global-position mask built by TeacherRunner, "
            f"StudentPipeline or the packing hook of a model laid out by parallelize_student"
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


def enable_cp_attention(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Select the gathered-K/V attention on this instance only (its config), with `group` on its modules."""
    from transformers import AttentionInterface

    inner = model.config._attn_implementation
    if inner == CP_ATTENTION:
        raise ValueError("context parallel is already enabled on this model")
    if inner not in SUPPORTED_ATTENTION:
        raise ValueError(f"context parallel needs attn_implementation in {SUPPORTED_ATTENTION}, got {inner!r}")
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
    return setup.cp_size, member_mesh(setup).get_local_rank("cp")


def _shard_batch(
    batch: dict[str, Any], *, cp_size: int, cp_rank: int, ignore_index: int = -100
) -> tuple[dict[str, Any], StudentShard]:
    input_ids = batch["input_ids"]
    batch_size, length = input_ids.shape
    info = StudentShard(length, padded_length(length, cp_size) if cp_size > 1 else length, cp_size, cp_rank)
    if cp_size == 1:
        return dict(batch), info
    position_ids, documents = positions_and_documents(batch, input_ids)
    local = dict(batch)
    # Padding is document 0 (attends to itself only, seen by nobody) and its labels are ignored.
    sharded = {"input_ids": (input_ids, 0), "position_ids": (position_ids, 0), "attention_mask": (documents, 0)}
    if batch.get("labels") is not None:
        sharded["labels"] = (batch["labels"], ignore_index)
    for key, (tensor, value) in sharded.items():
        if tuple(tensor.shape) != (batch_size, length):
            raise ValueError(f"batch[{key!r}] has shape {tuple(tensor.shape)}; expected {(batch_size, length)}")
        local[key] = pad_and_shard(tensor, cp_size=cp_size, cp_rank=cp_rank, value=value)
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
        The local `attention_mask` holds only the local document indices: the model's packing hook
        (`meshkd.core.packing.enable_cp_masks`) gathers the others over `cp`, so every cp rank must run
        the forward.
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
    return pad_and_shard(logits, cp_size=cp_size, cp_rank=cp_rank)


def flatten_student_cp_axes(setup: DistributedSetup) -> None:
    """Create the student's `STUDENT_CP_AXIS` (dp_shard x cp) view; every WORLD rank must call this.

    Needed before `parallelize_student` when cp_size > 1 and the student does not span the whole world
    (separate meshes): the process groups behind a flattened axis are created collectively over the
    whole world, and teacher-only ranks never call `parallelize_student`. Non-members make the same
    group-creation calls from the mesh layout (as `meshkd.core.topology` does for `dp`). Calling it again, or
    with cp_size 1, does nothing.
    """
    mesh = setup.device_mesh
    if mesh is None:
        raise ValueError("flatten_student_cp_axes needs a built setup (create_kd_distributed_setups)")
    if setup.cp_size == 1 or getattr(mesh, _FLATTENED_ATTR, False):
        return
    flatten_axes(mesh, ("dp_shard", "cp"), STUDENT_CP_AXIS, timeout=setup.collective_timeout)
    setattr(mesh, _FLATTENED_ATTR, True)


def check_student_cp(model: nn.Module, setup: DistributedSetup) -> None:
    """Validate a cp_size > 1 student before anything changes; creates the flattened axis when possible."""

    if setup.strategy == "ddp":
        raise ValueError(f"strategy 'ddp' with cp_size({setup.cp_size}) > 1 is not supported; use fsdp2")
    if packing_layout(model) != NEAT_INDEXED:
        raise ValueError(
            f"cp_size({setup.cp_size}) > 1 reads the student's attention_mask as NEAT document indices: call "
            f"meshkd.core.packing.configure_packing(model) before parallelize_student"
        )
    ensure_student_cp_axis(setup)


def ensure_student_cp_axis(setup: DistributedSetup) -> None:
    """The flattened `STUDENT_CP_AXIS`: created here when the student spans the world, else it must exist."""
    if not getattr(setup.device_mesh, _FLATTENED_ATTR, False):
        if setup.world_size != dist.get_world_size():
            raise ValueError(
                f"the student spans {setup.world_size} of {dist.get_world_size()} ranks: call "
                f"flatten_student_cp_axes(setup) on every rank of the world before laying out the student"
            )
        flatten_student_cp_axes(setup)  # every rank is a student here, so every rank takes part


def enable_student_cp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Gathered-K/V attention with a differentiable gather, and the packing hooks' masks made for cp."""
    group = mesh.get_group("cp")
    cp_size = mesh.size(mesh.mesh_dim_names.index("cp"))
    enable_cp_masks(model, group, cp_size=cp_size, cp_rank=mesh.get_local_rank("cp"))
    enable_cp_attention(model, group)

"""Teacher logits materialization: from TP/CP-sharded pieces to full [batch, sequence, vocab] logits.

Under context parallelism the sequence is sharded with torch's head-tail load balancing: the padded
sequence is cut into 2 * cp chunks and cp rank r holds chunks r and 2 * cp - 1 - r, head chunk first
(every rank gets an equal share of the causal attention work). `cp_shard` / `cp_unshard` implement that
layout for any tensor; `materialize_teacher_logits` gathers the vocabulary across TP (DTensor), then the
sequence across CP, and restores the original order.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def cp_chunk_order(cp_size: int) -> list[int]:
    """Chunk indices in the order the cp ranks hold them: rank r holds positions 2r and 2r + 1."""
    return [chunk for rank in range(cp_size) for chunk in (rank, 2 * cp_size - 1 - rank)]


def cp_shard(tensor: torch.Tensor, *, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """The head-tail share of cp rank `cp_rank` along `dim` (its size must divide by 2 * cp_size)."""
    length = tensor.shape[dim]
    if length % (2 * cp_size):
        raise ValueError(f"sequence length {length} is not divisible by 2 * cp_size = {2 * cp_size}; pad it first")
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def padded_length(length: int, cp_size: int) -> int:
    """The sequence length rounded up to a multiple of 2 * cp_size (head-tail sharding needs equal chunks)."""
    return math.ceil(length / (2 * cp_size)) * (2 * cp_size)


def pad_and_shard(tensor: torch.Tensor, *, cp_size: int, cp_rank: int, value: float = 0) -> torch.Tensor:
    """`tensor` [batch, sequence, ...] padded on dim 1 with `value`, then this cp rank's head-tail share."""
    pad = padded_length(tensor.shape[1], cp_size) - tensor.shape[1]
    if pad:
        shape = (tensor.shape[0], pad, *tensor.shape[2:])
        tensor = torch.cat([tensor, tensor.new_full(shape, value)], dim=1)
    return cp_shard(tensor, cp_size=cp_size, cp_rank=cp_rank, dim=1)


def cp_unshard(shards: list[torch.Tensor], *, dim: int = 1) -> torch.Tensor:
    """Inverse of `cp_shard`: the shards of cp ranks 0..cp-1 back in original sequence order."""
    cp_size = len(shards)
    pieces = [piece for shard in shards for piece in shard.chunk(2, dim=dim)]
    ordered = [None] * (2 * cp_size)
    for position, chunk in enumerate(cp_chunk_order(cp_size)):
        ordered[chunk] = pieces[position]
    return torch.cat(ordered, dim=dim)


def _axis_size(mesh: DeviceMesh, axis: str) -> int:
    names = mesh.mesh_dim_names or ()
    return mesh.size(names.index(axis)) if axis in names else 1


def materialize_teacher_logits(logits: torch.Tensor, device_mesh: DeviceMesh, sequence_length: int) -> torch.Tensor:
    """Reconstruct full teacher logits across TP and CP before mesh transport.

    Args:
        logits: [batch, sequence, vocab] teacher logits: a vocabulary-sharded DTensor (Shard(-1)) and/or,
            under CP, this rank's head-tail share [batch, local_sequence, ...] of the padded sequence.
        device_mesh: the teacher mesh; its optional `tp` and `cp` axes are used.
        sequence_length: the unpadded global sequence length to keep.

    Returns:
        [batch, sequence_length, vocab], detached and contiguous, identical on every rank of the replica.
    """
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    logits = logits.detach()
    cp_size = _axis_size(device_mesh, "cp")
    if cp_size > 1:
        group = device_mesh.get_group("cp")
        shards = [torch.empty_like(logits) for _ in range(cp_size)]
        dist.all_gather(shards, logits.contiguous(), group=group)
        logits = cp_unshard(shards, dim=1)
    if logits.shape[1] < sequence_length:
        raise ValueError(f"logits hold {logits.shape[1]} positions, fewer than sequence_length {sequence_length}")
    return logits[:, :sequence_length].contiguous()

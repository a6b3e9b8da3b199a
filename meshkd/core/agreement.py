"""Agreement across ranks: every member learns every member's small value, or the first failure, alike.

The rule of every multi-rank step in meshkd is that no peer is ever left blocked: ranks first agree on a
status, then all raise or all go on. Two collective steps need that as a step of its own, and use this
module: `meshkd.recipe.common.faults` (a setup phase that failed on some ranks: `first_failure`) and
`meshkd.core.packing` (both roles' packing layouts: `gather_values`). Values travel as `meshkd.core.wire`
JSON specs, so nothing is unpickled across roles. Transfers whose status rides with the data (the bridge's
error specs, the stage broadcasts' headers, the teacher pipeline's shape metadata) carry it inline
instead: one collective fewer per value.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshkd.core import wire


def group_device(group: dist.ProcessGroup) -> torch.device:
    """Where tensors for `group`'s collectives must live: NCCL only moves CUDA memory, gloo moves host memory."""
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Bytes of a failure message the other ranks receive (longer ones are cut).
MESSAGE_BYTES = 2048


def gather_values(value: Any, group: dist.ProcessGroup | None = None, *,
                  device: torch.device | str = "cpu") -> list[Any]:
    """Every member's `value` in group-rank order; all members must call.

    `value`: nested dicts, lists, tuples and scalars (int, float, str, bool, None), no tensors. Two
    all-gathers: the lengths, then the JSON documents padded to the longest.
    """
    tensors: list[torch.Tensor] = []
    spec = wire.tree_spec(value, tensors)
    if tensors:
        raise TypeError("gather_values takes scalars and containers only, not tensors")
    document = wire.encode_spec(spec).to(device)
    size = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([document.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(length) for length in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: document.numel()] = document
    documents = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    dist.all_gather(documents, padded, group=group)
    return [wire.tree_from_spec(wire.decode_spec(data[: int(length)]), [])
            for data, length in zip(documents, lengths)]


def first_failure(message: str | None, group: dist.ProcessGroup | None = None, *,
                  device: torch.device | str = "cpu") -> tuple[int, str] | None:
    """(global rank, message) of the lowest member whose `message` is not None, as every member learns it.

    None when no member failed: then it costs one all-reduce. All members must call.
    """
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    beyond = max(ranks) + 1
    rank = dist.get_rank()
    first = torch.tensor([rank if message is not None else beyond], dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    origin = int(first.item())
    if origin == beyond:
        return None
    text = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=device)
    if rank == origin:
        encoded = message.encode()[:MESSAGE_BYTES]
        if encoded:
            text[: len(encoded)] = wire.bytes_tensor(encoded).to(device)
    dist.broadcast(text, src=origin, group=group)
    return origin, bytes(text.cpu().tolist()).rstrip(b"\0").decode(errors="replace")

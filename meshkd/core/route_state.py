"""What each end of a bridge route keeps between calls (`meshkd.core.bridge`): the last spec, and on the CPU
the transfer buffers it reuses.
"""

from __future__ import annotations

from typing import Any

import torch

from meshkd.core import wire

# Consecutive repeats of a route's spec after which the header and the data travel together (see
# `KDMeshBridge._broadcast_tree`). Two, not one: a spec that alternates in pairs (A A B B) never pays for a
# filler transfer, and a changed spec pays at most one filler per three calls.
_SPECULATE_AFTER = 2


class RouteState:
    """What both ends of a route know about its last spec: the sender its JSON document, receivers the
    decoded spec and leaves; both the data size and how many times in a row the spec has repeated."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        self.document: bytes | None = None
        self.spec: Any = None
        self.leaves: list = []
        self.nbytes = 0
        self.repeats = 0
        self.inband = False

    def remember(self, document: bytes | None, spec: Any, nbytes: int, *, num_leaves: int) -> None:
        self.document, self.spec, self.nbytes, self.repeats = document, spec, nbytes, 0
        self.leaves = wire.leaf_specs(spec) if spec is not None else []
        # Several leaves are packed by a copy anyway, so the header word can ride in the same buffer; a
        # single leaf travels from its own memory, so the word goes alongside it instead.
        self.inband = num_leaves > 1

    @property
    def speculating(self) -> bool:
        return self.repeats >= _SPECULATE_AFTER and self.nbytes > 0


class BufferPool:
    """Reusable CPU transfer buffers of one route.

    Why: a fresh buffer of N bytes costs N / 4096 page faults and the kernel's zeroing on first touch, which
    on the CPU is as slow as the transfer itself at large sizes. A receive buffer is handed out as the
    storage of the received tensors, so it is reused only once the caller has dropped every tensor that
    views it (the storage's reference count is 1: the pool's own). At most `capacity` buffers are kept (the
    double-buffered loop holds two received values and receives a third). CUDA needs none of this: its
    caching allocator reuses memory already.
    """

    def __init__(self, capacity: int = 3) -> None:
        self.capacity = capacity
        self._storages: list[torch.UntypedStorage] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 CPU tensor of `nbytes`, on a storage no one else references."""
        # The storage's use count (torch's own cudagraph trees reuse outputs the same way): tensors and
        # Python storage objects that refer to it each hold one reference; the pool's object is the one.
        for storage in self._storages:
            if storage.nbytes() == nbytes and torch._C._storage_Use_Count(storage._cdata) == 1:
                break
        else:
            storage = torch.UntypedStorage(nbytes)
            self._storages = [storage, *self._storages[: self.capacity - 1]]
        return torch.empty(0, dtype=torch.uint8).set_(storage)

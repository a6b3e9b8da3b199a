"""Where the tensors given to torch.distributed's collectives live, checked in a running world.

An NCCL group takes device tensors only, so every tensor a collective sees must be on the device of the
caller's role. On the CPU the role's device is the CPU and a misplaced tensor cannot show; the checks
therefore also run code with the device it claims set to "meta" and the collectives not forwarded
(`forward=False`): a tensor made on the CPU regardless of that device is then found.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch.distributed's tensor collectives, by the argument positions that hold tensors or lists of them.
_TENSOR_ARGS = {
    "broadcast": (0,), "all_reduce": (0,), "reduce": (0,), "all_gather": (0, 1), "all_gather_into_tensor": (0, 1),
    "reduce_scatter": (0, 1), "reduce_scatter_tensor": (0, 1), "all_to_all_single": (0, 1), "gather": (0, 1),
    "scatter": (0, 1), "send": (0,), "recv": (0,), "isend": (0,), "irecv": (0,),
}
_OTHER = ("barrier", "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")


@dataclass(frozen=True)
class Call:
    """One collective call: its name, its group (None: the default group) and the calling thread."""

    name: str
    group: object
    thread: int


class _Done:
    """What an async collective returns when it is not forwarded."""

    def wait(self, timeout=None) -> bool:
        return True


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


@contextlib.contextmanager
def audited_collectives(device: torch.device | str | None, *, forward: bool = True) -> Iterator[list[Call]]:
    """Patch torch.distributed's collectives for the block; yields the list of calls seen, in order.

    `device`: every tensor given to a collective must be on it (AssertionError naming the collective and
    the tensor's device otherwise); None records without checking. `forward=False`: the calls are recorded
    and checked but not run (for code run with a device the collectives cannot use).
    """
    expected = None if device is None else torch.device(device)
    calls: list[Call] = []
    originals = {name: getattr(dist, name) for name in (*_TENSOR_ARGS, *_OTHER)}

    def audited(name: str):
        original = originals[name]

        def call(*args, **kwargs):
            calls.append(Call(name, kwargs.get("group"), threading.get_ident()))
            given = [args[position] for position in _TENSOR_ARGS.get(name, ()) if position < len(args)]
            for value in [*given, *kwargs.values()]:
                for tensor in _tensors(value):
                    assert expected is None or tensor.device == expected, (
                        f"{name} was given a tensor on {tensor.device}, expected {expected}"
                    )
            if not forward:
                return _Done() if kwargs.get("async_op") else None
            return original(*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, audited(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)

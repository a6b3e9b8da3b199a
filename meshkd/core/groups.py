"""Process groups: which of the groups meshkd creates wait blocking under NCCL, and the timeout they all get.

Design. Two kinds of group, told apart when they are created, because ProcessGroupNCCL reads
TORCH_NCCL_BLOCKING_WAIT once, in its constructor, for that group alone:

- Groups meshkd itself waits on (the world group its agreements and stop flag use, the patient set-up
  group of `meshkd.recipe.common.faults`, the bridge's control, role and route groups): created inside
  `blocking_wait()`, so a wait that outlasts the group's timeout (or meets an aborted communicator) raises
  DistBackendError in the waiting thread, which `meshkd.recipe.common.faults.FaultWatch` names as a lost peer.
- The DeviceMesh groups FSDP2, tp, cp and pp use (`meshkd.core.topology`): created outside it, so their
  waits only order CUDA streams and FSDP2 overlaps its all-gathers and reduce-scatters with compute; a
  collective there that outlasts its timeout is ended by torch's watchdog. They get the run's collective
  timeout through `mesh_backend_override` (DeviceMesh passes no timeout of its own to `new_group`, which
  then takes torch's default: 10 min for NCCL, 30 for gloo).

`blocking_wait` sets the variable only while it is open and only under NCCL, and never where the user set
TORCH_NCCL_BLOCKING_WAIT or its legacy name NCCL_BLOCKING_WAIT: then the user's value holds for every group.
gloo needs neither: it raises in the collective that lost its peer.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Sequence

import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

BLOCKING_WAIT_ENV = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")
"""The variables ProcessGroupNCCL reads for blocking wait; the legacy name still counts as the user's choice."""


def _uses_nccl(backend: str | None) -> bool:
    """Whether `backend` (None: the world's) is NCCL: where `blocking_wait` acts; tests stand in for NCCL here."""
    return (backend or dist.get_backend()) == dist.Backend.NCCL


@contextlib.contextmanager
def blocking_wait(backend: str | None = None) -> Iterator[None]:
    """NCCL groups created inside wait blocking (see the module docstring); other backends are left alone.

    `backend`: the backend of the group about to be created when there is no world yet (None: the world's).
    """
    if not _uses_nccl(backend) or any(name in os.environ for name in BLOCKING_WAIT_ENV):
        yield
        return
    os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TORCH_NCCL_BLOCKING_WAIT", None)


def waiting_group(ranks: Sequence[int] | None = None, *, timeout: datetime.timedelta | None) -> dist.ProcessGroup:
    """A group meshkd waits on itself: `new_group(ranks, timeout=timeout)` inside `blocking_wait()`.

    Collective over the whole world, like `new_group`."""
    with blocking_wait():
        return dist.new_group(ranks=None if ranks is None else list(ranks), timeout=timeout)


def mesh_backend_override(timeout: datetime.timedelta | None) -> tuple | None:
    """DeviceMesh's `(backend, options)` for one axis whose groups time out after `timeout` (None: torch's default).

    The backend stays the world's; the options carry only the timeout (ProcessGroupNCCL.Options under NCCL,
    which is the type it requires). A mesh axis given options never reuses the world group, even where it
    spans the whole world, so no FSDP2 / tp / cp / pp collective runs on a group created blocking.
    """
    if timeout is None:
        return None
    if dist.get_backend() == dist.Backend.NCCL:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
    else:
        options = C10dBackend.Options(dist.get_backend(), timeout)
    return (None, options)

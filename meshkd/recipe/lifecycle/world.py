"""The world a rank joins: its device and the process group, both from torchrun's environment.

A CUDA rank takes GPU LOCAL_RANK and the group uses NCCL; a CPU rank uses gloo. One GPU per process:
NCCL cannot run two ranks of a group on one GPU, so a node that sees fewer GPUs than it runs ranks is
refused before any is used, by `meshkd train` before it starts the workers (`check_gpu_count`) and by
every rank before it creates the group (`init_world`). The collective timeout is the config's
`collective_timeout_s`.

NCCL failures. gloo raises in the collective that lost its peer; NCCL queues the collective on the GPU and,
by default, its watchdog thread ends the process when one times out, so the rank never says why. The world
group is one meshkd waits on itself (agreements, the stop flag, the vocabulary), so it is created with
blocking wait (`meshkd.core.groups.blocking_wait`, unless the user set TORCH_NCCL_BLOCKING_WAIT): a wait on
it blocks the calling thread until the collective completes or the timeout passes, and a timeout aborts
that communicator and raises DistBackendError in the waiting thread, which `FaultWatch` turns into
`PeerLostError`. The variable is set only while the group is created: the DeviceMesh groups FSDP2, tp, cp
and pp use are created without it and keep their overlap. NCCL does not notice a peer process exiting: the
recipe has
`FaultWatch.watch_exits` call `abort_communicators` when a peer process of this host exits unfinished, so
the waits on it end at once. After a failure `close_world` aborts every communicator (ncclCommAbort,
which drops queued work) instead of `destroy_process_group`, which waits for that work and can hang; a
clean finish, and every gloo world, still destroys the group.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from meshkd.core.groups import blocking_wait
from meshkd.recipe.settings.config import KDRecipeConfig


def uses_cuda(config: KDRecipeConfig) -> bool:
    """Whether the run's ranks use CUDA devices (`device: cuda`, or `auto` where CUDA is available)."""
    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


def check_gpu_count(config: KDRecipeConfig, local_processes: int) -> None:
    """Refuse to run `local_processes` ranks of a CUDA run on a node that sees fewer GPUs.

    One GPU per process: NCCL cannot run two ranks of a group on one GPU, and a rank without a GPU of its
    own would fail later with "invalid device ordinal".
    """
    if not uses_cuda(config):
        return
    visible = torch.cuda.device_count()
    if local_processes > visible:
        raise ValueError(
            f"this run needs {local_processes} processes on this node, one GPU each, but the node sees {visible} "
            f"GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): lay out fewer "
            "ranks per node, or set device: cpu"
        )


def init_world(config: KDRecipeConfig) -> tuple[torch.device, bool]:
    """This rank's device, and whether the process group was created here (from torchrun's environment,
    NCCL on CUDA, gloo on CPU, `collective_timeout_s`), so that the caller destroys it at the end.

    A CUDA rank takes GPU LOCAL_RANK; a node with fewer GPUs than LOCAL_WORLD_SIZE is refused first."""
    device = torch.device("cpu")
    if uses_cuda(config):
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        check_gpu_count(config, max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), local_rank + 1))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if dist.is_initialized():
        return device, False
    backend = "nccl" if device.type == "cuda" else "gloo"
    # Blocking wait for the world group alone (see the module docstring): without it a wait only orders the
    # CUDA streams, and a timed-out collective ends the process through the watchdog without a Python error.
    with blocking_wait(backend):
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=config.collective_timeout_s))
    return device, True


def abort_communicators() -> None:
    """Abort every process group of this rank (ncclCommAbort on NCCL), from any thread; torch's registry of
    groups is left as it is, so that the rank's next collective raises (DistBackendError: "NCCL communicator
    was aborted") instead of finding no group. `close_world` still ends the world afterwards.

    Like torch's `_abort_process_group`, the aborts of an NCCL world run inside one NCCL group call, so that
    aborting one communicator does not wait on another.
    """
    c10d = dist.distributed_c10d
    names = dict(c10d._world.pg_names)  # a copy: the main thread may be using the registry
    default = c10d._world.default_pg
    backend = None
    if default is not None and dist.is_nccl_available():
        with contextlib.suppress(RuntimeError):  # a group without a CUDA backend
            backend = default._get_backend(torch.device("cuda"))
    grouped = dist.is_nccl_available() and isinstance(backend, dist.ProcessGroupNCCL)
    if grouped:
        backend._group_start()
    for group in sorted(names, key=lambda group: names[group], reverse=True):
        group.abort()
    if grouped:
        backend._group_end()


def close_world(*, failed: bool) -> None:
    """End the process group this rank created: destroy it, or after a failure on NCCL abort every communicator.

    `destroy_process_group` shuts NCCL communicators down in order and waits for their queued work: a
    collective abandoned by a failure (a request whose peer is gone) would hold it forever. Aborting
    (`_abort_process_group`: ncclCommAbort on every group, the default one included) drops that work. gloo
    raises instead of queueing, and its destroy returns, so a gloo world is destroyed either way.
    """
    if failed and dist.get_backend() == dist.Backend.NCCL:
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def run_role(config: KDRecipeConfig, make_role: Callable[[torch.device], Any]) -> dict:
    """A role's `run()` on this rank (`meshkd serve-teacher`, `meshkd cache-teacher`), in the current world or a
    new one from the environment: `make_role(device)` builds it, its `stop` (`StopRequest`) is obeyed while it
    runs, and a world created here is closed after it (aborted on NCCL after a failure, as `close_world` says)."""
    device, owns_group = init_world(config)
    role, failed = None, True
    try:
        role = make_role(device)
        role.stop.install()
        summary = role.run()
        failed = False
        return summary
    finally:
        if role is not None:
            role.stop.restore()
        if owns_group and dist.is_initialized():
            close_world(failed=failed)

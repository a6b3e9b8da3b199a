"""Local worlds: run a function on N spawned processes of this machine, joined in one process group.

The test suite (many checks per world, because starting processes is the expensive part) and the
benchmarks run their multi-rank code this way. Each rank gets MASTER_ADDR / MASTER_PORT / RANK /
WORLD_SIZE, joins the group (gloo, or NCCL with GPU `rank`), runs `target(rank, *args)` and leaves the
group. `target` must be importable by name (a module-level function or a picklable object): the ranks
start from a fresh interpreter, never a fork of the caller (whose threads and process groups they must
not inherit). They are forked from multiprocessing's forkserver, a clean process that has imported torch
once (`_PRELOAD`), so each rank does not pay that import again: starting ranks is most of a test world's
cost.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp

# Imported once by the forkserver that every rank is forked from (CUDA is not initialised by importing).
_PRELOAD = ["torch", "torch.distributed", "transformers"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for the group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, backend: str, timeout_s: float,
               target: Callable[..., None], args: Sequence[Any]) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    if "OMP_NUM_THREADS" not in os.environ:
        # The ranks share this machine's cores: more compute threads than cores only adds contention.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        target(rank, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_world(world_size: int, target: Callable[..., None], args: Sequence[Any] = (), *, backend: str = "gloo",
                timeout_s: float = 60.0, deadline_s: float | None = None) -> str | None:
    """Run `target(rank, *args)` on `world_size` new rank processes and wait for them.

    `timeout_s` bounds each collective of the default group; `deadline_s` (None: no limit) the whole
    world, after which the ranks still running are killed. Returns None when every rank exited cleanly,
    else why not (the first rank that failed, or the deadline).
    """
    mp.set_forkserver_preload(_PRELOAD)  # takes effect when this process starts its forkserver
    context = mp.start_processes(_rank_main, args=(world_size, free_port(), backend, timeout_s, target, list(args)),
                                 nprocs=world_size, start_method="forkserver", join=False)
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    try:
        while not context.join(timeout=1.0):
            if deadline is not None and time.monotonic() > deadline:
                return f"world did not finish within {deadline_s} s"
    except Exception as error:  # a rank exited non-zero (torch names it and its exit code or signal)
        return f"{type(error).__name__}: {str(error)[:2000]}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return None

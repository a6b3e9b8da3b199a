"""Run many checks in one multi-process gloo world, because starting processes is the expensive part.

A test module lists its checks (module-level functions, so that spawned processes can import them) and
asks `World.run` for their results once; each pytest test then asserts on one check's result. A check
runs on every rank; it fails when it raises on any rank. A failing check ends the world (its peers may
be stuck in a collective), and the checks after it are reported as not run.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch.multiprocessing as mp

Check = Callable[[], None]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _name(check: Check) -> str:
    return getattr(check, "__name__", None) or str(check)


def _rank_main(rank: int, world_size: int, port: int, checks: Sequence[Check], out_dir: str, timeout_s: float) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    results_file = Path(out_dir, f"rank{rank}.jsonl")
    try:
        for check in checks:
            try:
                check()
                outcome = None
            except BaseException:
                outcome = traceback.format_exc()
            with results_file.open("a") as sink:
                sink.write(json.dumps({"check": _name(check), "error": outcome}) + "\n")
            if outcome is not None:
                os._exit(1)  # peers may be blocked in a collective: end the world
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class WorldResults:
    """Per-check outcome, merged over ranks."""

    def __init__(self, world_size: int, errors: dict[str, dict[int, str | None]], launch_error: str | None):
        self._world_size = world_size
        self._errors = errors
        self._launch_error = launch_error

    def errors(self, name: str) -> dict[int, str | None]:
        """rank -> traceback (None where `name` passed) for the ranks that reported on `name`."""
        return dict(self._errors.get(name, {}))

    def check(self, name: str) -> None:
        """Raise AssertionError with every failing rank's traceback if `name` failed or did not run."""
        per_rank = self._errors.get(name, {})
        failures = {rank: error for rank, error in per_rank.items() if error}
        if failures:
            report = "\n".join(f"--- rank {rank} ---\n{error}" for rank, error in sorted(failures.items()))
            raise AssertionError(f"check {name} failed:\n{report}")
        if len(per_rank) < self._world_size:
            missing = sorted(set(range(self._world_size)) - set(per_rank))
            raise AssertionError(f"check {name} did not finish on ranks {missing}: {self._launch_error or 'world ended'}")


def run_world(
    world_size: int, checks: Sequence[Check], *, timeout_s: float = 60.0, deadline_s: float = 400.0
) -> WorldResults:
    """Run `checks` in order on `world_size` spawned gloo ranks; returns their results.

    `timeout_s` bounds each collective of the default group; `deadline_s` the whole world.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        launch_error = None
        context = mp.start_processes(
            _rank_main,
            args=(world_size, _free_port(), list(checks), out_dir, timeout_s),
            nprocs=world_size,
            start_method="spawn",
            join=False,
        )
        deadline = time.monotonic() + deadline_s
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    launch_error = f"world did not finish within {deadline_s} s"
                    break
        except Exception as error:  # a rank exited non-zero; its check result says why
            launch_error = f"{type(error).__name__}: {str(error)[:2000]}"
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        errors: dict[str, dict[int, str | None]] = {}
        for rank in range(world_size):
            path = Path(out_dir, f"rank{rank}.jsonl")
            if path.exists():
                for line in path.read_text().splitlines():
                    record = json.loads(line)
                    errors.setdefault(record["check"], {})[rank] = record["error"]
    return WorldResults(world_size, errors, launch_error)


def world_test(world_size: int, checks: Sequence[Check], **options):
    """A pytest test, parametrized by check name, that runs all `checks` in one world on first use."""
    import pytest

    results: list[WorldResults] = []

    @pytest.mark.parametrize("check", [_name(check) for check in checks])
    def test(check: str) -> None:
        if not results:
            results.append(run_world(world_size, checks, **options))
        results[0].check(check)

    return test

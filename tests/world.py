"""Run many checks in one multi-process gloo world (`meshkd.core.local_world`): starting processes is the
expensive part.

A test module lists its checks (module-level functions, so that spawned processes can import them) and
asks `run_world` (or `world_test`) for their results once; each pytest test then asserts on one check's result. A check
runs on every rank; it fails when it raises on any rank. A failing check ends the world (its peers may
be stuck in a collective), and the checks after it are reported as not run.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from meshkd.core.local_world import spawn_world

Check = Callable[[], None]


def _name(check: Check) -> str:
    return getattr(check, "__name__", None) or str(check)


def _run_checks(rank: int, checks: Sequence[Check], out_dir: str) -> None:
    results_file = Path(out_dir, f"rank{rank}.jsonl")
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
            ended = self._launch_error or "world ended"
            raise AssertionError(f"check {name} did not finish on ranks {missing}: {ended}")


_SETUPS: dict[tuple[str, int], object] = {}


def layout_setups(cfg: dict, world_size: int):
    """`create_kd_distributed_setups(cfg, world_size)`, built once per layout in this world and registered as
    the current setup again when reused.

    Every mesh creates its own process groups (each gloo group holds connections and threads on every rank),
    and the checks of one world ask for the same few layouts again and again. Every rank runs the same checks
    in the same order, so every rank builds the same layouts in the same order, as mesh construction needs.
    """
    from meshkd.core.topology import create_kd_distributed_setups, set_current_setup

    key = (json.dumps(cfg, sort_keys=True), world_size)
    if key not in _SETUPS:
        _SETUPS[key] = create_kd_distributed_setups(cfg, world_size)
    setups = _SETUPS[key]
    set_current_setup(setups.local)
    return setups


def run_world(
    world_size: int, checks: Sequence[Check], *, timeout_s: float = 60.0, deadline_s: float = 400.0
) -> WorldResults:
    """Run `checks` in order on `world_size` spawned gloo ranks; returns their results.

    `timeout_s` bounds each collective of the default group; `deadline_s` the whole world.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        launch_error = spawn_world(world_size, _run_checks, (list(checks), out_dir), timeout_s=timeout_s,
                                   deadline_s=deadline_s)
        errors: dict[str, dict[int, str | None]] = {}
        for rank in range(world_size):
            path = Path(out_dir, f"rank{rank}.jsonl")
            if path.exists():
                for line in path.read_text().splitlines():
                    record = json.loads(line)
                    errors.setdefault(record["check"], {})[rank] = record["error"]
    return WorldResults(world_size, errors, launch_error)


class WorldsBySize:
    """Checks that need worlds of different sizes, run in one world per size (each size's checks in the order
    given), that world started when a test first asks for one of its checks.

    Tests of one module that each trained in a world of their own share a few worlds this way; a check that
    fails ends its world, and the checks after it in that world are reported as not run.
    """

    def __init__(self, checks: Sequence[tuple[int, Check]], *, timeout_s: float = 60.0,
                 deadline_per_check_s: float = 300.0) -> None:
        self._checks = list(checks)
        self._sizes = {_name(check): size for size, check in self._checks}
        assert len(self._sizes) == len(self._checks), "check names must be unique"
        self._timeout_s, self._deadline_per_check_s = timeout_s, deadline_per_check_s
        self._results: dict[int, WorldResults] = {}

    def results(self, name: str) -> WorldResults:
        """The results of the world that ran `name` (started now if it has not run yet)."""
        size = self._sizes[name]
        if size not in self._results:
            checks = [check for check_size, check in self._checks if check_size == size]
            self._results[size] = run_world(size, checks, timeout_s=self._timeout_s,
                                            deadline_s=self._deadline_per_check_s * len(checks))
        return self._results[size]

    def check(self, name: str) -> None:
        """Raise AssertionError if `name` failed or did not run (see `WorldResults.check`)."""
        self.results(name).check(name)


def world_test(world_size: int, checks: Sequence[Check], **options):
    """A pytest test, parametrized by check name, that runs all `checks` in one world on first use."""
    import pytest

    results: list[WorldResults] = []

    @pytest.mark.world
    @pytest.mark.parametrize("check", [_name(check) for check in checks])
    def test(check: str) -> None:
        if not results:
            results.append(run_world(world_size, checks, **options))
        results[0].check(check)

    return test

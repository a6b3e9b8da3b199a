"""Failure behaviour: peer death, clean stop on a signal, atomic checkpoints, and bad input.

The process tests drive `meshkd train` as a user would (one student rank, a teacher on two tensor-parallel
ranks, tiny random-init Llamas) through one chain of runs on one run directory, because starting worlds
is the expensive part:

1. SIGKILL the student in the middle of a checkpoint save: both teachers exit with an error naming the
   lost student, the half-written checkpoint stays a `.partial` directory.
2. `--resume`: starts from the previous complete checkpoint, ignoring the partial one, and replays the
   steps after it exactly (fp32 on the CPU); then SIGKILL a teacher rank: the student exits with an
   error naming the lost teacher, the other teacher with an error too.
3. `--resume`, then SIGTERM to `meshkd train`: the run stops at a step boundary with a checkpoint of that
   step, every process exits, `meshkd train` exits 143.
4. `--resume` to the end: every step logged once, in order.

After every run no process of the run is left. Bad configs and bad data are checked in this process
(config loading and `preflight` need no process group). One three-rank world covers the rest: what only
one role can find out while setting up (its weights, its data split, its checkpoint) must raise on every
rank, and a SIGINT that reaches one student rank only must stop every rank at the same step.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from meshkd.recipe.common.metrics import read_metrics
from meshkd.recipe.modeling import checkpoint as ckpt
from meshkd.recipe.settings.config import ConfigError
from meshkd.recipe.settings.config_loading import config_from_dict
from tests.tiny import base_config, tiny_llama, with_layout
from tests.world import run_world

TIMEOUT_S = 30  # collective_timeout_s of the process tests
MAX_STEPS = 16
CKPT_EVERY = 3
WORLD = 3  # student rank 0, teacher ranks 1-2 (tp 2)


# ---------------------------------------------------------------------------------------------------------
# Helpers for runs of `meshkd train`


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text` (the run's unique config path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and not process_gone(int(entry.name)):
                found.append(int(entry.name))
    return found


class Run:
    """One `meshkd train` process with its output in files (no pipe can fill up and block it)."""

    def __init__(self, config_path: Path, out_dir: Path, name: str, *extra: str) -> None:
        self.config_path, self.name = config_path, name
        self.stdout_path, self.stderr_path = out_dir / f"{name}.out", out_dir / f"{name}.err"
        with self.stdout_path.open("w") as stdout, self.stderr_path.open("w") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "meshkd", "train", str(config_path), *extra], stdout=stdout, stderr=stderr
            )
        self.run_dir = Path(yaml.safe_load(config_path.read_text())["logging"]["run_dir"])

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()  # its launcher and workers get SIGTERM (parent-death signal)
            raise AssertionError(f"{self.name} did not exit within {timeout} s:\n{self.stderr[-3000:]}") from None

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    def last_step(self) -> int:
        try:
            records = read_metrics(self.run_dir)
        except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or caught mid-line
            return 0
        return max((r["step"] for r in records if r["kind"] == "train"), default=0)

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.last_step() < step:
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.process.returncode}) before step {step}:\n"
                                     f"{self.stderr[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not reach step {step} in {timeout} s")
            time.sleep(0.05)

    def worker_pids(self, world_size: int = WORLD) -> dict[int, int]:
        return {rank: int(self.run_dir.joinpath("pids", f"rank{rank}.pid").read_text().split()[0])
                for rank in range(world_size)}

    def worker_endings(self) -> dict[int, str]:
        """'exit code 1', 'signal SIGKILL', ... per worker rank that did not exit 0, from the launcher's report."""
        endings = re.findall(r"worker rank (\d+) \(pid \d+\) ended with (.+)", self.stderr)
        return {int(rank): how for rank, how in endings}

    def errors(self) -> dict[int, str]:
        """The one-line error each worker printed."""
        return {int(rank): line for rank, line in re.findall(r"meshkd: error: rank (\d+): (.+)", self.stderr)}


def kill_during_save(run: Run, rank: int) -> tuple[int, float]:
    """SIGKILL `rank` while it writes a checkpoint; returns (the step being saved, when it was killed).

    The rank is frozen (SIGSTOP) as soon as a `.partial` directory appears; if the save already finished
    by then it is resumed and the next save is tried, so the kill lands in the middle of a save for sure.
    """
    root = run.run_dir / "checkpoints"
    run.wait_for_step(1)
    pid = run.worker_pids()[rank]
    for step in range(2 * CKPT_EVERY, MAX_STEPS, CKPT_EVERY):
        partial, final = root / f"step_{step:08d}.partial", ckpt.checkpoint_dir(root, step)
        deadline = time.monotonic() + 120
        while not partial.exists():
            assert run.process.poll() is None and time.monotonic() < deadline, run.stderr[-3000:]
            time.sleep(0.002)
        os.kill(pid, signal.SIGSTOP)
        if partial.exists() and not final.exists():
            os.kill(pid, signal.SIGKILL)
            return step, time.monotonic()
        os.kill(pid, signal.SIGCONT)
    raise AssertionError("no checkpoint save was caught in the middle")


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    """Runs 1-4 of the module docstring on one run directory; returns what each showed."""
    tmp = tmp_path_factory.mktemp("chain")
    config = with_layout(base_config(tmp), {"dp_size": 1}, {"dp_size": 1, "tp_size": 2})
    config["step_scheduler"].update(max_steps=MAX_STEPS, ckpt_every_steps=CKPT_EVERY)
    config["checkpoint"] = {"enabled": True, "save_hf": False}
    config["collective_timeout_s"] = TIMEOUT_S
    config_path = tmp / "chain.yaml"
    config_path.write_text(yaml.safe_dump(config))
    run_dir = Path(config["logging"]["run_dir"])
    root = run_dir / "checkpoints"
    result: dict = {"config_path": config_path, "root": root}
    grace = 2 * TIMEOUT_S

    # 1. Kill the student mid-save.
    first = Run(config_path, tmp, "run1")
    killed_step, killed_at = kill_during_save(first, rank=0)
    pids = first.worker_pids()
    code = first.wait(grace + 30)
    result["run1"] = dict(run=first, code=code, elapsed=time.monotonic() - killed_at, killed_step=killed_step,
                          pids=pids, latest=ckpt.latest_checkpoint(root), left=processes_mentioning(str(config_path)),
                          partial_left=(root / f"step_{killed_step:08d}.partial").is_dir(),
                          records=read_metrics(run_dir))

    # 2. Resume past the partial checkpoint, then kill a teacher rank.
    second = Run(config_path, tmp, "run2", "--resume")
    second.wait_for_step(killed_step + 2)
    pids = second.worker_pids()
    os.kill(pids[2], signal.SIGKILL)
    killed_at = time.monotonic()
    code = second.wait(grace + 30)
    result["run2"] = dict(run=second, code=code, elapsed=time.monotonic() - killed_at, pids=pids,
                          left=processes_mentioning(str(config_path)), records=read_metrics(run_dir))

    # 3. Resume without periodic checkpoints (the stop must write its own), then SIGTERM to `meshkd train`.
    last_logged, resumed_from = second.last_step(), ckpt.latest_checkpoint(root)
    third = Run(config_path, tmp, "run3", "--resume",
                "--set", f"step_scheduler.ckpt_every_steps={10 * MAX_STEPS}")
    third.wait_for_step(last_logged + 1)
    pids = third.worker_pids()
    third.process.send_signal(signal.SIGTERM)
    signalled_at = time.monotonic()
    code = third.wait(grace + 30)
    result["run3"] = dict(run=third, code=code, elapsed=time.monotonic() - signalled_at, pids=pids,
                          resumed_from=resumed_from,
                          left=processes_mentioning(str(config_path)), last_step=third.last_step(),
                          latest=ckpt.latest_checkpoint(root))

    # 4. Resume to the end.
    fourth = Run(config_path, tmp, "run4", "--resume")
    code = fourth.wait(180)
    result["run4"] = dict(run=fourth, code=code, pids=fourth.worker_pids(), left=processes_mentioning(str(config_path)),
                          records=read_metrics(run_dir))
    return result


def assert_world_gone(outcome: dict) -> None:
    assert outcome["left"] == [], f"processes of the run still alive: {outcome['left']}"
    alive = {rank: pid for rank, pid in outcome["pids"].items() if not process_gone(pid)}
    assert not alive, f"worker processes still alive: {alive}"


# ---------------------------------------------------------------------------------------------------------
# Peer death


@pytest.mark.world
def test_killing_the_student_mid_save_ends_the_teachers_with_an_error_naming_it(chain):
    outcome = chain["run1"]
    run = outcome["run"]
    assert outcome["code"] == 1, run.stderr[-3000:]
    assert outcome["elapsed"] < 2 * TIMEOUT_S
    assert run.worker_endings() == {0: "signal SIGKILL", 1: "exit code 1", 2: "exit code 1"}, run.stderr[-3000:]
    errors = run.errors()
    assert set(errors) == {1, 2}
    for line in errors.values():
        assert line.startswith("lost the student (rank 0; rank 0 exited) during "), line
    assert "Traceback" not in run.stderr
    assert_world_gone(outcome)


@pytest.mark.world
def test_killing_a_teacher_rank_ends_the_student_with_an_error_naming_the_teacher(chain):
    outcome = chain["run2"]
    run = outcome["run"]
    assert outcome["code"] == 1, run.stderr[-3000:]
    assert outcome["elapsed"] < 2 * TIMEOUT_S
    endings = run.worker_endings()
    assert endings[2] == "signal SIGKILL" and endings[0] == "exit code 1" and endings[1] == "exit code 1", endings
    errors = run.errors()
    assert re.match(r"lost the teacher \(ranks 1-2; ranks? [12, -]*2 exited\) during (send_batch|send_logits|"
                    r"broadcast_command|the teacher request): ", errors[0]), errors[0]
    assert errors[1].startswith("lost the "), errors[1]
    assert "Traceback" not in run.stderr
    others = [line for line in run.stderr.splitlines() if line.strip() and not line.startswith("meshkd: ")]
    assert not others, others  # no torchrun log lines: one line per worker, meshkd's
    assert_world_gone(outcome)


# ---------------------------------------------------------------------------------------------------------
# Atomic checkpoints and exact resume


@pytest.mark.world
def test_a_save_killed_half_way_leaves_the_previous_checkpoint_as_the_latest(chain):
    outcome = chain["run1"]
    step = outcome["killed_step"]
    assert outcome["partial_left"], "the kill should have left the checkpoint being written as .partial"
    assert outcome["latest"] == ckpt.checkpoint_dir(chain["root"], step - CKPT_EVERY)
    assert json.loads((outcome["latest"] / "meta.json").read_text())["step"] == step - CKPT_EVERY


@pytest.mark.world
def test_resume_ignores_the_partial_checkpoint_and_replays_the_killed_steps_exactly(chain):
    killed = chain["run1"]
    step = killed["killed_step"]
    run = chain["run2"]["run"]
    previous = step - CKPT_EVERY
    assert f"resumed from {ckpt.checkpoint_dir(chain['root'], previous)} at step {previous}" in run.stdout
    keys = ("loss", "ce_loss", "kd_loss", "grad_norm", "lr", "num_tokens")
    original = {r["step"]: [r[k] for k in keys] for r in killed["records"] if r["kind"] == "train"}
    replayed = {r["step"]: [r[k] for k in keys] for r in chain["run2"]["records"] if r["kind"] == "train"}
    for replayed_step in range(step - CKPT_EVERY + 1, step + 1):
        assert replayed[replayed_step] == original[replayed_step], f"step {replayed_step} differs after resume"
    # The step the kill interrupted was saved again, completely this time.
    assert json.loads((ckpt.checkpoint_dir(chain["root"], step) / "meta.json").read_text())["step"] == step


# ---------------------------------------------------------------------------------------------------------
# Clean stop


@pytest.mark.world
def test_sigterm_stops_at_a_step_boundary_with_a_checkpoint_of_that_step(chain):
    outcome = chain["run3"]
    run = outcome["run"]
    assert outcome["code"] == 128 + signal.SIGTERM, run.stderr[-3000:]
    stopped = outcome["last_step"]
    assert f"resumed from {outcome['resumed_from']}" in run.stdout
    assert stopped > int(outcome["resumed_from"].name.split("_")[1])  # so the checkpoint below is the stop's
    assert f"meshkd: stopped at step {stopped} on a stop request" in run.stdout
    assert outcome["latest"] == ckpt.checkpoint_dir(chain["root"], stopped)
    # The end-of-run report says so too, and where to continue from.
    assert f"meshkd train: stopped at step {stopped} of {MAX_STEPS} on a stop request" in run.stdout
    assert f"last checkpoint: {outcome['latest']} (continue with --resume)" in run.stdout
    assert json.loads((outcome["latest"] / "meta.json").read_text())["step"] == stopped
    assert run.worker_endings() == {} and run.errors() == {}, run.stderr[-3000:]
    assert outcome["elapsed"] < 2 * TIMEOUT_S
    assert_world_gone(outcome)


@pytest.mark.world
def test_resume_after_the_stop_finishes_with_every_step_logged_once(chain):
    outcome = chain["run4"]
    run = outcome["run"]
    assert outcome["code"] == 0, run.stderr[-3000:]
    stopped = chain["run3"]["last_step"]
    assert f"resumed from {ckpt.checkpoint_dir(chain['root'], stopped)} at step {stopped}" in run.stdout
    assert [r["step"] for r in outcome["records"] if r["kind"] == "train"] == list(range(1, MAX_STEPS + 1))
    assert Path(run.run_dir, "summary.json").is_file()
    assert f"meshkd train: finished {MAX_STEPS} of {MAX_STEPS} steps (resumed at step {stopped}) in " in run.stdout
    assert f": {MAX_STEPS - stopped} trained in this run" in run.stdout
    assert_world_gone(outcome)


@pytest.mark.world
@dataclass
class Ending:
    """How a run ended after `signal_worker`: exit code of `meshkd train`, seconds from the signal to its exit,
    the worker pids, and what of the run was still alive the moment it exited."""

    code: int
    elapsed: float
    pids: dict[int, int]
    left: list[str]


def signal_worker(run: Run, path: Path, rank: int, signum: int, *, timeout_s: float, world_size: int = WORLD,
                  step_timeout_s: float = 120) -> Ending:
    """Once the run has logged step 2, send `signum` to worker `rank` and wait (at most 4 * `timeout_s`, the
    collective timeout) for `meshkd train` to exit. Leaves no worker behind, whatever happens."""
    pids = {}
    try:
        run.wait_for_step(2, timeout=step_timeout_s)
        pids = run.worker_pids(world_size)
        os.kill(pids[rank], signum)
        sent_at = time.monotonic()
        code = run.wait(4 * timeout_s)
        elapsed = time.monotonic() - sent_at
        left = [f"rank {r} (pid {pid})" for r, pid in pids.items() if not process_gone(pid)]
        left += [f"pid {pid}" for pid in processes_mentioning(str(path)) if pid not in pids.values()]
        return Ending(code, elapsed, pids, left)
    finally:
        if run.process.poll() is None:
            run.process.kill()
        for pid in pids.values():
            if not process_gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_frozen_teacher_rank_ends_every_process_within_twice_the_timeout(tmp_path):
    """SIGSTOP on a teacher rank: its peers time out, and torchrun kills the frozen one after meshkd's grace."""
    timeout = 15
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, {"dp_size": 1, "tp_size": 2})
    config["step_scheduler"]["max_steps"] = 100000  # far more than it will run
    config["collective_timeout_s"] = timeout
    path = tmp_path / "frozen.yaml"
    path.write_text(yaml.safe_dump(config))
    run = Run(path, tmp_path, "frozen")
    ending = signal_worker(run, path, 2, signal.SIGSTOP, timeout_s=timeout)
    code, elapsed, pids = ending.code, ending.elapsed, ending.pids
    print(f"frozen teacher rank: meshkd train exited {elapsed:.1f} s after the freeze (collective timeout {timeout} s)")
    assert code == 1, run.stderr[-3000:]
    assert elapsed < 2 * timeout, f"{elapsed:.1f} s after the freeze"
    assert all(process_gone(pid) for pid in pids.values()) and processes_mentioning(str(path)) == []
    assert "lost the teacher" in run.errors()[0], run.stderr[-3000:]
    assert run.worker_endings()[2] == "signal SIGKILL", run.stderr[-3000:]


@pytest.mark.world
def test_data_slower_to_prepare_than_the_peer_timeout_is_not_a_lost_peer(tmp_path):
    """The students tokenize a 4 MiB document for several seconds while the teacher, loaded at once, waits:
    with a 3 s collective timeout the run still trains (the wait after loading is bounded by
    setup_timeout_s instead)."""
    from tests.recipe.lifecycle.test_recipe import TrainRun

    config = with_layout(base_config(tmp_path), {"dp_size": 1}, {"dp_size": 1})
    corpus = Path(config["dataset"]["paths"][0]).parent
    (corpus / "zz_long.txt").write_text("def f(x):\n    return x  # " + "spam " * (4 << 18) + "\n")
    config["step_scheduler"]["max_steps"] = 2
    config["collective_timeout_s"] = 3
    run_world(2, [TrainRun(config)], timeout_s=3, deadline_s=300).check("train")
    assert [r["step"] for r in read_metrics(config["logging"]["run_dir"]) if r["kind"] == "train"] == [1, 2]


@pytest.mark.world
def test_a_disk_too_small_for_checkpoints_is_warned_of_and_a_failed_save_is_one_line(tmp_path, small_disk):
    mount = small_disk
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, None)
    config["checkpoint"] = {"enabled": True, "save_hf": False, "dir": str(mount / "ckpt")}
    config["step_scheduler"].update(max_steps=2, ckpt_every_steps=1)
    path = tmp_path / "full.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "meshkd", "train", str(path)], capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count("meshkd: warning: checkpoint.dir: the run's 2 checkpoints take about") == 1
    errors = re.findall(r"meshkd: error: rank 0: (.+)", result.stderr)
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert errors[0].startswith(f"checkpoint {mount / 'ckpt' / 'step_00000001.partial'} could not be written: "
                                "rank 0: OSError:"), errors[0]
    assert "No space left on device" in errors[0]


# ---------------------------------------------------------------------------------------------------------
# Atomic checkpoints, without processes


def test_latest_checkpoint_counts_only_renamed_directories_with_meta(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path / "missing") is None
    for name, meta in (("step_00000002", True), ("step_00000004", True), ("step_00000006.partial", True),
                       ("step_00000008", False), ("step_final", True), ("notes", False)):
        (tmp_path / name).mkdir()
        if meta:
            (tmp_path / name / "meta.json").write_text("{}")
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_00000004"


# ---------------------------------------------------------------------------------------------------------
# Bad input: config loading (no process group)


_DELETE = object()


def tiny(tmp_path: Path, **edits) -> dict:
    """The tiny separate-mesh config (student rank 0, teacher rank 1), edited: `section__key=value` sets a
    key, `section=value` a whole section, the value _DELETE removes it."""
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, {"dp_size": 1})
    for dotted, value in edits.items():
        *parents, last = dotted.split("__")
        target = config
        for part in parents:
            target = target.setdefault(part, {})
        if value is _DELETE:
            target.pop(last, None)
        else:
            target[last] = value
    return config

CONFIG_CASES = {
    "unknown_section": ({"optimiser": {"lr": 1.0}}, r"optimiser"),
    "unknown_nested_key": ({"step_scheduler__max_step": 3}, r"step_scheduler\.max_step"),
    "unknown_layout_key": ({"distributed__pipeline_size": 2}, r"distributed\.pipeline_size"),
    "number_as_text": ({"optimizer__lr": "fast"}, r"optimizer\.lr must be a number"),
    "fraction_as_count": ({"step_scheduler__max_steps": 2.5}, r"step_scheduler\.max_steps must be an integer"),
    "text_as_bool": ({"separate_meshes": "yes"}, r"separate_meshes must be true or false"),
    "null_number": ({"kd__kd_ratio": None}, r"kd\.kd_ratio must not be null"),
    "section_not_a_mapping": ({"kd": 3}, r"kd: expected a mapping"),
    "two_model_sources": ({"model__path": "/models/x"}, r"model: set exactly one of model\.path or model\.random_init"),
    "no_teacher_source": ({"teacher_model": {}}, r"teacher_model: set exactly one"),
    "bad_dtype": ({"model__dtype": "int8"}, r"model\.dtype"),
    "kd_ratio_above_one": ({"kd__kd_ratio": 1.5}, r"kd\.kd_ratio must be in \[0, 1\]"),
    "zero_temperature": ({"kd__temperature": 0}, r"kd\.temperature must be a finite number > 0"),
    "nan_temperature": ({"kd__temperature": float("nan")}, r"kd\.temperature must be a finite number > 0"),
    "infinite_lr": ({"optimizer__lr": float("inf")}, r"optimizer\.lr must be a finite number > 0, got inf"),
    "nan_lr": ({"optimizer__lr": float("nan")}, r"optimizer\.lr must be a finite number > 0, got nan"),
    "one_beta": ({"optimizer__betas": [0.9]}, r"optimizer\.betas must be two numbers in \[0, 1\), got \[0\.9\]"),
    "beta_of_one": ({"optimizer__betas": [0.9, 1.0]}, r"optimizer\.betas must be two numbers"),
    "negative_weight_decay": ({"optimizer__weight_decay": -0.1}, r"optimizer\.weight_decay must be"),
    "zero_eps": ({"optimizer__eps": 0.0}, r"optimizer\.eps must be a finite number > 0"),
    "zero_max_grad_norm": ({"optimizer__max_grad_norm": 0.0}, r"optimizer\.max_grad_norm must be"),
    "negative_warmup": ({"lr_scheduler__warmup_steps": -3}, r"lr_scheduler\.warmup_steps must be >= 0, got -3"),
    "min_lr_ratio_above_one": ({"lr_scheduler__min_lr_ratio": 5.0}, r"lr_scheduler\.min_lr_ratio must be in \[0, 1\]"),
    "zero_total_steps": ({"lr_scheduler__total_steps": 0}, r"lr_scheduler\.total_steps must be >= 1 or null"),
    "zero_collective_timeout": ({"collective_timeout_s": 0}, r"collective_timeout_s must be a finite number"),
    "negative_collective_timeout": ({"collective_timeout_s": -5}, r"collective_timeout_s must be a finite number"),
    "huge_dp_size": ({"teacher_distributed__dp_size": 2**40}, r"the layout needs 1099511627777 ranks, more than"),
    "infinite_setup_timeout": ({"setup_timeout_s": float("inf")}, r"setup_timeout_s must be a finite number"),
    "bad_file_policy": ({"dataset__on_bad_file": "ignore"}, r"dataset\.on_bad_file must be error or skip"),
    "no_data_paths": ({"dataset__paths": []}, r"dataset\.paths is empty"),
    "zero_steps": ({"step_scheduler__max_steps": 0}, r"step_scheduler\.max_steps must be >= 1"),
    "batch_not_divisible": ({"step_scheduler__global_batch_size": 5, "step_scheduler__local_batch_size": 2},
                            r"global_batch_size\(5\) must be divisible by local_batch_size\(2\)"),
    "batch_not_divisible_by_dp": ({"distributed__dp_size": 3}, r"distributed\.dp_size\(3\)"),
    "shared_meshes_with_teacher_layout": ({"separate_meshes": False},
                                          r"teacher_distributed is set but separate_meshes is false"),
    # Caught at load even where the layout leaves the world open (no dp_size to count ranks by).
    "shared_meshes_with_teacher_layout_and_open_dp": ({"separate_meshes": False, "distributed": {}},
                                                      r"teacher_distributed is set but separate_meshes is false"),
    "separate_without_teacher_layout": ({"teacher_distributed": _DELETE}, r"teacher_distributed is missing"),
    "expert_parallel_on_separate_meshes": ({"teacher_distributed__ep_size": 2}, r"teacher_distributed\.ep_size\(2\)"),
    "ddp_on_separate_meshes": ({"distributed__strategy": "ddp"}, r"distributed\.strategy 'ddp'"),
    "zero_tp_size": ({"distributed__tp_size": 0}, r"distributed\.tp_size must be a positive integer"),
    "unknown_pp_schedule": ({"distributed__pp_schedule": "zb"}, r"distributed\.pp_schedule must be one of "
                            r"\['1f1b', 'gpipe'\], got 'zb'"),
    "unknown_optimizer": ({"optimizer__name": "adam"}, r"optimizer\.name must be adamw or sgd"),
    "unknown_decay": ({"lr_scheduler__decay": "step"}, r"lr_scheduler\.decay"),
    "unknown_device": ({"device": "tpu"}, r"device must be auto, cpu or cuda"),
    "student_pp_with_ddp": ({"separate_meshes": False, "teacher_distributed": _DELETE,
                             "distributed": {"strategy": "ddp", "dp_size": 1, "pp_size": 2}},
                            r"distributed\.pp_size\(2\) > 1 needs strategy fsdp2"),
    "student_1f1b_with_too_few_micro_batches": ({"distributed": {"dp_size": 2, "pp_size": 2},
                                                 "step_scheduler__global_batch_size": 2},
                                                r"distributed\.pp_schedule '1f1b' needs at least pp_size\(2\) "
                                                r"micro-batches per step, got .* = 1"),
    "student_sequence_parallel": ({"distributed": {"dp_size": 1, "sequence_parallel": True}},
                                  r"distributed\.sequence_parallel is not supported for the student"),
    "ddp_with_tp_on_shared_meshes": ({"separate_meshes": False, "teacher_distributed": _DELETE,
                                      "distributed": {"strategy": "ddp", "dp_size": 1, "tp_size": 2}},
                                     r"distributed\.strategy 'ddp' with tp_size\(2\)"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config_is_rejected_at_load_naming_the_key(case, tmp_path):
    changes, message = CONFIG_CASES[case]
    with pytest.raises(ConfigError, match=message):
        config_from_dict(tiny(tmp_path, **changes))


# ---------------------------------------------------------------------------------------------------------
# Bad input: preflight (files, tokenizers, model configs; no process group, no weights)


def llama(**overrides) -> dict:
    section = tiny_llama(3, seed=2)
    section["random_init"].update(overrides)
    return section


def saved_rows(directory: Path, row: dict) -> str:
    """A Hugging Face dataset of one row saved with `save_to_disk`."""
    import datasets

    datasets.Dataset.from_list([row]).save_to_disk(str(directory))
    return str(directory)


def write_files(directory: Path, texts: dict[str, str]) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (directory / name).write_text(text)
    return str(directory / "*")


def word_tokenizer(directory: Path) -> str:
    """A local HF tokenizer with its own small vocabulary (not the byte tokenizer's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, "def": 3, "return": 4}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]",
                            unk_token="[UNK]").save_pretrained(directory)
    (directory / "config.json").write_text('{"model_type": "llama"}')  # meshkd reads tokenizers from model dirs
    return str(directory)


def hf_dir_without_weights(directory: Path) -> str:
    """A model directory with a config.json but no weights."""
    from transformers import AutoConfig

    kwargs = dict(llama()["random_init"])
    AutoConfig.for_model(kwargs.pop("model_type"), **kwargs).save_pretrained(directory)
    return str(directory)


def garbage_weights(directory: Path) -> str:
    """A model directory whose config is fine and whose model.safetensors is not a safetensors file."""
    hf_dir_without_weights(directory)
    (directory / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all" * 64)
    return str(directory)


def write_file(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("not a directory\n")
    return str(path)


def preflight_cases(tmp: Path) -> dict:
    student_tp2 = {"distributed": {"dp_size": 1, "tp_size": 2}}
    return {
        "missing_data_file": ({"dataset__paths": [str(tmp / "nowhere" / "*.txt")]}, FileNotFoundError,
                              r"dataset\.paths: no file matches the data path .*nowhere"),
        "empty_corpus": ({"dataset__paths": [write_files(tmp / "blank", {"a.txt": "", "b.txt": "  \n\n"})]},
                         ValueError, r"dataset\.paths: no non-empty document in the 2 file\(s\)"),
        "jsonl_without_text_key": ({"dataset__paths": [write_files(tmp / "jsonl", {"a.jsonl": '{"body": "x"}\n'})]},
                                   ValueError, r"dataset\.paths: .*a\.jsonl:1: no text_key 'text'"),
        "unknown_data_format": ({"dataset__format": "parquet"}, ValueError, r"dataset: format must be one of"),
        "validation_takes_everything": ({"dataset__val_fraction": 1.0}, ValueError,
                                        r"dataset: val_fraction must be in \[0, 1\)"),
        "sequence_longer_than_student_positions": ({"step_scheduler__sequence_length": 300}, ConfigError,
                                                   r"step_scheduler\.sequence_length\(300\) exceeds model's "
                                                   r"max_position_embeddings\(256\)"),
        "sequence_longer_than_teacher_positions": ({"teacher_model": llama(max_position_embeddings=16)}, ConfigError,
                                                   r"exceeds teacher_model's max_position_embeddings\(16\)"),
        "different_tokenizers": ({"model__tokenizer": word_tokenizer(tmp / "words")}, ValueError,
                                 r"model\.tokenizer / teacher_model\.tokenizer: student and teacher use different "
                                 r"tokenizers \(5 vs 258 tokens\)"),
        "tokenizer_larger_than_embedding": ({"model": {**llama(vocab_size=200), "seed": 1}}, ValueError,
                                            r"the tokenizer has 258 tokens but the embedding table of the student "
                                            r"has 200 rows"),
        "missing_tokenizer_directory": ({"teacher_model__tokenizer": str(tmp / "no_tokenizer")}, FileNotFoundError,
                                        r"teacher_model\.tokenizer: model directory not found: .*no_tokenizer"),
        "model_config_not_json": ({"teacher_model": {"path": write_files(tmp / "bad_json", {"config.json": "{no"})[:-2],
                                                     "tokenizer": "byte"}},
                                  OSError, r"teacher_model: .*bad_json/config\.json' is not a valid JSON file"),
        "missing_model_directory": ({"teacher_model": {"path": str(tmp / "no_model"), "tokenizer": "byte"}},
                                    FileNotFoundError, r"teacher_model: model directory not found: .*no_model"),
        "student_tp_splits_heads": ({"distributed": {"dp_size": 1, "tp_size": 3}}, ConfigError,
                                    r"distributed\.tp_size\(3\) does not fit model: tp_size\(3\) must divide "
                                    r"num_attention_heads\(4\)"),
        "teacher_tp_splits_kv_heads": ({"teacher_distributed": {"dp_size": 1, "tp_size": 4}}, ConfigError,
                                       r"teacher_distributed\.tp_size\(4\) does not fit teacher_model: "
                                       r"tp_size\(4\) must divide num_key_value_heads\(2\)"),
        "teacher_pp_above_layers": ({"teacher_distributed": {"dp_size": 1, "pp_size": 4}}, ConfigError,
                                    r"teacher_distributed\.pp_size\(4\) exceeds teacher_model's 3 decoder layers"),
        "teacher_pp_above_kept_layers": ({"teacher_distributed": {"dp_size": 1, "pp_size": 3},
                                          "teacher_model__keep_layers": [0, 2]}, ConfigError,
                                         r"pp_size\(3\) exceeds teacher_model's 2 decoder layers "
                                         r"\(after keep_layers\)"),
        "student_tp_with_a_larger_vocabulary": ({**student_tp2, "model": {**llama(vocab_size=300), "seed": 1}},
                                                ConfigError, r"model: vocabulary 300 differs from the common "
                                                r"vocabulary 262"),
        "keep_layers_out_of_range": ({"model__keep_layers": [0, 5]}, ValueError,
                                     r"model\.keep_layers \[5\] out of range"),
        "misspelled_model_size": ({"model": llama(hidden_sise=64)}, ValueError,
                                  r"model\.random_init keys \['hidden_sise'\]"),
        "unknown_model_type": ({"teacher_model": {"random_init": {"model_type": "lama"}, "tokenizer": "byte"}},
                               ValueError, r"teacher_model\.random_init model_type 'lama'"),
        "teacher_layout_without_dp_size": ({"teacher_distributed": {"tp_size": 2}}, ConfigError,
                                           r"teacher_distributed\.dp_size is required with separate_meshes: true"),
        "student_pp_above_layers": ({"distributed": {"dp_size": 1, "pp_size": 3}}, ConfigError,
                                    r"distributed\.pp_size\(3\) exceeds model's 2 decoder layers"),
        "expert_parallel_of_a_dense_model": ({"separate_meshes": False, "teacher_distributed": _DELETE,
                                              "distributed": {"dp_size": 1, "tp_size": 2, "ep_size": 2}}, ConfigError,
                                             r"distributed\.tp_size\(2\), ep_size\(2\) does not fit model: .* needs "
                                             r"a mixture-of-experts model; LlamaForCausalLM ships no expert-parallel"),
        "teacher_experts_over_dp": ({"teacher_distributed": {"dp_size": 2, "ep_size": 2}}, ConfigError,
                                    r"teacher_distributed\.ep_size\(2\) would spread the teacher's experts over its "
                                    r"data-parallel ranks, .* use ep_size equal to tp_size"),
        "student_experts_over_dp_with_cp": ({"distributed": {"dp_size": 2, "cp_size": 2, "ep_size": 2}}, ConfigError,
                                            r"distributed\.ep_size\(2\) spreads experts over the data-parallel "
                                            r"ranks, .*; got cp_size\(2\)"),
        "negative_model_size": ({"model__random_init__hidden_size": -64}, ValueError,
                                r"model\.random_init\.hidden_size \(-64\): .*negative dimension -64"),
        "negative_head_count": ({"teacher_model": llama(num_attention_heads=-4)}, ValueError,
                                r"teacher_model\.random_init\.num_attention_heads \(-4\): .*negative dimension"),
        "garbage_safetensors": ({"teacher_model": {"path": garbage_weights(tmp / "garbage"), "tokenizer": "byte"}},
                                ValueError, r"teacher_model\.path: .*garbage/model\.safetensors is not a readable "
                                r"safetensors file"),
        "run_dir_is_a_file": ({"logging__run_dir": write_file(tmp / "afile")}, ConfigError,
                              r"logging\.run_dir: .*afile exists and is not a directory"),
        "checkpoint_dir_under_a_file": ({"checkpoint__dir": str(Path(write_file(tmp / "bfile")) / "ckpt")},
                                        ConfigError, r"checkpoint\.dir: .*cannot be created: .*bfile is not a dir"),
        "missing_hf_dataset": ({"dataset__hf": {"path": str(tmp / "no_dataset")}}, ValueError,
                               r"dataset\.hf\.path '.*no_dataset': cannot load it .*not a local file or directory"),
        "hf_dataset_without_the_text_column": ({"dataset__hf": {"path": saved_rows(tmp / "saved", {"body": "x"})}},
                                               ValueError, r"dataset\.hf '.*saved' split 'train' row 0: "
                                               r"no text_key 'text' in the row \(its columns: 'body'\)"),
        "flex_attention_with_small_heads_on_cuda": ({"device": "cuda", "teacher_model__attn_implementation":
                                                     "flex_attention"}, ConfigError,
                                                    r"teacher_model\.attn_implementation: flex_attention on CUDA "
                                                    r"needs head_dim >= 16 .*; teacher_model has head_dim 8: use sdpa"),
    }


PREFLIGHT_CASES = [
    "missing_data_file", "empty_corpus", "jsonl_without_text_key", "unknown_data_format", "validation_takes_everything",
    "sequence_longer_than_student_positions", "sequence_longer_than_teacher_positions", "different_tokenizers",
    "tokenizer_larger_than_embedding", "missing_tokenizer_directory", "missing_model_directory",
    "student_tp_splits_heads", "teacher_tp_splits_kv_heads", "teacher_pp_above_layers", "teacher_pp_above_kept_layers",
    "student_tp_with_a_larger_vocabulary", "keep_layers_out_of_range", "misspelled_model_size", "unknown_model_type",
    "teacher_layout_without_dp_size", "student_pp_above_layers",
    "expert_parallel_of_a_dense_model", "teacher_experts_over_dp",
    "student_experts_over_dp_with_cp",
    "negative_model_size", "flex_attention_with_small_heads_on_cuda",
    "missing_hf_dataset", "hf_dataset_without_the_text_column",
    "run_dir_is_a_file", "checkpoint_dir_under_a_file", "model_config_not_json", "negative_head_count",
    "garbage_safetensors",
]


@pytest.mark.parametrize("case", PREFLIGHT_CASES)
def test_bad_input_fails_preflight_naming_the_key_or_file(case, tmp_path):
    from meshkd.recipe.lifecycle.preflight import preflight

    changes, error_type, message = preflight_cases(tmp_path)[case]
    config = config_from_dict(tiny(tmp_path, **changes))  # valid as a config: only the files tell
    with pytest.raises(error_type, match=message):
        preflight(config)


def test_an_moe_teacher_under_tp_alone_is_told_when_its_experts_stay_whole(tmp_path, capsys):
    from meshkd.parallel.tensor_parallel import experts_left_whole
    from meshkd.recipe.common import metrics
    from meshkd.recipe.lifecycle.preflight import preflight
    from meshkd.recipe.modeling.models import load_causal_lm

    moe = {"random_init": {**llama()["random_init"], "model_type": "qwen3_moe", "num_experts": 4,
                           "num_experts_per_tok": 2, "moe_intermediate_size": 16}, "tokenizer": "byte", "seed": 2}
    whole = experts_left_whole(load_causal_lm(random_init=moe["random_init"]))
    for layout, warned in (({"dp_size": 1, "tp_size": 2}, whole), ({"dp_size": 1, "tp_size": 2, "ep_size": 2}, False)):
        metrics.warned.clear()
        preflight(config_from_dict(tiny(tmp_path, teacher_model=moe, teacher_distributed=layout)))
        err = capsys.readouterr().err
        assert ("teacher_distributed.ep_size: teacher_model's experts stay whole on each of its 2 tp ranks" in err) \
            == warned, (layout, err)
        assert ("set ep_size: 2" in err) == warned


def test_binary_and_non_utf8_data_files_are_refused_or_skipped_by_name(tmp_path, capsys):
    from meshkd.recipe.corpus import data
    from meshkd.recipe.lifecycle.preflight import preflight

    config = tiny(tmp_path)
    corpus = Path(config["dataset"]["paths"][0]).parent
    binary, latin = corpus / "zz_binary.txt", corpus / "zz_latin.txt"
    binary.write_bytes(Path(sys.executable).resolve().read_bytes()[:4096])  # an ELF executable's start
    latin.write_bytes(b"caf\xe9 au lait")
    with pytest.raises(ValueError, match=rf"dataset.paths: data file '{binary}' is binary \(a NUL byte at offset"):
        preflight(config_from_dict(config))
    binary.unlink()
    with pytest.raises(ValueError, match=rf"data file '{latin}' is not valid UTF-8 \(byte 0xe9 at offset 3\)"):
        preflight(config_from_dict(config))
    binary.write_bytes(Path(sys.executable).resolve().read_bytes()[:4096])
    config["dataset"]["on_bad_file"] = "skip"
    checked = preflight(config_from_dict(config))
    warned = capsys.readouterr().err
    assert f"meshkd: warning: skipping data file '{binary}': binary" in warned
    assert f"meshkd: warning: skipping data file '{latin}': not valid UTF-8" in warned
    train, val = data.build_run_datasets(checked.tokenizer, config_from_dict(config).dataset, sequence_length=32)
    assert train.num_documents + val.num_documents == 24  # the corpus without the two
    config["dataset"]["on_bad_file"] = "ignore"
    with pytest.raises(ConfigError, match="dataset.on_bad_file must be error or skip, got 'ignore'"):
        config_from_dict(config)


def test_the_tiny_config_passes_preflight(tmp_path):
    from meshkd.recipe.lifecycle.preflight import preflight

    preflight(config_from_dict(tiny(tmp_path)))


def test_meshkd_train_rejects_bad_input_before_starting_any_process(tmp_path, capsys):
    from meshkd import cli

    config = tiny(tmp_path, dataset__paths=[str(tmp_path / "nowhere.txt")])
    config_path = tmp_path / "bad.yaml"
    config_path.write_text(yaml.safe_dump(config))
    started = time.monotonic()
    assert cli.main(["train", str(config_path)]) == 2
    assert time.monotonic() - started < 30
    assert "meshkd: error: dataset.paths: no file matches the data path" in capsys.readouterr().err
    assert not Path(config["logging"]["run_dir"]).exists()  # no worker ever ran
    # An OSError (a model's config.json that is not JSON) is one line too, not a traceback.
    broken = write_files(tmp_path / "broken_model", {"config.json": "{no"})[:-2]
    config_path.write_text(yaml.safe_dump(tiny(tmp_path, teacher_model={"path": broken, "tokenizer": "byte"})))
    assert cli.main(["train", str(config_path)]) == 2
    assert re.match(r"meshkd: error: teacher_model: .*config\.json' is not a valid JSON file\.\n$",
                    capsys.readouterr().err)


# ---------------------------------------------------------------------------------------------------------
# One three-rank world (student ranks 0-1, teacher rank 2): setup failures of one role are raised on every
# rank within the collective timeout, and a signal to one student rank stops every rank at the same step.

WORLD_TIMEOUT_S = 30


class Train:
    """A check that trains a config (picklable for spawned ranks)."""

    def __init__(self, name: str, config: dict) -> None:
        self.__name__, self.config = name, config

    def __call__(self) -> None:
        from meshkd.recipe.lifecycle.run import KDRecipe

        KDRecipe(config_from_dict(self.config)).run()


def _train_records(config: dict) -> int:
    try:
        return sum(r["kind"] == "train" for r in read_metrics(config["logging"]["run_dir"]))
    except FileNotFoundError:
        return 0


class ExpectSetupFailure:
    """A check: setup raises on every rank, the failing ranks their own error, the others SetupError naming
    the lowest failing rank."""

    def __init__(self, name: str, config: dict, *, failing_ranks: set[int], match: str, resume: bool = False) -> None:
        self.__name__, self.config, self.failing_ranks, self.match = name, config, failing_ranks, match
        self.resume = resume

    def __call__(self) -> None:
        import torch.distributed as dist

        from meshkd.recipe.common.faults import SetupError
        from meshkd.recipe.lifecycle.run import KDRecipe

        trained_before = _train_records(self.config)
        started = time.monotonic()
        with pytest.raises(Exception) as raised:
            KDRecipe(config_from_dict(self.config), resume=self.resume).run()
        elapsed = time.monotonic() - started
        error = raised.value
        if dist.get_rank() in self.failing_ranks:
            assert not isinstance(error, SetupError), repr(error)
        else:
            assert isinstance(error, SetupError) and error.origin_rank == min(self.failing_ranks), repr(error)
        assert re.search(self.match, str(error)), str(error)
        assert elapsed < WORLD_TIMEOUT_S, f"took {elapsed:.1f} s: a rank waited for a peer"
        assert _train_records(self.config) == trained_before, "a training step ran"


class ExpectNonFiniteStop:
    """A check: a student whose loss is not finite stops at step 1 on every student rank with the step and the
    values named, before the update; the teacher is released and ends normally."""

    def __init__(self, name: str, config: dict) -> None:
        self.__name__, self.config = name, config

    def __call__(self) -> None:
        import torch.distributed as dist

        from meshkd.recipe.lifecycle.run import KDRecipe

        recipe = KDRecipe(config_from_dict(self.config))
        if dist.get_rank() == 2:
            assert recipe.run() == {}  # served until the student's STOP_TEACHER
            return
        stopped = r"step 1: the loss or its gradient is not finite \(loss .*grad_norm nan\); training stopped"
        with pytest.raises(ValueError, match=stopped):
            recipe.run()
        assert _train_records(self.config) == 0, "a step was logged as trained"


class SkipNonFiniteSteps:
    """A check: with kd.on_nonfinite: skip_step, a NaN loss at step 2 skips that update on every student rank
    and training goes on; a second one, past kd.max_skipped_steps=1, stops the run naming the limit."""

    def __init__(self, name: str, config: dict) -> None:
        self.__name__, self.config = name, config

    def __call__(self) -> None:
        import torch.distributed as dist

        from meshkd.recipe.lifecycle.run import KDRecipe
        from meshkd.recipe.student.train_step import TrainStep

        micro_batch_loss, calls = TrainStep.micro_batch_loss, []
        nan_steps = {2}

        def poisoned(step_of, *args, **kwargs):
            calls.append(args)
            loss, values = micro_batch_loss(step_of, *args, **kwargs)
            step = (len(calls) - 1) // step_of.num_micro_batches + 1
            return (loss * float("nan"), values) if step in nan_steps else (loss, values)

        TrainStep.micro_batch_loss = poisoned
        try:
            again = copy.deepcopy(self.config)
            again["logging"]["run_dir"] += "_again"
            if dist.get_rank() == 2:  # the teacher serves both runs and ends normally
                assert KDRecipe(config_from_dict(self.config)).run() == {}
                assert KDRecipe(config_from_dict(again)).run() == {}
                return
            summary = KDRecipe(config_from_dict(self.config)).run()
            assert summary["skipped_steps"] == 1
            records = [r for r in read_metrics(self.config["logging"]["run_dir"]) if r["kind"] == "train"]
            assert [(r["step"], r["skipped"]) for r in records] == [(1, False), (2, True), (3, False)]
            assert all(math.isfinite(r["loss"]) for r in records if not r["skipped"])
            calls.clear()
            nan_steps.update({1, 3})
            recipe = KDRecipe(config_from_dict(again))
            with pytest.raises(ValueError, match=r"step 2: .* not finite .*after 1 skipped step\(s\), the most "
                                                 r"kd.max_skipped_steps allows"):
                recipe.run()
        finally:
            TrainStep.micro_batch_loss = micro_batch_loss


class SignalOneStudentRank:
    """A check: SIGINT reaches student rank 1 only, after step 2; every rank stops at the same step."""

    def __init__(self, name: str, config: dict) -> None:
        self.__name__, self.config = name, config

    def __call__(self) -> None:
        import threading

        import torch.distributed as dist

        from meshkd.recipe.lifecycle.run import KDRecipe

        run_dir = Path(self.config["logging"]["run_dir"])

        def signal_after_step_two() -> None:
            while not any(r["kind"] == "train" and r["step"] >= 2 for r in _read_quietly(run_dir)):
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGINT)

        if dist.get_rank() == 1:
            threading.Thread(target=signal_after_step_two, daemon=True).start()
        summary = KDRecipe(config_from_dict(self.config)).run()
        if dist.get_rank() == 2:
            assert summary == {}  # the teacher served until STOP_TEACHER and returned normally
            return
        stopped = summary["stopped_at_step"]
        assert 2 <= stopped < self.config["step_scheduler"]["max_steps"]
        root = run_dir / "checkpoints"
        assert ckpt.latest_checkpoint(root) == ckpt.checkpoint_dir(root, stopped)
        if dist.get_rank() == 0:
            assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == list(range(1, stopped + 1))


class FailOnStudentRankOne:
    """A check: student rank 1 fails on its own at the `call`-th call of `owner.method` (as out of memory
    would; by default inside step 2's micro-batch losses) while rank 0 waits in a collective. Rank 1 raises
    `message` (and its process exits, as a worker's would); the others must fail within seconds, not after
    the collective timeout."""

    def __init__(self, name: str, config: dict, *, owner: type | None = None, method: str = "micro_batch_loss",
                 call: int = 3, message: str = "out of memory (simulated)") -> None:
        self.__name__, self.config = name, config
        self.owner, self.method, self.call, self.message = owner, method, call, message

    def __call__(self) -> None:
        import torch.distributed as dist

        from meshkd.recipe.common.faults import PeerLostError
        from meshkd.recipe.lifecycle.run import KDRecipe
        from meshkd.recipe.student.train_step import TrainStep

        recipe = KDRecipe(config_from_dict(self.config))
        owner = self.owner or TrainStep
        original, calls = getattr(owner, self.method), []

        def failing(instance, *args, **kwargs):
            calls.append(args)
            if dist.get_rank() == 1 and len(calls) == self.call:
                raise RuntimeError(self.message)
            return original(instance, *args, **kwargs)

        setattr(owner, self.method, failing)  # this process only: the check ends it
        if dist.get_rank() == 1:
            recipe.run()  # raises: the harness records it and ends this process
        started = time.monotonic()
        with pytest.raises(PeerLostError, match=r"lost the student \(ranks 0-1; rank.* exited\)"):
            recipe.run()
        assert time.monotonic() - started < WORLD_TIMEOUT_S / 2, "a rank waited for the collective timeout"


def _read_quietly(run_dir: Path) -> list[dict]:
    try:
        return read_metrics(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return []


SETUP_CHECKS = ["student_data_leaves_no_training_document", "teacher_weights_missing",
                "train_one_step_with_a_checkpoint", "resume_from_a_checkpoint_of_another_model",
                "sigint_to_one_student_rank_stops_every_rank_at_the_same_step",
                "a_non_finite_loss_stops_every_rank_before_the_update",
                "on_nonfinite_skip_step_skips_the_update_up_to_the_limit",
                "a_rank_local_failure_in_training_ends_every_rank_within_seconds"]


@pytest.fixture(scope="module")
def three_rank_world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("three_rank_world")
    base = with_layout(base_config(tmp), {"dp_size": 2}, {"dp_size": 1})

    def variant(name: str) -> dict:
        config = copy.deepcopy(base)
        config["logging"]["run_dir"] = str(tmp / name)
        return config

    one_document = variant("one_document")
    one_document["dataset"].update(paths=[write_files(tmp / "one", {"a.txt": "def f():\n    return 1\n"})],
                                   val_fraction=0.5)
    no_weights = variant("no_weights")
    no_weights["teacher_model"] = {"path": hf_dir_without_weights(tmp / "no_weights_model"), "tokenizer": "byte"}
    trained = variant("other_model")
    trained["step_scheduler"].update(max_steps=1, ckpt_every_steps=1)
    trained["checkpoint"] = {"enabled": True, "save_hf": False}
    other_model = copy.deepcopy(trained)
    other_model["model"]["random_init"].update(hidden_size=48, intermediate_size=96)
    overflowing = variant("overflowing")  # logits / 1e-40 overflow float32: the KD loss is not finite
    overflowing["kd"]["temperature"] = 1e-40
    skipping = variant("skipping")
    skipping["step_scheduler"].update(max_steps=3)
    skipping["kd"].update(on_nonfinite="skip_step", max_skipped_steps=1)
    stopped = variant("stopped")
    stopped["step_scheduler"].update(max_steps=200)
    stopped["checkpoint"] = {"enabled": True, "save_hf": False}

    checks = [
        ExpectSetupFailure(SETUP_CHECKS[0], one_document, failing_ranks={0, 1},
                           match=r"dataset: val_fraction=0\.5 of 1 document\(s\) leaves no document"),
        ExpectSetupFailure(SETUP_CHECKS[1], no_weights, failing_ranks={2}, match=r"teacher_model: .*no_weights_model"),
        Train(SETUP_CHECKS[2], trained),
        ExpectSetupFailure(SETUP_CHECKS[3], other_model, failing_ranks={0, 1}, resume=True,
                           match=r"checkpoint .*step_00000001 cannot be loaded into this run"),
        SignalOneStudentRank(SETUP_CHECKS[4], stopped),
        ExpectNonFiniteStop(SETUP_CHECKS[5], overflowing),
        SkipNonFiniteSteps(SETUP_CHECKS[6], skipping),
        # Last: rank 1's process exits, which ends this world.
        FailOnStudentRankOne(SETUP_CHECKS[7], variant("rank_local_failure")),
    ]
    return run_world(3, checks, timeout_s=WORLD_TIMEOUT_S, deadline_s=300)


@pytest.mark.world
@pytest.mark.parametrize("check", SETUP_CHECKS[:-1])
def test_three_rank_world(check, three_rank_world):
    three_rank_world.check(check)


@pytest.mark.world
def test_a_rank_local_failure_in_training_ends_every_rank_within_seconds(three_rank_world):
    errors = three_rank_world.errors(SETUP_CHECKS[-1])
    assert "out of memory (simulated)" in (errors.get(1) or ""), errors
    assert errors.get(0) is None and errors.get(2) is None, errors

"""Several teachers: killing or freezing either teacher ends every rank within the reliability bounds
(elapsed < 2 * collective timeout), and the student's error names that teacher.

Each test drives `meshkd train` as a user would, with the helpers of `tests.recipe.lifecycle.test_reliability`, on a
three-rank world: the student on rank 0, teacher 'code' on rank 1, teacher 'math' on rank 2 (each on ranks
of its own, tiny random-init Llamas of different seeds). The run is told to train far longer than it will;
after a couple of steps one teacher rank is killed (SIGKILL) or frozen (SIGSTOP).
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import yaml

from tests.recipe.lifecycle.test_reliability import Run, signal_worker
from tests.tiny import base_config, tiny_llama

TIMEOUT_S = 15  # collective_timeout_s of the runs
RANKS = {"student": 0, "code": 1, "math": 2}


def two_teacher_run(tmp: Path, name: str) -> tuple[Run, Path]:
    """Start `meshkd train` on the three-rank layout of the module docstring; returns the run and its config."""
    config = base_config(tmp)
    del config["teacher_model"]  # replaced by the two entries of `teachers`
    config["distributed"] = {"dp_size": 1}
    config["teachers"] = [{"name": "code", "model": tiny_llama(3, seed=2), "distributed": {"dp_size": 1}},
                          {"name": "math", "model": tiny_llama(3, seed=4), "distributed": {"dp_size": 1}}]
    config["step_scheduler"]["max_steps"] = 100000  # far more than it will run
    config["collective_timeout_s"] = TIMEOUT_S
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return Run(path, tmp, name), path


@pytest.mark.world
def test_killing_teacher_math_ends_every_rank_with_the_student_naming_it(tmp_path):
    run, path = two_teacher_run(tmp_path, "killed")
    ending = signal_worker(run, path, RANKS["math"], signal.SIGKILL, timeout_s=TIMEOUT_S)
    code, elapsed, left = ending.code, ending.elapsed, ending.left
    print(f"killed teacher 'math': meshkd train exited {elapsed:.1f} s after the kill "
          f"(collective timeout {TIMEOUT_S} s)")
    assert code == 1, run.stderr[-3000:]
    assert elapsed < 2 * TIMEOUT_S, f"{elapsed:.1f} s after the kill"
    endings = run.worker_endings()
    assert endings == {0: "exit code 1", 1: "exit code 1", 2: "signal SIGKILL"}, run.stderr[-3000:]
    errors = run.errors()
    assert re.match(r"lost the teacher 'math' \(rank 2; rank 2 exited\) during ", errors[0]), errors[0]
    assert errors[1].startswith("lost the ") and "teacher 'code'" not in errors[1], errors[1]
    assert "Traceback" not in run.stderr
    assert left == [], f"still alive when meshkd train exited: {left}"


@pytest.mark.world
def test_freezing_teacher_code_ends_every_rank_within_twice_the_timeout_with_the_student_naming_it(tmp_path):
    """SIGSTOP on teacher 'code': the student times out waiting for it, teacher 'math' loses the student, and
    the frozen rank is killed after meshkd's grace."""
    run, path = two_teacher_run(tmp_path, "frozen")
    ending = signal_worker(run, path, RANKS["code"], signal.SIGSTOP, timeout_s=TIMEOUT_S)
    code, elapsed, left = ending.code, ending.elapsed, ending.left
    print(f"frozen teacher 'code': meshkd train exited {elapsed:.1f} s after the freeze "
          f"(collective timeout {TIMEOUT_S} s)")
    assert code == 1, run.stderr[-3000:]
    assert elapsed < 2 * TIMEOUT_S, f"{elapsed:.1f} s after the freeze"
    endings = run.worker_endings()
    assert endings == {0: "exit code 1", 1: "signal SIGKILL", 2: "exit code 1"}, run.stderr[-3000:]
    errors = run.errors()
    assert re.match(r"lost the teacher 'code' \(rank 1\) during ", errors[0]), errors[0]
    assert "teacher 'math'" not in errors[0]
    assert errors[2].startswith("lost the ") and "teacher 'math'" not in errors[2], errors[2]
    assert "Traceback" not in run.stderr
    assert left == [], f"still alive when meshkd train exited: {left}"

"""`meshkd train` on separate meshes under NCCL, one GPU per rank: run where 2 or 4 GPUs are visible.

Student 1 + teacher 1 on two GPUs must follow the CPU's curve for the same config (fp32). Student tp 2 +
teacher tp 2 on four GPUs trains 50 steps with the teacher overlapped and synchronous: no hang, the same
curve, and the teacher wait and throughput of both printed for comparison (`-s` shows them). Killing or
freezing the teacher of a student 1 + teacher 1 run ends every rank within twice `collective_timeout_s`, the
student with the one line naming the teacher (a killed one within the timeout: the exit watch aborts the
communicators; a frozen one through NCCL's blocking wait timing out). Two teachers, each on a GPU of its own
(or one on the student's GPU), asked at once on threads and CUDA streams of their own, follow the CPU's curve.
"""

import signal
import statistics

import pytest
import torch
import yaml

from tests.gpu import CUDA
from tests.gpu.test_train_nccl import losses, train
from tests.recipe.lifecycle.test_reliability import Run, process_gone, processes_mentioning, signal_worker
from tests.tiny import base_config, with_layout

pytestmark = [*CUDA, pytest.mark.world]


def gpus(count: int):
    return pytest.mark.skipif(torch.cuda.device_count() < count, reason=f"needs {count} visible GPUs")


def separate(tmp_path, name: str, student: dict, teacher: dict, *, device: str = "cuda") -> dict:
    config = with_layout(base_config(tmp_path), student, teacher)
    config["device"] = device
    config["logging"]["run_dir"] = str(tmp_path / name)
    return config


@gpus(2)
def test_a_student_and_a_teacher_on_two_gpus_follow_the_cpus_curve(tmp_path):
    on_gpu = train(separate(tmp_path, "gpu", {"dp_size": 1}, {"dp_size": 1}))
    on_cpu = train(separate(tmp_path, "cpu", {"dp_size": 1}, {"dp_size": 1}, device="cpu"))
    assert len(on_gpu) == len(on_cpu) > 0
    torch.testing.assert_close(losses(on_gpu), losses(on_cpu), rtol=5e-3, atol=1e-4)


@gpus(4)
def test_tp2_student_and_tp2_teacher_train_50_steps_overlapped_and_not(tmp_path):
    runs = {}
    for overlap in (True, False):
        config = separate(tmp_path, f"overlap_{overlap}", {"dp_size": 1, "tp_size": 2}, {"dp_size": 1, "tp_size": 2})
        config["kd"]["overlap_teacher"] = overlap
        config["step_scheduler"].update(max_steps=50, val_batches=1)
        runs[overlap] = train(config)
    assert len(runs[True]) == len(runs[False]) == 50
    torch.testing.assert_close(losses(runs[True]), losses(runs[False]), rtol=1e-3, atol=1e-5)
    for overlap, records in runs.items():
        later = records[5:]  # past the warm-up steps
        print(f"overlap {overlap}: teacher_wait_s median {statistics.median(r['teacher_wait_s'] for r in later):.4f}, "
              f"tokens_per_s median {statistics.median(r['tokens_per_s'] for r in later):.0f}")


def two_teachers(tmp_path, name: str, *, own: int, device: str = "cuda") -> dict:
    """base_config with two teachers (weights 0.7 / 0.3), the last `own` of them on a GPU of their own."""
    config = base_config(tmp_path)
    teacher = config.pop("teacher_model")
    other = {**teacher, "seed": 5, "random_init": {**teacher["random_init"], "model_type": "qwen2"}}
    config["teachers"] = [{"name": "a", "model": teacher, "weight": 0.7}, {"name": "b", "model": other, "weight": 0.3}]
    for entry in config["teachers"][2 - own:]:
        entry["distributed"] = {"dp_size": 1}
    config.update(distributed={"dp_size": 1}, device=device)
    config["logging"]["run_dir"] = str(tmp_path / name)
    return config


@pytest.mark.parametrize("own", [pytest.param(1, marks=gpus(2)), pytest.param(2, marks=gpus(3))])
def test_two_teachers_asked_at_once_follow_the_cpus_curve(own, tmp_path):
    on_gpu = train(two_teachers(tmp_path, "gpu", own=own))
    on_cpu = train(two_teachers(tmp_path, "cpu", own=own, device="cpu"))
    assert len(on_gpu) == len(on_cpu) > 0
    torch.testing.assert_close(losses(on_gpu), losses(on_cpu), rtol=5e-3, atol=1e-4)
    assert all(record["kd_loss/a"] > 0 and record["kd_loss/b"] > 0 for record in on_gpu)


@gpus(2)
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_lost_teacher_ends_every_rank_of_an_nccl_run_within_twice_the_timeout(how, tmp_path):
    """The teacher's process is killed or frozen mid-run; the student prints the one line naming the teacher
    and exits 1. Killed: the student's exit watch aborts its communicators, well before the timeout. Frozen:
    its NCCL wait times out, and torchrun ends the teacher after meshkd's 5 s grace."""
    timeout = 15
    config = separate(tmp_path, "lost", {"dp_size": 1}, {"dp_size": 1})
    config["step_scheduler"]["max_steps"] = 100000  # far more than it will run
    config["collective_timeout_s"] = timeout
    path = tmp_path / "lost.yaml"
    path.write_text(yaml.safe_dump(config))
    run = Run(path, tmp_path, "lost")
    ending = signal_worker(run, path, 1, how, timeout_s=timeout, world_size=2, step_timeout_s=300)
    code, elapsed, pids = ending.code, ending.elapsed, ending.pids
    others = [line for line in run.stderr.splitlines() if line.strip() and not line.startswith("meshkd: ")]
    print(f"teacher {how.name}: meshkd train exited {elapsed:.1f} s after it (collective timeout {timeout} s); "
          f"{len(others)} other stderr line(s):", *others[:20], sep="\n")
    assert code == 1, run.stderr[-3000:]
    bound = timeout if how == signal.SIGKILL else 2 * timeout  # a killed peer is noticed without the timeout
    assert elapsed < bound, f"{elapsed:.1f} s after the teacher was {how.name}"
    assert all(process_gone(pid) for pid in pids.values()) and processes_mentioning(str(path)) == []
    exited = "; rank 1 exited" if how == signal.SIGKILL else ""
    assert run.errors()[0].startswith(f"lost the teacher (rank 1{exited}) during "), run.stderr[-3000:]
    # torchrun reports the workers that had failed when it looked (every 0.1 s): a killed teacher may be alone
    # there, the student exiting 1 within meshkd's grace; the student is never the one torchrun had to kill.
    endings = run.worker_endings()
    assert endings[1] == "signal SIGKILL" and endings.get(0, "exit code 1") == "exit code 1", run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]

"""`meshkd train` on separate meshes under NCCL, one GPU per rank: run where 2 or 4 GPUs are visible.

Student 1 + teacher 1 on two GPUs must follow the CPU's curve for the same config (fp32). Student tp 2 +
teacher tp 2 on four GPUs trains 50 steps with the teacher overlapped and synchronous: no hang, the same
curve, and the teacher wait and throughput of both printed for comparison (`-s` shows them).
"""

import statistics

import pytest
import torch

from tests.gpu import CUDA
from tests.gpu.test_train_nccl import losses, train
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

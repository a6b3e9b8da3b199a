"""A served teacher on cuda:0: `meshkd serve-teacher` runs its teacher on the GPU and a student on the same GPU
trains against it over HTTP, as a user runs both. The student with top-k answers follows the curve of the same run
with the teacher in its own job (the served answers are the in-job teacher's, moved through host memory)."""

import copy
from pathlib import Path

import pytest

from meshkd.recipe.common.metrics import read_metrics
from tests.gpu import CUDA
from tests.gpu.test_train_nccl import train as train_in_job
from tests.recipe.lifecycle.test_teacher_service import Server, finished, student, train, write
from tests.tiny import base_config, with_layout

pytestmark = [*CUDA, pytest.mark.world]

TOPK = {"logits_transport": "topk", "topk": 8, "topk_tail_samples": 4}


def test_a_student_of_a_cuda_served_teacher_follows_the_in_job_curve(tmp_path):
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, {"dp_size": 1})
    config["step_scheduler"]["max_steps"] = 4
    server = Server(write(config, tmp_path / "server.yaml"), 0, tmp_path / "server.log")
    try:
        served = student(config, tmp_path, "served", server.url, TOPK)
        finished(train(write(served, tmp_path / "served.yaml")))
        health = server.health()
    finally:
        server.stop()
    assert health["protocol"] == 1 and health["vocab_rows"] == 262
    in_job = copy.deepcopy(served)
    del in_job["teacher_model"]["url"]
    in_job.pop("separate_meshes"), in_job.pop("teacher_distributed")
    in_job["logging"]["run_dir"] = str(tmp_path / "in_job")
    train_in_job(in_job)
    records, expected = ([r for r in read_metrics(Path(run["logging"]["run_dir"])) if r["kind"] == "train"]
                         for run in (served, in_job))
    assert len(records) == len(expected) == 4
    for record, reference in zip(records, expected):
        assert record["kd_loss"] > 0
        assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5)

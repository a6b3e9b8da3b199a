"""The recipe's start on CUDA, in one process without a GPU: what can be checked before any device is used.

No GPU is needed: the GPU count is simulated (torch.cuda's device_count and is_available patched) and a
device the CPU cannot show is stood in for by the meta device, with the collectives recorded instead of
run (`tests.collectives`). The GPU suite (tests/gpu) runs the same paths on a real device; its own code that
can run without one (the step counter of its host-sync count) runs here in a one-rank gloo world. Last, the
patience of a run's waits in a two-rank gloo world: a student that lays out, saves and exports for longer
than `collective_timeout_s` keeps its teacher.
"""

from __future__ import annotations

import pytest
import torch

from meshkd import cli, launcher
from meshkd.recipe.lifecycle.run import KDRecipe
from meshkd.recipe.lifecycle.world import check_gpu_count, init_world
from meshkd.recipe.settings.config_loading import config_from_dict
from tests.collectives import audited_collectives
from tests.tiny import base_config


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine sees `set(count)` GPUs; set_device fails the test if it is reached."""
    def set_count(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    def no_set_device(device):
        raise AssertionError(f"set_device({device}) was reached")

    monkeypatch.setattr(torch.cuda, "set_device", no_set_device)
    return set_count


def test_more_local_ranks_than_visible_gpus_are_refused_with_the_counts(gpus, monkeypatch, tmp_path):
    config = config_from_dict({**base_config(tmp_path), "device": "cuda"})
    gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"needs 3 processes on this node, one GPU each, but the node sees 2 GPU"):
        init_world(config)
    check_gpu_count(config, 2)  # one GPU each: accepted
    with pytest.raises(ValueError, match="needs 4 processes .* sees 2 GPU"):
        check_gpu_count(config, 4)
    gpus(0)  # device: cuda on a machine without one
    with pytest.raises(ValueError, match="needs 1 processes on this node, one GPU each, but the node sees 0 GPU"):
        check_gpu_count(config, 1)
    # On the CPU (auto without CUDA, or device: cpu) there is no count to meet.
    check_gpu_count(config_from_dict(base_config(tmp_path)), 8)
    gpus(1)
    check_gpu_count(config_from_dict({**base_config(tmp_path), "device": "cpu"}), 8)


def test_meshkd_train_refuses_the_layout_before_starting_processes(gpus, monkeypatch, tmp_path, capsys):
    import yaml

    path = tmp_path / "run.yaml"
    separate = {**base_config(tmp_path), "separate_meshes": True, "distributed": {"dp_size": 2},
                "teacher_distributed": {"dp_size": 1}, "device": "auto"}
    path.write_text(yaml.safe_dump(separate))
    gpus(2)
    monkeypatch.setattr(launcher, "launch", lambda *args: pytest.fail("processes were started"))
    assert cli.main(["train", str(path)]) == 2
    assert "needs 3 processes on this node, one GPU each, but the node sees 2 GPU(s)" in capsys.readouterr().err


def test_the_vocabulary_sizes_are_all_reduced_on_the_role_device(tmp_path):
    recipe = KDRecipe(config_from_dict(base_config(tmp_path)))
    recipe.device = torch.device("meta")  # stands in for cuda: a CPU tensor would be found
    with audited_collectives(recipe.device, forward=False) as calls:
        with pytest.raises(NotImplementedError, match="meta"):  # a meta tensor has no values to read back
            recipe._common_vocab_size(None, {"student": 262})
    assert [call.name for call in calls] == ["all_reduce"]



@pytest.mark.world
@pytest.mark.parametrize("layout", ["separate", "shared"])
def test_the_gpu_suites_step_counter_counts_the_host_syncs_of_every_step_on_the_cpu(tmp_path, layout):
    """The GPU suite's host-sync count, through its own code path in a gloo world: the counter it puts in place
    of the training step must be a step the loop can read and call, and on the CPU it counts the step's reads
    of tensor values by source line. With the teacher on its own rank the training thread reads once per step
    (the step's one reduction); printed with `-s` for both layouts."""
    import json
    from collections import Counter

    from meshkd.core.local_world import spawn_world
    from tests.gpu.test_train_nccl import count_host_syncs, one_gpu, training_syncs
    from tests.tiny import with_layout

    config = one_gpu(tmp_path, "syncs", dtype="float32", device="cpu")
    if layout == "separate":  # student and teacher one rank each
        config = with_layout(config, {"dp_size": 1}, {"dp_size": 1})
    out = tmp_path / "syncs.json"
    world = 2 if layout == "separate" else 1
    assert spawn_world(world, count_host_syncs, (config, str(out)), timeout_s=60, deadline_s=300) is None
    per_step = json.loads(out.read_text())
    assert len(per_step) == config["step_scheduler"]["max_steps"]
    print(f"{layout}: host syncs of the training thread per step {[training_syncs(c) for c in per_step]}; "
          f"all reads, by source: {sum(map(Counter, per_step), Counter()).most_common()}")
    if layout == "separate":
        assert all(0 < training_syncs(counts) <= 2 for counts in per_step), per_step


def train_with_a_busy_student(rank: int, config: dict, pause_s: float) -> None:
    """Run `config` with the student pausing `pause_s` in its lay-out, before each checkpoint save and before
    its HF export, as a slow file system would."""
    import time

    from meshkd.recipe.lifecycle.student_trainer import StudentTrainer
    from meshkd.recipe.modeling import checkpoint

    def slowed(function):
        def call(*args, **kwargs):
            time.sleep(pause_s)
            return function(*args, **kwargs)
        return call

    StudentTrainer.lay_out = slowed(StudentTrainer.lay_out)
    checkpoint.save_checkpoint = slowed(checkpoint.save_checkpoint)
    checkpoint.export_hf = slowed(checkpoint.export_hf)
    KDRecipe(config_from_dict(config)).run()


@pytest.mark.world
def test_a_teacher_keeps_waiting_while_its_student_lays_out_saves_and_exports_past_the_timeout(tmp_path):
    from meshkd.core.local_world import spawn_world
    from meshkd.recipe.common.metrics import read_metrics
    from tests.tiny import with_layout

    config = with_layout(base_config(tmp_path), {"dp_size": 1}, {"dp_size": 1})
    config["checkpoint"] = {"enabled": True, "save_hf": True}
    config["step_scheduler"].update(max_steps=4, ckpt_every_steps=2)
    config["collective_timeout_s"] = 3  # the world's too, as `meshkd train` makes it
    assert spawn_world(2, train_with_a_busy_student, (config, 6.0), timeout_s=3, deadline_s=300) is None
    run_dir = tmp_path / "run"
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == [1, 2, 3, 4]
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    assert (run_dir / "hf_student" / "config.json").is_file()

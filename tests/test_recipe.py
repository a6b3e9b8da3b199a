"""The KD recipe end to end on tiny random-init Llamas: every layout's loss curve equals the
single-process run's (fp32, same seed and global batch), resume continues the curve exactly, bad configs
fail before training, and the CLI runs.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshkd.config import ConfigError, config_from_dict
from meshkd.metrics import read_metrics
from tests.world import run_world

STEPS = 5


def tiny_llama(layers: int, seed: int) -> dict:
    return {
        "random_init": {
            "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 262, "max_position_embeddings": 256,
        },
        "tokenizer": "byte",
        "seed": seed,
    }


def write_corpus(directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(24):
        words = " ".join(f"w{(index * 7 + j * 3) % 23}" for j in range(5 + (index * 5) % 17))
        (directory / f"doc{index:02d}.txt").write_text(f"def f{index}():\n    return '{words}'\n")
    return str(directory / "*.txt")


def base_config(tmp_path: Path) -> dict:
    return {
        "model": tiny_llama(2, seed=1),
        "teacher_model": tiny_llama(3, seed=2),
        "kd": {"kd_ratio": 0.5, "temperature": 2.0},
        "dataset": {"paths": [write_corpus(tmp_path / "corpus")], "val_fraction": 0.2, "seed": 3},
        "step_scheduler": {"max_steps": STEPS, "global_batch_size": 4, "local_batch_size": 1, "sequence_length": 32,
                           "val_batches": 2},
        "optimizer": {"lr": 1e-2, "max_grad_norm": 1.0},
        "lr_scheduler": {"warmup_steps": 1},
        "checkpoint": {"enabled": False},
        "logging": {"run_dir": str(tmp_path / "run"), "progress_bar": False},
        "collective_timeout_s": 60,
    }


def with_layout(config: dict, student: dict, teacher: dict | None) -> dict:
    config = copy.deepcopy(config)
    config["distributed"] = student
    if teacher is not None:
        config["separate_meshes"] = True
        config["teacher_distributed"] = teacher
    return config


class TrainRun:
    """A check that trains `config` in the world it runs in (picklable for spawned ranks)."""

    def __init__(self, config: dict, resume: bool = False) -> None:
        self.config, self.resume, self.__name__ = config, resume, "train"

    def __call__(self) -> None:
        from meshkd.recipe import KDRecipe

        KDRecipe(config_from_dict(self.config), resume=self.resume).run()


def train_in_world(world_size: int, config: dict, *, resume: bool = False) -> list[dict]:
    run_world(world_size, [TrainRun(config, resume)], timeout_s=60, deadline_s=300).check("train")
    return read_metrics(config["logging"]["run_dir"])


def curve(records: list[dict]) -> list[float]:
    """loss, ce_loss, kd_loss of every train step, flattened."""
    return [r[key] for r in records if r["kind"] == "train" for key in ("loss", "ce_loss", "kd_loss")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    config = base_config(tmp_path_factory.mktemp("reference"))
    return train_in_world(1, with_layout(config, {"dp_size": 1}, None))


LAYOUTS = {
    "shared_dp2": ({"dp_size": 2}, None),
    "shared_tp2": ({"dp_size": 1, "tp_size": 2}, None),
    "teacher_dp2": ({"dp_size": 1}, {"dp_size": 2}),
    "teacher_tp2": ({"dp_size": 1}, {"dp_size": 1, "tp_size": 2}),
    "teacher_cp2_packed": ({"dp_size": 1}, {"dp_size": 1, "cp_size": 2}),
    "teacher_pp2": ({"dp_size": 1}, {"dp_size": 1, "pp_size": 2}),
    "student_dp2": ({"dp_size": 2}, {"dp_size": 1}),
    "student_tp2": ({"dp_size": 1, "tp_size": 2}, {"dp_size": 1}),
}


def test_reference_run_learns(reference):
    losses = curve(reference)[::3]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    evals = [r for r in reference if r["kind"] == "eval"]
    assert evals[0]["teacher_val_loss"] > 0 and evals[-1]["val_loss"] < evals[0]["val_loss"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_loss_curve_equals_single_process(layout, reference, tmp_path):
    student, teacher = LAYOUTS[layout]
    config = with_layout(base_config(tmp_path), student, teacher)
    world_size = config_world_size(config)
    records = train_in_world(world_size, config)
    assert curve(records) == pytest.approx(curve(reference), rel=1e-4)


def config_world_size(config: dict) -> int:
    from meshkd.config import required_world_size

    return required_world_size(config_from_dict(config))


def test_resume_after_a_stop_continues_the_curve_exactly(reference, tmp_path):
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, {"dp_size": 1})
    config["checkpoint"] = {"enabled": True, "save_hf": True}
    config["step_scheduler"]["ckpt_every_steps"] = 2
    first = copy.deepcopy(config)
    # Stops after step 3 of a 5-step schedule; the latest checkpoint is step 2.
    first["step_scheduler"]["max_steps"] = 3
    first["lr_scheduler"]["total_steps"] = STEPS
    train_in_world(2, first)
    records = train_in_world(2, config, resume=True)
    resumed = [r for r in records if r["kind"] == "train" and r["step"] > 2]
    assert [r["step"] for r in resumed] == [3, 4, 5]
    assert curve(resumed) == pytest.approx(curve(reference)[6:], rel=1e-4)
    summary = json.loads(Path(config["logging"]["run_dir"], "summary.json").read_text())
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(summary["hf_dir"]).config.num_hidden_layers == 2


@pytest.mark.parametrize(
    "change, message",
    [
        ({"step_scheduler": {"max_step": 3}}, r"step_scheduler.max_step"),
        ({"kd": {"kd_ratio": "high"}}, r"kd.kd_ratio must be a number"),
        ({"kd": {"kd_ratio": 1.5}}, r"kd.kd_ratio must be in \[0, 1\]"),
        ({"optimizer": {"lr": -1.0}}, r"optimizer.lr must be > 0"),
        ({"teacher_distributed": {"dp_size": 1}}, r"teacher_distributed is set but separate_meshes is false"),
        ({"distributed": {"dp_size": 3}, "step_scheduler": {"global_batch_size": 4}}, r"global_batch_size\(4\)"),
        ({"dataset": {"paths": []}}, r"dataset.paths is empty"),
        ({"model": {"path": "x", "random_init": {"model_type": "llama"}}}, r"exactly one of model.path"),
        ({"unknown_section": {}}, r"unknown config key\(s\) \['unknown_section'\]"),
    ],
)
def test_bad_configs_fail_at_load_naming_the_key(tmp_path, change, message):
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, None)
    for section, values in change.items():
        if isinstance(values, dict) and isinstance(config.get(section), dict):
            config[section] = {**config[section], **values}
        else:
            config[section] = values
    with pytest.raises(ConfigError, match=message):
        config_from_dict(config)


def test_cli_trains_end_to_end_and_plots(tmp_path):
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, {"dp_size": 1})
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [sys.executable, "-m", "meshkd", "train", str(config_path), "--set", "step_scheduler.max_steps=2"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(config["logging"]["run_dir"])
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    saved = yaml.safe_load(Path(config["logging"]["run_dir"], "config.yaml").read_text())
    assert saved["step_scheduler"]["max_steps"] == 2


def test_cli_rejects_a_typo_before_starting_processes(tmp_path):
    config_path = tmp_path / "bad.yaml"
    config_path.write_text(yaml.safe_dump({**base_config(tmp_path), "optimiser": {"lr": 1.0}}))
    result = subprocess.run([sys.executable, "-m", "meshkd", "train", str(config_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "optimiser" in result.stderr

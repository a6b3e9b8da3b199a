"""Checkpoint integrity: a manifest of sizes and sha256 written with every checkpoint, checked on resume.

One two-rank world (a dp 2 student sharing its ranks with the teacher) trains, damages checkpoints as a
failing disk or an operator would, and resumes: a damaged newest checkpoint is passed over for the one
before it (the steps after it replay exactly), a run whose every checkpoint is damaged is refused naming
the file, and partial directories left by unfinished saves are removed at the next start.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from meshkd.recipe.common.metrics import read_metrics
from meshkd.recipe.modeling import checkpoint as ckpt
from tests.recipe.lifecycle.test_recipe import TrainRun
from tests.tiny import base_config, with_layout
from tests.world import run_world


class Damage:
    """A check: rank 0 damages files of checkpoints (picklable); every rank waits for it."""

    def __init__(self, root: str, steps: list[int], how: str, name: str) -> None:
        self.root, self.steps, self.how, self.__name__ = root, steps, how, name

    def __call__(self) -> None:
        import torch.distributed as dist

        if dist.get_rank() == 0:
            for step in self.steps:
                directory = ckpt.checkpoint_dir(self.root, step)
                if self.how == "corrupt":  # the size stays, the bytes inside a shard change
                    shard = sorted(directory.glob("*.distcp"))[0]
                    data = bytearray(shard.read_bytes())
                    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
                    shard.write_bytes(bytes(data))
                else:
                    (directory / ".metadata").unlink()
            Path(self.root, "step_00000099.partial").mkdir(exist_ok=True)  # as a save killed half-way leaves it
        dist.barrier()


class ExpectFailure:
    """A check: resuming `config` must raise ValueError; its message is written next to the run."""

    def __init__(self, config: dict, name: str) -> None:
        self.config, self.__name__ = config, name

    def __call__(self) -> None:
        from meshkd.recipe.lifecycle.run import KDRecipe
        from meshkd.recipe.settings.config_loading import config_from_dict

        try:
            KDRecipe(config_from_dict(self.config), resume=True).run()
        except ValueError as error:
            Path(self.config["logging"]["run_dir"]).mkdir(parents=True, exist_ok=True)
            Path(self.config["logging"]["run_dir"], "error.txt").write_text(str(error))
            return
        raise AssertionError("resuming from damaged checkpoints did not fail")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("checkpoints")
    base = with_layout(base_config(tmp), {"dp_size": 2}, None)
    base["checkpoint"] = {"enabled": True, "save_hf": False, "dir": str(tmp / "checkpoints")}
    base["step_scheduler"].update(max_steps=4, ckpt_every_steps=2)
    base["lr_scheduler"]["total_steps"] = 6

    def run_config(name: str, max_steps: int) -> dict:
        config = copy.deepcopy(base)
        config["step_scheduler"]["max_steps"] = max_steps
        config["logging"]["run_dir"] = str(tmp / name)
        return config

    configs = {"first": run_config("first", 4), "resumed": run_config("resumed", 6),
               "all_damaged": run_config("all_damaged", 6)}
    root = base["checkpoint"]["dir"]
    checks = [TrainRun(configs["first"]), Damage(root, [4], "corrupt", "corrupt_newest"),
              TrainRun(configs["resumed"], resume=True), Damage(root, [6, 4], "corrupt", "corrupt_two"),
              Damage(root, [2], "delete", "delete_metadata"), ExpectFailure(configs["all_damaged"], "refused")]
    checks[0].__name__, checks[2].__name__ = "first", "resumed"
    results = run_world(2, checks, timeout_s=60, deadline_s=300)
    for check in checks:
        results.check(check.__name__)
    return {"root": Path(root), **configs}


pytestmark = pytest.mark.world


def test_a_damaged_newest_checkpoint_is_passed_over_for_the_one_before(runs):
    first = {r["step"]: r for r in read_metrics(runs["first"]["logging"]["run_dir"]) if r["kind"] == "train"}
    resumed = {r["step"]: r for r in read_metrics(runs["resumed"]["logging"]["run_dir"]) if r["kind"] == "train"}
    assert sorted(resumed) == [3, 4, 5, 6]  # from step 2: step 4's checkpoint was corrupted
    for step in (3, 4):
        assert resumed[step]["loss"] == first[step]["loss"], f"step {step} differs after the fallback"


def test_every_checkpoint_damaged_is_refused_naming_the_file(runs):
    message = Path(runs["all_damaged"]["logging"]["run_dir"], "error.txt").read_text()
    newest = ckpt.checkpoint_dir(runs["root"], 6)
    assert message.startswith(f"every checkpoint under {runs['root']} is damaged; the newest: {newest}/__"), message
    assert "is corrupted (its sha256 differs from the one written with it)" in message


def test_partial_directories_are_removed_at_the_next_start(runs):
    assert not list(runs["root"].glob("*.partial"))


def test_every_checkpoint_has_a_manifest_of_its_files(runs):
    directory = ckpt.checkpoint_dir(runs["root"], 4)  # corrupted, but no file of it deleted
    manifest = json.loads((directory / "manifest.json").read_text())
    on_disk = {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}
    assert set(manifest) == on_disk - {"manifest.json", "meta.json"}
    assert {"rng_rank0.pt", "rng_rank1.pt"} <= set(manifest)


def test_a_tensor_that_is_not_finite_is_named():
    state = {"a.weight": torch.zeros(2), "b.weight": torch.tensor([1.0, float("nan")]), "c": torch.tensor([1])}
    assert ckpt.nonfinite_tensor(state) == "tensor b.weight holds NaN or inf"
    assert ckpt.nonfinite_tensor({"a": torch.ones(3)}) is None

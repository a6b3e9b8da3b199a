"""`meshkd.commands`: a command reads its config file once, and the overrides it adds reach the workers.

One-rank tier without a process group: `meshkd train` runs its checks in this process and the launch of the
workers is replaced by a record of their command line (starting processes is `tests/test_cli.py`'s part).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from meshkd import commands, launcher
from meshkd.recipe.settings import config_loading
from tests.tiny import base_config, with_layout


def test_train_reads_its_config_once_and_hands_the_selected_layers_to_the_workers(tmp_path, monkeypatch):
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, {"dp_size": 1})
    config["model"]["keep_layers"] = {"auto": 1}  # a selection adds an override and rebuilds the config
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(config))
    reads, launched = [], []
    read_text = Path.read_text

    def counted_read_text(path, *args, **kwargs):
        if Path(path) == config_path:
            reads.append(path)
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counted_read_text)
    monkeypatch.setattr(launcher, "inside_torchrun", lambda: False)
    monkeypatch.setattr(launcher, "launch", lambda world_size, argv: launched.append((world_size, argv)) or 0)
    assert commands.train_command(str(config_path), ["step_scheduler.max_steps=2"], None, False) == 0
    assert len(reads) == 1
    [(world_size, argv)] = launched
    overrides = argv[3::2]
    assert world_size == 2 and argv[:3] == ["train", str(config_path), "--set"]
    assert overrides[0] == "step_scheduler.max_steps=2" and overrides[1].startswith("model.keep_layers=[")
    workers = config_loading.load_config(config_path, overrides)  # what each worker builds
    assert len(workers.model.keep_layers) == 1 and workers.step_scheduler.max_steps == 2


def test_building_a_config_leaves_its_document_as_it_was(tmp_path):
    document = base_config(tmp_path)
    config = config_loading.config_from_dict(document, ["kd.kd_ratio=0.25", "kd.divergence=reverse_kl"])
    assert config.kd.kd_ratio == 0.25 and document["kd"] == base_config(tmp_path)["kd"]

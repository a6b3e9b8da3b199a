"""The meshkd command: end to end through torch's launcher, and early failure on a bad config."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshkd.recipe.common.metrics import read_metrics
from tests.tiny import base_config, with_layout

pytestmark = pytest.mark.world  # every test here runs the meshkd command


def meshkd_train(config_path: Path, *extra: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "meshkd", "train", str(config_path), *extra],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """One `meshkd train` of the tiny config (starting processes is the expensive part, so both tests below
    look at it): max_steps set on the command line, the student's layers measured (`keep_layers: {auto: 1}`),
    a checkpoint every step. Returns what the run left, read before any test adds to it."""
    tmp_path = tmp_path_factory.mktemp("cli")
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, {"dp_size": 1})
    config["model"]["keep_layers"] = {"auto": 1}
    config["checkpoint"] = {"enabled": True, "save_hf": False}
    config["step_scheduler"]["ckpt_every_steps"] = 1
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(config))
    run_dir = Path(config["logging"]["run_dir"])
    result = meshkd_train(config_path, "--set", "step_scheduler.max_steps=2")
    return {"config_path": config_path, "run_dir": run_dir, "stdout": result.stdout, "config": config,
            "steps": [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"],
            "saved": yaml.safe_load((run_dir / "config.yaml").read_text()),
            "selection": json.loads((run_dir / "layer_selection.json").read_text())}


def test_cli_trains_end_to_end_and_plots(trained):
    assert trained["steps"] == [1, 2]
    assert trained["saved"]["step_scheduler"]["max_steps"] == 2
    run_dir = trained["run_dir"]
    plotted = subprocess.run([sys.executable, "-m", "meshkd", "plot", str(run_dir)],
                             capture_output=True, text=True, timeout=120)
    assert plotted.returncode == 0, plotted.stderr[-2000:]
    assert Path(run_dir, "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_ends_with_a_report_of_the_run(trained):
    """How the run ended, its figures before and after beside the teacher's (as summary.json has them), and
    where its outputs are."""
    report = trained["stdout"][trained["stdout"].index("meshkd train: finished"):].splitlines()
    summary = json.loads((trained["run_dir"] / "summary.json").read_text())
    assert report[0].startswith("meshkd train: finished 2 of 2 steps in ")
    assert ": 2 trained in this run, " in report[0]
    assert "tokens/s in the steps" in report[0]
    rows = {line[:36].strip(): line[36:].split() for line in report[1:] if line.startswith("  ") and ":" not in line}
    assert rows[""] == ["before", "after", "teacher"]
    assert rows["held-out loss (nats/token)"] == [f"{summary[key]:.4f}" for key in
                                                  ("val_loss_before", "val_loss_after", "teacher_val_loss")]
    assert rows["KL(teacher || student)"] == [f"{summary[key]:.4f}" for key in ("val_kl_before", "val_kl_after")]
    assert f"  run directory: {trained['run_dir']} (metrics.jsonl, summary.json)" in report
    assert f"  last checkpoint: {trained['run_dir'] / 'checkpoints' / 'step_00000002'}" in report


def test_cli_measures_the_students_layers_once_and_a_resumed_run_keeps_them(trained):
    run_dir = trained["run_dir"]
    chosen = trained["selection"]["keep_layers"]
    assert "least important first" in trained["stdout"] and f"keeping 1 of 2 layers: {chosen}" in trained["stdout"]
    assert trained["saved"]["model"]["keep_layers"] == chosen
    # Another request would be measured again; a resumed run keeps the layers its checkpoint was trained with.
    resumed = meshkd_train(trained["config_path"], "--resume", "--set", "step_scheduler.max_steps=3",
                           "--set", "model.keep_layers.calibration_rows=2", "--quiet")
    assert f"model.keep_layers: {chosen}, as {run_dir / 'layer_selection.json'} records" in resumed.stdout
    assert "meshkd train: finished" not in resumed.stdout  # --quiet
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["keep_layers"] == chosen
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == [1, 2, 3]


def test_cli_rejects_a_typo_before_starting_processes(tmp_path):
    config_path = tmp_path / "bad.yaml"
    config_path.write_text(yaml.safe_dump({**base_config(tmp_path), "optimiser": {"lr": 1.0}}))
    result = subprocess.run([sys.executable, "-m", "meshkd", "train", str(config_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "optimiser" in result.stderr


def test_cli_converts_a_gguf_teacher_once_and_its_workers_load_the_directory(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    from meshkd.recipe.modeling.models import byte_tokenizer
    from tests.recipe.modeling.test_models import tiny_llama, write_gguf

    write_gguf(tiny_llama(seed=11, tie_word_embeddings=True), byte_tokenizer(), tmp_path / "teacher.gguf")
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, {"dp_size": 1})
    config["teacher_model"] = {"path": str(tmp_path / "teacher.gguf")}
    config_path = tmp_path / "gguf.yaml"
    config_path.write_text(yaml.safe_dump(config))
    environment = {**os.environ, "MESHKD_CACHE": str(tmp_path / "cache")}

    def train() -> str:
        result = subprocess.run([sys.executable, "-m", "meshkd", "train", str(config_path), "--set",
                                 "step_scheduler.max_steps=1"], capture_output=True, text=True, timeout=300,
                                env=environment)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    assert "converting" in train() and "converting" not in train()  # once: the second run finds it
    saved = yaml.safe_load(Path(config["logging"]["run_dir"], "config.yaml").read_text())["teacher_model"]
    assert Path(saved["path"]).parent == tmp_path / "cache" and saved["gguf_file"] is None
    assert (Path(saved["path"]) / "model.safetensors").is_file()


def test_local_processes_share_the_cores_and_the_users_thread_count_wins(monkeypatch):
    from meshkd.launcher import threads_per_process

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert [threads_per_process(n) for n in (1, 2, 3, 8, 16)] == ["8", "4", "2", "1", "1"]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_process(1) == "3"


def test_the_demo_reports_bits_per_byte_kl_and_top1_agreement_from_the_summaries(capsys):
    from meshkd.demo_runs import figures_report

    kd = {"teacher_val_bits_per_byte": 0.9504, "val_bits_per_byte_before": 1.6414, "val_bits_per_byte_after": 1.2554,
          "val_kl_before": 1.9482, "val_kl_after": 1.0434, "val_top1_agreement_before": 0.363,
          "val_top1_agreement_after": 0.53}
    figures_report(kd, {"CE-only": {"val_bits_per_byte_after": 1.3}})  # a run from a cache: no KL, no agreement
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:46].strip(): line[46:].split() for line in lines if line.startswith("  ") and line[:46].strip()}
    assert rows == {"teacher": ["0.9504"], "pruned student before healing": ["1.6414", "1.9482", "36.3%"],
                    "after KD healing": ["1.2554", "1.0434", "53.0%"], "after CE-only healing": ["1.3000", "-", "-"]}


def test_the_hidden_states_demo_compares_with_the_text_demo_only(capsys):
    from meshkd.cli import main

    for flag in ("--on-policy", "--cross-tokenizer"):
        assert main(["demo", "--hidden-states", flag]) == 2
        assert "--hidden-states compares with the text demo's KD run" in capsys.readouterr().err


def test_the_cross_tokenizer_demo_refuses_what_kd_cross_tokenizer_does_not_do(capsys):
    from meshkd.cli import main

    for flags, named in ((["--on-policy"], "--on-policy and --cross-tokenizer"), (["--cache"], "leave out --cache")):
        assert main(["demo", "--cross-tokenizer", *flags]) == 2
        assert named in capsys.readouterr().err

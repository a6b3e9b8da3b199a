"""`meshkd plot`: one run's loss terms, several runs' held-out and training CE on one labelled figure."""

import json
from pathlib import Path

import pytest

from meshkd.cli import main
from meshkd.recipe.lifecycle.plot import curves


def write_run(run_dir: Path, *, ce: list[float], kd: list[float], val: list[float], teacher: float) -> str:
    """A run directory's metrics.jsonl: a training record per step, an evaluation before and after."""
    run_dir.mkdir(parents=True)
    records = [{"kind": "eval", "step": 0, "val_loss": val[0], "teacher_val_loss": teacher}]
    records += [{"kind": "train", "step": step, "loss": 0.5 * (c + k), "ce_loss": c, "kd_loss": k}
                for step, (c, k) in enumerate(zip(ce, kd), start=1)]
    records.append({"kind": "eval", "step": len(ce), "val_loss": val[1], "teacher_val_loss": teacher})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(run_dir)


@pytest.fixture
def runs(tmp_path) -> dict[str, str]:
    return {"kd": write_run(tmp_path / "kd", ce=[3.0, 2.5, 2.0], kd=[1.0, 0.8, 0.6], val=[3.2, 2.1], teacher=1.5),
            "ce": write_run(tmp_path / "ce", ce=[3.0, 2.6, 2.2], kd=[0.0, 0.0, 0.0], val=[3.2, 2.4], teacher=1.5)}


def test_one_run_draws_its_loss_terms_and_leaves_out_a_term_of_weight_zero(runs):
    assert set(curves([runs["kd"]])) == {"train loss", "train CE", "train KD", "validation CE",
                                         "teacher validation CE"}
    drawn = curves([runs["ce"]])
    assert "train KD" not in drawn  # kd_ratio 0: logged as 0, not a curve
    assert drawn["validation CE"] == ([0, 3], [3.2, 2.4])


def test_several_runs_share_one_figure_each_curve_labelled_by_its_run(runs, tmp_path):
    drawn = curves([runs["kd"], runs["ce"]], ["KD", "CE only"])
    assert set(drawn) == {"KD: train CE", "KD: validation CE", "CE only: train CE", "CE only: validation CE",
                          "teacher validation CE"}
    assert drawn["KD: train CE"] == ([1, 2, 3], [3.0, 2.5, 2.0])
    assert drawn["CE only: validation CE"] == ([0, 3], [3.2, 2.4])
    assert drawn["teacher validation CE"] == ([0, 3], [1.5, 1.5])
    with pytest.raises(ValueError, match="1 labels for 2 run directories"):
        curves([runs["kd"], runs["ce"]], ["KD"])

    # The command: one PNG for both, beside the first run by default, or where --out says.
    assert main(["plot", runs["kd"], runs["ce"], "--label", "KD", "--label", "CE only"]) == 0
    assert Path(runs["kd"], "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", runs["kd"], runs["ce"], "--out", str(tmp_path / "both.png")]) == 0
    assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"


def test_a_directory_without_metrics_is_named(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "nowhere/metrics.jsonl does not exist" in capsys.readouterr().err

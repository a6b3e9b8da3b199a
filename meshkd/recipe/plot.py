"""`meshkd plot RUN_DIR`: the loss curves of a run (train loss, CE, KD, each teacher's KD; validation loss) as a
PNG."""

from __future__ import annotations

from pathlib import Path

from meshkd.recipe.metrics import read_metrics


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw RUN_DIR/metrics.jsonl to `out` (default RUN_DIR/curves.png); returns the PNG path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError("meshkd plot needs matplotlib: pip install 'meshkd[plotting]'") from error
    records = read_metrics(run_dir)
    train = [r for r in records if r["kind"] == "train" and not r.get("skipped")]  # a skipped step has NaN
    evals = [r for r in records if r["kind"] == "eval"]
    figure, axis = plt.subplots(figsize=(8, 4.5))
    # Several teachers: each one's own divergence (kd_loss/NAME) beside the combined one.
    teachers = [(key, f"train KD to {key.partition('/')[2]}") for key in (train[0] if train else {})
                if key.startswith("kd_loss/")]
    for key, label in (("loss", "train loss"), ("ce_loss", "train CE"), ("kd_loss", "train KD"), *teachers):
        if any(r[key] != 0 for r in train):  # a term of weight 0 (kd_ratio 0 or 1) is logged as 0
            axis.plot([r["step"] for r in train], [r[key] for r in train], label=label)
    if evals:
        axis.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation CE")
        teacher = [r["teacher_val_loss"] for r in evals if "teacher_val_loss" in r]
        if teacher:
            axis.axhline(teacher[0], linestyle="--", color="gray", label="teacher validation CE")
    axis.set_xlabel("step")
    axis.set_ylabel("nats / token")
    axis.set_title(str(run_dir))
    axis.legend()
    out = Path(out) if out is not None else Path(run_dir, "curves.png")
    figure.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(figure)
    return out

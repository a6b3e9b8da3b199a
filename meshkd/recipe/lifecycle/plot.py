"""`meshkd plot RUN_DIR [RUN_DIR ...]`: loss curves as a PNG.

One run: its training loss and its terms (CE, KD, each teacher's KD) and its held-out loss. Several runs
(`meshkd demo --compare`, or runs a user wants side by side): each run's training CE and held-out loss on
one figure, one colour per run, labelled; CE is the term every run has, whatever its `kd_ratio`. The
teacher's held-out loss is a dashed line in both. `curves` says what is drawn; `plot_runs` draws it.
"""

from __future__ import annotations

from pathlib import Path

from meshkd.recipe.common.metrics import read_metrics

Curve = tuple[list[int], list[float]]  # steps, values


def curves(run_dirs: list[str | Path], labels: list[str] | None = None) -> dict[str, Curve]:
    """Label -> (steps, nats per token) of each curve to draw: a run's training terms (one run; a term of
    weight 0, logged as 0, is left out) or each run's training CE (several), each run's held-out loss, and
    the teacher's held-out loss (a constant, as first evaluated)."""
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} run directories")
    labels = labels or [Path(run_dir).name for run_dir in run_dirs]
    drawn: dict[str, Curve] = {}
    teacher = None
    for run_dir, label in zip(run_dirs, labels):
        records = read_metrics(run_dir)
        train = [r for r in records if r["kind"] == "train" and not r.get("skipped")]  # a skipped step has NaN
        evals = [r for r in records if r["kind"] == "eval"]
        if len(run_dirs) == 1:  # several teachers: each one's own divergence (kd_loss/NAME) beside the mix
            keys = dict.fromkeys(key for record in train for key in record)  # routed: a teacher may skip a step
            teachers = [(key, f"train KD to {key.partition('/')[2]}") for key in keys if key.startswith("kd_loss/")]
            terms = [("loss", "train loss"), ("ce_loss", "train CE"), ("kd_loss", "train KD"), *teachers]
            prefix = ""
        else:
            terms, prefix = [("ce_loss", "train CE")], f"{label}: "
        for key, name in terms:
            points = [(r["step"], r[key]) for r in train if key in r]
            if any(value != 0 for _, value in points):
                drawn[prefix + name] = ([step for step, _ in points], [value for _, value in points])
        if evals:
            drawn[prefix + "validation CE"] = ([r["step"] for r in evals], [r["val_loss"] for r in evals])
        if teacher is None:
            teacher = next((r["teacher_val_loss"] for r in evals if "teacher_val_loss" in r), None)
    if teacher is not None:
        steps = [step for xs, _ in drawn.values() for step in xs] or [0]
        drawn["teacher validation CE"] = ([min(steps), max(steps)], [teacher, teacher])
    return drawn


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None, labels: list[str] | None = None) -> Path:
    """Draw `curves(run_dirs, labels)` to `out` (default: RUN_DIR/curves.png for one run, FIRST_RUN_DIR/
    compare.png for several); returns the PNG path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError("meshkd plot needs matplotlib: pip install 'meshkd[plotting]'") from error
    drawn = curves(run_dirs, labels)
    figure, axis = plt.subplots(figsize=(8, 4.5))
    colours = {}  # several runs: a run's curves share a colour, training thin, held-out with markers
    for label, (steps, values) in drawn.items():
        if label == "teacher validation CE":
            axis.axhline(values[0], linestyle="--", color="gray", label=label)
            continue
        run = label.rpartition(": ")[0]
        style = "o-" if label.endswith("validation CE") else "-"
        line = axis.plot(steps, values, style, label=label, color=colours.get(run) if run else None,
                         linewidth=1.0 if run and style == "-" else 1.5)[0]
        colours.setdefault(run, line.get_color())
    axis.set_xlabel("step")
    axis.set_ylabel("nats / token")
    axis.set_title(str(run_dirs[0]) if len(run_dirs) == 1 else "held-out and training CE")
    axis.legend()
    default = Path(run_dirs[0], "curves.png" if len(run_dirs) == 1 else "compare.png")
    out = Path(out) if out is not None else default
    figure.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(figure)
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """One run's curves (`plot_runs` of one directory)."""
    return plot_runs([run_dir], out)

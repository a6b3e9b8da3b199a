"""What `meshkd train` prints when a run ends: how it ended, what it trained, the held-out figures before and
after beside the teacher's, and where its outputs are.

The figures are those of the run's `summary.json` (evaluation keys as `meshkd.recipe.student.evaluation` names
them), plus what only the trainer counts (steps, tokens, times, the last checkpoint); a figure the run did
not measure (the teacher's, when its answers come from a cache) is left out. `logging.summary: false` (or
`meshkd train --quiet`) keeps it quiet for scripts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_ROWS = (  # (label, summary key of the student before / after, the teacher's, format)
    ("held-out loss (nats/token)", "val_loss_before", "val_loss_after", "teacher_val_loss", ".4f"),
    ("held-out bits per byte", "val_bits_per_byte_before", "val_bits_per_byte_after", "teacher_val_bits_per_byte",
     ".4f"),
    ("KL(teacher || student)", "val_kl_before", "val_kl_after", None, ".4f"),
    ("top-1 agreement with the teacher", "val_top1_agreement_before", "val_top1_agreement_after", None, ".1%"),
    ("speculative acceptance (1 - TVD)", "val_acceptance_before", "val_acceptance_after", None, ".1%"),
)


@dataclass
class RunFigures:
    """What the trainer counted in this process (a resumed run counts from its resumed step)."""

    start_step: int
    last_step: int
    max_steps: int
    tokens: float  # valid tokens trained, over the data-parallel ranks
    step_time_s: float  # inside the training steps
    wall_s: float  # from set-up to the end
    run_dir: Path
    checkpoint: Path | None  # the last checkpoint on disk, or None (checkpointing off, or nothing saved)
    stopped: str | None = None  # why the run stopped early, or None when it reached max_steps


def run_report(summary: dict, figures: RunFigures) -> str:
    """The end-of-run report as printed (a few lines)."""
    trained = figures.last_step - figures.start_step
    rate = f", {figures.tokens / figures.step_time_s:,.0f} tokens/s in the steps" if figures.step_time_s > 0 else ""
    resumed = f" (resumed at step {figures.start_step})" if figures.start_step else ""
    if figures.stopped is None:
        head = f"meshkd train: finished {figures.last_step} of {figures.max_steps} steps{resumed}"
    else:
        head = f"meshkd train: stopped at step {figures.last_step} of {figures.max_steps} on {figures.stopped}{resumed}"
    lines = [f"{head} in {figures.wall_s:.1f} s: {trained} trained in this run, {figures.tokens:,.0f} tokens{rate}"]
    if summary.get("skipped_steps"):
        lines.append(f"  skipped steps (a loss or gradient not finite): {summary['skipped_steps']}")
    table = []
    for label, before, after, teacher, spec in _ROWS:
        cells = [format(summary[key], spec) if key in summary else "" for key in (before, after)]
        cells.append(format(summary[teacher], spec) if teacher and teacher in summary else "")
        if any(cells):
            table.append(f"  {label:<34} {cells[0]:>9} {cells[1]:>9} {cells[2]:>9}".rstrip())
    if table:
        lines += [f"  {'':<34} {'before':>9} {'after':>9} {'teacher':>9}", *table]
    lines.append(f"  run directory: {figures.run_dir} (metrics.jsonl, summary.json)")
    if figures.checkpoint is not None:
        lines.append(f"  last checkpoint: {figures.checkpoint}"
                     + (" (continue with --resume)" if figures.stopped is not None else ""))
    if "hf_dir" in summary:
        lines.append(f"  exported model: {summary['hf_dir']}")
    return "\n".join(lines)

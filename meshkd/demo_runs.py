"""What the demos share: the embedded demo config filled in with the installed demo teacher, and the report's
figures (bits per byte, KL to the teacher, top-1 agreement) and curves (`meshkd.demo` and
`meshkd.demo_cross_tokenizer` import it; it imports neither).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path


@functools.lru_cache(maxsize=1)
def _demo_teacher_directory() -> Path:
    """The demo teacher as an HF directory; found (the GGUF file hashed) once per process."""
    from meshkd.recipe.modeling.models import converted_gguf, demo_teacher_source

    source = demo_teacher_source()
    return converted_gguf(source["path"], source["gguf_file"])


def demo_overrides(run_dir: str, extra: list[str]) -> list[str]:
    """Fill the embedded demo config with the installed teacher, converted once from GGUF to an HF directory
    (every process of every run then loads it in a fraction of the time, and sharded)."""
    directory = _demo_teacher_directory()
    return [f"model.path={directory}", f"teacher_model.path={directory}", f"logging.run_dir={run_dir}", *extra]


def figures_report(kd: dict, others: dict[str, dict]) -> None:
    """Bits per byte (comparable across tokenizers), and the KL to the teacher and top-1 agreement with it
    (what distillation optimizes) before and after KD, and after each of `others` (label -> its summary); "-"
    where a run did not report one (a teacher cache holds no distribution for validation rows)."""

    def figure(summary: dict, key: str, spec: str) -> str:
        return format(summary[key], spec) if key in summary else "-"

    print(f"\n{'':<46} {'bits/byte':>9}  {'KL(teacher||student)':>20}  {'top-1 agreement':>15}")
    rows = [("teacher", kd, "teacher_val_bits_per_byte", None),
            ("pruned student before healing", kd, "val_bits_per_byte_before", "_before"),
            ("after KD healing", kd, "val_bits_per_byte_after", "_after")]
    rows += [(f"after {label} healing", summary, "val_bits_per_byte_after", "_after")
             for label, summary in others.items()]
    for label, summary, bits, suffix in rows:
        kl = figure(summary, f"val_kl{suffix}", ".4f") if suffix else ""
        top1 = figure(summary, f"val_top1_agreement{suffix}", ".1%") if suffix else ""
        print(f"  {label:<44} {figure(summary, bits, '.4f'):>9}  {kl:>20}  {top1:>15}")


def print_curves(run_dirs: dict[str, str]) -> None:
    """Draw the runs (label -> run directory) on one figure and print its path (a run alone: its own loss
    terms); where matplotlib is missing the figures printed before stand alone."""
    with contextlib.suppress(RuntimeError):
        from meshkd.recipe.lifecycle.plot import plot_runs

        print(f"\ncurves: {plot_runs(list(run_dirs.values()), labels=list(run_dirs))}")

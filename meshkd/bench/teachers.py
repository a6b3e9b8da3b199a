"""Several teachers at once: the step time of `meshkd train` with two teachers of equal cost, each on a rank of
its own, against the same run with one of them.

    meshkd bench --only teachers [--quick] [--json OUT]

What is measured: `meshkd train` runs of one student with a `teachers:` list of one entry ("one": teacher
`a`) and of two entries ("two": teachers `a` and `b`), every teacher with `distributed: {dp_size: 1}`, so on
a rank of its own (ranks: the student's 0, then `a` on 1, `b` on 2; 2 processes against 3), `kd.combine:
sum` with weights 1 and 1, `kd.overlap_teacher` at its default (true: each teacher is asked for the same
micro-batch at once, on its own thread and bridge, `meshkd.core.teacher_ensemble`), full float32 logits on
the wire. The models are random-init Llamas reading one byte-level BPE of 4096 entries trained here on the
bench's text (`meshkd.bench.cross_tokenizer.bench_texts`: the standard library's json and email sources):
the student hidden 128, 2 layers; each teacher hidden 512, 8 layers (MLP 2048), the same architecture
with another seed, so the two cost the same and a teacher's forward, not the student's step, sets the pace.
A step: 4 rows of 256 tokens in 2 micro-batches of 2, kd_ratio 1, OMP_NUM_THREADS 1 a process unless set.
The runs alternate one, two, one, two, ... in one bench run (`repeats` of each). The figures: the median
`step_time_s` over the steps after the second of every run of a side, the ratio two / one of those
medians, and the medians of `teacher_wait_s` (the step's whole wait for the teachers' answers) and of each
teacher's `teacher_wait_s/NAME` (the ensemble awaits the teachers in list order: `a`'s is the wait for
its answer, `b`'s the further wait for `b`'s once `a`'s has come, about 0 when both work at once).

Were the teachers asked in turn, two would cost about twice one; asked at once, the step costs the slower
teacher. The target (the several-teachers issue): two / one <= 1.15 where every process has cores of its
own (here 3 for the two-teacher run, a thread each). On a machine with fewer cores than processes (a
2-core machine runs the student and two teachers on 2 cores) the teachers compete for the cores and the
figure is reported as measured, not held to the target; `cores_per_process_two` in the results says which
case a run was.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from meshkd.bench.cross_tokenizer import MAX_CHARS, TEXT_PATTERNS, bench_texts, random_llama, train_records

TARGET_RATIO = 1.15
SIZES = {"student_hidden": 128, "student_layers": 2, "teacher_hidden": 512, "teacher_layers": 8, "vocab": 4096,
         "sequence": 256}
SIDES = {"one": ("a",), "two": ("a", "b")}


def _config(root: Path, name: str, tokenizer: str, teachers: tuple[str, ...], steps: int, sizes: dict) -> dict:
    """`meshkd train` of the student with `teachers` (names), each a teacher of the same size on a rank of its
    own; seeds: the student 1, the teachers 2, 3, ..."""
    return {
        "model": random_llama(sizes["student_hidden"], sizes["student_layers"], sizes["vocab"], tokenizer, 1),
        "teachers": [{"name": teacher, "weight": 1.0, "distributed": {"dp_size": 1},
                      "model": random_llama(sizes["teacher_hidden"], sizes["teacher_layers"], sizes["vocab"],
                                            tokenizer, 2 + index)}
                     for index, teacher in enumerate(teachers)],
        "distributed": {"dp_size": 1},
        "kd": {"kd_ratio": 1.0, "chunk_size": 256, "combine": "sum"},
        "dataset": {"paths": TEXT_PATTERNS, "val_fraction": 0.05, "max_document_chars": MAX_CHARS},
        "step_scheduler": {"max_steps": steps, "global_batch_size": 4, "local_batch_size": 2,
                           "sequence_length": sizes["sequence"], "val_batches": 1},
        "optimizer": {"lr": 1e-3}, "checkpoint": {"enabled": False},
        "logging": {"run_dir": str(root / name), "progress_bar": False},
    }


def _median(records: list[dict], key: str) -> float:
    values = [record[key] for record in records if key in record]
    if len(values) != len(records):
        raise RuntimeError(f"{key} is missing from {len(records) - len(values)} of {len(records)} train records")
    return statistics.median(values)


def _each(records: list[dict], key: str, teachers: tuple[str, ...]) -> dict[str, float]:
    """Each teacher's median of `key`: `key/NAME`, or the plain key for one teacher (a list of one is the one
    teacher's run)."""
    return {name: _median(records, f"{key}/{name}" if len(teachers) > 1 else key) for name in teachers}


def run(*, repeats: int, steps: int, sizes: dict = SIZES) -> dict:
    """The section's figures: `repeats` runs of each side, alternating, of `steps` steps each."""
    from meshkd.recipe.modeling.transplant import train_byte_level_bpe

    records: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="meshkd-bench-teachers-") as scratch:
        root = Path(scratch)
        train_byte_level_bpe(bench_texts(), sizes["vocab"]).save_pretrained(root / "tokenizer")
        for repeat in range(repeats):
            for side, teachers in SIDES.items():
                config = _config(root, f"{side}{repeat}", str(root / "tokenizer"), teachers, steps, sizes)
                records[side] += train_records(config, root / f"{side}{repeat}.yaml")
    result: dict = {"sizes": dict(sizes), "repeats": repeats, "steps": steps,
                    "processes": {side: 1 + len(teachers) for side, teachers in SIDES.items()},
                    "cpus": os.cpu_count(),
                    "steps_measured": {side: len(side_records) for side, side_records in records.items()}}
    result["cores_per_process_two"] = (result["cpus"] or 1) / result["processes"]["two"]
    for side, teachers in SIDES.items():
        result[f"step_time_{side}_s"] = _median(records[side], "step_time_s")
        result[f"teacher_wait_{side}_s"] = _median(records[side], "teacher_wait_s")
        result[f"teacher_wait_per_teacher_{side}_s"] = _each(records[side], "teacher_wait_s", teachers)
        result[f"kd_loss_per_teacher_{side}"] = _each(records[side], "kd_loss", teachers)
    result["step_time_ratio_two_over_one"] = result["step_time_two_s"] / result["step_time_one_s"]
    return result


def run_section(quick: bool) -> dict:
    """{"teachers": results}, printed as they are measured; `quick`: one run of each side, 6 steps (else two
    of 12)."""
    started = time.perf_counter()
    results = run(repeats=1 if quick else 2, steps=6 if quick else 12)
    waits = {side: ", ".join(f"{name} {wait:.3f} s" for name, wait in results[f"teacher_wait_per_teacher_{side}_s"]
                             .items()) for side in SIDES}
    shared = results["cores_per_process_two"] < 1
    print(f"teachers: one teacher on its own rank {results['step_time_one_s']:.3f} s a step (teacher wait "
          f"{results['teacher_wait_one_s']:.3f} s: {waits['one']}), two of equal cost each on its own rank "
          f"{results['step_time_two_s']:.3f} s (teacher wait {results['teacher_wait_two_s']:.3f} s: {waits['two']}); "
          f"ratio two / one {results['step_time_ratio_two_over_one']:.3f} (target <= {TARGET_RATIO} where every "
          f"process has cores of its own; {results['cpus']} CPUs for {results['processes']['two']} processes"
          f"{': shared, reported as measured' if shared else ''}; medians of {results['steps_measured']['one']} "
          f"and {results['steps_measured']['two']} steps; the section took {time.perf_counter() - started:.0f} s)")
    return {"teachers": results}

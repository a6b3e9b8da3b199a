"""`meshkd bench`: meshkd's benchmarks, installed with it; every figure is a ratio measured side by side.

    meshkd bench [--quick] [--json OUT] [--only SECTION,...]

Sections (`transport`: bandwidth, latency, overlap, modes, memory; `cache`; `loading`; `precision`;
`step`; `cross_tokenizer`; `teachers`; `served`; `data`; `lora`; `rollouts`), in that order. The JSON file is rewritten
after each section, so an interrupted run keeps what it measured. A section whose prerequisites are missing
(the demo teacher for `modes`, `step` and `cross_tokenizer`, Linux's peak-memory counters for `memory`,
`loading`, `precision` and `lora` on the CPU, a vLLM environment named by MESHKD_VLLM_PYTHON for `rollouts`,
transformers for `modes`, `cache`, `precision`, `step`,
`cross_tokenizer`, `teachers`, `served`, `data`, `lora` and `rollouts`) is skipped with a note saying what to install; a
section that fails is recorded with its error and the others still run
(the exit status is then 1).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

SECTIONS = ("bandwidth", "latency", "overlap", "modes", "memory", "cache", "loading", "precision", "step",
            "cross_tokenizer", "teachers", "served", "data", "lora", "rollouts")
# Sections measured together: the three world sections share one world.
_GROUPS = (("bandwidth", "latency", "overlap"), ("modes",), ("memory",), ("cache",), ("loading",), ("precision",),
           ("step",), ("cross_tokenizer",), ("teachers",), ("served",), ("data",), ("lora",), ("rollouts",))


def missing_prerequisite(section: str) -> str | None:
    """Why `section` cannot run on this machine, or None."""
    needs_transformers = ("modes", "cache", "precision", "step", "cross_tokenizer", "teachers", "served", "data",
                          "lora", "rollouts")
    if section in needs_transformers and importlib.util.find_spec("transformers") is None:
        return "needs transformers: pip install 'meshkd[recipe]'"
    if section in ("modes", "step", "cross_tokenizer"):
        from meshkd.recipe.modeling import models

        try:
            models.demo_teacher_source()
        except ImportError as error:
            return f"needs the demo teacher ({error})"
    if section == "rollouts":
        from meshkd.bench import rollouts

        return rollouts.missing()
    on_cpu = section in ("precision", "lora") and not torch.cuda.is_available()
    if (section in ("memory", "loading") or on_cpu) and not Path("/proc/self/clear_refs").exists():
        return "needs Linux's per-process peak-memory counter (/proc/self/clear_refs)"
    return None


def _run_group(names: list[str], quick: bool) -> dict:
    if names == ["cache"]:
        from meshkd.bench import cache

        return cache.run_section(quick)
    if names == ["loading"]:
        from meshkd.bench import loading

        return loading.run_section(quick)
    if names == ["precision"]:
        from meshkd.bench import precision

        return precision.run_section(quick)
    if names == ["lora"]:
        from meshkd.bench import adapters

        return adapters.run_section(quick)
    if names == ["cross_tokenizer"]:
        from meshkd.bench import cross_tokenizer

        return cross_tokenizer.run_section(quick)
    if names == ["data"]:
        from meshkd.bench import data

        return data.run_section(quick)
    if names == ["teachers"]:
        from meshkd.bench import teachers

        return teachers.run_section(quick)
    if names == ["served"]:
        from meshkd.bench import served

        return served.run_section(quick)
    if names == ["rollouts"]:
        from meshkd.bench import rollouts

        return rollouts.run_section(quick)
    if names == ["step"]:
        from meshkd.bench import step

        return step.run_section(quick)
    from meshkd.bench import transport

    return transport.run(names, quick)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshkd bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, repeats and tokens")
    parser.add_argument("--json", type=Path, default=Path("bench.json"), help="results file (default bench.json)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = parser.parse_args(argv)
    chosen = [name for name in args.only.split(",") if name]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    from meshkd.bench import transport

    started = time.perf_counter()
    results: dict = {
        "meta": {"backend": transport.world_backend(), "torch": torch.__version__, "cpus": os.cpu_count(),
                 "quick": args.quick},
        "skipped": {}, "failed": {},
    }

    def save() -> None:
        results["meta"]["seconds"] = time.perf_counter() - started
        args.json.write_text(json.dumps(results, indent=2))

    for group in _GROUPS:
        names = [name for name in group if name in chosen]
        if not names:
            continue
        why = missing_prerequisite(names[0])
        if why is not None:
            results["skipped"].update(dict.fromkeys(names, why))
            print(f"meshkd bench: skipping {', '.join(names)}: {why}", flush=True)
        else:
            print(f"meshkd bench: {', '.join(names)} ...", flush=True)
            try:
                results.update(_run_group(names, args.quick))
            except Exception as error:  # noqa: BLE001 - one section's failure must not lose the others
                results["failed"].update(dict.fromkeys(names, f"{type(error).__name__}: {error}"))
                print(f"meshkd bench: {', '.join(names)} failed: {type(error).__name__}: {error}", file=sys.stderr)
        save()
    print(transport.report(results))
    save()
    print(f"results written to {args.json}")
    return 1 if results["failed"] else 0

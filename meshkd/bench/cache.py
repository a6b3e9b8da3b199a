"""The offline teacher cache: its bytes per token, its write throughput, and training from it vs a live teacher.

    meshkd bench --only cache [--quick] [--json OUT]

One config, random-init Llamas with a vocabulary of 49152 (the demo's) and the byte tokenizer, on the
Python standard library's json and email sources at sequence 256: a student (hidden 128, 2 layers) on one
rank, a teacher (hidden 512, 8 layers) on one rank of its own, `kd.logits_transport: topk` with k = 64 and
32 tail samples. `meshkd cache-teacher` writes the cache once (bytes per training position from its
manifest, tokens/s as the writer measured them). Then `meshkd train` runs alternately with the live
teacher and from the cache, twice each, 12 steps a run (once, 6 steps, with --quick); the figure is the
median step time over the steps after the second (the first ones warm up), and the ratio cache / live of
those medians, both sides measured in this one run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def _config(root: Path, steps: int) -> dict:
    def llama(hidden: int, layers: int, seed: int) -> dict:
        return {"random_init": {"model_type": "llama", "hidden_size": hidden, "intermediate_size": 4 * hidden,
                                "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 4,
                                "vocab_size": 49152, "max_position_embeddings": 512},
                "tokenizer": "byte", "seed": seed}

    return {
        "model": llama(128, 2, 1), "teacher_model": llama(512, 8, 2),
        "separate_meshes": True, "distributed": {"dp_size": 1}, "teacher_distributed": {"dp_size": 1},
        "kd": {"kd_ratio": 1.0, "logits_transport": "topk", "topk": 64, "topk_tail_samples": 32,
               "chunk_size": 256, "teacher_cache": str(root / "cache")},
        "dataset": {"paths": ["${stdlib}/json/*.py", "${stdlib}/email/*.py"], "val_fraction": 0.05},
        "step_scheduler": {"max_steps": steps, "global_batch_size": 4, "local_batch_size": 2,
                           "sequence_length": 256, "val_batches": 1},
        "optimizer": {"lr": 1e-3}, "checkpoint": {"enabled": False},
        "logging": {"run_dir": str(root / "run"), "progress_bar": False},
    }


def _meshkd(*args: str) -> float:
    started = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run([sys.executable, "-m", "meshkd", *args], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"meshkd {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return time.perf_counter() - started


def _step_times(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record["step_time_s"] for record in records if record["kind"] == "train" and record["step"] > 2]


def run(repeats: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="meshkd-bench-cache-") as scratch:
        root = Path(scratch)
        path = root / "config.yaml"
        path.write_text(yaml.safe_dump(_config(root, steps)))
        write_s = _meshkd("cache-teacher", str(path))
        manifest = json.loads((root / "cache" / "manifest.json").read_text())
        times: dict[str, list[float]] = {"live": [], "cache": []}
        for repeat in range(repeats):
            for side in ("live", "cache"):
                run_dir = root / f"{side}{repeat}"
                cache = [] if side == "cache" else ["--set", "kd.teacher_cache=null"]
                _meshkd("train", str(path), "--set", f"logging.run_dir={run_dir}", *cache)
                times[side] += _step_times(run_dir)
    summary = manifest["summary"]
    live, cached = statistics.median(times["live"]), statistics.median(times["cache"])
    return {
        "bytes_per_position": summary["train_bytes_per_position"],
        "cache_bytes": summary["bytes"], "cached_rows": summary["rows"],
        "write_tokens_per_s": summary["tokens_per_s"], "write_command_s": write_s,
        "step_time_live_s": live, "step_time_cache_s": cached, "step_time_ratio_cache_over_live": cached / live,
        "steps_measured": {side: len(values) for side, values in times.items()},
    }


def run_section(quick: bool) -> dict:
    """{"cache": results}, printed as they are measured; `quick`: one run of each side, 6 steps."""
    results = run(1, 6) if quick else run(2, 12)
    print(f"cache: {results['bytes_per_position']:.1f} bytes per training position (top-64 + 32 tail samples; "
          f"target <= 1024), {results['cache_bytes'] / 2**20:.1f} MiB for {results['cached_rows']['train']} training + "
          f"{results['cached_rows']['validation']} validation rows")
    print(f"write: {results['write_tokens_per_s']:.0f} tokens/s of teacher forward and encoding "
          f"(the whole command {results['write_command_s']:.1f} s)")
    print(f"train step: live teacher {results['step_time_live_s']:.3f} s, from the cache "
          f"{results['step_time_cache_s']:.3f} s, ratio cache / live {results['step_time_ratio_cache_over_live']:.3f}")
    return {"cache": results}

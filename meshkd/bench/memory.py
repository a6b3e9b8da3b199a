"""The transport bench's `memory` section: peak memory of the chunked KD loss against the plain one.

Each measurement runs in a fresh process (`python -m meshkd.bench.memory --memory-probe ...`): after the
inputs exist the kernel's peak-RSS counter is reset and VmHWM is read after backward (on CUDA:
max_memory_allocated); the values are compared with a float64 evaluation. See `meshkd.bench.transport`
for the whole bench.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from meshkd.bench.measure import MIB, median_ratio, status_kib


def _memory_probe(kind: str, vocab: int, sequence: int, chunk_size: int) -> dict:
    """Run in a fresh process: peak bytes of one KD loss forward + backward above its inputs, and its value.

    kind: "naive" (the plain full-softmax path), "chunked", or "float64" (the value only, chunked in float64
    without a gradient: the reference both float32 values are compared with).
    """
    from meshkd.core.loss import kd_loss

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    generator = torch.Generator(device=device).manual_seed(0)
    student = 3 * torch.randn(sequence, vocab, generator=generator, device=device)
    teacher = 3 * torch.randn(sequence, vocab, generator=generator, device=device)
    labels = torch.zeros(sequence, dtype=torch.int64, device=device)
    if kind == "float64":
        with torch.no_grad():
            value = kd_loss(student.double(), teacher.double(), labels, chunk_size=chunk_size)
        return {"peak_bytes": 0, "value": float(value)}
    student.requires_grad_()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS (inputs touched already)
        base = status_kib("VmRSS") * 1024
    loss = kd_loss(student, teacher, labels, chunk_size=None if kind == "naive" else chunk_size)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = status_kib("VmHWM") * 1024
    return {"peak_bytes": peak - base, "value": float(loss.detach())}


def _probe(kind: str, vocab: int, sequence: int, chunk_size: int) -> dict:
    command = [sys.executable, "-m", __name__, "--memory-probe", kind, str(vocab), str(sequence), str(chunk_size)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(settings: dict) -> list[dict]:
    """The section's rows: per vocabulary and chunk size, peak MiB of both losses (medians) and their errors."""
    sequence = settings["memory_sequence"]
    rows = []
    for vocab in settings["memory_vocabs"]:
        exact = _probe("float64", vocab, sequence, 128)["value"]
        naive, chunked = [], {size: [] for size in settings["memory_chunk_sizes"]}
        for repeat in range(settings["memory_repeats"]):
            order = [("naive", None, naive)] + [("chunked", size, sink) for size, sink in chunked.items()]
            for kind, size, sink in order if repeat % 2 == 0 else order[::-1]:
                sink.append(_probe(kind, vocab, sequence, size or 0))
        for size, runs in chunked.items():
            rows.append({
                "vocab": vocab, "sequence": sequence, "chunk_size": size,
                "input_mib": 2 * sequence * vocab * 4 / MIB,
                "naive_mib": statistics.median(r["peak_bytes"] for r in naive) / MIB,
                "chunked_mib": statistics.median(r["peak_bytes"] for r in runs) / MIB,
                "ratio": median_ratio([r["peak_bytes"] for r in runs], [r["peak_bytes"] for r in naive]),
                "chunked_vs_naive": max(abs(c["value"] / n["value"] - 1) for c, n in zip(runs, naive)),
                "chunked_vs_float64": max(abs(c["value"] / exact - 1) for c in runs),
                "naive_vs_float64": max(abs(n["value"] / exact - 1) for n in naive),
            })  # fmt: skip
    return rows


if __name__ == "__main__":  # the memory section's fresh processes
    if len(sys.argv) > 1 and sys.argv[1] == "--memory-probe":
        kind, vocab, sequence, chunk = sys.argv[2], *map(int, sys.argv[3:6])
        print(json.dumps(_memory_probe(kind, vocab, sequence, chunk)))

"""What the bench sections measure with: medians of side-by-side ratios, and this process's memory."""

from __future__ import annotations

import statistics
from pathlib import Path

MIB = 1 << 20


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median of the pairwise ratios: each pair was measured side by side, so a shared machine biases both."""
    return statistics.median(n / d for n, d in zip(numerators, denominators))


def status_kib(field: str) -> int:
    """A /proc/self/status field in KiB (VmHWM: the peak resident memory)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")

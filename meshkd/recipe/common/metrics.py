"""Run observability: a metrics sink that writes on one rank and is a no-op on the others.

`metrics.jsonl` in the run directory gets one JSON object per training step (`"kind": "train"`) and per
evaluation (`"kind": "eval"`); TensorBoard scalars are optional. `print0` keeps `if rank == 0` out of the
recipe; `warn0` says a warning once.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist


def is_logging_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args: Any) -> None:
    """print on global rank 0 only."""
    if is_logging_rank():
        print(*args, flush=True)


def progress_bar(total: int, *, initial: int, desc: str, enabled: bool):
    """A tqdm bar on the logging rank when `enabled` (`logging.progress_bar`); a silent one elsewhere."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True,
                disable=not (is_logging_rank() and enabled))


WARNED_ENV = "MESHKD_WARNED"
"""Environment variable with the warnings `meshkd train` already printed (JSON list): its workers skip them."""
warned: list[str] = []  # what this process warned, in order


def warn0(message: str) -> None:
    """`meshkd: warning: MESSAGE` on stderr, once, from global rank 0 (before there is a world: the process
    torchrun calls rank 0, or the launcher): every rank checks the same things."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0 and message not in warned and message not in json.loads(os.environ.get(WARNED_ENV, "[]")):
        warned.append(message)
        print(f"meshkd: warning: {message}", file=sys.stderr, flush=True)


class MetricsSink:
    """Appends records to RUN_DIR/metrics.jsonl (and TensorBoard) on global rank 0."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = False, resume_step: int | None = None) -> None:
        """`resume_step`: a resumed run keeps the records up to that step and drops the later ones, which
        the interrupted run logged after its last checkpoint and the resumed run logs again."""
        self.active = is_logging_rank()
        self.path = Path(run_dir, "metrics.jsonl")
        self._writer = None
        if not self.active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step is not None and self.path.is_file():
            kept = [r for r in read_metrics(run_dir) if r["step"] <= resume_step]
        self.path.write_text("".join(json.dumps(record) + "\n" for record in kept))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise RuntimeError(
                    "logging.tensorboard needs the tensorboard package: pip install tensorboard"
                ) from error
            self._writer = SummaryWriter(str(Path(run_dir, "tensorboard")))

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        if not self.active:
            return
        record = {"kind": kind, "step": step, **{k: _finite(v) for k, v in values.items()}}
        with self.path.open("a") as sink:
            sink.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for name, value in values.items():
                if isinstance(value, (int, float)):
                    self._writer.add_scalar(f"{kind}/{name}", value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: write them as strings so the file stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl, in order."""
    path = Path(run_dir, "metrics.jsonl")
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a meshkd run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

"""Batches of packed rows: each data-parallel rank's share of every training step, and of the held-out rows.

Training batches: epoch e visits the rows (`meshkd.recipe.corpus.rows.PackedDataset`) in a permutation seeded by
`seed + e`; step s is a pure function of (seed, s), so a resumed run jumps straight to its step. Each global
batch is split contiguously over the data-parallel ranks, so the global batch does not depend on `dp_size`.
Held-out batches cover the rows once, in order, the last step padded so that every rank runs as many.
`to_device` moves a host tensor to a GPU from pinned memory without the host waiting for the copy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import torch

from meshkd.recipe.corpus.rows import PackedDataset


def steps_per_epoch(dataset: PackedDataset, global_batch_size: int) -> int:
    """Optimizer steps in one pass over `dataset`; the last `len(dataset) % global_batch_size` rows of each
    epoch's permutation are left out of that epoch (different rows each epoch)."""
    return len(dataset) // global_batch_size


def iterate_batches(
    dataset: PackedDataset,
    *,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    start_step: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield this data-parallel rank's share of every training step's global batch, forever.

    Epoch e visits the rows in the permutation seeded by `seed + e`, `global_batch_size` rows per step, and
    drops the incomplete tail (see `steps_per_epoch`) so a batch never holds a row twice. Step s's global
    batch is split contiguously: dp rank r gets rows [r * g / dp_size, (r + 1) * g / dp_size). The global
    batch depends on neither `dp_rank` nor `dp_size`. Iteration starts at step `start_step`: a resumed run
    gets exactly the batches it would have seen, at the cost of one permutation, not a replay.

    Yields:
        batch dicts (`BATCH_KEYS`), each tensor int64 [global_batch_size // dp_size, sequence_length].

    Raises:
        ValueError: `global_batch_size` not divisible by `dp_size` or larger than the dataset, or a rank,
            size or step out of range.
    """
    _check_dp(dp_rank, dp_size)
    if global_batch_size < 1 or global_batch_size % dp_size != 0:
        raise ValueError(f"global_batch_size ({global_batch_size}) must be a positive multiple of dp_size ({dp_size})")
    if global_batch_size > len(dataset):
        raise ValueError(
            f"global_batch_size ({global_batch_size}) exceeds the dataset's {len(dataset)} packed rows; "
            f"lower it or add data"
        )
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")
    # Validated above, iterated below: a generator function would only raise on the first next().
    return _training_batches(dataset, global_batch_size, dp_rank, dp_size, seed, start_step)


def _training_batches(
    dataset: PackedDataset, global_batch_size: int, dp_rank: int, dp_size: int, seed: int, start_step: int
) -> Iterator[dict[str, torch.Tensor]]:
    local_batch_size = global_batch_size // dp_size
    for rows in _step_rows(len(dataset), global_batch_size, seed, start_step):
        start = dp_rank * local_batch_size
        yield dataset[rows[start : start + local_batch_size]]  # advanced indexing: a copy


def _step_rows(num_rows: int, global_batch_size: int, seed: int, start_step: int) -> Iterator[torch.Tensor]:
    """The row indices of every step's global batch from `start_step` on, forever (see `iterate_batches`)."""
    per_epoch = num_rows // global_batch_size
    epoch, step_in_epoch = divmod(start_step, per_epoch)
    while True:
        order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))  # = _permutation
        for step in range(step_in_epoch, per_epoch):
            yield order[step * global_batch_size : (step + 1) * global_batch_size]
        epoch, step_in_epoch = epoch + 1, 0


def training_rows(dataset: PackedDataset, *, global_batch_size: int, seed: int, num_steps: int) -> list[int]:
    """The rows that steps [0, num_steps) of `iterate_batches` visit, in order of first visit, each once.

    Independent of the data-parallel layout; once the steps span an epoch, every row the epochs use.
    """
    if not 1 <= global_batch_size <= len(dataset):
        raise ValueError(f"global_batch_size ({global_batch_size}) must be in [1, {len(dataset)}] (the packed rows)")
    seen: dict[int, None] = {}  # insertion-ordered
    for rows in itertools.islice(_step_rows(len(dataset), global_batch_size, seed, 0), num_steps):
        seen.update(dict.fromkeys(rows.tolist()))
        if len(seen) == len(dataset):
            break
    return list(seen)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`. A host tensor goes to a GPU from pinned memory, the host not waiting for the copy
    (torch's pinned-memory allocator keeps the buffer until its copy has run; later work on the same stream
    runs after it)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def split_micro_batches(batch: dict[str, torch.Tensor], num_micro_batches: int) -> list[dict[str, torch.Tensor]]:
    """Split a batch's rows into `num_micro_batches` equal, contiguous micro-batches (views, not copies).

    Raises:
        ValueError: the batch's rows are not divisible by `num_micro_batches`.
    """
    num_rows = next(iter(batch.values())).shape[0]
    if num_micro_batches < 1 or num_rows % num_micro_batches != 0:
        raise ValueError(
            f"a batch of {num_rows} rows cannot be split into {num_micro_batches} equal micro-batches; "
            f"the local batch size (global_batch_size / dp_size) must be a multiple of num_micro_batches"
        )
    size = num_rows // num_micro_batches
    return [{key: value[i * size : (i + 1) * size] for key, value in batch.items()} for i in range(num_micro_batches)]


def eval_batches(
    dataset: PackedDataset,
    *,
    batch_size: int,
    dp_rank: int,
    dp_size: int,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield this rank's batches covering `dataset` once, in order; every rank yields the same number.

    `batch_size` is rows per rank per step. Step t covers rows [t * batch_size * dp_size, (t + 1) *
    batch_size * dp_size), dp rank r taking the r-th `batch_size` of them. The final step is completed
    with padding rows (pad ids, labels -100, mask 0) so that every rank runs the same collectives; they
    carry no token and no target, so sums over valid tokens are unaffected. An empty dataset yields nothing.

    Yields:
        batch dicts (`BATCH_KEYS`), each tensor int64 [batch_size, sequence_length].
    """
    _check_dp(dp_rank, dp_size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return _eval_batches(dataset, batch_size, dp_rank, dp_size)


def _eval_batches(
    dataset: PackedDataset, batch_size: int, dp_rank: int, dp_size: int
) -> Iterator[dict[str, torch.Tensor]]:
    rows_per_step = batch_size * dp_size
    for step in range(math.ceil(len(dataset) / rows_per_step)):
        start = step * rows_per_step + dp_rank * batch_size
        batch = dataset[start : start + batch_size]
        pad = dataset.padding(batch_size - batch["input_ids"].shape[0])
        # Concatenating also copies the slice, so a consumer that edits a batch in place (a CPU .to() is a
        # no-op) cannot change the dataset, as with training batches.
        yield {key: torch.cat([batch[key], pad[key]]) for key in batch}


def _check_dp(dp_rank: int, dp_size: int) -> None:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank ({dp_rank}) must be in [0, dp_size) with dp_size ({dp_size}) >= 1")

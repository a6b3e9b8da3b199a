"""The batch schema: the keys of a batch of packed rows, a split's rows (`PackedDataset`), padding rows, and the
first-fit placement of the token store's packing plans (`meshkd.recipe.corpus.stored_rows`). The layout of each
tensor is `meshkd.recipe.corpus.data`'s module docstring's. A cross-tokenizer row
(`meshkd.recipe.corpus.aligned_data`) carries its teacher side beside it under `teacher_` names (`teacher_side`)
and its groups' columns (`TEACHER_POSITIONS`, `GROUP_ENDS`, `TEACHER_GROUP_ENDS`); KD counts its aligned
positions only (`kd_labels`, `group_positions`). Those keys are `meshkd.core.batch_keys`', which the teacher's
answers read too. Where its groups lie in a micro-batch is read once on the host (`group_layout`) and travels
beside the micro-batch under `GROUP_LAYOUT`, so that the losses chunk it without reading the device back.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from meshkd.core.batch_keys import (  # noqa: F401 (the schema's keys, re-exported)
    BATCH_KEYS,
    GROUP_ENDS,
    TEACHER_GROUP_ENDS,
    TEACHER_KEYS,
    TEACHER_POSITIONS,
    group_positions,
    kd_labels,
    teacher_side,
)

IGNORE_INDEX = -100
"""Label of positions without a target (document ends, padding); the losses skip it."""



class PackedDataset:
    """NEAT-packed rows of one split: four int64 tensors [num_rows, sequence_length] (see `BATCH_KEYS`).

    `dataset[index]` returns the batch dict of the selected rows (an int, slice or index tensor). `extra`
    holds more per-row fields, name -> (int64 tensor [num_rows, any length], its padding value), returned
    with the others (`meshkd.recipe.corpus.aligned_data`: the teacher's own tokenization of each row).
    """

    def __init__(
        self,
        *,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pad_token_id: int,
        num_documents: int,
        extra: dict[str, tuple[torch.Tensor, int]] | None = None,
    ):
        tensors = (input_ids, labels, position_ids, attention_mask)
        assert all(t.dim() == 2 and t.dtype == torch.int64 and t.shape == input_ids.shape for t in tensors)
        self.extra = dict(extra or {})
        assert all(t.dim() == 2 and t.shape[0] == len(input_ids) for t, _ in self.extra.values())
        self.input_ids = input_ids
        self.labels = labels
        self.position_ids = position_ids
        self.attention_mask = attention_mask
        self.pad_token_id = pad_token_id
        self.num_documents = num_documents  # source documents, before long ones were cut into pieces

    def __len__(self) -> int:
        """Number of packed rows."""
        return self.input_ids.shape[0]

    @property
    def sequence_length(self) -> int:
        """Tokens per row."""
        return self.input_ids.shape[1]

    @property
    def num_tokens(self) -> int:
        """Number of non-padding tokens."""
        return int((self.attention_mask != 0).sum())

    def tokens_per_row(self) -> list[int]:
        """Non-padding tokens of each row."""
        return (self.attention_mask != 0).sum(dim=1).tolist()

    def __getitem__(self, index: int | slice | torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch dict of the selected rows; an int selects one row as a batch of one.

        A slice returns views of the dataset's tensors: copy before editing in place.
        """
        if isinstance(index, int):
            index = [index]
        return {key: getattr(self, key)[index] for key in BATCH_KEYS} | {
            key: tensor[index] for key, (tensor, _) in self.extra.items()}

    def padding(self, num_rows: int) -> dict[str, torch.Tensor]:
        """`num_rows` rows of pure padding with every key of a batch (`padding_rows` and the extra fields')."""
        return padding_rows(num_rows, self.sequence_length, self.pad_token_id) | {
            key: torch.full((num_rows, tensor.shape[1]), value, dtype=tensor.dtype)
            for key, (tensor, value) in self.extra.items()}

    def __repr__(self) -> str:
        return (
            f"PackedDataset(rows={len(self)}, sequence_length={self.sequence_length}, "
            f"documents={self.num_documents}, tokens={self.num_tokens})"
        )


def padding_rows(num_rows: int, sequence_length: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """`num_rows` rows of pure padding: no token, no target, no document."""
    shape = (num_rows, sequence_length)
    return {
        "input_ids": torch.full(shape, pad_token_id, dtype=torch.int64),
        "labels": torch.full(shape, IGNORE_INDEX, dtype=torch.int64),
        "position_ids": torch.zeros(shape, dtype=torch.int64),
        "attention_mask": torch.zeros(shape, dtype=torch.int64),
    }


def first_fit(lengths: list[int], capacity: int) -> tuple[list[int], list[int]]:
    """Row and offset of each piece, placed first-fit in order into rows of `capacity` tokens.

    A max-tree over the rows' free space finds the first row with room in O(log rows), so packing stays
    linear-ish on corpora with many rows. Rows not yet opened are empty, so the first row with room is
    either an open one or the next new one, and rows are numbered in the order they open.
    """
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    free = [capacity] * (2 * size)  # free[size + row] is the free space of row; inner nodes hold maxima
    rows, offsets = [], []
    for length in lengths:
        node = 1
        while node < size:
            node = 2 * node if free[2 * node] >= length else 2 * node + 1
        row = node - size
        rows.append(row)
        offsets.append(capacity - free[node])
        free[node] -= length
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return rows, offsets


GROUP_LAYOUT = "group_layout"
"""Beside a cross-tokenizer micro-batch's tensors on its way to the loss (never in a teacher request): its
`GroupLayout`, read from its rows on the host."""


@dataclass(frozen=True)
class GroupLayout:
    """Where the groups KD counts lie in a micro-batch (`group_positions`' order), read on the host once so that the
    fused output layer cuts them into chunks with Python ints (`meshkd.recipe.teacher.group_answers`).

    Groups are disjoint runs of student positions in row-major order, so their last positions ascend and the groups
    that end in a run of positions are a contiguous range (`ending`)."""

    ends: tuple[int, ...]
    """Each group's last flat position (row * length + column), ascending."""
    last: torch.Tensor
    """The same, int64 [groups] on the host."""
    group_of: torch.Tensor
    """int64 [rows * length] on the host: at each of a group's positions before its last, the group's index;
    `num_groups` elsewhere."""
    malformed: bool
    """Whether a target inside a group (before its last position) is no token id."""

    @property
    def num_groups(self) -> int:
        """The groups KD counts."""
        return len(self.ends)

    def ending(self, start: int, end: int) -> tuple[int, int]:
        """The range [first, stop) of the groups whose last position lies in [start, end)."""
        return bisect.bisect_left(self.ends, start), bisect.bisect_left(self.ends, end)


def group_layout(batch: dict, *, ignore_index: int) -> GroupLayout:
    """The `GroupLayout` of a cross-tokenizer batch (on a device: one copy to the host, which waits for it)."""
    keys = ("labels", TEACHER_POSITIONS, GROUP_ENDS)
    host = dict(zip(keys, torch.stack([batch[key] for key in keys]).cpu()))
    length = host["labels"].shape[1]
    first = group_positions(host, None, length, ignore_index)
    last = group_positions(host, GROUP_ENDS, length, ignore_index)
    assert bool((first <= last).all()) and bool((first[1:] > last[:-1]).all()), "aligned groups overlap"
    lengths = last - first
    group_of = torch.full((host["labels"].numel(),), len(first), dtype=torch.int64)
    # Each group's positions before its last: first, first + 1, ..., last - 1.
    earlier = first.repeat_interleave(lengths) + torch.arange(int(lengths.sum())) - (
        (lengths.cumsum(0) - lengths).repeat_interleave(lengths))
    group_of[earlier] = torch.arange(len(first)).repeat_interleave(lengths)
    malformed = bool((host["labels"].reshape(-1)[earlier] < 0).any())
    return GroupLayout(ends=tuple(last.tolist()), last=last, group_of=group_of, malformed=malformed)


def with_group_layout(batch: dict, host_batch: dict | None, *, ignore_index: int) -> dict:
    """`batch` with its `GroupLayout` under `GROUP_LAYOUT` (read from `host_batch`, the same rows on the host, when
    given) if it is a cross-tokenizer batch whose groups a loss merges (`GROUP_ENDS`); else `batch` itself."""
    if GROUP_ENDS not in batch or GROUP_LAYOUT in batch:
        return batch
    return batch | {GROUP_LAYOUT: group_layout(batch if host_batch is None else host_batch, ignore_index=ignore_index)}

"""The keys of a batch of packed rows that the teacher's answers read: every batch's four tensors, and a
cross-tokenizer row's teacher side (under `teacher_` names) and its groups' columns.

`meshkd.recipe.corpus.rows` is the batch schema (it re-exports these); the answers
(`meshkd.core.answers`) read a micro-batch through them: which labels KD counts (`kd_labels`), the groups'
flat positions (`group_positions`), the teacher's own tokenization (`teacher_side`).
"""

from __future__ import annotations

import torch

BATCH_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")
"""Keys of every batch dict, each an int64 tensor [rows, sequence_length]."""
TEACHER_POSITIONS = "teacher_positions"
"""A cross-tokenizer row's key: at a group's first student column, the teacher column paired with it (-1 elsewhere)."""
GROUP_ENDS, TEACHER_GROUP_ENDS = "group_ends", "teacher_group_ends"
"""Beside `teacher_positions`, at a group's first student column: the columns of the logits predicting the
group's last token, the student's and the teacher's (what `uld` and `gold` merge a group over)."""
TEACHER_KEYS = tuple(f"teacher_{key}" for key in BATCH_KEYS)
"""The teacher's side of a row: its `input_ids`, `labels`, `position_ids`, `attention_mask`."""


def teacher_side(batch: dict) -> dict:
    """The teacher's tokenization of a cross-tokenizer batch, under the plain keys (itself otherwise)."""
    return {key: batch[f"teacher_{key}"] for key in BATCH_KEYS} if TEACHER_POSITIONS in batch else batch


def kd_labels(batch: dict, ignore_index: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The labels KD counts: a cross-tokenizer batch's aligned positions only, else all of `labels`; `rows`: a bool
    [rows] mask, the labels of the other rows left out (several teachers routed per row)."""
    positions = batch.get(TEACHER_POSITIONS)
    labels = batch["labels"] if positions is None else batch["labels"].masked_fill(positions < 0, ignore_index)
    return labels if rows is None else labels.masked_fill(~rows[:, None], ignore_index)


def group_positions(batch: dict, key: str | None, length: int, ignore_index: int) -> torch.Tensor:
    """Flat positions (row * `length` + column) held by `batch[key]` (None: the first student columns
    themselves) at the groups KD counts (`kd_labels`), in row-major order of their first student column:
    the order in which both sides list a micro-batch's groups."""
    paired = kd_labels(batch, ignore_index) != ignore_index
    rows = torch.arange(len(paired), device=paired.device)[:, None].expand_as(paired)
    columns = torch.arange(paired.shape[1], device=paired.device).expand_as(paired) if key is None else batch[key]
    return rows[paired] * length + columns[paired]


__all__ = ["BATCH_KEYS", "GROUP_ENDS", "TEACHER_GROUP_ENDS", "TEACHER_KEYS", "TEACHER_POSITIONS", "group_positions",
           "kd_labels", "teacher_side"]

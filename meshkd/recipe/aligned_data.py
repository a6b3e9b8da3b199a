"""Rows for a teacher with another tokenizer: each row's text in both tokenizations, aligned by bytes.

With `kd.cross_tokenizer` the documents are read and split as `meshkd.recipe.data` does, then both
tokenizations are packed into the same rows (`meshkd.core.token_alignment.pack_aligned`: NEAT rows,
documents never mixed, each side its own sequence length). A row holds the student's keys
(`data.BATCH_KEYS`), the teacher's under `teacher_` names (`TEACHER_KEYS`), and `teacher_positions`
[rows, student sequence length]: at each student position that predicts an aligned group's first token, the
teacher position that predicts that group's first token on its side (both models have read the same bytes
there); -1 elsewhere. The teacher answers at those positions, projected onto the student's vocabulary
(`meshkd.recipe.teacher_worker.TeacherForward`); KD counts only them (`kd_labels`), the cross-entropy every
student label. With one tokenizer on both sides every label is such a position and the projection is the
identity, so the objective is plain KD's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshkd.core.token_alignment import AlignedBatch, pack_aligned
from meshkd.recipe.data import BATCH_KEYS, IGNORE_INDEX, PackedDataset, pad_token_id

TEACHER_POSITIONS = "teacher_positions"
TEACHER_KEYS = tuple(f"teacher_{key}" for key in BATCH_KEYS)
"""The teacher's side of a row: its `input_ids`, `labels`, `position_ids`, `attention_mask`."""


def run_packing(config, student_tokenizer, teacher_tokenizer) -> Callable[[list[str]], PackedDataset] | None:
    """The `pack_texts` of a run's datasets (`data.build_run_datasets`): both sides' with `kd.cross_tokenizer`,
    None (the student tokenizer's own packing) without."""
    if config.kd.cross_tokenizer is None:
        return None
    return aligned_packing(student_tokenizer, teacher_tokenizer, sequence_length=config.step_scheduler.sequence_length,
                           teacher_sequence_length=config.teacher_sequence_length, pack=config.dataset.packing)


def aligned_packing(student_tokenizer, teacher_tokenizer, *, sequence_length: int, teacher_sequence_length: int,
                    pack: bool) -> Callable[[list[str]], PackedDataset]:
    """`data.build_datasets`' `pack_texts` of a cross-tokenizer run: texts -> aligned rows of both sides
    (no special tokens, each side's EOS appended, as `meshkd.recipe.data` tokenizes)."""

    def pack_texts(texts: list[str]) -> PackedDataset:
        aligned = pack_aligned(texts, student_tokenizer, teacher_tokenizer, student_sequence_length=sequence_length,
                               teacher_sequence_length=teacher_sequence_length, pack=pack)
        padding = {"input_ids": pad_token_id(teacher_tokenizer), "labels": IGNORE_INDEX}
        extra = {f"teacher_{key}": (aligned.teacher[key], padding.get(key, 0)) for key in BATCH_KEYS}
        extra[TEACHER_POSITIONS] = (teacher_positions(aligned), -1)
        return PackedDataset(**aligned.student, pad_token_id=pad_token_id(student_tokenizer),
                             num_documents=len(texts), extra=extra)

    return pack_texts


def teacher_positions(aligned: AlignedBatch) -> torch.Tensor:
    """[rows, student sequence length]: the teacher column paired with each student column (-1: none)."""
    groups, positions = aligned.groups, torch.full_like(aligned.student["input_ids"], -1)
    student_length, teacher_length = aligned.student["input_ids"].shape[1], aligned.teacher["input_ids"].shape[1]
    positions[groups.row, groups.student_first - groups.row * student_length] = (
        groups.teacher_first - groups.row * teacher_length)
    return positions


def teacher_side(batch: dict) -> dict:
    """The teacher's tokenization of a cross-tokenizer batch, under the plain keys (itself otherwise)."""
    return {key: batch[f"teacher_{key}"] for key in BATCH_KEYS} if TEACHER_POSITIONS in batch else batch


def kd_labels(batch: dict, ignore_index: int) -> torch.Tensor:
    """The labels KD counts: a cross-tokenizer batch's aligned positions only, else all of `labels`."""
    positions = batch.get(TEACHER_POSITIONS)
    return batch["labels"] if positions is None else batch["labels"].masked_fill(positions < 0, ignore_index)

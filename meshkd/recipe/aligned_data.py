"""Rows for a teacher with another tokenizer: each row's text in both tokenizations, aligned by bytes.

With `kd.cross_tokenizer` the documents are read and split as `meshkd.recipe.data` does, then both
tokenizations are packed into the same rows (`meshkd.core.token_alignment.pack_aligned`: NEAT rows,
documents never mixed, each side its own sequence length). A row holds the student's keys
(`data.BATCH_KEYS`), the teacher's under `teacher_` names (`TEACHER_KEYS`), and `teacher_positions`
[rows, student sequence length]: at each student position that predicts an aligned group's first token, the
teacher position that predicts that group's first token on its side (both models have read the same bytes
there); -1 elsewhere. The teacher answers at those positions, projected onto the student's vocabulary
(`meshkd.recipe.teacher_worker.TeacherForward`); KD counts only them (`kd_labels`), the cross-entropy every
student label, both divided by the step's valid student labels (so a KD term weighs what it weighs with one
tokenizer). With one tokenizer on both sides every label is such a position and the projection is the
identity, so the objective is plain KD's. With `loss: uld` or `gold` the teacher answers each counted
group's chain-rule distribution over its own vocabulary instead (`teacher_group_log_probs`, the groups listed
in one order on both sides by `group_positions`), and the student's loss compares its groups with them
(`group_kd_loss`). On-policy rows, made of the student's own samples, get their
teacher side when they are made (`CompletionAligner`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshkd.core.cross_tokenizer_loss import VocabularyMap, gold_loss, group_log_probs, uld_loss
from meshkd.core.token_alignment import AlignedBatch, align_token_spans, pack_aligned
from meshkd.core.token_bytes import decode_with_byte_spans, encode_with_byte_spans, token_bytes
from meshkd.recipe.data import BATCH_KEYS, IGNORE_INDEX, PackedDataset, pad_token_id, padding_rows

TEACHER_POSITIONS = "teacher_positions"
GROUPS = "groups"
"""The mode of a `uld` / `gold` teacher answer: {"mode": GROUPS, "log_probs": [groups, teacher vocab]}."""
GROUP_ENDS, TEACHER_GROUP_ENDS = "group_ends", "teacher_group_ends"
"""Beside `teacher_positions`, at a group's first student column: the columns of the logits predicting the
group's last token, the student's and the teacher's (what `uld` and `gold` merge a group over)."""
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
        extra.update({key: (columns, -1) for key, columns in group_columns(aligned).items()})
        return PackedDataset(**aligned.student, pad_token_id=pad_token_id(student_tokenizer),
                             num_documents=len(texts), extra=extra)

    return pack_texts


def group_columns(aligned: AlignedBatch) -> dict[str, torch.Tensor]:
    """`TEACHER_POSITIONS`, `GROUP_ENDS`, `TEACHER_GROUP_ENDS`, each [rows, student sequence length], set at
    the student column that predicts each group's first token, -1 elsewhere."""
    groups = aligned.groups
    student_length, teacher_length = aligned.student["input_ids"].shape[1], aligned.teacher["input_ids"].shape[1]
    at = (groups.row, groups.student_first - groups.row * student_length)
    columns = {}
    for key, positions, length in ((TEACHER_POSITIONS, groups.teacher_first, teacher_length),
                                   (GROUP_ENDS, groups.student_last, student_length),
                                   (TEACHER_GROUP_ENDS, groups.teacher_last, teacher_length)):
        columns[key] = torch.full_like(aligned.student["input_ids"], -1)
        columns[key][at] = positions - groups.row * length
    return columns


def group_positions(batch: dict, key: str | None, length: int, ignore_index: int) -> torch.Tensor:
    """Flat positions (row * `length` + column) held by `batch[key]` (None: the first student columns
    themselves) at the groups KD counts (`kd_labels`), in row-major order of their first student column:
    the order in which both sides list a micro-batch's groups."""
    paired = kd_labels(batch, ignore_index) != ignore_index
    rows = torch.arange(len(paired), device=paired.device)[:, None].expand_as(paired)
    columns = torch.arange(paired.shape[1], device=paired.device).expand_as(paired) if key is None else batch[key]
    return rows[paired] * length + columns[paired]


def teacher_group_log_probs(logits: torch.Tensor, batch: dict, *, temperature: float,
                            ignore_index: int) -> torch.Tensor:
    """[groups, teacher vocab]: the teacher's chain-rule distribution of each group KD counts
    (`meshkd.core.cross_tokenizer_loss.group_log_probs`), from its logits of the batch's teacher side."""
    teacher = teacher_side(batch)
    length = teacher["input_ids"].shape[1]
    # The next token: inside a group it is the same document's, and the group's merge reads only those.
    targets = torch.roll(teacher["input_ids"], -1, dims=1)
    return group_log_probs(logits, targets, group_positions(batch, TEACHER_POSITIONS, length, ignore_index),
                           group_positions(batch, TEACHER_GROUP_ENDS, length, ignore_index), temperature=temperature)


def group_kd_loss(logits: torch.Tensor, batch: dict, teacher_log_probs: torch.Tensor, kd, *,
                  num_valid_tokens: float, vocabulary_map: VocabularyMap | None) -> torch.Tensor:
    """`kd.cross_tokenizer.loss` `uld` or `gold` of a micro-batch: the student's groups against the teacher's
    group distributions (`teacher_group_log_probs`), summed and divided by `num_valid_tokens`."""
    length, ignore = batch["input_ids"].shape[1], kd.ignore_index
    common = {"student_first": group_positions(batch, None, length, ignore),
              "student_last": group_positions(batch, GROUP_ENDS, length, ignore),
              "temperature": kd.temperature, "num_valid_tokens": num_valid_tokens}
    if kd.cross_tokenizer.loss == "uld":
        return uld_loss(logits, batch["labels"], teacher_log_probs, **common)
    return gold_loss(logits, batch["labels"], teacher_log_probs, vocabulary_map, divergence=kd.divergence, **common)


def teacher_side(batch: dict) -> dict:
    """The teacher's tokenization of a cross-tokenizer batch, under the plain keys (itself otherwise)."""
    return {key: batch[f"teacher_{key}"] for key in BATCH_KEYS} if TEACHER_POSITIONS in batch else batch


def kd_labels(batch: dict, ignore_index: int) -> torch.Tensor:
    """The labels KD counts: a cross-tokenizer batch's aligned positions only, else all of `labels`."""
    positions = batch.get(TEACHER_POSITIONS)
    return batch["labels"] if positions is None else batch["labels"].masked_fill(positions < 0, ignore_index)


def completion_aligner(config, student_tokenizer, teacher_tokenizer) -> CompletionAligner | None:
    """What gives a run's on-policy rows their teacher side: with `kd.cross_tokenizer` when the student
    completes prompts (`kd.generates`), else None."""
    if config.kd.cross_tokenizer is None or not config.kd.generates:
        return None
    return CompletionAligner(student_tokenizer, teacher_tokenizer, ignore_index=config.kd.ignore_index,
                             teacher_sequence_length=config.teacher_sequence_length)


class CompletionAligner:
    """The teacher's side of on-policy rows (`meshkd.recipe.on_policy.completion_batch`: prompt + the student's
    completion in a row of its own): the text the student's tokens spell (`decode_with_byte_spans`; bytes a
    sample left invalid read as U+FFFD) tokenized by the teacher, aligned, with `teacher_positions` as in
    dataset rows. The teacher's labels are its tokens that start in the completion. A teacher tokenization
    longer than `teacher_sequence_length` is cut: the groups past it are not distilled."""

    def __init__(self, student_tokenizer, teacher_tokenizer, *, teacher_sequence_length: int,
                 ignore_index: int) -> None:
        self.table = token_bytes(student_tokenizer)
        self.teacher_tokenizer, self.length = teacher_tokenizer, teacher_sequence_length
        self.ignore_index = ignore_index

    def __call__(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`rows` with the teacher's keys (`TEACHER_KEYS`, `TEACHER_POSITIONS`) on their device."""
        input_ids, labels, mask = (rows[key].cpu() for key in ("input_ids", "labels", "attention_mask"))
        teacher = padding_rows(len(input_ids), self.length, pad_token_id(self.teacher_tokenizer))
        columns = {key: torch.full_like(input_ids, -1) for key in (TEACHER_POSITIONS, GROUP_ENDS, TEACHER_GROUP_ENDS)}
        for row in range(len(input_ids)):
            count = int((mask[row] != 0).sum())
            targets = (labels[row] != self.ignore_index).nonzero()
            if count == 0 or len(targets) == 0:
                continue
            text, student = decode_with_byte_spans(input_ids[row, :count].tolist(), self.table)
            (spans,) = encode_with_byte_spans(self.teacher_tokenizer, [text], add_eos=False)
            ids = spans.ids[: self.length]
            completion = student.starts[int(targets[0]) + 1]  # the first generated token's first byte
            teacher["input_ids"][row, : len(ids)] = torch.tensor(ids)
            teacher["position_ids"][row, : len(ids)] = torch.arange(len(ids))
            teacher["attention_mask"][row, : len(ids)] = 1
            for k in range(1, len(ids)):
                if spans.starts[k] >= completion:
                    teacher["labels"][row, k - 1] = ids[k]
            alignment = align_token_spans(student, spans)
            for g in range(alignment.num_groups):
                s0, s1 = alignment.student_bounds[g], alignment.student_bounds[g + 1]
                t0, t1 = alignment.teacher_bounds[g], alignment.teacher_bounds[g + 1]
                if s0 >= 1 and t0 >= 1 and s1 > s0 and len(ids) >= t1 > t0:
                    ends = ((TEACHER_POSITIONS, t0 - 1), (GROUP_ENDS, s1 - 2), (TEACHER_GROUP_ENDS, t1 - 2))
                    for key, column in ends:
                        columns[key][row, s0 - 1] = column
        device = rows["input_ids"].device
        return rows | {f"teacher_{key}": value.to(device) for key, value in teacher.items()} | {
            key: value.to(device) for key, value in columns.items()}

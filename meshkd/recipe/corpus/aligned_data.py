"""Rows for a teacher with another tokenizer: each row's text in both tokenizations, aligned by bytes.

With `kd.cross_tokenizer` the documents are read and split as `meshkd.recipe.corpus.data` does, then both
tokenizations are packed into the same rows (`meshkd.core.aligned_packing.pack_aligned`: NEAT rows,
documents never mixed, each side its own sequence length: both checked against the corpus's first
documents at preflight, `check_row_lengths`, and their fill logged, `row_fill`). A row holds the student's keys
(`rows.BATCH_KEYS`), the teacher's under `teacher_` names (`TEACHER_KEYS`), and `teacher_positions`
[rows, student sequence length]: at each student position that predicts an aligned group's first token, the
teacher position that predicts that group's first token on its side (both models have read the same bytes
there); -1 elsewhere. The teacher answers at those positions, projected onto the student's vocabulary
(`meshkd.recipe.teacher.teacher_worker.TeacherForward`); KD counts only them (`kd_labels`), the cross-entropy every
student label, both divided by the step's valid student labels (so a KD term weighs what it weighs with one
tokenizer). With one tokenizer on both sides every label is such a position and the projection is the
identity, so the objective is plain KD's. With `loss: uld` or `gold` the teacher answers each counted
group's chain-rule distribution over its own vocabulary instead (`teacher_group_log_probs`, the groups listed
in one order on both sides by `group_positions`), and the student's loss compares its groups with them
(`group_kd_loss`). On-policy rows, made of the student's own samples, get their
teacher side when they are made (`CompletionAligner`).

Chat and prompt / completion rows are rendered by each side's own template (`meshkd.recipe.records`), so the
two texts differ but for the answers: each side's labels are its own answer tokens, and only the answers'
bytes are aligned (`align_shared_spans`; `pack_rows`); the rest of each side pairs with nothing, so KD counts
the answers alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshkd.core.aligned_packing import AlignedBatch, GroupTooLongError, pack_aligned_documents, pad_token_id
from meshkd.core.token_alignment import align_shared_spans, align_token_spans
from meshkd.core.token_bytes import (
    TokenSpans,
    decode_with_byte_spans,
    encode_with_byte_spans,
    encode_with_byte_spans_and_offsets,
    token_bytes,
)
from meshkd.recipe.common.metrics import warn0
from meshkd.recipe.corpus.rows import (
    BATCH_KEYS,
    GROUP_ENDS,
    IGNORE_INDEX,
    TEACHER_GROUP_ENDS,
    TEACHER_POSITIONS,
    PackedDataset,
    padding_rows,
)
from meshkd.recipe.corpus.tokenizing import answer_tokens
from meshkd.recipe.records import Document
from meshkd.recipe.settings.config import ConfigError

TEACHER_LENGTH_KEY = "kd.cross_tokenizer.teacher_sequence_length"
ROW_FILL_SAMPLE_CHARS = 64 << 10
"""`check_row_lengths` packs the corpus's first documents up to this many characters (packing is pure Python
and runs in every process's preflight: about half a second for this much)."""
MIN_ROW_FILL = 0.9
"""Below this share of a side's row positions holding a token, a teacher row length more than 10% off the one
the measured token ratio gives is warned about (`check_row_lengths`)."""


def run_packing(config, student_tokenizer, teacher_tokenizer) -> Callable[[list[str]], PackedDataset] | None:
    """The `pack_texts` of a run's datasets (`data.build_run_datasets`): both sides' with `kd.cross_tokenizer`,
    None (the student tokenizer's own packing) without."""
    if config.kd.cross_tokenizer is None:
        return None
    return aligned_packing(student_tokenizer, teacher_tokenizer, sequence_length=config.step_scheduler.sequence_length,
                           teacher_sequence_length=config.teacher_sequence_length, pack=config.dataset.packing)


def aligned_packing(student_tokenizer, teacher_tokenizer, *, sequence_length: int, teacher_sequence_length: int,
                    pack: bool) -> AlignedPacking:
    """The packing of a cross-tokenizer run's rows (`AlignedPacking`)."""
    return AlignedPacking(student_tokenizer, teacher_tokenizer, sequence_length, teacher_sequence_length, pack)


@dataclass(frozen=True)
class AlignedPacking:
    """The packing of a cross-tokenizer run: texts -> aligned rows of both sides (no special tokens, each side's
    EOS appended, as `meshkd.recipe.corpus.data` tokenizes). A run passes it to `data.build_run_datasets`, whose
    token store (`meshkd.recipe.corpus.corpus_store`) keeps both sides and packs the same rows from its settings;
    called on texts, it packs them in memory (a sample's row fill at preflight, `check_row_lengths`)."""

    student_tokenizer: Any
    teacher_tokenizer: Any
    sequence_length: int
    teacher_sequence_length: int
    pack: bool

    def __call__(self, texts: list[str]) -> PackedDataset:
        try:
            aligned = pack_rows(texts, self.student_tokenizer, self.teacher_tokenizer,
                                sequence_length=self.sequence_length,
                                teacher_sequence_length=self.teacher_sequence_length, pack=self.pack)
        except GroupTooLongError as error:
            raise row_too_short(error, self.sequence_length, self.teacher_sequence_length) from None
        padding = teacher_padding(self.teacher_tokenizer)
        extra = {f"teacher_{key}": (aligned.teacher[key], padding.get(key, 0)) for key in BATCH_KEYS}
        extra.update({key: (columns, -1) for key, columns in group_columns(aligned).items()})
        return PackedDataset(**aligned.student, pad_token_id=pad_token_id(self.student_tokenizer),
                             num_documents=len(texts), extra=extra)


def teacher_padding(teacher_tokenizer) -> dict[str, int]:
    """The padding value of each of the teacher's keys that is not 0."""
    return {"input_ids": pad_token_id(teacher_tokenizer), "labels": IGNORE_INDEX}


def pack_rows(texts: list[str], student_tokenizer, teacher_tokenizer, *, sequence_length: int,
              teacher_sequence_length: int, pack: bool) -> AlignedBatch:
    """Both sides of `texts` aligned (`encode_aligned`) and packed (`pack_aligned_documents`)."""
    student, student_trains, teacher, teacher_trains, alignments = encode_aligned(texts, student_tokenizer,
                                                                                  teacher_tokenizer)
    return pack_aligned_documents(student, teacher, student_sequence_length=sequence_length,
                                  teacher_sequence_length=teacher_sequence_length,
                                  student_pad_id=pad_token_id(student_tokenizer),
                                  teacher_pad_id=pad_token_id(teacher_tokenizer), pack=pack, alignments=alignments,
                                  student_trains=student_trains, teacher_trains=teacher_trains)


def encode_aligned(texts: list[str], student_tokenizer, teacher_tokenizer) -> tuple[list, list, list, list, list]:
    """Per text: the student's tokens (`TokenSpans`) and which train, the teacher's likewise, and their
    `Alignment`. A text row is read alike by both; a chat or prompt / completion row
    (`meshkd.recipe.records.Document`) by each in its own rendering (`Document.teacher`), aligned on the
    passages both hold (`Document.shared`: the answers, by `align_shared_spans`), each side's targets its own
    answer tokens."""
    teachers = [getattr(text, "teacher", None) or text for text in texts]
    student, student_trains = encode_rows(student_tokenizer, texts)
    teacher, teacher_trains = encode_rows(teacher_tokenizer, teachers)
    alignments = []
    for index, (text, mine, theirs) in enumerate(zip(texts, student, teacher)):
        try:
            if teachers[index] is text:
                alignments.append(align_token_spans(mine, theirs))
            else:
                alignments.append(align_shared_spans(mine, theirs, byte_passages(text, teachers[index])))
        except ValueError as error:
            raise ValueError(f"document {index}: {error}") from error
    return student, student_trains, teacher, teacher_trains, alignments


def encode_rows(tokenizer, texts: list[str]) -> tuple[list[TokenSpans], list[torch.Tensor | None]]:
    """Each text's tokens with their byte spans, EOS appended when the text takes it (`Document.eos`, as
    `meshkd.recipe.corpus.tokenizing.tokenize_documents` does), and which of them train (None: all), read from the
    same tokenization's character offsets (`answer_tokens`: the EOS trains with the answer it ends)."""
    spans, offsets = encode_with_byte_spans_and_offsets(tokenizer, texts,
                                                        add_eos=[getattr(text, "eos", True) for text in texts])
    trains = [None if getattr(text, "answers", None) is None else
              answer_tokens(text.answers, offset, closing=len(tokens) - len(offset))
              for text, tokens, offset in zip(texts, spans, offsets)]
    return spans, trains


def byte_passages(student: Document, teacher: Document) -> list[tuple[int, int, int]]:
    """`student.shared` (character offsets into both renderings) in UTF-8 bytes, as `align_shared_spans` takes."""
    def byte_offset(text: str, chars: int) -> int:
        return len(text[:chars].encode())
    return [(byte_offset(student, start), byte_offset(teacher, other), len(student[start : start + length].encode()))
            for start, other, length in student.shared]


def row_too_short(error: GroupTooLongError, sequence_length: int, teacher_sequence_length: int) -> ConfigError:
    """The error naming the key whose rows cannot hold one aligned group (a group is never split)."""
    if error.teacher_tokens > teacher_sequence_length:
        key, length, needed = TEACHER_LENGTH_KEY, teacher_sequence_length, error.teacher_tokens
    else:
        key, length, needed = "step_scheduler.sequence_length", sequence_length, error.student_tokens
    return ConfigError(f"{key} ({length}) is too short: {error.where} has {error.student_tokens} student and "
                       f"{error.teacher_tokens} teacher tokens covering the same bytes, and a group is never split "
                       f"across rows; use at least {needed}")


def row_fill(rows: PackedDataset) -> dict[str, float]:
    """`row_fill` and `teacher_row_fill`: the share of the student's and the teacher's row positions that hold a
    token in the rows of a cross-tokenizer run; {} for rows of one tokenization. A row is closed when either
    side is full, so the side whose tokenizer takes more tokens for the same bytes fills its rows and the
    other fills what the length ratio leaves."""
    if hasattr(rows, "row_fill"):  # rows read from a token store
        return rows.row_fill()
    if TEACHER_POSITIONS not in getattr(rows, "extra", {}) or len(rows) == 0:
        return {}
    teacher_mask, _ = rows.extra["teacher_attention_mask"]
    return {"row_fill": (rows.attention_mask != 0).double().mean().item(),
            "teacher_row_fill": (teacher_mask != 0).double().mean().item()}


def check_row_lengths(config, texts: list[str], student_tokenizer, teacher_tokenizer) -> dict[str, float]:
    """Pack the first `ROW_FILL_SAMPLE_CHARS` characters of `texts` (a run's documents, read at preflight) as the
    run will and return their `row_fill` with `teacher_row_length`, the teacher row length at which both sides
    fill alike: `step_scheduler.sequence_length` times the teacher tokens per student token of those rows.

    Warns (once, on rank 0) when a side fills less than `MIN_ROW_FILL` of its rows and
    `kd.cross_tokenizer.teacher_sequence_length` is more than 10% off `teacher_row_length`: too short, the
    teacher's side closes rows with the student's part empty (tokens the step could have trained on); too
    long, the teacher computes padding. The token ratio does not depend on the lengths, so the length it
    names is warned about no more.

    Raises:
        ConfigError: naming the key whose rows cannot hold one aligned group of the sample.
    """
    sample, left = [], ROW_FILL_SAMPLE_CHARS
    for text in texts:
        if left <= 0:
            break
        sample.append(text.cut(left) if isinstance(text, Document) else text[:left])
        left -= len(sample[-1])
    length, teacher_length = config.step_scheduler.sequence_length, config.teacher_sequence_length
    rows = aligned_packing(student_tokenizer, teacher_tokenizer, sequence_length=length,
                           teacher_sequence_length=teacher_length, pack=config.dataset.packing)(sample)
    fill = row_fill(rows)
    if not fill:
        return fill
    ratio = fill["teacher_row_fill"] * teacher_length / (fill["row_fill"] * length)
    fill["teacher_row_length"] = best = max(2, math.ceil(length * ratio))
    if min(fill["row_fill"], fill["teacher_row_fill"]) < MIN_ROW_FILL and abs(teacher_length - best) > 0.1 * best:
        warn0(f"{TEACHER_LENGTH_KEY}: rows fill {fill['row_fill']:.0%} of the student's {length} tokens and "
              f"{fill['teacher_row_fill']:.0%} of the teacher's {teacher_length} (measured on the first "
              f"{len(sample)} document(s)); the teacher's tokenizer takes {ratio:.2f} tokens per student token "
              f"of this text, so {TEACHER_LENGTH_KEY}: {best} fills both sides alike")
    return fill


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


def completion_aligner(config, student_tokenizer, teacher_tokenizer) -> CompletionAligner | None:
    """What gives a run's on-policy rows their teacher side: with `kd.cross_tokenizer` when the student
    completes prompts (`kd.generates`), else None."""
    if config.kd.cross_tokenizer is None or not config.kd.generates:
        return None
    return CompletionAligner(student_tokenizer, teacher_tokenizer, ignore_index=config.kd.ignore_index,
                             teacher_sequence_length=config.teacher_sequence_length)


class CompletionAligner:
    """The teacher's side of on-policy rows (`meshkd.recipe.student.on_policy.completion_batch`: prompt + the student's
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

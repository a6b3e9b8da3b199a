"""Aligned packing: two tokenizations of the same documents packed into rows together, each side its own length.

`pack_aligned` tokenizes with `encode_with_byte_spans`, aligns each document (`meshkd.core.token_alignment`)
and packs both sides NEAT-style (`meshkd.core.packing`): the same documents in the same rows, each side with
its own sequence length; a document too long for a row is cut at a common cut so both sides restart together
(`cut_document`), and the pieces go first-fit into rows with room on both sides (`place_pieces`).
`AlignedGroups` holds, per loss group, the flat positions of the logits that predict the group's first and
last token on each side (`meshkd.core.cross_tokenizer_loss`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from meshkd.core.token_alignment import IGNORE_INDEX, Alignment, align_token_spans
from meshkd.core.token_bytes import TokenSpans, encode_with_byte_spans


@dataclass(frozen=True)
class AlignedGroups:
    """The loss groups of an aligned batch, in row-major order: every field is an int64 tensor [groups].

    A loss group has tokens on both sides and, on both, a logit that predicts its first token within the
    same document. `student_first` / `student_last` are the flat positions (row * student sequence length
    + column, i.e. indices into logits flattened to [tokens, vocab]) of the student logits predicting the
    group's first and last token; the group's targets are the labels at positions first..last. Likewise
    `teacher_first` / `teacher_last` in the teacher's packing. `num_bytes` is the text the group covers
    (0 for a boundary group such as EOS with EOS); `row` is the group's row on both sides.
    """

    student_first: Tensor
    student_last: Tensor
    teacher_first: Tensor
    teacher_last: Tensor
    num_bytes: Tensor
    row: Tensor

    def __len__(self) -> int:
        return len(self.row)

    def select_rows(self, start: int, stop: int, *, student_sequence_length: int,
                    teacher_sequence_length: int) -> AlignedGroups:
        """The groups of rows [start, stop), with positions relative to that slice of both batches (the
        micro-batch or data-parallel share `batch[start:stop]` of each side)."""
        keep = (self.row >= start) & (self.row < stop)
        return AlignedGroups(
            student_first=self.student_first[keep] - start * student_sequence_length,
            student_last=self.student_last[keep] - start * student_sequence_length,
            teacher_first=self.teacher_first[keep] - start * teacher_sequence_length,
            teacher_last=self.teacher_last[keep] - start * teacher_sequence_length,
            num_bytes=self.num_bytes[keep],
            row=self.row[keep] - start,
        )


@dataclass(frozen=True)
class AlignedBatch:
    """Both sides of a text batch, packed into the same rows, and their loss groups.

    `student` and `teacher` are batch dicts in the layout of `meshkd.recipe.corpus.data` (`input_ids`, `labels`,
    `position_ids`, `attention_mask`, each int64 [rows, that side's sequence length]). `*_target_bytes`
    [rows, sequence length] hold the UTF-8 bytes the token each position's label names adds to the text
    (0 where the label is ignored or names a special token; tokens sharing a character count it once), for
    bits per byte.
    """

    student: dict[str, Tensor]
    teacher: dict[str, Tensor]
    groups: AlignedGroups
    student_target_bytes: Tensor
    teacher_target_bytes: Tensor


def pack_aligned(
    texts: Sequence[str],
    student_tokenizer,
    teacher_tokenizer,
    *,
    student_sequence_length: int,
    teacher_sequence_length: int,
    student_add_bos: bool = False,
    teacher_add_bos: bool = False,
    pack: bool = True,
) -> AlignedBatch:
    """Tokenize documents with both tokenizers (`encode_with_byte_spans`), align and pack them.

    See `pack_aligned_documents`; pad ids are each tokenizer's pad token, else its EOS, else 0.
    """
    student = encode_with_byte_spans(student_tokenizer, texts, add_bos=student_add_bos)
    teacher = encode_with_byte_spans(teacher_tokenizer, texts, add_bos=teacher_add_bos)
    return pack_aligned_documents(
        student, teacher,
        student_sequence_length=student_sequence_length, teacher_sequence_length=teacher_sequence_length,
        student_pad_id=pad_token_id(student_tokenizer), teacher_pad_id=pad_token_id(teacher_tokenizer), pack=pack,
    )  # fmt: skip


def pad_token_id(tokenizer) -> int:
    """The id padding takes: the tokenizer's pad token, else its EOS, else 0 (`meshkd.recipe.corpus.data`'s too)."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


class GroupTooLongError(ValueError):
    """A group with more tokens on a side than that side's row holds: a group is never split, so no cut of
    the document fits. `where` names the document, the group and its bytes; `student_tokens` /
    `teacher_tokens` are the group's tokens on each side."""

    def __init__(self, message: str, *, where: str, student_tokens: int, teacher_tokens: int) -> None:
        super().__init__(message)
        self.where, self.student_tokens, self.teacher_tokens = where, student_tokens, teacher_tokens


@dataclass
class Piece:
    """A document's groups that go into one row (`cut_document`), with their tokens on each side."""

    document: int
    groups: range  # group indices of the document's alignment
    student: range  # token indices of the document
    teacher: range


def pack_aligned_documents(
    student_documents: Sequence[TokenSpans],
    teacher_documents: Sequence[TokenSpans],
    *,
    student_sequence_length: int,
    teacher_sequence_length: int,
    student_pad_id: int = 0,
    teacher_pad_id: int = 0,
    pack: bool = True,
    alignments: Sequence[Alignment] | None = None,
    student_trains: Sequence[Tensor | None] | None = None,
    teacher_trains: Sequence[Tensor | None] | None = None,
) -> AlignedBatch:
    """Align each document's two tokenizations and pack both sides NEAT-style into the same rows.

    `alignments` gives each document's groups (default: `align_token_spans` of its two tokenizations, which
    must then be of one text). `student_trains` / `teacher_trains`: per document, a bool tensor saying which of
    its tokens are targets (an answer-only mask), or None when all are; a token that is not is no position's
    label on its side.

    A document whose tokens do not fit a row on either side is cut at group boundaries into the longest
    pieces that fit both; every piece is a document of its own on both sides (positions restart, labels
    stop at its end). Pieces go first-fit, in order, into the first row with room on both sides
    (`place_pieces`: a search of two max-trees, not a scan of the open rows); `pack=False` puts each
    piece in a row of its own. A document with no token on one side (or both) is skipped: it has nothing to
    pair (an empty text, say, with a tokenizer that adds neither BOS nor EOS).

    Raises:
        ValueError: mismatched document counts, a sequence length below 2, or invalid spans (named by
            document and side).
        GroupTooLongError (a ValueError): a single group longer than a row on either side.
    """
    if len(student_documents) != len(teacher_documents):
        raise ValueError(
            f"{len(student_documents)} student documents but {len(teacher_documents)} teacher documents: "
            f"give both tokenizations of every document"
        )
    lengths = {"student_sequence_length": student_sequence_length, "teacher_sequence_length": teacher_sequence_length}
    for name, value in lengths.items():
        if value < 2:
            raise ValueError(f"{name} must be at least 2 tokens, got {value}")
    if alignments is None:
        alignments = []
        for index, (student, teacher) in enumerate(zip(student_documents, teacher_documents)):
            try:
                alignments.append(align_token_spans(student, teacher))
            except ValueError as error:
                raise ValueError(f"document {index}: {error}") from error
    no_masks = [None] * len(student_documents)

    pieces = []
    for index, alignment in enumerate(alignments):
        pieces.extend(cut_document(index, alignment, student_sequence_length, teacher_sequence_length))
    rows, offsets = place_pieces(pieces, student_sequence_length, teacher_sequence_length, pack)
    num_rows = max(rows, default=-1) + 1

    sides = (
        (student_documents, student_sequence_length, student_pad_id, lambda p: p.student, student_trains),
        (teacher_documents, teacher_sequence_length, teacher_pad_id, lambda p: p.teacher, teacher_trains),
    )
    batches, target_bytes = [], []
    for side_index, (documents, length, pad_id, tokens_of, trains) in enumerate(sides):
        trains = no_masks if trains is None else trains
        batch = {
            "input_ids": torch.full((num_rows, length), pad_id, dtype=torch.int64),
            "labels": torch.full((num_rows, length), IGNORE_INDEX, dtype=torch.int64),
            "position_ids": torch.zeros((num_rows, length), dtype=torch.int64),
            "attention_mask": torch.zeros((num_rows, length), dtype=torch.int64),
        }
        nbytes = torch.zeros((num_rows, length), dtype=torch.int64)
        pieces_in_row = [0] * num_rows
        for piece, row, offset in zip(pieces, rows, offsets):
            pieces_in_row[row] += 1
            document = documents[piece.document]
            tokens = tokens_of(piece)
            if not tokens:  # a piece of one side's tokens alone (a chat template's wrapping)
                continue
            start = offset[side_index]
            columns = slice(start, start + len(tokens))
            ids = torch.tensor(document.ids[tokens.start : tokens.stop], dtype=torch.int64)
            sizes = torch.tensor(_new_bytes(document, tokens), dtype=torch.int64)
            labels = ids[1:]
            mask = trains[piece.document]
            if mask is not None:  # a token that does not train is no position's target
                targets = mask[tokens.start + 1 : tokens.stop]
                labels, sizes[1:] = labels.masked_fill(~targets, IGNORE_INDEX), sizes[1:].masked_fill(~targets, 0)
            batch["input_ids"][row, columns] = ids
            batch["labels"][row, start : start + len(tokens) - 1] = labels
            batch["position_ids"][row, columns] = torch.arange(len(tokens))
            batch["attention_mask"][row, columns] = pieces_in_row[row]
            nbytes[row, start : start + len(tokens) - 1] = sizes[1:]
        batches.append(batch)
        target_bytes.append(nbytes)

    fields: dict[str, list[int]] = {name: [] for name in AlignedGroups.__dataclass_fields__}
    for piece, row, (student_offset, teacher_offset) in zip(pieces, rows, offsets):
        alignment = alignments[piece.document]
        for g in piece.groups:
            s0 = alignment.student_bounds[g] - piece.student.start
            s1 = alignment.student_bounds[g + 1] - piece.student.start
            t0 = alignment.teacher_bounds[g] - piece.teacher.start
            t1 = alignment.teacher_bounds[g + 1] - piece.teacher.start
            if s0 < 1 or t0 < 1 or s1 == s0 or t1 == t0:
                continue  # no token on one side, or no logit predicting its first token in this piece
            fields["student_first"].append(row * student_sequence_length + student_offset + s0 - 1)
            fields["student_last"].append(row * student_sequence_length + student_offset + s1 - 2)
            fields["teacher_first"].append(row * teacher_sequence_length + teacher_offset + t0 - 1)
            fields["teacher_last"].append(row * teacher_sequence_length + teacher_offset + t1 - 2)
            fields["num_bytes"].append(alignment.byte_bounds[g + 1] - alignment.byte_bounds[g])
            fields["row"].append(row)
    order = sorted(range(len(fields["row"])), key=fields["student_first"].__getitem__)
    groups = AlignedGroups(**{
        name: torch.tensor([values[i] for i in order], dtype=torch.int64) for name, values in fields.items()
    })  # fmt: skip
    return AlignedBatch(batches[0], batches[1], groups, target_bytes[0], target_bytes[1])


def _new_bytes(document: TokenSpans, tokens: range) -> list[int]:
    """Bytes each token adds to those before it, so tokens sharing a character count it once."""
    covered = document.starts[tokens.start] if len(tokens) else 0
    sizes = []
    for k in tokens:
        sizes.append(max(0, document.ends[k] - max(document.starts[k], covered)))
        covered = max(covered, document.ends[k])
    return sizes


def cut_document(document: int, alignment: Alignment, student_length: int, teacher_length: int) -> list[Piece]:
    """The document (named `document` in errors and the pieces) as pieces of whole groups, each as long as fits
    a row on both sides; none when a side has no token. GroupTooLongError for a group longer than a row."""
    sb, tb = alignment.student_bounds, alignment.teacher_bounds
    if sb[-1] == 0 or tb[-1] == 0:  # nothing to pair on one side
        return []
    pieces = []
    first = 0
    for g in range(alignment.num_groups):
        student_tokens, teacher_tokens = sb[g + 1] - sb[g], tb[g + 1] - tb[g]
        if student_tokens > student_length or teacher_tokens > teacher_length:
            span = f"bytes {alignment.byte_bounds[g]}..{alignment.byte_bounds[g + 1]}"
            where = f"document {document}: group {g} ({span})"
            raise GroupTooLongError(
                f"{where} has {student_tokens} student and {teacher_tokens} teacher tokens, more than a row holds "
                f"({student_length} and {teacher_length}); use longer rows",
                where=where, student_tokens=student_tokens, teacher_tokens=teacher_tokens,
            )
        if sb[g + 1] - sb[first] > student_length or tb[g + 1] - tb[first] > teacher_length:
            pieces.append(Piece(document, range(first, g), range(sb[first], sb[g]), range(tb[first], tb[g])))
            first = g
    last = alignment.num_groups
    pieces.append(Piece(document, range(first, last), range(sb[first], sb[last]), range(tb[first], tb[last])))
    return pieces


def place_pieces(pieces: list[Piece], student_length: int, teacher_length: int,
                 pack: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """Row and (student, teacher) column offset of each piece: first fit on both sides at once, the first row
    (in the order rows open) with room on both (`pack` False: a row each).

    Two max-trees over the rows' free space, one per side, find that row without scanning the open rows: the
    search descends leftmost-first into the subtrees whose maxima both suffice, so it visits O(log rows) nodes
    a piece, more only where rows with room on one side alone come before the first with room on both (a
    subtree whose maxima lie in different rows). Rows not yet opened are empty and a piece fits an empty row
    (`cut_document`), so the row found is an open one or the next to open.
    """
    if not pack:
        return list(range(len(pieces))), [(0, 0)] * len(pieces)
    size = 1
    while size < max(1, len(pieces)):
        size *= 2
    # free[side][size + row]: the room left in row on that side; inner nodes hold their subtree's maximum.
    free = ([student_length] * (2 * size), [teacher_length] * (2 * size))
    capacity = (student_length, teacher_length)
    rows, offsets = [], []
    for piece in pieces:
        need = (len(piece.student), len(piece.teacher))
        node, stack = 0, [1]
        while stack:
            node = stack.pop()
            if free[0][node] < need[0] or free[1][node] < need[1]:
                continue
            if node >= size:
                break
            stack += (2 * node + 1, 2 * node)  # the left subtree first
        else:
            raise ValueError(f"a piece of {need[0]} student and {need[1]} teacher tokens is longer than a row "
                             f"({student_length} and {teacher_length})")
        rows.append(node - size)
        offsets.append((capacity[0] - free[0][node], capacity[1] - free[1][node]))
        for side in range(2):
            tree = free[side]
            tree[node] -= need[side]
            parent = node // 2
            while parent:
                tree[parent] = max(tree[2 * parent], tree[2 * parent + 1])
                parent //= 2
    return rows, offsets

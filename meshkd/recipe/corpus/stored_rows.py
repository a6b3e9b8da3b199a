"""A token store's rows: packing plans made from its document index, and a split's rows read from its memory maps.

`plan_split` / `plan_routed` / `plan_aligned` make a split's packing plan from the document offsets alone: the
first-fit NEAT packing of `meshkd.recipe.corpus.data`'s module docstring, teacher by teacher for routed rows
(`meshkd.recipe.corpus.routing`), pieces of whole groups on both sides for a cross-tokenizer corpus (as
`meshkd.recipe.corpus.aligned_data.AlignedPacking` packs texts). `StoredRows` (and `StoredAlignedRows`, both sides of
a cross-tokenizer corpus) build a batch on demand from the memory-mapped tokens
(`meshkd.recipe.corpus.token_store.TokenStore`): a rank's resident memory does not grow with the corpus.
"""

from __future__ import annotations

import numpy as np
import torch

from meshkd.core.aligned_packing import GroupTooLongError, cut_document, pad_token_id, place_pieces
from meshkd.core.teacher_ensemble import ROUTE
from meshkd.recipe.corpus.aligned_data import row_too_short, teacher_padding
from meshkd.recipe.corpus.rows import GROUP_ENDS, TEACHER_GROUP_ENDS, TEACHER_POSITIONS, first_fit, padding_rows
from meshkd.recipe.corpus.token_store import TokenStore

_IGNORE = -100


class StoredRows:
    """A split's NEAT-packed rows read from a token store: the interface of `meshkd.recipe.corpus.rows.PackedDataset`.

    A plan lists the split's pieces by row: `starts` (in the store's tokens), `lengths` and `offsets` (in the
    row), and `row_starts` [rows + 1] (the row's first piece); the k-th piece of a row is its document k + 1.
    `documents` [1] counts the split's documents that have a token; routed rows' plans also hold `routes`
    [rows], each row's teacher index, returned under `ROUTE` ([rows, 1]; -1 in padding rows).
    """

    def __init__(self, store: TokenStore, plan: dict[str, np.ndarray], *, sequence_length: int,
                 pad_token_id: int) -> None:
        self.store, self.plan = store, plan
        self.sequence_length, self.pad_token_id = sequence_length, pad_token_id
        self.num_documents = int(plan["documents"][0])  # source documents with a token, as PackedDataset counts
        self.extra: dict = {}
        if "routes" in plan:
            self.extra[ROUTE] = (torch.from_numpy(np.array(plan["routes"], dtype=np.int64)).view(-1, 1), -1)

    def __len__(self) -> int:
        return len(self.plan["row_starts"]) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.plan["lengths"].sum())

    def tokens_per_row(self) -> list[int]:
        """Non-padding tokens of each row."""
        return np.add.reduceat(self.plan["lengths"], self.plan["row_starts"][:-1]).tolist() if len(self) else []

    def __getitem__(self, index: int | slice | torch.Tensor) -> dict[str, torch.Tensor]:
        rows = self._rows(index)
        batch = padding_rows(len(rows), self.sequence_length, self.pad_token_id)
        plan = self.plan
        for out, row in enumerate(rows):
            for document, piece in enumerate(range(plan["row_starts"][row], plan["row_starts"][row + 1]), start=1):
                start, length, offset = (int(plan[key][piece]) for key in ("starts", "lengths", "offsets"))
                _put_piece(batch, out, *self.store.piece(start, length), offset, document)
        return batch | {key: tensor[rows] for key, (tensor, _) in self.extra.items()}

    def _rows(self, index: int | slice | torch.Tensor) -> list[int]:
        """The selected rows, a negative index counting from the end (as a tensor's rows do)."""
        if isinstance(index, slice):
            return list(range(*index.indices(len(self))))
        return torch.arange(len(self))[torch.as_tensor(index, dtype=torch.int64).reshape(-1)].tolist()

    def padding(self, num_rows: int) -> dict[str, torch.Tensor]:
        return padding_rows(num_rows, self.sequence_length, self.pad_token_id) | {
            key: torch.full((num_rows, tensor.shape[1]), value, dtype=tensor.dtype)
            for key, (tensor, value) in self.extra.items()}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rows={len(self)}, sequence_length={self.sequence_length}, "
                f"documents={self.num_documents}, tokens={self.num_tokens})")


def _put_piece(batch: dict[str, torch.Tensor], out: int, ids: np.ndarray, trains: np.ndarray | None, offset: int,
               document: int) -> None:
    """A piece's tokens into row `out` of `batch` at `offset`, the row's `document`-th: its ids, the next token
    as each one's label where it trains, positions from 0."""
    length = len(ids)
    if not length:
        return
    ids = torch.from_numpy(ids.astype(np.int64))
    at = slice(offset, offset + length)
    batch["input_ids"][out, at] = ids
    targets = ids[1:].clone()
    if trains is not None:
        targets[torch.from_numpy(trains[1:] == 0)] = _IGNORE
    batch["labels"][out, offset : offset + length - 1] = targets
    batch["position_ids"][out, at] = torch.arange(length)
    batch["attention_mask"][out, at] = document


class StoredAlignedRows(StoredRows):
    """A cross-tokenizer split's rows read from a two-sided token store: the batch dicts
    `meshkd.recipe.corpus.aligned_data.AlignedPacking` makes in memory (the student's keys, the teacher's under
    `teacher_` names, the group columns), built on demand. The plan (`plan_aligned`) lists, per piece, each
    side's `starts`, `lengths` and `offsets` (the teacher's under `teacher_` names) and its groups (`group_starts`,
    `group_counts`: rows of the store's group bounds)."""

    def __init__(self, store: TokenStore, plan: dict[str, np.ndarray], aligned) -> None:
        super().__init__(store, plan, sequence_length=aligned.sequence_length,
                         pad_token_id=pad_token_id(aligned.student_tokenizer))
        self.teacher_sequence_length = aligned.teacher_sequence_length
        self.teacher_padding = teacher_padding(aligned.teacher_tokenizer)

    def __getitem__(self, index: int | slice | torch.Tensor) -> dict[str, torch.Tensor]:
        rows, plan = self._rows(index), self.plan
        student = padding_rows(len(rows), self.sequence_length, self.pad_token_id)
        teacher = padding_rows(len(rows), self.teacher_sequence_length, self.teacher_padding["input_ids"])
        columns = {key: torch.full((len(rows), self.sequence_length), -1, dtype=torch.int64)
                   for key in (TEACHER_POSITIONS, GROUP_ENDS, TEACHER_GROUP_ENDS)}
        for out, row in enumerate(rows):
            for document, piece in enumerate(range(plan["row_starts"][row], plan["row_starts"][row + 1]), start=1):
                offset, teacher_offset = int(plan["offsets"][piece]), int(plan["teacher_offsets"][piece])
                for prefix, batch, at in (("", student, offset), ("teacher_", teacher, teacher_offset)):
                    start, length = int(plan[f"{prefix}starts"][piece]), int(plan[f"{prefix}lengths"][piece])
                    _put_piece(batch, out, *self.store.piece(start, length, teacher=bool(prefix)), at, document)
                # The loss groups, as `aligned_data.group_columns` sets them: a group with tokens on both sides and
                # a token of its piece before it on both.
                first = int(plan["group_starts"][piece])
                bounds = self.store.group_bounds(first, first + int(plan["group_counts"][piece]) + 1)
                mine, theirs = bounds[:, 0] - bounds[0, 0], bounds[:, 1] - bounds[0, 1]
                paired = (mine[:-1] >= 1) & (theirs[:-1] >= 1) & (mine[1:] > mine[:-1]) & (theirs[1:] > theirs[:-1])
                at = torch.from_numpy(offset + mine[:-1][paired] - 1)
                for key, values in ((TEACHER_POSITIONS, teacher_offset + theirs[:-1][paired] - 1),
                                    (GROUP_ENDS, offset + mine[1:][paired] - 2),
                                    (TEACHER_GROUP_ENDS, teacher_offset + theirs[1:][paired] - 2)):
                    columns[key][out, at] = torch.from_numpy(values)
        return student | {f"teacher_{key}": value for key, value in teacher.items()} | columns

    def padding(self, num_rows: int) -> dict[str, torch.Tensor]:
        teacher = padding_rows(num_rows, self.teacher_sequence_length, self.teacher_padding["input_ids"])
        return (padding_rows(num_rows, self.sequence_length, self.pad_token_id)
                | {f"teacher_{key}": value for key, value in teacher.items()}
                | {key: torch.full((num_rows, self.sequence_length), -1, dtype=torch.int64)
                   for key in (TEACHER_POSITIONS, GROUP_ENDS, TEACHER_GROUP_ENDS)})

    def row_fill(self) -> dict[str, float]:
        """`meshkd.recipe.corpus.aligned_data.row_fill` of these rows, from the plan."""
        if len(self) == 0:
            return {}
        return {"row_fill": float(self.plan["lengths"].sum()) / (len(self) * self.sequence_length),
                "teacher_row_fill": float(self.plan["teacher_lengths"].sum())
                / (len(self) * self.teacher_sequence_length)}


def plan_aligned(store: TokenStore, documents: np.ndarray, aligned) -> dict[str, np.ndarray]:
    """The packing plan of a two-sided store's `documents` (indices, in order), as `aligned.pack_aligned_documents`
    packs them: each cut into pieces of whole groups (`cut_document`), placed first-fit on both sides at once
    (`place_pieces`). ConfigError naming the key when a row cannot hold a group."""
    length, teacher_length = aligned.sequence_length, aligned.teacher_sequence_length
    pieces = []
    try:
        for index, document in enumerate(documents.tolist()):
            pieces.extend(cut_document(index, store.alignment(document), length, teacher_length))
    except GroupTooLongError as error:
        raise row_too_short(error, length, teacher_length) from None
    rows, offsets = place_pieces(pieces, length, teacher_length, aligned.pack)
    rows = np.asarray(rows, dtype=np.int64)
    order = np.argsort(rows, kind="stable")  # placement order within a row is offset order
    of = [int(documents[piece.document]) for piece in pieces]
    fields = {
        "starts": [int(store.offsets[d]) + piece.student.start for d, piece in zip(of, pieces)],
        "lengths": [len(piece.student) for piece in pieces],
        "offsets": [student for student, _ in offsets],
        "teacher_starts": [int(store.teacher_offsets[d]) + piece.teacher.start for d, piece in zip(of, pieces)],
        "teacher_lengths": [len(piece.teacher) for piece in pieces],
        "teacher_offsets": [teacher for _, teacher in offsets],
        "group_starts": [int(store.group_offsets[d]) + piece.groups.start for d, piece in zip(of, pieces)],
        "group_counts": [len(piece.groups) for piece in pieces],
    }
    num_rows = int(rows.max()) + 1 if len(rows) else 0
    row_starts = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=num_rows), out=row_starts[1:])
    return {**{name: np.asarray(values, dtype=np.int64)[order] for name, values in fields.items()},
            "row_starts": row_starts, "documents": np.array([len(documents)], dtype=np.int64)}


def plan_split(lengths: np.ndarray, starts: np.ndarray, sequence_length: int, *, pack: bool) -> dict[str, np.ndarray]:
    """The packing plan of documents (token `lengths`, `starts` in the store), in order: each cut into row-sized
    pieces, placed first-fit (one a row unless `pack`)."""
    full, rest = np.divmod(lengths, sequence_length)
    pieces_per_document = full + (rest > 0)
    piece_lengths = np.full(int(pieces_per_document.sum()), sequence_length, dtype=np.int64)
    last = np.cumsum(pieces_per_document) - 1
    piece_lengths[last[rest > 0]] = rest[rest > 0]
    first_of_document = np.repeat(starts, pieces_per_document)
    within = np.arange(len(piece_lengths)) - np.repeat(np.cumsum(pieces_per_document) - pieces_per_document,
                                                       pieces_per_document)
    piece_starts = first_of_document + within * sequence_length
    if pack:
        rows, offsets = first_fit(piece_lengths.tolist(), sequence_length)
        rows, offsets = np.asarray(rows, dtype=np.int64), np.asarray(offsets, dtype=np.int64)
    else:
        rows, offsets = np.arange(len(piece_lengths), dtype=np.int64), np.zeros(len(piece_lengths), dtype=np.int64)
    order = np.argsort(rows, kind="stable")  # placement order within a row is offset order
    num_rows = int(rows.max()) + 1 if len(rows) else 0
    row_starts = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=num_rows), out=row_starts[1:])
    return {"starts": piece_starts[order], "lengths": piece_lengths[order], "offsets": offsets[order],
            "row_starts": row_starts, "documents": np.array([np.count_nonzero(lengths)], dtype=np.int64)}


def plan_routed(lengths: np.ndarray, starts: np.ndarray, routes: np.ndarray, num_teachers: int,
                sequence_length: int, *, pack: bool) -> dict[str, np.ndarray]:
    """The plan of routed documents: each teacher's documents (`routes`: their indices) packed apart by
    `plan_split`, the rows put together in teacher order, each row's teacher under `routes`."""
    parts = [(teacher, plan_split(lengths[routes == teacher], starts[routes == teacher], sequence_length, pack=pack))
             for teacher in range(num_teachers) if np.any(routes == teacher)]
    row_starts, pieces = [np.zeros(1, dtype=np.int64)], 0
    for _, plan in parts:
        row_starts.append(plan["row_starts"][1:] + pieces)
        pieces += len(plan["starts"])
    empty = np.zeros(0, dtype=np.int64)
    return {**{name: np.concatenate([plan[name] for _, plan in parts] or [empty])
               for name in ("starts", "lengths", "offsets")},
            "row_starts": np.concatenate(row_starts),
            "routes": np.concatenate([np.full(len(plan["row_starts"]) - 1, teacher, dtype=np.int64)
                                      for teacher, plan in parts] or [empty]),
            "documents": np.array([sum(int(plan["documents"][0]) for _, plan in parts)], dtype=np.int64)}

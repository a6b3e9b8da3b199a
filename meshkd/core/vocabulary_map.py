"""How a teacher's vocabulary meets a student's: `VocabularyMap` (exact pairs and a sparse projection), built once
from the two tokenizers by `build_vocabulary_map`, saved and loaded keyed by `vocabulary_fingerprint`.

Tokens meet by their bytes (`meshkd.core.token_bytes.token_bytes`) and special tokens by role or content. The
cross-tokenizer losses (`meshkd.core.cross_tokenizer_loss`) compare the exact pairs directly (GOLD) and move a
teacher distribution onto the student's vocabulary through the projection.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from meshkd.core.token_bytes import token_bytes

_MAP_RULE = "meshkd-vocabulary-map-v1"  # bump when the matching rule changes, so cached maps are rebuilt
_SPECIAL_ROLES = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


@dataclass(frozen=True)
class VocabularyMap:
    """How a teacher's vocabulary meets a student's, built once by `build_vocabulary_map`.

    - Exact pairs (`exact_student_ids[i]`, `exact_teacher_ids[i]`), one-to-one: tokens of the same bytes, or
      special tokens of the same role (BOS, EOS, PAD, UNK) or the same content. GOLD compares them directly.
    - The projection W [student vocab, teacher vocab], sparse: entries (projection_student_ids[k],
      projection_teacher_ids[k]) of weight projection_weights[k]. Each teacher token has at most one entry:
      its exact partner, else the longest student token its bytes start with (leading spaces stripped if
      none does), else none (a special token without a partner: its mass is dropped and the projection
      renormalized).
    - `fingerprint`: a digest of both tokenizers' byte tables, special roles and the rule, to key a cache.
    """

    student_vocab_size: int
    teacher_vocab_size: int
    exact_student_ids: Tensor
    exact_teacher_ids: Tensor
    projection_student_ids: Tensor
    projection_teacher_ids: Tensor
    projection_weights: Tensor
    fingerprint: str

    def projection_matrix(self) -> Tensor:
        """W as a sparse COO tensor [student vocab, teacher vocab]."""
        return torch.sparse_coo_tensor(
            torch.stack([self.projection_student_ids, self.projection_teacher_ids]), self.projection_weights,
            (self.student_vocab_size, self.teacher_vocab_size), check_invariants=True,
        ).coalesce()  # fmt: skip

    def save(self, path: str | os.PathLike) -> None:
        """Write the map to `path` (a torch.save file of tensors, ints and strings)."""
        torch.save({name: getattr(self, name) for name in self.__dataclass_fields__} | {"rule": _MAP_RULE}, path)

    @classmethod
    def load(cls, path: str | os.PathLike, *, fingerprint: str | None = None) -> VocabularyMap:
        """Read a map saved by `save`; ValueError when it was built by another rule or, given `fingerprint`
        (`vocabulary_fingerprint` of the two tokenizers), for other tokenizers."""
        data = torch.load(path, weights_only=True)
        if data.pop("rule", None) != _MAP_RULE:
            raise ValueError(f"{os.fspath(path)} was not built by {_MAP_RULE}: rebuild the vocabulary map")
        if fingerprint is not None and data["fingerprint"] != fingerprint:
            raise ValueError(
                f"{os.fspath(path)} maps other tokenizers (fingerprint {data['fingerprint'][:12]}..., these are "
                f"{fingerprint[:12]}...): rebuild the vocabulary map"
            )
        return cls(**data)


def _special_roles(tokenizer) -> dict[str, int]:
    roles = {role: getattr(tokenizer, role, None) for role in _SPECIAL_ROLES}
    return {role: int(token_id) for role, token_id in roles.items() if token_id is not None}


def _special_contents(tokenizer, table: list[bytes | None]) -> dict[str, int]:
    tokens = tokenizer.convert_ids_to_tokens([i for i, entry in enumerate(table) if entry is None])
    ids = [i for i, entry in enumerate(table) if entry is None]
    return {token: i for token, i in zip(tokens, ids) if token is not None}


def vocabulary_fingerprint(student_tokenizer, teacher_tokenizer) -> str:
    """The digest `build_vocabulary_map` stores: equal for tokenizers whose maps would be equal."""
    return _fingerprint(token_bytes(student_tokenizer), _special_roles(student_tokenizer),
                        token_bytes(teacher_tokenizer), _special_roles(teacher_tokenizer),
                        student_tokenizer, teacher_tokenizer)


def _fingerprint(student_table, student_roles, teacher_table, teacher_roles, student_tokenizer, teacher_tokenizer):
    digest = hashlib.sha256(_MAP_RULE.encode())
    for table, roles, tokenizer in ((student_table, student_roles, student_tokenizer),
                                    (teacher_table, teacher_roles, teacher_tokenizer)):
        specials = _special_contents(tokenizer, table)
        digest.update(json.dumps([[None if entry is None else entry.hex() for entry in table], roles, specials],
                                 sort_keys=True).encode())
    return digest.hexdigest()


def build_vocabulary_map(student_tokenizer, teacher_tokenizer) -> VocabularyMap:
    """The exact pairs and the projection between two transformers fast tokenizers (see `VocabularyMap`).

    Token bytes come from `meshkd.core.token_bytes.token_bytes`. Among several student tokens of the
    teacher token's bytes, the one spelled like it wins, else the lowest id; each student token pairs once.
    Costs a pass over both vocabularies (seconds for 150k tokens): build once and `save` it.
    """
    student_table, teacher_table = token_bytes(student_tokenizer), token_bytes(teacher_tokenizer)
    student_strings = student_tokenizer.convert_ids_to_tokens(list(range(len(student_table))))
    teacher_strings = teacher_tokenizer.convert_ids_to_tokens(list(range(len(teacher_table))))
    by_bytes: dict[bytes, list[int]] = {}
    for i, entry in enumerate(student_table):
        if entry is not None:
            by_bytes.setdefault(entry, []).append(i)
    by_string = {string: i for i, string in enumerate(student_strings)}

    exact: dict[int, int] = {}  # teacher id -> student id
    used: set[int] = set()

    def pair(teacher_id: int, student_id: int) -> None:
        if teacher_id not in exact and student_id not in used:
            exact[teacher_id] = student_id
            used.add(student_id)

    student_roles, teacher_roles = _special_roles(student_tokenizer), _special_roles(teacher_tokenizer)
    for role, teacher_id in teacher_roles.items():
        if role in student_roles:
            pair(teacher_id, student_roles[role])
    student_specials = _special_contents(student_tokenizer, student_table)
    for content, teacher_id in _special_contents(teacher_tokenizer, teacher_table).items():
        if content in student_specials:
            pair(teacher_id, student_specials[content])
    # Tokens spelled alike first, so that one tokenizer on both sides pairs every token with itself.
    for teacher_id, entry in enumerate(teacher_table):
        same = by_string.get(teacher_strings[teacher_id])
        if entry is not None and same is not None and student_table[same] == entry:
            pair(teacher_id, same)
    for teacher_id, entry in enumerate(teacher_table):
        if entry is not None and teacher_id not in exact:
            for student_id in by_bytes.get(entry, ()):
                if student_id not in used:
                    pair(teacher_id, student_id)
                    break

    longest = max((len(entry) for entry in by_bytes), default=0)
    projection: dict[int, int] = dict(exact)
    for teacher_id, entry in enumerate(teacher_table):
        if entry is None or teacher_id in projection:
            continue
        for candidate in (entry, entry.lstrip(b" ")):
            student_id = _longest_prefix(candidate, by_bytes, longest)
            if student_id is not None:
                projection[teacher_id] = student_id
                break

    teacher_exact = sorted(exact)
    teacher_projected = sorted(projection)
    return VocabularyMap(
        student_vocab_size=len(student_table),
        teacher_vocab_size=len(teacher_table),
        exact_student_ids=torch.tensor([exact[t] for t in teacher_exact], dtype=torch.int64),
        exact_teacher_ids=torch.tensor(teacher_exact, dtype=torch.int64),
        projection_student_ids=torch.tensor([projection[t] for t in teacher_projected], dtype=torch.int64),
        projection_teacher_ids=torch.tensor(teacher_projected, dtype=torch.int64),
        projection_weights=torch.ones(len(teacher_projected), dtype=torch.float32),
        fingerprint=_fingerprint(student_table, student_roles, teacher_table, teacher_roles,
                                 student_tokenizer, teacher_tokenizer),
    )


def _longest_prefix(data: bytes, by_bytes: dict[bytes, list[int]], longest: int) -> int | None:
    for length in range(min(len(data), longest), 0, -1):
        ids = by_bytes.get(data[:length])
        if ids:
            return ids[0]
    return None

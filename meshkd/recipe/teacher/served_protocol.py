"""What a served teacher (`meshkd serve-teacher`) and its students (`ServedTeacher`) say to each other over HTTP.

    GET  /health      -> 200 JSON `Health`: the teacher, its vocabulary's fingerprint and size, its load
    POST /v1/answer   body `wire.to_bytes({"batch": {...}, "settings": {...}})`
                      -> 200 body `wire.to_bytes(answer)`, the wire dict a teacher on the student's own ranks
                         would have made (`meshkd.recipe.teacher.teacher_answers`)
                      -> 4xx JSON {"error": message}: a request the server refuses (not retried);
                         503 JSON {"error": ...}: the server is draining (retried, as a lost connection is)

Bodies are `meshkd.core.wire` byte strings (a JSON spec, then little-endian tensor bytes): nothing from the
network is unpickled. A request carries its rows (`BATCH_KEYS`, int64 [rows, sequence]) and every setting the
answer depends on besides the teacher (`answer_settings`): the kind of answer, the student's vocabulary size (the
answer covers its first entries), a cross-tokenizer row's teacher side and loss (`uld`, `gold`), the tail samples'
seed, top-k's size and tail, the temperature, the ignored label and the teacher layers whose outputs travel beside
a training answer (`kd.hidden_states`). The answer is then a pure function of the request and the teacher, so a
retried request gets the same answer and requests from several students can share a forward. With a token
(`TOKEN_VARIABLE`, never a config key) every request must carry `Authorization: Bearer TOKEN`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from meshkd.core import wire
from meshkd.core.answers import LABEL_LOG_PROBS, choices
from meshkd.core.teacher_protocol import check_beside
from meshkd.recipe.corpus.rows import BATCH_KEYS, GROUP_ENDS, TEACHER_GROUP_ENDS, TEACHER_KEYS, TEACHER_POSITIONS
from meshkd.recipe.settings.config import CrossTokenizerConfig, KDConfig

PROTOCOL_VERSION = 1
HEALTH_PATH = "/health"
ANSWER_PATH = "/v1/answer"
HEAD_PATH = "/v1/teacher_head"
"""GET ?vocab_size=N: the teacher's output layer over its first N entries, for its hidden answers
(`meshkd.recipe.teacher.teacher_head.TeacherHead.to_bytes`)."""
TOKEN_VARIABLE = "MESHKD_TEACHER_TOKEN"
"""The environment variable holding the bearer token, on the server and on every student rank."""

SETTINGS_KEYS = ("transport", "with_label_log_probs", "vocab_size", "seed", "topk", "topk_tail_samples",
                 "topk_encoding", "temperature", "ignore_index", "hidden_layers", "cross_tokenizer_loss")
CROSS_KEYS = (*TEACHER_KEYS, TEACHER_POSITIONS, GROUP_ENDS, TEACHER_GROUP_ENDS)
"""A cross-tokenizer row's teacher side and group columns (`meshkd.recipe.corpus.rows`), sent beside its
`BATCH_KEYS` when `settings.cross_tokenizer_loss` is uld or gold."""
CROSS_LOSSES = ("uld", "gold")
"""The cross-tokenizer losses a served teacher answers: per aligned group over its own vocabulary (a projection
onto the student's vocabulary would need the student's tokenizer on the server)."""


def request_keys(batch: dict) -> tuple[str, ...]:
    """The keys of `batch` a request carries: a cross-tokenizer row's teacher side and groups too."""
    return BATCH_KEYS + (CROSS_KEYS if TEACHER_POSITIONS in batch else ())


def answer_settings(kd: KDConfig, *, seed: int, vocab_size: int, hidden_layers: Sequence[int] = ()) -> dict[str, Any]:
    """The settings a student's requests carry besides the kind of answer (`transport` and `with_label_log_probs`,
    set per request);
    `hidden_layers`: the teacher layers of `kd.hidden_states`' pairs, whose outputs travel beside a training
    answer ([] for none)."""
    return {"vocab_size": vocab_size, "seed": seed, "topk": kd.topk, "topk_tail_samples": kd.topk_tail_samples,
            "topk_encoding": kd.topk_encoding, "temperature": kd.temperature, "ignore_index": kd.ignore_index,
            "hidden_layers": list(hidden_layers),
            "cross_tokenizer_loss": kd.cross_tokenizer.loss if kd.cross_tokenizer is not None else None}


def vocabulary_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's token -> id mapping: the teacher reads the student's ids, so both must agree."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()


def bearer_token() -> str | None:
    """The token of `TOKEN_VARIABLE`, None when it is unset or empty."""
    return os.environ.get(TOKEN_VARIABLE) or None


def auth_headers() -> dict[str, str]:
    token = bearer_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


@dataclass(frozen=True)
class AnswerRequest:
    """One student's request: its rows and the settings of the answer (`SETTINGS_KEYS`)."""

    batch: dict[str, torch.Tensor]
    settings: dict[str, Any]

    def to_bytes(self) -> bytes:
        return wire.to_bytes({"batch": {key: self.batch[key] for key in request_keys(self.batch)},
                              "settings": self.settings})

    @property
    def tokens(self) -> int:
        return sum(self.batch[key].numel() for key in ("input_ids", "teacher_input_ids") if key in self.batch)

    def compatible_key(self) -> tuple:
        """Requests with equal keys can share a forward (their rows stacked): same settings, same row length. A
        cross-tokenizer request shares none (its answer is per aligned group, not per row)."""
        unique = (id(self),) if self.settings["cross_tokenizer_loss"] else ()
        return (json.dumps(self.settings, sort_keys=True), self.batch["input_ids"].shape[1], *unique)


def parse_request(body: bytes, *, vocab_rows: int, num_layers: int, max_tokens: int) -> AnswerRequest:
    """The request in `body`; ValueError saying what is wrong with it (the server answers 400 or 413 with it).

    `vocab_rows`: the teacher's output rows (the largest vocabulary it answers over and the largest token id);
    `num_layers`: its decoder layers; `max_tokens`: tokens a request may hold at most."""
    try:
        value = wire.from_bytes(body)
    except ValueError as error:
        raise ValueError(f"the body is not a meshkd request: {error}") from None
    if not isinstance(value, dict) or set(value) != {"batch", "settings"}:
        raise ValueError("the body must hold exactly 'batch' and 'settings'")
    batch, settings = value["batch"], value["settings"]
    cross = isinstance(settings, dict) and settings.get("cross_tokenizer_loss") is not None
    keys = BATCH_KEYS + (CROSS_KEYS if cross else ())
    if not isinstance(batch, dict) or set(batch) != set(keys):
        raise ValueError(f"batch must hold exactly {list(keys)}")
    shape = _rows(batch, BATCH_KEYS)
    teacher = _rows(batch, TEACHER_KEYS) if cross else shape
    if cross:
        lengths = {TEACHER_POSITIONS: teacher[1], GROUP_ENDS: shape[1], TEACHER_GROUP_ENDS: teacher[1]}
        for key, length in lengths.items():
            column = batch[key]
            if (not isinstance(column, torch.Tensor) or column.dtype != torch.int64 or column.ndim != 2
                    or column.shape[0] != shape[0] or (column.numel() and int(column.max()) >= length)):
                raise ValueError(f"batch.{key} must be an int64 tensor [rows, columns] of columns below {length}")
        if int(batch["input_ids"].min()) < 0:
            raise ValueError("batch.input_ids must be token ids >= 0")
    if shape.numel() + (teacher.numel() if cross else 0) > max_tokens:
        raise TooLarge(f"the request holds {shape.numel() + (teacher.numel() if cross else 0)} tokens, more than "
                       f"this server's limit {max_tokens}")
    side = "teacher_" if cross else ""
    ids = batch[f"{side}input_ids"]
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_rows:
        raise ValueError(f"batch.{side}input_ids must be token ids in [0, {vocab_rows}), got [{int(ids.min())}, "
                         f"{int(ids.max())}]")
    for key, length in ((f"{side}position_ids", ids.shape[1]),) + ((("position_ids", shape[1]),) if cross else ()):
        if int(batch[key].min()) < 0 or int(batch[key].max()) >= length:
            raise ValueError(f"batch.{key} must be in [0, {length})")
    _check_settings(settings, vocab_rows, num_layers)
    return AnswerRequest(batch, settings)


def _rows(batch: dict, keys: tuple[str, ...]) -> torch.Size:
    """The common shape [rows, sequence] of `batch`'s `keys`, int64 each, with a token; ValueError otherwise."""
    first = batch[keys[0]]
    shape = first.shape if isinstance(first, torch.Tensor) and first.ndim == 2 else None
    for key in keys:
        tensor = batch[key]
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64 or tensor.shape != shape:
            raise ValueError(f"batch.{key} must be an int64 tensor [rows, sequence] shaped as batch.{keys[0]}")
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"batch holds no token ({keys[0]} {list(shape)})")
    return shape


class TooLarge(ValueError):
    """A request over the server's limits (HTTP 413)."""


def _check_settings(settings: Any, vocab_rows: int, num_layers: int) -> None:
    if not isinstance(settings, dict) or set(settings) != set(SETTINGS_KEYS):
        given = sorted(settings) if isinstance(settings, dict) else type(settings).__name__
        raise ValueError(f"settings must hold exactly {list(SETTINGS_KEYS)}, got {given}")
    answers = (*choices("logits_transport"), LABEL_LOG_PROBS)
    if settings["transport"] not in answers:
        raise ValueError(f"settings.transport {settings['transport']!r} is not one of {list(answers)}")
    if not isinstance(settings["with_label_log_probs"], bool):
        raise ValueError(f"settings.with_label_log_probs must be a bool, got {settings['with_label_log_probs']!r}")
    check_beside(settings["transport"], settings["with_label_log_probs"], where="settings")
    if settings["topk_encoding"] not in choices("topk_encoding"):
        raise ValueError(f"settings.topk_encoding must be {' or '.join(choices('topk_encoding'))}, got "
                         f"{settings['topk_encoding']!r}")
    cross = settings["cross_tokenizer_loss"]
    if cross not in (None, *CROSS_LOSSES):
        raise ValueError(f"settings.cross_tokenizer_loss must be null or one of {list(CROSS_LOSSES)}, got {cross!r}")
    # A cross-tokenizer student's vocabulary is its own: any size.
    integers = {"vocab_size": (1, 1 << 24 if cross else vocab_rows), "topk": (1, vocab_rows),
                "topk_tail_samples": (0, 1 << 16),
                "seed": (-(1 << 62), 1 << 62), "ignore_index": (-(1 << 31), 1 << 31)}
    for key, (low, high) in integers.items():
        if type(settings[key]) is not int or not low <= settings[key] <= high:
            raise ValueError(f"settings.{key} must be an integer in [{low}, {high}], got {settings[key]!r}")
    layers = settings["hidden_layers"]
    if not isinstance(layers, list) or not all(type(layer) is int and 0 <= layer < num_layers for layer in layers):
        raise ValueError(f"settings.hidden_layers must be a list of decoder layers in [0, {num_layers}), got "
                         f"{str(layers)[:80]}")
    temperature = settings["temperature"]
    if type(temperature) not in (int, float) or not 0 < temperature < float("inf"):
        raise ValueError(f"settings.temperature must be a number > 0, got {temperature!r}")


def answer_kd(kd: KDConfig, settings: dict[str, Any]) -> KDConfig:
    """`kd` with a request's settings: what the teacher encodes its answer with (the kind of answer is the
    request's own; a cross-tokenizer teacher's answers are per aligned group)."""
    cross = settings["cross_tokenizer_loss"]
    return replace(kd, topk=settings["topk"], topk_tail_samples=settings["topk_tail_samples"],
                   topk_encoding=settings["topk_encoding"], temperature=float(settings["temperature"]),
                   ignore_index=settings["ignore_index"],
                   cross_tokenizer=CrossTokenizerConfig(loss=cross) if cross else None)


@dataclass(frozen=True)
class Health:
    """What `GET /health` reports."""

    teacher: dict  # the teacher section's identity (`meshkd.recipe.modeling.models.model_identity`)
    vocabulary: str  # `vocabulary_fingerprint` of its tokenizer
    vocab_rows: int  # its output embedding's rows
    hidden_size: int
    num_layers: int  # its decoder layers
    load: dict  # requests queued and served, tokens served, seconds busy and up
    protocol: int = PROTOCOL_VERSION

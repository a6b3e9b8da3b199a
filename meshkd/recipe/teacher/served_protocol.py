"""What a served teacher (`meshkd serve-teacher`) and its students (`ServedTeacher`) say to each other over HTTP.

    GET  /health      -> 200 JSON `Health`: the teacher, its vocabulary's fingerprint and size, its load
    POST /v1/answer   body `wire.to_bytes({"batch": {...}, "settings": {...}})`
                      -> 200 body `wire.to_bytes(answer)`, the wire dict a teacher on the student's own ranks
                         would have made (`meshkd.recipe.teacher.teacher_answers`)
                      -> 4xx JSON {"error": message}: a request the server refuses (not retried);
                         503 JSON {"error": ...}: the server is draining (retried, as a lost connection is)

Bodies are `meshkd.core.wire` byte strings (a JSON spec, then little-endian tensor bytes): nothing from the
network is unpickled. A request carries its rows (`BATCH_KEYS`, int64 [rows, sequence]) and every setting the
answer depends on besides the teacher (`answer_settings`): the kind of answer, the student's vocabulary size
(the answer covers its first entries), the tail samples' seed, top-k's size and tail, the temperature, the
ignored label and the teacher layers whose outputs travel beside a training answer (`kd.hidden_states`). The
answer is then a pure function of the request and the teacher, so a retried request gets the same answer and
requests from several students can share a forward. With a token (`TOKEN_VARIABLE`, never a config key)
every request must carry `Authorization: Bearer TOKEN`.
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
from meshkd.core.logits_codec import TEACHER_ANSWERS
from meshkd.recipe.corpus.rows import BATCH_KEYS
from meshkd.recipe.settings.config import KDConfig

PROTOCOL_VERSION = 1
HEALTH_PATH = "/health"
ANSWER_PATH = "/v1/answer"
TOKEN_VARIABLE = "MESHKD_TEACHER_TOKEN"
"""The environment variable holding the bearer token, on the server and on every student rank."""

SETTINGS_KEYS = ("transport", "vocab_size", "seed", "topk", "topk_tail_samples", "temperature", "ignore_index",
                 "hidden_layers")


def answer_settings(kd: KDConfig, *, seed: int, vocab_size: int, hidden_layers: Sequence[int] = ()) -> dict[str, Any]:
    """The settings a student's requests carry besides the kind of answer (`transport`, set per request);
    `hidden_layers`: the teacher layers of `kd.hidden_states`' pairs, whose outputs travel beside a training
    answer ([] for none)."""
    return {"vocab_size": vocab_size, "seed": seed, "topk": kd.topk, "topk_tail_samples": kd.topk_tail_samples,
            "temperature": kd.temperature, "ignore_index": kd.ignore_index, "hidden_layers": list(hidden_layers)}


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
        return wire.to_bytes({"batch": {key: self.batch[key] for key in BATCH_KEYS}, "settings": self.settings})

    @property
    def tokens(self) -> int:
        return self.batch["input_ids"].numel()

    def compatible_key(self) -> tuple:
        """Requests with equal keys can share a forward (their rows stacked): same settings, same row length."""
        return (tuple(sorted(self.settings.items())), self.batch["input_ids"].shape[1])


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
    if not isinstance(batch, dict) or set(batch) != set(BATCH_KEYS):
        raise ValueError(f"batch must hold exactly {list(BATCH_KEYS)}")
    ids = batch["input_ids"]
    shape = ids.shape if isinstance(ids, torch.Tensor) and ids.ndim == 2 else None
    for key in BATCH_KEYS:
        tensor = batch[key]
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64 or tensor.shape != shape:
            raise ValueError(f"batch.{key} must be an int64 tensor [rows, sequence] shaped as batch.input_ids")
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"batch holds no token (input_ids {list(shape)})")
    if shape.numel() > max_tokens:
        raise TooLarge(f"the request holds {shape.numel()} tokens, more than this server's limit {max_tokens}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_rows:
        raise ValueError(f"batch.input_ids must be token ids in [0, {vocab_rows}), got [{int(ids.min())}, "
                         f"{int(ids.max())}]")
    if int(batch["position_ids"].min()) < 0 or int(batch["position_ids"].max()) >= shape[1]:
        raise ValueError(f"batch.position_ids must be in [0, {shape[1]})")
    _check_settings(settings, vocab_rows, num_layers)
    return AnswerRequest(batch, settings)


class TooLarge(ValueError):
    """A request over the server's limits (HTTP 413)."""


def _check_settings(settings: Any, vocab_rows: int, num_layers: int) -> None:
    if not isinstance(settings, dict) or set(settings) != set(SETTINGS_KEYS):
        given = sorted(settings) if isinstance(settings, dict) else type(settings).__name__
        raise ValueError(f"settings must hold exactly {list(SETTINGS_KEYS)}, got {given}")
    if settings["transport"] not in TEACHER_ANSWERS:
        raise ValueError(f"settings.transport {settings['transport']!r} is not one of {list(TEACHER_ANSWERS)}")
    integers = {"vocab_size": (1, vocab_rows), "topk": (1, vocab_rows), "topk_tail_samples": (0, 1 << 16),
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
    request's own; one tokenizer)."""
    return replace(kd, topk=settings["topk"], topk_tail_samples=settings["topk_tail_samples"],
                   temperature=float(settings["temperature"]), ignore_index=settings["ignore_index"],
                   cross_tokenizer=None)


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

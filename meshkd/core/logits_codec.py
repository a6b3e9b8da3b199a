"""Teacher logits on the wire: encode, check and take the KD loss of a teacher's answer, whatever its encoding.

The teacher encodes (`encode_teacher_logits`), the bridge carries the result like any nested value, and
the student's KD loss consumes it as it arrives (`kd_loss_encoded`). The encodings are registered by name in
`meshkd.core.encodings`, one module each, with their bytes a token:

- "full": the logits in the teacher's dtype (4 V bytes a token in float32); "full_bf16": rounded to bfloat16
  (2 V bytes) (`meshkd.core.encodings.full`);
- "topk": the k largest log-probabilities, their indices, the tail's mass and optionally m tail samples,
  8 k + 4 + 8 m bytes whatever V (`meshkd.core.encodings.topk`, which also says how the tail keeps the loss a
  divergence);
- "topk_compact": a top-k answer packed, 215 bytes at k = 64, m = 32, V = 49,152
  (`meshkd.core.encodings.compact`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from meshkd.core import wire
from meshkd.core.encodings import ENCODINGS, AnswerEncoding, choices, encoding_named
from meshkd.core.loss import check_divergence

LOGITS_MODES = choices("logits_transport")
"""What `kd.logits_transport` may ask for."""
LABEL_LOG_PROBS = "label_log_probs"
"""What an evaluation asks of the teacher instead of logits: its log-probability of each label (4 bytes a token)."""


def with_label_log_probs(mode: str) -> str:
    """What an evaluation asks for to get both an encoding of the logits (`mode`, one of `LOGITS_MODES`) and
    each label's log-probability, in one request: the answer is the encoding with one more field,
    "label_log_probs" [batch, sequence] float32 (0 at ignored labels); `split_label_log_probs` parts them."""
    if mode not in LOGITS_MODES:
        raise ValueError(f"logits mode must be one of {LOGITS_MODES}, got {mode!r}")
    return f"{mode}+{LABEL_LOG_PROBS}"


WITH_LABEL_LOG_PROBS = tuple(with_label_log_probs(mode) for mode in LOGITS_MODES)
TEACHER_ANSWERS = (*LOGITS_MODES, LABEL_LOG_PROBS, *WITH_LABEL_LOG_PROBS)
"""Everything a teacher request may ask for."""


def split_label_log_probs(answer: dict[str, Any]) -> tuple[dict[str, Any], Tensor]:
    """(the encoding of the logits, each label's log-probability) of a `with_label_log_probs` answer."""
    if not isinstance(answer, dict) or not isinstance(answer.get("label_log_probs"), Tensor):
        raise ValueError("a teacher answer asked with_label_log_probs must hold a label_log_probs tensor")
    encoded = {key: value for key, value in answer.items() if key != "label_log_probs"}
    return encoded, answer["label_log_probs"]


def encode_teacher_logits(
    logits: Tensor,
    mode: str = "full",
    *,
    k: int | None = None,
    temperature: float = 1.0,
    tail_samples: int = 0,
    seed: int = 0,
    chunk_size: int = 1024,
) -> dict[str, Any]:
    """Encode full teacher logits for transport.

    Args:
        logits: [batch, sequence, vocab] (or [tokens, vocab]) full, replicated teacher logits, already
            trimmed to the vocabulary the student uses.
        mode: a registered encoding's name (`meshkd.core.encodings`): "full", "full_bf16", "topk", "topk_compact".
        k: entries kept per token by top-k, 1 <= k <= vocab; ignored otherwise.
        temperature: top-k log-probabilities are taken at this temperature, and the loss must use the same.
        tail_samples: m >= 0 tail tokens sampled per token by top-k (0: the rest-bucket loss).
        seed: seeds the tail sampling.
        chunk_size: tokens encoded at a time by top-k (bounds the float32 working memory).

    Returns:
        The answer dict, {"mode": mode, ...}: full keeps `logits` itself (its dtype: the teacher's), full_bf16
        rounds them to bfloat16; top-k's fields are `meshkd.core.encodings.topk.TopK.encode`'s.
    """
    if mode not in ENCODINGS:
        raise ValueError(f"logits mode must be one of {tuple(ENCODINGS)}, got {mode!r}")
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.ndim < 2:
        raise ValueError("teacher logits must be a floating-point tensor [..., vocab]")
    return ENCODINGS[mode].encode(logits.detach(), k=k, temperature=temperature, tail_samples=tail_samples,
                                  seed=seed, chunk_size=chunk_size)


def encode_teacher_rows(logits: Tensor, mode: str, *, seeds: list[int], **options: Any) -> dict[str, Any]:
    """`encode_teacher_logits` of [rows, sequence, vocab] logits with one tail-sampling seed per row.

    A row's encoding then depends on that row alone, not on the rows it was batched with, so an encoding
    computed ahead of time for each row (an offline cache) equals the one computed live for any batch.
    """
    if len(seeds) != logits.shape[0]:
        raise ValueError(f"need one seed per row: {logits.shape[0]} rows, {len(seeds)} seeds")
    if mode not in ENCODINGS or not ENCODINGS[mode].seeded(tail_samples=options.get("tail_samples", 0)) or not seeds:
        return encode_teacher_logits(logits, mode, **options)
    rows = [encode_teacher_logits(logits[i : i + 1], mode, seed=seed, **options) for i, seed in enumerate(seeds)]
    return {key: torch.cat([row[key] for row in rows]) if isinstance(value, Tensor) else value
            for key, value in rows[0].items()}


def label_log_probs(logits: Tensor, labels: Tensor, *, ignore_index: int = -100,
                    chunk_size: int = 1024) -> dict[str, Any]:
    """The teacher's log-probability of each label: {"mode": LABEL_LOG_PROBS, "log_probs": [...] float32}.

    Args:
        logits: [batch, sequence, vocab] full teacher logits (temperature 1).
        labels: [batch, sequence] targets aligned with the logits; positions holding `ignore_index` get 0.
        chunk_size: tokens at a time (bounds the float32 working memory).

    The sum of -log_probs over valid labels is the teacher's cross-entropy on them.
    """
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels {tuple(labels.shape)} do not fit teacher logits {tuple(logits.shape)}")
    rows, targets = logits.detach().reshape(-1, logits.shape[-1]), labels.reshape(-1)
    valid = targets != ignore_index
    out = torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, rows.shape[0], chunk_size):
        chunk = slice(start, start + chunk_size)
        log_p = torch.log_softmax(rows[chunk].float(), dim=-1)
        picked = log_p.gather(-1, targets[chunk].clamp(min=0)[:, None])[:, 0]
        out[chunk] = torch.where(valid[chunk], picked, 0.0)
    return {"mode": LABEL_LOG_PROBS, "log_probs": out.view(labels.shape)}


def check_encoded_logits(encoded: Any, shape: tuple[int, ...] | torch.Size, *, check_indices: bool = True) -> str:
    """Validate encoded teacher logits against the student logits' (global) shape; returns the mode.

    Everything a peer could get wrong is checked here, before any of it is used: the mode, fields, dtypes,
    shapes, and for an answer with indices (top-k) that they lie in [0, vocab) and are distinct per token (one
    host sync). With `check_indices` False the index values are left to the caller (`AnswerEncoding.index_errors`,
    which reads nothing back): a training step folds them into the one reduction it makes per step anyway.

    Raises:
        ValueError: with what is wrong.
    """
    mode = encoded.get("mode") if isinstance(encoded, dict) else type(encoded).__name__
    encoding_named(mode).check(encoded, tuple(shape), check_indices=check_indices)
    return mode


def topk_index_message(vocab: int) -> str:
    """What `check_encoded_logits` says of top-k indices that `AnswerEncoding.index_errors` finds wrong."""
    return ENCODINGS["topk"].index_message(vocab)


def decode_teacher_logits(encoded: dict[str, Any]) -> Tensor:
    """The full teacher logits [..., vocab] an encoding carries (bfloat16 stays bfloat16).

    Raises ValueError for an encoding that does not carry them (top-k: its loss consumes the answer itself).
    """
    mode = encoded.get("mode") if isinstance(encoded, dict) else None
    if mode not in ENCODINGS or not ENCODINGS[mode].whole_distribution:
        whole = " and ".join(choices("logits_transport", whole_distribution=True))
        raise ValueError(f"only {whole} encodings carry full logits, got mode {mode!r}")
    return encoded["logits"]


def kd_loss_encoded(
    student_logits: Tensor,
    teacher: dict,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    num_valid_tokens: int | Tensor | None = None,
    chunk_size: int | None = None,
    divergence: str = "forward_kl",
    jsd_beta: float = 0.5,
    skew_alpha: float = 0.1,
    check_indices: bool = True,
) -> Tensor:
    """`meshkd.core.loss.kd_loss` against a teacher answer in any registered encoding: checked, then given to
    its encoding's loss kernel (whole logits: `kd_loss`; top-k: `kd_loss_topk`, forward KL only).

    Args:
        student_logits: [batch, sequence, vocab] or [tokens, vocab], or a vocab-sharded DTensor.
        teacher: the answer, as `send_logits` delivers it; validated against the student's global shape.
        labels, ignore_index, num_valid_tokens, chunk_size, divergence, jsd_beta, skew_alpha: as for `kd_loss`.
        temperature: T > 0; a top-k answer must have been made at the same temperature.
        check_indices: False leaves the check of top-k index values to the caller (`check_encoded_logits`),
            which the chunked and vocab-parallel paths allow: they read only the entries in range, so wrong
            indices give a wrong value, never an out-of-bounds read. The plain path always checks.
    """
    plain = chunk_size is None and not isinstance(student_logits, DTensor)
    encoding = encoding_named(check_encoded_logits(teacher, student_logits.shape,
                                                   check_indices=check_indices or plain))
    check_divergence(divergence, jsd_beta, skew_alpha=skew_alpha)
    encoding.check_divergence(divergence)
    return encoding.loss(student_logits, teacher, labels, temperature=temperature, ignore_index=ignore_index,
                         num_valid_tokens=num_valid_tokens, chunk_size=chunk_size, divergence=divergence,
                         jsd_beta=jsd_beta, skew_alpha=skew_alpha)


def encoded_nbytes(encoded: Any) -> int:
    """Bytes the data collective carries for a value on the wire (encoded logits or a plain tensor)."""
    return wire.payload_nbytes(encoded)


__all__ = ["LABEL_LOG_PROBS", "LOGITS_MODES", "TEACHER_ANSWERS", "WITH_LABEL_LOG_PROBS", "AnswerEncoding",
           "check_encoded_logits", "decode_teacher_logits", "encode_teacher_logits", "encode_teacher_rows",
           "encoded_nbytes", "kd_loss_encoded", "label_log_probs",
           "split_label_log_probs", "topk_index_message", "with_label_log_probs"]

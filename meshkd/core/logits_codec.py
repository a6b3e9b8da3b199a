"""Teacher logits on the wire: encodings of [batch, sequence, vocab] teacher logits for `send_logits`.

The teacher encodes (`encode_teacher_logits`), the bridge carries the result like any nested value, and
the student's KD loss consumes it as it arrives (`meshkd.core.loss.kd_loss_encoded`). Modes, with bytes per
token at vocabulary V:

- "full": the logits as the teacher computed them, exact, in the teacher's dtype (`teacher_model.dtype`):
  4 V bytes in float32, 2 V for a bfloat16 or float16 teacher. The loss upcasts them to float32.
- "full_bf16": the logits rounded to bfloat16 (2 V bytes, half of float32). The loss upcasts them to
  float32; rounding moves each logit by at most 2^-9 of its magnitude.
- "topk": per token the k largest teacher log-probabilities at temperature T (float32), their vocab
  indices (int32) and the log of the teacher's remaining tail mass P_rest (float32), plus optionally m
  samples of the tail (int32 index and float32 log-probability each): 8 k + 4 + 8 m bytes, whatever V
  (k = 64, V = 49152: 516 bytes, 0.26% of float32; with m = 32 tail samples, 772 bytes, 0.39%).

How "topk" treats the tail, so that the loss stays a divergence between distributions (naive top-k,
which renormalises the k values and drops the tail, is biased and has the wrong optimum):

- m = 0, "rest bucket": the KL over k + 1 buckets, the k tokens and a rest bucket holding P_rest on the
  teacher's side and the student's rest mass q_rest = 1 - (its mass on the k tokens) on the other. It is
  the full-vocabulary KL against a teacher whose tail is spread in the student's own proportions, so it
  is >= 0 and its gradient is T * (p_s - p_hat) for a proper distribution p_hat. Its error against the
  full KL is exactly  KL_full - KL_topk = P_rest * KL(teacher tail shape || student tail shape) >= 0:
  it never overestimates, and it is small when the tail mass is small or the student's tail already has
  the teacher's shape, but a student far from its teacher (early in distillation) sees it underestimate
  by up to P_rest times that tail divergence.
- m > 0, "sampled tail": the tail's share of the KL, sum over the tail of p_t (log p_t - log q), is
  estimated from m tail tokens drawn from the teacher's tail distribution (systematic sampling: one
  random offset per token, m evenly spaced points of the tail's cumulative distribution), each sent with
  its teacher log-probability: P_rest * mean_j (log p_t(v_j) - log q(v_j)). The loss is then an unbiased
  estimate of the full KL, with a noise that shrinks as the student's tail approaches the teacher's; its
  gradient is T * (p_s - p_hat) with p_hat the k top tokens plus the m samples weighted P_rest / m each,
  again a proper distribution. Sampling uses a generator seeded by `seed`: the same logits give the same
  encoding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from meshkd.core import wire

LOGITS_MODES = ("full", "full_bf16", "topk")
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


_FIELDS = {
    "full": {"mode", "logits"},
    "full_bf16": {"mode", "logits"},
    "topk": {"mode", "temperature", "log_probs", "indices", "tail_log_prob"},
}
_TAIL_SAMPLE_FIELDS = {"tail_indices", "tail_log_probs"}


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
        mode: "full", "full_bf16" or "topk" (see the module docstring).
        k: entries kept per token in "topk" mode, 1 <= k <= vocab; ignored otherwise.
        temperature: "topk" log-probabilities are taken at this temperature, and the loss must use the same.
        tail_samples: m >= 0 tail tokens sampled per token in "topk" mode (0: the rest-bucket loss).
        seed: seeds the tail sampling.
        chunk_size: tokens encoded at a time in "topk" mode (bounds the float32 working memory).

    Returns:
        full / full_bf16: {"mode", "logits": [..., vocab]}: `logits` itself for full (its dtype kept: the
        teacher's), rounded to bfloat16 for full_bf16.
        topk: {"mode", "temperature", "log_probs": [..., k] float32, "indices": [..., k] int32,
        "tail_log_prob": [...] float32} and, with tail samples, "tail_indices": [..., m] int32 and
        "tail_log_probs": [..., m] float32. log_probs are sorted in decreasing order; tail_log_prob is the
        log of 1 - sum(exp(log_probs)), computed without cancellation (-inf when k == vocab).
    """
    if mode not in LOGITS_MODES:
        raise ValueError(f"logits mode must be one of {LOGITS_MODES}, got {mode!r}")
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.ndim < 2:
        raise ValueError("teacher logits must be a floating-point tensor [..., vocab]")
    logits = logits.detach()
    if mode == "full":
        return {"mode": mode, "logits": logits}
    if mode == "full_bf16":
        return {"mode": mode, "logits": logits.to(torch.bfloat16)}
    vocab = logits.shape[-1]
    if k is None or not 1 <= k <= vocab:
        raise ValueError(f"topk needs 1 <= k <= vocab ({vocab}), got k={k}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    if tail_samples < 0 or chunk_size < 1:
        raise ValueError(f"need tail_samples >= 0 and chunk_size >= 1, got {tail_samples} and {chunk_size}")
    rows = logits.reshape(-1, vocab)
    num_tokens, device = rows.shape[0], logits.device
    log_probs = torch.empty(num_tokens, k, dtype=torch.float32, device=device)
    indices = torch.empty(num_tokens, k, dtype=torch.int32, device=device)
    tail = torch.empty(num_tokens, dtype=torch.float32, device=device)
    tail_indices = torch.empty(num_tokens, tail_samples, dtype=torch.int32, device=device)
    tail_log_probs = torch.empty(num_tokens, tail_samples, dtype=torch.float32, device=device)
    generator = torch.Generator(device=device).manual_seed(seed) if tail_samples else None
    for start in range(0, num_tokens, chunk_size):
        chunk = slice(start, start + chunk_size)
        scaled = rows[chunk].float() / temperature
        lse = torch.logsumexp(scaled, dim=-1)
        top, top_index = scaled.topk(k, dim=-1)
        log_probs[chunk] = top - lse[:, None]
        indices[chunk] = top_index.to(torch.int32)
        # The tail's own logsumexp, not log(1 - sum p_top): exact even when the tail mass is tiny.
        tail_scaled = scaled.scatter_(-1, top_index, -math.inf)
        tail[chunk] = torch.logsumexp(tail_scaled, dim=-1) - lse
        if tail_samples:
            tail_indices[chunk], tail_log_probs[chunk] = _sample_tail(
                tail_scaled - lse[:, None], tail_samples, generator
            )
    lead = logits.shape[:-1]
    encoded = {
        "mode": mode,
        "temperature": float(temperature),
        "log_probs": log_probs.view(*lead, k),
        "indices": indices.view(*lead, k),
        "tail_log_prob": tail.view(lead),
    }
    if tail_samples:
        encoded["tail_indices"] = tail_indices.view(*lead, tail_samples)
        encoded["tail_log_probs"] = tail_log_probs.view(*lead, tail_samples)
    return encoded


def encode_teacher_rows(logits: Tensor, mode: str, *, seeds: list[int], **options: Any) -> dict[str, Any]:
    """`encode_teacher_logits` of [rows, sequence, vocab] logits with one tail-sampling seed per row.

    A row's encoding then depends on that row alone, not on the rows it was batched with, so an encoding
    computed ahead of time for each row (an offline cache) equals the one computed live for any batch.
    """
    if len(seeds) != logits.shape[0]:
        raise ValueError(f"need one seed per row: {logits.shape[0]} rows, {len(seeds)} seeds")
    if mode != "topk" or not options.get("tail_samples") or not seeds:  # no row: no sample either
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


def _sample_tail(tail_log_p: Tensor, num_samples: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Systematic sample of `num_samples` tokens per row from the tail distribution.

    Args:
        tail_log_p: [c, vocab] teacher log-probabilities with the top-k entries at -inf.

    Returns:
        ([c, m] int32 indices, [c, m] their log-probabilities). Each sample is marginally distributed as the
        normalised tail (so averages over them are unbiased), and evenly spaced points make their average far
        less noisy than independent draws. Rows with no tail mass return some index; their weight is 0.
    """
    cdf = tail_log_p.exp().cumsum(dim=-1)
    total = cdf[:, -1:]
    offsets = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device)
    points = (offsets + torch.arange(num_samples, device=cdf.device)) / num_samples * total
    # Strictly below the total, so that the first entry whose cdf exceeds a point exists and has mass.
    points = torch.minimum(points, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, points, right=True).clamp_(max=cdf.shape[-1] - 1)
    return index.to(torch.int32), tail_log_p.gather(-1, index)


def check_encoded_logits(encoded: Any, shape: tuple[int, ...] | torch.Size, *, check_indices: bool = True) -> str:
    """Validate encoded teacher logits against the student logits' (global) shape; returns the mode.

    Everything a peer could get wrong is checked here, before any of it is used: fields, dtypes, shapes,
    and for "topk" that indices lie in [0, vocab) and are distinct per token (one host sync). With
    `check_indices` False the index values are left to the caller (`topk_index_errors`, which reads nothing
    back): a training step folds them into the one reduction it makes per step anyway.

    Raises:
        ValueError: with what is wrong.
    """
    if not isinstance(encoded, dict) or encoded.get("mode") not in LOGITS_MODES:
        mode = encoded.get("mode") if isinstance(encoded, dict) else type(encoded).__name__
        raise ValueError(f"encoded teacher logits need a mode in {LOGITS_MODES}, got {mode!r}")
    mode = encoded["mode"]
    fields = set(encoded)
    if mode == "topk" and fields >= _TAIL_SAMPLE_FIELDS:
        fields -= _TAIL_SAMPLE_FIELDS
    if fields != _FIELDS[mode]:
        optional = f" (optionally with {sorted(_TAIL_SAMPLE_FIELDS)})" if mode == "topk" else ""
        raise ValueError(
            f"encoded {mode} teacher logits need fields {sorted(_FIELDS[mode])}{optional}, got {sorted(encoded)}"
        )
    shape = tuple(shape)
    if mode in ("full", "full_bf16"):
        logits = encoded["logits"]
        if not isinstance(logits, Tensor) or not logits.is_floating_point() or tuple(logits.shape) != shape:
            got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"encoded teacher logits are {got}, the student's are {shape}")
        return mode
    log_probs, indices, tail = encoded["log_probs"], encoded["indices"], encoded["tail_log_prob"]
    temperature = encoded["temperature"]
    if not isinstance(temperature, float) or not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"encoded topk temperature must be a positive finite float, got {temperature!r}")
    if not all(isinstance(t, Tensor) for t in (log_probs, indices, tail)):
        raise ValueError("encoded topk fields log_probs, indices and tail_log_prob must be tensors")
    lead, vocab = shape[:-1], shape[-1]
    k = log_probs.shape[-1] if log_probs.ndim else 0
    if (
        tuple(log_probs.shape) != (*lead, k)
        or tuple(indices.shape) != (*lead, k)
        or tuple(tail.shape) != lead
        or not 1 <= k <= vocab
    ):
        raise ValueError(
            f"encoded topk shapes log_probs {tuple(log_probs.shape)}, indices {tuple(indices.shape)}, tail_log_prob "
            f"{tuple(tail.shape)} do not fit student logits {shape} (want [..., k], [..., k], [...], 1 <= k <= vocab)"
        )
    if not log_probs.is_floating_point() or not tail.is_floating_point():
        raise ValueError("encoded topk log_probs and tail_log_prob must be floating point")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"encoded topk indices must be int32 or int64, got {indices.dtype}")
    if "tail_indices" in encoded:
        samples, sample_log_probs = encoded["tail_indices"], encoded["tail_log_probs"]
        if not isinstance(samples, Tensor) or not isinstance(sample_log_probs, Tensor):
            raise ValueError("encoded topk fields tail_indices and tail_log_probs must be tensors")
        m = samples.shape[-1] if samples.ndim else -1
        if tuple(samples.shape) != (*lead, m) or tuple(sample_log_probs.shape) != (*lead, m) or m < 1:
            raise ValueError(
                f"encoded topk tail_indices {tuple(samples.shape)} and tail_log_probs {tuple(sample_log_probs.shape)} "
                f"must both be [..., m] with leading dims {lead} and m >= 1"
            )
        if samples.dtype not in (torch.int32, torch.int64) or not sample_log_probs.is_floating_point():
            raise ValueError("encoded topk tail_indices must be int32 or int64 and tail_log_probs floating point")
    if check_indices and bool(topk_index_errors(encoded, vocab)):  # one host sync for every index value
        raise ValueError(topk_index_message(vocab))
    return mode


def topk_index_errors(encoded: dict[str, Any], vocab: int) -> Tensor:
    """Whether a top-k encoding (its fields checked by `check_encoded_logits`) holds an index outside
    [0, `vocab`) or one repeated within a token's k, as a 0-dim bool tensor on the indices' device: nothing is
    read back, so the caller decides when to wait for it."""
    indices = encoded["indices"]
    bad = torch.zeros((), dtype=torch.bool, device=indices.device)
    if indices.numel():
        ordered = indices.reshape(-1, indices.shape[-1]).sort(dim=-1).values
        bad_range = (ordered[:, 0] < 0) | (ordered[:, -1] >= vocab)
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=-1)
        bad = (bad_range | repeated).any()
    samples = encoded.get("tail_indices")
    if samples is not None and samples.numel():
        bad = bad | (samples.amin() < 0) | (samples.amax() >= vocab)
    return bad


def topk_index_message(vocab: int) -> str:
    """What `check_encoded_logits` says of top-k indices that `topk_index_errors` finds wrong."""
    return f"encoded topk indices must be distinct per token and lie in [0, {vocab}), tail indices too"


def decode_teacher_logits(encoded: dict[str, Any]) -> Tensor:
    """The full teacher logits [..., vocab] an encoding carries (bfloat16 stays bfloat16).

    Raises ValueError for "topk", which does not carry them (its loss consumes the encoding itself).
    """
    mode = encoded.get("mode") if isinstance(encoded, dict) else None
    if mode not in ("full", "full_bf16"):
        raise ValueError(f"only full and full_bf16 encodings carry full logits, got mode {mode!r}")
    return encoded["logits"]


def encoded_nbytes(encoded: Any) -> int:
    """Bytes the data collective carries for a value on the wire (encoded logits or a plain tensor)."""
    return wire.payload_nbytes(encoded)


__all__ = ["LABEL_LOG_PROBS", "LOGITS_MODES", "TEACHER_ANSWERS", "WITH_LABEL_LOG_PROBS", "check_encoded_logits",
           "decode_teacher_logits", "encode_teacher_logits", "encode_teacher_rows", "encoded_nbytes", "label_log_probs",
           "split_label_log_probs", "topk_index_errors", "topk_index_message", "with_label_log_probs"]

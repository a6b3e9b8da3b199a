"""Top-k with its tail: "topk", the k largest teacher log-probabilities and what stands for the rest.

Per position: the k largest teacher log-probabilities at temperature T (float32), their vocabulary indices
(int32) and the log of the teacher's remaining tail mass P_rest (float32), plus optionally m samples of the tail
(int32 index and float32 log-probability each): 8 k + 4 + 8 m bytes, whatever V (k = 64, V = 49152: 516 bytes,
0.26% of float32; with m = 32 tail samples, 772 bytes, 0.39%).

How it treats the tail, so that the loss stays a divergence between distributions (naive top-k, which
renormalises the k values and drops the tail, is biased and has the wrong optimum):

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

The loss is forward KL only (`meshkd.core.loss.kd_loss_topk`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from meshkd.core.answers.base import register
from meshkd.core.answers.distribution import Distribution
from meshkd.core.loss import kd_loss_topk

_FIELDS = {"mode", "temperature", "log_probs", "indices", "tail_log_prob"}
_TAIL_SAMPLE_FIELDS = {"tail_indices", "tail_log_probs"}


@register
class TopK(Distribution):
    """The teacher's top-k log-probabilities with its tail (the module docstring)."""

    name = "topk"
    selected_by = {"logits_transport": "topk", "topk_encoding": "exact"}
    settings_keys = ("topk", "topk_tail_samples", "temperature")
    has_indices = True

    @classmethod
    def encode_logits(cls, logits, *, k, temperature, tail_samples, seed, chunk_size):
        """{"mode", "temperature", "log_probs": [..., k] float32, "indices": [..., k] int32, "tail_log_prob": [...]
        float32} and, with tail samples, "tail_indices": [..., m] int32 and "tail_log_probs": [..., m] float32.
        log_probs are sorted in decreasing order; tail_log_prob is the log of 1 - sum(exp(log_probs)), computed
        without cancellation (-inf when k == vocab)."""
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
            "mode": cls.name,
            "temperature": float(temperature),
            "log_probs": log_probs.view(*lead, k),
            "indices": indices.view(*lead, k),
            "tail_log_prob": tail.view(lead),
        }
        if tail_samples:
            encoded["tail_indices"] = tail_indices.view(*lead, tail_samples)
            encoded["tail_log_probs"] = tail_log_probs.view(*lead, tail_samples)
        return encoded

    @classmethod
    def seeded(cls, *, tail_samples):
        return tail_samples > 0

    @classmethod
    def check(cls, answer: dict[str, Any], shape) -> None:
        fields = set(answer)
        if fields >= _TAIL_SAMPLE_FIELDS:
            fields -= _TAIL_SAMPLE_FIELDS
        if fields != _FIELDS:
            raise ValueError(f"encoded topk teacher logits need fields {sorted(_FIELDS)} (optionally with "
                             f"{sorted(_TAIL_SAMPLE_FIELDS)}), got {sorted(answer)}")
        shape = tuple(shape)
        log_probs, indices, tail = answer["log_probs"], answer["indices"], answer["tail_log_prob"]
        temperature = answer["temperature"]
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
                f"encoded topk shapes log_probs {tuple(log_probs.shape)}, indices {tuple(indices.shape)}, "
                f"tail_log_prob {tuple(tail.shape)} do not fit student logits {shape} (want [..., k], [..., k], "
                "[...], 1 <= k <= vocab)"
            )
        if not log_probs.is_floating_point() or not tail.is_floating_point():
            raise ValueError("encoded topk log_probs and tail_log_prob must be floating point")
        if indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"encoded topk indices must be int32 or int64, got {indices.dtype}")
        if "tail_indices" in answer:
            samples, sample_log_probs = answer["tail_indices"], answer["tail_log_probs"]
            if not isinstance(samples, Tensor) or not isinstance(sample_log_probs, Tensor):
                raise ValueError("encoded topk fields tail_indices and tail_log_probs must be tensors")
            m = samples.shape[-1] if samples.ndim else -1
            if tuple(samples.shape) != (*lead, m) or tuple(sample_log_probs.shape) != (*lead, m) or m < 1:
                raise ValueError(
                    f"encoded topk tail_indices {tuple(samples.shape)} and tail_log_probs "
                    f"{tuple(sample_log_probs.shape)} must both be [..., m] with leading dims {lead} and m >= 1"
                )
            if samples.dtype not in (torch.int32, torch.int64) or not sample_log_probs.is_floating_point():
                raise ValueError("encoded topk tail_indices must be int32 or int64 and tail_log_probs floating point")

    @classmethod
    def index_errors(cls, answer, vocab):
        """Nothing is read back: the caller decides when to wait for the flag."""
        indices = answer["indices"]
        bad = torch.zeros((), dtype=torch.bool, device=indices.device)
        if indices.numel():
            ordered = indices.reshape(-1, indices.shape[-1]).sort(dim=-1).values
            bad_range = (ordered[:, 0] < 0) | (ordered[:, -1] >= vocab)
            repeated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=-1)
            bad = (bad_range | repeated).any()
        samples = answer.get("tail_indices")
        if samples is not None and samples.numel():
            bad = bad | (samples.amin() < 0) | (samples.amax() >= vocab)
        return bad

    @classmethod
    def index_message(cls, vocab):
        return f"encoded topk indices must be distinct per token and lie in [0, {vocab}), tail indices too"

    @classmethod
    def bytes_per_token(cls, vocab, *, k, tail_samples, logits_bytes, width=None):
        return 8 * k + 4 + 8 * tail_samples

    @classmethod
    def kernel(cls, student_logits, decoded, labels, kd, *, norm, chunk_size, divergence=None):
        cls.checked(decoded, student_logits, kd, divergence or kd.divergence)
        return kd_loss_topk(student_logits, decoded, labels, temperature=kd.temperature, ignore_index=kd.ignore_index,
                            num_valid_tokens=norm, chunk_size=chunk_size)


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

"""Compact top-k answers, "topk_compact": a "topk" answer (`meshkd.core.encodings.topk`) packed into bytes a token,
for the wire, the teacher cache and a served teacher (`kd.topk_encoding: compact`).

Design. Every token takes the same number of bytes, so a batch's answer stays one tensor, [..., nbytes] uint8,
that the bridge, the cache and a served teacher carry, slice and concatenate as any other field:

    [ k + m indices, ceil(log2 V) bits each, bit-packed | k top log-probs, 1 byte each | log P_rest, float32 |
      the m tail samples' mean log-probability, float32 (with m > 0) ]

- Indices: the k top entries, then the m tail samples, each in b = ceil(log2 V) bits (16 for V = 49,152, 18 for
  151,936), least significant bit first.
- Top log-probabilities: q = round(-16 log p), clamped to [0, 255]: a step of 1/16 nat, so each is off by at
  most 1/32 nat down to p = e^-15.97 (1.2e-7); a smaller one decodes as e^-15.97 (at most 64 such entries,
  mass 7.4e-6). Decoding shifts the k values by one shared amount so that they hold exactly 1 - P_rest, as the
  exact answer's do: the decoded answer is a proper distribution with the exact tail mass. Its KL to the exact
  answer is then -sum_i p_i e_i with errors e_i spread over at most 1/16 nat, at most about
  (1/32)^2 / 2 = 4.9e-4 nats a token (second order), whatever k.
- log P_rest: float32, exact. The tail samples' log-probabilities: their mean alone, float32, decoded as m equal
  values. The sampled-tail loss reads them only through that mean (P_rest * mean_j (log p_t(v_j) - log q(v_j))),
  and its gradient not at all (T * (p_s - p_hat), a tail share of P_rest / m a sample): exact.

k = 64 with 32 tail samples at V = 49,152 takes 264 bytes a token (192 of them indices), 34.2% of the exact
encoding's 772; at V = 151,936, 288.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from meshkd.core.encodings.base import ENCODINGS, AnswerEncoding, register
from meshkd.core.encodings.topk import TopK

COMPACT = "topk_compact"
TOP_STEP = 16.0
"""Quantization steps a nat of the top log-probabilities."""
_CHUNK = 4096  # tokens packed at a time: bounds the [tokens, entries, bits] bit matrix


def index_bits(vocab: int) -> int:
    """Bits an index of a `vocab`-entry vocabulary takes."""
    return max(1, math.ceil(math.log2(vocab)))


def nbytes_per_token(k: int, tail_samples: int, vocab: int) -> int:
    """Bytes a token of a compact answer takes (see the module docstring)."""
    return math.ceil((k + tail_samples) * index_bits(vocab) / 8) + k + 4 + (4 if tail_samples else 0)


def pack_topk(encoded: dict[str, Any], vocab: int) -> dict[str, Any]:
    """The compact form of a "topk" encoding over a `vocab`-entry vocabulary: {"mode": COMPACT, "temperature",
    "k", "tail_samples", "vocab", "packed": [..., nbytes] uint8}."""
    log_probs, indices, tail = encoded["log_probs"], encoded["indices"], encoded["tail_log_prob"]
    lead, k = tuple(tail.shape), log_probs.shape[-1]
    samples = encoded.get("tail_indices")
    m = 0 if samples is None else samples.shape[-1]
    all_indices = indices.reshape(-1, k).long()
    top_q = (log_probs.reshape(-1, k).float() * -TOP_STEP).round().clamp(0, 255).to(torch.uint8)
    floats = [tail.reshape(-1).float()]
    if m:
        all_indices = torch.cat([all_indices, samples.reshape(-1, m).long()], dim=1)
        floats.append(encoded["tail_log_probs"].reshape(-1, m).float().mean(-1))
    parts = [top_q, torch.stack(floats, dim=1).view(torch.uint8)]
    packed = torch.cat([_pack_bits(all_indices, index_bits(vocab)), *parts], dim=1)
    return {"mode": COMPACT, "temperature": encoded["temperature"], "k": k, "tail_samples": m, "vocab": vocab,
            "packed": packed.view(*lead, packed.shape[-1])}


def unpack_topk(compact: dict[str, Any]) -> dict[str, Any]:
    """The "topk" encoding a compact answer carries (its values quantized, see the module docstring).

    Raises:
        ValueError: fields or sizes that do not fit each other, naming them.
    """
    k, m, vocab, packed = (compact.get(key) for key in ("k", "tail_samples", "vocab", "packed"))
    if not (type(k) is int and type(m) is int and type(vocab) is int and k >= 1 and m >= 0 and vocab >= k):
        raise ValueError(f"a compact top-k answer needs integers k >= 1, tail_samples >= 0 and vocab >= k, got "
                         f"k={k!r}, tail_samples={m!r}, vocab={vocab!r}")
    width = nbytes_per_token(k, m, vocab)
    if not isinstance(packed, Tensor) or packed.dtype != torch.uint8 or packed.ndim < 1 or packed.shape[-1] != width:
        got = (f"{packed.dtype} {tuple(packed.shape)}" if isinstance(packed, Tensor) else type(packed).__name__)
        raise ValueError(f"a compact top-k answer of k={k}, tail_samples={m}, vocab={vocab} packs {width} bytes a "
                         f"token (uint8 [..., {width}]), got {got}")
    lead = tuple(packed.shape[:-1])
    rows = packed.reshape(-1, width)
    bits = index_bits(vocab)
    index_bytes = math.ceil((k + m) * bits / 8)
    indices = _unpack_bits(rows[:, :index_bytes], k + m, bits)
    top = rows[:, index_bytes : index_bytes + k].float() / -TOP_STEP
    floats = rows[:, index_bytes + k :].contiguous().view(torch.float32)
    rest = floats[:, 0]
    # One shift for the k values, so that they hold 1 - P_rest exactly (log1p(-P_rest), without cancellation).
    kept = torch.log(-torch.expm1(rest)).nan_to_num(neginf=-math.inf)
    top = top + (kept - torch.logsumexp(top, dim=-1))[:, None]
    encoded = {"mode": "topk", "temperature": compact["temperature"],
               "log_probs": top.view(*lead, k), "indices": indices[:, :k].to(torch.int32).view(*lead, k),
               "tail_log_prob": rest.view(lead)}
    if m:
        encoded["tail_indices"] = indices[:, k:].to(torch.int32).view(*lead, m)
        encoded["tail_log_probs"] = floats[:, 1:].expand(-1, m).reshape(*lead, m)
    return encoded


@register
class CompactTopK(AnswerEncoding):
    name = COMPACT
    selected_by = {"logits_transport": "topk", "topk_encoding": "compact"}
    settings_keys = (*TopK.settings_keys, "topk_encoding")
    has_indices = True

    @property
    def exact(self) -> TopK:
        return ENCODINGS[TopK.name]

    def encode(self, logits, **options):
        return pack_topk(self.exact.encode(logits, **options), logits.shape[-1])

    def seeded(self, *, tail_samples):
        return self.exact.seeded(tail_samples=tail_samples)

    def decode(self, answer):
        """The "topk" answer it carries; besides it, fields other than the packing's (an evaluation's label
        log-probabilities, a teacher's hidden states) are kept."""
        packing = ("k", "tail_samples", "vocab", "packed")
        return {**{key: value for key, value in answer.items() if key not in packing}, **unpack_topk(answer)}

    def check(self, answer, shape, *, check_indices):
        self.exact.check(self.decode(answer), shape, check_indices=check_indices)

    def index_errors(self, answer, vocab):
        return self.exact.index_errors(self.decode(answer), vocab)

    def index_message(self, vocab):
        return self.exact.index_message(vocab)

    def nbytes_per_token(self, vocab, *, k, tail_samples, logits_bytes):
        return nbytes_per_token(k, tail_samples, vocab)

    def loss(self, student_logits, answer, labels, **options):
        return self.exact.loss(student_logits, self.decode(answer), labels, **options)


def _pack_bits(values: Tensor, bits: int) -> Tensor:
    """[tokens, entries] non-negative integers below 2^bits -> [tokens, ceil(entries * bits / 8)] uint8."""
    tokens, entries = values.shape
    width = math.ceil(entries * bits / 8)
    out = torch.empty(tokens, width, dtype=torch.uint8, device=values.device)
    shifts = torch.arange(bits, device=values.device)
    weights = (1 << torch.arange(8, device=values.device)).to(torch.uint8)
    for start in range(0, tokens, _CHUNK):
        chunk = values[start : start + _CHUNK]
        flat = ((chunk[..., None] >> shifts) & 1).to(torch.uint8).view(len(chunk), entries * bits)
        flat = torch.nn.functional.pad(flat, (0, width * 8 - entries * bits))
        out[start : start + _CHUNK] = (flat.view(len(chunk), width, 8) * weights).sum(-1, dtype=torch.uint8)
    return out


def _unpack_bits(packed: Tensor, entries: int, bits: int) -> Tensor:
    """`_pack_bits`' inverse: [tokens, width] uint8 -> [tokens, entries] int64."""
    tokens = packed.shape[0]
    out = torch.empty(tokens, entries, dtype=torch.int64, device=packed.device)
    shifts = torch.arange(8, device=packed.device)
    weights = 1 << torch.arange(bits, device=packed.device)
    for start in range(0, tokens, _CHUNK):
        chunk = packed[start : start + _CHUNK]
        flat = ((chunk[..., None].long() >> shifts) & 1).view(len(chunk), -1)[:, : entries * bits]
        out[start : start + _CHUNK] = (flat.view(len(chunk), entries, bits) * weights).sum(-1)
    return out


__all__ = ["COMPACT", "CompactTopK", "index_bits", "nbytes_per_token", "pack_topk", "unpack_topk"]

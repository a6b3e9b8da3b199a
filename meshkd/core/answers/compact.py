"""Compact top-k answers, "topk_compact": a "topk" answer (`meshkd.core.answers.topk`) packed into bytes a token,
for the wire, the teacher cache and a served teacher (`kd.topk_encoding: compact`).

Design. Every token takes the same number of bytes, so a batch's answer stays one tensor, [..., nbytes] uint8,
that the bridge, the cache and a served teacher carry, slice and concatenate as any other field:

    [ bits: the k top indices as a set | the m tail samples as a sorted list | the top-1's slot among the k |
      k top log-probs, 1 byte each, in index order | log P_rest, float32 | the m samples' mean log-probability,
      float32 (with m > 0) ]

- Indices: a sorted list of n values below V in Elias-Fano form, a fixed n (l + 1) + (V >> l) bits or so
  whatever the values (`elias_fano_bits`): each value's l low bits as they are, its high part in unary (a one
  at high + i in a bitmap). The k top indices are a set (the loss reads them in any order): sorted, 92 bytes
  for k = 64 at V = 49,152 where 16 bits each take 128. The m tail samples are sorted already (systematic
  sampling walks the tail's cumulative distribution in index order, `topk._sample_tail`): 50 bytes for 32.
  Their order restored on decoding is by the quantized values, ties by index; the top-1 alone is kept exact
  (its slot, ceil(log2 k) bits), as an evaluation's top-1 agreement reads it.
- Top log-probabilities: q = round(-16 log p), clamped to [0, 255]: a step of 1/16 nat, so each is off by at
  most 1/32 nat down to p = e^-15.97 (1.2e-7); a smaller one decodes as e^-15.97 (at most 64 such entries,
  mass 7.4e-6). Decoding shifts the k values by one shared amount so that they hold exactly 1 - P_rest, as the
  exact answer's do: the decoded answer is a proper distribution with the exact tail mass. Its KL to the exact
  answer is then -sum_i p_i e_i with errors e_i spread over at most 1/16 nat, at most about
  (1/32)^2 / 2 = 4.9e-4 nats a token (second order), whatever k.
- log P_rest: float32, exact. The tail samples' log-probabilities: their mean alone, float32, decoded as m equal
  values. The sampled-tail loss reads them only through that mean (P_rest * mean_j (log p_t(v_j) - log q(v_j))),
  and its gradient not at all (T * (p_s - p_hat), a tail share of P_rest / m a sample): exact.

k = 64 with 32 tail samples takes 215 bytes a token at V = 49,152 (142 of them indices), 27.8% of the exact
encoding's 772; 235 at V = 151,936. A fifth (155) is out of reach while each token sends 96 indices: a set of
64 of 49,152 holds log2 C(49152, 64) = 701 bits of information and 32 sorted samples about 380 more, 135 bytes
before any value. A damaged index bitmap (not n ones) is found by the index check (`index_errors`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from meshkd.core.answers.base import register
from meshkd.core.answers.topk import TopK

COMPACT = "topk_compact"
TOP_STEP = 16.0
"""Quantization steps a nat of the top log-probabilities."""
_CHUNK = 4096  # tokens packed at a time: bounds the [tokens, entries, bits] bit matrices


def elias_fano_bits(n: int, vocab: int) -> tuple[int, int]:
    """(low bits a value, bits in all) of n sorted values below `vocab` in Elias-Fano form, the low bits chosen to
    make it shortest: n low parts, then a bitmap of n ones and one zero a high part (`(vocab - 1) >> low` + 1)."""
    if n == 0:
        return 0, 0
    widths = {low: n * low + n + ((vocab - 1) >> low) + 1 for low in range(max(1, vocab - 1).bit_length() + 1)}
    low = min(widths, key=widths.get)
    return low, widths[low]


def _slot_bits(k: int) -> int:
    return (k - 1).bit_length()


def _index_bits(k: int, tail_samples: int, vocab: int) -> int:
    return elias_fano_bits(k, vocab)[1] + elias_fano_bits(tail_samples, vocab)[1] + _slot_bits(k)


def nbytes_per_token(k: int, tail_samples: int, vocab: int) -> int:
    """Bytes a token of a compact answer takes (see the module docstring)."""
    return math.ceil(_index_bits(k, tail_samples, vocab) / 8) + k + 4 + (4 if tail_samples else 0)


def pack_topk(encoded: dict[str, Any], vocab: int) -> dict[str, Any]:
    """The compact form of a "topk" encoding over a `vocab`-entry vocabulary: {"mode": COMPACT, "temperature",
    "k", "tail_samples", "vocab", "packed": [..., nbytes] uint8}."""
    log_probs, indices, tail = encoded["log_probs"], encoded["indices"], encoded["tail_log_prob"]
    lead, k = tuple(tail.shape), log_probs.shape[-1]
    samples = encoded.get("tail_indices")
    m = 0 if samples is None else samples.shape[-1]
    top, order = indices.reshape(-1, k).long().sort(dim=-1)
    top_q = (log_probs.reshape(-1, k).float().gather(-1, order) * -TOP_STEP).round().clamp(0, 255).to(torch.uint8)
    slot = order.argmin(dim=-1, keepdim=True)  # where the top-1 (entry 0 of the exact answer) went
    floats = [tail.reshape(-1).float()]
    if m:
        samples = samples.reshape(-1, m).long()
        floats.append(encoded["tail_log_probs"].reshape(-1, m).float().mean(-1))
    index_bytes = torch.cat([_index_bytes(top[chunk], samples[chunk] if m else None, slot[chunk], vocab)
                             for chunk in _chunks(len(top))])
    packed = torch.cat([index_bytes, top_q, torch.stack(floats, dim=1).view(torch.uint8)], dim=1)
    return {"mode": COMPACT, "temperature": encoded["temperature"], "k": k, "tail_samples": m, "vocab": vocab,
            "packed": packed.view(*lead, packed.shape[-1])}


def unpack_topk(compact: dict[str, Any]) -> dict[str, Any]:
    """The "topk" encoding a compact answer carries (its values quantized, see the module docstring).

    Raises:
        ValueError: fields or sizes that do not fit each other, naming them.
    """
    return _unpack(compact)[0]


def _unpack(compact: dict[str, Any]) -> tuple[dict[str, Any], Tensor]:
    """`unpack_topk`'s answer, and a 0-dim bool: whether every index bitmap held its n ones."""
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
    index_bytes = math.ceil(_index_bits(k, m, vocab) / 8)
    top, samples, slot, whole = (torch.cat(parts) for parts in zip(*(
        _indices_of(rows[chunk, :index_bytes], k, m, vocab) for chunk in _chunks(len(rows)))))
    values = rows[:, index_bytes : index_bytes + k].float() / -TOP_STEP
    # Decreasing values again, the top-1 first whatever ties the quantization made.
    order = values.scatter(-1, slot, math.inf).sort(dim=-1, descending=True, stable=True).indices
    values, top = values.gather(-1, order), top.gather(-1, order)
    floats = rows[:, index_bytes + k :].contiguous().view(torch.float32)
    rest = floats[:, 0]
    # One shift for the k values, so that they hold 1 - P_rest exactly (log1p(-P_rest), without cancellation).
    kept = torch.log(-torch.expm1(rest)).nan_to_num(neginf=-math.inf)
    values = values + (kept - torch.logsumexp(values, dim=-1))[:, None]
    encoded = {"mode": "topk", "temperature": compact["temperature"],
               "log_probs": values.view(*lead, k), "indices": top.to(torch.int32).view(*lead, k),
               "tail_log_prob": rest.view(lead)}
    if m:
        encoded["tail_indices"] = samples.to(torch.int32).view(*lead, m)
        encoded["tail_log_probs"] = floats[:, 1:].expand(-1, m).reshape(*lead, m)
    return encoded, whole.all()


def _chunks(tokens: int) -> list[slice]:
    return [slice(start, start + _CHUNK) for start in range(0, max(tokens, 1), _CHUNK)]


def _index_bytes(top: Tensor, samples: Tensor | None, slot: Tensor, vocab: int) -> Tensor:
    """Some tokens' index bits as bytes: [tokens, k] sorted top indices, [tokens, m] sorted samples (or None),
    [tokens, 1] the top-1's slot."""
    bits = [_elias_fano(top, vocab), *([] if samples is None else [_elias_fano(samples, vocab)]),
            _to_bits(slot, _slot_bits(top.shape[1]))]
    return _bytes_of(torch.cat(bits, dim=1))


def _indices_of(index_bytes: Tensor, k: int, m: int, vocab: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`_index_bytes`' inverse: (top [tokens, k], samples [tokens, m], slot [tokens, 1], [tokens] bool: whether
    the bitmaps held their k and m ones)."""
    bits = _bits_of(index_bytes)
    top_bits, sample_bits = elias_fano_bits(k, vocab)[1], elias_fano_bits(m, vocab)[1]
    top, top_whole = _from_elias_fano(bits[:, :top_bits], k, vocab)
    samples, samples_whole = _from_elias_fano(bits[:, top_bits : top_bits + sample_bits], m, vocab)
    slot = _from_bits(bits[:, top_bits + sample_bits :], 1, _slot_bits(k))
    return top, samples, slot, top_whole & samples_whole


@register
class CompactTopK(TopK):
    """A top-k answer packed (the module docstring), unpacked where the student takes it: the loss, its checks
    and an evaluation's figures are the exact top-k answer's of the unpacked fields."""

    name = COMPACT
    selected_by = {"logits_transport": "topk", "topk_encoding": "compact"}
    settings_keys = (*TopK.settings_keys, "topk_encoding")
    layout = "elias-fano indices"

    def _decoded(self, wire):
        """The "topk" answer the wire carries (a decoded one as it is); a bitmap without its n ones is kept as
        `damaged`, for the index check."""
        if wire.get("mode") != COMPACT:
            return wire
        decoded, whole = self._unpacked(wire)
        self.damaged = ~whole
        return decoded

    @classmethod
    def encode_logits(cls, logits, **options):
        return pack_topk(TopK.encode_logits(logits, **options), logits.shape[-1])

    @classmethod
    def decode(cls, wire):
        """The "topk" answer it carries; besides it, fields other than the packing's (an evaluation's label
        log-probabilities, a teacher's hidden states) are kept."""
        return cls._unpacked(wire)[0]

    @staticmethod
    def _unpacked(wire):
        packing = ("k", "tail_samples", "vocab", "packed")
        encoded, whole = _unpack(wire)
        return {**{key: value for key, value in wire.items() if key not in packing}, **encoded}, whole

    @classmethod
    def index_message(cls, vocab):
        return f"{TopK.index_message(vocab)} (a compact answer's index bitmaps hold k and m ones)"

    @classmethod
    def bytes_per_token(cls, vocab, *, k, tail_samples, logits_bytes, width=None):
        return nbytes_per_token(k, tail_samples, vocab)


def _to_bits(values: Tensor, bits: int) -> Tensor:
    """[tokens, n] integers below 2^bits -> [tokens, n * bits] uint8 0 / 1, least significant bit first."""
    shifts = torch.arange(bits, device=values.device)
    return ((values[..., None] >> shifts) & 1).to(torch.uint8).flatten(1)


def _from_bits(bits: Tensor, n: int, width: int) -> Tensor:
    """`_to_bits`' inverse, of the first n * width bits: [tokens, n] int64."""
    weights = 1 << torch.arange(width, device=bits.device)
    return (bits[:, : n * width].long().view(len(bits), n, width) * weights).sum(-1)


def _bytes_of(bits: Tensor) -> Tensor:
    """[tokens, b] 0 / 1 -> [tokens, ceil(b / 8)] uint8."""
    width = math.ceil(bits.shape[1] / 8)
    padded = torch.nn.functional.pad(bits, (0, width * 8 - bits.shape[1]))
    weights = (1 << torch.arange(8, device=bits.device)).to(torch.uint8)
    return (padded.view(len(bits), width, 8) * weights).sum(-1, dtype=torch.uint8)


def _bits_of(packed: Tensor) -> Tensor:
    """`_bytes_of`' inverse: [tokens, width] uint8 -> [tokens, 8 width] uint8 0 / 1."""
    return ((packed[..., None] >> torch.arange(8, device=packed.device, dtype=torch.uint8)) & 1).flatten(1)


def _elias_fano(values: Tensor, vocab: int) -> Tensor:
    """[tokens, n] sorted (non-decreasing) values below `vocab` -> [tokens, elias_fano_bits(n, vocab)] bits: the
    low parts, then the bitmap with a one at each value's high part + its place in the list."""
    tokens, n = values.shape
    low, count = elias_fano_bits(n, vocab)
    bitmap = torch.zeros(tokens, count - n * low, dtype=torch.uint8, device=values.device)
    bitmap.scatter_(1, (values >> low) + torch.arange(n, device=values.device), 1)
    return torch.cat([_to_bits(values & ((1 << low) - 1), low), bitmap], dim=1)


def _from_elias_fano(bits: Tensor, n: int, vocab: int) -> tuple[Tensor, Tensor]:
    """`_elias_fano`'s inverse: ([tokens, n] int64 values, [tokens] bool: whether the bitmap held n ones). The ones
    are found by a stable sort, without a host sync."""
    low, _ = elias_fano_bits(n, vocab)
    bitmap = bits[:, n * low :]
    ones = (1 - bitmap).sort(dim=-1, stable=True).indices[:, :n]
    high = ones - torch.arange(n, device=bits.device)
    return (high << low) | _from_bits(bits, n, low), bitmap.sum(-1) == n


__all__ = ["COMPACT", "CompactTopK", "elias_fano_bits", "nbytes_per_token", "pack_topk", "unpack_topk"]

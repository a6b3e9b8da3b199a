"""Entropy-coded compact top-k answers, for the teacher cache (`kd.teacher_cache_coding: entropy`).

A compact answer (`meshkd.core.answers.compact`) spends the same bytes on every token: its k top indices as a
set in Elias-Fano form are within 4 bytes of a set's floor (log2 C(V, k) bits), whatever tokens the teacher
favours. Below that floor needs a model of which tokens a teacher's top k holds. This module codes what a compact
answer holds with range-ANS (rANS) against frequency tables fitted on a first batch of answers (`CodingTables.fit`;
the teacher cache fits them on its first shard and keeps them in its manifest), and gives back the very same
compact answer, byte for byte, when decoded:

- the k top indices, in rank order (the top-1 first, then by quantized value, ties by index: the order
  `unpack_topk` gives them in), each against a unigram table of the tokens a teacher's top k holds;
- the top-1's quantized value q_0 (q = round(-16 log p), compact's quantization, read from the packed answer),
  and the k - 1 rank deltas q_i - q_(i-1) >= 0, against a table for each group of ranks 1, 2-3, 4-7, 8-15, ...
  (a delta grows with the rank: one table for all costs 2 bytes more at k = 50);
- the m sorted tail samples as gaps (the first sample, then each one's distance to the one before), each gap by
  its bit length against a table, and its bits below the leading one as they are;
- log P_rest, float32 as it is: its low 3 bytes are the stream's initial state (2^23 + those 24 bits), its high
  byte is kept beside the stream; the tail samples' mean log-probability, float32, beside it too.

Each token is its own rANS stream (31-bit state, byte output, tables of 2^22), so that every token of a batch
decodes at once, one symbol of each a step: a token costs its symbols' information plus the 4-byte final state
(less the 3 bytes of log P_rest it carries back) and 1 length byte. A stream must end where its length says, in a
state of the initial states' range: a check of each besides the shard's sha256. Tables are fitted counts plus one,
so every token of the vocabulary stays codable (a token no fitted answer held costs 22 bits).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from meshkd.core.answers.compact import COMPACT, TOP_STEP, nbytes_per_token, pack_topk, unpack_topk

PRECISION = 22
"""Bits of every table's total: symbol frequencies sum to 2^PRECISION."""
_LOW = 1 << 23  # the state's lower bound, and its value before the first symbol and after the last
_MASK = (1 << PRECISION) - 1
_EMITS = 3  # most bytes one symbol can push out: the state has 31 bits, a renormalization keeps 31 - 22 + 1
_PAYLOAD = 24  # bits of log P_rest the initial state carries
LAYOUT = f"rans-{PRECISION} v1: unigram top indices in rank order, rank deltas by rank group, tail gaps"
"""The version of the coded layout, recorded in the teacher cache's key."""
LENGTH_ESCAPE = 255
"""A token's stream length of this many bytes or more is kept in a list of its own (`CodedAnswers.overflow`)."""


@dataclasses.dataclass(frozen=True)
class CodingTables:
    """The frequency tables (int64, each row summing to 2^PRECISION) coded answers are read with: `top` [vocab] of
    the top indices, `first` [256] of the top-1's quantized value, `delta` [groups, 256] of the rank deltas by
    rank group (`_delta_groups`), `gap` [bit length of vocab + 1] of the tail samples' gaps' bit lengths."""

    top: Tensor
    first: Tensor
    delta: Tensor
    gap: Tensor

    @classmethod
    def fit(cls, answer: dict[str, Any]) -> CodingTables:
        """Tables fitted on a compact answer's tokens (`pack_topk`'s form, [..., nbytes] packed)."""
        fields = _fields(answer)
        k, vocab = answer["k"], answer["vocab"]
        if vocab > 1 << (PRECISION - 2):
            raise ValueError(f"entropy-coded answers take a vocabulary of at most {1 << (PRECISION - 2)}, got {vocab}")
        deltas, groups = fields["q"].diff(dim=-1), _delta_groups(k)
        return cls(top=_quantize(torch.bincount(fields["top"].flatten(), minlength=vocab)),
                   first=_quantize(torch.bincount(fields["q"][:, 0], minlength=256)),
                   delta=torch.stack([_quantize(torch.bincount(deltas[:, groups == group].flatten(), minlength=256))
                                      for group in range(_num_groups(k))]),
                   gap=_quantize(torch.bincount(_bit_length(fields["gaps"]).flatten(),
                                                minlength=_gap_symbols(vocab))))

    def to_json(self) -> dict[str, Any]:
        """The tables as JSON holds them: per table its shape, the entries (flattened) with a fitted count and
        their frequencies (the others have frequency 1)."""
        out: dict[str, Any] = {"precision": PRECISION}
        for name, table in self._tables().items():
            flat = table.flatten()
            fitted = (flat > 1).nonzero().flatten()
            out[name] = {"shape": list(table.shape), "entries": fitted.tolist(), "frequencies": flat[fitted].tolist()}
        return out

    @classmethod
    def from_json(cls, data: Any) -> CodingTables:
        """`to_json`'s inverse. Raises ValueError if a table is unreadable or not whole (2^PRECISION a row)."""
        if not isinstance(data, dict) or data.get("precision") != PRECISION:
            raise ValueError(f"coding tables of precision {PRECISION} expected, got "
                             f"{data.get('precision') if isinstance(data, dict) else data!r}")
        tables = {}
        for field in dataclasses.fields(cls):
            entry = data.get(field.name)
            try:
                table = torch.ones(math.prod(entry["shape"]), dtype=torch.int64)
                table[torch.tensor(entry["entries"], dtype=torch.int64)] = torch.tensor(entry["frequencies"],
                                                                                        dtype=torch.int64)
                table = table.view(entry["shape"])
            except (TypeError, KeyError, ValueError, IndexError, RuntimeError) as error:
                raise ValueError(f"coding table {field.name!r} is not readable ({error})") from None
            if bool((table.sum(-1) != 1 << PRECISION).any()) or int(table.min()) < 1:
                raise ValueError(f"coding table {field.name!r} does not sum to 2^{PRECISION} with every entry >= 1")
            tables[field.name] = table
        return cls(**tables)

    def check(self, *, k: int, vocab: int) -> None:
        """ValueError unless the tables fit answers of `k` top entries over `vocab`."""
        shapes = {"top": (vocab,), "first": (256,), "delta": (_num_groups(k), 256), "gap": (_gap_symbols(vocab),)}
        for name, shape in shapes.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"coding table {name!r} has shape {tuple(getattr(self, name).shape)}, answers of "
                                 f"k={k} over a vocabulary of {vocab} need {shape}")

    def _tables(self) -> dict[str, Tensor]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


@dataclasses.dataclass
class CodedAnswers:
    """Tokens' answers coded: `data` [bytes] uint8 their streams one after the other, `lengths` [tokens] int64
    each stream's bytes, `rest_high` [tokens] uint8 the high byte of each log P_rest (float32), `tail_mean`
    [tokens] float32 the tail samples' mean log-probability (empty without tail samples)."""

    data: Tensor
    lengths: Tensor
    rest_high: Tensor
    tail_mean: Tensor

    def length_bytes(self) -> tuple[Tensor, Tensor]:
        """The lengths as stored: ([tokens] uint8, LENGTH_ESCAPE for a long one; [long ones] int32 their lengths)."""
        long = self.lengths >= LENGTH_ESCAPE
        return self.lengths.clamp(max=LENGTH_ESCAPE).to(torch.uint8), self.lengths[long].to(torch.int32)

    @staticmethod
    def lengths_of(short: Tensor, overflow: Tensor) -> Tensor:
        """`length_bytes`' inverse ([tokens] int64). Raises ValueError if the long ones and the list differ."""
        lengths = short.long().flatten()
        long = lengths == LENGTH_ESCAPE
        if int(long.sum()) != overflow.numel():
            raise ValueError(f"{int(long.sum())} long streams, {overflow.numel()} lengths listed")
        lengths[long] = overflow.long().flatten()
        return lengths

    def nbytes(self) -> int:
        """Bytes they take as stored: streams, lengths and what is kept beside the streams."""
        short, overflow = self.length_bytes()
        return (self.data.numel() + short.numel() + 4 * overflow.numel() + self.rest_high.numel()
                + 4 * self.tail_mean.numel())


def encode(answer: dict[str, Any], tables: CodingTables) -> CodedAnswers:
    """A compact answer's tokens ([..., nbytes] packed) coded against `tables`."""
    fields = _fields(answer)
    k, m = answer["k"], answer["tail_samples"]
    tables.check(k=k, vocab=answer["vocab"])
    q, top = fields["q"], fields["top"]
    steps = [_lookup(tables.top, top), _lookup(tables.first, q[:, :1]),
             _lookup(tables.delta, q.diff(dim=-1), rows=_delta_groups(k))]
    if m:
        gaps = fields["gaps"]
        bits = _bit_length(gaps)
        raw = (bits - 1).clamp(min=0)
        shift = PRECISION - raw
        low = torch.where(bits > 0, gaps - (1 << raw), 0)
        steps += [_lookup(tables.gap, bits), (low << shift, 1 << shift)]
    starts = torch.cat([start for start, _ in steps], dim=1)
    freqs = torch.cat([freq for _, freq in steps], dim=1)
    assert starts.shape[1] == 2 * k + 2 * m
    rest_bits = fields["rest"].view(torch.int32).long() & 0xFFFFFFFF
    data, lengths = _rans_encode(starts, freqs, _LOW + (rest_bits & ((1 << _PAYLOAD) - 1)))
    return CodedAnswers(data, lengths, (rest_bits >> _PAYLOAD).to(torch.uint8), fields["tail_mean"])


def decode(coded: CodedAnswers, tables: CodingTables, *, k: int, tail_samples: int, vocab: int,
           temperature: float) -> dict[str, Any]:
    """`encode`'s inverse: the compact answer, packed [tokens, nbytes] as `pack_topk` packed it.

    Raises:
        ValueError: a stream that does not decode to its length and end state (damaged data or lengths), or
            tables that do not fit.
    """
    tables.check(k=k, vocab=vocab)
    m, tokens = tail_samples, len(coded.lengths)
    ends = coded.lengths.cumsum(0)
    if int(ends[-1] if tokens else 0) != coded.data.numel():
        raise ValueError(f"the streams' lengths add up to {int(ends[-1] if tokens else 0)} bytes, the data holds "
                         f"{coded.data.numel()}")
    reader = _Reader(coded.data, ends - coded.lengths, ends)
    top = torch.stack([reader.take(tables.top) for _ in range(k)], dim=1)
    deltas = torch.stack([reader.take(tables.first),
                          *(reader.take(tables.delta[group]) for group in _delta_groups(k).tolist())], dim=1)
    samples = torch.zeros(tokens, 0, dtype=torch.int64)
    if m:
        bits = torch.stack([reader.take(tables.gap) for _ in range(m)], dim=1)
        raw = (bits - 1).clamp(min=0)
        low = torch.stack([reader.take_bits(raw[:, j]) for j in range(m)], dim=1)
        samples = torch.where(bits > 0, (1 << raw) + low, 0).cumsum(-1)
    payload = reader.finish()
    if tokens and max(int(top.max()), int(samples.max()) if m else 0) >= vocab:
        raise ValueError(f"coded streams decode to indices beyond the vocabulary of {vocab}: damaged data")
    rest = (coded.rest_high.long() << _PAYLOAD) | payload
    rest = torch.where(rest >= 1 << 31, rest - (1 << 32), rest).to(torch.int32).view(torch.float32)
    encoded = {"mode": "topk", "temperature": temperature, "indices": top.to(torch.int32),
               "log_probs": deltas.cumsum(-1).float() / -TOP_STEP, "tail_log_prob": rest}
    if m:
        encoded["tail_indices"] = samples.to(torch.int32)
        encoded["tail_log_probs"] = coded.tail_mean[:, None].expand(-1, m)
    answer = pack_topk(encoded, vocab)
    if m:  # the mean as it was, not the mean of m copies of it (float sums may round)
        answer["packed"][:, -4:] = coded.tail_mean.contiguous().view(torch.uint8).view(tokens, 4)
    return answer


# ------------------------------------------------------------------------------------------ what is coded


def _fields(answer: dict[str, Any]) -> dict[str, Tensor]:
    """What a compact answer holds, per token ([tokens, ...]): the top indices in rank order `top` [k], their
    quantized values `q` [k] (non-decreasing), the tail samples' gaps `gaps` [m], `rest` and `tail_mean`."""
    if answer.get("mode") != COMPACT:
        raise ValueError(f"entropy coding takes compact top-k answers ({COMPACT!r}), got {answer.get('mode')!r}")
    exact = unpack_topk(answer)  # checks the fields and sizes
    k, m, vocab = answer["k"], answer["tail_samples"], answer["vocab"]
    width = nbytes_per_token(k, m, vocab)
    packed = answer["packed"].reshape(-1, width)
    # The packed layout (compact's module docstring): [index bits | k values in index order | floats].
    values_at = width - k - 4 - (4 if m else 0)
    by_index = packed[:, values_at : values_at + k].long()
    top = exact["indices"].reshape(-1, k).long()
    order = top.sort(dim=-1).indices  # where each index (in rank order) sits among the sorted ones
    q = torch.empty_like(by_index).scatter_(1, order, by_index)
    if bool((q.diff(dim=-1) < 0).any()):
        raise ValueError("a compact answer's values are not in rank order after its top-1 (damaged packing)")
    floats = packed[:, values_at + k :].contiguous().view(torch.float32)
    fields = {"top": top, "q": q, "rest": floats[:, 0].clone(),
              "tail_mean": floats[:, 1].clone() if m else torch.empty(0, dtype=torch.float32)}
    samples = exact["tail_indices"].reshape(-1, m).long() if m else torch.zeros(len(top), 0, dtype=torch.int64)
    fields["gaps"] = samples.diff(dim=-1, prepend=torch.zeros(len(top), 1, dtype=torch.int64))
    return fields


def _bit_length(values: Tensor) -> Tensor:
    """[...] int64 >= 0 -> their bit lengths (0 for 0)."""
    return torch.where(values > 0, torch.floor(torch.log2(values.clamp(min=1).double())).long() + 1, 0)


def _delta_groups(k: int) -> Tensor:
    """[k - 1] the table group of the delta at each rank 1 .. k - 1: 0 for rank 1, 1 for 2-3, 2 for 4-7, ..."""
    return _bit_length(torch.arange(1, k)) - 1


def _num_groups(k: int) -> int:
    return max(1, (k - 1).bit_length())


def _gap_symbols(vocab: int) -> int:
    return max(1, vocab - 1).bit_length() + 1


def _quantize(counts: Tensor) -> Tensor:
    """Counts -> frequencies summing to 2^PRECISION, every symbol >= 1 (counts plus one, scaled, the rounding's
    remainder given to the largest)."""
    counts = counts.double() + 1
    freqs = (counts * ((1 << PRECISION) / counts.sum())).floor().long().clamp(min=1)
    freqs[freqs.argmax()] += (1 << PRECISION) - int(freqs.sum())
    assert int(freqs.min()) >= 1
    return freqs


def _lookup(table: Tensor, symbols: Tensor, *, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(starts, frequencies) of [tokens, n] symbols in `table` [symbols], or in `table` [groups, symbols] with
    symbol j in row rows[j]."""
    starts = table.cumsum(-1) - table
    if rows is None:
        return starts[symbols], table[symbols]
    return starts[rows, symbols], table[rows, symbols]


# ------------------------------------------------------------------------------------------------ rANS


def _rans_encode(starts: Tensor, freqs: Tensor, initial: Tensor) -> tuple[Tensor, Tensor]:
    """[lanes, steps] symbols' starts and frequencies (of 2^PRECISION), one stream a lane from its `initial`
    [lanes] state (in [2^23, 2^31)) -> (the streams one after the other [bytes] uint8, [lanes] int64 each stream's
    bytes). A stream is the final state (4 bytes, most significant first), then the bytes renormalization pushed
    out, last first: the decoder's order."""
    lanes, steps = starts.shape
    state = initial.clone()
    pushed = torch.zeros(lanes, _EMITS * steps + 1, dtype=torch.uint8)
    count = torch.zeros(lanes, dtype=torch.int64)
    for step in reversed(range(steps)):  # rANS decodes last-in first-out: encode the symbols backwards
        freq = freqs[:, step]
        bound = freq << (31 - PRECISION)  # the state keeps below 2^31 after taking the symbol
        for _ in range(_EMITS):
            emit = state >= bound
            if not bool(emit.any()):
                break
            # Lanes that do not emit write their current slot too; a later byte (or the count) overwrites it.
            pushed.scatter_(1, count[:, None], (state & 0xFF).to(torch.uint8)[:, None])
            count += emit
            state = torch.where(emit, state >> 8, state)
        state = ((state // freq) << PRECISION) + state % freq + starts[:, step]
    head = torch.stack([(state >> shift) & 0xFF for shift in (24, 16, 8, 0)], dim=1).to(torch.uint8)
    position = torch.arange(pushed.shape[1])
    body = pushed.gather(1, (count[:, None] - 1 - position).clamp(min=0))
    streams = torch.cat([head, body], dim=1)
    kept = torch.cat([torch.ones(lanes, 4, dtype=torch.bool), position < count[:, None]], dim=1)
    return streams[kept], count + 4


class _Reader:
    """Decodes every lane's stream a symbol at a time (`take`), from `data` [bytes] between `starts` and `ends`."""

    def __init__(self, data: Tensor, starts: Tensor, ends: Tensor) -> None:
        self.data = torch.cat([data.flatten(), torch.zeros(4, dtype=torch.uint8)]).long()  # reads past: zeros
        self.ends = ends
        self.ok = (ends - starts) >= 4
        head = self.data[(starts[:, None] + torch.arange(4)).clamp(max=len(self.data) - 1)]
        self.state = (head << torch.tensor([24, 16, 8, 0])).sum(-1)
        self.position = starts + 4

    def take(self, table: Tensor) -> Tensor:
        """[lanes] symbols of `table` (frequencies summing to 2^PRECISION)."""
        cumulative = table.cumsum(0)
        slot = self.state & _MASK
        symbol = torch.searchsorted(cumulative, slot, right=True).clamp(max=len(table) - 1)
        self._advance(slot, cumulative[symbol] - table[symbol], table[symbol])
        return symbol

    def take_bits(self, bits: Tensor) -> Tensor:
        """[lanes] integers of `bits` [lanes] bits each, every value equally likely."""
        shift = PRECISION - bits
        slot = self.state & _MASK
        value = slot >> shift
        self._advance(slot, value << shift, 1 << shift)
        return value

    def _advance(self, slot: Tensor, start: Tensor, freq: Tensor) -> None:
        self.state = freq * (self.state >> PRECISION) + slot - start
        for _ in range(_EMITS):
            need = self.state < _LOW
            if not bool(need.any()):
                break
            byte = self.data[self.position.clamp(max=len(self.data) - 1)]
            self.state = torch.where(need, (self.state << 8) | byte, self.state)
            self.position = self.position + need

    def finish(self) -> Tensor:
        """The payload of each lane's initial state ([lanes] int64); ValueError unless every stream ended where
        its length says, in a state of the initial states' range."""
        payload = self.state - _LOW
        bad = ~self.ok | (payload < 0) | (payload >= 1 << _PAYLOAD) | (self.position != self.ends)
        if bool(bad.any()):
            first = int(bad.nonzero()[0])
            raise ValueError(f"{int(bad.sum())} coded streams do not decode (the first: token {first}): the data or "
                             "its lengths are damaged")
        return payload


__all__ = ["LAYOUT", "PRECISION", "CodedAnswers", "CodingTables", "decode", "encode"]

"""Entropy-coded compact answers (`meshkd.core.cache_coding`): pure functions, no process group."""

from __future__ import annotations

import pytest
import torch

from meshkd.core import cache_coding
from meshkd.core.answers import encode_teacher_logits
from meshkd.core.answers.compact import unpack_topk
from meshkd.core.cache_coding import CodedAnswers, CodingTables


def _compact(k: int, m: int, *, vocab: int = 1000, tokens: int = 96, seed: int = 0) -> dict:
    logits = torch.randn(2, tokens // 2, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    return encode_teacher_logits(logits, "topk_compact", k=k, temperature=1.0, tail_samples=m, seed=seed)


def _round_trip(answer: dict, tables: CodingTables) -> tuple[CodedAnswers, dict]:
    coded = cache_coding.encode(answer, tables)
    short, overflow = coded.length_bytes()
    coded.lengths = CodedAnswers.lengths_of(short, overflow)  # as the cache stores them
    return coded, cache_coding.decode(coded, tables, k=answer["k"], tail_samples=answer["tail_samples"],
                                      vocab=answer["vocab"], temperature=answer["temperature"])


@pytest.mark.parametrize(("k", "m"), [(1, 0), (2, 3), (20, 0), (20, 8), (64, 32)])
def test_round_trip_gives_the_compact_answer_byte_for_byte(k, m):
    answer = _compact(k, m)
    # Tables fitted on other tokens: tokens the fit never saw stay codable.
    tables = CodingTables.from_json(CodingTables.fit(_compact(k, m, seed=1)).to_json())
    coded, decoded = _round_trip(answer, tables)
    width = answer["packed"].shape[-1]
    assert torch.equal(decoded["packed"], answer["packed"].reshape(-1, width))
    exact, back = unpack_topk(answer), unpack_topk(decoded)
    assert torch.equal(back["indices"], exact["indices"].reshape(-1, k))  # indices exact, the top-1 first
    assert torch.equal(back["log_probs"], exact["log_probs"].reshape(-1, k))  # values as compact quantizes them
    assert torch.equal(back["tail_log_prob"], exact["tail_log_prob"].flatten())
    if m:
        assert torch.equal(back["tail_indices"], exact["tail_indices"].reshape(-1, m))
        assert torch.equal(back["tail_log_probs"], exact["tail_log_probs"].reshape(-1, m))


def test_fitted_tables_code_below_the_fixed_width():
    answer = _compact(20, 0, tokens=512)
    coded = cache_coding.encode(answer, CodingTables.fit(answer))
    assert coded.nbytes() < answer["packed"][..., 0].numel() * answer["packed"].shape[-1]


def test_long_streams_keep_their_lengths_in_the_overflow_list():
    answer = _compact(100, 32, vocab=60000, tokens=8)
    flat = torch.ones(60000, dtype=torch.int64)
    flat[0] = (1 << cache_coding.PRECISION) - 59999  # every index but 0 costs about 22 bits
    tables = CodingTables.fit(answer)
    tables = CodingTables(top=flat, first=tables.first, delta=tables.delta, gap=tables.gap)
    coded, decoded = _round_trip(answer, tables)
    assert int(coded.lengths.min()) >= cache_coding.LENGTH_ESCAPE
    assert torch.equal(decoded["packed"], answer["packed"].reshape(8, -1))


def test_damaged_streams_and_lengths_are_refused():
    answer = _compact(20, 8)
    tables = CodingTables.fit(answer)
    coded = cache_coding.encode(answer, tables)
    options = {"k": 20, "tail_samples": 8, "vocab": 1000, "temperature": 1.0}
    lengths = coded.lengths.clone()
    lengths[0] += 1
    lengths[1] -= 1
    with pytest.raises(ValueError, match="do not decode"):
        cache_coding.decode(CodedAnswers(coded.data, lengths, coded.rest_high, coded.tail_mean), tables, **options)
    with pytest.raises(ValueError, match="add up to"):
        cache_coding.decode(CodedAnswers(coded.data[:-1], coded.lengths, coded.rest_high, coded.tail_mean), tables,
                            **options)
    data = coded.data.clone()
    data[:4] = 0  # a final state below the initial states' range
    with pytest.raises(ValueError, match="do not decode"):
        cache_coding.decode(CodedAnswers(data, coded.lengths, coded.rest_high, coded.tail_mean), tables, **options)


def test_tables_that_do_not_fit_are_refused():
    tables = CodingTables.fit(_compact(20, 0))
    with pytest.raises(ValueError, match="'delta' has shape"):
        tables.check(k=64, vocab=1000)
    data = tables.to_json()
    data["top"]["frequencies"][0] += 1
    with pytest.raises(ValueError, match="'top' does not sum"):
        CodingTables.from_json(data)

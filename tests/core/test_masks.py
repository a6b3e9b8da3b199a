"""Tests for meshkd.core.masks: the one mask rule against a brute-force reference, in any query / key order.

Pure tier only: no process group, no model (the masks inside models: tests/core/test_packing.py, and under
context parallel tests/parallel/test_context_parallel.py and test_layouts.py).
"""

from __future__ import annotations

import pytest
import torch

from meshkd.core.logits import cp_shard
from meshkd.core.masks import additive_mask, indexed_to_additive_mask, layer_masks

DOCUMENTS = torch.tensor([[1, 1, 1, 2, 2, 3, 3, 3, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]])


def reference_mask(documents: torch.Tensor, query_length: int, window: int | None) -> torch.Tensor:
    batch_size, key_length = documents.shape
    allowed = torch.zeros(batch_size, 1, query_length, key_length, dtype=torch.bool)
    for b in range(batch_size):
        for i in range(query_length):
            q = key_length - query_length + i
            for k in range(key_length):
                same = documents[b, q] != 0 and documents[b, k] == documents[b, q]
                in_window = window is None or q - k < window
                allowed[b, 0, i, k] = (same and k <= q and in_window) or k == q
    return allowed


@pytest.mark.parametrize("query_length, window", [(None, None), (None, 3), (4, None), (1, 2)])
def test_additive_mask_matches_reference(query_length, window):
    mask = indexed_to_additive_mask(DOCUMENTS, query_length=query_length, dtype=torch.float16, sliding_window=window)
    expected = reference_mask(DOCUMENTS, query_length or DOCUMENTS.shape[1], window)
    assert mask.dtype == torch.float16 and mask.shape == expected.shape
    assert torch.equal(mask == 0, expected)
    assert torch.all(mask[~expected] == torch.finfo(torch.float16).min)


def test_additive_mask_rejects_bad_shapes():
    with pytest.raises(ValueError, match="batch, sequence"):
        indexed_to_additive_mask(torch.ones(1, 1, 4, 4))
    with pytest.raises(ValueError, match="query_length 5"):
        indexed_to_additive_mask(torch.ones(1, 4), query_length=5)


def test_bool_mask_is_one_document():
    bools = torch.tensor([[True, True, True, False]])
    assert torch.equal(indexed_to_additive_mask(bools), indexed_to_additive_mask(bools.long()))


def test_global_indices_in_any_order_give_the_same_mask_permuted():
    index = torch.arange(DOCUMENTS.shape[1])
    expected = indexed_to_additive_mask(DOCUMENTS, sliding_window=3)
    assert torch.equal(additive_mask(DOCUMENTS, index, index, dtype=torch.float32, sliding_window=3), expected)
    # Permuted keys (the cp gather order) give the same mask with its key columns permuted.
    order = torch.randperm(len(index), generator=torch.Generator().manual_seed(0))
    permuted = additive_mask(DOCUMENTS, index[:5], index[order], dtype=torch.float32, sliding_window=None)
    assert torch.equal(permuted, indexed_to_additive_mask(DOCUMENTS)[:, :, :5][..., order])


@pytest.mark.parametrize("cp_size", [2, 4])
def test_cp_masks_are_the_whole_mask_in_head_tail_order(cp_size):
    documents = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 0, 0]])
    windows = {"full_attention": None, "sliding_attention": 3}
    whole = layer_masks(documents, windows, dtype=torch.float32)
    index = torch.arange(documents.shape[1])
    keys = torch.cat([cp_shard(index, cp_size=cp_size, cp_rank=r, dim=0) for r in range(cp_size)])
    for cp_rank in range(cp_size):
        queries = cp_shard(index, cp_size=cp_size, cp_rank=cp_rank, dim=0)
        sharded = layer_masks(documents, windows, dtype=torch.float32, cp_size=cp_size, cp_rank=cp_rank)
        for kind in windows:
            assert torch.equal(sharded[kind], whole[kind][:, :, queries][..., keys])


def test_one_mask_per_window():
    one = layer_masks(DOCUMENTS, {"full_attention": None}, dtype=torch.float32)
    assert isinstance(one, torch.Tensor) and torch.equal(one, indexed_to_additive_mask(DOCUMENTS))
    windows = {"full_attention": None, "sliding_attention": 3, "chunked": None}
    masks = layer_masks(DOCUMENTS, windows, dtype=torch.float32, query_length=4)
    assert set(masks) == set(windows) and masks["chunked"] is masks["full_attention"]
    assert torch.equal(masks["sliding_attention"], indexed_to_additive_mask(DOCUMENTS, query_length=4,
                                                                           sliding_window=3))

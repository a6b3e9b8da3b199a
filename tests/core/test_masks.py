"""Tests for meshkd.core.masks: the one mask rule against a brute-force reference, in any query / key order.

Pure tier only: no process group, no model (the masks inside models: tests/core/test_packing.py, and under
context parallel tests/parallel/test_context_parallel.py and test_layouts.py).
"""

from __future__ import annotations

import pytest
import torch

from meshkd.core.logits import cp_shard
from meshkd.core.masks import (
    SUPPORTED_ATTENTION,
    additive_mask,
    indexed_to_additive_mask,
    layer_masks,
    takes_block_masks,
)

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


# ---------------------------------------------------------------------------------------------------------
# FlexAttention block masks: the same rule, entry by entry and tile by tile.

def dense_block_mask(mask) -> torch.Tensor:
    """The entries [batch, 1, query, key] a BlockMask allows: its rule evaluated wherever its tile tables
    say a tile is partial, True where they say full, False where they leave the tile out."""
    from torch.nn.attention.flex_attention import create_mask

    batch_size, _, query_length, key_length = mask.shape
    rule = create_mask(mask.mask_mod, batch_size, 1, query_length, key_length, device="cpu")
    rows, columns = mask.BLOCK_SIZE

    def spread(tiles: torch.Tensor) -> torch.Tensor:
        return tiles.repeat_interleave(rows, 2).repeat_interleave(columns, 3)[:, :, :query_length, :key_length]

    listed, full = spread(mask.to_dense()).bool(), spread(full_tiles(mask)).bool()  # to_dense: every listed tile
    assert not (full & ~listed).any()
    assert rule[full].all(), "a tile marked full holds a masked entry"
    return (rule & listed) | full


def full_tiles(mask) -> torch.Tensor:
    """[batch, 1, query tiles, key tiles] True where the mask's full-tile table lists the tile."""
    from torch.nn.attention.flex_attention import BlockMask

    if mask.full_kv_num_blocks is None:
        return torch.zeros_like(mask.to_dense())
    return BlockMask.from_kv_blocks(mask.full_kv_num_blocks, mask.full_kv_indices,
                                    BLOCK_SIZE=mask.BLOCK_SIZE, seq_lengths=mask.seq_lengths).to_dense()


def long_documents(length: int) -> torch.Tensor:
    """Two rows of several documents, tiles of 128 both inside one document and across boundaries."""
    rows = [[150, 40, 210, 96], [300, 200]]
    documents = torch.zeros(len(rows), length, dtype=torch.int64)
    for row, lengths in enumerate(rows):
        start = 0
        for index, size in enumerate(lengths, 1):
            documents[row, start : start + size] = index
            start += size
    return documents


@pytest.mark.parametrize("query_length, window", [(None, None), (None, 100), (200, None), (1, 130)])
def test_block_mask_is_the_additive_rule(query_length, window):
    documents = long_documents(520)
    windows = {"full_attention": window}
    blocks = layer_masks(documents, windows, dtype=torch.float32, query_length=query_length, block=True)
    additive = layer_masks(documents, windows, dtype=torch.float32, query_length=query_length)
    assert tuple(blocks.shape) == tuple(additive.shape)
    assert torch.equal(dense_block_mask(blocks), additive == 0)
    if query_length is None:
        assert blocks.sparsity() > 40  # tiles across documents are left out, so the kernel skips them


@pytest.mark.parametrize("cp_size", [2, 4])
def test_cp_block_masks_follow_the_gathered_key_order(cp_size):
    documents = long_documents(512)
    windows = {"full_attention": None, "sliding_attention": 70}
    for cp_rank in range(cp_size):
        blocks = layer_masks(documents, windows, dtype=torch.float32, cp_size=cp_size, cp_rank=cp_rank, block=True)
        additive = layer_masks(documents, windows, dtype=torch.float32, cp_size=cp_size, cp_rank=cp_rank)
        for kind in windows:
            assert torch.equal(dense_block_mask(blocks[kind]), additive[kind] == 0), (cp_rank, kind)


def test_flex_attention_with_the_block_mask_is_sdpa_with_the_additive_mask():
    """FlexAttention's own (eager) computation over the block mask: padding rows attend to themselves."""
    from torch.nn.attention.flex_attention import flex_attention

    documents = long_documents(300)
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 4, 300, 8, generator=generator) for _ in range(3))
    windows = {"full_attention": None}
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=layer_masks(documents, windows, dtype=torch.float32))
    with torch.no_grad(), pytest.warns(UserWarning, match="without torch.compile"):
        actual = flex_attention(query, key, value, block_mask=layer_masks(documents, windows, dtype=torch.float32,
                                                                          block=True))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_takes_block_masks_reads_the_attention_implementation():
    from types import SimpleNamespace

    assert takes_block_masks(SimpleNamespace(_attn_implementation="flex_attention"))
    assert not any(takes_block_masks(SimpleNamespace(_attn_implementation=name)) for name in ("sdpa", "eager"))
    assert "flex_attention" in SUPPORTED_ATTENTION

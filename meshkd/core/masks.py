"""Attention masks: every 4D mask meshkd hands a transformers model is built here, by one rule.

The rule. `documents` [batch, sequence] holds each token's 1-based document index (0 = padding; an
ordinary 0/1 mask is the one-document case). A query attends to a key of the same nonzero document that is
not after it, within the sliding window when its layer has one; a padding query attends to itself only, so
no row is fully masked (such a row turns into NaN in the softmax). Positions are GLOBAL sequence indices,
so under context parallel (`cp_size` > 1) a rank's head-tail share of the queries is masked against the
keys in the order the cp attention gathers them (cp rank 0's share, then rank 1's, ...), and document
boundaries and sliding windows hold across shards.

One mask per attention kind. transformers hands an already prepared 4D additive mask [batch, 1, query,
key] to the sdpa and eager attention functions untouched; models whose layers mix sliding and full
attention (Gemma 2/3, Qwen2 with sliding layers, gpt-oss) also take a {kind: mask} dict and give each layer
the mask of its kind. `attention_windows` reads the kinds from the model's config, `layer_masks` builds
what the model takes. Callers: the packing hook (`meshkd.core.packing`, also under context parallel),
`TeacherRunner`, `StudentPipeline` and layer selection.

Two forms of one rule, chosen by the model's attention (`takes_block_masks`). sdpa and eager take the rule
as an additive tensor: O(S^2) per row, and a mask that keeps sdpa off its flash kernel. A model loaded with
attn_implementation "flex_attention" takes it as a FlexAttention `BlockMask` (`block_mask`): the rule as a
`mask_mod` over the same global indices plus, per 128 x 128 tile, whether the tile is empty, full or partial,
so the kernel skips empty tiles and the stored mask is O(S^2 / 128^2). transformers hands a prepared
BlockMask to its flex attention untouched, as it does a 4D tensor, so the model's own forward runs either
way. On CUDA the block mask is built by a compiled `create_block_mask` (tile by tile, never the dense
mask); elsewhere eagerly, which evaluates the rule densely once per call (FlexAttention has no backward
on the CPU, so there it serves forward-only models: a teacher, evaluation).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshkd.core.logits import cp_shard, cp_unshard

__all__ = [
    "FLEX_ATTENTION",
    "SUPPORTED_ATTENTION",
    "additive_mask",
    "attention_windows",
    "block_mask",
    "gather_documents",
    "indexed_to_additive_mask",
    "layer_masks",
    "mask_dtype",
    "positions_and_documents",
    "takes_block_masks",
]

FLEX_ATTENTION = "flex_attention"
"""transformers' FlexAttention implementation: it takes the rule as a `BlockMask` (`block_mask`)."""

SUPPORTED_ATTENTION = ("sdpa", "eager", FLEX_ATTENTION)
"""Attention implementations of transformers that take a prepared mask as-is: a 4D additive tensor (sdpa,
eager) or a BlockMask (flex). Flash attention builds its own masks and would silently ignore these."""


def takes_block_masks(config: Any) -> bool:
    """Whether a model of `config` attends through FlexAttention, and so takes `BlockMask`s, not 4D tensors."""
    return getattr(config, "_attn_implementation", None) == FLEX_ATTENTION


def attention_windows(config: Any, owner: nn.Module) -> dict[str, int | None]:
    """The attention kinds of a model's layers, each with its sliding window (None: full causal attention).

    Keys are the kinds named in `config.layer_types` ("full_attention", "sliding_attention"); a config without
    `layer_types` (Mistral style) has one kind whose window is `config.sliding_window`. Raises ValueError when
    the attention implementation does not take a prepared mask or a layer kind has no known mask rule.
    """
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"NEAT packing needs attn_implementation in {SUPPORTED_ATTENTION} (they take a prepared mask); "
            f"{type(owner).__name__} uses {implementation!r}. Load it with attn_implementation 'sdpa', 'eager' "
            f"or 'flex_attention'."
        )
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return {"full_attention": window}
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"NEAT packing has no mask rule for the layer types {unknown} of {type(owner).__name__}")
    return {kind: window if kind == "sliding_attention" else None for kind in dict.fromkeys(layer_types)}


def additive_mask(
    documents: torch.Tensor,
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    *,
    dtype: torch.dtype,
    sliding_window: int | None,
) -> torch.Tensor:
    """The rule: additive mask [batch, 1, query, key] for queries and keys at the given GLOBAL indices.

    documents [batch, sequence]: document index per global position, 0 = padding. Entries are 0 where the
    query may attend to the key and the most negative `dtype` value elsewhere.
    """
    documents = documents.long()
    query_documents = documents[:, query_index, None]  # [batch, query, 1]
    key_documents = documents[:, None, key_index]  # [batch, 1, key]
    distance = query_index[:, None] - key_index[None, :]  # [query, key]
    visible = distance >= 0
    if sliding_window is not None:
        visible &= distance < sliding_window
    allowed = (query_documents == key_documents) & (query_documents != 0) & visible
    allowed |= distance == 0
    additive = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=documents.device)
    return additive.masked_fill_(allowed, 0.0)[:, None]


def block_mask(
    documents: torch.Tensor,
    *,
    query_length: int | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    sliding_window: int | None = None,
) -> Any:
    """The rule as a FlexAttention `BlockMask`, entry by entry the visibility of the additive mask
    `layer_masks` builds for the same arguments: [batch, 1, query_length, sequence] (the last
    `query_length` queries, default all), or under context parallel [batch, 1, sequence / cp_size,
    sequence] with this cp rank's head-tail queries against every key in gathered order.

    documents [batch, sequence]: document index per global position, 0 = padding (the whole padded
    sequence under cp). The mask function reads `documents` (captured, not copied) and computes global
    positions from tile-local indices, so the mask stores only its tile tables besides: a few
    [batch, 1, query / 128, key / 128] int32 tensors.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    documents = documents.long()
    length = documents.shape[1]
    if cp_size == 1:
        query_length = length if query_length is None else query_length
        offset = length - query_length

        def positions(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return query + offset, key
    else:
        # Head-tail shards in arithmetic rather than index tables: cp rank r holds chunks r and 2cp-1-r of
        # 2cp equal chunks (`cp_shard`), and the keys come in cp-rank order, 2 chunks a rank.
        chunk = length // (2 * cp_size)
        query_length = 2 * chunk

        def global_position(rank: torch.Tensor | int, local: torch.Tensor) -> torch.Tensor:
            return torch.where(local < chunk, rank * chunk + local, (2 * cp_size - 2 - rank) * chunk + local)

        def positions(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return global_position(cp_rank, query), global_position(key // (2 * chunk), key % (2 * chunk))

    def visible(batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        query_position, key_position = positions(query, key)
        query_document = documents[batch, query_position]
        distance = query_position - key_position
        allowed = (query_document == documents[batch, key_position]) & (query_document != 0) & (distance >= 0)
        if sliding_window is not None:
            allowed = allowed & (distance < sliding_window)
        return allowed | (distance == 0)

    # Compiled (CUDA), the tile tables are made tile by tile. Eagerly (the CPU, where compiling would add tens
    # of seconds to every process's start) the rule is evaluated densely once per call: a transient O(S^2).
    return create_block_mask(visible, B=documents.shape[0], H=None, Q_LEN=query_length, KV_LEN=length,
                             device=documents.device, _compile=documents.device.type == "cuda")


def indexed_to_additive_mask(
    attention_mask: torch.Tensor,
    *,
    query_length: int | None = None,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Turn an indexed mask [batch, key] into an additive mask [batch, 1, query, key] (`additive_mask`).

    The queries are the last `query_length` positions (default: all of them, i.e. no KV cache). A bool or
    0/1 mask is the one-document case.
    """
    if attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape)
        raise ValueError(f"expected an indexed attention_mask [batch, sequence], got shape {shape}")
    key_length = attention_mask.shape[1]
    query_length = key_length if query_length is None else query_length
    if not 0 < query_length <= key_length:
        raise ValueError(f"query_length {query_length} must be in [1, {key_length}] (the mask's sequence length)")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
    key_index = torch.arange(key_length, device=attention_mask.device)
    return additive_mask(attention_mask, key_index[key_length - query_length :], key_index, dtype=dtype,
                         sliding_window=sliding_window)


def layer_masks(
    documents: torch.Tensor,
    windows: dict[str, int | None],
    *,
    dtype: torch.dtype,
    query_length: int | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    block: bool = False,
) -> Any:
    """The masks a model takes for `documents` [batch, sequence]: one mask when its layers share an
    attention kind, else {kind: mask} (kinds with the same window share one mask).

    Each mask is an additive tensor of `dtype`, or with `block` (a model that `takes_block_masks`) a
    `BlockMask` of the same shape and visibility. Without context parallel the shape is [batch, 1,
    query_length, sequence], the queries being the last `query_length` positions (default all). With
    `cp_size` > 1, `documents` covers the whole padded sequence in original order and each mask is
    [batch, 1, sequence / cp_size, sequence]: this cp rank's head-tail queries against every key in
    gathered order.
    """
    if cp_size > 1:
        index = torch.arange(documents.shape[1], device=documents.device)
        query_index = cp_shard(index, cp_size=cp_size, cp_rank=cp_rank, dim=0)
        key_index = torch.cat([cp_shard(index, cp_size=cp_size, cp_rank=r, dim=0) for r in range(cp_size)])

    def build(window: int | None) -> Any:
        if block:
            return block_mask(documents, query_length=query_length, cp_size=cp_size, cp_rank=cp_rank,
                              sliding_window=window)
        if cp_size == 1:
            return indexed_to_additive_mask(documents, query_length=query_length, dtype=dtype, sliding_window=window)
        return additive_mask(documents, query_index, key_index, dtype=dtype, sliding_window=window)

    built: dict[int | None, Any] = {}
    for window in windows.values():
        if window not in built:
            built[window] = build(window)
    masks = {kind: built[window] for kind, window in windows.items()}
    return next(iter(masks.values())) if len(masks) == 1 else masks


def mask_dtype(module: nn.Module, device: torch.device) -> torch.dtype:
    """The dtype of the attention scores `module` computes: autocast's when it is on, else its parameters'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    for parameter in module.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def gather_documents(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Document indices of the whole padded sequence [batch, sequence] from every cp rank's head-tail share
    [batch, sequence / cp_size] (all-gathered over the cp `group`, then put back in original order)."""
    shards = [torch.empty_like(local, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.long().contiguous(), group=group)
    return cp_unshard(shards, dim=1)


def positions_and_documents(batch: dict, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's position_ids and document indices, defaulting to one document per row in order."""
    batch_size, length = input_ids.shape
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(batch_size, length)
    documents = batch.get("attention_mask")
    if documents is None:
        documents = torch.ones_like(input_ids)
    return position_ids, documents

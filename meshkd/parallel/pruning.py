"""Layer dropping: a student initialized from its teacher by keeping some decoder layers (DistilBERT, Minitron).

`prune_layers` changes the model in place: the kept layers keep their tensors, and what depends on a
layer's position is renumbered so caches and masks stay consistent. The decoder is found as everywhere
else in meshkd, by the model's pipeline plan (`meshkd.parallel.stages.decoder_of`). Used on whole models
(`meshkd.recipe.modeling.models.load_causal_lm`) and on meta models before they are laid out
(`meshkd.parallel.sharded_loading.empty_causal_lm`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from torch import nn

from meshkd.parallel.stages import decoder_of

__all__ = ["prune_layers"]

# Config entries holding one value per decoder layer: pruning keeps the kept layers' entries.
_PER_LAYER_CONFIG_KEYS = (
    "layer_types",
    "mlp_layer_types",
    "no_rope_layers",
    "layers_block_type",
    "num_attention_heads_per_layer",
    "num_key_value_heads_per_layer",
    "activation_sparsity_pattern",
)
# Config entries listing decoder-layer indices: pruning renumbers the kept ones and drops the others.
_LAYER_INDEX_CONFIG_KEYS = ("mlp_only_layers",)


def prune_layers(model: nn.Module, keep_layers: Sequence[int]) -> nn.Module:
    """Keep only the decoder layers `keep_layers` of `model`, in place, and return it.

    The kept layers keep their parameters (the same tensors). What depends on a layer's position is
    renumbered so caches and masks stay consistent: `config.num_hidden_layers`, per-layer config lists
    such as `layer_types`, layer-index lists such as `mlp_only_layers`, and every submodule's `layer_idx`
    (the key of its KV-cache slot).

    Raises ValueError for an empty, unsorted, duplicated or out-of-range `keep_layers`, or for a model
    whose decoder (`decoder_of`) or per-layer config entries this function does not know how to update.
    """
    config = model.config
    owner = decoder_of(model)
    layers = owner.layers
    num_layers = len(layers)
    keep = [operator.index(index) for index in keep_layers]
    if not keep:
        raise ValueError("keep_layers is empty: keep at least one decoder layer")
    out_of_range = [index for index in keep if not 0 <= index < num_layers]
    if out_of_range:
        raise ValueError(f"keep_layers {out_of_range} out of range: the model has {num_layers} layers, "
                         f"[0, {num_layers})")
    duplicates = sorted({index for index in keep if keep.count(index) > 1})
    if duplicates:
        raise ValueError(f"keep_layers holds duplicates {duplicates}: {keep}")
    if keep != sorted(keep):
        raise ValueError(f"keep_layers must be sorted ascending (layers run in order): {keep}")

    # Check every config entry first, so an unsupported model raises before anything was changed.
    updates: dict[str, list[Any]] = {}
    for key, value in vars(config).items():
        if not isinstance(value, (list, tuple)) or "layer" not in key:
            continue
        if key in _PER_LAYER_CONFIG_KEYS and len(value) == num_layers:
            updates[key] = [value[index] for index in keep]
        elif key in _LAYER_INDEX_CONFIG_KEYS:
            updates[key] = [new for new, old in enumerate(keep) if old in set(value)]
        else:
            raise ValueError(
                f"cannot prune layers: config entry {key}={list(value)} depends on layer positions in a way "
                "this function does not know"
            )
    for key, value in updates.items():
        setattr(config, key, value)
    config.num_hidden_layers = len(keep)

    kept = nn.ModuleList(layers[index] for index in keep)
    for new_index, layer in enumerate(kept):
        for module in layer.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = new_index
    owner.layers = kept
    if isinstance(getattr(owner, "has_sliding_layers", None), bool):
        # Derived from `layer_types` at construction (Qwen2 and kin): skip masks no kept layer needs.
        owner.has_sliding_layers = "sliding_attention" in (getattr(config, "layer_types", None) or ())
    return model

"""Sharded loading: build a model without weights, lay it out, then read only this rank's share.

Design. `empty_causal_lm` builds a model of a Hugging Face directory from its config with every parameter
on the meta device (buffers, such as rotary frequencies, are computed as usual), pruned by `keep_layers`.
The caller lays it out as it would a loaded model (pipeline split, tensor parallel, FSDP2: all of them work
on meta parameters), then `load_shards` gives the parameters storage on the device and fills each from the
safetensors files: a DTensor receives the piece its placements give this rank, read as a slice of the file
when every placement is a plain shard or a replica (only those bytes are read), else cut from the whole
tensor, one tensor at a time; a plain parameter is read whole. Layers another pipeline stage owns are not
parameters of this rank's model, so they are never read. A rank's peak memory is its share of the model
plus, at most, one whole tensor.

Checkpoint names follow the model's names: a pruned layer is read under its original index and a tied
output head under the embedding's name. A checkpoint that stores some tensor under another name (one that
transformers converts while loading, such as per-expert MoE weights) is not loaded this way:
`empty_causal_lm` returns None and the caller loads the whole model instead.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

__all__ = ["Checkpoint", "empty_causal_lm", "is_empty", "load_shards"]


class Checkpoint:
    """The safetensors files of a Hugging Face directory and, per parameter name, where to read it."""

    def __init__(self, directory: Path, names: dict[str, str], files: dict[str, Path]):
        self.directory = directory
        self.names = names  # model parameter name -> checkpoint tensor name
        self.files = files  # checkpoint tensor name -> file


def _checkpoint_files(directory: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> safetensors file, from the index or the single file; {} when neither exists."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{index}: not a safetensors index (JSON with a weight_map): {error}") from None
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        return {}
    with _open_safetensors(single) as handle:
        return dict.fromkeys(handle.keys(), single)


@contextlib.contextmanager
def _open_safetensors(file: Path):
    """safe_open, with a damaged file reported as ValueError naming it (not safetensors' own error type)."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{file}: not a readable safetensors file ({error})") from None
    with handle:
        yield handle


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered in this context is moved to the meta device; buffers stay real."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, parameter: nn.Parameter | None) -> None:
        register(module, name, parameter)
        if parameter is not None and not parameter.is_meta:
            module._parameters[name] = nn.Parameter(parameter.to("meta"), requires_grad=parameter.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def empty_causal_lm(
    directory: str | Path,
    *,
    keep_layers: Sequence[int] | None,
    dtype: torch.dtype,
    attn_implementation: str | None,
) -> tuple[nn.Module, Checkpoint] | None:
    """(model with meta parameters, its `Checkpoint`), or None when the directory cannot be read in shards.

    None: no safetensors files, or some parameter of the model is not stored under its own name.
    `attn_implementation` None: `meshkd.recipe.models.default_attn_implementation`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshkd.recipe.models import default_attn_implementation, prune_layers

    directory = Path(directory)
    files = _checkpoint_files(directory)
    if not files:
        return None
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    attn_implementation = attn_implementation or default_attn_implementation(type(config))
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    original = {}  # pruned layer index -> original index
    if keep_layers is not None:
        prune_layers(model, keep_layers)
        original = dict(enumerate(keep_layers))
    names = {}
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    parameter_names = {id(p): name for name, p in model.named_parameters()}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        stored = re.sub(r"(\.layers\.)(\d+)(\.)",
                        lambda m: f"{m[1]}{original.get(int(m[2]), int(m[2]))}{m[3]}", name)
        if stored not in files and head is not None and parameter is head.weight and embedding is not None:
            stored = parameter_names[id(embedding.weight)]  # a tied head is stored as the embedding
        if stored not in files:
            return None
        names[name] = stored
    model.eval()
    return model, Checkpoint(directory, names, files)


def is_empty(model: nn.Module) -> bool:
    """Whether `model` still waits for `load_shards` (its parameters are on the meta device)."""
    return any(_local(parameter).is_meta for parameter in model.parameters())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@torch.no_grad()
def load_shards(model: nn.Module, checkpoint: Checkpoint, *, device: torch.device | str,
                names: dict[str, str] | None = None) -> None:
    """Give `model`'s meta parameters storage on `device` and fill each with this rank's share.

    `model` is the laid-out model or a module holding its parameters under other names (a pipeline stage
    wrapper): `names` then maps this module's parameter names to the model's (default: the same). Buffers
    keep their values.
    """
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])
    for name, parameter in model.named_parameters():
        stored = checkpoint.names[names[name] if names else name]
        file = checkpoint.files[stored]
        # Opened per tensor: the file's pages read for one tensor are unmapped before the next is read, so
        # they never add up to the whole checkpoint in this process's resident memory.
        with _open_safetensors(file) as handle:
            _fill(parameter, handle.get_slice(stored), what=f"{stored} ({file.name})")


def _fill(parameter: torch.Tensor, source, *, what: str) -> None:
    """Copy this rank's piece of the stored tensor `source` (a safetensors slice) into `parameter`."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(source.get_shape())
    if tuple(parameter.shape) != shape:
        raise ValueError(f"checkpoint tensor {what} has shape {shape}, the model expects {tuple(parameter.shape)}")
    local = _local(parameter)
    if not isinstance(parameter, DTensor):
        local.copy_(source[:])
        return
    if all(type(placement) in (Shard, Replicate) for placement in parameter.placements):
        local_shape, offset = compute_local_shape_and_global_offset(shape, parameter.device_mesh,
                                                                    parameter.placements)
        if tuple(local_shape) == tuple(local.shape):
            local.copy_(source[tuple(slice(start, start + size) for start, size in zip(offset, local_shape))])
            return
    # Strided or padded placements: cut this rank's piece from the whole tensor.
    piece = distribute_tensor(source[:].to(local.device), parameter.device_mesh, parameter.placements,
                              src_data_rank=None)
    local.copy_(piece.to_local())

"""Sharded loading: build a model without weights, lay it out, then read only this rank's share.

Design. `empty_causal_lm` builds a model of a Hugging Face directory from its config with every parameter
on the meta device (buffers, such as rotary frequencies, are computed as usual), pruned by `keep_layers`,
with the attention the model class does best of the two that take meshkd's masks
(`default_attn_implementation`: sdpa, else eager).
The caller lays it out as it would a loaded model (pipeline split, tensor parallel, FSDP2: all of them work
on meta parameters), then `load_shards` gives the parameters storage on the device and fills each from the
safetensors files: a DTensor receives the piece its placements give this rank, read as slices of the file
(one per run of consecutive indices: a shard, a replica, or a strided shard of a packed projection, whose
piece is a run in each block; only those bytes are read), else (padded shards) cut from the whole tensor,
one tensor at a time; a plain parameter is read whole. Layers another pipeline stage owns are not
parameters of this rank's model, so they are never read. A rank's peak memory is its share of the model
plus, at most, one whole tensor.

Checkpoint names are turned into the model's by transformers' own conversion mapping for the model (what
`from_pretrained` applies: renamings, and converters that merge per-expert MoE weights into one tensor
per projection), so a parameter is read from one stored tensor or from a stack of them (`StoredTensor`):
an expert-parallel rank reads only its experts' tensors. A pruned layer is read under its original index
and a tied output head under the embedding's name. A converter with another operation (not merging a list
of tensors, not concatenating) or a parameter nothing maps to makes `empty_causal_lm` return None: the
caller loads the whole model instead.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from meshkd.parallel.pruning import prune_layers

__all__ = ["Checkpoint", "causal_lm_class", "default_attn_implementation", "empty_causal_lm", "fill_from_whole",
           "is_empty", "load_shards"]


class Checkpoint:
    """The safetensors files of a Hugging Face directory and, per model parameter name, how to read it."""

    def __init__(self, directory: Path, sources: dict[str, StoredTensor]):
        self.directory = directory
        self.sources = sources  # model parameter name -> the stored tensor, or the stack of them, it is made of


class StoredTensor:
    """One tensor of a safetensors file, read in pieces: `read_into(files, box, out)` copies into `out` the
    part from box[d][0] to box[d][1] along each dimension d."""

    def __init__(self, name: str, file: Path):
        self.name, self.file = name, file

    def shape(self, files: _OpenFiles) -> tuple[int, ...]:
        return tuple(files[self.file].get_slice(self.name).get_shape())

    def read_into(self, files: _OpenFiles, box: Sequence[tuple[int, int]], out: torch.Tensor) -> None:
        out.copy_(files[self.file].get_slice(self.name)[tuple(slice(start, stop) for start, stop in box)])

    def leaves(self) -> list[StoredTensor]:
        return [self]

    def __str__(self) -> str:
        return f"{self.name} ({self.file.name})"


class _Combined(StoredTensor):
    """A tensor made of stored ones along dimension `dim`; a piece reads only the parts it covers."""

    def __init__(self, parts: list[StoredTensor], dim: int):
        self.parts, self.dim = parts, dim

    def leaves(self) -> list[StoredTensor]:
        return [leaf for part in self.parts for leaf in part.leaves()]

    def __str__(self) -> str:
        leaves = self.leaves()
        return f"{len(leaves)} stored tensors, {leaves[0]} to {leaves[-1]}"


class _Stacked(_Combined):
    """Stored tensors of one shape stacked along a new dimension (transformers' MergeModulelist: per-expert
    weights as one tensor)."""

    def shape(self, files: _OpenFiles) -> tuple[int, ...]:
        shape = self.parts[0].shape(files)
        return (*shape[:self.dim], len(self.parts), *shape[self.dim:])

    def read_into(self, files: _OpenFiles, box: Sequence[tuple[int, int]], out: torch.Tensor) -> None:
        start, stop = box[self.dim]
        rest = (*box[:self.dim], *box[self.dim + 1:])
        for index, part in enumerate(self.parts[start:stop]):
            part.read_into(files, rest, out.select(self.dim, index))


class _Concatenated(_Combined):
    """Stored tensors concatenated along an existing dimension (transformers' Concatenate: gate and up
    projections as one)."""

    def shape(self, files: _OpenFiles) -> tuple[int, ...]:
        shapes = [part.shape(files) for part in self.parts]
        return (*shapes[0][:self.dim], sum(shape[self.dim] for shape in shapes), *shapes[0][self.dim + 1:])

    def read_into(self, files: _OpenFiles, box: Sequence[tuple[int, int]], out: torch.Tensor) -> None:
        start, stop = box[self.dim]
        offset = 0
        for part in self.parts:
            size = part.shape(files)[self.dim]
            low, high = max(start, offset), min(stop, offset + size)
            if low < high:
                part.read_into(files, (*box[:self.dim], (low - offset, high - offset), *box[self.dim + 1:]),
                               out.narrow(self.dim, low - start, high - low))
            offset += size


class _OpenFiles:
    """The safetensors files one parameter is read from, each opened once and all closed together."""

    def __init__(self):
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, object] = {}

    def __getitem__(self, file: Path):
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(_open_safetensors(file))
        return self._handles[file]

    def __enter__(self) -> _OpenFiles:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


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


def default_attn_implementation(config_class) -> str:
    """Return "sdpa" when the causal-LM class of `config_class` supports sdpa, else "eager" (e.g. Gemma2)."""
    model_class = causal_lm_class(config_class)
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def causal_lm_class(config_class):
    """The *ForCausalLM class transformers builds for `config_class`, or None when there is none."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[config_class]
    except (KeyError, ValueError, ImportError, AttributeError):
        return None


def empty_causal_lm(
    directory: str | Path,
    *,
    keep_layers: Sequence[int] | None,
    dtype: torch.dtype,
    attn_implementation: str | None,
) -> tuple[nn.Module, Checkpoint] | None:
    """(model with meta parameters, its `Checkpoint`), or None when the directory cannot be read in shards.

    None: no safetensors files, or some parameter of the model is not found in them (under its own name or
    the one transformers' conversion mapping gives it).
    `attn_implementation` None: `default_attn_implementation`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

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
    # The name each parameter has in the unpruned model, which the checkpoint's names turn into.
    unpruned = {name: re.sub(r"(\.layers\.)(\d+)(\.)",
                             lambda m: f"{m[1]}{original.get(int(m[2]), int(m[2]))}{m[3]}", name)
                for name, _ in model.named_parameters(remove_duplicate=False)}
    stored = _stored_tensors(model, files, set(unpruned.values()))
    if stored is None:
        return None
    sources = {}
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    parameter_names = {id(p): name for name, p in model.named_parameters()}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        source = stored.get(unpruned[name])
        if source is None and head is not None and parameter is head.weight and embedding is not None:
            source = stored.get(unpruned[parameter_names[id(embedding.weight)]])  # a tied head: the embedding
        if source is None:
            return None
        sources[name] = source
    model.eval()
    return model, Checkpoint(directory, sources)


def _stored_tensors(model: nn.Module, files: dict[str, Path], wanted: set[str]) -> dict[str, StoredTensor] | None:
    """Parameter name (of the unpruned model) -> what it is read from, for the names in `wanted`.

    The checkpoint's names are turned into the model's by transformers' own conversion mapping for the
    model (renamings, and converters such as per-expert weights merged into one tensor), as
    `from_pretrained` does; None when a converter uses an operation other than merging a list of tensors
    and concatenating (those are not read in pieces here).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model)
    renamings = [transform for transform in transforms if isinstance(transform, WeightRenaming)]
    converters = [transform for transform in transforms if isinstance(transform, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    present = dict.fromkeys(wanted, True)
    stored: dict[str, StoredTensor] = {}
    merged: dict[str, dict[str, list[StoredTensor]]] = {}  # target -> source pattern -> its tensors, in order
    for key in sorted(files, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, present)
        if target not in wanted and key in wanted:
            target, pattern = key, None
        if target not in wanted:
            continue  # a layer pruned away, or a tensor the model does not have
        if pattern is None:
            stored[target] = StoredTensor(key, files[key])
        else:
            merged.setdefault(target, {}).setdefault(pattern, []).append(StoredTensor(key, files[key]))
    for target, parts in merged.items():
        converter = by_pattern[next(iter(parts))]
        for operation in converter.operations:
            if isinstance(operation, MergeModulelist):
                parts = {pattern: [_Stacked(tensors, operation.dim)] for pattern, tensors in parts.items()}
            elif isinstance(operation, Concatenate):
                ordered = [tensor for pattern in converter.source_patterns for tensor in parts.get(pattern, [])]
                parts = {"": [_Concatenated(ordered, operation.dim)]}
            else:
                return None
        if len(parts) != 1 or len(next(iter(parts.values()))) != 1:
            return None  # the operations do not end in one tensor
        stored[target] = next(iter(parts.values()))[0]
    return stored


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
    wrapper, a LoRA student's base layers): `names` then maps this module's parameter names to the model's
    (default: the same); a parameter it maps to None is given storage only, for the caller to fill (a
    LoRA adapter). Buffers keep their values.
    """
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    tied = _tied_names(model)
    model.to_empty(device=device)
    # to_empty gives every module its own new parameter, so a tied output head would become a second
    # matrix: the other names of a shared parameter are pointed back at the first one's new storage.
    for first, others in tied.items():
        for other in others:
            owner, _, attribute = other.rpartition(".")
            model.get_submodule(owner).register_parameter(attribute, model.get_parameter(first))
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])
    for name, parameter in model.named_parameters():
        if names is not None and names[name] is None:
            continue
        source = checkpoint.sources[names[name] if names else name]
        # Opened per parameter: the file's pages read for one parameter are unmapped before the next is
        # read, so they never add up to the whole checkpoint in this process's resident memory.
        with _OpenFiles() as files:
            _fill(parameter, source, files)


def _tied_names(model: nn.Module) -> dict[str, list[str]]:
    """For each parameter registered under several names: its first name -> the others."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return {group[0]: group[1:] for group in names.values() if len(group) > 1}


def _fill(parameter: torch.Tensor, source: StoredTensor, files: _OpenFiles) -> None:
    """Copy this rank's piece of the stored tensor `source` into `parameter`."""
    from torch.distributed.tensor import DTensor

    shape = source.shape(files)
    if tuple(parameter.shape) != shape:
        raise ValueError(f"checkpoint tensor {source} has shape {shape}, the model expects {tuple(parameter.shape)}")
    whole = tuple((0, size) for size in shape)
    local = _local(parameter)
    if not isinstance(parameter, DTensor):
        source.read_into(files, whole, local)
        return
    indices = _local_indices(shape, parameter)
    if indices is not None and tuple(len(index) for index in indices) == tuple(local.shape):
        # Read run by run: a dimension sharded in strides (packed projections) holds several runs.
        for box in itertools.product(*(_runs(index) for index in indices)):
            source.read_into(files, [(start, stop) for _, start, stop in box],
                             local[tuple(slice(at, at + stop - start) for at, start, stop in box)])
        return
    # Padded or other placements: cut this rank's piece from the whole tensor.
    tensor = torch.empty(shape, dtype=local.dtype, device=local.device)
    source.read_into(files, whole, tensor)
    fill_from_whole(parameter, tensor)


def fill_from_whole(parameter: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy into `parameter` (a DTensor's local piece, or a plain tensor) its share of `whole`, the same
    tensor on every rank (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(parameter, DTensor):
        parameter.copy_(whole)
        return
    whole = whole.to(device=parameter.to_local().device, dtype=parameter.dtype)
    parameter.to_local().copy_(
        distribute_tensor(whole, parameter.device_mesh, parameter.placements, src_data_rank=None).to_local())


def _local_indices(shape: tuple[int, ...], parameter) -> list[torch.Tensor] | None:
    """Per dimension, the global indices of this rank's piece of a DTensor of `shape`, as DTensor cuts it
    (torch.chunk per shard, strided shards as blocks chunked in turn); None for other placements."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def chunk(index: torch.Tensor, parts: int, which: int) -> torch.Tensor:
        chunks = torch.chunk(index, parts)
        return chunks[which] if which < len(chunks) else index[:0]

    indices = [torch.arange(size) for size in shape]
    coordinate = parameter.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(parameter.placements):
        parts, which = parameter.device_mesh.size(mesh_dim), coordinate[mesh_dim]
        if type(placement) is _StridedShard:
            blocks = [chunk(indices[placement.dim], placement.split_factor, block)
                      for block in range(placement.split_factor)]
            indices[placement.dim] = torch.cat([chunk(block, parts, which) for block in blocks])
        elif type(placement) is Shard:
            indices[placement.dim] = chunk(indices[placement.dim], parts, which)
        elif type(placement) is not Replicate:
            return None
    return indices


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """The consecutive runs of `index` as (position in `index`, first value, last value + 1)."""
    runs = []
    for position, value in enumerate(index.tolist()):
        if runs and runs[-1][2] == value:
            runs[-1] = (runs[-1][0], runs[-1][1], value + 1)
        else:
            runs.append((position, value, value + 1))
    return runs

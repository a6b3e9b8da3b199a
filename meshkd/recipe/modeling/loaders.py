"""Loaders of a config section's model and tokenizer (`model`, `teacher_model`): what every role loads.

A section names one source (`meshkd.recipe.modeling.models.load_causal_lm`). Three forms of its model: whole
(`load_section_model`), without weights to be read in shards once laid out where the checkpoint allows
(`load_section_model_for_layout`, `meshkd.parallel.sharded_loading`), and a skeleton on the meta device
for the preflight checks (`load_section_skeleton`). A tokenizer is loaded once per source in a process.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch

from meshkd.parallel.pruning import prune_layers
from meshkd.parallel.sharded_loading import default_attn_implementation, empty_causal_lm
from meshkd.recipe.modeling import models


def load_section_tokenizer(section) -> object:
    """The tokenizer of a model section; one object per source in a process (a GGUF file's takes seconds)."""
    return _tokenizer(section.tokenizer, section.path, section.gguf_file)


@functools.lru_cache(maxsize=4)
def _tokenizer(name: str | None, path: str | None, gguf_file: str | None) -> object:
    if name == "byte":
        return models.byte_tokenizer()
    return models.load_tokenizer(path=name or path, gguf_file=gguf_file)


def load_section_model(section) -> torch.nn.Module:
    """The whole model of a config section, pruned as configured, on the CPU."""
    return models.load_causal_lm(
        path=section.path,
        gguf_file=section.gguf_file,
        random_init=section.random_init,
        keep_layers=section.keep_layers,
        dtype=section.dtype,
        attn_implementation=section.attn_implementation,
        seed=section.seed,
    )


def load_section_model_for_layout(section):
    """(model, `Checkpoint`) with meta parameters, to be filled by `load_shards` once laid out, for a Hugging
    Face directory stored under the model's own names; else (the loaded model, None)."""
    if section.path is not None and section.gguf_file is None and not str(section.path).endswith(".gguf"):
        directory, _ = models.resolve_source(section.path, None)
        empty = empty_causal_lm(directory, keep_layers=section.keep_layers, dtype=models.resolve_dtype(section.dtype),
                                attn_implementation=section.attn_implementation)
        if empty is not None:
            return empty
    return load_section_model(section), None


def load_section_skeleton(section, label: str = "model") -> torch.nn.Module:
    """The model of a config section, pruned as configured, on the meta device: its config, no weights.

    Errors name the section `label` and, where the model's own error does not, the `random_init` key it
    concerns; a `path`'s safetensors files are checked to be readable (`check_safetensors_headers`).
    """
    if section.random_init is not None:
        try:
            with torch.device("meta"):
                return load_section_model(section)
        except Exception as error:  # noqa: BLE001 - the modeling code's verdict on the user's kwargs: a
            # negative size reaching a tensor's shape, a value of the wrong type for the config class
            raise ValueError(_random_init_error(label, section.random_init, error)) from None
    from transformers import AutoConfig, AutoModelForCausalLM

    directory, gguf_file = models.resolve_source(section.path, section.gguf_file)
    if gguf_file is None:
        check_safetensors_headers(directory, f"{label}.path")
    kwargs = {"gguf_file": gguf_file} if gguf_file is not None else {}
    hf_config = AutoConfig.from_pretrained(str(directory), local_files_only=True, **kwargs)
    attention = section.attn_implementation or default_attn_implementation(type(hf_config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attention)
    if section.keep_layers is not None:
        prune_layers(model, section.keep_layers)
    return model


def _random_init_error(label: str, random_init: dict, error: Exception) -> str:
    """The model's error about `random_init` kwargs, naming the keys it most likely concerns: those the
    message names, else the negative sizes, else those whose values it quotes (a negative `hidden_size`
    surfaces as "negative dimension -64")."""
    message = " ".join(str(error).split())
    if message.startswith(("random_init", "keep_layers")):  # meshkd's own checks: they name the key
        return f"{label}.{message}"
    numbers = {key: value for key, value in random_init.items()
               if isinstance(value, int | float) and not isinstance(value, bool)}
    quoted = set(re.findall(r"-?\d+(?:\.\d+)?", message))
    for keys in ([key for key in random_init if re.search(rf"\b{re.escape(key)}\b", message)],
                 [key for key, value in numbers.items() if value < 0],
                 [key for key, value in numbers.items() if str(value) in quoted]):
        if len(keys) == 1:
            return f"{label}.random_init.{keys[0]} ({random_init[keys[0]]!r}): {message}"
        if keys:
            return f"{label}.random_init ({', '.join(f'{key}={random_init[key]!r}' for key in keys)}): {message}"
    return f"{label}.random_init: {message}"


def check_safetensors_headers(directory: Path, key: str) -> None:
    """Read the header of each `*.safetensors` file of a model directory (a few KiB each, no weights), so a
    truncated or garbage file is refused before any process loads it.

    Raises:
        ValueError: naming `key` and the file.
    """
    from safetensors import safe_open

    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except Exception as error:  # noqa: BLE001 - the library's own error types differ between versions
            raise ValueError(f"{key}: {path} is not a readable safetensors file ({error})") from None

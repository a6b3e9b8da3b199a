"""Choose the decoder layers a pruned student keeps by measured importance: `keep_layers: {auto: N}`.

Design. The model to prune (the `model` section's own source with all its layers; usually the teacher
itself) runs its own forward on the first `calibration_rows` rows of the training split, with hooks on
its decoder layers recording each layer's input and output. The distance between two hidden states is
their angle over pi, averaged over the non-padding tokens (Gromov et al. 2024, "The Unreasonable
Ineffectiveness of the Deeper Layers"; ShortGPT's block influence, 1 - cosine, orders layers alike).
- `by: block` (the default) drops the L - N contiguous layers whose input and output are closest. The
  layers of a block act together, and only measuring the block as one sees that: on SmolLM2-135M, keeping
  8 of 30 layers this way starts at 10.8 nats of held-out loss, dropping the 22 individually least
  important layers at 13.5.
- `by: layer` drops the L - N layers that change their input least, each measured on its own (ShortGPT).
It runs in one process before any worker starts (`meshkd train` and `meshkd prune` call it), loading the
whole model to prune once; on a GPU in a child process that exits when done, so that neither the model
nor the CUDA context it needs stays on the launcher's GPU for the whole run. The choice, the ranking and
what they were measured on go to RUN_DIR/layer_selection.json: a later run of the same request, model
and calibration rows reuses it, and `--resume` always does, so a run's layers never change under it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

from meshkd.core.masks import attention_windows, layer_masks, takes_block_masks
from meshkd.parallel.stages import decoder_of
from meshkd.recipe.common.files import write_atomically
from meshkd.recipe.corpus import data
from meshkd.recipe.modeling import models
from meshkd.recipe.modeling.loaders import load_section_model
from meshkd.recipe.settings.config import ConfigError, KDRecipeConfig
from meshkd.recipe.teacher.teacher_cache import model_identity, row_hashes, rows_digest

SELECTION_FILE = "layer_selection.json"
METHODS = ("block", "layer")
_SOURCE_KEYS = ("path", "gguf_file", "random_init", "dtype", "seed", "attn_implementation")
_ROWS_PER_FORWARD = 4


def selection_path(config: KDRecipeConfig) -> Path:
    return Path(config.logging.run_dir, SELECTION_FILE)


def request(config: KDRecipeConfig) -> dict[str, Any]:
    """`model.keep_layers` as a request with its defaults filled in: {auto, by, calibration_rows}."""
    return {"by": "block", "calibration_rows": 16, **config.model.keep_layers}


def angular_distances(model: torch.nn.Module, batches, *, span: int) -> tuple[list[float], list[float]]:
    """(per layer, per block of `span` layers): the mean angular distance, over the non-padding tokens of
    `batches` (NEAT-packed batch dicts), between a layer's (a block's first layer's) input and its (the
    block's last layer's) output. Entry i of the block list is the block starting at layer i."""
    layers = decoder_of(model).layers
    recorded: list[torch.Tensor | None] = [None] * (len(layers) + 1)

    def record_input(index: int):
        def hook(module, args, kwargs):
            recorded[index] = args[0] if args else kwargs["hidden_states"]
        return hook

    def record_output(module, args, output):
        recorded[-1] = output[0] if isinstance(output, tuple) else output

    handles = [layer.register_forward_pre_hook(record_input(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(record_output))
    windows = attention_windows(model.config, model)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    device = next(model.parameters()).device
    per_layer = torch.zeros(len(layers), dtype=torch.float64)
    per_block = torch.zeros(len(layers) - span + 1, dtype=torch.float64)
    tokens = 0
    try:
        with torch.no_grad():
            for batch in batches:
                documents = batch["attention_mask"].to(device)
                masks = layer_masks(documents, windows, dtype=dtype, block=takes_block_masks(model.config))
                model(input_ids=batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device),
                      attention_mask=masks, use_cache=False)
                valid = documents != 0
                states = [state[valid] for state in recorded]
                for i in range(len(layers)):
                    per_layer[i] += _angles(states[i], states[i + 1]).sum().cpu()
                for i in range(len(per_block)):
                    per_block[i] += _angles(states[i], states[i + span]).sum().cpu()
                tokens += int(valid.sum())
    finally:
        for handle in handles:
            handle.remove()
    if tokens == 0:
        raise ValueError("the calibration rows hold no token")
    return (per_layer / tokens).tolist(), (per_block / tokens).tolist()


def _angles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    cosine = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)
    return torch.arccos(cosine.clamp(-1.0, 1.0)) / math.pi


def choose(per_layer: list[float], per_block: list[float], *, keep: int, by: str) -> list[int]:
    """The layers to keep, ascending: all but the closest block of len(per_layer) - keep layers (`block`),
    or the `keep` layers of largest distance (`layer`). Ties go to the earlier layer or block."""
    num_layers = len(per_layer)
    if by == "block":
        start = min(range(len(per_block)), key=lambda i: (per_block[i], i))
        dropped = range(start, start + num_layers - keep)
        return [i for i in range(num_layers) if i not in dropped]
    ranked = sorted(range(num_layers), key=lambda i: (-per_layer[i], i))
    return sorted(ranked[:keep])


def calibration_rows(config: KDRecipeConfig, tokenizer) -> dict[str, torch.Tensor]:
    """The first `calibration_rows` rows of the run's training split."""
    train, _ = data.build_run_datasets(tokenizer, config.dataset, sequence_length=config.step_scheduler.sequence_length)
    return train[: request(config)["calibration_rows"]]


def _on_gpu(config: KDRecipeConfig) -> bool:
    return torch.cuda.is_available() and config.device != "cpu"


def measure_apart(config: KDRecipeConfig, rows: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`measure` in a spawned process that exits when done: the model and the CUDA context go with it."""
    import torch.multiprocessing as mp  # its pickler shares the rows' tensors with the child

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, (config, rows))


def measure(config: KDRecipeConfig, rows: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Measure the `model` section's layers on the calibration `rows` and return the selection record."""
    asked = request(config)
    section = dataclasses.replace(config.model, keep_layers=None)
    with models.loading_quietly():
        model = load_section_model(section)
    num_layers = len(decoder_of(model).layers)
    if asked["auto"] > num_layers:
        raise ConfigError(f"model.keep_layers.auto: {asked['auto']} is more than the model's {num_layers} layers")
    if _on_gpu(config):
        model.to("cuda")
    batches = [{key: value[i: i + _ROWS_PER_FORWARD] for key, value in rows.items()}
               for i in range(0, len(rows["input_ids"]), _ROWS_PER_FORWARD)]
    span = max(1, num_layers - asked["auto"])
    per_layer, per_block = angular_distances(model, batches, span=span)
    keep = choose(per_layer, per_block, keep=asked["auto"], by=asked["by"])
    return {
        "request": asked,
        "measured_on": _measured_on(config, rows),
        "keep_layers": keep,
        "layer_distance": per_layer,
        "block_distance": {"layers_per_block": span, "by_first_layer": per_block},
    }


def _measured_on(config: KDRecipeConfig, rows) -> dict[str, Any]:
    return {**model_identity(config.model, "model", _SOURCE_KEYS),
            "calibration rows (sha256)": rows_digest(row_hashes(rows))}


def describe(record: dict[str, Any]) -> str:
    """The ranking and the choice, for the terminal."""
    per_layer = record["layer_distance"]
    ranked = sorted(range(len(per_layer)), key=lambda i: (per_layer[i], i))
    asked, keep = record["request"], record["keep_layers"]
    lines = [f"model.keep_layers: {asked}: layer importance on {asked['calibration_rows']} calibration rows "
             "(angular distance between a layer's input and output; least important first):",
             "  " + "  ".join(f"{i}:{per_layer[i]:.3f}" for i in ranked)]
    dropped = [i for i in range(len(per_layer)) if i not in keep]
    if asked["by"] == "block" and dropped:
        block = record["block_distance"]["by_first_layer"][dropped[0]]
        lines.append(f"dropping layers {dropped[0]}-{dropped[-1]}, the {len(dropped)} contiguous layers whose input "
                     f"and output are closest ({block:.3f})")
    elif dropped:
        lines.append(f"dropping the {len(dropped)} least important layers {dropped}")
    lines.append(f"keeping {len(keep)} of {len(per_layer)} layers: {keep}")
    return "\n".join(lines)


def resolve(config: KDRecipeConfig, tokenizer, *, resume: bool = False, measure_here: bool = True) -> list[int]:
    """The layers `model.keep_layers: {auto: N}` keeps for this run, recorded in RUN_DIR/layer_selection.json.

    The record is reused when it holds the same request, model and calibration rows, and always on
    `resume`; otherwise the layers are measured (`measure_here`; the ranking is printed) or ConfigError
    says how to measure them.
    """
    path = selection_path(config)
    record = _read(path)
    if record is not None and resume:
        return _reused(record, path, measure_here)
    rows = calibration_rows(config, tokenizer)  # tokenized once: to check the record, or to measure on
    if record is not None and record["request"] == request(config) and (
            record["measured_on"] == _measured_on(config, rows)):
        return _reused(record, path, measure_here)
    if not measure_here:
        raise ConfigError(f"model.keep_layers: {config.model.keep_layers} is chosen by measuring the model in one "
                          f"process; {path} holds no choice for this run: run `meshkd prune CONFIG` first")
    record = measure_apart(config, rows) if _on_gpu(config) else measure(config, rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(record, indent=1).encode())
    print(f"meshkd: {describe(record)}\nmeshkd: layer selection written to {path}", flush=True)
    return record["keep_layers"]


def _reused(record: dict[str, Any], path: Path, say: bool) -> list[int]:
    if say:
        print(f"meshkd: model.keep_layers: {record['keep_layers']}, as {path} records", flush=True)
    return record["keep_layers"]


def _read(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not {"request", "measured_on", "keep_layers"} <= set(record):
            raise ValueError("not a layer selection record")
    except ValueError as error:
        raise ConfigError(f"model.keep_layers: {path} is damaged ({error}); remove it to measure again") from None
    return record

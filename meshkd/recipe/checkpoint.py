"""Sharded, atomic checkpoints of the student with torch.distributed.checkpoint (DCP).

A checkpoint is a directory `step_00000042` holding the DCP shards of model + optimizer (keyed by
parameter name, so pipeline stages merge), one small file per rank with what is rank-local (RNG states),
and `meta.json` (step, scheduler state) written last. It is first written under `step_00000042.partial`
and renamed by the first student rank after every rank finished, so a process killed mid-save leaves the
previous checkpoint as the latest and the partial one ignored (`latest_checkpoint` counts only `step_N`
directories holding meta.json). The next save of that step removes the leftover partial directory first.
The data position is the step itself: batches are a pure function of (seed, step). `export_hf` writes the
final student as an HF directory.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from meshkd.recipe.faults import brief

_PARTIAL = ".partial"
# Optimizer state keyed by parameter name ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): pipeline
# stages hold different parameters, and their positional param_groups would collide in one checkpoint.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_COMPLETE = re.compile(r"step_(\d+)")


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """Where the complete checkpoint of `step` lives under `root`."""
    return Path(root, f"step_{step:08d}")


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `root`, or None.

    Complete: named `step_N` (renamed from `step_N.partial` after every rank wrote its part) and holding
    meta.json. Partial directories, directories without meta.json and other names are ignored.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    complete = []
    for path in root.iterdir():
        match = _COMPLETE.fullmatch(path.name)
        if match and (path / "meta.json").is_file():
            complete.append((int(match.group(1)), path))
    return max(complete)[1] if complete else None


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    group: dist.ProcessGroup | None,
    extra: dict | None = None,
) -> Path:
    """Save a checkpoint of `step`; every rank of `group` (the student ranks) calls it."""
    final = checkpoint_dir(root, step)
    partial = final.with_name(final.name + _PARTIAL)
    rank, group_rank = dist.get_rank(), dist.get_rank(group)
    if group_rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier(group=group)
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(partial), process_group=group)
    torch.save(_rng_state(), partial / f"rng_rank{rank}.pt")
    dist.barrier(group=group)
    if group_rank == 0:
        meta = {"step": step, "scheduler": scheduler.state_dict(), **(extra or {})}
        (partial / "meta.json").write_text(json.dumps(meta))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
    dist.barrier(group=group)
    return final


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    group: dist.ProcessGroup | None,
) -> dict:
    """Restore model, optimizer, scheduler and this rank's RNG from `path`; returns its meta.json."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_OPTIONS
    )
    scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return meta


def resume_latest(root: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                  group: dist.ProcessGroup | None) -> tuple[Path | None, int]:
    """Restore the latest complete checkpoint under `root`; returns it and its step ((None, 0) when none).

    Only complete checkpoints count: a save killed half-way left a `.partial` directory. A checkpoint that
    does not fit this run raises ValueError naming it.
    """
    latest = latest_checkpoint(root)
    if latest is None:
        return None, 0
    try:
        meta = load_checkpoint(latest, model=model, optimizer=optimizer, scheduler=scheduler, group=group)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # DCP raises CheckpointException, a BaseException
        raise ValueError(
            f"checkpoint {latest} cannot be loaded into this run (a different model or layout?): {brief(error)}"
        ) from error
    return latest, meta["step"]


def export_hf(out_dir: Path, *, model: torch.nn.Module, pipeline, tokenizer, group: dist.ProcessGroup | None) -> Path:
    """Write the student as an HF directory (safetensors, config, tokenizer); every student rank calls.

    `pipeline`: the `StudentPipeline` when the student is pipelined (this rank holds one stage: the whole
    model is gathered from the stages and written from an empty shell of its config), else None.
    """
    from transformers import AutoModelForCausalLM

    from meshkd.parallel.data_parallel import gather_full_state_dict
    from meshkd.recipe.metrics import is_logging_rank
    from meshkd.recipe.models import save_hf_model

    if pipeline is None:
        state_dict, shell = gather_full_state_dict(model), getattr(model, "module", model)
    else:
        state_dict = pipeline.full_state_dict()
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(model.config)
    if is_logging_rank():
        save_hf_model(shell, tokenizer, out_dir, state_dict=state_dict)
    if group is not None or dist.get_world_size() > 1:
        dist.barrier(group=group)
    return out_dir

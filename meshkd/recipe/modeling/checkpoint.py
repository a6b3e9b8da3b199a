"""Sharded, atomic checkpoints of the student with torch.distributed.checkpoint (DCP).

A checkpoint is a directory `step_00000042` holding the DCP shards of model + optimizer (keyed by
parameter name, so pipeline stages merge), one small file per rank with what is rank-local (RNG states),
`manifest.json` (every file's size and sha256) and `meta.json` (step, scheduler state) written last. It
is first written under `step_00000042.partial`: every rank hashes and fsyncs a share of the files, the
first student rank writes the manifest and meta.json, fsyncs the directory and renames it. A process
killed mid-save leaves the previous checkpoint as the latest and the partial one ignored
(`latest_checkpoint` counts only `step_N` directories holding meta.json); partial directories left over
are removed at the next start (`remove_partials`). `resume_latest` checks the newest checkpoint against
its manifest (every rank a share of the files) and falls back to the newest intact one, saying so. The
data position is the step itself: batches are a pure function of (seed, step). The model's state is its
parameters as they train: a mixed-precision student's float32 master weights, with float32 optimizer
states, so a resumed run repeats the uninterrupted one. `export_hf` writes the final student as an HF
directory in the dtype asked for (the configured one), refusing tensors that are not finite.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from meshkd.core.agreement import first_failure, gather_values, group_device
from meshkd.recipe.common.faults import brief
from meshkd.recipe.common.files import file_sha256, fsync

_PARTIAL = ".partial"
# Optimizer state keyed by parameter name ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): pipeline
# stages hold different parameters, and their positional param_groups would collide in one checkpoint.
# Frozen parameters (a LoRA student's base) are not saved: they are read again from the model's source.
# Loading leaves them alone (strict=False); every key it asks for must be in the checkpoint (`dcp.load`).
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True)
_LOAD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)
_COMPLETE = re.compile(r"step_(\d+)")
_MANIFEST = "manifest.json"


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """Where the complete checkpoint of `step` lives under `root`."""
    return Path(root, f"step_{step:08d}")


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `root`, or None.

    Complete: named `step_N` (renamed from `step_N.partial` after every rank wrote its part) and holding
    meta.json. Partial directories, directories without meta.json and other names are ignored.
    """
    complete = complete_checkpoints(root)
    return complete[0] if complete else None


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Every complete checkpoint under `root` (see `latest_checkpoint`), newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    complete = []
    for path in root.iterdir():
        match = _COMPLETE.fullmatch(path.name)
        if match and (path / "meta.json").is_file():
            complete.append((int(match.group(1)), path))
    return [path for _, path in sorted(complete, reverse=True)]


def remove_partials(root: str | Path) -> list[Path]:
    """Remove the `.partial` directories saves killed half-way left under `root`; returns them."""
    root = Path(root)
    stale = sorted(path for path in root.iterdir() if path.name.endswith(_PARTIAL)) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _group_share(paths: list[Path], group: dist.ProcessGroup | None) -> list[Path]:
    """This rank's share of `paths` (every rank of `group` lists the same paths)."""
    return paths[dist.get_rank(group) :: dist.get_world_size(group)]


def _manifest(directory: Path, group: dist.ProcessGroup | None) -> dict[str, dict]:
    """{file: {bytes, sha256}} of every file under `directory`, each rank hashing (and fsyncing) a share."""
    files = sorted(path for path in directory.rglob("*") if path.is_file())
    mine = {}
    for path in _group_share(files, group):
        fsync(path)
        mine[str(path.relative_to(directory))] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    merged = {}
    for share in gather_values(mine, group, device=group_device(group)):
        merged.update(share)
    return merged


def check_checkpoint(path: Path, group: dist.ProcessGroup | None) -> str | None:
    """What is wrong with checkpoint `path` against its manifest (a file missing, cut or changed), or None.

    Every rank of `group` checks a share of the files and all learn the first problem. A checkpoint
    written before manifests existed has nothing to check against: None.
    """
    problem, manifest = None, {}
    try:
        manifest = json.loads((path / _MANIFEST).read_text())
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or any(not isinstance(entry, dict) or set(entry) != {"bytes", "sha256"}
                                             for entry in manifest.values()):
        manifest, problem = {}, f"{path / _MANIFEST}: not a readable checkpoint manifest"
    for name in _group_share(sorted(manifest), group):
        file, entry = path / name, manifest[name]
        if not file.is_file():
            problem = f"{file} is missing"
        elif file.stat().st_size != entry["bytes"]:
            problem = f"{file} has {file.stat().st_size} bytes, {entry['bytes']} were written"
        elif file_sha256(file) != entry["sha256"]:
            problem = f"{file} is corrupted (its sha256 differs from the one written with it)"
        if problem is not None:
            break
    problems = gather_values(problem, group, device=group_device(group))
    return next((found for found in problems if found is not None), None)


def _cause(error: BaseException) -> str:
    """One line for a DCP failure: the first failing rank's own error, not `CheckpointException ranks: ...`."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, cause = min(failures.items(), key=lambda item: item[0])
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, its traceback)
        return f"rank {rank}: {type(cause).__name__}: {brief(cause)}"
    return brief(error)


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
    try:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(partial), process_group=group)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # DCP raises CheckpointException, a BaseException, on every rank
        raise OSError(f"checkpoint {partial} could not be written: {_cause(error)}") from error
    torch.save(_rng_state(), partial / f"rng_rank{rank}.pt")
    dist.barrier(group=group)
    manifest = _manifest(partial, group)
    if group_rank == 0:
        meta = {"step": step, "scheduler": scheduler.state_dict(), **(extra or {})}
        for name, document in ((_MANIFEST, manifest), ("meta.json", meta)):  # meta.json last: it marks complete
            (partial / name).write_text(json.dumps(document))
            fsync(partial / name)
        fsync(partial)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        fsync(final.parent)
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
    try:
        meta = json.loads((path / "meta.json").read_text())
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or not {"step", "scheduler"} <= set(meta):
        raise ValueError(f"{path / 'meta.json'}: not a readable checkpoint meta file (step and scheduler state)")
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_LOAD_OPTIONS
    )
    scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return meta


def resume_latest(root: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                  group: dist.ProcessGroup | None) -> tuple[Path | None, int]:
    """Restore the newest intact checkpoint under `root`; returns it and its step ((None, 0) when none).

    Only complete checkpoints count: a save killed half-way left a `.partial` directory. A damaged one (a
    file missing, cut or changed since it was written) is passed over for the previous one, saying so; when
    every checkpoint is damaged, ValueError names the newest's problem. A checkpoint that does not fit this
    run raises ValueError naming it.
    """
    from meshkd.recipe.common.metrics import print0

    complete, newest_problem = complete_checkpoints(root), None
    for path in complete:
        problem = check_checkpoint(path, group)
        if problem is None:
            break
        newest_problem = newest_problem or problem
        print0(f"meshkd: checkpoint {path} is damaged ({problem}); trying the one before it")
    else:
        if complete:
            raise ValueError(f"every checkpoint under {root} is damaged; the newest: {newest_problem}")
        return None, 0
    try:
        meta = load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, group=group)
    except (KeyboardInterrupt, SystemExit, ValueError):  # a ValueError names the file already
        raise
    except BaseException as error:  # DCP raises CheckpointException, a BaseException
        raise ValueError(
            f"checkpoint {path} cannot be loaded into this run (a different model or layout?): {_cause(error)}"
        ) from error
    return path, meta["step"]


def nonfinite_tensor(state_dict: dict[str, torch.Tensor]) -> str | None:
    """'tensor NAME holds NaN or inf' for the first such floating-point tensor, else None."""
    for name, tensor in state_dict.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"tensor {name} holds NaN or inf"
    return None


def export_hf(out_dir: Path, *, model: torch.nn.Module, pipeline, tokenizer, group: dist.ProcessGroup | None,
              dtype: torch.dtype | None = None, merge_adapters: Callable[[dict], dict] | None = None) -> Path:
    """Write the student as an HF directory (safetensors, config, tokenizer); every student rank calls.

    `pipeline`: the `StudentPipeline` when the student is pipelined (this rank holds one stage: the whole
    model is gathered from the stages, tensor by tensor, to global rank 0 and written from an empty shell
    of its config), else None.
    `dtype`: the floating-point tensors' dtype in the files (None: the parameters').
    `merge_adapters`: a LoRA student's, on the writing rank: writes the adapters, returns the state dict
    with them merged (`meshkd.recipe.modeling.adapters.export_adapters`); the student is written as a plain model.
    """
    from transformers import AutoModelForCausalLM

    from meshkd.parallel.data_parallel import gather_full_state_dict
    from meshkd.recipe.common.metrics import is_logging_rank
    from meshkd.recipe.modeling.models import save_hf_model

    # Gathered to global rank 0 only (the setup's first rank), the rank that writes it: the others never hold a
    # full copy.
    state_dict = (gather_full_state_dict(model, rank0_only=True) if pipeline is None
                  else pipeline.full_state_dict(first_rank_only=True))
    shell = getattr(model, "module", model)
    if pipeline is not None or merge_adapters is not None:  # a stage, or LoRA layers: written from a plain shell
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(shell.config)
    if merge_adapters is not None and is_logging_rank():
        state_dict = merge_adapters(state_dict)
    if dtype is not None:
        state_dict = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
                      for name, tensor in state_dict.items()}
    problem = nonfinite_tensor(state_dict) if is_logging_rank() else None
    failure = first_failure(problem, group, device=group_device(group)) if dist.get_world_size(group) > 1 else None
    if problem is not None or failure is not None:
        raise ValueError(f"HF export to {out_dir}: {problem or failure[1]}; nothing written")
    if is_logging_rank():
        save_hf_model(shell, tokenizer, out_dir, state_dict=state_dict)
    if group is not None or dist.get_world_size() > 1:
        dist.barrier(group=group)
    return out_dir

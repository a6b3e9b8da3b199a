"""The world a rank joins: its device and the process group, both from torchrun's environment.

A CUDA rank takes GPU LOCAL_RANK and the group uses NCCL; a CPU rank uses gloo. One GPU per process:
NCCL cannot run two ranks of a group on one GPU, so a node that sees fewer GPUs than it runs ranks is
refused before any is used, by `meshkd train` before it starts the workers (`check_gpu_count`) and by
every rank before it creates the group (`init_world`). The collective timeout is the config's
`collective_timeout_s`.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from meshkd.recipe.config import KDRecipeConfig


def uses_cuda(config: KDRecipeConfig) -> bool:
    """Whether the run's ranks use CUDA devices (`device: cuda`, or `auto` where CUDA is available)."""
    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


def check_gpu_count(config: KDRecipeConfig, local_processes: int) -> None:
    """Refuse to run `local_processes` ranks of a CUDA run on a node that sees fewer GPUs.

    One GPU per process: NCCL cannot run two ranks of a group on one GPU, and a rank without a GPU of its
    own would fail later with "invalid device ordinal".
    """
    if not uses_cuda(config):
        return
    visible = torch.cuda.device_count()
    if local_processes > visible:
        raise ValueError(
            f"this run needs {local_processes} processes on this node, one GPU each, but the node sees {visible} "
            f"GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): lay out fewer "
            "ranks per node, or set device: cpu"
        )


def init_world(config: KDRecipeConfig) -> tuple[torch.device, bool]:
    """This rank's device, and whether the process group was created here (from torchrun's environment,
    NCCL on CUDA, gloo on CPU, `collective_timeout_s`), so that the caller destroys it at the end.

    A CUDA rank takes GPU LOCAL_RANK; a node with fewer GPUs than LOCAL_WORLD_SIZE is refused first."""
    device = torch.device("cpu")
    if uses_cuda(config):
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        check_gpu_count(config, max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), local_rank + 1))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if dist.is_initialized():
        return device, False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=config.collective_timeout_s))
    return device, True

"""A pipelined student's whole state dict: every stage's tensors, unsharded, in HF order (what an export writes).

Collective over the student's setup. `pipeline_state_dict(first_rank_only=False)`: every rank gathers its
stage over tp and dp and the stages are exchanged whole over pp (pickled): every rank holds the whole
model, for tests and small models. With `first_rank_only` the model travels tensor by tensor to the setup's
first rank (`_gather_to_first_rank`): no rank but the first holds more than one unsharded tensor of its
stage at a time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshkd.core.topology import DistributedSetup
from meshkd.parallel.data_parallel import gather_full_state_dict


def pipeline_state_dict(stage_model: nn.Module, setup: DistributedSetup, *, pp_group: dist.ProcessGroup,
                        pp_rank: int, device: torch.device, first_rank_only: bool = False) -> dict[str, torch.Tensor]:
    """The complete HF-named state dict of the pipeline whose stage `stage_model` is this rank's (module
    docstring): on every rank, or with `first_rank_only` on the setup's first rank alone ({} elsewhere)."""
    if first_rank_only:
        return _gather_to_first_rank(stage_model, setup, pp_group=pp_group, pp_rank=pp_rank, device=device)
    state = gather_full_state_dict(stage_model)
    parts: list[dict[str, torch.Tensor] | None] = [None] * setup.pp_size
    dist.all_gather_object(parts, state, group=pp_group)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:  # stage order: embedding, layers in order, norm, lm_head (the HF order)
        merged.update(part)
    return merged


def _gather_to_first_rank(stage_model: nn.Module, setup: DistributedSetup, *, pp_group: dist.ProcessGroup, pp_rank: int,
                      device: torch.device) -> dict[str, torch.Tensor]:
    """The whole model on the setup's first rank, one tensor at a time; {} elsewhere.

    The first rank (pp, dp, cp and tp coordinates 0) learns each stage's names, shapes and dtypes first
    (small objects over its pp group). Then, stage after stage in HF order, the ranks of a stage make
    each of its tensors whole in turn (`full_tensor`, collective over the stage's tp / dp axes: every rank
    of the stage takes part) and the one rank of the stage in the first rank's pipeline sends it over
    pp, from the device (NCCL takes device tensors), into a buffer on the first rank that is moved to
    the CPU at once. The other replicas' pipelines only take part in the gathers. So a rank holds at
    most its stage's largest tensor beyond its shards; the first rank holds the model it will write.
    Cannot deadlock: the first rank waits on stage s only after it is done with the stages before it,
    and a stage's gathers involve that stage's ranks alone.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    first, rank = setup.ranks[0], dist.get_rank()
    carries = first in dist.get_process_group_ranks(pp_group)  # this pipeline takes the stages to it
    # This stage's tensors by HF name, still sharded (views, no copy); the names are the full dict's.
    local = get_model_state_dict(stage_model, options=StateDictOptions(full_state_dict=False))
    layouts: list = [None] * setup.pp_size
    if carries:
        layout = [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in local.items()]
        dist.gather_object(layout, layouts if rank == first else None, dst=first, group=pp_group)
    merged: dict[str, torch.Tensor] = {}
    for stage in range(setup.pp_size):
        if stage == pp_rank:
            for name, tensor in local.items():
                whole = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
                if rank == first:
                    merged[name] = whole.cpu()
                elif carries:
                    dist.send(whole.contiguous(), dst=first, group=pp_group)
                del whole
        elif rank == first:
            source = dist.get_global_rank(pp_group, stage)
            for name, shape, dtype in layouts[stage]:
                buffer = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buffer, src=source, group=pp_group)
                merged[name] = buffer.cpu()
                del buffer
    return merged

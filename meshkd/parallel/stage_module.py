"""One pipeline stage of a causal LM as the torch module a pipeline schedule runs (`StageModule`): the model's own
forward over this stage's layers (`meshkd.parallel.stages.ModelStage`), its attention masks built from the NEAT
document indices, an MoE student's router statistics carried from stage to stage, and the stage's output as the
schedule's static metadata says it (`meshkd.parallel.student_pipeline.StudentPipeline` builds and runs it)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshkd.core.masks import layer_masks, mask_dtype
from meshkd.parallel.context_parallel import pad_and_shard
from meshkd.parallel.stages import ModelStage


class StageModule(nn.Module):
    """One pipeline stage of a causal LM (`meshkd.parallel.stages.ModelStage`), with the HF parameter names.

    The model's children are this module's children, so names stay `model.layers.N...`, `lm_head...`.
    forward(inputs, position_ids=, documents=): `inputs` is input_ids [rows, seq] on the first stage and the
    previous stage's hidden state [rows, seq, hidden] elsewhere; the model's own forward runs with the
    masks built from `documents`. Returns the hidden state, or on the last stage this rank's local logits
    [rows, seq, local_vocab] as a plain tensor (the stage metadata then needs no DTensor gradient
    description; `StudentPipeline` rebuilds the DTensor for the loss), or with `hands_hidden_states` the last
    hidden states [rows, seq, hidden] (the output layer checked on the first forward: `last_hidden_states`).
    """

    def __init__(
        self, stage: ModelStage, *, windows: dict[str, int | None], dtype: torch.dtype, logits_dtype: torch.dtype,
        cp_size: int = 1, cp_rank: int = 0, router_loss=None, block: bool = False,
    ):
        super().__init__()
        for name, child in stage.model.named_children():
            self.add_module(name, child)
        self.stage = stage  # a plain object: the model is reached through it, its children are registered above
        self.config = stage.model.config
        self.windows = windows
        self.block = block  # FlexAttention BlockMasks (`meshkd.core.masks.takes_block_masks`)
        self.dtype, self.logits_dtype = dtype, logits_dtype
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self.router_loss = router_loss
        self.hands_hidden_states = False
        self._head_checked = False

    def forward(self, inputs: torch.Tensor, statistics: torch.Tensor | None = None, *, position_ids: torch.Tensor,
                documents: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The stage's output; with a router loss (hidden state or logits, the routers' statistics so far),
        `statistics` then being the previous stage's (none on the first)."""
        masks = layer_masks(documents, self.windows, dtype=mask_dtype(self, inputs.device), cp_size=self.cp_size,
                            cp_rank=self.cp_rank, block=self.block)
        with self.router_loss.recording() if self.router_loss else contextlib.nullcontext():
            hidden_states = self.stage.is_last and self.hands_hidden_states
            check_head = hidden_states and not self._head_checked
            output = self.stage.run(inputs, attention_mask=masks, position_ids=position_ids,
                                    hidden_states=hidden_states, check_head=check_head)
            self._head_checked |= check_head
        if not self.stage.is_last or self.hands_hidden_states:
            # The receiving stage allocated its buffer from the static metadata: same dtype, contiguous.
            output = output.to(self.dtype).contiguous()
        else:
            # The schedule checks the logits against the static metadata too.
            output = (output.to_local() if isinstance(output, DTensor) else output).to(self.logits_dtype)
        if self.router_loss is None:
            return output
        # The routers saw this rank's tokens: under cp its head-tail share of the whole sequence's documents.
        real = documents if self.cp_size == 1 else pad_and_shard(documents, cp_size=self.cp_size,
                                                                 cp_rank=self.cp_rank)
        own = self.router_loss.statistics(real)
        if torch.is_grad_enabled() and not own.requires_grad:
            own.requires_grad_()  # a stage without routers: the schedule expects a gradient for every output
        return output, own if statistics is None else statistics + own


__all__ = ["StageModule"]

"""Pipeline stages of a transformers causal LM that run the model's own forward.

Design. A stage keeps the model object whole and runs its forward, so everything a family does in its
forward (Gemma's embedding scale and logit soft-capping, Granite's multipliers, Gemma 3's rotary per layer
type, the per-layer-type masks) comes out right without meshkd knowing it. The module boundaries come from
the model's `base_model_pp_plan` (`embed_tokens`, `layers`, `norm`): the decoder layers other stages own
become pass-through modules without parameters (so the kept layers keep their HF names and indices), the
embedding is dropped on stages after the first, and the final norm and output head become pass-throughs on
stages before the last. Two hooks join a stage to its neighbours:
- after the first stage, a forward pre-hook on the first kept layer replaces that layer's input with the
  hidden state received from the previous stage. The model's forward is given that tensor as
  `inputs_embeds` for its shape and dtype only; what the forward computes from it before the first layer
  (Granite's embedding multiplier, say) is discarded;
- before the last stage, the pass-through standing in for the final norm records its input: the output of
  the last kept layer after every hook of that layer ran (FSDP2's included). What follows runs on
  pass-throughs and costs a few element-wise operations.
The last stage returns the model's logits, i.e. what the model's own head and post-processing produce, or, for a
loss that applies the output layer itself (`meshkd.core.fused_output`), its last hidden states
(`last_hidden_states`: the model's forward with its output layer applied to the last position only).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

__all__ = ["HeadTransformError", "ModelStage", "decoder_of", "is_pass_through", "is_tied", "last_hidden_states",
           "stage_layers"]


class HeadTransformError(ValueError):
    """A model changes its logits after its output layer (`last_hidden_states`' check)."""


def last_hidden_states(model: nn.Module, *, check_head: bool = False, **inputs: Any) -> torch.Tensor:
    """[batch, sequence, hidden]: a causal LM's last hidden states (after its final norm: what its output layer
    takes), from the model's own forward with the hidden states asked for (the last of them is the final norm's
    output in transformers 5) and its output layer applied to the last position only (`logits_to_keep`: one
    position's logits, [batch, 1, vocab], instead of every position's; none at all would leave a tensor-parallel
    head an empty DTensor, which its layouts cannot reshape).

    `check_head`: check that the model returned what the output layer made at that position (a forward hook reads
    it), once, before trusting that the logits are the output layer's of these hidden states.

    Raises:
        HeadTransformError: with `check_head`, the model changed the output layer's logits (a soft-cap or a scale
            in its forward).
    """
    made: list[torch.Tensor] = []
    head = getattr(model, "module", model).get_output_embeddings() if check_head else None  # under DDP, the model's
    handle = head.register_forward_hook(lambda module, args, output: made.append(output)) if check_head else None
    try:
        with warnings.catch_warnings():
            # FSDP2 warns of views among a root's outputs (the hidden states are): an in-place op on one would skip
            # its pre-backward all-gather. They are only read here, by the fused loss.
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            output = model(**inputs, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    finally:
        if handle is not None:
            handle.remove()
    if check_head:
        local = [value.to_local() if hasattr(value, "to_local") else value for value in (output.logits, made[-1])]
        if local[0].shape != local[1].shape or not torch.equal(local[0].float(), local[1].float()):
            raise HeadTransformError(f"{type(model).__name__} changes its logits after its output layer")
    return output.hidden_states[-1]


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Contiguous decoder layers of one stage; the first `num_layers % pp_size` stages take one extra."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


def decoder_of(model: nn.Module) -> nn.Module:
    """The base model of a transformers causal LM: the module whose `base_model_pp_plan` names its parts.

    Raises ValueError when the model has no such plan or its modules do not match it.
    """
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None)
    decoder = getattr(model, "base_model", None)
    if not plan or decoder is None or decoder is model or not hasattr(model, "set_output_embeddings"):
        raise ValueError(
            f"{type(model).__name__} is not a transformers causal LM with a `base_model_pp_plan` "
            "(a decoder and an output head); meshkd splits and parallelizes models by that plan"
        )
    missing = [name for name in ("embed_tokens", "layers", "norm") if not hasattr(decoder, name)]
    if missing or "layers" not in plan or not isinstance(decoder.layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__}'s base model lacks {missing or ['a layers ModuleList']}: its pipeline plan "
            f"{sorted(plan)} does not have the embed_tokens -> layers -> norm shape meshkd splits"
        )
    return decoder


def is_tied(model: nn.Module) -> bool:
    """Whether the input embedding and the output head share one weight."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    return embedding is not None and head is not None and getattr(head, "weight", None) is embedding.weight


class _PassThrough(nn.Module):
    """Stands in for a module another stage owns: returns its first input unchanged, holds no parameters."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


def is_pass_through(module: nn.Module) -> bool:
    """Whether `module` stands in for a part another pipeline stage owns."""
    return isinstance(module, _PassThrough)


class _Recorder(_PassThrough):
    """Pass-through for the final norm on a stage before the last: keeps its input, the stage's output."""

    def __init__(self):
        super().__init__()
        self.recorded: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.recorded = hidden_states
        return hidden_states


class _ReplaceInput:
    """Forward pre-hook on the first kept layer: its hidden-state input becomes the received activation."""

    def __init__(self):
        self.hidden: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, self.hidden = self.hidden, None
        if hidden is None:
            raise RuntimeError("pipeline stage ran its first layer without a received activation")
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": hidden}
        return (hidden, *args[1:]), kwargs


class ModelStage:
    """One pipeline stage of a transformers causal LM, made in place; `run` calls the model's own forward.

    Args:
        model: a transformers causal LM whose config has a `base_model_pp_plan` (every decoder family of
            transformers 5 does).
        pp_size, pp_rank: the number of stages and this one's index.

    Attributes:
        model: the same model object, with other stages' parts replaced (parameter names unchanged).
        layers: the indices of the decoder layers this stage keeps.
        is_first, is_last.

    With tied input/output embeddings the first stage keeps the embedding and the last stage keeps the output
    head, each holding the one tensor; keeping the two copies equal is the trainer's concern.
    """

    def __init__(self, model: nn.Module, *, pp_size: int, pp_rank: int):
        decoder = decoder_of(model)
        num_layers = len(decoder.layers)
        self.layers = stage_layers(num_layers, pp_size, pp_rank)
        if not len(self.layers):
            raise ValueError(f"pp_size({pp_size}) exceeds the number of decoder layers ({num_layers})")
        self.model = model
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp_size - 1
        for index in range(num_layers):
            if index not in self.layers:
                decoder.layers[index] = _PassThrough()
        self._replace_input: _ReplaceInput | None = None
        self._recorder: _Recorder | None = None
        if not self.is_first:
            decoder.embed_tokens = None
            self._replace_input = _ReplaceInput()
            # Prepended: wrappers added later (FSDP2) must see the received activation, not the discarded one.
            decoder.layers[self.layers[0]].register_forward_pre_hook(
                self._replace_input, with_kwargs=True, prepend=True
            )
        if not self.is_last:
            self._recorder = decoder.norm = _Recorder()
            model.set_output_embeddings(_PassThrough())

    def run(self, inputs: torch.Tensor, *, hidden_states: bool = False, check_head: bool = False,
            **kwargs: Any) -> torch.Tensor:
        """The stage's output for `inputs`, through the model's own forward.

        `inputs` is input_ids [batch, sequence] on the first stage and the previous stage's hidden state
        [batch, sequence, hidden] elsewhere; `kwargs` go to the model's forward (attention_mask,
        position_ids, ...). Returns the hidden state [batch, sequence, hidden] on a stage before the last,
        else the model's logits [batch, sequence, vocab], or with `hidden_states` its last hidden states
        (`last_hidden_states`, which `check_head` passes on).
        """
        feed = {"input_ids": inputs} if self.is_first else {"inputs_embeds": inputs}
        if not self.is_first:
            self._replace_input.hidden = inputs
        try:
            if self.is_last and hidden_states:
                return last_hidden_states(self.model, check_head=check_head, **feed, **kwargs)
            output = self.model(**feed, use_cache=False, **kwargs)
        finally:
            if not self.is_first:
                self._replace_input.hidden = None
        if self.is_last:
            return output.logits
        hidden, self._recorder.recorded = self._recorder.recorded, None
        return hidden

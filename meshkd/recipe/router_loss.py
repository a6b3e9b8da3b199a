"""The load-balancing loss of an MoE student's routers, computed by the model's own function.

Design. transformers' MoE causal LMs (Qwen3-MoE, Mixtral, gpt-oss and others) compute the Switch
Transformer load-balancing loss with their module's `load_balancing_loss_func` from the routers' logits,
weighted by `config.router_aux_loss_coef`; but inside their forward only from an ordinary 0/1 attention
mask, which packed batches replace with document indices (and which the packing hook has turned into a 4D
mask by then). So `RouterLoss` records the router logits itself, with forward hooks on the router modules
the model declares (`_can_record_outputs["router_logits"]`), and calls the model's function with the mask
of real tokens. The trainer adds coef * that loss averaged over the step's micro-batches on every
data-parallel rank (the per-micro-batch mean, as transformers and Megatron take it).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn


class RouterLoss:
    """`with loss.recording(): logits = model(...)`, then `loss.value(attention_mask)`: the routers' loss."""

    def __init__(self, model: nn.Module, coefficient: float) -> None:
        recorder = getattr(model, "_can_record_outputs", {}).get("router_logits")
        function = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
        if recorder is None or function is None:
            raise ValueError(f"kd.router_aux_loss_coef is {coefficient}, but the student "
                             f"({type(model).__name__}) has no router")
        self.coefficient = coefficient
        self.function, self.index = function, recorder.index
        self.num_experts, self.top_k = model.num_experts, model.num_experts_per_tok
        self._recorded: list[torch.Tensor] | None = None
        for module in model.modules():
            if isinstance(module, recorder.target_class):
                module.register_forward_hook(self._record)

    @classmethod
    def for_student(cls, model: nn.Module, coefficient: float | None) -> RouterLoss | None:
        """The student's router loss: `coefficient`, or None for the model config's own (an MoE student's
        `router_aux_loss_coef`; no loss for a dense student). 0 turns it off."""
        if coefficient is None:
            coefficient = getattr(model.config, "router_aux_loss_coef", 0.0) if hasattr(model, "num_experts") else 0.0
        return cls(model, coefficient) if coefficient > 0 else None

    def _record(self, module: nn.Module, args, output) -> None:
        if self._recorded is not None:
            self._recorded.append(output[self.index])

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Keep the router logits of the forwards inside the block (none elsewhere: no memory held)."""
        self._recorded = []
        try:
            yield
        finally:
            self._logits, self._recorded = tuple(self._recorded), None

    def value(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """The load-balancing loss of the last recorded forward, over its real tokens (mask != 0)."""
        return self.function(self._logits, self.num_experts, self.top_k, (attention_mask != 0).long())

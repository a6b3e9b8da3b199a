"""The load-balancing loss of an MoE student's routers: the model's own loss, split over the ranks.

Design. transformers' MoE causal LMs (Qwen3-MoE, Mixtral, gpt-oss and others) compute the Switch
Transformer load-balancing loss with their module's `load_balancing_loss_func`, weighted by
`config.router_aux_loss_coef`, inside their forward from an ordinary 0/1 attention mask only (packed
batches replace it with document indices). So `RouterLoss` records the router logits itself, with forward
hooks on the router modules the model declares (`_can_record_outputs["router_logits"]`).

That loss of one micro-batch is E * sum_e (C_e / N) * (P_e / N): C_e the top-k assignments to expert e,
P_e the routing probabilities summed over the real tokens of every MoE layer, N the real tokens times the
layers. C and N only count; P alone carries the gradient. So a rank that holds some of the layers (a
pipeline stage) or some of the tokens (a context-parallel shard) adds its part as `statistics`, and
`local_loss` is E * sum_e C_e * P_e(local) / N^2 with C and N summed over every part first: the parts of
all ranks add up to the whole loss, value and gradient. Pipeline stages hand their running statistics to
the next stage beside the hidden state (the backward brings the gradient of P back the same way), and the
last stage sums C and N over the cp ranks. At construction the split is checked against the model's own
function, so a family whose loss is another one is refused, not trained with a different objective.

The trainer adds coef * that loss averaged over the step's micro-batches on every data-parallel rank (the
per-micro-batch mean, as transformers and Megatron take it).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn


class RouterLoss:
    """`with loss.recording(): model(...)`, then `loss.statistics(mask)` and `loss.local_loss(...)`.

    Statistics are one tensor [2, E + 1]: row 0 the routing probabilities summed per expert (differentiable;
    its last entry 0), row 1 the top-k assignments per expert and, last, the real tokens times the layers.
    """

    def __init__(self, model: nn.Module, coefficient: float) -> None:
        recorder = getattr(model, "_can_record_outputs", {}).get("router_logits")
        function = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
        if recorder is None or function is None:
            raise ValueError(f"kd.router_aux_loss_coef is {coefficient}, but the student "
                             f"({type(model).__name__}) has no router")
        self.coefficient = coefficient
        self.index = recorder.index
        self.num_experts, self.top_k = model.num_experts, model.num_experts_per_tok
        self._check_against(function, type(model).__name__)
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

    def statistics(self, real: torch.Tensor, logits: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """[2, E + 1] of the last recorded forward's routers (or of `logits`), over its real tokens (`real`
        [batch, sequence], nonzero where a token is real: the micro-batch's document indices)."""
        logits = self._logits if logits is None else logits
        mask = (real.reshape(-1) != 0).float()
        probabilities = torch.zeros(self.num_experts, dtype=torch.float32, device=real.device)
        counts = torch.zeros(self.num_experts + 1, dtype=torch.float32, device=real.device)
        for layer in logits:
            # As the models' function: softmax in the router's dtype, top-k of those, sums in float32.
            routing = torch.softmax(layer, dim=-1)
            chosen = torch.topk(routing, self.top_k, dim=-1).indices
            probabilities = probabilities + (routing.float() * mask.unsqueeze(-1)).sum(dim=0)
            with torch.no_grad():
                counts[: self.num_experts].scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(self.top_k))
                counts[-1] += mask.sum()
        return torch.stack([torch.cat([probabilities, probabilities.new_zeros(1)]), counts])

    def local_loss(self, statistics: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """This part's share of the micro-batch's loss; the shares of every part holding `statistics` add up
        to the loss. `group`: the ranks holding the other parts of the same layers (context parallel)."""
        counts = statistics[1].detach().clone()
        if group is not None:
            dist.all_reduce(counts, group=group)
        assignments, rows = counts[: self.num_experts], counts[-1].clamp(min=1.0)
        return self.num_experts * (assignments * statistics[0, : self.num_experts]).sum() / rows**2

    def _check_against(self, function, family: str) -> None:
        """ValueError unless the split computes the model's own loss (random router logits, some padding)."""
        generator = torch.Generator().manual_seed(0)
        logits = tuple(torch.randn(12, self.num_experts, generator=generator) for _ in range(3))
        real = torch.tensor([[1] * 9 + [0] * 3])
        ours = self.local_loss(self.statistics(real, logits))
        theirs = function(logits, self.num_experts, self.top_k, real.long())
        if not torch.allclose(ours, torch.as_tensor(theirs, dtype=ours.dtype), rtol=1e-5, atol=1e-7):
            raise ValueError(f"kd.router_aux_loss_coef is {self.coefficient}, but the router loss of {family} is "
                             f"not the Switch Transformer loss meshkd computes; set kd.router_aux_loss_coef: 0")

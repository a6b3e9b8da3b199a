"""The output layer fused with the loss: from a student's last hidden states and its output weight to the loss and
its gradients, the [tokens, vocab] logits never whole.

Design. `fused_output_loss(hidden, weight, objective, chunk_size=c)` runs c tokens at a time: their logits (hidden_c
@ weight^T, in float32 or in the compute dtype autocast would use, then float32), the loss of those tokens by
`objective` (any of `meshkd.core.loss`'s losses on a logits chunk, through their closed-form gradients), and at
once, in forward, the chunk's gradients with respect to its hidden states (g_c @ weight) and to the weight (summed:
g_c^T @ hidden_c). A rank then holds one chunk's logits and their gradient (2 c V floats), the weight's gradient (V
H) and the hidden states' (T H), instead of T V logits and T V gradients. As `meshkd.core.chunked_loss` does for the
logits, the gradients are made in forward and attached (`_AttachGrads`): nothing is recomputed in backward.


`objective(logits_chunk, tokens)` is the loss of the tokens `tokens` (a slice of the flattened positions) given
their logits [c, V]: normalized by the whole micro-batch's count, so that the chunks' losses add up to the
loss of all tokens (`chunk_answer` cuts a teacher's encoded answer the same way). The weight is the output
layer's own parameter (tied to the input embeddings or not: its gradient is added to whatever else it gets).

`meshkd train` uses it through `meshkd.recipe.student.fused_head` (`kd.fused_output_loss`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

Objective = Callable[[Tensor, slice], Tensor]


class _AttachGrads(torch.autograd.Function):
    """`loss` as a function of `hidden`, `weight` and `bias` with their precomputed (local) gradients (None: not
    asked), made the inputs' own by `layout` in backward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, loss: Tensor, layout: _Layout,
                grad_hidden: Tensor | None, grad_weight: Tensor | None, grad_bias: Tensor | None) -> Tensor:
        ctx.layout, ctx.inputs = layout, (hidden, weight, bias)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return loss.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias = ctx.inputs
        grad_hidden, grad_weight, grad_bias = (None if grad is None else grad.mul_(grad_output)
                                               for grad in ctx.saved_tensors)
        return (None if grad_hidden is None else ctx.layout.hidden_grad(hidden, grad_hidden),
                None if grad_weight is None else ctx.layout.shard_grad(weight, grad_weight),
                None if grad_bias is None else ctx.layout.shard_grad(bias, grad_bias), None, None, None, None, None)


class _Layout:
    """Where the output weight lives: a plain tensor, or a DTensor sharded over the vocabulary (a vocab-parallel
    head: Shard(0) on a mesh axis). Then each rank computes its vocabulary slice of a chunk's logits from its
    weight shard and the whole hidden states, the objective sees them as a DTensor sharded on the vocabulary
    (the losses' vocab-parallel paths), and the hidden states' gradient is the sum of the ranks' parts."""

    def __init__(self, weight: Tensor) -> None:
        self.sharded = isinstance(weight, DTensor)
        if self.sharded:
            self.mesh, self.placements, self.vocab = weight.device_mesh, weight.placements, weight.shape[0]

    @staticmethod
    def local(value: Tensor | None) -> Tensor | None:
        return value.to_local() if isinstance(value, DTensor) else value

    def logits(self, local: Tensor) -> Tensor:
        """A chunk's logits [c, this rank's vocabulary] as the objective takes them (differentiably)."""
        if not self.sharded:
            return local
        placements = [Shard(1) if placement == Shard(0) else placement for placement in self.placements]
        return DTensor.from_local(local, self.mesh, placements, run_check=False, shape=(local.shape[0], self.vocab),
                                  stride=(self.vocab, 1))

    def shard_grad(self, value: Tensor, local: Tensor) -> Tensor:
        """The gradient of the weight or bias `value` from this rank's part."""
        if not isinstance(value, DTensor):
            return local
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())

    def hidden_grad(self, hidden: Tensor, local: Tensor) -> Tensor:
        """The gradient of the hidden states from this rank's part: the parts summed over the vocabulary's ranks
        (a Partial DTensor, which the hidden states' DTensor backward reduces; all-reduced here for a plain one)."""
        if not self.sharded:
            return local
        if isinstance(hidden, DTensor):
            partial = [Partial() if placement == Shard(0) else placement for placement in self.placements]
            return DTensor.from_local(local, self.mesh, partial, run_check=False)
        for axis, placement in enumerate(self.placements):
            if placement == Shard(0):
                dist.all_reduce(local, group=self.mesh.get_group(axis))
        return local


def fused_output_loss(hidden: Tensor, weight: Tensor, objective: Objective, *, chunk_size: int = 1024,
                      bias: Tensor | None = None, compute_dtype: torch.dtype | None = None,
                      reverse: bool = False) -> Tensor:
    """The loss `objective` gives the logits `hidden @ weight^T (+ bias)`, computed `chunk_size` tokens at a time.

    Args:
        hidden: [..., H] the student's last hidden states (after its final norm); a DTensor too (gathered first).
        weight: [V, H] its output layer's weight, or a DTensor sharded over the vocabulary (a vocab-parallel
            head: the objective then gets DTensor logits sharded on the vocabulary); `bias`: [V] or None.
        objective: (logits [c, V] float32, the chunk's token slice of the flattened positions) -> that chunk's
            share of the loss, a differentiable scalar.
        chunk_size: tokens at a time (bounds the [chunk, V] temporaries).
        compute_dtype: the dtype of the logits' and hidden states' matmuls (None: float32), as autocast would
            run the output layer: each chunk's logits are made in it and handed to `objective` as float32, the
            gradients with respect to the hidden states and the weight are made from the logits' gradient rounded
            to it (the hidden states' in it; the weight's from those rounded values, accumulated over the chunks
            in float32, without a [V, H] temporary). Autocast itself is off inside.
        reverse: the chunks last to first (an objective whose chunks depend on later ones').

    Returns:
        The loss, a scalar whose gradients with respect to `hidden` and `weight` (and `bias`) are those of the
        unfused `objective(hidden @ weight^T + bias)` (in `compute_dtype`: up to its rounding).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden states of width {hidden.shape[-1]} do not fit an output weight {tuple(weight.shape)}")
    dtype, layout = compute_dtype or torch.float32, _Layout(weight)
    if isinstance(hidden, DTensor) and not all(placement.is_replicate() for placement in hidden.placements):
        hidden = hidden.redistribute(hidden.device_mesh, [Replicate()] * hidden.device_mesh.ndim)  # every position
    local_hidden = layout.local(hidden.detach())
    rows = local_hidden.reshape(-1, local_hidden.shape[-1])
    w = layout.local(weight.detach()).to(dtype)  # cast once, as autocast caches a weight's cast
    b = None if bias is None else layout.local(bias.detach()).float()
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                               or (bias is not None and bias.requires_grad))
    total = torch.zeros((), dtype=torch.float32, device=rows.device)
    # Only the gradients something asks for (a LoRA student's frozen head asks for none of its own).
    grad_hidden = torch.empty_like(rows) if needs_grad and hidden.requires_grad else None
    grad_weight = torch.zeros_like(w, dtype=torch.float32) if needs_grad and weight.requires_grad else None
    grad_bias = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if needs_grad and bias is not None \
        else None
    with torch.autocast(rows.device.type, enabled=False):
        starts = range(0, rows.shape[0], chunk_size)
        for start in reversed(starts) if reverse else starts:
            tokens = slice(start, start + chunk_size)
            chunk = rows[tokens].to(dtype)
            with torch.no_grad():
                logits = (chunk @ w.T).float()
                if b is not None:
                    logits += b
            if not needs_grad:
                with torch.no_grad():
                    total += objective(layout.logits(logits), tokens).float()
                continue
            with torch.enable_grad():
                logits.requires_grad_()
                loss = objective(layout.logits(logits), tokens)
                (grad_logits,) = torch.autograd.grad(loss, logits)
            total += loss.detach().float()
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            grad_logits = grad_logits.to(dtype)
            if grad_hidden is not None:
                grad_hidden[tokens] = (grad_logits @ w).to(rows.dtype)
            if grad_weight is not None:
                # Accumulated in place in float32: in a lower dtype, `grad_weight += grad_logits.T @ chunk` would
                # make a [V, H] product every chunk. The casts here are [c, V] and [c, H], and the products of
                # bfloat16 values are exact in float32. (torch has no CPU kernel for an `out_dtype` matmul.)
                grad_weight.addmm_(grad_logits.T.float(), chunk.float())
            del logits, grad_logits
    if not needs_grad:
        return total
    return _AttachGrads.apply(hidden, weight, bias, total, layout,
                              None if grad_hidden is None else grad_hidden.view(local_hidden.shape),
                              None if grad_weight is None else grad_weight.to(weight.dtype),
                              None if grad_bias is None else grad_bias.to(bias.dtype))


def chunk_answer(answer: dict[str, Any], tokens: slice, lead: tuple[int, ...]) -> dict[str, Any]:
    """A teacher's encoded answer (`meshkd.core.answers`: full, full_bf16 or top-k) cut to the flattened
    positions `tokens` of the positions `lead` ([batch, sequence]): every tensor field [*lead, ...] as [c, ...];
    the other fields as they are."""
    count = math.prod(lead)
    return {key: value.reshape(count, *value.shape[len(lead):])[tokens]
            if isinstance(value, Tensor) and tuple(value.shape[: len(lead)]) == tuple(lead) else value
            for key, value in answer.items()}


__all__ = ["chunk_answer", "fused_output_loss"]

"""The output layer fused with the loss: from a student's last hidden states and its output weight to the loss and
its gradients, the [tokens, vocab] logits never whole.

Design. `fused_output_loss(hidden, weight, objective, chunk_size=c)` runs c tokens at a time: their logits
(hidden_c @ weight^T, in float32), the loss of those tokens by `objective` (any of `meshkd.core.loss`'s losses on
a logits chunk, through their closed-form gradients), and at once, in forward, the chunk's gradients with
respect to its hidden states (g_c @ weight) and to the weight (summed: g_c^T @ hidden_c). A rank then holds one
chunk's logits and their gradient (2 c V floats), the weight's gradient (V H) and the hidden states' (T H),
instead of T V logits and T V gradients. As `meshkd.core.chunked_loss` does for the logits, the gradients are
made in forward and attached (`_AttachGrads`): nothing is recomputed in backward.

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
from torch import Tensor
from torch.autograd.function import once_differentiable

Objective = Callable[[Tensor, slice], Tensor]


class _AttachGrads(torch.autograd.Function):
    """`loss` as a function of `hidden` and `weight` with the precomputed gradients `grad_hidden`, `grad_weight`."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, loss: Tensor, grad_hidden: Tensor | None,
                grad_weight: Tensor | None) -> Tensor:
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return (None if grad_hidden is None else grad_hidden.mul_(grad_output),
                None if grad_weight is None else grad_weight.mul_(grad_output), None, None, None)


def fused_output_loss(hidden: Tensor, weight: Tensor, objective: Objective, *, chunk_size: int = 1024,
                      bias: Tensor | None = None) -> Tensor:
    """The loss `objective` gives the logits `hidden @ weight^T (+ bias)`, computed `chunk_size` tokens at a time.

    Args:
        hidden: [..., H] the student's last hidden states (after its final norm).
        weight: [V, H] its output layer's weight; `bias`: [V] or None.
        objective: (logits [c, V] float32, the chunk's token slice of the flattened positions) -> that chunk's
            share of the loss, a differentiable scalar.
        chunk_size: tokens at a time (bounds the [chunk, V] temporaries).

    Returns:
        The loss, a scalar whose gradients with respect to `hidden` and `weight` (and `bias`) are those of the
        unfused `objective(hidden @ weight^T + bias)`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden states of width {hidden.shape[-1]} do not fit an output weight {tuple(weight.shape)}")
    rows = hidden.detach().reshape(-1, hidden.shape[-1])
    w = weight.detach()
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                               or (bias is not None and bias.requires_grad))
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    # Only the gradients something asks for (a LoRA student's frozen head asks for none of its own).
    grad_hidden = torch.empty_like(rows) if needs_grad and hidden.requires_grad else None
    grad_weight = torch.zeros_like(w, dtype=torch.float32) if needs_grad and weight.requires_grad else None
    grad_bias = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if needs_grad and bias is not None \
        else None
    for start in range(0, rows.shape[0], chunk_size):
        tokens = slice(start, start + chunk_size)
        chunk = rows[tokens]
        with torch.no_grad():
            logits = chunk.float() @ w.float().T
            if bias is not None:
                logits += bias.detach().float()
        if not needs_grad:
            with torch.no_grad():
                total += objective(logits, tokens).float()
            continue
        with torch.enable_grad():
            logits.requires_grad_()
            loss = objective(logits, tokens)
            (grad_logits,) = torch.autograd.grad(loss, logits)
        total += loss.detach().float()
        if grad_hidden is not None:
            grad_hidden[tokens] = (grad_logits @ w.float()).to(rows.dtype)
        if grad_weight is not None:
            grad_weight.addmm_(grad_logits.T, chunk.float())
        if grad_bias is not None:
            grad_bias += grad_logits.sum(0)
        del logits, grad_logits
    if not needs_grad:
        return total
    loss = _AttachGrads.apply(hidden, weight, total, None if grad_hidden is None else grad_hidden.view(hidden.shape),
                              None if grad_weight is None else grad_weight.to(weight.dtype))
    if bias is not None:  # the bias's gradient rides on a second, zero-valued term
        loss = loss + _BiasGrad.apply(bias, grad_bias.to(bias.dtype))
    return loss


class _BiasGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias: Tensor, grad: Tensor) -> Tensor:
        ctx.save_for_backward(grad)
        return bias.new_zeros((), dtype=torch.float32)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, None]:
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_output), None


def chunk_answer(answer: dict[str, Any], tokens: slice, lead: tuple[int, ...]) -> dict[str, Any]:
    """A teacher's encoded answer (`meshkd.core.logits_codec`: full, full_bf16 or top-k) cut to the flattened
    positions `tokens` of the positions `lead` ([batch, sequence]): every tensor field [*lead, ...] as [c, ...];
    the other fields as they are."""
    count = math.prod(lead)
    return {key: value.reshape(count, *value.shape[len(lead):])[tokens]
            if isinstance(value, Tensor) and tuple(value.shape[: len(lead)]) == tuple(lead) else value
            for key, value in answer.items()}


__all__ = ["chunk_answer", "fused_output_loss"]

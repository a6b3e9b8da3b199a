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
from torch import Tensor
from torch.autograd.function import once_differentiable

Objective = Callable[[Tensor, slice], Tensor]


class _AttachGrads(torch.autograd.Function):
    """`loss` as a function of `hidden`, `weight` and `bias` with their precomputed gradients (None: not asked)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, loss: Tensor, grad_hidden: Tensor | None,
                grad_weight: Tensor | None, grad_bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return loss.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        return (*(None if grad is None else grad.mul_(grad_output) for grad in ctx.saved_tensors),
                None, None, None, None)


def fused_output_loss(hidden: Tensor, weight: Tensor, objective: Objective, *, chunk_size: int = 1024,
                      bias: Tensor | None = None, compute_dtype: torch.dtype | None = None) -> Tensor:
    """The loss `objective` gives the logits `hidden @ weight^T (+ bias)`, computed `chunk_size` tokens at a time.

    Args:
        hidden: [..., H] the student's last hidden states (after its final norm).
        weight: [V, H] its output layer's weight; `bias`: [V] or None.
        objective: (logits [c, V] float32, the chunk's token slice of the flattened positions) -> that chunk's
            share of the loss, a differentiable scalar.
        chunk_size: tokens at a time (bounds the [chunk, V] temporaries).
        compute_dtype: the dtype of the matmuls (None: float32), as autocast would run the output layer: each
            chunk's logits are made in it and handed to `objective` as float32, the gradients with respect to
            the hidden states and the weight are made in it from the logits' gradient rounded to it, and the
            weight's are summed over the chunks in float32. Autocast itself is off inside.

    Returns:
        The loss, a scalar whose gradients with respect to `hidden` and `weight` (and `bias`) are those of the
        unfused `objective(hidden @ weight^T + bias)` (in `compute_dtype`: up to its rounding).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden states of width {hidden.shape[-1]} do not fit an output weight {tuple(weight.shape)}")
    dtype = compute_dtype or torch.float32
    rows = hidden.detach().reshape(-1, hidden.shape[-1])
    w = weight.detach().to(dtype)  # cast once, as autocast caches a weight's cast
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                               or (bias is not None and bias.requires_grad))
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    # Only the gradients something asks for (a LoRA student's frozen head asks for none of its own).
    grad_hidden = torch.empty_like(rows) if needs_grad and hidden.requires_grad else None
    grad_weight = torch.zeros_like(w, dtype=torch.float32) if needs_grad and weight.requires_grad else None
    grad_bias = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if needs_grad and bias is not None \
        else None
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, rows.shape[0], chunk_size):
            tokens = slice(start, start + chunk_size)
            chunk = rows[tokens].to(dtype)
            with torch.no_grad():
                logits = (chunk @ w.T).float()
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
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            grad_logits = grad_logits.to(dtype)
            if grad_hidden is not None:
                grad_hidden[tokens] = (grad_logits @ w).to(rows.dtype)
            if grad_weight is not None:
                if dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.T, chunk)
                else:
                    grad_weight += grad_logits.T @ chunk
            del logits, grad_logits
    if not needs_grad:
        return total
    return _AttachGrads.apply(hidden, weight, bias, total,
                              None if grad_hidden is None else grad_hidden.view(hidden.shape),
                              None if grad_weight is None else grad_weight.to(weight.dtype),
                              None if grad_bias is None else grad_bias.to(bias.dtype))


def chunk_answer(answer: dict[str, Any], tokens: slice, lead: tuple[int, ...]) -> dict[str, Any]:
    """A teacher's encoded answer (`meshkd.core.logits_codec`: full, full_bf16 or top-k) cut to the flattened
    positions `tokens` of the positions `lead` ([batch, sequence]): every tensor field [*lead, ...] as [c, ...];
    the other fields as they are."""
    count = math.prod(lead)
    return {key: value.reshape(count, *value.shape[len(lead):])[tokens]
            if isinstance(value, Tensor) and tuple(value.shape[: len(lead)]) == tuple(lead) else value
            for key, value in answer.items()}


__all__ = ["chunk_answer", "fused_output_loss"]

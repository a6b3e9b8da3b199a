"""The chunked and vocab-parallel kernels behind `meshkd.core.loss`: k tokens at a time, each vocab slice local.

A kernel computes one chunk's loss sum and its gradient with respect to the student's logits in the
same pass (closed forms: T * (p_s - p_t) for KD, p_s - onehot for CE); `chunked` runs the chunks and
hands the summed loss to autograd with that gradient attached (`_AttachGrad`). On the vocab-parallel path
row maxima and sums of exponentials are combined with all-reduces over the vocab axis, so the full
vocabulary is never gathered, and every collective runs in forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

# Vocab entries per slice where a chunk's temporaries are taken column-wise (bounds them to [c, _COLUMNS]).
_COLUMNS = 8192

# (student rows [c, v], teacher rows [c, v] / a tuple of per-token fields / None, labels [c], valid [c])
#   -> (loss sum, d sum / d student)
_ChunkFn = Callable[[Tensor, Tensor | tuple[Tensor, ...] | None, Tensor, Tensor], tuple[Tensor, Tensor]]


class _AttachGrad(torch.autograd.Function):
    """Return `loss` as a function of `logits` whose gradient d loss / d logits is the precomputed `grad`.

    Why the gradient is computed in the forward pass, chunk by chunk, rather than recomputed in backward:
    the per-token gradients have closed forms (T * (p_s - p_t) for KD, p_s - onehot for CE) that fall out
    of the very softmax the forward computes, so nothing is computed twice; the teacher logits need not
    stay alive until backward (the saved gradient replaces them, at the student's dtype); and on the
    vocab-parallel path every collective runs in forward, none in backward, where its order relative to
    other ranks' collectives (FSDP's, for example) would be harder to reason about. The cost is that the
    gradient is materialised even if backward never runs, so it is skipped when no gradient is needed.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, loss: Tensor, grad: Tensor, normalizer: Tensor) -> Tensor:
        ctx.save_for_backward(grad, normalizer)
        return loss.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, None, None, None]:
        grad, normalizer = ctx.saved_tensors
        # In place, so backward holds one [tokens, vocab] buffer, not two; the token normalizer is applied
        # here, in the same pass. A second backward through the same graph (retain_graph=True) fails
        # loudly on the saved tensor's version counter.
        return grad.mul_(grad_output / normalizer), None, None, None


class TopKFields(NamedTuple):
    """A top-k answer's per-token fields, by name (`meshkd.core.answers.topk`): [..., k], [..., k], [...] and, with
    sampled tail tokens, [..., m] twice (None without)."""

    log_probs: Tensor
    indices: Tensor
    tail_log_prob: Tensor
    tail_indices: Tensor | None = None
    tail_log_probs: Tensor | None = None

    @classmethod
    def of(cls, answer: dict) -> TopKFields:
        """The fields of a top-k answer dict."""
        return cls(*(answer.get(name) for name in cls._fields))

    @property
    def sampled(self) -> bool:
        """Whether the tail is sampled (else a rest bucket)."""
        return self.tail_indices is not None

    def map(self, fn: Callable[[Tensor], Tensor]) -> TopKFields:
        """`fn` of every field present."""
        return TopKFields(*(None if field is None else fn(field) for field in self))


def chunked(
    student: Tensor,
    teacher: Tensor | TopKFields | None,
    labels: Tensor,
    ignore_index: int,
    num_valid_tokens: int | Tensor | None,
    chunk_size: int | None,
    partial_over: dist.ProcessGroup | None,
    chunk_fn: _ChunkFn,
    *,
    scale: float = 1.0,
) -> Tensor:
    """Run `chunk_fn` over token chunks of local [.., vocab] tensors; sum losses, fill the gradient.

    `partial_over`: the group whose ranks each return only their vocab slice's share of the loss sums, so
    that the total still needs summing over it (KD); None when `chunk_fn` returns complete sums (CE).
    """
    rows = student.flatten(0, -2)
    num_tokens = rows.shape[0]
    if isinstance(teacher, TopKFields):  # per-token teacher fields [..., *] of a top-k answer: rows of each
        teacher_rows = teacher.map(lambda t: t.reshape(num_tokens, *t.shape[labels.ndim :]))
    else:
        teacher_rows = None if teacher is None else teacher.flatten(0, -2)
    flat_labels = labels.reshape(-1).to(student.device)
    valid = flat_labels != ignore_index
    chunk_size = num_tokens if chunk_size is None else chunk_size
    compute_dtype = result_dtype(student) if not isinstance(teacher, Tensor) else result_dtype(student, teacher)
    normalizer = token_normalizer(num_valid_tokens, valid, compute_dtype)
    needs_grad = student.requires_grad and torch.is_grad_enabled()

    with torch.no_grad():
        total = torch.zeros((), dtype=compute_dtype, device=student.device)
        one_chunk = chunk_size >= num_tokens  # its gradient is the whole one: no copy into a buffer
        grad = torch.empty_like(rows) if needs_grad and not one_chunk else None
        for start in range(0, num_tokens, chunk_size):
            chunk = slice(start, start + chunk_size)
            if isinstance(teacher_rows, TopKFields):
                t = teacher_rows.map(lambda field, chunk=chunk: field[chunk])
            else:
                t = None if teacher_rows is None else teacher_rows[chunk]
            loss_sum, chunk_grad = chunk_fn(rows[chunk], t, flat_labels[chunk], valid[chunk])
            total += loss_sum
            if needs_grad:
                if one_chunk:
                    grad = chunk_grad.to(rows.dtype)
                else:
                    grad[chunk] = chunk_grad
        if partial_over is not None:
            # Each rank summed its vocab slice's share of every token's loss; one scalar completes them all.
            dist.all_reduce(total, group=partial_over)
        loss = total * scale / normalizer
    if not needs_grad:
        return loss
    return _AttachGrad.apply(student, loss, grad.view(student.shape), normalizer)


def kd_chunk(
    student: Tensor, teacher: Tensor, valid: Tensor, temperature: float, group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor]:
    """Local share of sum_tokens KL for one chunk [c, v], and T^2 * d KL / d student = T * (p_s - p_t).

    Two [c, v] blocks live at a time: log p_s, which becomes the gradient, and log p_t. The KL terms and
    the gradient are made block of rows by block of rows, each of about [c, _COLUMNS] entries (whole rows:
    each elementwise step is then one large operation, worth its threads), so the chunk's working memory is
    about twice its logits. On a whole vocabulary both log-softmaxes are torch's fused kernel.
    """
    log_p_s, log_p_t = _log_softmaxes(student, teacher, temperature, group)
    kl_rows = log_p_s.new_zeros(log_p_s.shape[0])
    block = max(1, log_p_s.shape[0] * _COLUMNS // max(log_p_s.shape[-1], 1))
    for start in range(0, log_p_s.shape[0], block):
        rows = slice(start, start + block)
        p_t = log_p_t[rows].exp()
        # Zero where p_t == 0 (0 log 0 = 0): the teacher's -inf logits add nothing.
        kl_rows[rows] = torch.where(p_t > 0, p_t * (log_p_t[rows] - log_p_s[rows]), 0.0).sum(-1)
        log_p_s[rows].exp_().sub_(p_t)
    grad = log_p_s if temperature == 1 else log_p_s.mul_(temperature)
    grad[~valid] = 0.0  # ignored tokens: no gradient (and no NaN from a degenerate row)
    return torch.where(valid, kl_rows, 0.0).sum(), grad


def student_weighted_chunk(
    student: Tensor, teacher: Tensor, valid: Tensor, temperature: float, group: dist.ProcessGroup | None,
    divergence: str, mix: float,
) -> tuple[Tensor, Tensor]:
    """A divergence other than forward KL for one chunk [c, v]: local loss share and T^2 * grad.

    With q the student's and p the teacher's distribution at temperature T (s = logits / T), each divergence
    D has the gradient d D / d s_v = q_v * (h_v - E_q[h]) with h = d D / d q (a constant in h cancels):
    - reverse KL(q || p): h = log q - log p;
    - JSD_beta (`mix` = beta), m = beta p + (1 - beta) q: h = (1 - beta) (log q - log m);
    - skew forward KL(p || m) (`mix` = alpha), m = alpha p + (1 - alpha) q: h = -(1 - alpha) p / m;
    - skew reverse KL(q || m) (`mix` = alpha), m = (1 - alpha) p + alpha q: h = log q - log m - alpha q / m,
      computed less its constants, as -log(1 + (1 - alpha) p / (alpha q)) - alpha (1 - alpha) (q - p) / m;
    - total variation 1/2 sum |p - q|: h = sign(q - p) / 2 (0 where they are equal).
    E_q[h] needs the whole vocabulary: one SUM all-reduce per chunk on a vocab shard. Reverse KL is infinite
    where the teacher gives a token probability 0 that the student does not.
    """
    log_q, log_p = _log_softmaxes(student, teacher, temperature, group)
    q = log_q.exp()
    if divergence == "reverse_kl":
        h = log_q - log_p
        terms = torch.where(q > 0, q * h, 0.0)
    elif divergence == "jsd":
        log_m = torch.logaddexp(log_p + math.log(mix), log_q + math.log1p(-mix))
        h = (1 - mix) * (log_q - log_m)
        p = log_p.exp()
        terms = (mix * torch.where(p > 0, p * (log_p - log_m), 0.0)
                 + (1 - mix) * torch.where(q > 0, q * (log_q - log_m), 0.0))
    elif divergence == "skew_forward_kl":
        log_m = torch.logaddexp(log_p + math.log(mix), log_q + math.log1p(-mix))
        p = log_p.exp()
        h = -(1 - mix) * (log_p - log_m).exp()
        terms = torch.where(p > 0, p * (log_p - log_m), 0.0)
    elif divergence == "skew_reverse_kl":
        log_m = torch.logaddexp(log_p + math.log1p(-mix), log_q + math.log(mix))
        # h less its constants, which h - E_q[h] would cancel, losing in float32 what is left as alpha nears 1:
        # log q - log m = -log alpha - log(1 + (1 - alpha) p / (alpha q)), alpha q / m = alpha + alpha (1 - alpha)
        # (q - p) / m.
        h = (-F.softplus(log_p - log_q + math.log((1 - mix) / mix))
             - mix * (1 - mix) * (q - log_p.exp()) * (-log_m).exp())
        terms = torch.where(q > 0, q * (log_q - log_m), 0.0)
    else:  # total variation distance
        p = log_p.exp()
        h = 0.5 * torch.sign(q - p)
        terms = 0.5 * (p - q).abs()
    h = torch.where(q > 0, h, 0.0)  # a token the student never picks adds nothing (and no inf * 0)
    expected = (q * h).sum(-1)
    if group is not None:
        dist.all_reduce(expected, group=group)
    grad = (q * (h - expected[:, None]) * temperature).masked_fill_(~valid[:, None], 0.0)
    return torch.where(valid[:, None], terms, 0.0).sum(), grad


def kd_topk_chunk(
    student: Tensor,
    teacher: TopKFields,
    valid: Tensor,
    temperature: float,
    vocab_offset: int,
    group: dist.ProcessGroup | None,
) -> tuple[Tensor, Tensor]:
    """Top-k KD for one chunk: sum over tokens of the top-k KL, and T^2 times its gradient [c, v].

    `teacher`: log_probs [c, k], indices [c, k], tail_log_prob [c] and optionally tail_indices [c, m] and
    tail_log_probs [c, m]. With s = student / T, q = softmax(s), P the teacher's top-k probabilities and
    P_rest its tail mass, d KL / d s_v = q_v * (sum P + P_rest) - P_v on the k tokens, and on the rest
    - P_rest * q_v / q_rest with a rest bucket, or - P_rest * (times v was sampled) / m with tail samples
    (sum P + P_rest is 1 up to rounding; keeping it makes the gradient exact for the value computed).
    On a vocab shard each rank reads the entries it owns; row maxima and sums (and the gathered logits
    of the k tokens and the samples) are completed with one MAX and one SUM all-reduce, so the loss comes
    out complete on every rank.
    """
    compute_dtype = result_dtype(student)
    log_p, index, tail = teacher.log_probs, teacher.indices, teacher.tail_log_prob
    sampled = teacher.sampled
    log_p, tail = log_p.to(compute_dtype), tail.to(compute_dtype)
    s = student.to(compute_dtype) / temperature
    num_rows, local_vocab = s.shape

    def local_entries(global_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(clamped local column, owned mask, the student's s there or 0) for global vocab indices [c, n]."""
        local = global_index.long().to(s.device) - vocab_offset
        owned = (local >= 0) & (local < local_vocab)  # the entry falls in this rank's vocab slice
        local = local.clamp(0, max(local_vocab - 1, 0))
        values = torch.where(owned, s.gather(-1, local), 0.0) if local_vocab else torch.zeros_like(local, dtype=s.dtype)
        return local, owned, values

    top_local, top_owned, s_top = local_entries(index)
    rows_of = [s]
    if sampled:
        sample_local, sample_owned, s_samples = local_entries(teacher.tail_indices)
        sample_log_p = teacher.tail_log_probs.to(compute_dtype)
        gathered = torch.cat([s_top, s_samples], dim=-1)
    else:
        in_top = torch.zeros_like(s)
        if local_vocab:
            # scatter_add, not scatter: clamped non-owned entries land on real columns and must add nothing.
            in_top.scatter_add_(-1, top_local, top_owned.to(s.dtype))
        rows_of.append(s.masked_fill(in_top > 0, -math.inf))  # the rest: everything but the k tokens
        gathered = s_top
    maxima = torch.stack([x.amax(-1) if local_vocab else x.new_full((num_rows,), -math.inf) for x in rows_of])
    if group is not None:
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    maxima = torch.where(maxima.isfinite(), maxima, 0.0)
    exps = [(x - m[:, None]).exp() for x, m in zip(rows_of, maxima)]
    sums = torch.cat([torch.stack([e.sum(-1) for e in exps]), gathered.T])
    if group is not None:
        dist.all_reduce(sums, group=group)
    sum_exp, gathered = sums[: len(exps)], sums[len(exps) :].T
    lse = maxima[0] + sum_exp[0].log()
    k = index.shape[-1]
    p, p_rest = log_p.exp(), tail.exp()
    top_terms = torch.where(valid[:, None] & (p > 0), p * (log_p - (gathered[:, :k] - lse[:, None])), 0.0)
    has_tail = valid & (p_rest > 0)
    if sampled:
        log_q_samples = gathered[:, k:] - lse[:, None]
        difference = torch.where(has_tail[:, None], sample_log_p - log_q_samples, 0.0)
        tail_terms = torch.where(has_tail, p_rest * difference.mean(-1), 0.0)
    else:
        log_q_rest = maxima[1] + sum_exp[1].log() - lse
        tail_terms = torch.where(has_tail, p_rest * (tail - log_q_rest), 0.0)
    loss_sum = top_terms.sum() + tail_terms.sum()

    grad = exps[0] / sum_exp[0][:, None] * (p.sum(-1) + p_rest)[:, None]
    if local_vocab:
        grad.scatter_add_(-1, top_local, -torch.where(top_owned, p, 0.0))
        if sampled:
            weight = torch.where(sample_owned, (p_rest / sample_log_p.shape[-1])[:, None], 0.0)
            grad.scatter_add_(-1, sample_local, -weight)
    if not sampled:
        # P_rest * q_v / q_rest = P_rest * exp(s_v - max_rest) / sum_rest on the rest (zero on the k tokens).
        grad -= exps[1] * torch.where(p_rest > 0, p_rest / sum_exp[1], 0.0)[:, None]
    grad = torch.where(valid[:, None], grad * temperature, 0.0)
    return loss_sum, grad


def ce_chunk(
    student: Tensor, labels: Tensor, valid: Tensor, vocab_offset: int, group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor]:
    """Sum over valid tokens of logsumexp - target logit for one chunk [c, v], and the gradient p_s - onehot."""
    logits = student.to(result_dtype(student))
    local_vocab = logits.shape[-1]
    local_labels = labels - vocab_offset
    owned = valid & (local_labels >= 0) & (local_labels < local_vocab)  # the label is in this rank's slice
    index = local_labels.clamp(0, max(local_vocab - 1, 0))[:, None]
    if local_vocab > 0:
        target = torch.where(owned, logits.gather(-1, index).squeeze(-1), 0.0)
    else:
        target = torch.zeros_like(labels, dtype=logits.dtype)
    # The target logit rides along with the sum of exponentials: one SUM all-reduce serves both.
    maxima, (sum_exp, target) = _reduced_max_and_sums([logits], [target], group)
    lse = maxima[0] + sum_exp[0].log()
    loss_sum = torch.where(valid, lse - target, 0.0).sum()
    grad = torch.where(valid[:, None], (logits - lse[:, None]).exp(), 0.0)
    if local_vocab > 0:
        grad.scatter_add_(-1, index, -owned.to(grad.dtype)[:, None])
    return loss_sum, grad


def _log_softmaxes(student: Tensor, teacher: Tensor, temperature: float,
                   group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """log softmax(x / T) [c, v] of the student's and the teacher's rows, new tensors in their common dtype.

    On a whole vocabulary torch's own fused kernel makes each in one pass over the rows; on a vocab shard
    (`group`) the row maxima and sums of both are all-reduced together (`_log_softmax_`).
    """
    compute_dtype = result_dtype(student, teacher)
    if group is None:
        return tuple(torch.log_softmax(x.to(compute_dtype) / temperature if temperature != 1 else x, -1,
                                       dtype=compute_dtype) for x in (student, teacher))
    # copy=True: the in-place steps must never write into the caller's logits.
    scaled = [x.to(compute_dtype, copy=True) for x in (student, teacher)]
    if temperature != 1:
        for x in scaled:
            x.div_(temperature)
    _log_softmax_(scaled, group)
    return scaled[0], scaled[1]


def _log_softmax_(xs: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """Log-softmax of each [c, v] tensor over its (possibly vocab-sharded) last dim, in place; two
    all-reduces in all."""
    maxima, (sum_exp,) = _reduced_max_and_sums(xs, [], group)
    lse = maxima + sum_exp.log()
    for x, row_lse in zip(xs, lse):
        x.sub_(row_lse[:, None])


def _reduced_max_and_sums(
    xs: list[Tensor], extras: list[Tensor], group: dist.ProcessGroup | None
) -> tuple[Tensor, list[Tensor]]:
    """Row maxima [k, c] of the tensors `xs` ([c, v] each) and, stacked with `extras` ([c] each) in one SUM
    all-reduce, their row sums of exp(x - max) [k, c]. Returns (maxima, [sum_exp, *extras])."""
    maxima = torch.stack([x.amax(-1) if x.shape[-1] else x.new_full(x.shape[:-1], -math.inf) for x in xs])
    if group is not None:
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    # A row that is -inf everywhere (an ignored token, say) would give NaN from -inf - -inf; shift it by 0.
    maxima = torch.where(maxima.isfinite(), maxima, 0.0)
    sum_exp = torch.stack([
        sum((x[:, i : i + _COLUMNS] - m[:, None]).exp_().sum(-1) for i in range(0, x.shape[-1], _COLUMNS))
        if x.shape[-1] else x.new_zeros(x.shape[:-1])
        for x, m in zip(xs, maxima)
    ])  # fmt: skip
    sums = torch.cat([sum_exp, *(e[None] for e in extras)])
    if group is not None:
        dist.all_reduce(sums, group=group)
    return maxima, [sums[: len(xs)], *sums[len(xs) :]]


def kl_terms(log_p_s: Tensor, log_p_t: Tensor, valid: Tensor) -> Tensor:
    """Per-entry p_t * (log p_t - log p_s) [c, v], zero where p_t == 0 (0 log 0 = 0) or the token is ignored.

    Masking p_t by `valid` first also keeps NaN out of the gradient when an ignored row is degenerate.
    """
    p_t = torch.where(valid[:, None], log_p_t.exp(), 0.0)
    return torch.where(p_t > 0, p_t * (log_p_t - log_p_s), 0.0)


def token_normalizer(num_valid_tokens: int | Tensor | None, valid: Tensor, dtype: torch.dtype) -> Tensor:
    """The divisor as a tensor, at least 1, so that a batch with no valid token gives 0, not 0 / 0."""
    if num_valid_tokens is None:
        count = valid.sum()
    elif isinstance(num_valid_tokens, Tensor):
        count = num_valid_tokens.detach().to(valid.device)
    else:
        if num_valid_tokens < 0:
            raise ValueError(f"num_valid_tokens must be >= 0, got {num_valid_tokens}")
        # Filled on the device: torch.tensor would copy the value from pageable host memory, a host sync on CUDA
        # for every chunk that calls this.
        return torch.full((), max(num_valid_tokens, 1), dtype=dtype, device=valid.device)
    return count.to(dtype).clamp_min(1)


def result_dtype(*tensors: Tensor) -> torch.dtype:
    """float32 for half-precision inputs (softmax in bf16 loses too much), float64 if any input is."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype

"""Loss: the knowledge-distillation loss, cross-entropy, and the objective that mixes them.

API:
- `kd_loss(student_logits, teacher_logits, labels, *, temperature=1.0, ignore_index=-100,
  num_valid_tokens=None, chunk_size=None)`: forward KL(p_teacher || p_student) at temperature T,
  times T^2.
- `cross_entropy_loss(student_logits, labels, *, ignore_index=-100, num_valid_tokens=None,
  chunk_size=None)`: next-token cross-entropy of the student.
- `kd_loss_encoded(student_logits, teacher, labels, ...)`: `kd_loss` against teacher logits in a
  transport encoding (`meshkd.core.logits_codec`: full, full_bf16, or top-k with a tail bucket).
- `kd_objective(ce, kd, kd_ratio)`: (1 - kd_ratio) * ce + kd_ratio * kd.

Conventions shared by both losses:
- Logits are `[batch, sequence, vocab]` or `[tokens, vocab]`; labels have the logits' shape without the
  vocab dim. Labels must already be aligned with the logits: position i of the labels is the target of
  position i of the logits. Shift them (labels[:, 1:] against logits[:, :-1]) before calling.
- Only tokens whose label is not `ignore_index` count. A loss is the SUM over those tokens divided by
  `num_valid_tokens`: pass the global number of valid tokens across gradient accumulation steps and
  data-parallel ranks so that summed micro-batch losses average correctly; it defaults to the local
  count. With no valid token the loss is exactly zero and its gradient is zero (never NaN).
- Teacher logits are constants: no gradient flows into them.
- The result is a plain 0-dim tensor in float32 (float64 if an input is float64), whatever the logits'
  dtype; on the vocab-parallel path it is identical on every rank of the vocab axis.
- The chunked and vocab-parallel paths support one backward per graph (see `_AttachGrad`).

Three paths, one value:
1. Plain (`chunk_size=None`, plain tensors): full softmax and ordinary autograd. Simple, and a reference.
2. Chunked (`chunk_size=k`): `k` tokens at a time, so forward and backward hold a few [k, vocab] float32
   blocks at a time on top of the gradient itself (see `_AttachGrad` for how).
3. Vocab-parallel: taken whenever `student_logits` is a DTensor sharded on the vocab dim (Shard(-1) on
   one mesh axis, Replicate on any other). Each rank works on its vocab slice; row maxima and sums of
   exponentials are combined with all-reduces over that axis, and the full vocabulary is never gathered.
   It is chunked over tokens too (`chunk_size=None` means one chunk). The teacher logits may be a DTensor
   on the same mesh, the matching local vocab slice, or the full-vocab tensor (sliced locally). The slice
   follows DTensor's own layout (torch.chunk semantics: vocab 10 on 4 ranks is 3, 3, 3, 1), and a rank may
   hold an empty slice. Every rank of the axis must call with the same tokens and labels.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from meshkd.core.logits_codec import check_encoded_logits

# Vocab entries per slice where a chunk's temporaries are taken column-wise (bounds them to [c, _COLUMNS]).
_COLUMNS = 8192
_TOPK_FIELDS = ("log_probs", "indices", "tail_log_prob", "tail_indices", "tail_log_probs")
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# (student rows [c, v], teacher rows [c, v] / a tuple of per-token fields / None, labels [c], valid [c])
#   -> (loss sum, d sum / d student)
_ChunkFn = Callable[[Tensor, Tensor | tuple[Tensor, ...] | None, Tensor, Tensor], tuple[Tensor, Tensor]]


def kd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    num_valid_tokens: int | Tensor | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """Distillation loss: T^2 * sum over valid tokens of KL(p_teacher,T || p_student,T) / num_valid_tokens.

    Per token, KL = sum_v p_t[v] * (log p_t[v] - log p_s[v]) with p = softmax(logits / T); vocab entries
    where p_t is zero (teacher logit -inf) contribute nothing. The T^2 factor keeps gradient magnitudes
    comparable across temperatures.

    Args:
        student_logits: [batch, sequence, vocab] or [tokens, vocab]; a DTensor sharded on the vocab dim
            selects the vocab-parallel path.
        teacher_logits: same (global) shape as `student_logits`; see the module docstring for the forms
            accepted on the vocab-parallel path.
        labels: the logits' shape without the vocab dim, aligned with the logits; only used as a mask.
        temperature: T > 0.
        ignore_index: label of tokens that do not count.
        num_valid_tokens: normaliser (global valid-token count); defaults to the local count.
        chunk_size: tokens per chunk; None computes all tokens at once.
    """
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    _check_chunk_size(chunk_size)
    _check_shapes(student_logits, labels, teacher_logits)
    labels = _full(labels)

    if isinstance(student_logits, DTensor):
        student, group, offset = _vocab_shard(student_logits)
        teacher = _matching_teacher_shard(teacher_logits, student_logits, student, offset)
        return _chunked(
            student, teacher, labels, ignore_index, num_valid_tokens, chunk_size, group,
            lambda s, t, _, valid: _kd_chunk(s, t, valid, temperature, group),
            scale=temperature**2,
        )  # fmt: skip

    # A plain student holds the full vocab already, so a sharded teacher costs nothing more gathered.
    teacher = _full(teacher_logits)
    if chunk_size is not None:
        return _chunked(
            student_logits, teacher, labels, ignore_index, num_valid_tokens, chunk_size, None,
            lambda s, t, _, valid: _kd_chunk(s, t, valid, temperature, None),
            scale=temperature**2,
        )  # fmt: skip

    compute_dtype = _compute_dtype(student_logits, teacher)
    valid = (labels != ignore_index).reshape(-1)
    log_p_s = F.log_softmax(student_logits.flatten(0, -2).to(compute_dtype) / temperature, dim=-1)
    log_p_t = F.log_softmax(teacher.detach().flatten(0, -2).to(compute_dtype) / temperature, dim=-1)
    kl = _kl_terms(log_p_s, log_p_t, valid).sum()
    return kl * temperature**2 / _normalizer(num_valid_tokens, valid, compute_dtype)


def kd_loss_encoded(
    student_logits: Tensor,
    teacher: dict,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    num_valid_tokens: int | Tensor | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """`kd_loss` against teacher logits in a transport encoding (`meshkd.core.logits_codec`).

    "full" and "full_bf16" are `kd_loss` on the logits they carry. "topk" is the KL over the teacher's k
    tokens plus its tail (a rest bucket, or sampled tail tokens; see `meshkd.core.logits_codec`), times
    T^2, with the same conventions and the same three paths as `kd_loss`: plain (autograd, the
    reference), chunked, and vocab-parallel for a student DTensor sharded on the vocab dim (each rank
    reads the entries it owns; one MAX and one SUM all-reduce per chunk, the full vocabulary never
    gathered).

    Args:
        student_logits: [batch, sequence, vocab] or [tokens, vocab], or a vocab-sharded DTensor.
        teacher: the encoding, as `send_logits` delivers it; validated against the student's global shape.
        labels, ignore_index, num_valid_tokens, chunk_size: as for `kd_loss`.
        temperature: T > 0; a "topk" encoding must have been made at the same temperature.
    """
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    mode = check_encoded_logits(teacher, student_logits.shape)
    if mode != "topk":
        return kd_loss(
            student_logits, teacher["logits"], labels, temperature=temperature, ignore_index=ignore_index,
            num_valid_tokens=num_valid_tokens, chunk_size=chunk_size,
        )  # fmt: skip
    if not math.isclose(teacher["temperature"], temperature, rel_tol=1e-9):
        raise ValueError(
            f"the topk teacher logits were encoded at temperature {teacher['temperature']}, the loss asks for "
            f"{temperature}: encode at the loss temperature"
        )
    _check_chunk_size(chunk_size)
    _check_shapes(student_logits, labels)
    labels = _full(labels)
    fields = tuple(teacher[name] for name in _TOPK_FIELDS if name in teacher)
    if isinstance(student_logits, DTensor):
        student, group, offset = _vocab_shard(student_logits)
        return _chunked(
            student, fields, labels, ignore_index, num_valid_tokens, chunk_size, None,
            lambda s, t, _, valid: _kd_topk_chunk(s, t, valid, temperature, offset, group),
            scale=temperature**2,
        )  # fmt: skip
    if chunk_size is not None:
        return _chunked(
            student_logits, fields, labels, ignore_index, num_valid_tokens, chunk_size, None,
            lambda s, t, _, valid: _kd_topk_chunk(s, t, valid, temperature, 0, None),
            scale=temperature**2,
        )  # fmt: skip

    # The plain path: the formula with autograd, the reference for the other two.
    compute_dtype = _compute_dtype(student_logits)
    valid = (labels != ignore_index).reshape(-1)
    vocab, k = student_logits.shape[-1], fields[0].shape[-1]
    log_p = fields[0].reshape(-1, k).to(compute_dtype)
    index = fields[1].reshape(-1, k).long().to(student_logits.device)
    tail = fields[2].reshape(-1).to(compute_dtype)
    log_q = F.log_softmax(student_logits.flatten(0, -2).to(compute_dtype) / temperature, dim=-1)
    p, p_rest = log_p.exp(), tail.exp()
    top_terms = torch.where(valid[:, None] & (p > 0), p * (log_p - log_q.gather(-1, index)), 0.0)
    has_tail = valid & (p_rest > 0)
    if len(fields) == 5:  # sampled tail: P_rest * mean over samples of (log p_t - log q)
        m = fields[3].shape[-1]
        sample_index = fields[3].reshape(-1, m).long().to(student_logits.device)
        sample_log_p = fields[4].reshape(-1, m).to(compute_dtype)
        difference = torch.where(has_tail[:, None], sample_log_p - log_q.gather(-1, sample_index), 0.0)
        tail_terms = torch.where(has_tail, p_rest * difference.mean(-1), 0.0)
    else:  # rest bucket: P_rest * (log P_rest - log q_rest)
        if k < vocab:
            log_q_rest = log_q.scatter(-1, index, -math.inf).logsumexp(-1)
        else:  # no rest (the teacher's tail is empty too); logsumexp over nothing has a NaN gradient
            log_q_rest = torch.full_like(tail, -math.inf)
        tail_terms = torch.where(has_tail, p_rest * (tail - log_q_rest), 0.0)
    kl = top_terms.sum() + tail_terms.sum()
    return kl * temperature**2 / _normalizer(num_valid_tokens, valid, compute_dtype)


def cross_entropy_loss(
    student_logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    num_valid_tokens: int | Tensor | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """Cross-entropy: sum over valid tokens of -log p_student[label] / num_valid_tokens.

    Same conventions and paths as `kd_loss` (a DTensor student sharded on the vocab dim is vocab-parallel:
    each rank contributes the target logit only where the label falls in its slice). Valid labels must
    lie in [0, vocab); the vocab-parallel path cannot check that without a device sync, so it does not.
    """
    _check_chunk_size(chunk_size)
    _check_shapes(student_logits, labels)
    labels = _full(labels)

    if isinstance(student_logits, DTensor):
        student, group, offset = _vocab_shard(student_logits)
        return _chunked(
            student, None, labels, ignore_index, num_valid_tokens, chunk_size, None,
            lambda s, _, y, valid: _ce_chunk(s, y, valid, offset, group),
        )  # fmt: skip
    if chunk_size is not None:
        return _chunked(
            student_logits, None, labels, ignore_index, num_valid_tokens, chunk_size, None,
            lambda s, _, y, valid: _ce_chunk(s, y, valid, 0, None),
        )  # fmt: skip

    compute_dtype = _compute_dtype(student_logits)
    flat_labels = labels.reshape(-1)
    valid = flat_labels != ignore_index
    ce = F.cross_entropy(
        student_logits.flatten(0, -2).to(compute_dtype), flat_labels, ignore_index=ignore_index, reduction="sum"
    )
    return ce / _normalizer(num_valid_tokens, valid, compute_dtype)


def kd_objective(ce: Tensor | None, kd: Tensor | None, kd_ratio: float) -> Tensor:
    """The training objective (1 - kd_ratio) * ce + kd_ratio * kd, with kd_ratio in [0, 1].

    A term whose weight is zero is skipped (it may be None, and a non-finite value there cannot leak into
    the objective): kd_ratio >= 1 returns `kd` alone, kd_ratio == 0 returns `ce` alone, so a pure-KD run
    need not compute the cross-entropy at all.
    """
    if not 0.0 <= kd_ratio <= 1.0:
        raise ValueError(f"kd_ratio must lie in [0, 1], got {kd_ratio}")
    if kd_ratio > 0 and kd is None:
        raise ValueError(f"kd is required when kd_ratio > 0 (got kd_ratio={kd_ratio})")
    if kd_ratio < 1 and ce is None:
        raise ValueError(f"ce is required when kd_ratio < 1 (got kd_ratio={kd_ratio})")
    if kd_ratio >= 1:
        return kd
    if kd_ratio == 0:
        return ce
    return (1.0 - kd_ratio) * ce + kd_ratio * kd


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
    def forward(ctx, logits: Tensor, loss: Tensor, grad: Tensor) -> Tensor:
        ctx.save_for_backward(grad)
        return loss.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, None, None]:
        (grad,) = ctx.saved_tensors
        # In place, so backward holds one [tokens, vocab] buffer, not two. A second backward through the
        # same graph (retain_graph=True) fails loudly on the saved tensor's version counter.
        return grad.mul_(grad_output), None, None


def _chunked(
    student: Tensor,
    teacher: Tensor | tuple[Tensor, ...] | None,
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
    if isinstance(teacher, tuple):  # per-token teacher fields [..., *] of an encoding: rows of each
        teacher_rows = tuple(t.reshape(num_tokens, *t.shape[labels.ndim :]) for t in teacher)
    else:
        teacher_rows = None if teacher is None else teacher.flatten(0, -2)
    flat_labels = labels.reshape(-1).to(student.device)
    valid = flat_labels != ignore_index
    chunk_size = num_tokens if chunk_size is None else chunk_size
    compute_dtype = _compute_dtype(student) if not isinstance(teacher, Tensor) else _compute_dtype(student, teacher)
    normalizer = _normalizer(num_valid_tokens, valid, compute_dtype)
    needs_grad = student.requires_grad and torch.is_grad_enabled()

    with torch.no_grad():
        total = torch.zeros((), dtype=compute_dtype, device=student.device)
        grad = torch.empty_like(rows) if needs_grad else None
        for start in range(0, num_tokens, chunk_size):
            chunk = slice(start, start + chunk_size)
            if isinstance(teacher_rows, tuple):
                t = tuple(field[chunk] for field in teacher_rows)
            else:
                t = None if teacher_rows is None else teacher_rows[chunk]
            loss_sum, chunk_grad = chunk_fn(rows[chunk], t, flat_labels[chunk], valid[chunk])
            total += loss_sum
            if grad is not None:
                grad[chunk] = chunk_grad.div_(normalizer)
        if partial_over is not None:
            # Each rank summed its vocab slice's share of every token's loss; one scalar completes them all.
            dist.all_reduce(total, group=partial_over)
        loss = total * scale / normalizer
    if grad is None:
        return loss
    return _AttachGrad.apply(student, loss, grad.view(student.shape))


def _kd_chunk(
    student: Tensor, teacher: Tensor, valid: Tensor, temperature: float, group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor]:
    """Local share of sum_tokens KL for one chunk [c, v], and T^2 * d KL / d student = T * (p_s - p_t).

    Two [c, v] blocks live at a time: log p_s, which becomes the gradient, and log p_t, which becomes p_t.
    Everything else is done in slices of `_COLUMNS` vocab entries, so the chunk's working memory is about
    twice its logits.
    """
    compute_dtype = _compute_dtype(student, teacher)
    # copy=True: the in-place steps below must never write into the caller's logits.
    log_p_s = student.to(compute_dtype, copy=True).div_(temperature)
    log_p_t = teacher.to(compute_dtype, copy=True).div_(temperature)
    _log_softmax_([log_p_s, log_p_t], group)
    invalid = ~valid[:, None]
    kl_sum = log_p_s.new_zeros(())
    for start in range(0, log_p_s.shape[-1], _COLUMNS):
        columns = slice(start, start + _COLUMNS)
        p_t = log_p_t[:, columns].exp().masked_fill_(invalid, 0.0)
        # Zero where p_t == 0 (0 log 0 = 0), which also clears an ignored row's NaN.
        kl_sum += torch.where(p_t > 0, p_t * (log_p_t[:, columns] - log_p_s[:, columns]), 0.0).sum()
    p_t = log_p_t.exp_().masked_fill_(invalid, 0.0)
    grad = log_p_s.exp_().sub_(p_t).mul_(temperature).masked_fill_(invalid, 0.0)
    return kl_sum, grad


def _kd_topk_chunk(
    student: Tensor,
    teacher: tuple[Tensor, ...],
    valid: Tensor,
    temperature: float,
    vocab_offset: int,
    group: dist.ProcessGroup | None,
) -> tuple[Tensor, Tensor]:
    """Top-k KD for one chunk: sum over tokens of the top-k KL, and T^2 times its gradient [c, v].

    `teacher`: (log_probs [c, k], indices [c, k], tail_log_prob [c]) and optionally (tail_indices [c, m],
    tail_log_probs [c, m]). With s = student / T, q = softmax(s), P the teacher's top-k probabilities and
    P_rest its tail mass, d KL / d s_v = q_v * (sum P + P_rest) - P_v on the k tokens, and on the rest
    - P_rest * q_v / q_rest with a rest bucket, or - P_rest * (times v was sampled) / m with tail samples
    (sum P + P_rest is 1 up to rounding; keeping it makes the gradient exact for the value computed).
    On a vocab shard each rank reads the entries it owns; row maxima and sums (and the gathered logits
    of the k tokens and the samples) are completed with one MAX and one SUM all-reduce, so the loss comes
    out complete on every rank.
    """
    compute_dtype = _compute_dtype(student)
    log_p, index, tail = teacher[:3]
    sampled = len(teacher) == 5
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
        sample_local, sample_owned, s_samples = local_entries(teacher[3])
        sample_log_p = teacher[4].to(compute_dtype)
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


def _ce_chunk(
    student: Tensor, labels: Tensor, valid: Tensor, vocab_offset: int, group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor]:
    """Sum over valid tokens of logsumexp - target logit for one chunk [c, v], and the gradient p_s - onehot."""
    logits = student.to(_compute_dtype(student))
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


def _kl_terms(log_p_s: Tensor, log_p_t: Tensor, valid: Tensor) -> Tensor:
    """Per-entry p_t * (log p_t - log p_s) [c, v], zero where p_t == 0 (0 log 0 = 0) or the token is ignored.

    Masking p_t by `valid` first also keeps NaN out of the gradient when an ignored row is degenerate.
    """
    p_t = torch.where(valid[:, None], log_p_t.exp(), 0.0)
    return torch.where(p_t > 0, p_t * (log_p_t - log_p_s), 0.0)


def _normalizer(num_valid_tokens: int | Tensor | None, valid: Tensor, dtype: torch.dtype) -> Tensor:
    """The divisor as a tensor, at least 1, so that a batch with no valid token gives 0, not 0 / 0."""
    if num_valid_tokens is None:
        count = valid.sum()
    elif isinstance(num_valid_tokens, Tensor):
        count = num_valid_tokens.detach().to(valid.device)
    else:
        if num_valid_tokens < 0:
            raise ValueError(f"num_valid_tokens must be >= 0, got {num_valid_tokens}")
        count = torch.tensor(num_valid_tokens, device=valid.device)
    return count.to(dtype).clamp_min(1)


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float32 for half-precision inputs (softmax in bf16 loses too much), float64 if any input is."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _vocab_shard(logits: DTensor) -> tuple[Tensor, dist.ProcessGroup, int]:
    """Local vocab slice, the process group of the sharded mesh axis, and the slice's global vocab offset."""
    vocab_dim = logits.ndim - 1
    placements = tuple(logits.placements)
    shard_axes = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim % logits.ndim == vocab_dim]
    others_replicated = all(isinstance(p, Replicate) for i, p in enumerate(placements) if i not in shard_axes)
    if len(shard_axes) != 1 or not others_replicated:
        raise ValueError(
            "the vocab-parallel loss needs student_logits sharded on the vocab dim (Shard(-1)) on exactly one "
            f"mesh axis and replicated on any other, got placements {placements}"
        )
    _, offsets = compute_local_shape_and_global_offset(logits.shape, logits.device_mesh, placements)
    return logits.to_local(), logits.device_mesh.get_group(shard_axes[0]), offsets[vocab_dim]


def _matching_teacher_shard(teacher: Tensor, student: DTensor, student_local: Tensor, offset: int) -> Tensor:
    """The teacher's vocab slice matching the student's local slice, never gathering the full vocab."""
    if isinstance(teacher, DTensor):
        if teacher.device_mesh != student.device_mesh:
            raise ValueError("teacher_logits is a DTensor on a different mesh than student_logits")
        # Same placements: no-op; Replicate -> Shard: a local slice, no communication.
        return teacher.redistribute(student.device_mesh, student.placements).to_local()
    if teacher.shape == student_local.shape:
        return teacher
    if teacher.shape == student.shape:
        return teacher.narrow(-1, offset, student_local.shape[-1])
    raise ValueError(
        f"teacher_logits shape {tuple(teacher.shape)} matches neither the student's global shape "
        f"{tuple(student.shape)} nor its local vocab slice {tuple(student_local.shape)}"
    )


def _full(tensor: Tensor) -> Tensor:
    """A plain tensor from a DTensor (labels, or a teacher next to a full-vocab student)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _check_chunk_size(chunk_size: int | None) -> None:
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens or None, got {chunk_size}")


def _check_shapes(student: Tensor, labels: Tensor, teacher: Tensor | None = None) -> None:
    """Shapes are checked on global shapes (a DTensor's .shape is global), before any collective."""
    if student.ndim not in (2, 3):
        raise ValueError(
            f"student_logits must be [batch, sequence, vocab] or [tokens, vocab], got shape {tuple(student.shape)}"
        )
    # A plain teacher next to a DTensor student may be the local vocab slice: `_matching_teacher_shard`.
    full_shape_expected = isinstance(teacher, DTensor) or not isinstance(student, DTensor)
    if teacher is not None and full_shape_expected and teacher.shape != student.shape:
        raise ValueError(
            f"teacher_logits shape {tuple(teacher.shape)} does not match student_logits shape {tuple(student.shape)}"
        )
    if labels.shape != student.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must be student_logits shape {tuple(student.shape)} without the "
            f"vocab dim, i.e. {tuple(student.shape[:-1])}"
        )

"""Loss: the knowledge-distillation loss, cross-entropy, and the objective that mixes them.

API:
- `kd_loss(student_logits, teacher_logits, labels, *, temperature=1.0, ignore_index=-100,
  num_valid_tokens=None, chunk_size=None, divergence="forward_kl", jsd_beta=0.5, skew_alpha=0.1)`: a
  divergence between teacher and student at temperature T, times T^2: forward KL(p_t || p_s) (the
  default), reverse KL(p_s || p_t), the generalized Jensen-Shannon divergence of GKD (Agarwal et al.
  2024), JSD_beta = beta * KL(p_t || m) + (1 - beta) * KL(p_s || m) with m = beta * p_t + (1 - beta) * p_s,
  DistiLLM's skew KL divergences (Ko et al. 2024, "DistiLLM: Towards Streamlined Distillation for Large
  Language Models", eq. 2 and 3): skew forward KL(p_t || alpha * p_t + (1 - alpha) * p_s) and skew reverse
  KL(p_s || (1 - alpha) * p_t + alpha * p_s), and the total variation distance 1/2 * sum |p_t - p_s|.
- `cross_entropy_loss(student_logits, labels, *, ignore_index=-100, num_valid_tokens=None,
  chunk_size=None)`: next-token cross-entropy of the student.
- `kd_loss_topk(student_logits, teacher, labels, ...)`: forward KL against a top-k answer with its tail
  (`meshkd.core.answers.topk`), its fields read by name (`meshkd.core.chunked_loss.TopKFields`).
- `kd_objective(ce, kd, kd_ratio)`: (1 - kd_ratio) * ce + kd_ratio * kd.
- `top1_agreements(student_logits, teacher_top, labels, *, ignore_index=-100)`: how many valid positions have
  the teacher's likeliest token as the student's likeliest (an evaluation figure, no gradient).

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
- The chunked and vocab-parallel paths support one backward per graph (see `meshkd.core.chunked_loss`).

Three paths, one value:
1. Plain (`chunk_size=None`, plain tensors): full softmax and ordinary autograd. Simple, and a reference.
2. Chunked (`chunk_size=k`): `k` tokens at a time, so forward and backward hold a few [k, vocab] float32
   blocks at a time on top of the gradient itself (see `meshkd.core.chunked_loss` for how).
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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshkd.core.chunked_loss import (
    TopKFields,
    ce_chunk,
    chunked,
    kd_chunk,
    kd_topk_chunk,
    kl_terms,
    result_dtype,
    student_weighted_chunk,
    token_normalizer,
)

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "skew_forward_kl", "skew_reverse_kl", "tvd")


def kd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    num_valid_tokens: int | Tensor | None = None,
    chunk_size: int | None = None,
    divergence: str = "forward_kl",
    jsd_beta: float = 0.5,
    skew_alpha: float = 0.1,
) -> Tensor:
    """Distillation loss: T^2 * sum over valid tokens of D(p_teacher,T, p_student,T) / num_valid_tokens.

    Per token, forward KL = sum_v p_t[v] * (log p_t[v] - log p_s[v]) with p = softmax(logits / T); vocab
    entries where p_t is zero (teacher logit -inf) contribute nothing. Reverse KL swaps the roles (entries
    where p_s is zero contribute nothing; one where p_t is zero and p_s is not makes it infinite). JSD_beta
    (see the module docstring) is finite everywhere and needs beta strictly inside (0, 1). The T^2 factor
    keeps gradient magnitudes comparable across temperatures.

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
        divergence: one of `DIVERGENCES`.
        jsd_beta: beta of "jsd", in (0, 1).
        skew_alpha: alpha of "skew_forward_kl" and "skew_reverse_kl", in (0, 1) (DistiLLM's default 0.1).
    """
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    check_divergence(divergence, jsd_beta, skew_alpha=skew_alpha)
    _check_chunk_size(chunk_size)
    _check_shapes(student_logits, labels, teacher_logits)
    labels = _full(labels)
    mix = jsd_beta if divergence == "jsd" else skew_alpha

    def chunk_fn(group):
        if divergence == "forward_kl":
            return lambda s, t, _, valid: kd_chunk(s, t, valid, temperature, group)
        return lambda s, t, _, valid: student_weighted_chunk(s, t, valid, temperature, group, divergence, mix)

    if isinstance(student_logits, DTensor):
        student, group, offset = _vocab_shard(student_logits)
        teacher = _matching_teacher_shard(teacher_logits, student_logits, student, offset)
        return chunked(student, teacher, labels, ignore_index, num_valid_tokens, chunk_size, group,
                       chunk_fn(group), scale=temperature**2)

    # A plain student holds the full vocab already, so a sharded teacher costs nothing more gathered.
    teacher = _full(teacher_logits)
    if chunk_size is not None:
        return chunked(student_logits, teacher, labels, ignore_index, num_valid_tokens, chunk_size, None,
                       chunk_fn(None), scale=temperature**2)

    # The plain path: the formulas with autograd, the reference for the other two.
    compute_dtype = result_dtype(student_logits, teacher)
    valid = (labels != ignore_index).reshape(-1)
    log_p_s = F.log_softmax(student_logits.flatten(0, -2).to(compute_dtype) / temperature, dim=-1)
    log_p_t = F.log_softmax(teacher.detach().flatten(0, -2).to(compute_dtype) / temperature, dim=-1)
    if divergence == "forward_kl":
        terms = kl_terms(log_p_s, log_p_t, valid)
    elif divergence == "reverse_kl":
        terms = kl_terms(log_p_t, log_p_s, valid)
    elif divergence == "jsd":
        log_m = torch.logaddexp(log_p_t + math.log(jsd_beta), log_p_s + math.log1p(-jsd_beta))
        terms = jsd_beta * kl_terms(log_m, log_p_t, valid) + (1 - jsd_beta) * kl_terms(log_m, log_p_s, valid)
    elif divergence == "skew_forward_kl":
        terms = kl_terms(torch.logaddexp(log_p_t + math.log(skew_alpha), log_p_s + math.log1p(-skew_alpha)),
                         log_p_t, valid)
    elif divergence == "skew_reverse_kl":
        terms = kl_terms(torch.logaddexp(log_p_t + math.log1p(-skew_alpha), log_p_s + math.log(skew_alpha)),
                         log_p_s, valid)
    else:
        terms = torch.where(valid[:, None], 0.5 * (log_p_t.exp() - log_p_s.exp()).abs(), 0.0)
    return terms.sum() * temperature**2 / token_normalizer(num_valid_tokens, valid, compute_dtype)


def check_divergence(divergence: str, jsd_beta: float, *, skew_alpha: float = 0.1) -> None:
    """ValueError for an unknown divergence, or a JSD beta or skew alpha outside (0, 1). (Which divergences a
    kind of answer carries: `Distribution.check_divergence`.)"""
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if divergence == "jsd" and not 0.0 < jsd_beta < 1.0:
        raise ValueError(f"jsd_beta must lie strictly between 0 and 1, got {jsd_beta} (JSD_0 and JSD_1 are 0; "
                         "use forward_kl or reverse_kl)")
    if divergence.startswith("skew_") and not 0.0 < skew_alpha < 1.0:
        raise ValueError(f"skew_alpha must lie strictly between 0 and 1, got {skew_alpha} (alpha 0 is the plain "
                         "KL, alpha 1 gives 0)")


def kd_loss_topk(
    student_logits: Tensor,
    teacher: dict,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    num_valid_tokens: int | Tensor | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """Forward KL against a checked top-k answer (`meshkd.core.answers.topk`): the KL over the teacher's k
    tokens plus its tail (a rest bucket, or sampled tail tokens), times T^2, with the same conventions and the
    same three paths as `kd_loss`: plain (autograd, the reference), chunked, and vocab-parallel for a student
    DTensor sharded on the vocab dim (each rank reads the entries it owns; one MAX and one SUM all-reduce per
    chunk, the full vocabulary never gathered). The chunked and vocab-parallel paths read only indices in
    range, so wrong indices give a wrong value, never an out-of-bounds read.

    Args:
        student_logits: [batch, sequence, vocab] or [tokens, vocab], or a vocab-sharded DTensor.
        teacher: the answer, its fields checked (`meshkd.core.answers.topk.TopK.check`).
        labels, ignore_index, num_valid_tokens, chunk_size: as for `kd_loss`.
        temperature: T > 0, the temperature the answer was made at.
    """
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    if not math.isclose(teacher["temperature"], temperature, rel_tol=1e-9):
        raise ValueError(
            f"the topk teacher logits were encoded at temperature {teacher['temperature']}, the loss asks for "
            f"{temperature}: encode at the loss temperature"
        )
    _check_chunk_size(chunk_size)
    _check_shapes(student_logits, labels)
    labels = _full(labels)
    fields = TopKFields.of(teacher)
    if isinstance(student_logits, DTensor):
        student, group, offset = _vocab_shard(student_logits)
        return chunked(
            student, fields, labels, ignore_index, num_valid_tokens, chunk_size, None,
            lambda s, t, _, valid: kd_topk_chunk(s, t, valid, temperature, offset, group),
            scale=temperature**2,
        )  # fmt: skip
    if chunk_size is not None:
        return chunked(
            student_logits, fields, labels, ignore_index, num_valid_tokens, chunk_size, None,
            lambda s, t, _, valid: kd_topk_chunk(s, t, valid, temperature, 0, None),
            scale=temperature**2,
        )  # fmt: skip

    # The plain path: the formula with autograd, the reference for the other two.
    compute_dtype = result_dtype(student_logits)
    valid = (labels != ignore_index).reshape(-1)
    vocab, k = student_logits.shape[-1], fields.log_probs.shape[-1]
    log_p = fields.log_probs.reshape(-1, k).to(compute_dtype)
    index = fields.indices.reshape(-1, k).long().to(student_logits.device)
    tail = fields.tail_log_prob.reshape(-1).to(compute_dtype)
    log_q = F.log_softmax(student_logits.flatten(0, -2).to(compute_dtype) / temperature, dim=-1)
    p, p_rest = log_p.exp(), tail.exp()
    top_terms = torch.where(valid[:, None] & (p > 0), p * (log_p - log_q.gather(-1, index)), 0.0)
    has_tail = valid & (p_rest > 0)
    if fields.sampled:  # sampled tail: P_rest * mean over samples of (log p_t - log q)
        m = fields.tail_indices.shape[-1]
        sample_index = fields.tail_indices.reshape(-1, m).long().to(student_logits.device)
        sample_log_p = fields.tail_log_probs.reshape(-1, m).to(compute_dtype)
        difference = torch.where(has_tail[:, None], sample_log_p - log_q.gather(-1, sample_index), 0.0)
        tail_terms = torch.where(has_tail, p_rest * difference.mean(-1), 0.0)
    else:  # rest bucket: P_rest * (log P_rest - log q_rest)
        if k < vocab:
            log_q_rest = log_q.scatter(-1, index, -math.inf).logsumexp(-1)
        else:  # no rest (the teacher's tail is empty too); logsumexp over nothing has a NaN gradient
            log_q_rest = torch.full_like(tail, -math.inf)
        tail_terms = torch.where(has_tail, p_rest * (tail - log_q_rest), 0.0)
    kl = top_terms.sum() + tail_terms.sum()
    return kl * temperature**2 / token_normalizer(num_valid_tokens, valid, compute_dtype)


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
        return chunked(
            student, None, labels, ignore_index, num_valid_tokens, chunk_size, None,
            lambda s, _, y, valid: ce_chunk(s, y, valid, offset, group),
        )  # fmt: skip
    if chunk_size is not None:
        return chunked(
            student_logits, None, labels, ignore_index, num_valid_tokens, chunk_size, None,
            lambda s, _, y, valid: ce_chunk(s, y, valid, 0, None),
        )  # fmt: skip

    compute_dtype = result_dtype(student_logits)
    flat_labels = labels.reshape(-1)
    valid = flat_labels != ignore_index
    ce = F.cross_entropy(
        student_logits.flatten(0, -2).to(compute_dtype), flat_labels, ignore_index=ignore_index, reduction="sum"
    )
    return ce / token_normalizer(num_valid_tokens, valid, compute_dtype)


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


def top1_agreements(student_logits: Tensor, teacher_top: Tensor, labels: Tensor, *, ignore_index: int = -100) -> Tensor:
    """How many valid positions have the teacher's likeliest token as the student's likeliest too (0-dim int64).

    A position agrees when the student's logit at `teacher_top` is its largest (ties with another token
    count as agreement: the teacher's choice is then one of the student's argmaxes). A DTensor student
    sharded on the vocab dim compares per vocab slice and combines with two MAX all-reduces over that
    axis; the full vocabulary is never gathered.

    Args:
        student_logits: [batch, sequence, vocab] or [tokens, vocab], or a vocab-sharded DTensor.
        teacher_top: the teacher's likeliest token per position, the logits' shape without the vocab dim.
        labels: same shape; positions holding `ignore_index` do not count.
    """
    _check_shapes(student_logits, labels)
    labels, teacher_top = _full(labels), _full(teacher_top).long()
    valid = labels != ignore_index
    if isinstance(student_logits, DTensor):
        local, group, offset = _vocab_shard(student_logits)
        index = teacher_top.to(local.device) - offset
        inside = (index >= 0) & (index < local.shape[-1])
        if local.shape[-1]:  # a rank may hold an empty vocab slice
            best = local.amax(-1).float()
            at = torch.where(inside, local.gather(-1, index.clamp(0, local.shape[-1] - 1)[..., None])[..., 0].float(),
                             -math.inf)
        else:
            best = at = torch.full(index.shape, -math.inf, device=local.device)
        both = torch.stack([best, at])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        best, at = both[0], both[1]
    else:
        best = student_logits.amax(-1)
        at = student_logits.gather(-1, teacher_top.to(student_logits.device)[..., None])[..., 0]
    return ((at >= best) & valid.to(best.device)).sum()


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

"""The teacher's log-probability of each label, "label_log_probs" (4 bytes a token): what an evaluation of the
teacher's loss asks for, and what on-policy distillation with the reverse KL estimated on the student's own sampled
tokens trains against (`kd.divergence: sampled_reverse_kl`), whatever serves the teacher (in the job, served, a
vLLM completions endpoint's `prompt_logprobs`).

The sampled estimate. The student samples x_t from its own distribution pi_s; the reverse KL of a position is
E_{x ~ pi_s}[log pi_s(x) - log pi_t(x)], estimated at the sampled token by (`kd.sampled_estimator`)

    k1 = log pi_s(x_t) - log pi_t(x_t)        unbiased; trained by its score-function gradient, the per-token
                                              advantage -(k1) of the on-policy distillation references:
                                              d/dtheta = k1 * d log pi_s(x_t) / dtheta (k1 taken as a constant)
    k3 = r - 1 - log r, r = pi_t(x_t) / pi_s(x_t)   unbiased and never negative, lower variance; trained by its own
                                              (pathwise) gradient, d k3 / d log pi_s(x_t) = 1 - r

summed over the completion's tokens (its labels: prompt and padding never count) and divided by the step's valid
tokens as every KD term is. The value reported as `kd_loss` is the estimate itself. Both distributions at
temperature 1 (the student sampled at its generation temperature; the estimate is of the KL it trains).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from meshkd.core.answers.base import TeacherAnswer, merged_rows, register
from meshkd.core.answers.distribution import LABEL_LOG_PROBS, label_log_probs
from meshkd.core.batch_keys import kd_labels, teacher_side
from meshkd.core.chunked_loss import token_normalizer

SAMPLED_REVERSE_KL = "sampled_reverse_kl"
"""The `kd.divergence` estimated on the sampled tokens, against this kind of answer."""
ESTIMATORS = ("k1", "k3")
"""The values of `kd.sampled_estimator`."""


@register
class LabelLogProbs(TeacherAnswer):
    """The teacher's log-probability of each label ("log_probs" [rows, sequence], 0 at ignored labels)."""

    name = LABEL_LOG_PROBS

    @classmethod
    def made_for(cls, transport, kd):
        return transport == cls.name

    @classmethod
    def encode(cls, logits, batch, context, *, with_label_log_probs=False):
        """Of the labels of the teacher's own tokenization (`teacher_side`)."""
        return label_log_probs(logits, teacher_side(batch)["labels"], ignore_index=context.kd.ignore_index)

    def label_log_probs(self) -> torch.Tensor:
        return self.wire["log_probs"]

    @property
    def rows(self) -> int:
        """The rows the answer covers (a routed teacher's: its own only)."""
        return self.wire["log_probs"].shape[0]

    def kd_loss(self, logits, micro_batch, context, *, norm):
        """The reverse KL estimated on the sampled tokens (the module docstring) of the micro-batch."""
        return self.divergence(logits, micro_batch, context, norm=norm), {}

    def chunk_kd_loss(self, logits, tokens, micro_batch, context, *, norm):
        """`kd_loss`' share of the flattened positions `tokens`, given their logits [c, vocab]."""
        return self.chunk_divergence(logits, tokens, micro_batch, context, norm=norm), {}

    def divergence(self, logits: torch.Tensor, micro_batch: dict, context, *, norm,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """The estimate at the labels KD counts; `rows`: a bool [rows] mask, the others do not count (several
        teachers routed per row, `meshkd.core.combinations.route`)."""
        kd = context.kd
        return sampled_reverse_kl(logits, kd_labels(micro_batch, kd.ignore_index, rows), self.wire["log_probs"],
                                  estimator=kd.sampled_estimator, norm=norm, ignore_index=kd.ignore_index)

    def chunk_divergence(self, logits: torch.Tensor, tokens: slice, micro_batch: dict, context, *, norm,
                         rows: torch.Tensor | None = None) -> torch.Tensor:
        """`divergence`'s share of the flattened positions `tokens`, given their logits [c, vocab]."""
        kd = context.kd
        labels = kd_labels(micro_batch, kd.ignore_index, rows).reshape(-1)[tokens]
        return sampled_reverse_kl(logits, labels, self.wire["log_probs"].reshape(-1)[tokens],
                                  estimator=kd.sampled_estimator, norm=norm, ignore_index=kd.ignore_index)

    @staticmethod
    def merged(members: dict[str, LabelLogProbs], rows: dict[str, torch.Tensor]) -> LabelLogProbs:
        """One answer for the whole micro-batch from each routed teacher's answer for its rows (`rows`: name ->
        bool [rows]), as `Distribution.merged` puts distributions together.

        Raises:
            ValueError: a teacher answered another kind, or not the rows routed to it.
        """
        for name, member in members.items():
            if not isinstance(member, LabelLogProbs):
                raise ValueError(f"routed teachers answered in different encodings: teacher {name!r} answered "
                                 f"{member.name!r}, not {LABEL_LOG_PROBS!r}")
        return LabelLogProbs(merged_rows({name: member.wire for name, member in members.items()}, rows))


def sampled_reverse_kl(logits: torch.Tensor, labels: torch.Tensor, teacher_log_probs: torch.Tensor, *, estimator: str,
                       norm: float | torch.Tensor | None, ignore_index: int = -100) -> torch.Tensor:
    """The reverse KL estimated at the sampled tokens `labels` (the module docstring), summed over the valid ones
    and divided by `norm`: its value the estimate, its gradient the estimator's.

    Args:
        logits: the student's [..., vocab] at the positions of `labels` [...] (a vocab-sharded DTensor too: a
            chunk's, gathered over the vocabulary's ranks).
        teacher_log_probs: [...] the teacher's log-probability of each label.
        estimator: "k1" or "k3".
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"kd.sampled_estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if isinstance(logits, DTensor):  # the log-normalizer reads the whole vocabulary
        logits = logits.full_tensor()
    valid = labels != ignore_index
    scaled = logits.float()
    student = scaled.gather(-1, labels.clamp(min=0)[..., None])[..., 0] - scaled.logsumexp(-1)
    log_ratio = torch.where(valid, student - teacher_log_probs.to(student.dtype), 0.0)  # log pi_s / pi_t
    divisor = token_normalizer(norm, valid, student.dtype)
    if estimator == "k3":
        return (torch.expm1(-log_ratio) + log_ratio).sum() / divisor
    value = log_ratio.sum() / divisor
    surrogate = (log_ratio.detach() * torch.where(valid, student, 0.0)).sum() / divisor
    return value.detach() + (surrogate - surrogate.detach())


__all__ = ["ESTIMATORS", "SAMPLED_REVERSE_KL", "LabelLogProbs", "sampled_reverse_kl"]

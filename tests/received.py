"""What a student does with an answer it received, for tests that start from a wire dict: its kind by mode
(`answer_of`), the checks of its fields and index values, and its KD loss through the kind's kernel, as the step
computes them (`meshkd.core.answers`)."""

from __future__ import annotations

import torch

from meshkd.core.answers import LossContext, answer_of
from meshkd.recipe.settings.config import KDConfig


def received(encoded, shape) -> str:
    """Check a received answer against the student's logits of `shape` (its fields, then its index values at once);
    its kind's name."""
    answer = answer_of(encoded)
    answer.check(answer.encoding, tuple(shape))
    answer.check_indices(LossContext(KDConfig()), shape[-1])
    return answer.name


def kd_loss_of(student_logits: torch.Tensor, encoded: dict, labels: torch.Tensor, *, temperature: float = 1.0,
               ignore_index: int = -100, num_valid_tokens=None, chunk_size: int | None = None,
               divergence: str = "forward_kl", jsd_beta: float = 0.5, skew_alpha: float = 0.1) -> torch.Tensor:
    """The KD loss of `student_logits` against a received answer: its index values checked at once, then its
    kind's kernel (`Distribution.kernel`)."""
    answer = answer_of(encoded)
    kd = KDConfig(temperature=temperature, ignore_index=ignore_index, divergence=divergence, jsd_beta=jsd_beta,
                  skew_alpha=skew_alpha)
    answer.check_indices(LossContext(kd), student_logits.shape[-1])
    return answer.kernel(student_logits, answer.encoding, labels, kd, norm=num_valid_tokens, chunk_size=chunk_size)

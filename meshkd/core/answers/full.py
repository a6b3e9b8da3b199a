"""The teacher's whole logits: "full", as the teacher computed them, and "full_bf16", rounded to bfloat16.

- "full": exact, in the teacher's dtype (`teacher_model.dtype`): 4 V bytes a position in float32, 2 V for a
  bfloat16 or float16 teacher.
- "full_bf16": 2 V bytes whatever the teacher's dtype; rounding moves each logit by at most 2^-9 of its magnitude.
The loss upcasts both to float32 and takes any divergence (`meshkd.core.loss.kd_loss`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from meshkd.core.answers.base import register
from meshkd.core.answers.distribution import Distribution
from meshkd.core.loss import kd_loss


@register
class FullLogits(Distribution):
    """The teacher's logits in its dtype ("logits" [rows, sequence, vocab])."""

    name = "full"
    selected_by = {"logits_transport": "full"}
    whole_distribution = True
    keeps_dtype = True

    @classmethod
    def encode_logits(cls, logits, **options):
        return {"mode": cls.name, "logits": logits}

    @classmethod
    def check(cls, decoded: dict[str, Any], shape) -> None:
        if set(decoded) != {"mode", "logits"}:
            raise ValueError(f"encoded {cls.name} teacher logits need fields ['logits', 'mode'], got {sorted(decoded)}")
        logits = decoded["logits"]
        if not isinstance(logits, Tensor) or not logits.is_floating_point() or tuple(logits.shape) != tuple(shape):
            got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"encoded teacher logits are {got}, the student's are {tuple(shape)}")

    @classmethod
    def bytes_per_token(cls, vocab, *, k, tail_samples, logits_bytes, width=None):
        return logits_bytes * vocab

    @classmethod
    def kernel(cls, student_logits, decoded, labels, kd, *, norm, chunk_size, divergence=None):
        divergence = divergence or kd.divergence
        cls.checked(decoded, student_logits, kd, divergence)
        return kd_loss(student_logits, decoded["logits"], labels, temperature=kd.temperature,
                       ignore_index=kd.ignore_index, num_valid_tokens=norm, chunk_size=chunk_size,
                       divergence=divergence, jsd_beta=kd.jsd_beta, skew_alpha=kd.skew_alpha)


@register
class Bfloat16Logits(FullLogits):
    """The teacher's logits rounded to bfloat16."""

    name = "full_bf16"
    selected_by = {"logits_transport": "full_bf16"}
    keeps_dtype = False

    @classmethod
    def encode_logits(cls, logits, **options):
        return {"mode": cls.name, "logits": logits.to(torch.bfloat16)}

    @classmethod
    def bytes_per_token(cls, vocab, *, k, tail_samples, logits_bytes, width=None):
        return 2 * vocab

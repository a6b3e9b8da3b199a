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

from meshkd.core.encodings.base import AnswerEncoding, register
from meshkd.core.loss import kd_loss


@register
class FullLogits(AnswerEncoding):
    name = "full"
    selected_by = {"logits_transport": "full"}
    whole_distribution = True

    def encode(self, logits, **options):
        return {"mode": self.name, "logits": logits}

    def check(self, answer: dict[str, Any], shape, *, check_indices: bool) -> None:
        if set(answer) != {"mode", "logits"}:
            raise ValueError(f"encoded {self.name} teacher logits need fields ['logits', 'mode'], got {sorted(answer)}")
        logits = answer["logits"]
        if not isinstance(logits, Tensor) or not logits.is_floating_point() or tuple(logits.shape) != tuple(shape):
            got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"encoded teacher logits are {got}, the student's are {tuple(shape)}")

    def nbytes_per_token(self, vocab, *, k, tail_samples, logits_bytes):
        return logits_bytes * vocab

    def loss(self, student_logits, answer, labels, **options):
        return kd_loss(student_logits, answer["logits"], labels, **options)


@register
class Bfloat16Logits(FullLogits):
    name = "full_bf16"
    selected_by = {"logits_transport": "full_bf16"}

    def encode(self, logits, **options):
        return {"mode": self.name, "logits": logits.to(torch.bfloat16)}

    def nbytes_per_token(self, vocab, *, k, tail_samples, logits_bytes):
        return 2 * vocab

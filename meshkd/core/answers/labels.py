"""The teacher's log-probability of each label, "label_log_probs": what an evaluation of the teacher's loss asks for
(4 bytes a token), of the labels of its own tokenization, at temperature 1, whichever tokenizer."""

from __future__ import annotations

import torch

from meshkd.core.answers.base import TeacherAnswer, register
from meshkd.core.answers.distribution import LABEL_LOG_PROBS, label_log_probs
from meshkd.core.batch_keys import teacher_side


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

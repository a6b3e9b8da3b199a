"""The recipe's door to the teacher's answers (`meshkd.core.answers`: one registered class a mode, each owning its
wire form, decoding, index check, KD loss and loss by chunks). Importing it registers the one kind the recipe
adds, a cross-tokenizer teacher's per-group answer (`meshkd.recipe.teacher.group_answers`, "groups"), and gives the
teacher's side `with_hidden_states`: `kd.hidden_states`' paired layers beside a training answer.
"""

from __future__ import annotations

import torch

from meshkd.core.answers import (
    ANSWERS,
    HIDDEN_STATES,
    Cut,
    Distribution,
    EncodeContext,
    Figures,
    LossContext,
    TeacherAnswer,
    answer_of,
    answer_type,
    choices,
    selected_kind,
)
from meshkd.recipe.teacher.group_answers import GroupDistributions


def with_hidden_states(wire: dict, hidden: list[torch.Tensor] | None, transport: str, *,
                       with_label_log_probs: bool = False) -> dict:
    """`wire` with the teacher's outputs of the paired layers (`kd.hidden_states`; each [rows, sequence, width])
    stacked under "hidden_states" when the request is a training one (a distribution alone): float32 where the
    logits keep the teacher's dtype (`Distribution.keeps_dtype`: full), else bfloat16, as the logits travel.
    Evaluations' answers go without them."""
    if not hidden or with_label_log_probs or transport not in choices("logits_transport"):
        return wire
    dtype = torch.float32 if ANSWERS.named(transport).keeps_dtype else torch.bfloat16
    return {**wire, HIDDEN_STATES: torch.stack(hidden, dim=2).to(dtype)}


__all__ = ["ANSWERS", "Cut", "Distribution", "EncodeContext", "Figures", "GroupDistributions", "LossContext",
           "TeacherAnswer", "answer_of", "answer_type", "selected_kind", "with_hidden_states"]

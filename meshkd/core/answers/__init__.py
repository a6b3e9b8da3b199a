"""Teacher answers: one registered class a mode, that makes its wire dict on the teacher's side and reads it on the
student's (`meshkd.core.answers.base`: the interface, the contexts, the registry). Importing the package registers
the built-in kinds, one module each, in the order messages and the configuration reference list them:

- `full`: "full" (the teacher's logits, its dtype) and "full_bf16" (rounded to bfloat16);
- `hidden`: "hidden" (the teacher's last hidden states, its dtype, from which its output layer on the student's
  side rebuilds the logits) and "hidden_bf16" (rounded to bfloat16);
- `topk`: "topk" (top-k log-probabilities, their indices, the tail's mass and optional tail samples);
- `compact`: "topk_compact" (a top-k answer packed: Elias-Fano indices, quantized values);
- `labels`: "label_log_probs" (each label's log-probability, what an evaluation asks of the teacher);
- `ensemble`: "teachers" (several teachers' answers, combined by `kd.combine`).
Those of the first four are distributions over the student's vocabulary (`distribution.Distribution`). A
cross-tokenizer teacher's per-group answer ("groups") is registered by `meshkd.recipe.teacher.group_answers`.
"""

# isort: off
from meshkd.core.answers import full, hidden, topk, compact, labels, ensemble
# isort: on
from meshkd.core.answers.base import (
    ANSWERS,
    Cut,
    EncodeContext,
    Figures,
    LossContext,
    TeacherAnswer,
    answer_of,
    answer_type,
    register,
)
from meshkd.core.answers.distribution import (
    HIDDEN_STATES,
    LABEL_LOG_PROBS,
    Distribution,
    answer_bytes,
    answer_settings,
    choices,
    distributions,
    encode_teacher_logits,
    label_log_probs,
    selected,
    selected_kind,
)

__all__ = ["ANSWERS", "HIDDEN_STATES", "LABEL_LOG_PROBS", "Cut", "Distribution", "EncodeContext", "Figures",
           "LossContext", "TeacherAnswer", "answer_bytes", "answer_of", "answer_settings", "answer_type", "choices",
           "compact", "distributions", "encode_teacher_logits", "ensemble", "full", "hidden", "label_log_probs",
           "labels", "register", "selected", "selected_kind", "topk"]

"""Answer encodings: how a teacher's distribution travels to the student's loss, one module each, registered by
name (`meshkd.core.encodings.base`). Importing the package registers the built-in ones:

- `full`: "full" (the teacher's logits, its dtype) and "full_bf16" (rounded to bfloat16);
- `topk`: "topk" (top-k log-probabilities, their indices, the tail's mass and optional tail samples);
- `compact`: "topk_compact" (a top-k answer packed: indices in ceil(log2 V) bits, values quantized).
"""

# Registered in this order, the order messages and the configuration reference list them.
# isort: off
from meshkd.core.encodings import full, topk, compact
# isort: on
from meshkd.core.encodings.base import ENCODINGS, AnswerEncoding, choices, encoding_named, register, selected

__all__ = ["ENCODINGS", "AnswerEncoding", "choices", "compact", "encoding_named", "full", "register", "selected",
           "topk"]

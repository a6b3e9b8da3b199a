"""Row formats: one dataset row (a JSONL object, a Hugging Face dataset row) -> one `Document`, by
`dataset.records`.

Each format is a registered `RowFormat` (`base`), one module each: `text`, `chat`, `prompt_completion`
(the last two rendered by a tokenizer's chat template, `chat_template`). `reading.record_reader` is the reader a
dataset section gets; `document.Document` what it returns. Nothing here tokenizes (`meshkd.recipe.corpus`
does).
"""

from meshkd.recipe.records import chat, prompt_completion, text  # noqa: F401  (each registers its format)
from meshkd.recipe.records.base import FORMATS, RowFormat, format_named, register
from meshkd.recipe.records.document import Document
from meshkd.recipe.records.reading import prompt_reader, record_reader

__all__ = ["FORMATS", "Document", "RowFormat", "format_named", "prompt_reader", "record_reader", "register"]

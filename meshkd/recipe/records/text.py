"""`text` rows: the `text_key` column, all of it trains, EOS appended (a plain text file is one such row)."""

from __future__ import annotations

from meshkd.recipe.records.base import RowFormat, RowReader, register
from meshkd.recipe.records.document import Document, string_column


@register
class TextRows(RowFormat):
    name = "text"
    settings_keys = ("text_key",)
    plain_text_files = True

    def reader(self, dataset, tokenizer=None, tokenizer_key="model.tokenizer") -> RowReader:
        def read(record: dict, where: str) -> Document | None:
            text = string_column(record, dataset.text_key, where, "text_key")
            return Document.of(text) if text.strip() else None
        return read

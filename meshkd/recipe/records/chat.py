"""`chat` rows: the `messages_key` column, a list of `{role, content}` (roles: system, user, assistant, tool and
those `dataset.chat_roles` adds; any other is refused naming the row), rendered with the tokenizer's own chat
template (`meshkd.recipe.records.chat_template`); the assistant turns train."""

from __future__ import annotations

from meshkd.recipe.records.base import RowFormat, RowReader, register
from meshkd.recipe.records.chat_template import TEMPLATE_KEYS, ChatRenderer, checked_messages, roles
from meshkd.recipe.records.document import Document, column


@register
class ChatRows(RowFormat):
    name = "chat"
    settings_keys = TEMPLATE_KEYS
    rendered = marks_answers = True

    def reader(self, dataset, tokenizer=None, tokenizer_key="model.tokenizer") -> RowReader:
        if tokenizer is None or tokenizer.chat_template is None:
            raise ValueError(f"dataset.records 'chat' renders rows with the chat template of {tokenizer_key}, which "
                             "has none")
        render, allowed = ChatRenderer(tokenizer, dataset.train_on, tokenizer_key), roles(dataset)

        def read(record: dict, where: str) -> Document:
            messages = column(record, dataset.messages_key, where, "messages_key")
            return render(checked_messages(messages, f"{where}: {dataset.messages_key!r}", allowed), where)
        return read

"""`prompt_completion` rows: `prompt_key` and `completion_key` (strings, or lists of messages as TRL's
conversational form), optional `system_key` and `context_key` (joined before the prompt); the completion trains.
With a chat template (`dataset.chat_template` true, or null and the tokenizer has one) they are rendered as a chat
of system, user and assistant turns (`meshkd.recipe.records.chat_template`); without, the completion follows the
prompt as it is, EOS appended."""

from __future__ import annotations

from meshkd.recipe.records.base import RowFormat, RowReader, register
from meshkd.recipe.records.chat_template import TEMPLATE_KEYS, ChatRenderer, checked_messages, roles
from meshkd.recipe.records.document import Document, column, string_column


@register
class PromptCompletionRows(RowFormat):
    name = "prompt_completion"
    settings_keys = TEMPLATE_KEYS
    rendered = marks_answers = True

    def reader(self, dataset, tokenizer=None, tokenizer_key="model.tokenizer") -> RowReader:
        has_template = tokenizer is not None and tokenizer.chat_template is not None
        if dataset.chat_template and not has_template:
            raise ValueError(f"dataset.records 'prompt_completion' renders rows with the chat template of "
                             f"{tokenizer_key}, which has none (dataset.chat_template: false joins prompt and "
                             f"completion as they are)")
        templated = dataset.chat_template or (dataset.chat_template is None and has_template)
        render = ChatRenderer(tokenizer, dataset.train_on, tokenizer_key) if templated else None
        keys = {"prompt": dataset.prompt_key or "prompt", "completion": dataset.completion_key}
        allowed = roles(dataset)

        def read(record: dict, where: str) -> Document:
            prompt, completion = (column(record, keys[name], where, f"{name}_key") for name in ("prompt", "completion"))
            system, context = (string_column(record, getattr(dataset, setting), where, setting)
                               for setting in ("system_key", "context_key"))
            if isinstance(prompt, str):
                prompt = "\n\n".join([part for part in (context, prompt) if part])
            if render is None:  # plain: the completion right after the prompt
                for name, value in (("prompt", prompt), ("completion", completion)):
                    if not isinstance(value, str):
                        raise ValueError(f"{where}: {keys[name]!r} holds a {type(value).__name__}; without a chat "
                                         f"template prompt and completion are strings")
                if not completion.strip():
                    raise ValueError(f"{where}: empty answer ({keys['completion']!r} is empty)")
                head = "\n\n".join([part for part in (system, prompt) if part])
                return Document.of(head + completion, answers=[(len(head), len(head) + len(completion))],
                                   prompt_end=len(head), contents=[(len(head), completion)])
            if isinstance(prompt, str):
                prompt = [{"role": "system", "content": system}] * bool(system) + [{"role": "user", "content": prompt}]
            if isinstance(completion, str):
                completion = [{"role": "assistant", "content": completion}]
            messages = (checked_messages(prompt, f"{where}: {keys['prompt']!r}", allowed)
                        + checked_messages(completion, f"{where}: {keys['completion']!r}", allowed))
            return render(messages, where)
        return read

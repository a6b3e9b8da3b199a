"""Rows a tokenizer's chat template renders (`chat`, and `prompt_completion` with a template): a list of messages
-> its `Document`, the assistant turns' spans kept as its answers.

An assistant turn i is the text between the rendering of turns [0, i) with the generation prompt and that of
turns [0, i]: so the answer holds what the template puts after the content (the end-of-turn token: the model
learns to stop) and not the assistant header. A template that does not render conversations as prefixes of
longer ones cannot be split so, and is refused naming the row. `dataset.train_on`: `answers` (every assistant
turn), `last_answer`, or `all` (every token, as text).

The end-of-turn token (`end_of_turn_token`, where an on-policy completion of a chat prompt stops): the added token
the template writes right after an assistant turn's content (ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`), read
from the rendering of a probe conversation, not from a list of known templates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshkd.recipe.records.document import Document

TEMPLATE_KEYS = ("records", "train_on", "chat_template", "messages_key", "prompt_key", "completion_key",
                 "system_key", "context_key")
"""The `dataset` keys rendered rows depend on: one set for every format a template renders, so that the teacher
caches and token stores of `chat` and `prompt_completion` rows key alike (`chat_roles` joins them when set)."""

TRAIN_ON = ("answers", "last_answer", "all")
"""The values of `dataset.train_on`: which assistant turns train (`all`: every token)."""

CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have; `dataset.chat_roles` adds others (a template renders any role it is given,
so a misspelt one would otherwise train silently)."""


def checked_messages(value: Any, where: str, roles: Sequence[str]) -> list[dict]:
    """`value` checked to be a list of {role, content} objects with a role of `roles` (other keys kept for the
    template)."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: expected a non-empty list of {{role, content}} messages, got "
                         f"{type(value).__name__}")
    for index, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{where}: message {index} is not a {{role, content}} object of strings: "
                             f"{str(message)[:80]}")
        if message["role"] not in roles:
            raise ValueError(f"{where}: message {index} has the role {message['role']!r}, none of "
                             f"{', '.join(roles)} (dataset.chat_roles adds others)")
    return value


def roles(dataset) -> tuple[str, ...]:
    """The roles the `dataset` section's messages may have."""
    return (*CHAT_ROLES, *dataset.chat_roles)


class ChatRenderer:
    """A list of messages -> its `Document` under a tokenizer's chat template (see the module docstring);
    `tokenizer_key` names the tokenizer in errors."""

    def __init__(self, tokenizer, train_on: str, tokenizer_key: str = "model.tokenizer") -> None:
        self.tokenizer, self.train_on, self.tokenizer_key = tokenizer, train_on, tokenizer_key

    def render(self, messages: list[dict], where: str, *, generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as error:  # jinja's TemplateError (raise_exception in the template) and its kin
            raise ValueError(f"{where}: the chat template of {self.tokenizer_key} refuses the row: {error}") from None

    def __call__(self, messages: list[dict], where: str) -> Document:
        text = self.render(messages, where)
        answers, contents = [], []
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:turn], where, generation_prompt=True) if turn else ""
            through = text if turn == len(messages) - 1 else self.render(messages[: turn + 1], where)
            if not (through.startswith(before) and text.startswith(through)):
                raise ValueError(f"{where}: the chat template of {self.tokenizer_key} does not render turn {turn} "
                                 f"as a prefix of the whole conversation, so its answer cannot be told from the "
                                 f"prompt (dataset.train_on: all trains on every token)")
            if not message["content"].strip():
                raise ValueError(f"{where}: empty answer (message {turn}, role 'assistant')")
            answers.append((len(before), len(through)))
            contents.append(_written(message["content"], text, len(before), len(through)))
        if not answers:
            raise ValueError(f"{where}: no assistant message, so nothing to train on")
        prompt_end = answers[-1][0]
        if self.train_on == "all":
            answers = None
        elif self.train_on == "last_answer":
            answers = answers[-1:]
        return Document.of(text, answers=answers, prompt_end=prompt_end, eos=False, contents=contents)


def _written(content: str, text: str, start: int, end: int) -> tuple[int, str] | None:
    """Where `content` stands in `text[start:end]` (an answer turn's rendering) and as what: as given, else
    stripped (templates such as Llama 3's trim it); None when the template changes it otherwise."""
    for written in (content, content.strip()):
        found = text.find(written, start, end)
        if found >= 0:
            return found, written
    return None


_PROBE = "meshkd-end-of-turn-probe"
"""The content of the probe answer `end_of_turn_token` renders (no whitespace: no template trims it)."""


def end_of_turn_token(tokenizer) -> int | None:
    """The id of the token `tokenizer`'s chat template closes an assistant turn with: the longest of its added
    tokens (`get_added_vocab`) that the rendering of a one-question conversation continues with right after the
    answer's content (blanks skipped); None without a template, or where the template writes no added token
    there (text, or nothing: EOS alone then ends a completion)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses the probe names no end of turn
        return None
    if _PROBE not in text:
        return None
    after = text[text.rindex(_PROBE) + len(_PROBE):].lstrip()  # " </s>" after Llama 2's answers
    added = {token: index for token, index in tokenizer.get_added_vocab().items() if token}
    found = [token for token in added if after.startswith(token)]
    return added[max(found, key=len)] if found else None

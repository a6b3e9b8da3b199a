"""Records: one dataset row (a JSONL object, a Hugging Face dataset row) -> one `Document`, by `dataset.records`.

Design:
- A `Document` is the text the student reads (a `str`) with what the loss needs beyond it: `answers`, the
  character spans whose tokens train (None: every token trains), `prompt_end`, where the on-policy prompt of
  the row ends, `eos`, whether the tokenizer's EOS closes it, and `route`, the teacher a routed row names.
  Tokenizing maps the spans to tokens (`tokenize_documents`), so the answer-only mask is carried by the labels
  (-100 outside answers) and survives whatever carries labels: packing, cp sharding, pipeline stages, the
  teacher cache, several teachers.
- `text` rows: the `text_key` column, all of it trains, EOS appended (plain text files are such rows too).
- `chat` rows: the `messages_key` column, a list of `{role, content}` (roles: system, user, assistant, tool and
  those `dataset.chat_roles` adds; any other is refused naming the row), rendered with the tokenizer's own chat
  template. An assistant turn i is the text between the rendering of turns [0, i) with the generation
  prompt and that of turns [0, i]: so the answer holds what the template puts after the content (the
  end-of-turn token: the model learns to stop) and not the assistant header. A template that does not
  render conversations as prefixes of longer ones cannot be split so, and is refused naming the row.
- `prompt_completion` rows: `prompt_key` and `completion_key` (strings, or lists of messages as TRL's
  conversational form), optional `system_key` and `context_key` (joined before the prompt). With a chat
  template (`dataset.chat_template` true, or null and the tokenizer has one) they are rendered as a chat of
  system, user and assistant turns; without, the completion follows the prompt as it is, EOS appended.
- `dataset.train_on`: `answers` (every assistant turn), `last_answer`, or `all` (every token, as text).
- `tokenize_documents` maps the spans to tokens: a token trains when its first character lies in an answer,
  by the fast tokenizer's offsets over the whole text (the tokens the model sees at inference).
- With `kd.cross_tokenizer` the teacher's tokenizer renders the row too (`Document.teacher`); the two
  renderings share the answers' text, not the wrapping around it (`Document.shared`: what
  `meshkd.recipe.corpus.aligned_data` aligns the two tokenizations on).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch


class Document(str):
    """A document's text with what its loss reads beyond the text (see the module docstring)."""

    answers: tuple[tuple[int, int], ...] | None = None
    prompt_end: int | None = None
    eos: bool = True
    route: str | None = None
    contents: tuple[tuple[int, str] | None, ...] = ()
    """Per assistant turn (every one, whatever `train_on`): where its content starts and the content as the
    template wrote it (stripped when the template strips it; None when the template changes it otherwise)."""
    teacher: Document | None = None
    """With `kd.cross_tokenizer`: the row as the teacher's tokenizer renders it."""
    shared: tuple[tuple[int, int, int], ...] = ()
    """Beside `teacher`: the passages both renderings hold alike, as (start here, start in `teacher`,
    characters): the answers (`shared_passages`)."""

    @classmethod
    def of(cls, text: str, *, answers=None, prompt_end=None, eos: bool = True, route: str | None = None,
           contents=(), teacher: Document | None = None, shared=()) -> Document:
        document = cls(text)
        document.answers = None if answers is None else tuple(answers)
        document.prompt_end, document.eos, document.route = prompt_end, eos, route
        document.contents, document.teacher, document.shared = tuple(contents), teacher, tuple(shared)
        return document

    def cut(self, max_chars: int) -> Document:
        """The first `max_chars` characters, the spans clipped to them (an answer cut away is dropped); the
        teacher's rendering likewise, and the shared passages to what both keep."""
        if len(self) <= max_chars and (self.teacher is None or len(self.teacher) <= max_chars):
            return self
        answers = None if self.answers is None else [(start, min(end, max_chars)) for start, end in self.answers
                                                     if start < max_chars]
        prompt_end = None if self.prompt_end is None or self.prompt_end > max_chars else self.prompt_end
        contents = [content for content in self.contents if content is not None and content[0] < max_chars]
        shared = [(start, other, min(length, max_chars - start, max_chars - other))
                  for start, other, length in self.shared if start < max_chars and other < max_chars]
        return Document.of(self[:max_chars], answers=answers, prompt_end=prompt_end, eos=self.eos, route=self.route,
                           contents=contents, teacher=None if self.teacher is None else self.teacher.cut(max_chars),
                           shared=shared)

    def prompt(self, where: str) -> Document:
        """The row's on-policy prompt: its text before the last answer (the generation prompt included); a
        text row is its own. ValueError naming the row (`where`) when the answer starts the row."""
        if self.prompt_end is None:
            return self
        if self.prompt_end == 0:
            raise ValueError(f"{where}: the row's answer starts at its first character, so it has no prompt")
        return Document.of(self[: self.prompt_end], eos=False, route=self.route)


def record_reader(dataset, tokenizer=None, teachers: list[str] | None = None,
                  teacher_tokenizer=None) -> Callable[[dict, str], Document | None]:
    """`(record, where) -> Document` (None: an empty text row, skipped) as the `dataset` section says.

    `where` names the row in errors (`file:line`, or the dataset and index). `tokenizer` renders chat rows;
    ValueError when they need a template it does not have. `teachers`: the names a routed row may give.
    `teacher_tokenizer` (`kd.cross_tokenizer`): chat and prompt / completion rows are rendered by it too, into
    `Document.teacher`, with the passages both renderings share (`shared_passages`).
    """
    records = getattr(dataset, "records", "text")
    route_key = dataset.teacher_key
    if records == "text":
        convert = _text_reader(dataset.text_key)
    else:
        convert = _row_reader(dataset, tokenizer, "model.tokenizer")
        if teacher_tokenizer is not None:
            convert = _both_sides(convert, _row_reader(dataset, teacher_tokenizer, "teacher_model.tokenizer"))

    def read(record: dict, where: str) -> Document | None:
        document = convert(record, where)
        if document is None or route_key is None:
            return document
        route = record.get(route_key)
        if not isinstance(route, str):
            raise ValueError(f"{where}: the route key {route_key!r} must hold the name of the row's teacher, "
                             f"got {route!r}")
        if teachers is not None and route not in teachers:
            raise ValueError(f"{where}: dataset.teacher_key {route_key!r} names the teacher {route!r}, which is "
                             f"none of the teachers {teachers}")
        document.route = route
        return document

    # What a plain text file can be: a document of text rows only, and one naming no teacher.
    read.records, read.route_key = records, route_key
    return read


def prompt_reader(read_row: Callable[[dict, str], Document | None]) -> Callable[[dict, str], Document | None]:
    """A reader of each row's on-policy prompt (`Document.prompt`) in place of the row `read_row` reads."""
    def read(record: dict, where: str) -> Document | None:
        document = read_row(record, where)
        return document if document is None else document.prompt(where)

    read.records, read.route_key = read_row.records, read_row.route_key
    return read


def _row_reader(dataset, tokenizer, tokenizer_key: str) -> Callable[[dict, str], Document]:
    """A chat or prompt / completion row's `Document` as `tokenizer` (the config's `tokenizer_key`) renders it."""
    records = dataset.records
    template = records == "chat" or dataset.chat_template or (
        dataset.chat_template is None and tokenizer is not None and tokenizer.chat_template is not None)
    if template and (tokenizer is None or tokenizer.chat_template is None):
        raise ValueError(f"dataset.records {records!r} renders rows with the chat template of {tokenizer_key}, "
                         f"which has none (dataset.chat_template: false joins prompt and completion as they "
                         f"are)" if records == "prompt_completion" else
                         f"dataset.records 'chat' renders rows with the chat template of {tokenizer_key}, which "
                         "has none")
    render = ChatRenderer(tokenizer, dataset.train_on, tokenizer_key) if template else None
    return _chat_reader(dataset, render) if records == "chat" else _pair_reader(dataset, render)


def _both_sides(student: Callable[[dict, str], Document],
                teacher: Callable[[dict, str], Document]) -> Callable[[dict, str], Document]:
    """A reader of rows rendered by both tokenizers: the student's `Document` with the teacher's beside it."""
    def read(record: dict, where: str) -> Document:
        document = student(record, where)
        document.teacher = teacher(record, where)
        document.shared = shared_passages(document, document.teacher, where)
        return document
    return read


def shared_passages(student: Document, teacher: Document, where: str) -> tuple[tuple[int, int, int], ...]:
    """What two renderings of one row hold alike, as (student start, teacher start, characters): the whole text
    when they are equal, else each answer's content (where a template strips it, what both keep of it).
    ValueError naming the row when a template changes an answer otherwise (nothing then pairs its bytes)."""
    if str(student) == str(teacher):
        return ((0, 0, len(student)),)
    shared = []
    for turn, (mine, theirs) in enumerate(zip(student.contents, teacher.contents, strict=True)):
        if mine is None or theirs is None:
            key = "model.tokenizer" if mine is None else "teacher_model.tokenizer"
            raise ValueError(f"{where}: the chat template of {key} does not write answer {turn} as the row gives "
                             f"it, so kd.cross_tokenizer cannot pair its bytes with the other tokenizer's")
        (start, text), (other, other_text) = mine, theirs
        if other_text in text:
            shared.append((start + text.index(other_text), other, len(other_text)))
        elif text in other_text:
            shared.append((start, other + other_text.index(text), len(text)))
        else:
            raise ValueError(f"{where}: answer {turn} reads {text[:40]!r} under the chat template of model.tokenizer "
                             f"but {other_text[:40]!r} under teacher_model.tokenizer's, so kd.cross_tokenizer cannot "
                             f"pair its bytes")
    return tuple(shared)


def column(record: dict, key: str, where: str, setting: str) -> Any:
    """`record[key]`; ValueError naming the row, the setting (`text_key`, ...) and the row's columns if absent."""
    if key not in record:
        keys = ", ".join(repr(name) for name in list(record)[:8])
        raise ValueError(f"{where}: no {setting} {key!r} in the row (its columns: {keys or 'none'})")
    return record[key]


def _text_reader(text_key: str) -> Callable[[dict, str], Document | None]:
    def read(record: dict, where: str) -> Document | None:
        text = column(record, text_key, where, "text_key")
        if not isinstance(text, str):
            raise ValueError(f"{where}: {text_key!r} holds a {type(text).__name__}, not a string")
        return Document.of(text) if text.strip() else None
    return read


def _chat_reader(dataset, render: ChatRenderer) -> Callable[[dict, str], Document]:
    roles = (*CHAT_ROLES, *dataset.chat_roles)

    def read(record: dict, where: str) -> Document:
        messages = column(record, dataset.messages_key, where, "messages_key")
        return render(_messages(messages, f"{where}: {dataset.messages_key!r}", roles), where)
    return read


def _pair_reader(dataset, render: ChatRenderer | None) -> Callable[[dict, str], Document]:
    keys = {"prompt": dataset.prompt_key or "prompt", "completion": dataset.completion_key}
    roles = (*CHAT_ROLES, *dataset.chat_roles)

    def text(record: dict, key: str | None, where: str, setting: str) -> str | None:
        value = None if key is None else column(record, key, where, setting)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{where}: {key!r} holds a {type(value).__name__}, not a string")
        return value

    def read(record: dict, where: str) -> Document:
        prompt, completion = (column(record, keys[name], where, f"{name}_key") for name in ("prompt", "completion"))
        system, context = (text(record, getattr(dataset, setting), where, setting)
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
        messages = (_messages(prompt, f"{where}: {keys['prompt']!r}", roles)
                    + _messages(completion, f"{where}: {keys['completion']!r}", roles))
        return render(messages, where)

    return read


CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have; `dataset.chat_roles` adds others (a template renders any role it is given,
so a misspelt one would otherwise train silently)."""


def _messages(value: Any, where: str, roles: Sequence[str]) -> list[dict]:
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


# Documents are tokenized this many at a time: big enough for the fast tokenizer's batch encoding to
# pay off, small enough that the token lists of a large corpus never exist all at once as Python lists.
TOKENIZE_CHUNK = 256


def tokenize_documents(tokenizer, texts: list[str], *,
                       keep_empty: bool = False) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per document that yields tokens (every document with `keep_empty`): (int64 ids, EOS appended when the
    tokenizer has one and the document takes it; which tokens train, a bool tensor, or None when all do:
    `answer_tokens`)."""
    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    documents = []
    for start in range(0, len(texts), TOKENIZE_CHUNK):
        chunk = texts[start : start + TOKENIZE_CHUNK]
        masked = any(getattr(text, "answers", None) is not None for text in chunk)
        if masked and not tokenizer.is_fast:
            raise ValueError(f"answer-only loss finds the answer tokens by their character offsets, which "
                             f"{type(tokenizer).__name__} (not a fast tokenizer) does not give; dataset.train_on: "
                             f"all trains on every token")
        # verbose=False: documents longer than the model's context are expected, they are cut when packed.
        encoded = tokenizer(chunk, add_special_tokens=False, verbose=False, return_offsets_mapping=masked)
        for index, (text, ids) in enumerate(zip(chunk, encoded["input_ids"])):
            if not ids:
                if keep_empty:
                    documents.append((torch.zeros(0, dtype=torch.int64), None))
                continue
            closing = eos if getattr(text, "eos", True) else []
            trains = None
            if getattr(text, "answers", None) is not None:
                trains = answer_tokens(text.answers, encoded["offset_mapping"][index], closing=len(closing))
            documents.append((torch.tensor(ids + closing, dtype=torch.int64), trains))
    return documents


def answer_tokens(answers: Sequence[tuple[int, int]], offsets: Sequence[tuple[int, int]], *,
                  closing: int = 0) -> torch.Tensor:
    """Which tokens train: those whose first character lies in an answer span (character offsets [start, end)),
    then `closing` tokens appended after the text (its EOS), which train with the answer they end."""
    starts = torch.tensor([start for start, _ in offsets], dtype=torch.int64)
    trains = torch.zeros(len(offsets), dtype=torch.bool)
    for begin, end in answers:
        trains |= (starts >= begin) & (starts < end)
    return torch.cat([trains, trains[-1:].expand(closing) if len(trains) else torch.zeros(closing, dtype=torch.bool)])


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of everything that decides how text becomes ids (the fast tokenizer's whole definition)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    text += json.dumps([tokenizer.eos_token_id, tokenizer.pad_token_id])
    return hashlib.sha256(text.encode()).hexdigest()

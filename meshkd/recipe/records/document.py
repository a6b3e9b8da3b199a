"""A `Document`: the text the student reads, with what its loss reads beyond the text.

- `answers`: the character spans whose tokens train (None: every token trains). Tokenizing maps them to tokens
  (`meshkd.recipe.corpus.tokenizing`), so the answer-only mask is carried by the labels (-100 outside answers)
  and survives whatever carries labels: packing, cp sharding, pipeline stages, the teacher cache, several
  teachers.
- `prompt_end`: where the row's on-policy prompt ends; `eos`: whether the tokenizer's EOS closes it; `route`:
  the teacher a routed row names.
- With `kd.cross_tokenizer` the teacher's tokenizer renders the row too (`teacher`); the two renderings share
  the answers' text, not the wrapping around it (`shared`: what `meshkd.recipe.corpus.aligned_data` aligns the
  two tokenizations on).
"""

from __future__ import annotations

from typing import Any


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
    characters): the answers (`meshkd.recipe.records.reading.shared_passages`)."""

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
        document that marks no prompt is its own. ValueError naming the row (`where`) when the answer starts it."""
        if self.prompt_end is None:
            return self
        if self.prompt_end == 0:
            raise ValueError(f"{where}: the row's answer starts at its first character, so it has no prompt")
        return Document.of(self[: self.prompt_end], eos=False, route=self.route)


def column(record: dict, key: str, where: str, setting: str) -> Any:
    """`record[key]`; ValueError naming the row, the setting (`text_key`, ...) and the row's columns if absent."""
    if key not in record:
        keys = ", ".join(repr(name) for name in list(record)[:8])
        raise ValueError(f"{where}: no {setting} {key!r} in the row (its columns: {keys or 'none'})")
    return record[key]


def string_column(record: dict, key: str | None, where: str, setting: str) -> str | None:
    """`record[key]` checked to be a string (None when `key` is None); ValueError naming the row otherwise."""
    value = None if key is None else column(record, key, where, setting)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: {key!r} holds a {type(value).__name__}, not a string")
    return value

"""A dataset section's reader of rows: its row format's, with the teacher a routed row names and, with
`kd.cross_tokenizer`, the teacher's own rendering of each row beside the student's."""

from __future__ import annotations

from meshkd.recipe.records.base import RowReader, format_named
from meshkd.recipe.records.document import Document


def record_reader(dataset, tokenizer=None, teachers: list[str] | None = None, teacher_tokenizer=None) -> RowReader:
    """`(record, where) -> Document` (None: an empty row, skipped) as the `dataset` section says.

    `where` names the row in errors (`file:line`, or the dataset and index). `tokenizer` renders rows of a
    `rendered` format; ValueError when they need a template it does not have. `teachers`: the names a routed
    row may give. `teacher_tokenizer` (`kd.cross_tokenizer`): rows of a `rendered` format are rendered by it
    too, into `Document.teacher`, with the passages both renderings share (`shared_passages`). The reader's
    `row_format` and `route_key` say which files may be plain text and name teachers.
    """
    row_format = format_named(getattr(dataset, "records", "text"))
    route_key = dataset.teacher_key
    convert = row_format.reader(dataset, tokenizer, "model.tokenizer")
    if teacher_tokenizer is not None and row_format.rendered:
        convert = _both_sides(convert, row_format.reader(dataset, teacher_tokenizer, "teacher_model.tokenizer"))

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

    read.row_format, read.route_key = row_format, route_key
    return read


def prompt_reader(read_row: RowReader) -> RowReader:
    """A reader of each row's on-policy prompt (`Document.prompt`) in place of the row `read_row` reads."""
    def read(record: dict, where: str) -> Document | None:
        document = read_row(record, where)
        return document if document is None else document.prompt(where)

    read.row_format, read.route_key = read_row.row_format, read_row.route_key
    return read


def _both_sides(student: RowReader, teacher: RowReader) -> RowReader:
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

"""Documents: the files a dataset's paths match, read as text documents with errors naming file and line.

Plain text files are one document each; JSONL files one document per line, under `text_key` (a file ending
in `.jsonl`, or every file with `format: jsonl`). Files are read as bytes and decoded here, so an invalid
byte is reported with its file (and line), not deep inside the tokenizer. A file that is not text (a NUL
byte: binary; or not valid UTF-8) is, by `on_bad_file`, read anyway ("read": decoded with
`encoding_errors`), refused naming it ("error"), or left out with a warning naming it ("skip"; printed by
the process of global rank 0 only, once per file, since every rank reads the same files). The check scans
a file in blocks and JSONL files are read line by line, so a file larger than memory streams.

Files ending in `.parquet`, `.csv`, `.arrow` or `.json` are read with `datasets` (`meshkd.recipe.corpus.hf_sources`),
as is the dataset `dataset.hf` names. Every row of JSONL and those sources becomes a `Document` by
`dataset.records` (`meshkd.recipe.records`: text, chat or prompt / completion rows; with `route_key`, several
teachers' `kd.combine: route`, each also names its teacher).

A recipe's `dataset` section reads as `reading_arguments` says; `corpus_documents` is its documents in corpus
order, and `validation_documents` the seeded share of them held out (before any packing, so no document
gives tokens to both splits).
"""

from __future__ import annotations

import codecs
import glob
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from meshkd.recipe.common.metrics import warn0
from meshkd.recipe.corpus.hf_sources import builder_of, file_rows, section_rows
from meshkd.recipe.records import Document, record_reader
from meshkd.recipe.settings.config_loading import expand_path

if TYPE_CHECKING:  # transformers costs seconds to import; only its type is needed here
    from transformers import PreTrainedTokenizerBase


def describe_patterns(patterns: list) -> str:
    return ", ".join(repr(str(p)) for p in patterns)


def match_files(patterns: list) -> list[str]:
    """Sorted, de-duplicated files matched by the patterns; FileNotFoundError names a pattern matching none."""
    files: set[str] = set()
    for pattern in patterns:
        expanded = os.path.expanduser(os.fspath(pattern))
        matched = [path for path in glob.glob(expanded, recursive=True) if os.path.isfile(path)]
        if not matched:
            hint = " (a directory: use a pattern such as 'dir/**/*.txt')" if os.path.isdir(expanded) else ""
            raise FileNotFoundError(f"no file matches the data path {str(pattern)!r}{hint}")
        files.update(os.path.abspath(path) for path in matched)
    return sorted(files)


BAD_FILE_POLICIES = ("read", "error", "skip")
_FORMATS = ("text", "jsonl")


_SCAN_BYTES = 16 << 20


def not_text(path: str) -> str | None:
    """Why the file at `path` is not text ("binary (...)", a NUL byte anywhere first; else "not valid UTF-8
    (...)"), or None when it is. Read in blocks: a file larger than memory is scanned in bounded memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, bad = 0, None
    with open(path, "rb") as file:
        while block := file.read(_SCAN_BYTES):
            nul = block.find(b"\0")
            if nul >= 0:
                return f"binary (a NUL byte at offset {offset + nul})"
            if bad is None:
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as error:
                    # The decoder holds back at most 3 bytes of an unfinished character from the block before.
                    position = offset + error.start - len(error.object) + len(block)
                    bad = f"not valid UTF-8 (byte 0x{error.object[error.start]:02x} at offset {position})"
            offset += len(block)
    if bad is None:
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as error:
            bad = f"not valid UTF-8 (a character cut at the end, offset {offset - len(error.object) + error.start})"
    return bad


def check_text(path: str, on_bad_file: str) -> bool:
    """Whether to read `path`: False to skip it (warned); ValueError when it is not text and that is an error."""
    reason = None if on_bad_file == "read" else not_text(path)
    if reason is None:
        return True
    if on_bad_file == "error":
        raise ValueError(f"data file {path!r} is {reason}: not a text file (on_bad_file 'skip' leaves such "
                         "files out)")
    warn0(f"skipping data file {path!r}: {reason}")
    return False


def read_documents(files: list[str], **arguments) -> list[Document]:
    """The documents of `files` (then of the `dataset.hf` section `hf_section`), in order: `iter_documents`."""
    return list(iter_documents(files, **arguments))


def iter_documents(
    files: list[str],
    *,
    text_key: str = "text",
    format: str | None,
    max_documents: int | None,
    max_document_chars: int | None,
    encoding_errors: str,
    on_bad_file: str = "read",
    route_key: str | None = None,
    read_record: Callable[[dict, str], Document | None] | None = None,
    hf_section=None,
) -> Iterator[Document]:
    """The documents of `files` (then of the `dataset.hf` section `hf_section`), in order, one at a time.

    `read_record` turns a row into its document (`meshkd.recipe.records.record_reader`); None reads the
    `text_key` column (and with `route_key` the teacher's name) of text rows.
    """
    if read_record is None:
        read_record = record_reader(SimpleNamespace(text_key=text_key, teacher_key=route_key))
    count = 0
    for record, where in iter_rows(files, format=format, encoding_errors=encoding_errors, on_bad_file=on_bad_file,
                                   read_record=read_record, hf_section=hf_section):
        document = to_document(read_record, record, where, max_document_chars)
        if document is None:
            continue
        yield document
        count += 1
        if count == max_documents:
            return  # stop reading: a cap on a large corpus should not read all of it


def iter_rows(files: list[str], *, format: str | None, encoding_errors: str, on_bad_file: str,
              read_record, hf_section=None) -> Iterator[tuple[dict | Document, str]]:
    """Every row of `files` (then of `hf_section`) as (a row dict, or a plain text file's Document; where), in
    order, before `to_document` (`read_record` says which files may be plain text and name teachers)."""
    if on_bad_file not in BAD_FILE_POLICIES:
        raise ValueError(f"on_bad_file must be one of {BAD_FILE_POLICIES}, got {on_bad_file!r}")
    for rows in _sources(files, format, encoding_errors, on_bad_file, read_record.row_format.plain_text_files,
                         read_record.route_key, hf_section):
        yield from rows


def to_document(read_record, record: dict | Document, where: str, max_document_chars: int | None) -> Document | None:
    """A row's document, cut to `max_document_chars`; None for a row with no text (skipped)."""
    document = read_record(record, where) if isinstance(record, dict) else record
    if document is None or not document.strip():
        return None
    return document if max_document_chars is None else document.cut(max_document_chars)


def _sources(files, format, encoding_errors, on_bad_file, text_rows, route_key, hf_section):
    """Each source's rows as (a row dict or a plain text file's Document, where)."""
    for path in files:
        if format is None and builder_of(path) is not None:
            yield file_rows(path)
            continue
        try:
            if not check_text(path, on_bad_file):
                continue
        except OSError as error:
            raise ValueError(f"cannot read data file {path!r}: {error}") from error
        if format == "jsonl" or (format is None and Path(path).suffix.lower() == ".jsonl"):
            yield _jsonl_rows(path, encoding_errors)
        elif route_key is not None:
            raise ValueError(f"{path} is not a JSONL file, so no document of it can name its teacher under the "
                             f"route key {route_key!r}")
        elif not text_rows:
            raise ValueError(f"{path} is a plain text file: dataset.records reads rows of JSONL, parquet, CSV, "
                             f"arrow or JSON files (or dataset.hf)")
        else:
            yield [(_text_document(path, _read_bytes(path), encoding_errors), path)]
    if hf_section is not None:
        yield section_rows(hf_section)


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise ValueError(f"cannot read data file {path!r}: {error}") from error


def _text_document(path: str, data: bytes, encoding_errors: str) -> Document:
    try:
        return Document.of(data.decode("utf-8", errors=encoding_errors))
    except UnicodeDecodeError as error:
        raise ValueError(
            f"data file {path!r} is not valid UTF-8 ({error}); pass encoding_errors='replace' to read it anyway"
        ) from None


def _jsonl_rows(path: str, encoding_errors: str) -> Iterator[tuple[dict, str]]:
    """The rows of a JSONL file, read line by line (a file larger than memory streams)."""
    try:
        file = open(path, "rb")
    except OSError as error:
        raise ValueError(f"cannot read data file {path!r}: {error}") from error
    with file:
        for number, raw in enumerate(file, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8", errors=encoding_errors)
            except UnicodeDecodeError as error:
                raise ValueError(f"{where}: line is not valid UTF-8 ({error})") from None
            if not line.strip():  # blank lines (a trailing newline, separators) are not records
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: invalid JSON ({error})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object per line, got {type(record).__name__}")
            yield record, where


def check_arguments(
    sequence_length: int,
    val_fraction: float,
    format: str | None,
    max_documents: int | None,
    max_document_chars: int | None,
    encoding_errors: str,
) -> None:
    """ValueError naming the first invalid reading or packing argument of a run's rows
    (`meshkd.recipe.corpus.data.build_run_datasets`)."""
    if not isinstance(sequence_length, int) or sequence_length < 2:
        # One token has no next-token target, so a row needs two to train on anything.
        raise ValueError(f"sequence_length must be an integer >= 2, got {sequence_length!r}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if format is not None and format not in _FORMATS:
        raise ValueError(f"format must be one of {_FORMATS} or None (by extension), got {format!r}")
    if max_documents is not None and max_documents < 1:
        raise ValueError(f"max_documents must be >= 1 or None, got {max_documents}")
    if max_document_chars is not None and max_document_chars < 1:
        raise ValueError(f"max_document_chars must be >= 1 or None, got {max_document_chars}")
    try:
        codecs.lookup_error(encoding_errors)
    except LookupError:
        raise ValueError(f"unknown encoding_errors handler {encoding_errors!r} (e.g. 'strict', 'replace')") from None


def reading_arguments(dataset, tokenizer: PreTrainedTokenizerBase | None = None,
                      teachers: list[str] | None = None, teacher_tokenizer=None) -> dict:
    """The `dataset` section as `meshkd.recipe.corpus.data.split_texts`' arguments (what a run reads and splits);
    `tokenizer` renders chat rows (`teacher_tokenizer` too, with `kd.cross_tokenizer`), `teachers` are the names
    routed rows may give (`meshkd.recipe.records.record_reader`)."""
    return {"paths": [expand_path(p) for p in dataset.paths], "val_fraction": dataset.val_fraction,
            "seed": dataset.seed, "format": dataset.format, "max_documents": dataset.max_documents,
            "max_document_chars": dataset.max_document_chars, "on_bad_file": dataset.on_bad_file,
            "read_record": record_reader(dataset, tokenizer, teachers, teacher_tokenizer), "hf_section": dataset.hf}


def corpus_documents(*, paths, seed: int, hf_section=None, max_documents: int | None = None,
                     **reading) -> Iterator[Document]:
    """The documents `split_texts` reads, in corpus order, one at a time (`documents.iter_documents`'s
    `reading` arguments); ValueError when there is none."""
    patterns = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not patterns and hf_section is None:
        raise ValueError("paths is empty: give at least one file path or glob pattern")
    files = match_files(patterns)
    if max_documents is not None:
        files = [files[i] for i in _permutation(len(files), seed)]
    count = 0
    for document in iter_documents(files, max_documents=max_documents, hf_section=hf_section, **reading):
        count += 1
        yield document
    if not count:
        where = f"the {len(files)} file(s) matched by {describe_patterns(patterns)}" + (
            f" and dataset.hf {hf_section.path!r}" if hf_section is not None else "")
        raise ValueError(f"no non-empty document in {where}")


def validation_documents(num_documents: int, val_fraction: float, seed: int) -> torch.Tensor:
    """Indices of the documents held out for validation: a seeded share, at least one when `val_fraction` > 0."""
    num_val = 0 if val_fraction == 0 else max(1, round(val_fraction * num_documents))
    if num_val >= num_documents:
        raise ValueError(
            f"val_fraction={val_fraction} of {num_documents} document(s) leaves no document, and so no packed "
            f"row, for training; add documents or lower val_fraction"
        )
    return torch.randperm(num_documents, generator=torch.Generator().manual_seed(seed))[:num_val]


def _permutation(size: int, seed: int) -> list[int]:
    # torch's CPU generator gives the same permutation for the same seed on every machine and version
    # we support, unlike Python's hash-randomized structures; every seeded choice here goes through it.
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(size, generator=generator).tolist()

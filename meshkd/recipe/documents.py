"""Documents: the files a dataset's paths match, read as text documents with errors naming file and line.

Plain text files are one document each; JSONL files one document per line, under `text_key` (a file ending
in `.jsonl`, or every file with `format: jsonl`). Files are read as bytes and decoded here, so an invalid
byte is reported with its file (and line), not deep inside the tokenizer.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from pathlib import Path


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


def read_documents(
    files: list[str],
    *,
    text_key: str,
    format: str | None,
    max_documents: int | None,
    max_document_chars: int | None,
    encoding_errors: str,
) -> list[str]:
    documents: list[str] = []
    for path in files:
        is_jsonl = format == "jsonl" or (format is None and Path(path).suffix.lower() == ".jsonl")
        if is_jsonl:
            texts = _jsonl_documents(path, text_key, encoding_errors)
        else:
            texts = _text_document(path, encoding_errors)
        for text in texts:
            if not text.strip():
                continue
            documents.append(text if max_document_chars is None else text[:max_document_chars])
            if max_documents is not None and len(documents) == max_documents:
                return documents  # stop reading: a cap on a large corpus should not read all of it
    return documents


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise ValueError(f"cannot read data file {path!r}: {error}") from error


def _text_document(path: str, encoding_errors: str) -> Iterator[str]:
    try:
        yield _read_bytes(path).decode("utf-8", errors=encoding_errors)
    except UnicodeDecodeError as error:
        raise ValueError(
            f"data file {path!r} is not valid UTF-8 ({error}); pass encoding_errors='replace' to read it anyway"
        ) from None


def _jsonl_documents(path: str, text_key: str, encoding_errors: str) -> Iterator[str]:
    for number, raw in enumerate(_read_bytes(path).splitlines(), start=1):
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
        if text_key not in record:
            keys = ", ".join(repr(key) for key in list(record)[:8])
            raise ValueError(f"{where}: no text_key {text_key!r} in the object (its keys: {keys or 'none'})")
        text = record[text_key]
        if not isinstance(text, str):
            raise ValueError(f"{where}: {text_key!r} holds a {type(text).__name__}, not a string")
        yield text

"""Hugging Face `datasets` as a source of rows, read offline: files, `save_to_disk` directories, Hub ids.

- A file of `dataset.paths` ending in `.parquet`, `.csv`, `.arrow` or `.json` is read with the `datasets` builder
  of that name, streamed (row by row, no Arrow copy written to the datasets cache).
- `dataset.hf` names one dataset: a `save_to_disk` directory (`load_from_disk`), or an id or builder for
  `load_dataset` (a Hub id is read from the local Hugging Face cache: meshkd sets `HF_DATASETS_OFFLINE=1`
  unless the environment sets it), with its subset (`name`), `split`, `revision`, `data_files` and `streaming`.
Rows come as `(row dict, where)`, `where` naming the source and row index for errors; any failure to open a
source is one ValueError naming it. `datasets` is imported only when such a source is read.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BUILDERS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow", ".json": "json"}
"""File extension -> the `datasets` builder that reads such a file."""


def builder_of(path: str) -> str | None:
    """The `datasets` builder of a data file, or None when meshkd reads it itself (text, JSONL)."""
    return BUILDERS.get(Path(path).suffix.lower())


def file_rows(path: str) -> Iterator[tuple[dict, str]]:
    """The rows of one parquet / CSV / arrow / JSON file, streamed."""
    datasets = _datasets()
    try:
        rows = datasets.load_dataset(builder_of(path), data_files=path, split="train", streaming=True)
        yield from ((row, f"{path} row {index}") for index, row in enumerate(rows))
    except Exception as error:  # datasets and pyarrow raise their own types for a malformed file
        raise ValueError(f"cannot read data file {path!r} with datasets ({type(error).__name__}: "
                         f"{_first_line(error)})") from None


def section_rows(section) -> Iterator[tuple[dict, str]]:
    """The rows of the dataset `dataset.hf` names (`HFDatasetConfig`)."""
    rows, label = _open(section), f"dataset.hf {section.path!r} split {section.split!r}"
    for index, row in enumerate(rows):
        yield row, f"{label} row {index}"


def _open(section):
    datasets = _datasets()
    path = os.path.expanduser(section.path)
    try:
        if os.path.isdir(path) and any(os.path.exists(os.path.join(path, name))
                                       for name in ("state.json", "dataset_dict.json")):
            loaded = datasets.load_from_disk(path)
            if isinstance(loaded, datasets.DatasetDict):
                if section.split not in loaded:
                    raise ValueError(f"no split {section.split!r} (its splits: {', '.join(loaded)})")
                loaded = loaded[section.split]
            return loaded.to_iterable_dataset() if section.streaming else loaded
        return datasets.load_dataset(path, section.name, split=section.split, revision=section.revision,
                                     data_files=section.data_files, streaming=section.streaming)
    except Exception as error:
        hint = ("" if os.path.exists(path) else
                " (not a local file or directory: a Hub id is read from the local Hugging Face cache, which does "
                "not hold it, or the network)")
        raise ValueError(f"dataset.hf.path {section.path!r}: cannot load it ({type(error).__name__}: "
                         f"{_first_line(error)}){hint}") from None


def _datasets():
    # Hub ids are read from the local cache, not fetched (a run never downloads data); HF_DATASETS_OFFLINE=0
    # set by the user lets `datasets` download. Read when `datasets` is first imported, so set before it.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise ValueError("reading parquet, CSV, arrow or JSON data and dataset.hf needs the `datasets` package "
                         "(pip install 'meshkd[recipe]')") from None
    datasets.logging.set_verbosity_error()  # no per-file progress bars: meshkd reports what it reads
    datasets.disable_progress_bars()
    return datasets


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def hf_fingerprint(section) -> dict[str, Any]:
    """The `dataset.hf` section, with every file of a local dataset directory by path, size and mtime."""
    fingerprint = dataclasses.asdict(section)
    path = os.path.expanduser(section.path)
    if os.path.isdir(path):
        fingerprint["files"] = [[name, os.path.getsize(os.path.join(path, name)),
                                 os.path.getmtime(os.path.join(path, name))]
                                for name in sorted(os.listdir(path)) if os.path.isfile(os.path.join(path, name))]
    return fingerprint

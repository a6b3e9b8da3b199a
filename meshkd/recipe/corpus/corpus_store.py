"""A dataset section's token store: the corpus tokenized once per host into a `meshkd.recipe.corpus.token_store`,
packed once, and opened as each split's rows.

Design:
- `dataset.token_store: DIR` keeps each corpus's tokens under DIR/<key digest>/, the key being what the tokens
  depend on: every source file by path, size and mtime (a `dataset.hf` directory's files likewise, a Hub id by
  name and revision), the tokenizer's fingerprint and chat template, and the reading settings (those of every
  row and the row format's `settings_keys`, `meshkd.recipe.records`). A changed source or tokenizer gives another
  key, so a new store is written (and the run says so); the old one stays until removed.
- The first process of a host to take the store's file lock writes it, the others wait for the lock under
  `setup_timeout_s`. With `dataset.tokenize_workers` > 1 it reads the rows and hands them in chunks to worker
  processes that render and tokenize them, in order.
- A packing plan per (sequence length, packing, split) is computed from the document offsets alone (the
  split and first-fit packing of `meshkd.recipe.corpus.data`'s module docstring; routed rows packed teacher by
  teacher, `meshkd.recipe.corpus.routing`, each row's teacher in the plan) and kept beside the tokens.
- A cross-tokenizer corpus (`kd.cross_tokenizer`) keeps both sides' tokens and each document's groups; its plan
  packs as `meshkd.recipe.corpus.aligned_data.AlignedPacking` packs texts (`plan_aligned`: pieces of whole groups,
  first fit on both sides), its rows `StoredAlignedRows`.
- Whole on-policy prompts are a corpus of their own, stored and planned the same way (one per row, unpacked):
  those of chat / prompt_completion rows (each row's text before its last answer, read by
  `meshkd.recipe.records.prompt_reader`) under the key of the rows plus `prompts`, those of text rows under
  `dataset.prompt_key` as the corpus of that column. Each prompt is tokenized from its own text, not cut from
  the rows' tokens: a prompt's tokens need not be a prefix of its row's (BPE merges across the boundary).
- `StoredRows` is a split's rows (`meshkd.recipe.corpus.stored_rows`, with the plans): a batch is built on demand from
  the memory-mapped tokens, so a rank's resident memory does not grow with the corpus.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshkd.core.aligned_packing import pad_token_id
from meshkd.recipe.common.files import cache_root
from meshkd.recipe.common.metrics import warn0
from meshkd.recipe.corpus import documents
from meshkd.recipe.corpus.aligned_data import encode_aligned
from meshkd.recipe.corpus.hf_sources import hf_fingerprint
from meshkd.recipe.corpus.stored_rows import StoredAlignedRows, StoredRows, plan_aligned, plan_routed, plan_split
from meshkd.recipe.corpus.token_store import PLAN_CHECKSUMS, TokenStore, load_plan, save_plans
from meshkd.recipe.corpus.tokenizing import TOKENIZE_CHUNK, tokenize_documents, tokenizer_fingerprint
from meshkd.recipe.records import format_named, prompt_reader, record_reader
from meshkd.recipe.settings.config_loading import expand_path


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:24]


@contextlib.contextmanager
def _host_lock(path: Path, timeout_s: float) -> Iterator[None]:
    """An exclusive lock on `path` among this host's processes; ValueError after `timeout_s` of waiting."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ValueError(f"waited {timeout_s:.0f} s (setup_timeout_s) for another process writing the "
                                     f"token store ({path}); raise setup_timeout_s for a large corpus") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def store_root(dataset) -> Path:
    """The directory of a run's token stores: `dataset.token_store`, else `token-stores` in meshkd's cache
    directory (`$MESHKD_CACHE`, else ~/.cache/meshkd); where that cannot be written, this user's folder in the
    system's temporary directory, said in a warning (a second run there reuses it while it lasts)."""
    if dataset.token_store is not None:
        return Path(expand_path(dataset.token_store))
    root = _writable_or_fallback(cache_root() / "token-stores")
    root.mkdir(parents=True, exist_ok=True)  # again: it may have been removed since
    return root


@functools.cache
def _writable_or_fallback(root: Path) -> Path:
    """`root` if this process can write there, else the fallback (`store_root`), found once a process."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=root).close()
        return root
    except OSError as error:
        fallback = Path(tempfile.gettempdir()) / f"meshkd-{os.getuid()}" / "token-stores"
        warn0(f"cannot write token stores under {root} ({error.strerror or error}): writing them under {fallback} "
              f"(dataset.token_store or $MESHKD_CACHE chooses the directory)")
        return fallback


def stored_datasets(tokenizer, dataset, *, sequence_length: int, pack: bool, wait_s: float,
                    routes: list[str] | None = None, progress: bool = True, aligned=None,
                    prompts: bool = False) -> tuple[StoredRows, StoredRows]:
    """(train, validation) rows of a recipe's `dataset` section read from its token store (under `store_root`),
    which this process writes first when no store of these sources, tokenizer and settings exists yet; `routes`:
    the teachers' names rows routed by `dataset.teacher_key` give (their order: the teacher indices).

    `aligned` (`meshkd.recipe.corpus.aligned_data.AlignedPacking`, `kd.cross_tokenizer`): the store holds both sides'
    tokens and each document's groups, and the rows are its packing's (`StoredAlignedRows`).

    `prompts`: the store holds each chat or prompt / completion row's on-policy prompt in place of the row
    (`meshkd.recipe.records.prompt_reader`), a corpus of its own under its own key. The on-policy prompts of text
    rows under `dataset.prompt_key` need nothing more: they are the corpus of that column (`dataset.text_key` set
    to it)."""
    teacher = None if aligned is None else aligned.teacher_tokenizer
    row_format = format_named(dataset.records)
    arguments = documents.reading_arguments(dataset, tokenizer, routes, teacher_tokenizer=teacher)
    if prompts:
        arguments["read_record"] = prompt_reader(arguments["read_record"])
    key = store_key(tokenizer, dataset, arguments) | {"routes": routes} | ({"prompts": True} if prompts else {})
    if teacher is not None:
        key["teacher"] = {"tokenizer": tokenizer_fingerprint(teacher),
                          "chat_template": teacher.chat_template if row_format.rendered else None}
    root = store_root(dataset)
    directory = root / digest(key)
    split_key = {"sequence_length": sequence_length, "packing": pack, "val_fraction": dataset.val_fraction,
                 "seed": dataset.seed}
    if aligned is not None:
        split_key["teacher_sequence_length"] = aligned.teacher_sequence_length
    plans = directory / f"plan-{digest(split_key)}"
    with _host_lock(root / f"{directory.name}.lock", wait_s):
        if not (directory / "manifest.json").exists():
            others = [path.name for path in root.glob("*/manifest.json")]
            what = "the on-policy prompts" if prompts else "the corpus"
            print(f"meshkd: tokenizing {what} once into {directory}" + (
                f" ({len(others)} store(s) of other sources, tokenizer or settings there)" if others else ""),
                file=sys.stderr, flush=True)
            TokenStore.write(directory, key, _tokenized(tokenizer, dataset, arguments, routes, aligned, prompts),
                             len(tokenizer), masked=row_format.marks_answers and not prompts,
                             routed=routes is not None,
                             progress=progress, teacher_vocabulary=None if teacher is None else len(teacher))
        store = TokenStore(directory)
        if plans.exists() and not (plans / PLAN_CHECKSUMS).exists():
            shutil.rmtree(plans)  # a plan written before plans had checksums: computed again, as it is cheap
        if not plans.exists():
            lengths = store.document_lengths()
            held_out = np.zeros(len(lengths), dtype=bool)
            held_out[documents.validation_documents(len(lengths), dataset.val_fraction, dataset.seed).numpy()] = True
            starts = store.offsets[:-1]

            def plan(chosen: np.ndarray) -> dict[str, np.ndarray]:
                if aligned is not None:
                    return plan_aligned(store, np.flatnonzero(chosen), aligned)
                if store.routes is None:
                    return plan_split(lengths[chosen], starts[chosen], sequence_length, pack=pack)
                return plan_routed(lengths[chosen], starts[chosen], store.routes[chosen], len(routes),
                                   sequence_length, pack=pack)

            save_plans(plans, {split: plan(chosen)
                               for split, chosen in (("train", ~held_out), ("validation", held_out))})
    if aligned is not None:
        return tuple(StoredAlignedRows(store, load_plan(plans / split), aligned) for split in ("train", "validation"))
    pad = pad_token_id(tokenizer)
    train, val = (StoredRows(store, load_plan(plans / split), sequence_length=sequence_length, pad_token_id=pad)
                  for split in ("train", "validation"))
    return train, val


def _tokenized(tokenizer, dataset, arguments: dict, routes: list[str] | None, aligned=None,
               prompts: bool = False) -> Iterator[list]:
    """Chunks of the corpus's tokenized documents, in corpus order: (ids, trains, route index) per document
    (`tokenizing.tokenize_documents`, empty ones kept; the index in `routes` of the teacher it names, None
    unless routed), and with `aligned` the teacher's ids and trains and the groups (`_tokenize_chunk`). With
    `dataset.tokenize_workers` > 1 (and no `max_documents`, whose count needs the documents in order), the
    rows are read here and turned into documents and tokens in worker processes, `imap` keeping the order;
    `prompts`: the workers read each row's on-policy prompt, as `arguments["read_record"]` does."""
    reading = {name: value for name, value in arguments.items() if name != "val_fraction"}
    if dataset.tokenize_workers <= 1 or dataset.max_documents is not None:
        corpus = documents.corpus_documents(**reading, encoding_errors="replace")
        yield from (_tokenize_chunk(tokenizer, chunk, routes, aligned) for chunk in _chunks(corpus))
        return
    files = documents.match_files(arguments["paths"]) if arguments["paths"] else []
    rows = documents.iter_rows(files, format=dataset.format, encoding_errors="replace",
                               on_bad_file=dataset.on_bad_file, read_record=arguments["read_record"],
                               hf_section=dataset.hf)
    # Spawned, not forked (the tokenizer and torch run threads); so a script of the user's own that builds the
    # data guards its entry point, as multiprocessing requires (the meshkd commands do).
    context = multiprocessing.get_context("spawn")
    with context.Pool(dataset.tokenize_workers, initializer=_start_worker,
                      initargs=(tokenizer, dataset, routes, aligned, prompts)) as pool:
        yield from pool.imap(_tokenize_rows, _chunks(rows))


def _tokenize_chunk(tokenizer, chunk: list, routes: list[str] | None, aligned=None) -> list[tuple]:
    """(ids, trains, route index) of each document of `chunk` (see `_tokenized`); with `aligned`, also the
    teacher's ids and trains and the groups' bounds (int64 [groups + 1, 3]), as
    `meshkd.recipe.corpus.aligned_data.encode_aligned` gives them."""
    indices = [None if routes is None else routes.index(document.route) for document in chunk]
    if aligned is None:
        return [(ids, trains, index) for (ids, trains), index
                in zip(tokenize_documents(tokenizer, chunk, keep_empty=True), indices)]
    sides = encode_aligned(chunk, aligned.student_tokenizer, aligned.teacher_tokenizer)
    return [(np.array(student.ids, dtype=np.int64), student_trains, index, np.array(teacher.ids, dtype=np.int64),
             teacher_trains, np.array([alignment.student_bounds, alignment.teacher_bounds, alignment.byte_bounds],
                                      dtype=np.int64).T)
            for student, student_trains, teacher, teacher_trains, alignment, index in zip(*sides, indices)]


_WORKER: dict = {}


def _start_worker(tokenizer, dataset, routes: list[str] | None, aligned=None, prompts: bool = False) -> None:
    read = record_reader(dataset, tokenizer, routes, None if aligned is None else aligned.teacher_tokenizer)
    _WORKER.update(tokenizer=tokenizer, read=prompt_reader(read) if prompts else read, routes=routes,
                   cut=dataset.max_document_chars, aligned=aligned)


def _tokenize_rows(rows: list) -> list[tuple]:
    """A worker's chunk: rows -> documents -> tokens, as numpy arrays (torch tensors would travel as shared
    memory handles, one per array)."""
    chunk = [document for document in (documents.to_document(_WORKER["read"], record, where, _WORKER["cut"])
                                        for record, where in rows) if document is not None]
    return [tuple(value.numpy() if isinstance(value, torch.Tensor) else value for value in document)
            for document in _tokenize_chunk(_WORKER["tokenizer"], chunk, _WORKER["routes"], _WORKER["aligned"])]


def store_key(tokenizer, dataset, arguments: dict) -> dict:
    """What a store's tokens depend on (see the module docstring)."""
    files = documents.match_files(arguments["paths"]) if arguments["paths"] else []
    row_format = format_named(dataset.records)
    reading = ("format", "records", "text_key", "max_documents", "max_document_chars", "on_bad_file")
    settings = {name: getattr(dataset, name) for name in (*reading, *row_format.settings_keys)}
    if dataset.chat_roles:  # only when set: the stores of runs without it keep their keys
        settings["chat_roles"] = dataset.chat_roles
    return {"sources": [[path, os.path.getsize(path), os.stat(path).st_mtime_ns] for path in files],
            "dataset.hf": None if dataset.hf is None else hf_fingerprint(dataset.hf),
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "chat_template": tokenizer.chat_template if row_format.rendered else None,
            "seed": dataset.seed if dataset.max_documents is not None else None, "settings": settings}


TOKENIZE_CHARS = 1 << 20
"""A chunk of documents ends at this many characters too: what tokenizing it holds (the ids as Python ints, the
tokenizer's encodings) stays bounded whatever the documents' sizes, so the writing process's memory does not
follow the corpus's largest documents."""


def _chunks(documents: Iterable) -> Iterator[list]:
    """`TOKENIZE_CHUNK` documents at a time, fewer where they reach `TOKENIZE_CHARS` (rows for workers: by count)."""
    chunk, chars = [], 0
    for document in documents:
        chunk.append(document)
        chars += len(document) if isinstance(document, str) else 0
        if len(chunk) == TOKENIZE_CHUNK or chars >= TOKENIZE_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk

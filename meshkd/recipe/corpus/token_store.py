"""Token store: a corpus tokenized once into flat files, packed once, read by every rank through memory maps.

Design:
- `dataset.token_store: DIR` keeps each corpus's tokens under DIR/<key digest>/, the key being what the tokens
  depend on: every source file by path, size and mtime (a `dataset.hf` directory's files likewise, a Hub id by
  name and revision), the tokenizer's fingerprint and chat template, and the reading settings (those of every
  row and the row format's `settings_keys`, `meshkd.recipe.records`). A changed source or tokenizer gives another
  key, so a new store is written (and the run says so); the old one stays until removed.
- Files: `tokens.bin` (every document's ids back to back, in the smallest unsigned type that holds the
  vocabulary), `trains.bin` (a byte per token, 1 where it trains, for chat / prompt_completion rows),
  `documents.bin` (int64 [documents + 1] offsets), `routes.bin` (int32, each document's teacher index in
  `teachers`, for rows routed by `dataset.teacher_key`) and `manifest.json` (the key, the counts, and a CRC-32 per
  MiB block of each file). Written in a temporary directory and renamed into place, so nothing half-written is
  ever read; the first process of a host to take the store's file lock writes it, the others wait for the
  lock under `setup_timeout_s`. With `dataset.tokenize_workers` > 1 it reads the rows and hands them in chunks
  to worker processes that render and tokenize them, in order.
- A packing plan per (sequence length, packing, split) is computed from the document offsets alone (the
  split and first-fit packing of `meshkd.recipe.corpus.data`'s module docstring; routed rows packed teacher by
  teacher, `meshkd.recipe.corpus.routing`, each row's teacher in the plan) and kept beside the tokens in
  `plan-<digest>/`, written the same way, with the sha256 of each of its arrays (`sha256.json`), checked when a
  run opens the plan.
- A cross-tokenizer corpus (`kd.cross_tokenizer`) keeps the teacher's tokens beside the student's and each
  document's groups (`meshkd.core.token_alignment.Alignment` bounds); its plan packs as
  `meshkd.recipe.corpus.aligned_data.AlignedPacking` packs texts (`plan_aligned`: pieces of whole groups, first fit
  on both sides), its rows `StoredAlignedRows`.
- Whole on-policy prompts are a corpus of their own, stored and planned the same way (one per row, unpacked):
  those of chat / prompt_completion rows (each row's text before its last answer, read by
  `meshkd.recipe.records.prompt_reader`) under the key of the rows plus `prompts`, those of text rows under
  `dataset.prompt_key` as the corpus of that column. Each prompt is tokenized from its own text, not cut from
  the rows' tokens: a prompt's tokens need not be a prefix of its row's (BPE merges across the boundary).
- `StoredRows` is a split's rows (`meshkd.recipe.corpus.stored_rows`, with the plans): a batch is built on demand from
  the memory-mapped tokens, so a rank's resident memory does not grow with the corpus. Each MiB block is
  checked against its CRC-32 the first time this process reads it: damaged bytes are refused naming the file,
  never read silently.
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
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshkd.core.aligned_packing import pad_token_id
from meshkd.core.token_alignment import Alignment
from meshkd.recipe.common.files import cache_root, file_sha256
from meshkd.recipe.common.metrics import warn0
from meshkd.recipe.corpus import documents
from meshkd.recipe.corpus.aligned_data import encode_aligned
from meshkd.recipe.corpus.hf_sources import hf_fingerprint
from meshkd.recipe.corpus.stored_rows import StoredAlignedRows, StoredRows, plan_aligned, plan_routed, plan_split
from meshkd.recipe.corpus.tokenizing import TOKENIZE_CHUNK, tokenize_documents, tokenizer_fingerprint
from meshkd.recipe.records import format_named, prompt_reader, record_reader
from meshkd.recipe.settings.config_loading import expand_path

FORMAT, VERSION = "meshkd-token-store", 1
BLOCK = 1 << 20
"""Bytes per checksummed block."""
PLAN_CHECKSUMS = "sha256.json"
"""A packing plan's file: the sha256 of each of its arrays."""
_IGNORE = -100


def token_dtype(vocabulary: int) -> np.dtype:
    """The smallest unsigned integer type that holds every id of a vocabulary of this size."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocabulary - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:24]


class _Checked:
    """A memory-mapped file whose MiB blocks are checked against the manifest's CRC-32s when first read."""

    def __init__(self, path: Path, dtype: np.dtype, crcs: list[int], size: int) -> None:
        actual = path.stat().st_size if path.exists() else -1
        if actual != size:
            raise ValueError(f"token store file {path} holds {actual} bytes, its manifest says {size}: damaged or "
                             f"half-copied; remove {path.parent} to rebuild it")
        self.path, self.crcs, self.dtype = path, crcs, dtype
        self.array = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
        self.checked = np.zeros(len(crcs), dtype=bool)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements [start, stop), their blocks checked first."""
        itemsize = self.dtype.itemsize
        first, last = start * itemsize // BLOCK, max(start, stop - 1) * itemsize // BLOCK
        for block in range(first, last + 1):
            if not self.checked[block]:
                raw = self.array.view(np.uint8)[block * BLOCK : (block + 1) * BLOCK]
                if zlib.crc32(raw) != self.crcs[block]:
                    raise ValueError(f"token store file {self.path}: block {block} (bytes {block * BLOCK} on) does "
                                     f"not match its checksum: damaged; remove {self.path.parent} to rebuild it")
                self.checked[block] = True
        return self.array[start:stop]

    def whole(self) -> np.ndarray:
        return self.read(0, len(self.array))


def _block_crcs(path: Path) -> list[int]:
    crcs = []
    with open(path, "rb") as file:
        while block := file.read(BLOCK):
            crcs.append(zlib.crc32(block))
    return crcs


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


def _write_atomically(directory: Path, write) -> None:
    """`write(tmp)` fills a temporary directory, then it becomes `directory` by one rename."""
    tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        os.rename(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class TokenStore:
    """One corpus's tokens on disk (see the module docstring): `write` it, then open it to read pieces."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        manifest_path = directory / "manifest.json"
        try:
            self.manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"{manifest_path}: not a readable token store manifest ({error})") from None
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise ValueError(f"{manifest_path}: not a meshkd token store of version {VERSION}")
        files = self.manifest["files"]
        self.tokens = _Checked(directory / "tokens.bin", np.dtype(self.manifest["token_dtype"]),
                               files["tokens.bin"]["crc32"], files["tokens.bin"]["bytes"])
        self.trains = (_Checked(directory / "trains.bin", np.dtype(np.uint8), files["trains.bin"]["crc32"],
                                files["trains.bin"]["bytes"]) if "trains.bin" in files else None)
        offsets = _Checked(directory / "documents.bin", np.dtype(np.int64), files["documents.bin"]["crc32"],
                           files["documents.bin"]["bytes"])
        self.offsets = offsets.whole()
        self.routes = (_Checked(directory / "routes.bin", np.dtype(np.int32), files["routes.bin"]["crc32"],
                                files["routes.bin"]["bytes"]).whole() if "routes.bin" in files else None)
        if len(self.offsets) != self.manifest["documents"] + 1 or self.offsets[-1] != self.manifest["tokens"]:
            raise ValueError(f"token store {directory}: its document index does not match its manifest")
        self.two_sided = "teacher_tokens.bin" in files
        if self.two_sided:  # a cross-tokenizer corpus: the teacher's tokens and each document's groups
            def checked(name: str, dtype) -> _Checked:
                return _Checked(directory / name, np.dtype(dtype), files[name]["crc32"], files[name]["bytes"])

            self.teacher_tokens = checked("teacher_tokens.bin", self.manifest["teacher_token_dtype"])
            self.teacher_trains = checked("teacher_trains.bin", np.uint8) if "teacher_trains.bin" in files else None
            self.teacher_offsets = checked("teacher_documents.bin", np.int64).whole()
            self.groups = checked("groups.bin", np.int64)
            self.group_offsets = checked("group_documents.bin", np.int64).whole()
            if (len(self.teacher_offsets) != len(self.offsets) or len(self.group_offsets) != len(self.offsets)
                    or self.teacher_offsets[-1] != self.manifest["teacher_tokens"]
                    or self.group_offsets[-1] * 3 != len(self.groups.array)):
                raise ValueError(f"token store {directory}: its teacher or group index does not match its manifest")

    @staticmethod
    def write(directory: Path, key: dict, documents: Iterable[list[tuple]], vocabulary: int, *, masked: bool,
              routed: bool, progress: bool, teacher_vocabulary: int | None = None) -> None:
        """Write the store of `documents` (chunks of (ids, trains, route index): `tokenizing.tokenize_documents`'
        output with each document's teacher index, None unless `routed`) at `directory`, atomically.

        With `teacher_vocabulary` (a cross-tokenizer corpus) each document also gives the teacher's ids and
        trains and its groups (int64 [groups + 1, 3]: the student, teacher and byte bounds of its `Alignment`),
        kept in `teacher_tokens.bin`, `teacher_trains.bin`, `teacher_documents.bin` (offsets), `groups.bin` and
        `group_documents.bin` (offsets, in rows of 3)."""
        sides = [("", token_dtype(vocabulary))]
        if teacher_vocabulary is not None:
            sides.append(("teacher_", token_dtype(teacher_vocabulary)))

        def fill(tmp: Path) -> None:
            count, tokens, groups = 0, [0] * len(sides), 0
            offsets = [[np.zeros(1, dtype=np.int64)] for _ in sides]
            group_offsets = [np.zeros(1, dtype=np.int64)]
            bar = _progress(progress)
            with contextlib.ExitStack() as files:
                def output(name: str, wanted: bool = True):
                    return files.enter_context(open(tmp / name, "wb")) if wanted else None

                ids_files = [output(f"{side}tokens.bin") for side, _ in sides]
                trains_files = [output(f"{side}trains.bin", masked) for side, _ in sides]
                routes_file = output("routes.bin", routed)
                groups_file = output("groups.bin", len(sides) > 1)
                for chunk in documents:
                    if routes_file is not None:
                        routes_file.write(np.array([document[2] for document in chunk], dtype=np.int32).tobytes())
                    for index, (_, dtype) in enumerate(sides):
                        at = 0 if index == 0 else 3  # (ids, trains, route[, teacher ids, teacher trains, groups])
                        for document in chunk:  # torch tensors, or numpy arrays from tokenizing workers
                            ids, trains = document[at], document[at + 1]
                            ids_files[index].write(np.asarray(ids).astype(dtype).tobytes())
                            if trains_files[index] is not None:
                                mask = np.ones(len(ids), dtype=bool) if trains is None else np.asarray(trains)
                                trains_files[index].write(mask.astype(np.uint8).tobytes())
                        lengths = np.array([len(document[at]) for document in chunk], dtype=np.int64)
                        offsets[index].append(tokens[index] + np.cumsum(lengths))
                        tokens[index] += int(lengths.sum())
                    if groups_file is not None:
                        bounds = [np.asarray(document[5], dtype=np.int64).reshape(-1, 3) for document in chunk]
                        for rows in bounds:
                            groups_file.write(rows.tobytes())
                        group_offsets.append(groups + np.cumsum([len(rows) for rows in bounds], dtype=np.int64))
                        groups = int(group_offsets[-1][-1])
                    count += len(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
                        bar.set_postfix(tokens=tokens[0])
            if bar is not None:
                bar.close()
            if count == 0:
                raise ValueError("no non-empty document in dataset.paths / dataset.hf")
            names = ["routes.bin"] * routed
            for index, (side, _) in enumerate(sides):
                np.concatenate(offsets[index]).tofile(tmp / f"{side}documents.bin")
                names += [f"{side}tokens.bin", f"{side}documents.bin"] + [f"{side}trains.bin"] * masked
            manifest = {"format": FORMAT, "version": VERSION, "key": key, "documents": count, "tokens": tokens[0],
                        "token_dtype": sides[0][1].name}
            if len(sides) > 1:
                np.concatenate(group_offsets).tofile(tmp / "group_documents.bin")
                names += ["groups.bin", "group_documents.bin"]
                manifest.update(teacher_tokens=tokens[1], teacher_token_dtype=sides[1][1].name, groups=groups)
            manifest["files"] = {name: {"bytes": (tmp / name).stat().st_size, "crc32": _block_crcs(tmp / name)}
                                 for name in names}
            (tmp / "manifest.json").write_text(json.dumps(manifest))

        _write_atomically(directory, fill)

    def document_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def piece(self, start: int, length: int, *, teacher: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens [start, start + length) and whether each trains (None: all do); the teacher's with `teacher`."""
        tokens, trains = (self.teacher_tokens, self.teacher_trains) if teacher else (self.tokens, self.trains)
        return tokens.read(start, start + length), None if trains is None else trains.read(start, start + length)

    def group_bounds(self, first: int, stop: int) -> np.ndarray:
        """Rows [first, stop) of the groups' bounds (int64 [rows, 3]: student, teacher, byte)."""
        return self.groups.read(3 * first, 3 * stop).reshape(-1, 3)

    def alignment(self, document: int):
        """The `meshkd.core.token_alignment.Alignment` of a document of a two-sided store."""
        bounds = self.group_bounds(int(self.group_offsets[document]), int(self.group_offsets[document + 1]))
        return Alignment(*(tuple(bounds[:, side].tolist()) for side in range(3)))


def _progress(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(desc="meshkd: tokenizing", unit=" docs", file=sys.stderr, mininterval=1.0)


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


def load_plan(directory: Path) -> dict[str, np.ndarray]:
    """A split's packing plan (`save_plans`), each file checked against its sha256 first: a damaged or missing
    file is refused naming it."""
    sums = json.loads((directory.parent / PLAN_CHECKSUMS).read_text())
    expected = {name.split("/", 1)[1]: value for name, value in sums.items() if name.startswith(f"{directory.name}/")}
    found = {path.name for path in directory.glob("*.npy")}
    for name in sorted(set(expected) | found):
        path = directory / name
        if name not in expected or not path.is_file() or file_sha256(path) != expected[name]:
            raise ValueError(f"token store file {path} does not match the plan's checksums ({PLAN_CHECKSUMS}): "
                             f"damaged; remove {directory.parent} to rebuild it")
    return {Path(name).stem: np.load(directory / name, mmap_mode="r") for name in sorted(expected)}


def save_plans(directory: Path, plans: dict[str, dict[str, np.ndarray]]) -> None:
    """Write each split's plan arrays as SPLIT/NAME.npy, with their sha256s in `PLAN_CHECKSUMS`."""
    def fill(tmp: Path) -> None:
        sums = {}
        for split, plan in plans.items():
            (tmp / split).mkdir()
            for name, array in plan.items():
                np.save(tmp / split / f"{name}.npy", array)
                sums[f"{split}/{name}.npy"] = file_sha256(tmp / split / f"{name}.npy")
        (tmp / PLAN_CHECKSUMS).write_text(json.dumps(sums, indent=1))
    _write_atomically(directory, fill)

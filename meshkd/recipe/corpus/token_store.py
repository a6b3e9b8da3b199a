"""Token store: a corpus's tokens in flat files, checksummed, written once and read through memory maps.

The format (`TokenStore`, its `write` and its reading):
- Files: `tokens.bin` (every document's ids back to back, in the smallest unsigned type that holds the
  vocabulary), `trains.bin` (a byte per token, 1 where it trains, for chat / prompt_completion rows),
  `documents.bin` (int64 [documents + 1] offsets), `routes.bin` (int32, each document's teacher index in
  `teachers`, for rows routed by `dataset.teacher_key`) and `manifest.json` (the key, the counts, and a CRC-32 per
  MiB block of each file). Written in a temporary directory and renamed into place, so nothing half-written is
  ever read.
- A cross-tokenizer corpus (`kd.cross_tokenizer`) keeps the teacher's tokens beside the student's and each
  document's groups (`meshkd.core.token_alignment.Alignment` bounds).
- Packing plans (`save_plans`, `load_plan`) are kept beside the tokens in `plan-<digest>/`, written the same way,
  with the sha256 of each of its arrays (`sha256.json`), checked when a run opens the plan.
- Each MiB block is checked against its CRC-32 the first time this process reads it: damaged bytes are refused
  naming the file, never read silently.

Which corpus a store holds, where it lives and when it is written are `meshkd.recipe.corpus.corpus_store`'s; the
rows read from it are `meshkd.recipe.corpus.stored_rows`'.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import zlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from meshkd.core.token_alignment import Alignment
from meshkd.recipe.common.files import file_sha256

FORMAT, VERSION = "meshkd-token-store", 1
BLOCK = 1 << 20
"""Bytes per checksummed block."""
PLAN_CHECKSUMS = "sha256.json"
"""A packing plan's file: the sha256 of each of its arrays."""


def token_dtype(vocabulary: int) -> np.dtype:
    """The smallest unsigned integer type that holds every id of a vocabulary of this size."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocabulary - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


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

"""The offline teacher: the teacher's answers for the rows of a run, computed once, read by many runs.

`meshkd cache-teacher CONFIG` (`meshkd.recipe.lifecycle.cache_writer`) runs only the teacher and writes them to the
directory `kd.teacher_cache` names; `meshkd train` with that key reads them instead of running a teacher.

A cache directory holds:
- `manifest.json`, written last and atomically: what the answers were computed from (the key: the data
  files with their sizes and sha256, the data and packing settings, the sequence length, the tokenizer,
  the vocabulary and the encoding, each under the config key that sets it), the teacher's identity, the
  rows held, and every shard with its size and sha256. A directory without it is an unfinished cache.
- shards `{split}-{index:05d}.safetensors`: the answers for a run of rows, each tensor [rows, sequence,
  ...] exactly as the live teacher sends them (`meshkd.recipe.teacher.teacher_worker.TeacherForward`): the
  `kd.logits_transport` encoding for training rows, each label's log-probability for validation rows.
  Each has a sidecar `.json` (its rows and checksum), renamed into place after the shard: a shard that
  looks complete is complete.
- with compact top-k answers (`kd.topk_encoding: compact`) and `kd.teacher_cache_coding: entropy` (the
  default), the training shards hold them entropy coded (`meshkd.core.cache_coding`): a variable number of
  bytes a token, found through an offset index per shard (`coded_tensors`), read back as the very compact
  answers the live teacher sends. The coding tables are fitted on the first training shard, kept in
  `coding.json` while the cache is written (a killed run continues with them) and in the manifest; the key
  records the coded layout (`kd.teacher_cache_coding`), so a cache of another layout is refused naming it.
- with hidden answers (`kd.logits_transport: hidden` or `hidden_bf16`), the teacher's output layer
  (`teacher_head/`, `meshkd.recipe.teacher.teacher_head.TeacherHead.save`), with which a training run reads
  them: the answers name its id, so that they are never read with another teacher's.

With `kd.cross_tokenizer` the teacher's answers are already projected onto the student's vocabulary, the
key also holds the alignment settings, the teacher's tokenizer and the temperature (the projection applies
it), and the teacher's tokenizer is saved in the cache (`teacher_tokenizer/`): a training run packs each
row's teacher side with it, and one whose own `teacher_model` tokenizer differs is refused.

Rows are the packed rows of the run's own data (`meshkd.recipe.corpus.data`). A student rank rebuilds its
datasets and finds a row's answer by a hash of its tokens, positions and documents, whatever batch
carries it; the digest of all row hashes refuses a dataset that packs differently. Top-k tail samples are
seeded by each row's tokens, so the answers equal the live teacher's. Cached are the training rows that
`step_scheduler.max_steps` steps visit (all once the steps span an epoch), in order of first visit (so a
longer run adds shards and keeps the earlier ones), and the validation rows evaluation reads.

Reading (`CachedTeacher`, a teacher source of `meshkd.core.teacher_protocol`): shards are memory-mapped
through safetensors, checked against their sha256 when first opened, and read one micro-batch ahead on a
background thread. `check_cache` is the preflight: every key field against the run, naming the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from meshkd.core import cache_coding
from meshkd.core.answers import LABEL_LOG_PROBS, answer_settings, selected_kind
from meshkd.core.answers.compact import CompactTopK
from meshkd.core.cache_coding import CodedAnswers, CodingTables
from meshkd.core.teacher_protocol import Batch, Encoded, TeacherFeed, TeacherRequest
from meshkd.recipe.common.files import file_sha256, write_atomically
from meshkd.recipe.corpus import documents
from meshkd.recipe.corpus.batches import to_device, training_rows
from meshkd.recipe.corpus.hf_sources import hf_fingerprint
from meshkd.recipe.corpus.rows import teacher_side
from meshkd.recipe.corpus.tokenizing import tokenizer_fingerprint
from meshkd.recipe.modeling import models
from meshkd.recipe.records import format_named
from meshkd.recipe.settings.config import ConfigError, KDRecipeConfig, TeacherConfig
from meshkd.recipe.settings.config_loading import expand_path
from meshkd.recipe.teacher.hidden_states import paired_layers

MANIFEST = "manifest.json"
FORMAT, VERSION = "meshkd-teacher-cache", 1
SPLITS = ("train", "validation")
TEACHER_TOKENIZER = "teacher_tokenizer"  # the cache's subdirectory with a cross-tokenizer teacher's tokenizer
TEACHER_HEAD = "teacher_head"  # the cache's subdirectory with the output layer that reads its hidden answers
TEACHER_KEYS = ("path", "gguf_file", "random_init", "keep_layers", "dtype", "seed", "attn_implementation")
CODING = "coding.json"  # the coding tables of an entropy-coded cache while it is written
CODED = ("coded", "lengths", "long_lengths", "row_offsets", "long_offsets", "rest_high", "tail_mean")
"""The tensors of a shard of entropy-coded compact answers, in place of "packed" (`coded_tensors`)."""


# ------------------------------------------------------------------------------------------- identity


def cache_key(config: KDRecipeConfig, teacher: TeacherConfig, tokenizer, *, vocab_size: int,
              teacher_tokenizer=None) -> dict[str, Any]:
    """What `teacher`'s answers in a run of `config` depend on, by the config key that sets each (a cache serves a
    run with the same key). `teacher_tokenizer`: the teacher's, with `kd.cross_tokenizer`."""
    dataset, kd = config.dataset, config.kd_of(teacher)
    row_format = format_named(dataset.records)
    files = documents.match_files([expand_path(pattern) for pattern in dataset.paths])
    key = {
        "dataset.paths": [[os.path.abspath(path), os.path.getsize(path), file_sha256(path)] for path in files],
        **{f"dataset.{name}": getattr(dataset, name) for name in
           ("format", "text_key", "val_fraction", "seed", "max_documents", "max_document_chars", "packing")},
        # the row format's keys (the answer-only mask is in the labels) and the template that renders its rows
        **{f"dataset.{name}": getattr(dataset, name) for name in row_format.settings_keys},
        **({"model.tokenizer.chat_template": tokenizer.chat_template} if row_format.rendered else {}),
        # only when set, so that the caches of runs without it keep their keys
        **({"dataset.chat_roles": dataset.chat_roles} if dataset.chat_roles else {}),
        **({"dataset.hf": hf_fingerprint(dataset.hf)} if dataset.hf is not None else {}),
        "step_scheduler.sequence_length": config.step_scheduler.sequence_length,
        "model.tokenizer": tokenizer_fingerprint(tokenizer),
        "vocabulary": vocab_size,
        "kd.ignore_index": kd.ignore_index,
        "kd.logits_transport": kd.logits_transport,
    }
    key.update(answer_settings(kd))
    if selected_kind(kd) is CompactTopK:  # how the cache holds them: one layout a coding
        key["kd.teacher_cache_coding"] = coded_layout(kd)
    if kd.hidden_states is not None:  # the teacher layers whose outputs the answers hold, in order
        key["kd.hidden_states.pairs (teacher layers)"] = paired_layers(config, "teacher")
    if kd.cross_tokenizer is not None:  # projected answers depend on the temperature too
        key.update({"kd.cross_tokenizer": {"loss": kd.cross_tokenizer.loss,
                                           "teacher_sequence_length": config.teacher_sequence_length},
                    "teacher_model.tokenizer": tokenizer_fingerprint(teacher_tokenizer),
                    "kd.temperature": kd.temperature})
        if row_format.rendered:  # the teacher renders the rows with its own template
            key["teacher_model.tokenizer.chat_template"] = teacher_tokenizer.chat_template
    return key


def coded_layout(kd) -> str:
    """What `kd.teacher_cache_coding` records in the key of a cache of compact answers: the coded layout's version
    (`meshkd.core.cache_coding.LAYOUT`), or "fixed"."""
    return f"entropy ({cache_coding.LAYOUT})" if kd.teacher_cache_coding == "entropy" else "fixed"


def coded_tensors(packed: torch.Tensor, fields: dict[str, Any], tables: CodingTables) -> dict[str, torch.Tensor]:
    """A shard's compact answers, "packed" [rows, sequence, nbytes], entropy coded: "coded" [bytes] the tokens'
    streams, row after row; "lengths" [rows, sequence] uint8 each stream's bytes (255: in "long_lengths" [n]
    int32, in order); the offset index "row_offsets" and "long_offsets" [rows + 1] int64, where each row's part
    of "coded" and "long_lengths" starts; "rest_high" [rows, sequence] uint8 and "tail_mean" [rows, sequence]
    float32 (empty without tail samples), what each token keeps beside its stream."""
    rows, sequence = packed.shape[:2]
    coded = cache_coding.encode({**fields, "packed": packed}, tables)
    short, long = coded.length_bytes()
    short = short.view(rows, sequence)
    long_counts = (short == cache_coding.LENGTH_ESCAPE).sum(-1)
    zero = torch.zeros(1, dtype=torch.int64)
    return {"coded": coded.data, "lengths": short, "long_lengths": long,
            "row_offsets": torch.cat([zero, coded.lengths.view(rows, sequence).sum(-1).cumsum(0)]),
            "long_offsets": torch.cat([zero, long_counts.cumsum(0)]), "rest_high": coded.rest_high.view(rows, sequence),
            "tail_mean": coded.tail_mean.view(rows, sequence) if fields["tail_samples"] else coded.tail_mean}


def _check_offsets(handle, path: Path) -> None:
    """ValueError naming the shard unless its offset index fits its coded answers."""
    tensors = {name: handle.get_tensor(name) for name in CODED}
    offsets, long_offsets, short = tensors["row_offsets"], tensors["long_offsets"], tensors["lengths"]
    problem = None
    if len(offsets) != len(short) + 1 or len(long_offsets) != len(short) + 1:
        problem = f"{len(offsets)} row offsets for {len(short)} rows"
    elif int(offsets[0]) != 0 or bool((offsets.diff() < 0).any()) or int(offsets[-1]) != tensors["coded"].numel():
        problem = f"row offsets from {int(offsets[0])} to {int(offsets[-1])}, {tensors['coded'].numel()} coded bytes"
    elif not torch.equal(long_offsets.diff(), (short == cache_coding.LENGTH_ESCAPE).sum(-1)) \
            or int(long_offsets[-1]) != tensors["long_lengths"].numel():
        problem = "long-stream offsets that do not count the long streams"
    else:
        lengths = CodedAnswers.lengths_of(short, tensors["long_lengths"]).view(short.shape)
        if not torch.equal(lengths.sum(-1), offsets.diff()):
            problem = "row offsets that do not add up the rows' stream lengths"
    if problem is not None:
        raise ValueError(f"kd.teacher_cache: shard {path} is damaged: its offset index does not fit its coded "
                         f"answers ({problem}); rerun `meshkd cache-teacher` to rewrite it")


def model_identity(section, label: str, keys: tuple[str, ...] = TEACHER_KEYS) -> dict[str, Any]:
    """A model section's `keys` as given, with the sha256 of its config.json (or GGUF file); weights are not hashed."""
    identity = {f"{label}.{name}": getattr(section, name) for name in keys}
    source = None
    if section.path is not None:
        try:
            directory, gguf_file = models.resolve_source(section.path, section.gguf_file)
            source = file_sha256(directory / (gguf_file or "config.json"))
        except (OSError, ValueError) as error:
            raise ConfigError(f"{label}: {error}") from None
    identity[f"{label} (config.json or GGUF file sha256)"] = source
    return identity


def teacher_identity(teacher: TeacherConfig) -> dict[str, Any]:
    """The teacher's model section's identity (`model_identity`, under the one-teacher key's name: the same
    teacher's caches and servers match whichever form names it)."""
    return model_identity(teacher.model, "teacher_model")


def _row_hash(input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for tensor in (input_ids, position_ids, attention_mask):
        digest.update(tensor.to("cpu", torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


def row_hashes(batch: Batch) -> list[str]:
    """One hash per row of a batch (or a dataset's rows): what identifies the row in a cache. A batch on a GPU
    comes to the host in one copy per tensor, not one per row."""
    tensors = [batch[key].to("cpu", torch.int64) for key in ("input_ids", "position_ids", "attention_mask")]
    return [_row_hash(*(tensor[i] for tensor in tensors)) for i in range(tensors[0].shape[0])]


def rows_digest(hashes: Iterable[str]) -> str:
    return hashlib.sha256("".join(hashes).encode()).hexdigest()


def rows_asked(config: KDRecipeConfig, datasets: dict, *, dp_size: int | None = None) -> dict[str, list[int]]:
    """The rows a run of `config` asks the teacher about: the training rows its steps visit (in order of
    first visit), and the validation rows an evaluation at `dp_size` reads (None: at any data-parallel
    size, at most `val_batches` global batches)."""
    steps = config.step_scheduler
    train = training_rows(datasets["train"], global_batch_size=steps.global_batch_size, seed=config.dataset.seed,
                               num_steps=steps.max_steps)
    num_val = len(datasets["validation"])
    if steps.val_batches is not None:
        per_batch = steps.global_batch_size if dp_size is None else steps.local_batch_size * dp_size
        num_val = min(num_val, steps.val_batches * per_batch)
    return {"train": train, "validation": list(range(num_val))}


# -------------------------------------------------------------------------------------------- files


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.safetensors"


def write_shard(path: Path, answers: dict[str, torch.Tensor], fields: dict[str, Any], record: dict) -> dict:
    """Write one shard (tensors [rows, ...], the answer's other fields as metadata) and then its sidecar.

    Returns the sidecar record: `record` with the shard's file name, size and sha256.
    """
    from safetensors.torch import save

    data = save({key: value.contiguous() for key, value in answers.items()}, metadata={"answer": json.dumps(fields)})
    write_atomically(path, data)
    record = {**record, "file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    write_atomically(path.with_suffix(".json"), json.dumps(record).encode())
    return record


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a complete cache; ValueError naming the file when there is none or it is unreadable."""
    path = Path(directory, MANIFEST)
    if not path.is_file():
        raise ValueError(f"{directory} is not a complete teacher cache ({MANIFEST} not found): write it with "
                         "`meshkd cache-teacher CONFIG` (a killed run continues where it stopped)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable cache manifest ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path}: not a meshkd teacher cache manifest of version {VERSION}")
    return manifest


# ------------------------------------------------------------------------------------------ preflight


def _differs(field: str, cached: Any, current: Any) -> str:
    if field == "dataset.paths":
        cached_files = {entry[0]: entry for entry in cached}
        current_files = {entry[0]: entry for entry in current}
        added = sorted(current_files.keys() - cached_files.keys())
        if added:
            return f"dataset.paths: {added[0]} is not among the cache's files ({len(added)} such)"
        gone = sorted(cached_files.keys() - current_files.keys())
        if gone:
            return f"dataset.paths: {gone[0]} was in the cache's data, this run does not read it ({len(gone)} such)"
        for path in sorted(current_files):
            if cached_files[path] != current_files[path]:
                return f"dataset.paths: {path} changed since the cache was written (size or content)"
    return f"{field}: the cache was written with {cached!r}, this run has {current!r}"


def cache_teacher_tokenizer(cache: str | os.PathLike):
    """The teacher's tokenizer the cross-tokenizer cache `cache` holds (`TEACHER_TOKENIZER`); ConfigError if it
    has none."""
    directory = Path(cache, TEACHER_TOKENIZER)
    if not directory.is_dir():
        raise ConfigError(f"kd.cross_tokenizer: the cache {cache} holds no teacher tokenizer "
                          f"({directory}): it was written without kd.cross_tokenizer; rerun `meshkd cache-teacher`")
    return models.load_tokenizer(path=directory)


def check_cache(config: KDRecipeConfig, teacher: TeacherConfig, tokenizer, *, student_vocab_rows: int,
                teacher_tokenizer=None) -> dict:
    """The preflight of training from `teacher`'s cache: the cache is complete and was written for this run.

    Compares every key field (data files and their content, data settings, sequence length, tokenizer,
    vocabulary, encoding) and, when the run names a teacher (`teacher_model`), the teacher's identity;
    checks that every shard is present with its size. Returns the manifest.

    Raises:
        ConfigError: naming the field that differs or the file that is missing, and the cache directory.
    """
    directory = teacher.cache
    try:
        manifest = read_manifest(directory)
    except ValueError as error:
        raise ConfigError(f"kd.teacher_cache: {error}") from None
    vocab_size = models.kd_vocab_size(student_vocab_rows, manifest["teacher_vocab_rows"],
                                      cross_tokenizer=config.kd.cross_tokenizer is not None)
    current = cache_key(config, teacher, tokenizer, vocab_size=vocab_size, teacher_tokenizer=teacher_tokenizer)
    if teacher.model.path is not None or teacher.model.random_init is not None:
        current.update(teacher_identity(teacher))
    for field, value in current.items():
        cached = manifest["key"].get(field, manifest["teacher"].get(field))
        if json.loads(json.dumps(value)) != cached:  # as JSON holds it: tuples are lists
            raise ConfigError(f"kd.teacher_cache: {directory} does not fit this run: "
                              f"{_differs(field, cached, value)}; rerun `meshkd cache-teacher` with this "
                              "config or point kd.teacher_cache elsewhere")
    for shard in manifest["shards"]:
        path = Path(directory, shard["file"])
        size = path.stat().st_size if path.is_file() else None
        if size != shard["bytes"]:
            what = "is missing" if size is None else f"has {size} bytes, the manifest says {shard['bytes']}"
            raise ConfigError(f"kd.teacher_cache: shard {path} {what}; rerun `meshkd cache-teacher` to rewrite it")
    return manifest


# ---------------------------------------------------------------------------------------------- reading


class CachedTeacher:
    """A teacher source that answers from a cache (see the module docstring).

    Args:
        directory: the cache (`kd.teacher_cache`); `manifest` its manifest, as `check_cache` returned it.
        datasets: {"train": ..., "validation": ...} this run's packed datasets (`meshkd.recipe.corpus.data`).
        asked: the rows this run asks about (`rows_asked`).
        device: where answers go.

    Raises:
        ValueError: the datasets pack differently from the cache's, or the run visits rows it does not hold.
    """

    def __init__(self, directory: str | os.PathLike, manifest: dict, datasets: dict, *, asked: dict[str, list[int]],
                 device: torch.device) -> None:
        self.directory = Path(directory)
        self.device = device
        self._shards = manifest["shards"]
        coding = manifest.get("coding")
        self._tables = None if coding is None else CodingTables.from_json(coding["tables"])
        self._open: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._answer_modes = {split: manifest["splits"][split]["answer"] for split in SPLITS}
        self._where: dict[str, tuple[str, int, int]] = {}  # row hash -> (split, shard, row in shard)
        for split, dataset in datasets.items():
            cached = manifest["splits"][split]
            hashes = row_hashes(dataset[:])
            if rows_digest(hashes) != cached["rows_digest"]:
                raise ValueError(
                    f"kd.teacher_cache: the packed {split} rows ({len(dataset)}) differ from the cache's "
                    f"({cached['num_rows']}): the data, tokenizer or packing changed; rerun `meshkd cache-teacher`"
                )
            for number, shard in enumerate(self._shards):
                if shard["split"] == split:
                    for offset, row in enumerate(cached["rows"][shard["first"] : shard["first"] + shard["count"]]):
                        self._where[hashes[row]] = (split, number, offset)
        held = set(manifest["splits"]["train"]["rows"])
        missing = [row for row in asked["train"] if row not in held]
        if missing:
            cached = manifest["splits"]["train"]
            raise ValueError(
                f"kd.teacher_cache: this run visits {len(missing)} training rows the cache does not hold (it holds "
                f"the rows of {cached['max_steps']} steps of global_batch_size {cached['global_batch_size']}); "
                "rerun `meshkd cache-teacher` with this run's step_scheduler.max_steps and global_batch_size"
            )
        held_val = len(manifest["splits"]["validation"]["rows"])
        if len(asked["validation"]) > held_val:
            raise ValueError(
                f"kd.teacher_cache: evaluation reads {len(asked['validation'])} validation rows, the cache holds "
                f"{held_val}; lower step_scheduler.val_batches or rerun `meshkd cache-teacher` with this run's settings"
            )

    def answer_mode(self, split: str) -> str:
        """What the cache holds for the rows of `split`: a `kd.logits_transport` encoding, or `LABEL_LOG_PROBS`."""
        return self._answer_modes[split]

    def _shard(self, number: int):
        """The open shard, its sha256 checked on first use (ValueError naming the file if it does not match)."""
        with self._lock:
            if number not in self._open:
                from safetensors import safe_open

                shard = self._shards[number]
                path = self.directory / shard["file"]
                if file_sha256(path) != shard["sha256"]:
                    raise ValueError(f"kd.teacher_cache: shard {path} is corrupted (its sha256 differs from the "
                                     "manifest's); rerun `meshkd cache-teacher` to rewrite it")
                handle = safe_open(str(path), framework="pt")
                fields = json.loads(handle.metadata()["answer"])
                if "coding" in fields:
                    if fields["coding"] != cache_coding.LAYOUT or self._tables is None:
                        raise ValueError(f"kd.teacher_cache: shard {path} is coded as {fields['coding']!r}, the "
                                         f"manifest's coding is {cache_coding.LAYOUT if self._tables else None!r}")
                    _check_offsets(handle, path)
                self._open[number] = (handle, fields, list(handle.keys()))
            return self._open[number]

    def _row(self, number: int, offset: int) -> dict[str, Any]:
        """One row's tensors [1, ...] of shard `number`: a coded row as its coded parts (`_decoded` packs them)."""
        handle, fields, names = self._shard(number)
        if "coding" not in fields:
            return {name: handle.get_slice(name)[offset : offset + 1] for name in names}
        row = {name: handle.get_slice(name)[offset : offset + 1] for name in names if name not in CODED}
        start, end = handle.get_slice("row_offsets")[offset : offset + 2].tolist()
        long_start, long_end = handle.get_slice("long_offsets")[offset : offset + 2].tolist()
        tail = handle.get_slice("tail_mean")[offset : offset + 1] if fields["tail_samples"] else torch.zeros(1, 0)
        parts = CodedAnswers(handle.get_slice("coded")[start:end],
                             CodedAnswers.lengths_of(handle.get_slice("lengths")[offset : offset + 1],
                                                     handle.get_slice("long_lengths")[long_start:long_end]),
                             handle.get_slice("rest_high")[offset].flatten(), tail.flatten())
        return {**row, "coded": (number, parts)}

    def _decoded(self, rows: list[dict[str, Any]], fields: dict[str, Any]) -> list[dict[str, Any]]:
        """`rows` with their coded parts decoded into "packed" [1, sequence, nbytes], a shard's rows at a time (a
        stream that does not decode names its shard)."""
        by_shard: dict[int, list[int]] = {}
        for index, row in enumerate(rows):
            if "coded" in row:
                by_shard.setdefault(row["coded"][0], []).append(index)
        for number, indices in by_shard.items():
            parts = [rows[index]["coded"][1] for index in indices]
            joined = CodedAnswers(*(torch.cat([getattr(part, name) for part in parts])
                                    for name in ("data", "lengths", "rest_high", "tail_mean")))
            try:
                packed = cache_coding.decode(joined, self._tables, k=fields["k"], tail_samples=fields["tail_samples"],
                                             vocab=fields["vocab"], temperature=fields["temperature"])["packed"]
            except ValueError as error:
                path = self.directory / self._shards[number]["file"]
                raise ValueError(f"kd.teacher_cache: shard {path} is damaged: {error}; rerun `meshkd cache-teacher` "
                                 "to rewrite it") from None
            for index, row in zip(indices, packed.view(len(indices), -1, packed.shape[-1])):
                rows[index] = {**{key: value for key, value in rows[index].items() if key != "coded"},
                               "packed": row[None]}
        return rows

    def request(self, batch: Batch, logits_transport: str, *, host_batch: Batch | None = None,
                with_label_log_probs: bool = False) -> Encoded:
        """The cached answers for every row of `batch`, as the live teacher would send them (a split's rows hold one
        kind of answer: no label log-probabilities beside a distribution)."""
        if with_label_log_probs:
            raise ValueError("kd.teacher_cache holds no label log-probabilities beside the teacher's distributions")
        rows: list[dict[str, torch.Tensor]] = []
        fields: dict[str, Any] = {"mode": logits_transport}
        for index, key in enumerate(row_hashes(batch)):
            if key not in self._where:
                if logits_transport == LABEL_LOG_PROBS and not bool(batch["attention_mask"][index].any()):
                    # A padding row of the last evaluation batch: no token, no target (of the teacher's own).
                    rows.append({"log_probs": torch.zeros(1, teacher_side(batch)["input_ids"].shape[1])})
                    continue
                raise ValueError(f"kd.teacher_cache: row {index} of this batch is not in the cache")
            split, number, offset = self._where[key]
            if self._answer_modes[split] != logits_transport:
                raise ValueError(f"kd.teacher_cache holds {self._answer_modes[split]!r} answers for {split} rows, "
                                 f"the run asks for {logits_transport!r}")
            fields = self._shard(number)[1]
            rows.append(self._row(number, offset))
        fields = {key: value for key, value in fields.items() if key != "coding"}
        rows = self._decoded(rows, fields)
        answer = {name: to_device(torch.cat([row[name] for row in rows]), self.device) for name in rows[0]}
        return {**fields, **answer}

    def prefetch(self, items: Iterable[Any], *, batch_fn: Callable[[Any], TeacherRequest],
                 depth: int = 1) -> TeacherFeed:
        """(item, cached answer) in order; with `depth` > 0 the next answers are read on a background thread."""
        pairs = self._read_ahead(items, batch_fn, depth)

        def close(timeout: float | None) -> bool:  # local reads: they end soon, whatever the timeout
            pairs.close()
            return True

        return TeacherFeed(pairs, close=close)

    def _read_ahead(self, items: Iterable[Any], batch_fn: Callable[[Any], TeacherRequest],
                    depth: int) -> Iterator[tuple[Any, Encoded]]:
        if depth == 0:
            yield from ((item, self.request(request.batch, request.logits_transport))
                        for item in items for request in (batch_fn(item),))
            return
        pending: deque = deque()
        items, end = iter(items), object()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshkd-cache-read") as reader:
            while True:
                while len(pending) <= depth:
                    item = next(items, end)
                    if item is end:
                        break
                    request = batch_fn(item)
                    pending.append((item, reader.submit(self.request, request.batch, request.logits_transport)))
                if not pending:
                    return
                item, answer = pending.popleft()
                yield item, answer.result()

    def close(self, timeout=None) -> None:
        """Nothing to release but the memory maps."""
        self._open.clear()

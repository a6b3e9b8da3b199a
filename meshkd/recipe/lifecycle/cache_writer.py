"""`meshkd cache-teacher`: run only the teacher over a run's rows and write its answers to `kd.teacher_cache`.

Every rank of the world is a teacher rank, laid out as the teacher's section says (`teacher_distributed`
on separate meshes, else `distributed`); with a served teacher (`teacher_model.url`) every rank is a writer
that asks it, as a data-parallel replica. Every rank builds the run's datasets and the same plan: the rows
the run will ask about (`meshkd.recipe.teacher.teacher_cache`), cut into shards of `shard_rows` rows. Rank 0 keeps
the shards a killed run completed (sidecar matches the plan, bytes match their sha256), removes the rest,
and checks the space the others need against the free disk. The shards left go round-robin to the
teacher's data-parallel replicas: in round r replica t computes the (r * dp + t)-th, micro-batch by
micro-batch (`step_scheduler.local_batch_size` rows, as training asks), and its output rank writes it.
After every round the world agrees on failures, so a full disk on one output rank stops every rank with
that rank's message, and on stop requests (SIGINT, SIGTERM, `meshkd`'s stop file: a rerun continues).
Entropy-coded compact answers (`kd.teacher_cache_coding: entropy`) need their coding tables before any
training shard is written: the first training shard is computed in a round of its own, its output rank fits
the tables on it and writes them (`coding.json`), and every rank reads them after the round. Once every shard
is written, rank 0 writes the manifest (the tables in it too): the cache is complete.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshkd.core.agreement import gather_values
from meshkd.core.answers import LABEL_LOG_PROBS, answer_bytes, selected_kind
from meshkd.core.answers.compact import CompactTopK
from meshkd.core.cache_coding import LAYOUT, CodingTables
from meshkd.core.teacher_protocol import TeacherRequest
from meshkd.core.topology import create_kd_distributed_setups, model_replicas
from meshkd.recipe.common.faults import FaultWatch, StopRequest, about
from meshkd.recipe.common.files import file_sha256, write_atomically
from meshkd.recipe.common.metrics import is_logging_rank, print0
from meshkd.recipe.corpus import data
from meshkd.recipe.corpus.aligned_data import run_packing
from meshkd.recipe.lifecycle.preflight import preflight
from meshkd.recipe.lifecycle.world import run_role
from meshkd.recipe.modeling import models
from meshkd.recipe.settings.config import DistributedConfig, KDRecipeConfig, TeacherConfig
from meshkd.recipe.teacher import teacher_cache as cache
from meshkd.recipe.teacher.hidden_states import paired_layers
from meshkd.recipe.teacher.sources import SourceContext, kind_of
from meshkd.recipe.teacher.teacher_head import TeacherHead
from meshkd.recipe.teacher.teacher_worker import TeacherForward, lay_out_teacher, load_teacher, teacher_vocabulary_map

# Shard size: large enough that a shard's sha256 and open cost little per row, small enough that a killed
# run loses little.
SHARD_BYTES = 256 << 20
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Shard:
    split: str
    index: int
    first: int  # position of its first row in the split's cached rows
    rows: tuple[int, ...]  # dataset row indices

    @property
    def name(self) -> str:
        return cache.shard_name(self.split, self.index)


def answer_nbytes(config: KDRecipeConfig, teacher: TeacherConfig, split: str, vocab_size: int, *,
                  width: int | None = None) -> int:
    """Bytes of one cached row of `teacher`'s: the encoding training asks for, or each label's log-probability;
    `width`: the teacher's hidden size."""
    kd, sequence = config.kd_of(teacher), config.step_scheduler.sequence_length
    if split == "validation":  # of the teacher's own tokens
        return 4 * config.teacher_sequence_length
    logits_bytes = 4 if teacher.model.dtype == "float32" else 2
    return answer_bytes(kd, vocab_size, logits_bytes=logits_bytes, width=width) * sequence


def default_shard_rows(num_rows: int, row_bytes: int, num_replicas: int) -> int:
    """About `SHARD_BYTES` a shard, but at least 4 shards a replica: a small cache still spreads over the
    replicas, shows progress and resumes finely."""
    return max(1, min(SHARD_BYTES // row_bytes, math.ceil(num_rows / (4 * num_replicas))))


def plan_shards(rows: dict[str, list[int]], shard_rows: dict[str, int]) -> list[Shard]:
    return [Shard(split, index, first, tuple(rows[split][first : first + shard_rows[split]]))
            for split in cache.SPLITS
            for index, first in enumerate(range(0, len(rows[split]), shard_rows[split]))]


def _shard_record(shard: Shard, plan_key: str, hashes: dict[str, list[str]], coding: str | None = None) -> dict:
    """A shard's sidecar record; `coding`: the sha256 of the coding tables its training answers are coded with."""
    record = {"split": shard.split, "first": shard.first, "count": len(shard.rows), "plan": plan_key,
              "rows_digest": cache.rows_digest(hashes[shard.split][row] for row in shard.rows)}
    return {**record, "coding": coding} if coding is not None and shard.split == "train" else record


def _complete(directory: Path, shard: Shard, expected: dict) -> dict | None:
    """The sidecar of a shard a previous run completed for this same plan, else None."""
    sidecar = directory / Path(shard.name).with_suffix(".json")
    try:
        record = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return None
    if any(record.get(key) != value for key, value in expected.items()):
        return None
    path = directory / record["file"]
    if not path.is_file() or path.stat().st_size != record["bytes"] or file_sha256(path) != record["sha256"]:
        return None
    return record


class CacheWriter:
    """One rank of `meshkd cache-teacher`: `run()` plans, computes this replica's shards, completes the cache."""

    def __init__(self, config: KDRecipeConfig, teacher: TeacherConfig, device: torch.device, *,
                 shard_rows: int | None = None) -> None:
        if teacher.cache is None:
            raise ValueError("kd.teacher_cache: set it to the directory the teacher cache is written to")
        if shard_rows is not None and shard_rows < 1:
            raise ValueError(f"--shard-rows must be >= 1, got {shard_rows}")
        self.config, self.teacher = config, teacher  # the run's settings, the teacher whose answers are cached
        self.kd = config.kd_of(teacher)
        self.device = device
        self.directory = Path(teacher.cache)
        self.shard_rows = shard_rows
        self.stop = StopRequest()
        self.coded = self.kd.teacher_cache_coding == "entropy" and selected_kind(self.kd) is CompactTopK
        self.tables: CodingTables | None = None  # fitted on the first training shard (coded caches)
        self.coding_sha: str | None = None

    def run(self) -> dict:
        """Write the cache (every rank of the world calls); returns its summary on every rank."""
        config = self.config
        checked = preflight(config, self.teacher, writing_cache=True)
        setups = create_kd_distributed_setups({"separate_meshes": False,
                                               "distributed": writer_layout(config, self.teacher)},
                                              dist.get_world_size(),
                                              timeout=datetime.timedelta(seconds=config.collective_timeout_s))
        faults = FaultWatch(setups, self.directory, self.device, setup_timeout_s=config.setup_timeout_s)
        vocab_size = models.kd_vocab_size(checked.student_vocab_rows, checked.teacher_vocab_rows,
                                          cross_tokenizer=config.kd.cross_tokenizer is not None)
        self.vocab_size = vocab_size
        with faults.on_every_rank("while reading the data and planning the cache", patient=True):
            faults.write_pid_file()  # creates the directory too
            datasets = dict(zip(cache.SPLITS, data.build_run_datasets(
                checked.tokenizer, config.dataset, sequence_length=config.step_scheduler.sequence_length,
                pack_texts=run_packing(config, checked.tokenizer, checked.teacher_tokenizer))))
            rows = cache.rows_asked(config, datasets)
            hashes = {split: cache.row_hashes(datasets[split][:]) for split in cache.SPLITS}
            row_bytes = {split: answer_nbytes(config, self.teacher, split, vocab_size, width=checked.teacher_width)
                         for split in cache.SPLITS}
            plan = plan_shards(rows, {split: self.shard_rows or default_shard_rows(
                len(rows[split]), row_bytes[split], setups.student.dp_size) for split in cache.SPLITS})
            state = self._resume(plan, hashes, row_bytes, checked, vocab_size) if is_logging_rank() else None
        state = gather_values(state, device=self.device)[0]  # rank 0's: the plan key and the shards kept
        if state["coding"] is not None:  # tables a killed run fitted, its coded shards kept
            self._read_coding()
        todo = [shard for shard in plan if shard.name not in state["done"]]
        tokens = {split: datasets[split].tokens_per_row() for split in cache.SPLITS}
        started = time.perf_counter()
        if todo and not self._compute(todo, setups.student, faults, datasets, state["plan"], hashes, vocab_size,
                                      tokens, checked):
            return {"stopped": True}
        seconds = time.perf_counter() - started
        computed = sum(tokens[shard.split][row] for shard in todo for row in shard.rows)
        with faults.on_every_rank("while writing the manifest"):
            summary = None
            if is_logging_rank():
                summary = self._finish(plan, rows, hashes, tokens, state, checked, computed_tokens=computed,
                                       seconds=seconds)
        summary = gather_values(summary, device=self.device)[0]
        if is_logging_rank():
            shutil.rmtree(self.directory / "pids", ignore_errors=True)
        return summary

    def _resume(self, plan: list[Shard], hashes: dict, row_bytes: dict, checked, vocab_size: int) -> dict:
        """On rank 0: keep the shards a killed run completed for this plan, remove other files, check the space."""
        directory = self.directory
        key = cache.cache_key(self.config, self.teacher, checked.tokenizer, vocab_size=vocab_size,
                              teacher_tokenizer=checked.teacher_tokenizer)
        identity = (checked.teacher.report or {}).get("teacher") or cache.teacher_identity(self.teacher)
        plan_key = hashlib.sha256(json.dumps([key, identity], sort_keys=True).encode()).hexdigest()
        (directory / cache.MANIFEST).unlink(missing_ok=True)  # incomplete until every shard is written
        done, keep = [], set()
        coding = directory / cache.CODING
        try:
            kept_coding = json.loads(coding.read_text()).get("plan") == plan_key if self.coded else False
        except (OSError, ValueError, AttributeError):
            kept_coding = False
        coding_sha = file_sha256(coding) if kept_coding else None
        if kept_coding:
            keep.add(coding.name)
        for shard in plan:
            record = _complete(directory, shard, _shard_record(shard, plan_key, hashes, coding_sha))
            if record is not None and (shard.split != "train" or not self.coded or coding_sha is not None):
                done.append(shard.name)
                keep.update({shard.name, Path(shard.name).with_suffix(".json").name})
        for path in directory.iterdir():
            if path.is_file() and path.name not in keep and path.suffix in (".safetensors", ".json", ".partial"):
                path.unlink()
        needed = sum(len(shard.rows) * row_bytes[shard.split] for shard in plan if shard.name not in done)
        free = shutil.disk_usage(directory).free
        per_position = row_bytes["train"] // self.config.step_scheduler.sequence_length
        print0(f"meshkd cache-teacher: {sum(len(shard.rows) for shard in plan)} rows in {len(plan)} shards "
               f"({len(done)} kept from an earlier run), {needed / MIB:.1f} MiB to write ({per_position} bytes per "
               f"training position, {self.kd.logits_transport}), {free / MIB:.0f} MiB free under {directory}")
        if needed > free:
            raise OSError(f"kd.teacher_cache: {directory} needs {needed / MIB:.1f} MiB more, its filesystem has "
                          f"{free / MIB:.1f} MiB free")
        return {"plan": plan_key, "key": key, "identity": identity, "done": done, "coding": coding_sha}

    def _compute(self, todo: list[Shard], setup, faults: FaultWatch, datasets: dict, plan_key: str, hashes: dict,
                 vocab_size: int, tokens: dict, checked) -> bool:
        """Load and lay out the teacher, then compute this replica's shards round by round; False if stopped."""
        config = self.config
        replicas = model_replicas(setup)
        mine = next(index for index, replica in enumerate(replicas) if dist.get_rank() in replica.ranks)
        output = dist.get_rank() == replicas[mine].output_rank
        with faults.on_every_rank("while loading and laying out the teacher", patient=True):
            forward = self._forward(setup, checked, vocab_size, encodes=output)
        progress = None
        if is_logging_rank() and config.logging.progress_bar:
            from tqdm import tqdm

            progress = tqdm(total=sum(len(shard.rows) for shard in todo), unit="row", desc="cache-teacher",
                            dynamic_ncols=True)
        started, computed = time.perf_counter(), 0
        # The first training shard alone when the coding tables are still to be fitted on it.
        fit_first = self.coded and self.tables is None and todo[0].split == "train"
        rounds = [todo[:1]] if fit_first else []
        rest = todo[1:] if fit_first else todo
        rounds += [rest[first : first + len(replicas)] for first in range(0, len(rest), len(replicas))]
        written = 0
        for shards in rounds:
            if self.stop.agreed(None, device=self.device):  # all stop after the same round
                print0(f"meshkd cache-teacher: stopped on {self.stop.reason()} with {written} of {len(todo)} shards "
                       "written; run it again to continue")
                return False
            written += len(shards)
            with faults.watch("computing the teacher cache", "teacher"), \
                    faults.on_every_rank(f"while computing shards {', '.join(shard.name for shard in shards)}"):
                if mine < len(shards):
                    self._write(shards[mine], forward, output, datasets, plan_key, hashes)
            # The output rank that fitted the tables wrote them: every other rank reads them.
            if self.coded and self.tables is None and shards[0].split == "train":
                with faults.on_every_rank("while reading the cache's coding tables"):
                    self._read_coding()
            computed += sum(tokens[shard.split][row] for shard in shards for row in shard.rows)
            if progress is not None:
                progress.update(sum(len(shard.rows) for shard in shards))
                progress.set_postfix(tok_s=f"{computed / (time.perf_counter() - started):.0f}")
        if progress is not None:
            progress.close()
        return True

    def _forward(self, setup, checked, vocab_size: int, *, encodes: bool):
        """request -> answer: the teacher laid out on this world, or a served one asked (`teacher_model.url`)."""
        config, kind = self.config, checked.source
        if kind.outside_job:  # its source is asked
            context = SourceContext(setup, self.device, {}, vocab_size, None)
            source = kind.make(config, self.teacher, checked.teacher, context)
            return lambda request: source.request(request.batch, request.logits_transport)
        model, checkpoint = load_teacher(self.teacher)
        rows = model.get_output_embeddings().weight.shape[0]
        if rows != checked.teacher_vocab_rows:
            raise ValueError(f"teacher_model: its output embedding has {rows} rows, its config "
                             f"{checked.teacher_vocab_rows}")
        runner = lay_out_teacher(model, checkpoint, setup, device=self.device)
        return TeacherForward(runner, vocab_size=vocab_size, kd=self.kd, seed=config.seed, encodes=encodes,
                              vocabulary_map=teacher_vocabulary_map(config, checked, losses=("projection",)),
                              hidden_layers=paired_layers(config, "teacher"), section=self.teacher.model)

    def _write(self, shard: Shard, forward: TeacherForward, output: bool, datasets: dict, plan_key: str,
               hashes: dict) -> None:
        """Compute one shard on this replica, micro-batch by micro-batch; its output rank writes it."""
        mode = self.kd.logits_transport if shard.split == "train" else LABEL_LOG_PROBS
        size = self.config.step_scheduler.local_batch_size
        answers = []
        for start in range(0, len(shard.rows), size):
            batch = datasets[shard.split][torch.tensor(shard.rows[start : start + size])]
            answer = forward(TeacherRequest({key: value.to(self.device) for key, value in batch.items()}, mode))
            if answer is not None:
                answers.append(answer)
        if output:
            tensors = {key: torch.cat([answer[key].cpu() for answer in answers])
                       for key, value in answers[0].items() if isinstance(value, torch.Tensor)}
            fields = {key: value for key, value in answers[0].items() if not isinstance(value, torch.Tensor)}
            with about("kd.teacher_cache"):
                if self.coded and fields.get("mode") == CompactTopK.name:
                    if self.tables is None:  # the first training shard: the tables are fitted on it
                        self._write_coding(CodingTables.fit({**fields, "packed": tensors["packed"]}), plan_key)
                    tensors = {**{key: value for key, value in tensors.items() if key != "packed"},
                               **cache.coded_tensors(tensors.pop("packed"), fields, self.tables)}
                    fields = {**fields, "coding": LAYOUT}
                cache.write_shard(self.directory / shard.name, tensors, fields,
                                  _shard_record(shard, plan_key, hashes, self.coding_sha))

    def _write_coding(self, tables: CodingTables, plan_key: str) -> None:
        write_atomically(self.directory / cache.CODING,
                         json.dumps({"plan": plan_key, "layout": LAYOUT, "tables": tables.to_json()}).encode())
        self._read_coding()

    def _read_coding(self) -> None:
        """The coding tables of this cache (`coding.json`, written by the rank that fitted them)."""
        path = self.directory / cache.CODING
        try:
            self.tables = CodingTables.from_json(json.loads(path.read_text())["tables"])
        except (OSError, ValueError, KeyError) as error:
            raise OSError(f"kd.teacher_cache: {path} is not readable after it was written ({error}; is the "
                          "directory one shared by every rank?)") from None
        self.coding_sha = file_sha256(path)

    def _finish(self, plan: list[Shard], rows: dict, hashes: dict, tokens: dict, state: dict, checked, *,
                computed_tokens: int, seconds: float) -> dict:
        """On rank 0: gather the sidecars into the manifest, written last; the summary."""
        records = []
        for shard in plan:
            record = _complete(self.directory, shard, _shard_record(shard, state["plan"], hashes, self.coding_sha))
            if record is None:
                raise OSError(f"kd.teacher_cache: shard {self.directory / shard.name} is missing or incomplete after "
                              "it was written (is the directory one shared by every rank?)")
            records.append(record)
        steps = self.config.step_scheduler
        splits = {split: {"answer": self.kd.logits_transport if split == "train" else LABEL_LOG_PROBS,
                          "num_rows": len(hashes[split]), "rows_digest": cache.rows_digest(hashes[split]),
                          "rows": rows[split]} for split in cache.SPLITS}
        splits["train"].update(max_steps=steps.max_steps, global_batch_size=steps.global_batch_size)
        num_bytes = sum(record["bytes"] for record in records)
        train_bytes = sum(record["bytes"] for record in records if record["split"] == "train")
        summary = {
            "directory": str(self.directory), "rows": {split: len(rows[split]) for split in cache.SPLITS},
            "tokens": sum(tokens[split][row] for split in cache.SPLITS for row in rows[split]), "bytes": num_bytes,
            "train_bytes_per_position": train_bytes / max(1, len(rows["train"]) * steps.sequence_length),
            "computed_tokens": computed_tokens, "seconds": seconds,
            "tokens_per_s": computed_tokens / seconds if seconds > 0 else None,
        }
        manifest = {"format": cache.FORMAT, "version": cache.VERSION, "key": state["key"],
                    "teacher": state["identity"], "teacher_vocab_rows": checked.teacher_vocab_rows,
                    "seed": self.config.seed, "splits": splits, "shards": records, "summary": summary}
        if self.tables is not None:  # what a reader decodes the training shards with
            manifest["coding"] = {"layout": LAYOUT, "sha256": self.coding_sha, "tables": self.tables.to_json()}
        if self.config.kd.hidden_states is not None:  # the width of its hidden states (a student's projection's)
            manifest["teacher_hidden_size"] = checked.teacher_width
        if self.config.kd.cross_tokenizer is not None:  # a training run reads its rows' teacher side with it
            checked.teacher_tokenizer.save_pretrained(self.directory / cache.TEACHER_TOKENIZER)
        if selected_kind(self.kd).reads_hidden:  # a training run reads its hidden answers with it
            head = TeacherHead.of(self.teacher.model, vocab_size=self.vocab_size)
            head.save(self.directory / cache.TEACHER_HEAD)
            manifest["teacher_head"] = head.id
        write_atomically(self.directory / cache.MANIFEST, json.dumps(manifest).encode())
        rate = f", {summary['tokens_per_s']:.0f} tokens/s" if computed_tokens else ""
        if self.config.logging.summary:
            print0(f"meshkd cache-teacher: {self.directory} complete: {summary['rows']['train']} training and "
                   f"{summary['rows']['validation']} validation rows, {num_bytes / MIB:.1f} MiB "
                   f"({summary['train_bytes_per_position']:.0f} bytes per training position); computed "
                   f"{computed_tokens} tokens in {seconds:.1f} s{rate}")
        return summary


def writer_layout(config: KDRecipeConfig, teacher: TeacherConfig) -> DistributedConfig:
    """The layout of `meshkd cache-teacher`'s world: the teacher's, or for a teacher outside the job (a served one,
    `teacher_model.url`) data-parallel writers that ask it (1 unless `--nproc` says more)."""
    if kind_of(config, teacher, writing_cache=True).outside_job:
        return DistributedConfig(dp_size=None)
    return config.layout_of(teacher)


def cache_teacher(config: KDRecipeConfig, teacher: TeacherConfig, *, shard_rows: int | None = None) -> dict:
    """`meshkd cache-teacher` of `teacher` on this rank: in the current world, or a new one from the environment."""
    return run_role(config, lambda device: CacheWriter(config, teacher, device, shard_rows=shard_rows))

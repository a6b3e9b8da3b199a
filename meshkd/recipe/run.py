"""The KD recipe: one class with setup / train / cleanup, run by every rank of the world.

Student ranks train; teacher ranks serve. On shared meshes every rank is both: it runs the teacher on
its own micro-batch, then trains. On separate meshes the student drives the teacher through
`KDMeshBridge`: RUN_TEACHER per micro-batch, its batch across, full logits back; the teacher loop serves
until STOP_TEACHER, which the student sends when it is done (after a failure of its own the first student
rank tries for a few seconds; after a lost peer nobody tries).
With `kd.overlap_teacher` (the default) a `TeacherPrefetcher` issues those requests on a background
thread one micro-batch ahead, so the teacher computes micro-batch i + 1 while the student trains on i;
requests and logits are those of the synchronous loop, in the same order, so the loss curve is too.

A pipelined student (`meshkd.parallel.student_pipeline`) runs all micro-batches of a step in one schedule: its
teacher logits are fetched first (they reach the last stage only), the loss is computed on the last
stage, and its values reach every stage through `broadcast_loss_metrics_from_last_stage` (evaluation
sums through `broadcast_tensors_from_last_stage`), so every rank logs, clips and checkpoints alike.

Loss normalization: each micro-batch loss is a sum over its valid tokens divided by the global number of
valid tokens of the optimizer step (all micro-batches, all data-parallel ranks). Data-parallel wrappers
average gradients over dp ranks, so the loss is multiplied by dp before backward to turn that average
into the sum the normalization asks for. The curve then equals a single-process run on the same global
batch.

Failures (`meshkd.recipe.faults`). `meshkd.recipe.preflight` checks what needs no process group (data files,
tokenizers, model configs against the layout) the same way on every rank, so a bad input raises
everywhere without a collective; `meshkd train` runs it before starting any process. What only one role
finds out while setting up (its weights, its data, a checkpoint) is agreed over the world before the next
collective, so every rank raises it (`SetupError` on the others). In training, a collective that fails
because a peer died or stopped answering becomes `PeerLostError`, naming the role and ranks lost. A stop
request (SIGINT, SIGTERM, or the stop file `meshkd train` names in MESHKD_STOP_FILE) is agreed among the
student ranks at a step boundary: they save a checkpoint of that step, send STOP_TEACHER and return.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from transformers import AutoModelForCausalLM

from meshkd.core.bridge import RUN_TEACHER, STOP_TEACHER, KDMeshBridge, TeacherPrefetcher
from meshkd.core.logits_codec import encode_teacher_logits
from meshkd.core.loss import cross_entropy_loss, kd_loss_encoded, kd_objective
from meshkd.core.packing import configure_kd_teacher_packing, configure_packing
from meshkd.core.stage_broadcast import (
    broadcast_loss_metrics_from_last_stage,
    broadcast_tensors_from_last_stage,
)
from meshkd.core.topology import create_kd_distributed_setups
from meshkd.parallel.context_parallel import flatten_student_cp_axes, shard_student_batch, shard_teacher_logits
from meshkd.parallel.data_parallel import (
    clip_grad_norm,
    gather_full_state_dict,
    parallelize_student,
    student_loss_scale,
)
from meshkd.parallel.sharded_loading import is_empty, load_shards
from meshkd.parallel.student_pipeline import StudentPipeline
from meshkd.parallel.teacher_runner import TeacherRunner
from meshkd.recipe import checkpoint as ckpt
from meshkd.recipe import data, models
from meshkd.recipe.config import KDRecipeConfig, expand_path
from meshkd.recipe.faults import FaultWatch, PeerLostError, StopRequest, brief
from meshkd.recipe.metrics import MetricsSink, is_logging_rank, print0
from meshkd.recipe.preflight import Preflight, about, load_section_model, load_section_model_for_layout, preflight

# After a rank-local failure in training: how long to try to hand off cleanly before simply exiting.
_FAILURE_WAIT_S = 5.0


def _device(config: KDRecipeConfig) -> torch.device:
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _lr_lambda(config: KDRecipeConfig):
    schedule = config.lr_scheduler
    total = schedule.total_steps or config.step_scheduler.max_steps

    def factor(step: int) -> float:
        if step < schedule.warmup_steps:
            return (step + 1) / schedule.warmup_steps
        if schedule.decay == "constant":
            return 1.0
        progress = min(1.0, (step - schedule.warmup_steps) / max(1, total - schedule.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule.decay == "cosine" else 1 - progress
        return schedule.min_lr_ratio + (1 - schedule.min_lr_ratio) * shape

    return factor


class KDRecipe:
    """Distill `config.teacher_model` into `config.model`; `run()` does setup, train and cleanup."""

    def __init__(self, config: KDRecipeConfig, *, resume: bool = False) -> None:
        self.config = config
        self.resume = resume
        self.run_dir = Path(config.logging.run_dir)
        self.bridge: KDMeshBridge | None = None
        self.pipeline: StudentPipeline | None = None  # set up for a student with pp_size > 1
        self.summary: dict = {}
        self._owns_process_group = False
        self._stop = StopRequest()

    # ---- setup ----

    def setup(self) -> None:
        config = self.config
        # Same files, same answer on every rank: a bad input raises everywhere before any collective.
        checked = preflight(config)
        self.device = _device(config)
        if not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=config.collective_timeout_s))
            self._owns_process_group = True
        self.setups = create_kd_distributed_setups(config, dist.get_world_size())
        self.faults = FaultWatch(self.setups, self.run_dir, self.device)
        flatten_student_cp_axes(self.setups.student)  # collective over the world: teacher ranks take part
        rank = dist.get_rank()
        self.is_student = rank in self.setups.student_ranks
        self.is_teacher = rank in self.setups.teacher_ranks
        student = self.setups.student
        self.dp_mesh = student.dp_mesh
        self.dp_size, self.dp_rank = student.dp_size, (self.dp_mesh.get_local_rank() if self.is_student else 0)
        steps = config.step_scheduler
        if steps.global_batch_size % (steps.local_batch_size * self.dp_size):
            raise ValueError(
                f"step_scheduler.global_batch_size({steps.global_batch_size}) must be divisible by "
                f"local_batch_size({steps.local_batch_size}) * data-parallel size({self.dp_size})"
            )
        self.num_micro_batches = steps.global_batch_size // (steps.local_batch_size * self.dp_size)
        with self.faults.watch("setup", "teacher" if self.is_student else "student"):
            self._setup_models_and_data(checked)

    def _setup_models_and_data(self, checked: Preflight) -> None:
        config, steps, student = self.config, self.config.step_scheduler, self.setups.student
        self.tokenizer, teacher_tokenizer = checked.tokenizer, checked.teacher_tokenizer

        # Each role loads only its own model and data: a failure there is agreed over the world below, so
        # the other role raises too instead of waiting in the next collective.
        # A model stored as safetensors under its own names is built without weights here and each rank
        # reads only its share once it is laid out (`meshkd.parallel.sharded_loading`); DDP replicates the whole
        # student, so it loads whole.
        student_model = teacher_model = student_checkpoint = teacher_checkpoint = None
        with self.faults.on_every_rank("while loading models and data"):
            self.faults.write_pid_file()
            torch.manual_seed(config.seed)
            if self.is_student:
                with about("model"):
                    if student.strategy == "fsdp2":
                        student_model, student_checkpoint = load_section_model_for_layout(config.model)
                    else:
                        student_model = load_section_model(config.model)
            if self.is_teacher:
                with about("teacher_model"):
                    teacher_model, teacher_checkpoint = load_section_model_for_layout(config.teacher_model)
            if self.is_student:
                with about("dataset"):
                    self.train_set, self.val_set = data.build_datasets(
                        self.tokenizer,
                        paths=[expand_path(p) for p in config.dataset.paths],
                        sequence_length=steps.sequence_length,
                        val_fraction=config.dataset.val_fraction,
                        seed=config.dataset.seed,
                        text_key=config.dataset.text_key,
                        format=config.dataset.format,
                        max_documents=config.dataset.max_documents,
                        max_document_chars=config.dataset.max_document_chars,
                        pack=config.dataset.packing,
                    )
                configure_packing(student_model)
        # Both sizes are known on every rank, so these checks raise everywhere.
        sizes = self._exchange_vocab_sizes(student_model, teacher_model)
        with about("model.tokenizer / teacher_model.tokenizer"):
            self.vocab_size = models.common_vocab_size(
                self.tokenizer, teacher_tokenizer, student_vocab_size=sizes[0], teacher_vocab_size=sizes[1]
            )
        if student.tp_size > 1 and sizes[0] != self.vocab_size:
            raise ValueError(
                f"model: vocabulary {sizes[0]} differs from the common vocabulary {self.vocab_size}: not supported "
                "with distributed.tp_size > 1"
            )

        # NEAT packing on both roles, checked across the control group on separate meshes.
        control = None
        if self.setups.separate:
            self.bridge = KDMeshBridge(
                self.setups, self.device, timeout=datetime.timedelta(seconds=config.collective_timeout_s)
            )
            control = self.bridge.control_group
        configure_kd_teacher_packing(
            [teacher_model] if teacher_model is not None else [],
            [student_model] if student_model is not None else [],
            control_group=control,
        )
        with self.faults.on_every_rank("while laying out the models"):
            if teacher_model is not None:
                self.teacher = TeacherRunner(teacher_model, self.setups.teacher, device=self.device)
                if teacher_checkpoint is not None:
                    with about("teacher_model"):
                        load_shards(teacher_model, teacher_checkpoint, device=self.device)
            else:
                self.teacher = None
            if self.is_student and student.pp_size > 1:
                self.pipeline = StudentPipeline(
                    student_model, student, device=self.device, schedule=student.pp_schedule,
                    num_micro_batches=self.num_micro_batches,
                )
                self.model = self.pipeline.stage_model
            elif self.is_student:
                # TeacherRunner and StudentPipeline move their model; parallelize_student leaves that to us.
                if not is_empty(student_model):  # else `load_shards` gives it storage on the device
                    student_model.to(self.device)
                self.model = parallelize_student(student_model, student)
            if student_checkpoint is not None:
                with about("model"):
                    load_shards(self.model, student_checkpoint, device=self.device)
            if self.is_student:
                opt = config.optimizer
                if opt.name == "adamw":
                    self.optimizer = torch.optim.AdamW(
                        self.model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay, betas=tuple(opt.betas),
                        eps=opt.eps, foreach=False,
                    )
                else:
                    self.optimizer = torch.optim.SGD(self.model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)
                self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(config))
        self.start_step = 0
        self.checkpoint_root = Path(config.checkpoint.dir or self.run_dir / "checkpoints")
        with self.faults.on_every_rank("while resuming and opening the run directory"):
            if self.resume and self.is_student:
                # Only complete checkpoints count: a save killed half-way left a `.partial` directory.
                latest = ckpt.latest_checkpoint(self.checkpoint_root)
                if latest is not None:
                    try:
                        meta = ckpt.load_checkpoint(
                            latest, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                            group=self.student_group,
                        )
                    except (KeyboardInterrupt, SystemExit):
                        raise
                    except BaseException as error:  # DCP raises CheckpointException, a BaseException
                        raise ValueError(
                            f"checkpoint {latest} cannot be loaded into this run (a different model or layout?): "
                            f"{brief(error)}"
                        ) from error
                    self.start_step = meta["step"]
                    print0(f"resumed from {latest} at step {self.start_step}")
                else:
                    print0(f"no checkpoint under {self.checkpoint_root}: starting at step 0")
            self.metrics = MetricsSink(
                self.run_dir, tensorboard=config.logging.tensorboard, resume_step=self.start_step if self.resume else None
            )
            if is_logging_rank():
                self.run_dir.mkdir(parents=True, exist_ok=True)
                (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))

    def _bridge(self, operation: str, *args):
        """Call a bridge method; a lost peer is reported as the other role (separate meshes: roles are disjoint)."""
        with self.faults.watch(operation, "student" if self.is_teacher else "teacher"):
            return getattr(self.bridge, operation)(*args)

    @property
    def student_group(self) -> dist.ProcessGroup | None:
        return self.bridge.student_group if self.bridge is not None else None

    def _exchange_vocab_sizes(self, student_model, teacher_model) -> tuple[int, int]:
        """(student, teacher) embedding sizes, known on every rank (each role loads only its own model)."""
        local = [
            student_model.get_output_embeddings().weight.shape[0] if student_model is not None else -1,
            teacher_model.get_output_embeddings().weight.shape[0] if teacher_model is not None else -1,
        ]
        sizes = torch.tensor(local, dtype=torch.int64)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
        return int(sizes[0]), int(sizes[1])

    # ---- teacher ----

    def _teacher_logits_local(self, batch: dict) -> torch.Tensor | None:
        logits = self.teacher.logits(batch)
        return None if logits is None else logits[..., : self.vocab_size]

    def _encode(self, logits: torch.Tensor, batch: dict, mode: str) -> dict:
        """Teacher logits in the transport encoding `mode` (kd.logits_transport, or "full" for evaluation)."""
        kd = self.config.kd
        # Tail samples are seeded by the batch itself, so a resumed run draws the same ones.
        seed = self.config.seed + int(batch["input_ids"].sum())
        return encode_teacher_logits(logits, mode, k=min(kd.topk, logits.shape[-1]), temperature=kd.temperature,
                                     tail_samples=kd.topk_tail_samples, seed=seed)

    def _teacher_logits(self, micro_batch: dict, *, mode: str | None = None) -> dict | None:
        """Encoded teacher logits (`meshkd.core.logits_codec`) for this rank's micro-batch, all positions.

        None on the pipeline stages of a student before its last: only the last stage computes the loss.
        """
        mode = mode or self.config.kd.logits_transport
        if self.bridge is None:
            # Shared meshes: the teacher's pipeline stages are the student's, its logits on the last one.
            logits = self._teacher_logits_local(micro_batch)
            return None if logits is None else self._encode(logits, micro_batch, mode)
        self._bridge("broadcast_command", RUN_TEACHER)
        received = None
        for wave in range(self.bridge.num_waves):
            self._bridge("send_batch", wave, {"batch": micro_batch, "logits_transport": mode})
            logits = self._bridge("send_logits", wave, None)
            if logits is not None:
                received = logits
        if received is None and self.bridge.receives_logits:
            raise RuntimeError(f"student rank {dist.get_rank()} received no teacher logits")
        return received

    def serve_teacher(self) -> None:
        """Teacher-only ranks: answer RUN_TEACHER with encoded logits until STOP_TEACHER."""
        output_ranks = {replica.output_rank for replica in self.bridge.teacher_replicas}
        while self._bridge("broadcast_command") == RUN_TEACHER:
            for wave in range(self.bridge.num_waves):
                request = self._bridge("send_batch", wave, None)
                encoded = None
                with self.faults.watch("the teacher forward", "teacher"):
                    batch = self.bridge.move_to_device(request["batch"])
                    logits = self._teacher_logits_local(batch)
                    if dist.get_rank() in output_ranks:
                        encoded = self._encode(logits, batch, request["logits_transport"])
                self._bridge("send_logits", wave, encoded)

    # ---- student ----

    def _micro_batches(self, batch: dict) -> list[dict]:
        size = self.config.step_scheduler.local_batch_size
        return [
            {key: value[i : i + size].to(self.device) for key, value in batch.items()}
            for i in range(0, batch["input_ids"].shape[0], size)
        ]

    def _sum_over_dp(self, values: list[float], *, and_cp: bool = False) -> list[float]:
        """Sum over data-parallel ranks; `and_cp` also over context-parallel ranks (per-rank token shares)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, group=self.dp_mesh.get_group())
        if and_cp and self.setups.student.cp_size > 1:
            dist.all_reduce(tensor, group=self.setups.student.device_mesh.get_group("cp"))
        return tensor.tolist()

    def _shard(self, micro_batch: dict, teacher: dict | None) -> tuple[dict, dict | None]:
        """This cp rank's head-tail share of a micro-batch and of its encoded teacher logits (identity without cp)."""
        student = self.setups.student
        if student.cp_size == 1:
            return micro_batch, teacher
        local, _ = shard_student_batch(micro_batch, student, ignore_index=self.config.kd.ignore_index)
        if teacher is not None:
            # Every tensor of an encoding is [batch, sequence, ...]: cut the sequence like the student's.
            teacher = {key: shard_teacher_logits(value, student) if isinstance(value, torch.Tensor) and value.ndim >= 2
                       else value for key, value in teacher.items()}
        return local, teacher

    def _student_logits(self, micro_batch: dict) -> torch.Tensor | None:
        """The student's logits for a micro-batch; under pipeline parallel forward only, None before the last stage."""
        if self.pipeline is not None:
            return self.pipeline.forward(micro_batch)
        output = self.model(
            input_ids=micro_batch["input_ids"],
            position_ids=micro_batch["position_ids"],
            attention_mask=micro_batch["attention_mask"],
        )
        return output.logits

    def _step_items(self, batches: Iterator[dict]) -> Iterator[dict]:
        """The micro-batches of every remaining step in order, each with its step's local valid-token count."""
        ignore = self.config.kd.ignore_index
        for _ in range(self.start_step, self.config.step_scheduler.max_steps):
            micro_batches = self._micro_batches(next(batches))
            valid = sum(int((micro_batch["labels"] != ignore).sum()) for micro_batch in micro_batches)
            for micro_batch in micro_batches:
                yield {"micro_batch": micro_batch, "step_valid": valid}

    def _teacher_feed(self, items: Iterator[dict]) -> Iterator[tuple[dict, dict | None]]:
        """(item, encoded teacher logits) in order; the logits are None when the loss needs no teacher.

        On separate meshes with `kd.overlap_teacher` a `TeacherPrefetcher` asks the teacher for the next
        micro-batch while this one trains (the next step's micro-batches under pipeline parallel, whose
        schedule takes a whole step at once): the same requests in the same order, so the same logits.
        """
        kd = self.config.kd
        if kd.kd_ratio == 0:
            return ((item, None) for item in items)
        if self.bridge is not None and kd.overlap_teacher:
            return TeacherPrefetcher(
                self.bridge, items, depth=self.num_micro_batches if self.pipeline is not None else 1,
                batch_fn=lambda item: {"batch": item["micro_batch"], "logits_transport": kd.logits_transport},
            )
        return ((item, self._teacher_logits(item["micro_batch"])) for item in items)

    def _next_from(self, feed: Iterator) -> tuple[tuple[dict, dict | None], float]:
        """The next (item, teacher logits) of `feed` and the seconds spent waiting for it."""
        started = time.perf_counter()
        with self.faults.watch("the teacher request", "teacher"):
            pair = next(feed)
        return pair, time.perf_counter() - started

    def _micro_batch_loss(
        self, logits: torch.Tensor, micro_batch: dict, teacher_logits: dict | None, norm: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(the loss to backpropagate, its loss / ce_loss / kd_loss values) of one micro-batch."""
        kd_cfg = self.config.kd
        labels = micro_batch["labels"]
        kd_logits = logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]
        ce = cross_entropy_loss(logits, labels, ignore_index=kd_cfg.ignore_index, num_valid_tokens=norm,
                                chunk_size=kd_cfg.chunk_size) if kd_cfg.kd_ratio < 1 else None
        kd = kd_loss_encoded(kd_logits, teacher_logits, labels, temperature=kd_cfg.temperature,
                             ignore_index=kd_cfg.ignore_index, num_valid_tokens=norm,
                             chunk_size=kd_cfg.chunk_size) if kd_cfg.kd_ratio > 0 else None
        loss = kd_objective(ce, kd, kd_cfg.kd_ratio)
        values = {"loss": float(loss.detach()), "ce_loss": float(ce.detach()) if ce is not None else 0.0,
                  "kd_loss": float(kd.detach()) if kd is not None else 0.0}
        # Wrappers average gradients over dp (and cp) ranks; the normalization asks for their sum.
        return loss * student_loss_scale(self.setups.student), values

    def train_step(self, feed: Iterator[tuple[dict, dict | None]]) -> dict[str, float]:
        """One optimizer step over the next `num_micro_batches` pairs of `feed` (see `_teacher_feed`)."""
        pair, wait = self._next_from(feed)
        (num_valid,) = self._sum_over_dp([pair[0]["step_valid"]])
        norm = max(num_valid, 1.0)
        records: list[dict[str, float]] = []
        if self.pipeline is None:
            for index in range(self.num_micro_batches):
                if index:
                    pair, waited = self._next_from(feed)
                    wait += waited
                micro_batch, teacher_logits = self._shard(pair[0]["micro_batch"], pair[1])
                logits = self._student_logits(micro_batch)
                loss, values = self._micro_batch_loss(logits, micro_batch, teacher_logits, norm)
                loss.backward()
                records.append(values)
        else:
            # The schedule runs every micro-batch of the step at once: all teacher logits first (the last
            # stage's; None on the others), while the prefetcher already asks for the next step's.
            pairs = [pair]
            for _ in range(1, self.num_micro_batches):
                pair, waited = self._next_from(feed)
                pairs.append(pair)
                wait += waited
            micro_batches, teacher_logits = zip(*(self._shard(item["micro_batch"], logits) for item, logits in pairs))
            by_index: dict[int, dict[str, float]] = {}

            def loss_fn(index: int, logits: torch.Tensor) -> torch.Tensor:
                loss, by_index[index] = self._micro_batch_loss(
                    logits, micro_batches[index], teacher_logits[index], norm
                )
                return loss

            self.pipeline.step(list(micro_batches), loss_fn)
            # Only the last stage computed losses; every stage logs and checkpoints the same values.
            records = broadcast_loss_metrics_from_last_stage(
                [by_index[i] for i in range(len(pairs))] if self.pipeline.is_last else None,
                pp_group=self.setups.student.pp_group,
            )
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        totals = [sum(record[key] for record in records) for key in ("loss", "ce_loss", "kd_loss")]
        summed = self._sum_over_dp(totals, and_cp=True)
        return {
            "loss": summed[0], "ce_loss": summed[1], "kd_loss": summed[2], "lr": lr, "grad_norm": grad_norm,
            "num_tokens": num_valid, "teacher_wait_s": wait,
        }

    def _clip_gradients(self) -> float:
        stages = self.setups.student.pp_group if self.pipeline is not None else None
        copies = self.pipeline.tied_copies if self.pipeline is not None else ()
        return clip_grad_norm(self.model.parameters(), self.config.optimizer.max_grad_norm, stages_group=stages,
                              uncounted=copies)

    @torch.no_grad()
    def evaluate(self, *, with_teacher: bool = False) -> dict[str, float]:
        """Validation CE (and perplexity) of the student, and of the teacher when asked."""
        steps = self.config.step_scheduler
        ignore = self.config.kd.ignore_index
        sums = [0.0, 0.0, 0.0]  # student CE sum, teacher CE sum, token count
        self.model.eval()
        for index, batch in enumerate(
            data.eval_batches(self.val_set, batch_size=steps.local_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size)
        ):
            if steps.val_batches is not None and index >= steps.val_batches:
                break
            micro_batch = {key: value.to(self.device) for key, value in batch.items()}
            teacher_logits = self._teacher_logits(micro_batch, mode="full") if with_teacher else None
            micro_batch, teacher_logits = self._shard(micro_batch, teacher_logits)
            labels = micro_batch["labels"]
            logits = self._student_logits(micro_batch)
            if logits is None:  # a pipeline stage before the last: the last stage's sums arrive below
                continue
            sums[0] += float(cross_entropy_loss(logits, labels, ignore_index=ignore, num_valid_tokens=1))
            if with_teacher:
                sums[1] += float(cross_entropy_loss(teacher_logits["logits"], labels, ignore_index=ignore,
                                                    num_valid_tokens=1))
            sums[2] += float((labels != ignore).sum())
        self.model.train()
        if self.pipeline is not None:
            last = {"sums": torch.tensor(sums, dtype=torch.float64)} if self.pipeline.is_last else None
            sums = broadcast_tensors_from_last_stage(last, pp_group=self.setups.student.pp_group)["sums"].tolist()
        student_sum, teacher_sum, count = self._sum_over_dp(sums, and_cp=True)
        count = max(count, 1.0)
        result = {"val_loss": student_sum / count, "val_perplexity": math.exp(min(student_sum / count, 50.0))}
        if with_teacher:
            result["teacher_val_loss"] = teacher_sum / count
        return result

    def _progress(self, total: int):
        if not (is_logging_rank() and self.config.logging.progress_bar):
            return None
        from tqdm import tqdm

        return tqdm(total=total, initial=self.start_step, desc="distill", dynamic_ncols=True)

    def train(self) -> None:
        if not self.is_student:
            self.serve_teacher()
            return
        try:
            self._train_student()
        except PeerLostError:
            raise  # a peer is gone or silent: STOP_TEACHER would only fail or wait out the timeout
        except BaseException:
            self._release_teacher_after_failure()
            raise
        if self.bridge is not None:
            self._bridge("broadcast_command", STOP_TEACHER)

    def _release_teacher_after_failure(self) -> None:
        """Tell the teacher to stop, briefly and only if it can help; this rank's error is the one to report.

        Only the first student rank's command reaches the teacher. Peers of a rank that failed on its own
        (out of memory, say) may be inside another collective and never take part, so the attempt is
        bounded: past it the rank simply exits, and its peers then fail fast on the lost connection.
        """
        if self.bridge is None or self.bridge.claimed or dist.get_rank() != self.setups.student_ranks[0]:
            return  # a prefetch thread that could not be stopped still holds the bridge
        with contextlib.suppress(RuntimeError):  # timed out or a peer gone: nothing more to do here
            self.bridge.broadcast_command(STOP_TEACHER, timeout=datetime.timedelta(seconds=_FAILURE_WAIT_S))

    def _stop_agreed(self) -> bool:
        """Whether any student rank was asked to stop: one all-reduce, so all stop at the same step."""
        flag = torch.tensor([int(self._stop.requested())], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.student_group)
        return bool(flag.item())

    def _train_student(self) -> None:
        config, steps = self.config, self.config.step_scheduler
        with self.faults.watch("the first evaluation", "student"):
            if self._stop_agreed():  # asked to stop during setup: not even the evaluation
                self._stopped(self.start_step, self.start_step)
                return
            before = self.evaluate(with_teacher=True)
        self.metrics.log("eval", self.start_step, before)
        self.summary.update(val_loss_before=before["val_loss"], teacher_val_loss=before["teacher_val_loss"])
        batches = data.iterate_batches(
            self.train_set, global_batch_size=steps.global_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size,
            seed=config.dataset.seed, start_step=self.start_step,
        )
        feed = self._teacher_feed(self._step_items(batches))
        try:
            step, saved = self._train_steps(feed)
        except PeerLostError:
            raise  # a prefetch thread may wait on the lost peer forever: it ends with the process
        except BaseException:
            # The prefetch thread may wait on peers that are stuck elsewhere: do not wait for it long.
            if isinstance(feed, TeacherPrefetcher):
                feed.close(timeout=_FAILURE_WAIT_S)
            raise
        self._close_feed(feed)
        if step < steps.max_steps:
            self._stopped(step, saved)
            return
        with self.faults.watch("the last evaluation", "student"):
            after = self.evaluate()
        self.metrics.log("eval", step, after)
        self.summary["val_loss_after"] = after["val_loss"]
        if config.checkpoint.enabled and config.checkpoint.save_hf:
            with self.faults.watch("the HF export", "student"):
                self.summary["hf_dir"] = str(self.export_hf().resolve())
        if is_logging_rank():
            (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))

    def _train_steps(self, feed: Iterator) -> tuple[int, int]:
        """Train until max_steps or an agreed stop; returns (the last step trained, the last step saved)."""
        config, steps = self.config, self.config.step_scheduler
        progress = self._progress(steps.max_steps)
        step = saved = self.start_step
        self.model.train()
        while step < steps.max_steps:
            with self.faults.watch(f"step {step + 1}", "student"):
                if self._stop_agreed():
                    break
                started = time.perf_counter()
                metrics = self.train_step(feed)
            step += 1
            elapsed = time.perf_counter() - started
            metrics["tokens_per_s"] = metrics["num_tokens"] / elapsed
            metrics["step_time_s"] = elapsed
            self.metrics.log("train", step, metrics)
            if progress is not None:
                progress.set_postfix(loss=f"{metrics['loss']:.3f}", ce=f"{metrics['ce_loss']:.3f}",
                                     kd=f"{metrics['kd_loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                progress.update(1)
            if steps.val_every_steps and step % steps.val_every_steps == 0 and step < steps.max_steps:
                with self.faults.watch(f"the evaluation after step {step}", "student"):
                    self.metrics.log("eval", step, self.evaluate())
            if config.checkpoint.enabled and steps.ckpt_every_steps and step % steps.ckpt_every_steps == 0:
                self.save(step)
                saved = step
        if progress is not None:
            progress.close()
        return step, saved

    def _close_feed(self, feed: Iterator) -> None:
        """End the teacher feed: a prefetched request in flight completes (its logits are dropped) and the
        bridge is free again for evaluation and STOP_TEACHER."""
        if isinstance(feed, TeacherPrefetcher):
            with self.faults.watch("the last teacher request", "teacher"):
                feed.close()

    def _stopped(self, step: int, saved: int) -> None:
        """After an agreed stop at `step`: checkpoint it (unless it is on disk or nothing was trained)."""
        self.summary["stopped_at_step"] = step
        note = "checkpointing is off: nothing saved"
        if self.config.checkpoint.enabled:
            if step != saved:
                self.save(step)
            where = ckpt.checkpoint_dir(self.checkpoint_root, step)
            note = f"resume from {where} with --resume" if step else "nothing trained yet"
        print0(f"meshkd: stopped at step {step} on {self._stop.reason()}; {note}")

    def save(self, step: int) -> None:
        with self.faults.watch(f"saving the checkpoint of step {step}", "student"):
            ckpt.save_checkpoint(
                self.checkpoint_root, step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                group=self.student_group,
            )

    def export_hf(self) -> Path:
        out_dir = self.run_dir / "hf_student"
        if self.pipeline is None:
            state_dict, model = gather_full_state_dict(self.model), _unwrap(self.model)
        else:
            # This rank holds one stage: the whole model is written from an empty (meta) shell of its config.
            state_dict = self.pipeline.full_state_dict()
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(self.model.config)
        if is_logging_rank():
            models.save_hf_model(model, self.tokenizer, out_dir, state_dict=state_dict)
        if self.student_group is not None or dist.get_world_size() > 1:
            dist.barrier(group=self.student_group)
        return out_dir

    def cleanup(self) -> None:
        if hasattr(self, "metrics"):
            self.metrics.close()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()

    def run(self) -> dict:
        """setup, train, cleanup; returns the summary (validation losses, HF directory) on student ranks.

        SIGINT and SIGTERM are handled while it runs (main thread only): the run stops at the next step
        boundary with a checkpoint of that step, and `summary["stopped_at_step"]` says where.
        """
        self._stop.install()
        try:
            self.setup()
            self.train()
        finally:
            self.cleanup()
            self._stop.restore()
        return self.summary


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)

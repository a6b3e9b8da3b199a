"""The KD recipe: one class with setup / train / cleanup, run by every rank of the world.

Student ranks train; teacher ranks serve. On shared meshes every rank is both: it runs the teacher on
its own micro-batch, then trains. On separate meshes the student drives the teacher through
`KDMeshBridge`: RUN_TEACHER per micro-batch, its batch across, full logits back; the teacher loop serves
until STOP_TEACHER, which the student always sends on exit, error paths included.

Loss normalization: each micro-batch loss is a sum over its valid tokens divided by the global number of
valid tokens of the optimizer step (all micro-batches, all data-parallel ranks). Data-parallel wrappers
average gradients over dp ranks, so the loss is multiplied by dp before backward to turn that average
into the sum the normalization asks for. The curve then equals a single-process run on the same global
batch.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.distributed.tensor import DTensor

from meshkd import checkpoint as ckpt
from meshkd import data, models
from meshkd.config import KDRecipeConfig, expand_path
from meshkd.loss import cross_entropy_loss, kd_loss, kd_objective
from meshkd.metrics import MetricsSink, is_logging_rank, print0
from meshkd.packing import configure_kd_teacher_packing, configure_packing
from meshkd.parallel import TeacherRunner, gather_full_state_dict, parallelize_student
from meshkd.topology import create_kd_distributed_setups
from meshkd.transport import RUN_TEACHER, STOP_TEACHER, KDMeshBridge

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def _load_tokenizer(section) -> object:
    if section.tokenizer == "byte":
        return models.byte_tokenizer()
    return models.load_tokenizer(path=section.tokenizer or section.path, gguf_file=section.gguf_file)


def _load_model(section) -> torch.nn.Module:
    return models.load_causal_lm(
        path=section.path,
        gguf_file=section.gguf_file,
        random_init=section.random_init,
        keep_layers=section.keep_layers,
        dtype=section.dtype,
        seed=section.seed,
    )


class KDRecipe:
    """Distill `config.teacher_model` into `config.model`; `run()` does setup, train and cleanup."""

    def __init__(self, config: KDRecipeConfig, *, resume: bool = False) -> None:
        self.config = config
        self.resume = resume
        self.run_dir = Path(config.logging.run_dir)
        self.bridge: KDMeshBridge | None = None
        self.summary: dict = {}
        self._owns_process_group = False

    # ---- setup ----

    def setup(self) -> None:
        config = self.config
        self.device = _device(config)
        if not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=config.collective_timeout_s))
            self._owns_process_group = True
        self.setups = create_kd_distributed_setups(config, dist.get_world_size())
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

        # Tokenizers first: a mismatch must fail before any weights load.
        self.tokenizer = _load_tokenizer(config.model)
        teacher_tokenizer = _load_tokenizer(config.teacher_model)
        torch.manual_seed(config.seed)
        student_model = _load_model(config.model) if self.is_student else None
        teacher_model = _load_model(config.teacher_model) if self.is_teacher else None
        sizes = self._exchange_vocab_sizes(student_model, teacher_model)
        self.vocab_size = models.common_vocab_size(
            self.tokenizer, teacher_tokenizer, student_vocab_size=sizes[0], teacher_vocab_size=sizes[1]
        )
        if self.is_student and student.tp_size > 1 and sizes[0] != self.vocab_size:
            raise ValueError(
                f"student vocabulary {sizes[0]} differs from the common vocabulary {self.vocab_size}: not supported "
                "with distributed.tp_size > 1"
            )
        if self.is_student:
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
            )
            max_positions = getattr(student_model.config, "max_position_embeddings", None)
            if max_positions is not None and steps.sequence_length > max_positions:
                raise ValueError(
                    f"step_scheduler.sequence_length({steps.sequence_length}) exceeds the student's maximum "
                    f"{max_positions} positions"
                )

        # NEAT packing on both roles, checked across the control group on separate meshes.
        if student_model is not None:
            configure_packing(student_model)
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
        self.teacher = (
            TeacherRunner(teacher_model.to(self.device), self.setups.teacher, device=self.device)
            if teacher_model is not None
            else None
        )
        if self.is_student:
            self.model = parallelize_student(student_model.to(self.device), student)
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
        if self.resume and self.is_student:
            latest = ckpt.latest_checkpoint(self.checkpoint_root)
            if latest is not None:
                meta = ckpt.load_checkpoint(
                    latest, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                    group=self.student_group,
                )
                self.start_step = meta["step"]
                print0(f"resumed from {latest} at step {self.start_step}")
        self.metrics = MetricsSink(
            self.run_dir, tensorboard=config.logging.tensorboard, resume_step=self.start_step if self.resume else None
        )
        if is_logging_rank():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))

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

    def _teacher_logits(self, micro_batch: dict) -> torch.Tensor:
        """Full teacher logits [batch, sequence, common vocab] for this rank's micro-batch."""
        if self.bridge is None:
            logits = self._teacher_logits_local(micro_batch)
            if logits is None:
                raise RuntimeError("teacher pipeline stages are not supported on shared meshes")
            return logits
        self.bridge.broadcast_command(RUN_TEACHER)
        received = None
        for wave in range(self.bridge.num_waves):
            self.bridge.send_batch(wave, micro_batch)
            logits = self.bridge.send_logits(wave, None)
            if logits is not None:
                received = logits
        if received is None:
            raise RuntimeError(f"student rank {dist.get_rank()} received no teacher logits")
        return received

    def serve_teacher(self) -> None:
        """Teacher-only ranks: answer RUN_TEACHER with logits until STOP_TEACHER."""
        output_ranks = {replica.output_rank for replica in self.bridge.teacher_replicas}
        while self.bridge.broadcast_command() == RUN_TEACHER:
            for wave in range(self.bridge.num_waves):
                batch = self.bridge.send_batch(wave, None)
                logits = self._teacher_logits_local(self.bridge.move_to_device(batch))
                self.bridge.send_logits(wave, logits if dist.get_rank() in output_ranks else None)

    # ---- student ----

    def _micro_batches(self, batch: dict) -> list[dict]:
        size = self.config.step_scheduler.local_batch_size
        return [
            {key: value[i : i + size].to(self.device) for key, value in batch.items()}
            for i in range(0, batch["input_ids"].shape[0], size)
        ]

    def _sum_over_dp(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, group=self.dp_mesh.get_group())
        return tensor.tolist()

    def _student_logits(self, micro_batch: dict) -> torch.Tensor:
        output = self.model(
            input_ids=micro_batch["input_ids"],
            position_ids=micro_batch["position_ids"],
            attention_mask=micro_batch["attention_mask"],
        )
        return output.logits

    def train_step(self, batch: dict) -> dict[str, float]:
        kd_cfg = self.config.kd
        micro_batches = self._micro_batches(batch)
        valid = sum(int((mb["labels"] != kd_cfg.ignore_index).sum()) for mb in micro_batches)
        (num_valid,) = self._sum_over_dp([valid])
        totals = {"loss": 0.0, "ce_loss": 0.0, "kd_loss": 0.0}
        wait = 0.0
        for micro_batch in micro_batches:
            started = time.perf_counter()
            teacher_logits = self._teacher_logits(micro_batch) if kd_cfg.kd_ratio > 0 else None
            wait += time.perf_counter() - started
            logits = self._student_logits(micro_batch)
            kd_logits = logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]
            labels = micro_batch["labels"]
            norm = max(num_valid, 1.0)
            ce = cross_entropy_loss(logits, labels, ignore_index=kd_cfg.ignore_index, num_valid_tokens=norm,
                                    chunk_size=kd_cfg.chunk_size) if kd_cfg.kd_ratio < 1 else None
            kd = kd_loss(kd_logits, teacher_logits, labels, temperature=kd_cfg.temperature,
                         ignore_index=kd_cfg.ignore_index, num_valid_tokens=norm,
                         chunk_size=kd_cfg.chunk_size) if kd_cfg.kd_ratio > 0 else None
            loss = kd_objective(ce, kd, kd_cfg.kd_ratio)
            (loss * self.dp_size).backward()
            totals["loss"] += float(loss.detach())
            totals["ce_loss"] += float(ce.detach()) if ce is not None else 0.0
            totals["kd_loss"] += float(kd.detach()) if kd is not None else 0.0
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        summed = self._sum_over_dp([totals["loss"], totals["ce_loss"], totals["kd_loss"]])
        return {
            "loss": summed[0], "ce_loss": summed[1], "kd_loss": summed[2], "lr": lr, "grad_norm": grad_norm,
            "num_tokens": num_valid, "teacher_wait_s": wait,
        }

    def _clip_gradients(self) -> float:
        return clip_grad_norm(self.model.parameters(), self.config.optimizer.max_grad_norm)

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
            labels = micro_batch["labels"]
            logits = self._student_logits(micro_batch)
            sums[0] += float(cross_entropy_loss(logits, labels, ignore_index=ignore, num_valid_tokens=1))
            if with_teacher:
                teacher_logits = self._teacher_logits(micro_batch)
                sums[1] += float(cross_entropy_loss(teacher_logits, labels, ignore_index=ignore, num_valid_tokens=1))
            sums[2] += float((labels != ignore).sum())
        self.model.train()
        student_sum, teacher_sum, count = self._sum_over_dp(sums)
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
        config, steps = self.config, self.config.step_scheduler
        if not self.is_student:
            self.serve_teacher()
            return
        try:
            self._train_student()
        finally:
            if self.bridge is not None:
                self.bridge.broadcast_command(STOP_TEACHER)

    def _train_student(self) -> None:
        config, steps = self.config, self.config.step_scheduler
        before = self.evaluate(with_teacher=True)
        self.metrics.log("eval", self.start_step, before)
        self.summary.update(val_loss_before=before["val_loss"], teacher_val_loss=before["teacher_val_loss"])
        batches = data.iterate_batches(
            self.train_set, global_batch_size=steps.global_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size,
            seed=config.dataset.seed, start_step=self.start_step,
        )
        progress = self._progress(steps.max_steps)
        step = self.start_step
        self.model.train()
        while step < steps.max_steps:
            started = time.perf_counter()
            metrics = self.train_step(next(batches))
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
                self.metrics.log("eval", step, self.evaluate())
            if config.checkpoint.enabled and steps.ckpt_every_steps and step % steps.ckpt_every_steps == 0:
                self.save(step)
        if progress is not None:
            progress.close()
        after = self.evaluate()
        self.metrics.log("eval", step, after)
        self.summary["val_loss_after"] = after["val_loss"]
        if config.checkpoint.enabled and config.checkpoint.save_hf:
            self.summary["hf_dir"] = str(self.export_hf().resolve())
        if is_logging_rank():
            (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))

    def save(self, step: int) -> None:
        ckpt.save_checkpoint(
            self.checkpoint_root, step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            group=self.student_group,
        )

    def export_hf(self) -> Path:
        out_dir = self.run_dir / "hf_student"
        state_dict = gather_full_state_dict(self.model)
        if is_logging_rank():
            models.save_hf_model(_unwrap(self.model), self.tokenizer, out_dir, state_dict=state_dict)
        if self.student_group is not None or dist.get_world_size() > 1:
            dist.barrier(group=self.student_group)
        return out_dir

    def cleanup(self) -> None:
        if hasattr(self, "metrics"):
            self.metrics.close()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()

    def run(self) -> dict:
        """setup, train, cleanup; returns the summary (validation losses, HF directory) on student ranks."""
        try:
            self.setup()
            self.train()
        finally:
            self.cleanup()
        return self.summary


def clip_grad_norm(parameters, max_norm: float | None) -> float:
    """Clip gradients to a total norm of `max_norm` (None: only measure); returns the total norm.

    Gradients may mix plain tensors (e.g. replicated norms under TP without FSDP) and DTensors on different
    meshes and placements, which torch's clip_grad_norm_ cannot combine; so each (mesh, placements) group
    gets its own norm, in the same order on every rank, and the groups are combined as plain numbers.
    """
    groups: dict = {}
    for parameter in parameters:
        grad = parameter.grad
        if grad is not None:
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            groups.setdefault(key, []).append(grad)
    squares = 0.0
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares += float(norm) ** 2
    total = math.sqrt(squares)
    if max_norm is not None and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for grads in groups.values():
            for grad in grads:
                grad.mul_(scale)
    return total


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)

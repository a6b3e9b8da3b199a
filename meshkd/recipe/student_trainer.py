"""The student's role in a run: load, lay out, train against a teacher source, evaluate, save, export.

One step: `data.iterate_batches` gives this data-parallel rank's share of the global batch, cut into
micro-batches (`_step_items`); the teacher source (`meshkd.core.teacher_protocol`; from `kd.teacher_cache`
a `meshkd.recipe.teacher_cache.CachedTeacher`) pairs each with its teacher logits, fetched one micro-batch
ahead (`kd.overlap_teacher`) so the teacher's forward, or the cache's read, overlaps the student's step;
`train_step` (or `pipelined_train_step`, whose schedule runs a whole step at once) computes each
micro-batch's loss (`micro_batch_loss`), backpropagates, clips and steps. With `kd.mode: on_policy` a
step's micro-batches are first completed by the student itself (`meshkd.recipe.on_policy`,
`_on_policy_step`), then scored by the teacher and trained on in the same way.

Loss normalization: each micro-batch loss is a sum over its valid tokens divided by the global number of
valid tokens of the optimizer step (all micro-batches, all data-parallel ranks). Data-parallel wrappers
average gradients over dp ranks, so the loss is multiplied by dp before backward to turn that average
into the sum the normalization asks for. The curve then equals a single-process run on the same global
batch.

A pipelined student (`meshkd.parallel.student_pipeline`) gets its teacher logits on the last stage only;
the loss values reach every stage through `broadcast_loss_metrics_from_last_stage` (evaluation sums
through `broadcast_tensors_from_last_stage`), so every rank logs, clips and checkpoints alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import queue
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from meshkd.core.agreement import gather_values, group_device
from meshkd.core.bridge import KDMeshBridge
from meshkd.core.logits_codec import LABEL_LOG_PROBS
from meshkd.core.loss import cross_entropy_loss, kd_loss_encoded, kd_objective
from meshkd.core.packing import configure_packing
from meshkd.core.stage_broadcast import broadcast_loss_metrics_from_last_stage, broadcast_tensors_from_last_stage
from meshkd.core.teacher_protocol import LocalTeacher, TeacherClient, TeacherPrefetcher, TeacherRequest
from meshkd.core.topology import KDDistributedSetups
from meshkd.parallel.context_parallel import shard_student_batch, shard_teacher_logits
from meshkd.parallel.data_parallel import (
    clip_grad_norm,
    parallelize_student,
    scale_expert_gradients,
    student_loss_scale,
)
from meshkd.parallel.mixed_precision import rounded_update_share
from meshkd.parallel.sharded_loading import is_empty, load_shards
from meshkd.parallel.student_pipeline import StudentPipeline
from meshkd.recipe import checkpoint as ckpt
from meshkd.recipe import data
from meshkd.recipe.config import KDRecipeConfig
from meshkd.recipe.faults import FaultWatch, PeerLostError, StopRequest
from meshkd.recipe.loaders import load_section_model, load_section_model_for_layout
from meshkd.recipe.metrics import MetricsSink, is_logging_rank, print0, read_metrics, warn0
from meshkd.recipe.models import resolve_dtype
from meshkd.recipe.on_policy import StudentCompletions, build_prompt_set, is_on_policy, row_seed
from meshkd.recipe.preflight import Preflight, about
from meshkd.recipe.router_loss import RouterLoss
from meshkd.recipe.teacher_cache import CachedTeacher, rows_asked
from meshkd.recipe.teacher_worker import TeacherForward, lay_out_teacher, load_teacher

# After a rank-local failure in training: how long to try to hand off cleanly before simply exiting.
FAILURE_WAIT_S = 5.0


class StudentTrainer:
    """A student rank (on shared meshes also the teacher): the recipe calls load, lay_out, resume, run, close."""

    def __init__(self, config: KDRecipeConfig, setups: KDDistributedSetups, faults: FaultWatch,
                 device: torch.device, stop: StopRequest) -> None:
        self.config = config
        self.setups = setups
        self.setup = setups.student
        self.faults = faults
        self.device = device
        self._stop = stop
        self.run_dir = Path(config.logging.run_dir)
        self.checkpoint_root = Path(config.checkpoint.dir or self.run_dir / "checkpoints")
        self.dp_size, self.dp_rank = self.setup.dp_size, self.setup.dp_mesh.get_local_rank()
        steps = config.step_scheduler
        self.num_micro_batches = steps.global_batch_size // (steps.local_batch_size * self.dp_size)
        self.summary: dict = {}
        self.start_step = 0
        self.skipped_steps = 0  # non-finite steps skipped since this process started (kd.on_nonfinite)
        self.metrics: MetricsSink | None = None

    # ---- setup, phase by phase ----

    def load(self, checked: Preflight) -> None:
        """This rank's models and data (the teacher too on shared meshes)."""
        config, steps = self.config, self.config.step_scheduler
        self.tokenizer = checked.tokenizer
        # DDP replicates the whole student, so it loads whole; FSDP2 reads its share once laid out. Its
        # parameters are float32 master weights unless model.pure_half_precision (meshkd.parallel.mixed_precision).
        section = dataclasses.replace(config.model, dtype=config.model.parameter_dtype())
        with about("model"):
            if self.setup.strategy == "fsdp2":
                self._model, self._checkpoint = load_section_model_for_layout(section)
            else:
                self._model, self._checkpoint = load_section_model(section), None
        self._cache_manifest = checked.cache_manifest
        self._teacher = None if self.setups.separate or self._cache_manifest else load_teacher(config)
        with about("dataset"):
            self.train_set, self.val_set = data.build_run_datasets(self.tokenizer, config.dataset,
                                                                   sequence_length=steps.sequence_length)
            self.train_prompts = self.val_prompts = None
            if config.dataset.prompt_key and self.generates:
                self.train_prompts, self.val_prompts = build_prompt_set(
                    self.tokenizer, config.dataset,
                    max_prompt_tokens=steps.sequence_length - config.kd.generation.max_new_tokens)
        configure_packing(self._model)

    def vocab_rows(self) -> tuple[int, int]:
        """(student, teacher) output-embedding rows known here; -1 for a model this rank does not hold."""
        teacher = self._teacher[0].get_output_embeddings().weight.shape[0] if self._teacher else -1
        if self._cache_manifest is not None:
            teacher = self._cache_manifest["teacher_vocab_rows"]
        return self._model.get_output_embeddings().weight.shape[0], teacher

    def packing_parts(self) -> tuple[list, list]:
        """(teacher parts, student parts) held here, for `configure_kd_teacher_packing`."""
        return ([self._teacher[0]] if self._teacher else []), [self._model]

    def lay_out(self, vocab_size: int, bridge: KDMeshBridge | None) -> None:
        """Lay out the models (teacher first, as its ranks do), then the optimizer and the teacher source."""
        config, setup = self.config, self.setup
        self.vocab_size = vocab_size
        self.bridge = bridge
        if self._cache_manifest is not None:
            datasets = {"train": self.train_set, "validation": self.val_set}
            self.teacher = CachedTeacher(config.kd.teacher_cache, self._cache_manifest, datasets, device=self.device,
                                         asked=rows_asked(config, datasets, dp_size=self.dp_size))
        elif bridge is None:
            runner = lay_out_teacher(*self._teacher, self.setups.teacher, device=self.device)
            self.teacher = LocalTeacher(TeacherForward(runner, vocab_size=vocab_size, kd=config.kd, seed=config.seed))
        else:
            self.teacher = TeacherClient(bridge)
        self._teacher = None
        # Hooks on the routers the model declares, on the whole model: pipeline stages keep theirs.
        self.router_loss = RouterLoss.for_student(self._model, config.kd.router_aux_loss_coef)
        compute_dtype = resolve_dtype(config.model.dtype)
        if setup.pp_size > 1:
            self.pipeline = StudentPipeline(self._model, setup, device=self.device, schedule=setup.pp_schedule,
                                            num_micro_batches=self.num_micro_batches, router_loss=self.router_loss,
                                            compute_dtype=compute_dtype)
            self.model = self.pipeline.stage_model
        else:
            self.pipeline = None
            # TeacherRunner and StudentPipeline move their model; parallelize_student leaves that to us.
            if not is_empty(self._model):  # else `load_shards` gives it storage on the device
                self._model.to(self.device)
            self.model = parallelize_student(self._model, setup, compute_dtype=compute_dtype)
        if self._checkpoint is not None:
            with about("model"):
                load_shards(self.model, self._checkpoint, device=self.device)
        del self._model, self._checkpoint
        opt = config.optimizer
        if opt.name == "adamw":
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay,
                                               betas=tuple(opt.betas), eps=opt.eps, foreach=False)
        else:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, config.lr_scheduler.factor(config.step_scheduler.max_steps))
        if config.model.pure_half_precision:
            self._warn_rounded_updates()

    def _warn_rounded_updates(self) -> None:
        """Say how much of a pure half-precision student an update of the peak lr cannot move."""
        lr, dtype = self.config.optimizer.lr, self.config.model.dtype
        share = rounded_update_share(self.model.parameters(), lr, group=self.student_group)
        if share > 0:
            warn0(f"model.pure_half_precision: the weights and optimizer states are {dtype}; an update of the "
                  f"peak lr {lr:g} (an Adam step's size) is below half a {dtype} step for {share:.1%} of the "
                  f"loaded weights and rounds away, so they do not learn. Without the key the student keeps "
                  f"float32 master weights and computes in {dtype} (about 16 bytes a parameter with AdamW, "
                  f"against 8)")

    def resume(self, resume: bool) -> None:
        """With `resume`, continue from the newest intact checkpoint; open the metrics and the run directory.

        Partial checkpoint directories, left by saves that did not finish, are removed first.
        """
        if is_logging_rank():
            for stale in ckpt.remove_partials(self.checkpoint_root):
                print0(f"meshkd: removed {stale}, left by a checkpoint save that did not finish")
        if resume:
            latest, self.start_step = ckpt.resume_latest(self.checkpoint_root, model=self.model,
                                                         optimizer=self.optimizer, scheduler=self.scheduler,
                                                         group=self.student_group)
            print0(f"resumed from {latest} at step {self.start_step}" if latest is not None
                   else f"no checkpoint under {self.checkpoint_root}: starting at step 0")
        self.metrics = MetricsSink(self.run_dir, tensorboard=self.config.logging.tensorboard,
                                   resume_step=self.start_step if resume else None)
        if is_logging_rank():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.config.to_dict(), sort_keys=False))

    @property
    def generates(self) -> bool:
        """Whether the student completes prompts: to train on them (on-policy), or to evaluate them."""
        return self.config.kd.mode == "on_policy" or self.evaluates_samples

    @property
    def evaluates_samples(self) -> bool:
        evaluate = self.config.kd.generation.evaluate
        return evaluate if evaluate is not None else self.config.kd.mode == "on_policy"

    def _completions(self, *, greedy: bool = False) -> StudentCompletions:
        """The student's completions with its current weights (DDP's inner model: no gradient sync needed)."""
        return StudentCompletions(getattr(self.model, "module", self.model), self.config, self.tokenizer,
                                  pad_token_id=self.train_set.pad_token_id, device=self.device, greedy=greedy)

    @property
    def student_group(self) -> dist.ProcessGroup | None:
        """The student ranks' group on separate meshes; None (the world) on shared ones."""
        return self.bridge.student_group if self.bridge is not None else None

    # ---- the run ----

    def run(self) -> dict:
        """Train to max_steps or an agreed stop, then release the teacher; returns the summary."""
        try:
            self._train()
        except PeerLostError:
            raise  # a peer is gone or silent: STOP_TEACHER would only fail or wait out the timeout
        except BaseException:
            self._release_teacher_after_failure()
            raise
        with self.faults.watch("broadcast_command", "teacher"):
            self.teacher.close()
        return self.summary

    def _release_teacher_after_failure(self) -> None:
        """Tell the teacher to stop, briefly and only if it can help; this rank's error is the one to report.

        Only the first student rank's command reaches the teacher. Peers of a rank that failed on its own
        (out of memory, say) may be inside another collective and never take part, so the attempt is
        bounded: past it the rank simply exits, and its peers then fail fast on the lost connection. A
        prefetch thread that could not be stopped still holds the bridge: then nothing is sent.
        """
        if self.bridge is None or self.bridge.claimed or dist.get_rank() != self.setups.student_ranks[0]:
            return
        with contextlib.suppress(RuntimeError):  # timed out or a peer gone: nothing more to do here
            self.teacher.close(timeout=datetime.timedelta(seconds=FAILURE_WAIT_S))

    def _stop_agreed(self) -> bool:
        """Whether any student rank was asked to stop: one all-reduce, so all stop at the same step."""
        flag = torch.tensor([int(self._stop.requested())], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.student_group)
        return bool(flag.item())

    def _train(self) -> None:
        config, steps = self.config, self.config.step_scheduler
        with self.faults.watch("the first evaluation", "student"):
            if self._stop_agreed():  # asked to stop during setup: not even the evaluation
                self._stopped(self.start_step, self.start_step)
                return
            before = self._first_evaluation()
        self.summary.update(val_loss_before=before["val_loss"], teacher_val_loss=before["teacher_val_loss"])
        batches = data.iterate_batches(
            self.train_set, global_batch_size=steps.global_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size,
            seed=config.dataset.seed, start_step=self.start_step,
        )
        if config.kd.mode == "on_policy":
            prompt_batches = None if self.train_prompts is None else data.iterate_batches(
                self.train_prompts, global_batch_size=steps.global_batch_size, dp_rank=self.dp_rank,
                dp_size=self.dp_size, seed=config.dataset.seed, start_step=self.start_step)
            self._on_policy_batches = batches, prompt_batches
            feed = None  # each step makes its own (`_on_policy_step`)
        else:
            feed = self._teacher_feed(self._step_items(batches))
        try:
            step, saved = self._train_steps(feed)
        except PeerLostError:
            raise  # a prefetch thread may wait on the lost peer forever: it ends with the process
        except BaseException:
            # The prefetch thread may wait on peers that are stuck elsewhere: do not wait for it long.
            if isinstance(feed, TeacherPrefetcher):
                feed.close(timeout=FAILURE_WAIT_S)
            raise
        if isinstance(feed, TeacherPrefetcher):
            # A prefetched request in flight completes (its logits are dropped); the bridge is free again.
            with self.faults.watch("the last teacher request", "teacher"):
                feed.close()
        if step < steps.max_steps:
            self._stopped(step, saved)
            return
        with self.faults.watch("the last evaluation", "student"):
            after = self.evaluate()
            if self.evaluates_samples:
                after.update(self.evaluate_samples())
        self.metrics.log("eval", step, after)
        self.summary["val_loss_after"] = after["val_loss"]
        if self.skipped_steps:
            self.summary["skipped_steps"] = self.skipped_steps
        if config.checkpoint.enabled and config.checkpoint.save_hf:
            with self.faults.watch("the HF export", "student"):
                self.summary["hf_dir"] = str(self.export_hf().resolve())
        if is_logging_rank():
            (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))

    def _first_evaluation(self) -> dict[str, float]:
        """Step 0's evaluation (student and teacher): a resumed run reuses the one its run directory logged.

        Rank 0 reads the run's metrics and hands what it found to every student rank, so all take the same
        branch (the run directory need not be shared across hosts).
        """
        logged = None
        if self.start_step > 0 and is_logging_rank():
            with contextlib.suppress(FileNotFoundError):
                logged = next((record for record in read_metrics(self.run_dir)
                               if record["kind"] == "eval" and record["step"] == 0 and "teacher_val_loss" in record),
                              None)
        if self.start_step > 0:
            logged = gather_values(logged, self.student_group, device=group_device(self.student_group))[0]
        if logged is not None:
            return logged
        before = self.evaluate(with_teacher=True)
        if self.evaluates_samples:
            before.update(self.evaluate_samples())
        self.metrics.log("eval", self.start_step, before)
        return before

    def _train_steps(self, feed: Iterator) -> tuple[int, int]:
        """Train until max_steps or an agreed stop; returns (the last step trained, the last step saved)."""
        config, steps = self.config, self.config.step_scheduler
        progress = self._progress(steps.max_steps)
        step = saved = self.start_step
        self.model.train()
        train_step = self.train_step if self.pipeline is None else self.pipelined_train_step
        if feed is None:  # on-policy: every step makes its own feed from the student's completions
            train_step = self._on_policy_step
        while step < steps.max_steps:
            with self.faults.watch(f"step {step + 1}", "student"):
                if self._stop_agreed():
                    break
                started = time.perf_counter()
                metrics = train_step(feed)
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

    def _progress(self, total: int):
        if not (is_logging_rank() and self.config.logging.progress_bar):
            return None
        from tqdm import tqdm

        return tqdm(total=total, initial=self.start_step, desc="distill", dynamic_ncols=True)

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

    # ---- one step ----

    def _micro_batches(self, batch: dict) -> list[dict]:
        size = self.config.step_scheduler.local_batch_size
        return [{key: value[i : i + size].to(self.device) for key, value in batch.items()}
                for i in range(0, batch["input_ids"].shape[0], size)]

    def _valid_tokens(self, micro_batches: list[dict]) -> int:
        return sum(int((micro_batch["labels"] != self.config.kd.ignore_index).sum()) for micro_batch in micro_batches)

    def _step_items(self, batches: Iterator[dict]) -> Iterator[dict]:
        """The micro-batches of every remaining step in order, each with its step's local valid-token count."""
        for _ in range(self.start_step, self.config.step_scheduler.max_steps):
            micro_batches = self._micro_batches(next(batches))
            valid = self._valid_tokens(micro_batches)
            for micro_batch in micro_batches:
                yield {"micro_batch": micro_batch, "step_valid": valid}

    def _on_policy_step(self, _feed: None = None) -> dict[str, float]:
        """One on-policy step: the student completes the prompts of its on-policy micro-batches, the teacher
        scores each as soon as it is made (while the student completes the next), then `train_step`.

        Completions of the whole step come before any update: all are drawn from the step's weights.
        """
        kd, count = self.config.kd, self.num_micro_batches
        step = self.scheduler.last_epoch  # steps taken so far: this step's index
        text_batches, prompt_batches = self._on_policy_batches
        text = self._micro_batches(next(text_batches))
        prompts = text if prompt_batches is None else self._micro_batches(next(prompt_batches))
        pending: queue.SimpleQueue = queue.SimpleQueue()

        def made() -> Iterator[dict]:
            for _ in range(count):
                item = pending.get()
                if item is None:  # generation failed: no more requests
                    return
                yield item

        feed = self.teacher.prefetch(made(), depth=count, batch_fn=lambda item: TeacherRequest(
            item["micro_batch"], kd.logits_transport))
        completer, items, figures = self._completions(), [], [0.0, 0.0, 0.0]  # tokens, completions, on-policy
        started = time.perf_counter()
        try:
            for index, micro_batch in enumerate(text):
                if is_on_policy(kd.generation.seed, step, index, kd.on_policy_fraction):
                    size = prompts[index]["input_ids"].shape[0]
                    first = (self.dp_rank * count + index) * size  # the rows' place in the global batch
                    seeds = [row_seed(kd.generation.seed, step, first + row) for row in range(size)]
                    micro_batch, tokens, completed = completer.rows(prompts[index], seeds)
                    figures = [figures[0] + tokens, figures[1] + completed, figures[2] + 1]
                items.append({"micro_batch": micro_batch, "step_valid": 0})
                pending.put(items[-1])
            generation_s = time.perf_counter() - started
            # The items are the very dicts the teacher's feed hands back: the count reaches them all.
            valid = self._valid_tokens([item["micro_batch"] for item in items])
            for item in items:
                item["step_valid"] = valid
            metrics = self.train_step(feed)
        except BaseException:
            pending.put(None)
            if isinstance(feed, TeacherPrefetcher):
                feed.close(timeout=FAILURE_WAIT_S)
            raise
        if isinstance(feed, TeacherPrefetcher):
            feed.close()
        tokens, completions = self._sum_over_dp(figures[:2])
        metrics.update(generated_tokens=tokens, mean_completion_length=tokens / max(completions, 1.0),
                       on_policy_share=figures[2] / count, generation_s=generation_s,
                       generation_tokens_per_s=tokens / generation_s if figures[2] else 0.0)
        return metrics

    def _teacher_feed(self, items: Iterator[dict]) -> Iterator[tuple[dict, dict | None]]:
        """(item, encoded teacher logits) in order; the logits are None when the loss needs no teacher.

        With `kd.overlap_teacher` a teacher on its own ranks is asked for the next micro-batch while this
        one trains (the next step's micro-batches under pipeline parallel, whose schedule takes a whole step
        at once): the same requests in the same order, so the same logits.
        """
        kd = self.config.kd
        if kd.kd_ratio == 0:
            return ((item, None) for item in items)
        depth = (self.num_micro_batches if self.pipeline is not None else 1) if kd.overlap_teacher else 0
        return self.teacher.prefetch(items, depth=depth,
                                     batch_fn=lambda item: TeacherRequest(item["micro_batch"], kd.logits_transport))

    def _next_from(self, feed: Iterator) -> tuple[tuple[dict, dict | None], float]:
        """The next (item, teacher logits) of `feed` and the seconds spent waiting for it."""
        started = time.perf_counter()
        with self.faults.watch("the teacher request", "teacher"):
            pair = next(feed)
        return pair, time.perf_counter() - started

    def _shard(self, micro_batch: dict, teacher: dict | None) -> tuple[dict, dict | None]:
        """This cp rank's head-tail share of a micro-batch and of its encoded teacher logits (identity without cp)."""
        if self.setup.cp_size == 1:
            return micro_batch, teacher
        local, _ = shard_student_batch(micro_batch, self.setup, ignore_index=self.config.kd.ignore_index)
        if teacher is not None:
            # Every tensor of an encoding is [batch, sequence, ...]: cut the sequence like the student's.
            teacher = {key: shard_teacher_logits(value, self.setup) if isinstance(value, torch.Tensor)
                       and value.ndim >= 2 else value for key, value in teacher.items()}
        return local, teacher

    def micro_batch_loss(self, logits: torch.Tensor, micro_batch: dict, teacher_logits: dict | None,
                         norm: float, router: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """(the loss to backpropagate, its loss / ce_loss / kd_loss values) of one micro-batch.

        `router`: an MoE student's load-balancing loss of this micro-batch (under cp this rank's share); the
        objective adds `router_loss.coefficient` times its mean over the step's micro-batches on every dp rank."""
        kd_cfg = self.config.kd
        labels = micro_batch["labels"]
        kd_logits = logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]
        ce = cross_entropy_loss(logits, labels, ignore_index=kd_cfg.ignore_index, num_valid_tokens=norm,
                                chunk_size=kd_cfg.chunk_size) if kd_cfg.kd_ratio < 1 else None
        # chunk_size None: the micro-batch as one chunk, through the same kernel as chunks (the loss module's
        # autograd formula, its reference, makes more passes over the [tokens, vocab] logits).
        kd = kd_loss_encoded(kd_logits, teacher_logits, labels, temperature=kd_cfg.temperature,
                             ignore_index=kd_cfg.ignore_index, num_valid_tokens=norm,
                             chunk_size=kd_cfg.chunk_size or max(labels.numel(), 1),
                             divergence=kd_cfg.divergence, jsd_beta=kd_cfg.jsd_beta) if kd_cfg.kd_ratio > 0 else None
        loss = kd_objective(ce, kd, kd_cfg.kd_ratio)
        values = {"ce_loss": float(ce.detach()) if ce is not None else 0.0,
                  "kd_loss": float(kd.detach()) if kd is not None else 0.0}
        if router is not None:
            share = router / (self.num_micro_batches * self.dp_size)  # of the mean over the step's micro-batches
            loss = loss + self.router_loss.coefficient * share
            values["router_loss"] = float(share.detach())
        values["loss"] = float(loss.detach())
        # Wrappers average gradients over dp (and cp) ranks; the normalization asks for their sum.
        return loss * student_loss_scale(self.setup), values

    def _step_pairs(self, feed: Iterator) -> tuple[list[tuple[dict, dict | None]], float, float]:
        """The step's (micro-batch, teacher logits) pairs, cp-sharded; the teacher wait; the global valid tokens."""
        pairs, wait = [], 0.0
        for _ in range(self.num_micro_batches):
            pair, waited = self._next_from(feed)
            pairs.append(pair)
            wait += waited
        (num_valid,) = self._sum_over_dp([pairs[0][0]["step_valid"]])
        return [self._shard(item["micro_batch"], logits) for item, logits in pairs], wait, num_valid

    def train_step(self, feed: Iterator[tuple[dict, dict | None]]) -> dict[str, float]:
        """One optimizer step over the next `num_micro_batches` pairs of `feed`, forward and backward each."""
        records, wait, num_valid = [], 0.0, None
        for index in range(self.num_micro_batches):
            pair, waited = self._next_from(feed)
            wait += waited
            if index == 0:
                (num_valid,) = self._sum_over_dp([pair[0]["step_valid"]])
            micro_batch, teacher_logits = self._shard(pair[0]["micro_batch"], pair[1])
            router = None
            with self.router_loss.recording() if self.router_loss else contextlib.nullcontext():
                logits = self._student_logits(micro_batch)
            if self.router_loss:  # under cp, this rank's share
                cp_group = self.setup.device_mesh.get_group("cp") if self.setup.cp_size > 1 else None
                router = self.router_loss.local_loss(self.router_loss.statistics(micro_batch["attention_mask"]),
                                                     group=cp_group)
            loss, values = self.micro_batch_loss(logits, micro_batch, teacher_logits, max(num_valid, 1.0), router)
            loss.backward()
            records.append(values)
        return self._finish_step(records, wait, num_valid)

    def pipelined_train_step(self, feed: Iterator[tuple[dict, dict | None]]) -> dict[str, float]:
        """One optimizer step of a pipelined student: the schedule runs every micro-batch of the step at once.

        All the step's teacher logits come first (the last stage's; None on the others), while the
        prefetcher already asks for the next step's. Only the last stage computes losses; every stage
        logs, clips and checkpoints the values it broadcasts.
        """
        pairs, wait, num_valid = self._step_pairs(feed)
        micro_batches, teacher_logits = zip(*pairs)
        by_index: dict[int, dict[str, float]] = {}

        def loss_fn(index: int, logits: torch.Tensor, router: torch.Tensor | None = None) -> torch.Tensor:
            loss, by_index[index] = self.micro_batch_loss(logits, micro_batches[index], teacher_logits[index],
                                                          max(num_valid, 1.0), router)
            return loss

        self.pipeline.step(list(micro_batches), loss_fn)
        records = broadcast_loss_metrics_from_last_stage(
            [by_index[i] for i in range(len(pairs))] if self.pipeline.is_last else None,
            pp_group=self.setup.pp_group,
        )
        return self._finish_step(records, wait, num_valid)

    def _finish_step(self, records: list[dict[str, float]], wait: float, num_valid: float) -> dict[str, float]:
        """Clip, step the optimizer and the schedule; the step's metrics summed over dp and cp ranks."""
        stages = self.setup.pp_group if self.pipeline is not None else None
        copies = self.pipeline.tied_copies if self.pipeline is not None else ()
        scale_expert_gradients(self.model)
        grad_norm = clip_grad_norm(self.model.parameters(), self.config.optimizer.max_grad_norm,
                                   stages_group=stages, uncounted=copies)
        keys = ("loss", "ce_loss", "kd_loss") + (("router_loss",) if self.router_loss else ())
        totals = [sum(record[key] for record in records) for key in keys]
        summed = self._sum_over_dp(totals, and_cp=True)
        finite = all(math.isfinite(value) for value in (*summed, grad_norm))
        if not finite:
            # The same sums on every student rank: all skip, or all stop, before the weights take the update.
            self._nonfinite_step(summed, grad_norm)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return {**dict(zip(keys, summed)), "lr": lr, "grad_norm": grad_norm, "num_tokens": num_valid,
                "teacher_wait_s": wait, "skipped": not finite}

    def _nonfinite_step(self, summed: list[float], grad_norm: float) -> None:
        """Skip this step's update (`kd.on_nonfinite: skip_step`, at most `kd.max_skipped_steps` times), else
        raise ValueError naming the step and the values."""
        kd = self.config.kd
        step = self.scheduler.last_epoch + 1
        values = f"loss {summed[0]}, ce_loss {summed[1]}, kd_loss {summed[2]}, grad_norm {grad_norm}"
        if kd.on_nonfinite == "skip_step" and self.skipped_steps < kd.max_skipped_steps:
            self.skipped_steps += 1
            warn0(f"step {step}: the loss or its gradient is not finite ({values}); step skipped, no update "
                  f"({self.skipped_steps} of at most kd.max_skipped_steps={kd.max_skipped_steps})")
            return
        skipped = f" after {self.skipped_steps} skipped step(s), the most kd.max_skipped_steps allows" if (
            kd.on_nonfinite == "skip_step") else ""
        raise ValueError(
            f"step {step}: the loss or its gradient is not finite ({values}); training stopped before this "
            f"update{skipped}. Lower optimizer.lr, check the data, or resume from the last checkpoint"
        )

    def _sum_over_dp(self, values: list[float], *, and_cp: bool = False) -> list[float]:
        """Sum over data-parallel ranks; `and_cp` also over context-parallel ranks (per-rank token shares)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, group=self.setup.dp_mesh.get_group())
        if and_cp and self.setup.cp_size > 1:
            dist.all_reduce(tensor, group=self.setup.device_mesh.get_group("cp"))
        return tensor.tolist()

    def _student_logits(self, micro_batch: dict) -> torch.Tensor | None:
        """The student's logits for a micro-batch; under pipeline parallel forward only, None before the last stage."""
        if self.pipeline is not None:
            return self.pipeline.forward(micro_batch)
        output = self.model(input_ids=micro_batch["input_ids"], position_ids=micro_batch["position_ids"],
                            attention_mask=micro_batch["attention_mask"])
        return output.logits

    # ---- evaluation, checkpoints, export ----

    @torch.no_grad()
    def evaluate(self, *, with_teacher: bool = False) -> dict[str, float]:
        """Validation CE (and perplexity) of the student, and of the teacher when asked."""
        steps = self.config.step_scheduler
        ignore = self.config.kd.ignore_index
        sums = [0.0, 0.0, 0.0]  # student CE sum, teacher CE sum, token count
        self.model.eval()
        for index, batch in enumerate(
            data.eval_batches(self.val_set, batch_size=steps.local_batch_size, dp_rank=self.dp_rank,
                              dp_size=self.dp_size)
        ):
            if steps.val_batches is not None and index >= steps.val_batches:
                break
            micro_batch = {key: value.to(self.device) for key, value in batch.items()}
            teacher_answer = None
            if with_teacher:
                with self.faults.watch("the teacher request", "teacher"):
                    teacher_answer = self.teacher.request(micro_batch, LABEL_LOG_PROBS)
            micro_batch, teacher_answer = self._shard(micro_batch, teacher_answer)
            labels = micro_batch["labels"]
            logits = self._student_logits(micro_batch)
            if logits is None:  # a pipeline stage before the last: the last stage's sums arrive below
                continue
            sums[0] += float(cross_entropy_loss(logits, labels, ignore_index=ignore, num_valid_tokens=1))
            if with_teacher:  # 0 at ignored labels
                sums[1] -= float(teacher_answer["log_probs"].sum())
            sums[2] += float((labels != ignore).sum())
        self.model.train()
        if self.pipeline is not None:
            last = {"sums": torch.tensor(sums, dtype=torch.float64)} if self.pipeline.is_last else None
            sums = broadcast_tensors_from_last_stage(last, pp_group=self.setup.pp_group)["sums"].tolist()
        student_sum, teacher_sum, count = self._sum_over_dp(sums, and_cp=True)
        count = max(count, 1.0)
        result = {"val_loss": student_sum / count, "val_perplexity": math.exp(min(student_sum / count, 50.0))}
        if with_teacher:
            result["teacher_val_loss"] = teacher_sum / count
        return result

    @torch.no_grad()
    def evaluate_samples(self) -> dict[str, float]:
        """The teacher's loss per token of the student's greedy completions of the validation prompts.

        How far the student's own text is from what the teacher would write: the quantity on-policy
        distillation lowers, measured the same way for any mode."""
        steps = self.config.step_scheduler
        completer, sums = self._completions(greedy=True), [0.0, 0.0, 0.0]  # teacher NLL, tokens, completions
        source = self.val_set if self.val_prompts is None else self.val_prompts
        for index, batch in enumerate(data.eval_batches(source, batch_size=steps.local_batch_size,
                                                        dp_rank=self.dp_rank, dp_size=self.dp_size)):
            if steps.val_batches is not None and index >= steps.val_batches:
                break
            rows, tokens, completed = completer.rows(batch, [0] * batch["input_ids"].shape[0])
            with self.faults.watch("the teacher request", "teacher"):
                answer = self.teacher.request(rows, LABEL_LOG_PROBS)
            sums = [sums[0] - float(answer["log_probs"].sum()), sums[1] + tokens, sums[2] + completed]
        nll, tokens, completions = self._sum_over_dp(sums)
        return {"teacher_nll_of_samples": nll / max(tokens, 1.0),
                "sample_length": tokens / max(completions, 1.0)}

    def save(self, step: int) -> None:
        with self.faults.watch(f"saving the checkpoint of step {step}", "student"):
            ckpt.save_checkpoint(self.checkpoint_root, step, model=self.model, optimizer=self.optimizer,
                                 scheduler=self.scheduler, group=self.student_group)

    def export_hf(self) -> Path:
        """The trained student as an HF directory (safetensors, config, tokenizer) under RUN_DIR/hf_student."""
        return ckpt.export_hf(self.run_dir / "hf_student", model=self.model, pipeline=self.pipeline,
                              tokenizer=self.tokenizer, group=self.student_group,
                              dtype=resolve_dtype(self.config.model.dtype))

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

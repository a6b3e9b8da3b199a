"""The student's role in a run: load, lay out, train against a teacher source, evaluate, save, export.

Set-up, one component each: the models and data (`load`), the layout, the optimizer and the teacher
source (`lay_out`), the step and the evaluations (`_setup_step`), the checkpoint and metrics (`resume`).
Then the loop (`_train`): `meshkd.recipe.student.step_data.StepData` pairs this data-parallel rank's micro-batches
with the teacher source's answers (`meshkd.core.teacher_protocol`; from `kd.teacher_cache` a
`meshkd.recipe.teacher.teacher_cache.CachedTeacher`), fetched ahead with `kd.overlap_teacher` so the teacher's
forward, or the cache's read, overlaps the student's step; `meshkd.recipe.student.train_step.TrainStep` trains on a
step's pairs. With `kd.mode: on_policy` each step's micro-batches are first completed by the student itself
(`meshkd.recipe.student.on_policy.OnPolicyStep`), or with `kd.generation.engine` by a vLLM server holding its weights
(`meshkd.recipe.student.rollout_engine`). Evaluations: `meshkd.recipe.student.evaluation`. Several teachers
(`teachers`) are one source, `meshkd.core.teacher_ensemble.TeacherEnsemble`, over each teacher's own.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from meshkd.core.answers.hidden import hold_head
from meshkd.core.bridge import KDMeshBridge
from meshkd.core.combinations import combination_named
from meshkd.core.packing import configure_packing
from meshkd.core.teacher_ensemble import TeacherEnsemble
from meshkd.core.teacher_protocol import TeacherFeed, TeacherSource
from meshkd.core.token_bytes import token_byte_lengths
from meshkd.core.topology import TeacherSetups
from meshkd.parallel.mixed_precision import rounded_update_warning
from meshkd.recipe.common.faults import FaultWatch, PeerLostError, StopRequest, about
from meshkd.recipe.common.metrics import MetricsSink, is_logging_rank, print0, progress_bar, warn0
from meshkd.recipe.corpus.aligned_data import completion_aligner
from meshkd.recipe.lifecycle.preflight import Preflight
from meshkd.recipe.lifecycle.run_report import RunFigures, run_report
from meshkd.recipe.modeling import checkpoint as ckpt
from meshkd.recipe.settings.config import KDRecipeConfig
from meshkd.recipe.student.evaluation import Evaluation, TeachersEvaluation, before_and_after
from meshkd.recipe.student.fused_head import FusedHead
from meshkd.recipe.student.on_policy import OnPolicyStep, StudentCompletions, sampling_settings
from meshkd.recipe.student.rollout_engine import Rollouts, ServerSampler, VLLMServer, WeightSync
from meshkd.recipe.student.step_data import StepData, run_datasets
from meshkd.recipe.student.student_model import export_student, lay_out_student, load_student, student_hidden_states
from meshkd.recipe.student.train_step import (
    Objective,
    Optimization,
    StepRanks,
    StudentParts,
    TrainStep,
    build_optimizer,
)
from meshkd.recipe.teacher.sources import SourceContext
from meshkd.recipe.teacher.teacher_answers import selected_kind
from meshkd.recipe.teacher.teacher_head import vocabulary_slice
from meshkd.recipe.teacher.teacher_worker import load_teacher, teacher_vocabulary_map


class StudentTrainer:
    """A student rank (on shared meshes also the teacher): the recipe calls load, lay_out, resume, run, close."""

    def __init__(self, config: KDRecipeConfig, setups: TeacherSetups, faults: FaultWatch,
                 device: torch.device, stop: StopRequest) -> None:
        self.config, self.setups, self.setup, self.faults, self.device = config, setups, setups.student, faults, device
        self._stop = stop
        self.run_dir = Path(config.logging.run_dir)
        self.checkpoint_root = Path(config.checkpoint.dir or self.run_dir / "checkpoints")
        self.dp_size, self.dp_rank = self.setup.dp_size, self.setup.dp_mesh.get_local_rank()
        steps = config.step_scheduler
        self.num_micro_batches = steps.global_batch_size // (steps.local_batch_size * self.dp_size)
        self.summary, self.start_step = {}, 0
        self.skipped_steps = 0  # non-finite steps skipped since this process started (kd.on_nonfinite)
        self.metrics: MetricsSink | None = None
        # For the end-of-run report: counted from here, in this process.
        self._started = time.perf_counter()
        self._trained = {"tokens": 0.0, "step_time_s": 0.0}
        self._last_step, self._stopped_on = 0, None  # the last step trained; why the run stopped early

    # ---- setup, phase by phase ----

    def load(self, checked: dict[str, Preflight]) -> None:
        """This rank's models and data (and the teachers on the student's ranks); `checked`: each teacher's
        preflight, by name."""
        config = self.config
        self.teacher_configs = {teacher.name: teacher for teacher in config.teacher_list()}
        self._checked = checked
        checked = checked[next(iter(self.teacher_configs))]  # what the teachers share: the student's tokenizer
        self.tokenizer, self.teacher_tokenizer = checked.tokenizer, checked.teacher_tokenizer
        self._teacher_width = checked.teacher_width
        self._model, self._checkpoint = load_student(config, self.setup)
        self._teachers = {name: load_teacher(teacher) for name, teacher in self.teacher_configs.items()
                          if self._checked[name].source.loads_here}
        # Read by the teacher's projection when it answers here (shared meshes), by GOLD's loss on every student.
        self._vocabulary_map = teacher_vocabulary_map(
            config, checked, losses=("projection", "gold") if self._teachers else ("gold",))
        self._completion_aligner = completion_aligner(config, self.tokenizer, self.teacher_tokenizer)
        with about("dataset"):
            self.train_set, self.val_set, self.train_prompts, self.val_prompts = run_datasets(
                config, self.tokenizer, self.teacher_tokenizer)
        configure_packing(self._model)

    def vocab_rows(self) -> dict[str, int]:
        """Output-embedding rows of the student and of each teacher (as its preflight found them), by name."""
        rows = {name: check.teacher_vocab_rows for name, check in self._checked.items()}
        return {"student": self._model.get_output_embeddings().weight.shape[0], **rows}

    def lay_out(self, vocab_size: int, bridges: dict[str, KDMeshBridge]) -> None:
        """Lay out the models (teachers first, as their ranks do), then the optimizer, the step and evaluations;
        `bridges`: to each teacher on ranks of its own, by name."""
        self.vocab_size, self.bridges = vocab_size, bridges
        datasets = {"train": self.train_set, "validation": self.val_set}
        self.teacher_sources = {  # meshkd.recipe.teacher.sources, by each teacher's kind
            name: self._checked[name].source.make(self.config, teacher, self._checked[name].teacher, SourceContext(
                self.setup, self.device, datasets, vocab_size, self._vocabulary_map, bridge=bridges.get(name),
                loaded=self._teachers.pop(name, None)))
            for name, teacher in self.teacher_configs.items()}
        self._hold_teacher_heads(datasets)
        # One teacher is the list of one: its own source; several are asked as one.
        self.teacher = TeacherEnsemble.of(
            self.teacher_sources, roles={name: self.setups.role(name) for name in self.teacher_sources},
            watch=self.faults.watch, route=combination_named(self.config.kd.combine).routes_rows,
            transports={name: self.config.kd_of(teacher).logits_transport
                        for name, teacher in self.teacher_configs.items()})
        self.model, self.pipeline, self.router_loss = lay_out_student(
            self._model, self._checkpoint, self.config, self.setup, device=self.device,
            num_micro_batches=self.num_micro_batches)
        del self._model, self._checkpoint
        self.hidden_states = student_hidden_states(self.model, self.config, teacher_width=self._teacher_width,
                                                   device=self.device)
        # The hidden-state projections' weights (widths that differ): trained with the student, checkpointed beside it.
        learned = self.hidden_states.parameters() if self.hidden_states else []
        self.checkpointed = self.model if not learned else torch.nn.ModuleDict(
            {"student": self.model, "hidden_state_projections": self.hidden_states.projections})
        self.optimizer, self.scheduler = build_optimizer(self.model, self.config, learned)
        self._setup_step()
        if self.config.model.pure_half_precision:
            warning = rounded_update_warning(self.model.parameters(), self.config.optimizer.lr,
                                             dtype=self.config.model.dtype, group=self.student_group)
            if warning:
                warn0(warning)

    def _hold_teacher_heads(self, datasets: dict) -> None:
        """The output layer of each teacher that answers with its hidden states, kept for its answers
        (`meshkd.core.answers.hidden.HEADS`): under tensor parallel the student's vocabulary slice only, where the
        run never combines the teachers' whole logits."""
        config = self.config
        combination = combination_named(config.kd.combine)
        rows = self.vocab_rows()["student"]
        held = None
        if self.setup.tp_size > 1 and rows == self.vocab_size and not (
                len(self.teacher_configs) > 1 and (combination.whole_distributions or combination.routes_rows)):
            held = vocabulary_slice(self.vocab_size, self.setup.device_mesh["tp"])
        context = SourceContext(self.setup, self.device, datasets, self.vocab_size, self._vocabulary_map)
        for name, teacher in self.teacher_configs.items():
            if selected_kind(config.kd_of(teacher)).reads_hidden:
                hold_head(self._checked[name].source.head(config, teacher, context, held))

    def _setup_step(self) -> None:
        """The training step (on-policy: wrapped in the completions' step) and the evaluations."""
        config = self.config
        fused_head = FusedHead.of(self.model, config, self.setup, self.pipeline, self.vocab_size)
        student = StudentParts(self.model, self.pipeline, fused_head=fused_head, router_loss=self.router_loss,
                               hidden_states=self.hidden_states)
        objective = Objective(config.kd, self.vocab_size, vocabulary_map=self._vocabulary_map,
                              teacher_weights=config.teacher_weights())
        optimization = Optimization(self.optimizer, self.scheduler, self.num_micro_batches,
                                    max_grad_norm=config.optimizer.max_grad_norm)
        self.step = TrainStep(student, objective, optimization, StepRanks(self.setup, self.device, self.student_group),
                              watch=self.faults.watch, stop_requested=self._stop.requested)
        self.rollouts = self._rollouts()
        self.on_policy_step = OnPolicyStep(config, train_step=self.step, teacher=self.teacher,
                                           completions=self._completions,
                                           rollouts=self.rollouts) if config.kd.mode == "on_policy" else None
        # The same for every teacher: each vocabulary entry's bytes, counted once.
        byte_lengths = token_byte_lengths(self.tokenizer, size=self.vocab_size)
        teacher_byte_lengths = token_byte_lengths(self.teacher_tokenizer) if config.kd.cross_tokenizer else None

        def evaluation(name: str, teacher: TeacherSource) -> Evaluation:
            return Evaluation(config, self.setup, kd=config.kd_of(self.teacher_configs[name]), model=self.model,
                              pipeline=self.pipeline, teacher=teacher,
                              val_set=self.val_set, val_prompts=self.val_prompts,
                              completions=lambda: self._completions(greedy=True), watch=self.faults.watch,
                              group=self.student_group, device=self.device,
                              byte_lengths=byte_lengths, teacher_byte_lengths=teacher_byte_lengths,
                              vocab_size=self.vocab_size, teacher_role=self.setups.role(name),
                              validation_answer=self._checked[name].source.validation_answer(teacher),
                              fused_head=fused_head)

        self.evaluation = TeachersEvaluation.of(
            {name: evaluation(name, source) for name, source in self.teacher_sources.items()},
            weights=config.teacher_weights())

    def resume(self, resume: bool) -> None:
        """With `resume`, continue from the newest intact checkpoint; open the metrics and the run directory.

        Partial checkpoint directories, left by saves that did not finish, are removed first.
        """
        if is_logging_rank():
            for stale in ckpt.remove_partials(self.checkpoint_root):
                print0(f"meshkd: removed {stale}, left by a checkpoint save that did not finish")
        if resume:
            latest, self.start_step = ckpt.resume_latest(self.checkpoint_root, model=self.checkpointed,
                                                         optimizer=self.optimizer, scheduler=self.scheduler,
                                                         group=self.student_group)
            print0(f"resumed from {latest} at step {self.start_step}" if latest is not None
                   else f"no checkpoint under {self.checkpoint_root}: starting at step 0")
        self.metrics = MetricsSink(self.run_dir, tensorboard=self.config.logging.tensorboard,
                                   resume_step=self.start_step if resume else None)
        if is_logging_rank():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.config.to_dict(), sort_keys=False))

    def _completions(self, *, greedy: bool = False) -> StudentCompletions:
        """The student's completions with its current weights (DDP's inner model: no gradient sync needed)."""
        return StudentCompletions(getattr(self.model, "module", self.model), self.config, self.tokenizer,
                                  pad_token_id=self.train_set.pad_token_id, device=self.device, greedy=greedy,
                                  teacher_side=self._completion_aligner)

    def _rollouts(self) -> Rollouts | None:
        """With `kd.generation.engine`: the vLLM server that draws the training completions, its weights the
        student's (written to `weights_dir`, default RUN_DIR/rollout_weights)."""
        engine = self.config.kd.generation.engine
        if engine is None:
            return None
        server = VLLMServer(engine.url, model=engine.served_model, timeout_s=engine.timeout_s)
        sampler = ServerSampler(server, sampling_settings(self.config, self.tokenizer),
                                max_concurrent_requests=engine.max_concurrent_requests)
        weights_dir = Path(engine.weights_dir) if engine.weights_dir else self.run_dir / "rollout_weights"
        sync = WeightSync(self.model, self.config, server, weights_dir=weights_dir, group=self.student_group)
        return Rollouts(sampler, sync, sync_every=engine.sync_every, ahead=engine.max_staleness > 0,
                        group=self.student_group)

    @property
    def student_group(self) -> dist.ProcessGroup | None:
        """The student ranks' group where teachers have ranks of their own; None (the world) where none has."""
        return next(iter(self.bridges.values())).student_group if self.bridges else None

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
        if self.config.logging.summary and is_logging_rank():  # it lists the run directory: once
            print0(run_report(self.summary, self._figures()))
        return self.summary

    def _figures(self) -> RunFigures:
        checkpoint = ckpt.latest_checkpoint(self.checkpoint_root) if self.config.checkpoint.enabled else None
        return RunFigures(start_step=self.start_step, last_step=self._last_step,
                          max_steps=self.config.step_scheduler.max_steps, tokens=self._trained["tokens"],
                          step_time_s=self._trained["step_time_s"], wall_s=time.perf_counter() - self._started,
                          run_dir=self.run_dir, checkpoint=checkpoint, stopped=self._stopped_on)

    def _release_teacher_after_failure(self) -> None:
        """Tell the teacher to stop, briefly and only if it can help; this rank's error is the one to report.

        Only the first student rank's command reaches the teacher. Peers of a rank that failed on its own
        (out of memory, say) may be inside another collective and never take part, so the attempt is
        bounded: past it the rank simply exits, and its peers then fail fast on the lost connection. A
        prefetch thread that could not be stopped still holds the bridge: then nothing is sent.
        """
        claimed = any(bridge.claimed for bridge in self.bridges.values())
        if not self.bridges or claimed or dist.get_rank() != self.setup.ranks[0]:
            return
        with contextlib.suppress(RuntimeError):  # timed out or a peer gone: nothing more to do here
            self.teacher.close(timeout=datetime.timedelta(seconds=TeacherFeed.FAILURE_WAIT_S))

    def _stop_agreed(self) -> bool:
        """Whether any student rank was asked to stop, so that all stop at the same step."""
        return self._stop.agreed(self.student_group, device=self.device)

    def _train(self) -> None:
        config, steps = self.config, self.config.step_scheduler
        self._last_step = self.start_step
        with self.faults.watch("the first evaluation", "student"):
            if self._stop_agreed():  # asked to stop during setup: not even the evaluation
                self._stopped(self.start_step, self.start_step)
                return
            before, computed = self.evaluation.first(self.run_dir, start_step=self.start_step,
                                                     with_samples=self.config.kd.evaluates_samples)
            if computed:
                self.metrics.log("eval", self.start_step, before)
        self.summary.update(val_loss_before=before["val_loss"], teacher_val_loss=before["teacher_val_loss"])
        self.summary.update(before_and_after(before, "_before"))
        data = StepData(config, dp_rank=self.dp_rank, dp_size=self.dp_size, start_step=self.start_step,
                        device=self.device, train_set=self.train_set, train_prompts=self.train_prompts,
                        teacher=self.teacher, train_step=self.step, on_policy_step=self.on_policy_step)
        with data.feed:
            step, saved = self._train_steps(data)
            # A prefetched request in flight completes (its answer is dropped); the bridge is free again.
            with self.faults.watch("the last teacher request", "teacher"):
                data.feed.close()
        if step < steps.max_steps:
            self._stopped(step, saved)
            return
        with self.faults.watch("the last evaluation", "student"):
            # The teacher too: the KL and top-1 agreement after training (its own figures come back unchanged).
            after = self.evaluation.full(with_teacher=True, with_samples=self.config.kd.evaluates_samples)
        self.metrics.log("eval", step, after)
        self.summary["val_loss_after"] = after["val_loss"]
        self.summary.update(before_and_after(after, "_after"))
        if self.skipped_steps:
            self.summary["skipped_steps"] = self.skipped_steps
        if config.checkpoint.enabled and config.checkpoint.save_hf:
            with self.faults.watch("the HF export", "student"):
                self.summary["hf_dir"] = str(self.export_hf().resolve())
        if is_logging_rank():
            (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))

    def _train_steps(self, data: StepData) -> tuple[int, int]:
        """Train until max_steps or an agreed stop; returns (the last step trained, the last step saved).

        A stop is agreed once before the first step (a request during the first evaluation), then in each
        step's own reduction of its figures (`TrainStep.stop_agreed`): no collective of its own per step, and
        a request that comes after that reduction stops the run after the next step."""
        config, steps = self.config, self.config.step_scheduler
        progress = progress_bar(steps.max_steps, initial=self.start_step, desc="distill",
                                enabled=config.logging.progress_bar)
        step = saved = self.start_step
        self.model.train()
        with self.faults.watch(f"step {step + 1}", "student"):
            stop = self._stop_agreed()
        while step < steps.max_steps and not stop:
            with self.faults.watch(f"step {step + 1}", "student"):
                started = time.perf_counter()
                metrics = data.train_next(self.skipped_steps)
                stop = self.step.stop_agreed
            step += 1
            self.skipped_steps += metrics["skipped"]
            elapsed = time.perf_counter() - started
            self._last_step = step
            self._trained["tokens"] += metrics["num_tokens"]
            self._trained["step_time_s"] += elapsed
            metrics["tokens_per_s"] = metrics["num_tokens"] / elapsed
            metrics["step_time_s"] = elapsed
            self.metrics.log("train", step, metrics)
            progress.set_postfix(loss=f"{metrics['loss']:.3f}", ce=f"{metrics['ce_loss']:.3f}",
                                 kd=f"{metrics['kd_loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
            progress.update(1)
            if steps.val_every_steps and step % steps.val_every_steps == 0 and step < steps.max_steps:
                with self.faults.watch(f"the evaluation after step {step}", "student"):
                    self.metrics.log("eval", step, self.evaluation.held_out())
            if config.checkpoint.enabled and steps.ckpt_every_steps and step % steps.ckpt_every_steps == 0:
                self.save(step)
                saved = step
        progress.close()
        return step, saved

    def _stopped(self, step: int, saved: int) -> None:
        """After an agreed stop at `step`: checkpoint it (unless it is on disk or nothing was trained)."""
        self.summary["stopped_at_step"] = step
        self._last_step, self._stopped_on = step, self._stop.reason()
        note = "checkpointing is off: nothing saved"
        if self.config.checkpoint.enabled:
            if step != saved:
                self.save(step)
            where = ckpt.checkpoint_dir(self.checkpoint_root, step)
            note = f"resume from {where} with --resume" if step else "nothing trained yet"
        print0(f"meshkd: stopped at step {step} on {self._stop.reason()}; {note}")

    # ---- checkpoints, export ----

    def save(self, step: int) -> None:
        with self.faults.watch(f"saving the checkpoint of step {step}", "student"):
            ckpt.save_checkpoint(self.checkpoint_root, step, model=self.checkpointed, optimizer=self.optimizer,
                                 scheduler=self.scheduler, group=self.student_group)

    def export_hf(self) -> Path:
        """The trained student as an HF directory under RUN_DIR/hf_student (`export_student`)."""
        exported, adapters = export_student(self.model, self.pipeline, self.config, self.run_dir,
                                            tokenizer=self.tokenizer, group=self.student_group)
        if adapters is not None:
            self.summary["hf_adapter_dir"] = str(adapters.resolve())
        return exported

    def close(self) -> None:
        if getattr(self, "rollouts", None) is not None:
            self.rollouts.close()
        if self.metrics is not None:
            self.metrics.close()

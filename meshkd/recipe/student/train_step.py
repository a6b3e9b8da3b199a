"""One optimizer step of the student, from the step's micro-batches and their teacher answers.

`TrainStep` holds what a step works with (the model, optimizer and lr schedule, the layout, the
objective's settings) and no state of the run: calling it takes the step's `num_micro_batches` pairs
(item, teacher answer) from a feed, lazily, so that the teacher may still be answering the next while one
trains, and returns the step's metrics. The data path of a micro-batch:

    shard (this cp rank's head-tail share of the batch and of the answer)
      -> the student's logits, or with the fused output layer its last hidden states (the model, or
         `StudentPipeline`, whose schedule runs a whole step at once)
      -> micro_batch_loss (`FusedHead.loss`, else the objective of whole logits) -> backward (gradient sync on
         the step's last micro-batch only)
    then, once per step: clip -> one reduction of the step's figures -> the non-finite rule -> optimizer and
    lr step -> metrics

What a step works with comes as four objects: the student's parts (`StudentParts`: the model, its pipeline, the
fused output layer, the router and hidden-state terms), the objective (`Objective`), the optimization
(`Optimization`: optimizer, schedule, micro-batches, clipping) and the ranks (`StepRanks`).

An item is `{"micro_batch": ..., "step_valid": ...}`: the micro-batch on the device and the local number of
valid tokens of its whole step (all its micro-batches on this rank, a tensor on the device), known before its
first backward; and where the data has them, its rows on the host (`"host_batch"`), from which a
cross-tokenizer micro-batch whose groups the loss merges gets its `GroupLayout` (`with_group_layout`; without
them, as on-policy rows, it is copied to the host once).

Loss normalization: each micro-batch loss is a sum over its valid tokens divided by the global number of
valid tokens of the optimizer step (all micro-batches, all data-parallel ranks). Data-parallel wrappers
average gradients over dp ranks, so the loss is multiplied by dp before backward to turn that average
into the sum the normalization asks for. The curve then equals a single-process run on the same global
batch.

Host syncs. Everything the step computes stays on the device until its end: the global valid-token count
(summed over the dp ranks before the first backward, and divided by as a tensor), the loss values, the
gradient norm (`clip_grad_norm` clips on the device too), the top-k index checks of the teacher's answers
(`LossContext.index_checks`), the chunks of a cross-tokenizer teacher's groups (cut by their `GroupLayout`, read on
the host). One all-reduce over the student ranks then sums the loss values with the stop
requests (`stop_requested`: SIGINT, SIGTERM, the stop file) and the index errors, and one `.tolist()` reads
it all back, which the non-finite rule, the optimizer step and the metrics need: with the teacher on its own
ranks the step's only host sync on the training thread (counted by `tests/gpu/test_train_nccl.py`'s
`CountedStep`; a pipelined step also sends its loss values from the last stage through the host). The
micro-batches reach a GPU from pinned memory, copied without waiting.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshkd.core.answers.topk import TopK
from meshkd.core.cross_tokenizer_loss import VocabularyMap
from meshkd.core.loss import cross_entropy_loss, kd_objective
from meshkd.core.stage_broadcast import broadcast_loss_metrics_from_last_stage
from meshkd.core.topology import DistributedSetup
from meshkd.parallel.context_parallel import shard_student_batch
from meshkd.parallel.data_parallel import clip_grad_norm, gradient_sync, scale_expert_gradients, student_loss_scale
from meshkd.parallel.stages import HeadTransformError
from meshkd.parallel.student_pipeline import StudentPipeline
from meshkd.recipe.common.metrics import warn0
from meshkd.recipe.corpus.batches import to_device
from meshkd.recipe.corpus.rows import with_group_layout
from meshkd.recipe.modeling.adapters import trainable_parameters
from meshkd.recipe.settings.config import ConfigError, KDConfig
from meshkd.recipe.student.fused_head import FusedHead
from meshkd.recipe.student.router_loss import RouterLoss
from meshkd.recipe.teacher.group_answers import merges_groups
from meshkd.recipe.teacher.hidden_states import StudentHiddenStates
from meshkd.recipe.teacher.teacher_answers import LossContext, TeacherAnswer, answer_of

Pair = tuple[dict, "dict | None"]  # (item, the teacher's answer as the feed gives it: on the wire)


def sum_over_ranks(values: list[float] | torch.Tensor, setup: DistributedSetup, *, device: torch.device,
                   and_cp: bool = False) -> list[float]:
    """Sum over data-parallel ranks; `and_cp` also over context-parallel ranks (per-rank token shares)."""
    tensor = torch.as_tensor(values, dtype=torch.float64).to(device)
    dist.all_reduce(tensor, group=setup.dp_mesh.get_group())
    if and_cp and setup.cp_size > 1:
        dist.all_reduce(tensor, group=setup.device_mesh.get_group("cp"))
    return tensor.tolist()


def build_optimizer(model: torch.nn.Module, config, extra: list[torch.nn.Parameter] = ()) -> tuple[
        torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The `optimizer` section's optimizer over the laid-out model's parameters (and `extra` ones trained with
    them: `kd.hidden_states`' projections), and the `lr_scheduler`'s schedule.

    AdamW on CUDA is torch's fused kernel: a few launches for each group of parameters, its step counts kept on
    the device. On the CPU it stays the per-tensor loop: torch's foreach ops run tensor by tensor there anyway.
    The parameters are grouped as `parameter_groups` says on every device, so a checkpoint's groups do not
    depend on where it was written."""
    opt = config.optimizer
    parameters = trainable_parameters(model) + list(extra)  # a LoRA student's: its adapters
    groups = parameter_groups(parameters)
    if opt.name == "adamw":
        on_cuda = bool(parameters) and all(parameter.device.type == "cuda" for parameter in parameters)
        optimizer = torch.optim.AdamW(groups, lr=opt.lr, weight_decay=opt.weight_decay,
                                      betas=tuple(opt.betas), eps=opt.eps, foreach=False, fused=on_cuda)
    else:
        optimizer = torch.optim.SGD(groups, lr=opt.lr, weight_decay=opt.weight_decay)
    factor = lr_factor(config.lr_scheduler, config.step_scheduler.max_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def parameter_groups(parameters: list[torch.nn.Parameter]) -> list[dict]:
    """The parameters in groups a multi-tensor (fused) optimizer kernel can step at once: one for each device
    mesh their DTensors lie on, one for plain tensors (`kd.hidden_states`' projections, a parameter no layout
    shards), in the order each kind first appears. torch's multi-tensor AdamW refuses a group that mixes
    DTensors and plain tensors ("mixed torch.Tensor and DTensor"); each mesh's DTensors (a student's experts
    over dp beside its FSDP2 shards) get a group of their own too, so no kernel call spans two meshes."""
    groups: dict = {}
    for parameter in parameters:
        mesh = parameter.device_mesh if isinstance(parameter, DTensor) else None
        groups.setdefault(mesh, []).append(parameter)
    return [{"params": members} for members in groups.values()]


def lr_factor(schedule, max_steps: int) -> Callable[[int], float]:
    """step -> the `lr_scheduler` section's learning-rate factor: linear warmup, then constant, linear or cosine
    decay to `min_lr_ratio` at `total_steps` (None: `max_steps`)."""
    total = schedule.total_steps or max_steps

    def factor(step: int) -> float:
        if step < schedule.warmup_steps:
            return (step + 1) / schedule.warmup_steps
        if schedule.decay == "constant":
            return 1.0
        progress = min(1.0, (step - schedule.warmup_steps) / max(1, total - schedule.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule.decay == "cosine" else 1 - progress
        return schedule.min_lr_ratio + (1 - schedule.min_lr_ratio) * shape
    return factor


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """`model.activation_checkpointing`: each decoder layer recomputes its activations in backward.

    The model's own (transformers' per-layer checkpointing), non-reentrant so that it composes with FSDP2,
    tensor parallel and pipeline stages; set before any layout, on the module tree every layout keeps."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"model.activation_checkpointing: {type(model).__name__} has no activation "
                          f"checkpointing of its own in transformers; set the key to false")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def micro_batches(batch: dict, *, size: int, device: torch.device) -> list[dict]:
    """A rank's batch cut into micro-batches of `size` rows, on `device` (a GPU's copied from pinned host
    memory, the host not waiting: `to_device`)."""
    batch = {key: to_device(value, device) for key, value in batch.items()}
    return [{key: value[i : i + size] for key, value in batch.items()}
            for i in range(0, batch["input_ids"].shape[0], size)]


def step_items(step_micro_batches: list[dict], *, ignore_index: int) -> Iterator[dict]:
    """The items of one step (see the module docstring): each micro-batch with the step's valid-token count."""
    valid = valid_tokens(step_micro_batches, ignore_index=ignore_index)
    return ({"micro_batch": micro_batch, "step_valid": valid} for micro_batch in step_micro_batches)


def valid_tokens(micro_batches: list[dict], *, ignore_index: int) -> torch.Tensor:
    """The number of labels that count in the loss, over `micro_batches`: a 0-dim int64 tensor on their device."""
    return torch.stack([(micro_batch["labels"] != ignore_index).sum() for micro_batch in micro_batches]).sum()


def shard_micro_batch(micro_batch: dict, setup: DistributedSetup, *, ignore_index: int) -> dict:
    """This cp rank's head-tail share of a micro-batch (itself without cp); its teacher answer's share:
    `TeacherAnswer.shard`."""
    if setup.cp_size == 1:
        return micro_batch
    return shard_student_batch(micro_batch, setup, ignore_index=ignore_index)[0]


def student_logits(model: torch.nn.Module, pipeline: StudentPipeline | None, micro_batch: dict) -> torch.Tensor | None:
    """The student's logits [batch, sequence, vocab] of a micro-batch (training and evaluation); a pipelined
    student's forward only, None before the last stage."""
    if pipeline is not None:
        return pipeline.forward(micro_batch)
    return model(input_ids=micro_batch["input_ids"], position_ids=micro_batch["position_ids"],
                 attention_mask=micro_batch["attention_mask"], use_cache=False).logits  # no KV cache to build


@dataclass
class StudentParts:
    """What of the student a step runs: the laid-out model (a pipelined student's stage model), its pipeline (or
    None), its output layer fused with the loss (`FusedHead.of`, or None: whole logits), an MoE student's router
    loss and `kd.hidden_states`' student side (`StudentHiddenStates`; its term is logged as `hidden_state_loss`)."""

    model: torch.nn.Module
    pipeline: StudentPipeline | None = None
    fused_head: FusedHead | None = None
    router_loss: RouterLoss | None = None
    hidden_states: StudentHiddenStates | None = None


@dataclass
class Objective:
    """The objective's settings (`kd`: kd_ratio, temperature, divergence, the non-finite rule, ...), the vocabulary
    the teacher's answers cover (the student's logits are cut to it for KD), `kd.cross_tokenizer.loss: gold`'s
    exact pairs of the two vocabularies, and several teachers' normalized weights by name (their answers combine
    by `kd.combine`; each one's divergence and wait are logged as `kd_loss/NAME` and `teacher_wait_s/NAME`)."""

    kd: KDConfig
    vocab_size: int
    vocabulary_map: VocabularyMap | None = None
    teacher_weights: dict[str, float] | None = None


@dataclass
class Optimization:
    """The optimizer and its lr schedule (stepped once a step), the micro-batches a step takes on this rank, and
    the clip threshold (None: no clipping; the norm is still measured)."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    num_micro_batches: int
    max_grad_norm: float | None = None


@dataclass
class StepRanks:
    """The student's layout, this rank's device, and every student rank (None: the world), over which the step's
    figures are reduced."""

    setup: DistributedSetup
    device: torch.device
    group: dist.ProcessGroup | None = None


class TrainStep:
    """One optimizer step: `step(feed, skipped_steps=...)` -> the step's metrics (see the module docstring).

    Args:
        student, objective, optimization, ranks: what the step works with (the module docstring).
        watch: `FaultWatch.watch`, around each wait for the teacher's answer.
        stop_requested: whether this rank was asked to stop; agreed over the ranks' group in each step's reduction,
            and `stop_agreed` tells the caller after the step (None: never asked).
    """

    def __init__(self, student: StudentParts, objective: Objective, optimization: Optimization, ranks: StepRanks, *,
                 watch: Callable[[str, str], Any], stop_requested: Callable[[], bool] | None = None) -> None:
        self.model, self.pipeline, self.fused_head = student.model, student.pipeline, student.fused_head
        self.router_loss, self.hidden_states = student.router_loss, student.hidden_states
        self.kd, self.vocab_size = objective.kd, objective.vocab_size
        self.optimizer, self.scheduler = optimization.optimizer, optimization.scheduler
        self.num_micro_batches, self.max_grad_norm = optimization.num_micro_batches, optimization.max_grad_norm
        self.setup, self.device, self.group = ranks.setup, ranks.device, ranks.group
        self.watch, self.stop_requested = watch, stop_requested or (lambda: False)
        self.stop_agreed = False  # whether any student rank was asked to stop, as of the last step's reduction
        setup = self.setup
        self.answer_context = LossContext(self.kd, vocabulary_map=objective.vocabulary_map,
                                          teacher_weights=objective.teacher_weights, cp_size=setup.cp_size,
                                          index_checks=[])
        self._cp_group = setup.device_mesh.get_group("cp") if setup.cp_size > 1 else None
        self._dp_group = setup.dp_mesh.get_group()
        # The loss values are the same on every tp rank and, once the last stage has sent them, every stage:
        # one rank of each dp x cp share adds them to the step's reduction over all student ranks.
        mesh = setup.device_mesh
        self._adds_loss_values = all(mesh.get_local_rank(axis) == 0 for axis, size in
                                     (("tp", setup.tp_size), ("pp", setup.pp_size)) if size > 1)

    def __call__(self, feed: Iterator[Pair], *, skipped_steps: int) -> dict[str, float]:
        """Train on the next `num_micro_batches` pairs of `feed`; `skipped_steps`: non-finite steps skipped
        so far (`kd.max_skipped_steps` bounds them). The metrics' "skipped" says whether this one was."""
        pairs = _StepPairs(feed, self)
        self.answer_context.index_checks.clear()
        if self.pipeline is None:
            records = self._plain(pairs)
        else:
            records = self._pipelined(list(pairs), norm=pairs.norm)
        metrics = self._finish(records, pairs, skipped_steps=skipped_steps)
        return {**metrics, **{f"teacher_wait_s/{name}": wait for name, wait in pairs.teacher_waits.items()}}

    def _plain(self, pairs: _StepPairs) -> list[dict[str, torch.Tensor]]:
        records = []
        for index, (micro_batch, answer) in enumerate(pairs):
            # Gradients are reduced over the data-parallel ranks once, after the step's last micro-batch.
            with gradient_sync(self.model, enabled=index == self.num_micro_batches - 1):
                router = None
                with (self.router_loss.recording() if self.router_loss else contextlib.nullcontext(),
                      self.hidden_states.tap.on() if self.hidden_states else contextlib.nullcontext()):
                    output = (self.fused_head.hidden_states(self.model, None, micro_batch) if self.fused_head
                              else student_logits(self.model, None, micro_batch))
                hidden = self.hidden_states.tap.take() if self.hidden_states else None
                if self.router_loss:  # under cp, this rank's share
                    statistics = self.router_loss.statistics(micro_batch["attention_mask"])
                    router = self.router_loss.local_loss(statistics, group=self._cp_group)
                loss, values = self.micro_batch_loss(output, micro_batch, answer, pairs.norm, router, hidden)
                loss.backward()
            records.append(values)
        return records

    def _pipelined(self, pairs: list[Pair], *, norm: torch.Tensor) -> list[dict]:
        """The schedule runs every micro-batch of the step at once; only the last stage computes losses, and
        every stage gets their values from it, so all log, clip and checkpoint alike."""
        micro_batches, answers = zip(*pairs)
        by_index: dict[int, dict] = {}

        def loss_fn(index: int, output: torch.Tensor, router: torch.Tensor | None = None) -> torch.Tensor:
            loss, by_index[index] = self.micro_batch_loss(output, micro_batches[index], answers[index], norm, router)
            return loss

        try:
            self.pipeline.step(list(micro_batches), loss_fn)
        except HeadTransformError as error:  # the last stage's first forward, with the fused output layer
            raise self.fused_head.refusal(error) from None
        return broadcast_loss_metrics_from_last_stage(
            [by_index[i] for i in range(len(pairs))] if self.pipeline.is_last else None, pp_group=self.setup.pp_group)

    def micro_batch_loss(self, output: torch.Tensor, micro_batch: dict, answer: TeacherAnswer | None,
                         norm: float | torch.Tensor, router: torch.Tensor | None = None,
                         hidden: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the loss to backpropagate, its detached loss / ce_loss / kd_loss values) of one micro-batch.

        `output`: the student's logits, or with the fused output layer its last hidden states (`FusedHead.loss`
        then computes the objective). `norm`: the step's global number of valid tokens, at least 1 (a 0-dim tensor
        in the step). `router`: an MoE student's load-balancing loss of this micro-batch (under cp this rank's
        share); the objective adds `router_loss.coefficient` times its mean over the step's micro-batches on every
        dp rank. `hidden`: the student's outputs of `kd.hidden_states`' paired layers; the objective adds `weight`
        times their term (`hidden_state_loss`)."""
        if self.fused_head is not None:
            loss, values = self.fused_head.loss(output, micro_batch, answer, self.answer_context, norm=norm)
        else:
            loss, values = self._objective(output, micro_batch, answer, norm)
        if hidden is not None:
            term = self.hidden_states.loss(hidden, answer, micro_batch, self.kd, norm=norm)
            loss = loss + self.hidden_states.weight * term
            values["hidden_state_loss"] = term.detach()
        if router is not None:
            share = router / (self.num_micro_batches * self.setup.dp_size)  # of the mean over the step's
            loss = loss + self.router_loss.coefficient * share
            values["router_loss"] = share.detach()
        values["loss"] = loss.detach()
        # Wrappers average gradients over dp (and cp) ranks; the normalization asks for their sum.
        return loss * student_loss_scale(self.setup), values

    def _objective(self, logits: torch.Tensor, micro_batch: dict, answer: TeacherAnswer | None,
                   norm: float | torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(1 - kd_ratio) CE + kd_ratio KD from whole logits, and its ce_loss / kd_loss values (and the answer's
        figures)."""
        kd = self.kd
        kd_logits = logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]
        ce = cross_entropy_loss(logits, micro_batch["labels"], ignore_index=kd.ignore_index, num_valid_tokens=norm,
                                chunk_size=kd.chunk_size) if kd.kd_ratio < 1 else None
        kd_loss, figures = (None, {}) if kd.kd_ratio == 0 else answer.kd_loss(kd_logits, micro_batch,
                                                                            self.answer_context, norm=norm)
        zero = torch.zeros((), device=logits.device)
        return kd_objective(ce, kd_loss, kd.kd_ratio), {"ce_loss": ce.detach() if ce is not None else zero,
                                                        "kd_loss": kd_loss.detach() if kd_loss is not None else zero,
                                                        **figures}

    def _finish(self, records: list[dict], pairs: _StepPairs, *, skipped_steps: int) -> dict:
        """Clip, reduce the step's figures over the student ranks and read them (the step's one host sync), apply
        the non-finite rule, step the optimizer and the schedule; the metrics, loss values summed over dp and cp."""
        stages = self.setup.pp_group if self.pipeline is not None else None
        copies = self.pipeline.tied_copies if self.pipeline is not None else ()
        scale_expert_gradients(self.model)
        parameters = list(self.model.parameters())
        if self.hidden_states is not None:  # its projections, replicated: reduced here, clipped with the model
            self.hidden_states.reduce_gradients([self._dp_group] + ([self._cp_group] if self._cp_group else []))
            parameters += self.hidden_states.parameters()
        grad_norm = clip_grad_norm(parameters, self.max_grad_norm, stages_group=stages, uncounted=copies)
        # The rest (the router's loss, each teacher's divergence) in the records' order, the same on every rank.
        keys = ("loss", "ce_loss", "kd_loss") + tuple(key for key in records[0] if key not in ("loss", "ce_loss",
                                                                                                "kd_loss"))
        totals = torch.stack([torch.stack([torch.as_tensor(record[key], dtype=torch.float64).to(self.device)
                                           for key in keys]) for record in records]).sum(0)
        checks = self.answer_context.index_checks
        reduced = torch.cat([totals if self._adds_loss_values else torch.zeros_like(totals),
                             torch.full((1,), float(self.stop_requested()), dtype=torch.float64, device=self.device),
                             torch.stack(checks).sum().double().view(1).to(self.device) if checks else
                             torch.zeros(1, dtype=torch.float64, device=self.device)])
        dist.all_reduce(reduced, group=self.group)
        # The valid-token count and the gradient norm are the same on every rank already: read with the rest.
        *summed, stops, index_errors, num_valid, grad_norm = torch.cat(
            [reduced, pairs.num_valid.view(1), grad_norm.to(self.device).view(1)]).tolist()
        self.stop_agreed = stops > 0
        if index_errors:  # the loss read only the indices in range; no update is taken from it
            raise ValueError(f"step {self.scheduler.last_epoch + 1}: a top-k teacher answer is malformed: "
                             f"{TopK.index_message(self.vocab_size)}")
        finite = all(math.isfinite(value) for value in (*summed, grad_norm))
        if finite:
            self.optimizer.step()
        else:
            # The same sums on every student rank: all skip, or all stop, before the weights take the update.
            check_nonfinite(self.kd, step=self.scheduler.last_epoch + 1, summed=summed, grad_norm=grad_norm,
                            skipped_steps=skipped_steps)
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return {**_routed_means(dict(zip(keys, summed)), norm=max(num_valid, 1.0)), "lr": lr, "grad_norm": grad_norm,
                "num_tokens": num_valid, "teacher_wait_s": pairs.wait_s, "skipped": not finite}


def _routed_means(metrics: dict[str, float], *, norm: float) -> dict[str, float]:
    """With routed rows, `kd_loss/NAME` summed over the step is the teacher's share of `kd_loss` (its rows'
    divergence over the step's `norm` tokens): it becomes the teacher's own divergence per token of its rows
    (`kd_tokens/NAME` of them), and is left out for a teacher that answered no rows this step."""
    for key in [key for key in metrics if key.startswith("kd_tokens/")]:
        name, tokens = key.partition("/")[2], metrics[key]
        share = metrics.pop(f"kd_loss/{name}")
        if tokens > 0:
            metrics[f"kd_loss/{name}"] = share * norm / tokens
    return metrics


class _StepPairs:
    """The step's (micro-batch, answer) pairs drawn from a feed as the step asks for them, cp-sharded.

    Drawing the first also sums its step's valid tokens over the dp ranks (`num_valid`, a float64 tensor on
    the device: nothing waits for it), which every micro-batch's loss divides by (`norm`: at least 1); `wait_s`
    adds up the time spent waiting for the teacher."""

    def __init__(self, feed: Iterator[Pair], step: TrainStep) -> None:
        self._feed, self._step = feed, step
        self.wait_s = 0.0
        self.num_valid = self.norm = torch.zeros((), dtype=torch.float64, device=step.device)
        self.teacher_waits: dict[str, float] = {}  # several teachers: each one's wait, by name

    def __iter__(self) -> Iterator[Pair]:
        step = self._step
        for index in range(step.num_micro_batches):
            started = time.perf_counter()
            with step.watch("the teacher request", "teacher"):
                item, answer = next(self._feed)
            self.wait_s += time.perf_counter() - started
            if index == 0:
                self.num_valid = torch.as_tensor(item["step_valid"], device=step.device).to(torch.float64, copy=True)
                dist.all_reduce(self.num_valid, group=step._dp_group)
                self.norm = self.num_valid.clamp_min(1.0)
            answer = answer_of(answer)
            for name, wait in (answer.wait_s if answer is not None else {}).items():
                self.teacher_waits[name] = self.teacher_waits.get(name, 0.0) + wait
            micro_batch = item["micro_batch"]
            if merges_groups(step.kd):  # where its groups lie, read from its host rows: no chunk waits for it
                micro_batch = with_group_layout(micro_batch, item.get("host_batch"), ignore_index=step.kd.ignore_index)
            yield (shard_micro_batch(micro_batch, step.setup, ignore_index=step.kd.ignore_index),
                   answer.shard(step.setup) if answer is not None else None)


def check_nonfinite(kd: KDConfig, *, step: int, summed: list[float], grad_norm: float, skipped_steps: int) -> None:
    """The non-finite rule: return to skip this step's update (`kd.on_nonfinite: skip_step`, at most
    `kd.max_skipped_steps` times in all), else raise ValueError naming the step and the values."""
    values = f"loss {summed[0]}, ce_loss {summed[1]}, kd_loss {summed[2]}, grad_norm {grad_norm}"
    if kd.on_nonfinite == "skip_step" and skipped_steps < kd.max_skipped_steps:
        warn0(f"step {step}: the loss or its gradient is not finite ({values}); step skipped, no update "
              f"({skipped_steps + 1} of at most kd.max_skipped_steps={kd.max_skipped_steps})")
        return
    skipped = f" after {skipped_steps} skipped step(s), the most kd.max_skipped_steps allows" if (
        kd.on_nonfinite == "skip_step") else ""
    raise ValueError(
        f"step {step}: the loss or its gradient is not finite ({values}); training stopped before this "
        f"update{skipped}. Lower optimizer.lr, check the data, or resume from the last checkpoint"
    )

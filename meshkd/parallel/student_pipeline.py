"""Student pipeline parallelism: one pipeline stage per pp rank, driven by torch.distributed.pipelining.

Design (torchtitan style). `StudentPipeline` splits the model by its pipeline plan
(`meshkd.parallel.stages.ModelStage`: this rank's contiguous decoder layers, the embedding on the first stage, norm
and head on the last, pass-throughs elsewhere) and wraps it in a small stage module that registers the
model's children as its own, so parameter names are the transformers (HF) names and the stages' state
dicts are slices of the HF state dict. The model's own forward runs. Then TP (`meshkd.parallel.tensor_parallel`,
the model's own plan), then FSDP2 per decoder layer and on the stage root over `dp_shard` (HSDP over
(dp_replicate, dp_shard)), as `parallelize_student` does; no wrapper when dp_size is 1. Tied input/output
embeddings become two copies, the first stage's embedding and the last stage's head, whose gradients are
exchanged and summed after every step (as Megatron does), so the same update keeps them equal.

Context parallel (cp_size > 1): the micro-batches are the cp rank's head-tail shards
(`meshkd.parallel.shard_student_batch`); the attention gathers K/V over `cp` with a differentiable gather
(as `parallelize_student`'s CP), the document indices of the whole sequence are gathered once per step,
and FSDP2 shards over the flattened (dp_shard, cp) axis, so the loss scale stays dp * cp.

A torch `PipelineStage` + `ScheduleGPipe` / `Schedule1F1B` runs the micro-batches. Only the hidden state
travels between stages, and for an MoE student trained with its router loss the routers' running statistics
(`meshkd.recipe.student.router_loss`: each stage adds its layers' part, the last stage's loss sees them all, and
the backward returns each stage its part's gradient the same way). Every rank of a data-parallel replica
holds the same micro-batches, so position_ids and the NEAT document indices reach every stage as schedule
kwargs (chunked per micro-batch like the inputs) and each stage builds its own attention masks
(`meshkd.core.masks.layer_masks`, as `TeacherRunner`). The micro-batch index reaches the loss as the schedule's target:
`arange(n)`, chunked into one index each.

Stage metadata is given statically (shapes from the micro-batch, dtype from the parameters), so torch runs
no extra forward/backward to infer it and never calls the loss for that; the last stage hands the schedule
its local vocab shard (a plain tensor) and the loss gets the DTensor Shard(-1) back, or, where the loss applies the
output layer itself (`hands_hidden_states`), its last hidden states. One stage and
schedule are built per micro-batch shape and kind (training, evaluation) and reused. Gradients are not
rescaled (`scale_grads=False`): the caller's loss is normalized over the whole optimizer step and already
multiplied by `student_loss_scale(setup)`.

Mixed precision (a compute dtype other than the parameters', `meshkd.parallel.mixed_precision`): each
stage's forward runs under autocast and FSDP2 gathers in the compute dtype, as `parallelize_student`
does; hidden states travel between stages in the parameters' dtype (a float32 residual stream is not
rounded at a stage boundary) and the last stage's logits in the compute dtype.

Export (`full_state_dict(first_rank_only=True)`, what `meshkd.recipe.modeling.checkpoint.export_hf` writes from): the
stages reach the setup's first rank one unsharded tensor at a time over pp, so no other rank ever holds more
than one whole tensor of its stage, and nothing is pickled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from meshkd.core.masks import (
    attention_windows,
    gather_documents,
    positions_and_documents,
    takes_block_masks,
)
from meshkd.core.topology import PP_SCHEDULES, DistributedSetup, member_mesh
from meshkd.parallel.context_parallel import enable_cp_attention, ensure_student_cp_axis
from meshkd.parallel.data_parallel import check_experts_over_dp, student_fsdp_mesh
from meshkd.parallel.mixed_precision import autocast_forward, fsdp_policy, is_mixed
from meshkd.parallel.pipeline_export import pipeline_state_dict
from meshkd.parallel.sharded_loading import is_empty
from meshkd.parallel.stage_module import StageModule
from meshkd.parallel.stages import ModelStage, decoder_of, is_pass_through, is_tied
from meshkd.parallel.tensor_parallel import apply_tensor_parallel

__all__ = ["StudentPipeline"]

LossFn = Callable[[int, torch.Tensor], torch.Tensor]
_MODEL_INPUTS = ("input_ids", "position_ids", "attention_mask")


@dataclass
class _Runner:
    """A torch stage and its schedule for one micro-batch shape and kind (training or evaluation)."""

    stage: Any
    schedule: Any
    fresh: bool = True  # not run yet: its first run initializes the stage (see `StudentPipeline._run`)


class StudentPipeline:
    """This rank's stage of a pipeline-parallel student, laid out over `setup`, and its schedule.

    Construction changes `model` in place (other stages' parts are dropped, the rest moved to `device`, TP
    and FSDP2 applied) and keeps it inside `stage_model`. Every rank of the setup constructs it; invalid
    settings raise ValueError on every rank before any collective.

    Attributes:
        stage_model: this rank's stage (HF parameter names, TP + FSDP2 applied): what the optimizer, the
            checkpoint (DCP) and the gradient norm see. Its `state_dict()` keys are a subset of the HF
            model's; the stages' subsets are disjoint and together complete.
        is_first / is_last: whether this rank holds the first / last pipeline stage.
        pp_rank, pp_size, pp_group: this rank's stage index, the number of stages, the pipeline group.

    Args:
        model: a transformers causal LM split by its `base_model_pp_plan` (`meshkd.parallel.stages.ModelStage`),
            sdpa, eager or flex attention, identical on every rank (or built with meta parameters for
            `meshkd.parallel.sharded_loading.load_shards`). Tied input/output embeddings are kept as two copies
            (first and last stage) with summed gradients.
        setup: the student's `DistributedSetup` with pp_size > 1 (this rank must be a member).
        device: where the stage runs.
        schedule: one of `meshkd.core.topology.PP_SCHEDULES`: "1f1b" (torch's Schedule1F1B) or "gpipe" (ScheduleGPipe).
        num_micro_batches: micro-batches per `step` (1F1B needs at least pp_size).
        router_loss: an MoE student's `meshkd.recipe.student.router_loss.RouterLoss`, built on the whole model before
            this splits it; its share of each micro-batch then reaches `loss_fn` (see `step`).
        compute_dtype: the dtype to compute in when it is not the parameters' (float32 master weights):
            mixed precision, as in `parallelize_student`.
    """

    def __init__(
        self,
        model: nn.Module,
        setup: DistributedSetup,
        *,
        device: torch.device | str,
        schedule: str,
        num_micro_batches: int,
        router_loss=None,
        compute_dtype: torch.dtype | None = None,
    ):
        # Validation first: it reads only the config and the setup, so every rank raises the same error
        # before any collective.
        _check_settings(model, setup, schedule, num_micro_batches)
        windows = attention_windows(model.config, model)
        block = takes_block_masks(model.config)  # read before context parallel renames the attention
        mesh = member_mesh(setup)

        self.setup = setup
        self.device = torch.device(device)
        self.schedule_name = schedule
        self.num_micro_batches = num_micro_batches
        self.pp_size = setup.pp_size
        self.pp_rank = mesh.get_local_rank("pp")
        self.pp_group = mesh.get_group("pp")
        self.is_first = self.pp_rank == 0
        self.is_last = self.pp_rank == self.pp_size - 1
        self.tp_mesh = mesh["tp"] if setup.tp_size > 1 else None
        self.cp_size, self.cp_rank = setup.cp_size, mesh.get_local_rank("cp")
        self.cp_group = mesh.get_group("cp") if self.cp_size > 1 else None
        if self.cp_size > 1:
            ensure_student_cp_axis(setup)

        # Pipeline split first, so that TP and FSDP only touch what this stage keeps.
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        mixed = is_mixed(model, compute_dtype)
        policy = fsdp_policy(model, compute_dtype)
        self.hidden_size = model.config.hidden_size
        tied = is_tied(model)
        model_stage = ModelStage(model, pp_size=self.pp_size, pp_rank=self.pp_rank)
        if not is_empty(model):  # else `load_shards` gives it storage on the device once laid out
            model.to(self.device)
        if self.tp_mesh is not None:
            apply_tensor_parallel(model, self.tp_mesh, expert_parallel=setup.expert_axis == "tp")
        if self.cp_size > 1:
            # Gathered-K/V attention, differentiable (as parallelize_student's CP): the stage builds the mask.
            enable_cp_attention(model, self.cp_group)
        self.router_loss = router_loss
        self.logits_dtype = compute_dtype if mixed else self.dtype
        stage = StageModule(model_stage, windows=windows, dtype=self.dtype, logits_dtype=self.logits_dtype,
                             cp_size=self.cp_size, cp_rank=self.cp_rank, router_loss=router_loss, block=block)
        if mixed:
            autocast_forward(stage, compute_dtype, self.device)
        if self.is_last:
            weight = model.get_output_embeddings().weight
            self.vocab_size = weight.shape[0]  # global, also for a DTensor
            self.local_vocab_size = weight.to_local().shape[0] if isinstance(weight, DTensor) else self.vocab_size
        if setup.dp_size * setup.cp_size > 1:
            _apply_fsdp(stage, setup, mesh, policy)
        self.stage_model = stage
        # Tied input/output embeddings: the first stage's embedding and the last stage's head hold copies of
        # one matrix, kept equal by summing their gradients after every step (as Megatron does); the same
        # optimizer update then keeps the copies identical.
        self.tied_weight: nn.Parameter | None = None
        if tied and (self.is_first or self.is_last):
            module = model.get_input_embeddings() if self.is_first else model.get_output_embeddings()
            self.tied_weight = module.weight
        self.tied_copies = (self.tied_weight,) if self.tied_weight is not None and not self.is_first else ()
        """Parameters that copy another stage's (the last stage's tied head): clipping scales them but does
        not count them in the gradient norm."""

        self._runners: dict[tuple, _Runner] = {}
        self._loss_fn: LossFn | None = None

    @property
    def hands_hidden_states(self) -> bool:
        """Whether the last stage hands its last hidden states [rows, seq, hidden] to the loss and to `forward`'s
        caller in place of the logits (a loss that applies the output layer itself: the fused output layer,
        `meshkd.recipe.student.fused_head`); both schedules' metadata then say so. Set before the first step."""
        return self.stage_model.hands_hidden_states

    @hands_hidden_states.setter
    def hands_hidden_states(self, value: bool) -> None:
        self.stage_model.hands_hidden_states = value

    @property
    def causal_lm(self) -> nn.Module:
        """This rank's stage's causal LM (the layers of other stages are pass-throughs)."""
        return self.stage_model.stage.model

    # -- training --------------------------------------------------------------------------------------

    def step(self, micro_batches: list[dict], loss_fn: LossFn) -> None:
        """One forward + backward over all micro-batches with the schedule; gradients accumulate in .grad.

        Args:
            micro_batches: `num_micro_batches` dicts with `input_ids`, `position_ids`, `attention_mask`
                (NEAT document indices) [rows, seq], all of one shape; identical on every rank of the
                data-parallel replica (all its stages and tp ranks), or with cp_size > 1 this cp rank's
                share from `shard_student_batch` (then seq is the local length). Other keys are ignored.
            loss_fn: `loss_fn(index, logits) -> Tensor`, called on the last stage only, once per
                micro-batch `index` (0-based, in order), with logits [rows, seq, vocab] (a DTensor
                Shard(-1) under tp; with `hands_hidden_states`, the last hidden states); with a
                `router_loss`, `loss_fn(index, logits, router)` where `router`
                is this rank's share of the micro-batch's router loss (the whole of it without cp, else the
                cp ranks' shares add up to it), to add to the loss. It returns the scalar loss to
                backpropagate, already normalized over the optimizer step and multiplied by
                `student_loss_scale(setup)`; gradients are not rescaled here.
        """
        if len(micro_batches) != self.num_micro_batches:
            raise ValueError(
                f"expected num_micro_batches({self.num_micro_batches}) micro-batches, got {len(micro_batches)}"
            )
        if not torch.is_grad_enabled():
            raise RuntimeError("StudentPipeline.step needs gradients enabled; use forward() for evaluation")
        input_ids, position_ids, documents = self._inputs(micro_batches)
        rows, length = micro_batches[0]["input_ids"].shape
        runner = self._runner(rows, length, train=True)
        # The target is only the micro-batch index: the schedule chunks it like the inputs, one per call.
        target = torch.arange(self.num_micro_batches)
        self._loss_fn = loss_fn
        before = self._tied_gradient()
        before = before.clone() if before is not None else None
        try:
            self._run(runner, input_ids, position_ids, documents, target=target, return_outputs=False)
        finally:
            self._loss_fn = None
        self._sum_tied_gradients(before)

    def _tied_gradient(self) -> torch.Tensor | None:
        """This rank's local piece of the tied weight's gradient, laid out like the weight, or None."""
        weight = self.tied_weight
        grad = weight.grad if weight is not None else None
        if not isinstance(grad, DTensor):
            return grad
        if grad.placements != weight.placements:
            # A vocab-sharded embedding's backward may leave its gradient in another layout than the weight's.
            weight.grad = grad = grad.redistribute(grad.device_mesh, weight.placements)
        return grad.to_local()

    def _sum_tied_gradients(self, before: torch.Tensor | None) -> None:
        """Add the other tied copy's gradient from this step to this one's: first and last stage swap theirs.

        Both copies are sharded alike (vocabulary over tp, dim 0 over dp), so the local pieces correspond.
        Only this step's contribution travels, so gradients accumulated over several calls are summed once.
        """
        if self.tied_weight is None:
            return
        local = self._tied_gradient()
        contribution = local - before if before is not None else local.clone()
        received = torch.empty_like(contribution)
        peer = self.pp_size - 1 if self.is_first else 0
        operations = [dist.P2POp(dist.isend, contribution, group=self.pp_group, group_peer=peer),
                      dist.P2POp(dist.irecv, received, group=self.pp_group, group_peer=peer)]
        for request in dist.batch_isend_irecv(operations):
            request.wait()
        local.add_(received)

    def _schedule_loss(self, output: torch.Tensor | tuple, target: torch.Tensor) -> torch.Tensor:
        """The loss the torch schedule calls on the last stage: (local logits or hidden states [, router
        statistics], [index]) -> loss_fn(...)."""
        index = int(target.reshape(-1)[0])
        if self.router_loss is None:
            return self._loss_fn(index, self._logits(output))
        logits, statistics = output
        return self._loss_fn(index, self._logits(logits), self.router_loss.local_loss(statistics, group=self.cp_group))

    # -- evaluation ------------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, micro_batch: dict) -> torch.Tensor | None:
        """Logits [rows, seq, vocab] on the last stage (DTensor Shard(-1) under tp; the last hidden states with
        `hands_hidden_states`); None elsewhere.

        Every stage (and tp rank) of the replica calls it with the same micro-batch. Forward only; put
        `stage_model` in eval mode first if the model has dropout.
        """
        input_ids, position_ids, documents = self._inputs([micro_batch])
        runner = self._runner(*micro_batch["input_ids"].shape, train=False)
        output = self._run(runner, input_ids, position_ids, documents, return_outputs=True)
        if not self.is_last:
            return None
        return self._logits(output if self.router_loss is None else output[0])

    @contextlib.contextmanager
    def gathered(self):
        """Within it, the stage's own parameters (the last stage's output layer among them) are whole on every rank
        of its FSDP2 group, as in its forward: a loss computed from the last stage's hidden states after an
        evaluation's schedule, which reshards them, reads the whole weight. Every rank of the group enters it."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self.stage_model, FSDPModule):
            yield
            return
        self.stage_model.unshard()
        try:
            yield
        finally:
            self.stage_model.reshard()

    # -- export ----------------------------------------------------------------------------------------

    def full_state_dict(self, *, first_rank_only: bool = False) -> dict[str, torch.Tensor]:
        """The complete HF-named state dict (all stages, unsharded, on the CPU) on every rank of the pipeline, or
        with `first_rank_only` on the setup's first rank alone (`meshkd.parallel.pipeline_export`)."""
        return pipeline_state_dict(self.stage_model, self.setup, pp_group=self.pp_group, pp_rank=self.pp_rank,
                                   device=self.device, first_rank_only=first_rank_only)

    # -- internals -------------------------------------------------------------------------------------

    def _inputs(self, micro_batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids, position_ids, documents of all micro-batches concatenated on dim 0 (the schedule splits).

        Under context parallel the micro-batches are this rank's shards: the documents of the whole padded
        sequence are gathered over cp here, before the schedule runs, since every stage's mask needs them.
        """
        shape = tuple(micro_batches[0]["input_ids"].shape)
        if len(shape) != 2:
            raise ValueError(f"input_ids must be [rows, seq], got shape {shape}")
        parts: tuple[list, list, list] = ([], [], [])
        for index, batch in enumerate(micro_batches):
            input_ids = batch["input_ids"].to(self.device)
            position_ids, documents = positions_and_documents(batch, input_ids)
            for name, tensor, part in zip(_MODEL_INPUTS, (input_ids, position_ids, documents), parts):
                if tuple(tensor.shape) != shape:
                    raise ValueError(
                        f"micro-batch {index}: {name} has shape {tuple(tensor.shape)}; every micro-batch "
                        f"tensor must have the shape {shape} of the first input_ids"
                    )
                part.append(tensor.to(self.device).long())
        input_ids, position_ids, documents = (torch.cat(part) for part in parts)
        if self.cp_size > 1:
            documents = gather_documents(documents, self.cp_group)
        return input_ids, position_ids, documents

    def _logits(self, local: torch.Tensor) -> torch.Tensor:
        """The last stage's local logits as the model returns them: a DTensor Shard(-1) under tp (the last hidden
        states, with `hands_hidden_states`, as they are)."""
        if self.tp_mesh is None or self.hands_hidden_states:
            return local
        rows, length = local.shape[:2]
        # Explicit global shape and stride: the vocab may not split evenly over tp.
        return DTensor.from_local(
            local, self.tp_mesh, (Shard(-1),), run_check=False,
            shape=torch.Size((rows, length, self.vocab_size)), stride=(length * self.vocab_size, self.vocab_size, 1),
        )  # fmt: skip

    def _runner(self, rows: int, length: int, *, train: bool) -> _Runner:
        """The stage and schedule for micro-batches of [rows, length], built on first use.

        torch allocates the receive buffers from the stage metadata once, so each shape gets its own
        stage. Training and evaluation get separate ones too: switching one schedule between them would
        re-initialize it every time.
        """
        key = (train, rows, length)
        if key in self._runners:
            return self._runners[key]
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        def meta(*shape: int, dtype: torch.dtype = self.dtype, grad: bool = True) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)

        hidden = meta(rows, length, self.hidden_size)
        inputs = meta(rows, length, dtype=torch.int64, grad=False) if self.is_first else hidden
        logits = self.is_last and not self.hands_hidden_states
        outputs = meta(rows, length, self.local_vocab_size, dtype=self.logits_dtype) if logits else hidden
        if self.router_loss is not None:  # and the routers' statistics (`StageModule.forward`)
            statistics = meta(2, self.router_loss.num_experts + 1, dtype=torch.float32)
            inputs = (inputs,) if self.is_first else (inputs, statistics)
            outputs = (outputs, statistics)
        stage = PipelineStage(self.stage_model, self.pp_rank, self.pp_size, self.device, input_args=inputs,
                              output_args=outputs, group=self.pp_group)
        if train:
            cls = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
            schedule = cls(stage, self.num_micro_batches, loss_fn=self._schedule_loss, scale_grads=False)
        else:
            # No loss: forward only (the backward part of GPipe then does nothing).
            schedule = ScheduleGPipe(stage, 1, scale_grads=False)
        self._runners[key] = runner = _Runner(stage, schedule)
        return runner

    def _run(self, runner: _Runner, input_ids, position_ids, documents, **options: Any) -> Any:
        """`schedule.step` with this stage's inputs, keeping any gradients the caller accumulated before.

        The first run of a stage initializes it, and torch then resets every FSDP parameter's .grad (a
        cleanup meant for its metadata inference, done in static mode too). A training step or an
        evaluation between backward and the optimizer step must not lose those gradients, so they are put
        aside and added back.
        """
        args = (input_ids,) if self.is_first else ()  # later stages receive their input from the previous one
        kwargs = dict(position_ids=position_ids, documents=documents)
        saved = []
        if runner.fresh:
            saved = [(p, p.grad) for p in self.stage_model.parameters() if p.grad is not None]
            for parameter, _ in saved:
                parameter.grad = None
        try:
            output = runner.schedule.step(*args, **kwargs, **options)
            runner.fresh = False
        finally:
            for parameter, grad in saved:
                parameter.grad = grad if parameter.grad is None else parameter.grad.add_(grad)
        return output


def _check_settings(model: nn.Module, setup: DistributedSetup, schedule: str, num_micro_batches: int) -> None:
    """ValueError for settings the student pipeline does not support (config and setup only, no collective)."""
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; valid schedules are {list(PP_SCHEDULES)}")
    if setup.pp_size < 2:
        raise ValueError(f"StudentPipeline needs pp_size > 1, got pp_size({setup.pp_size}); use parallelize_student")
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be a positive integer, got {num_micro_batches!r}")
    if schedule == "1f1b" and num_micro_batches < setup.pp_size:
        raise ValueError(
            f"schedule '1f1b' needs num_micro_batches({num_micro_batches}) >= pp_size({setup.pp_size}); "
            f"raise the number of micro-batches per step or use 'gpipe'"
        )
    if setup.sequence_parallel:
        raise ValueError("sequence_parallel with pp_size > 1 is not supported")
    if setup.strategy == "ddp" and setup.dp_size > 1:
        raise ValueError(f"strategy 'ddp' with pp_size({setup.pp_size}) > 1 is not supported; use fsdp2")
    if setup.expert_axis == "dp_shard":
        check_experts_over_dp(setup)  # refuses pp_size > 1
    num_layers = len(decoder_of(model).layers)
    if setup.pp_size > num_layers:
        raise ValueError(f"pp_size({setup.pp_size}) exceeds the number of decoder layers ({num_layers})")


def _apply_fsdp(stage: StageModule, setup: DistributedSetup, mesh, policy: dict) -> None:
    """FSDP2 per decoder layer, then on the stage root, over dp_shard (HSDP with dp_replicate > 1); `policy`:
    `meshkd.parallel.mixed_precision.fsdp_policy`'s."""
    from torch.distributed.fsdp import fully_shard

    dp_mesh = student_fsdp_mesh(setup, mesh)
    # As torchtitan does with pp: keep the parameters gathered from forward to backward, since every
    # micro-batch would gather them again. The schedule reshards after the last backward.
    for layer in decoder_of(stage.stage.model).layers:
        if not is_pass_through(layer):
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False, **policy)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False, **policy)

"""The student's output layer fused with its loss in training (`kd.fused_output_loss`; `meshkd.core.fused_output`).

Design. The model's own forward runs; for one micro-batch its output layer's forward is swapped (`computing`):
it receives the last hidden states, computes the micro-batch's objective from them and its weight chunk by
chunk (`kd.chunk_size` tokens, 1024 when unset), and returns, in place of the logits, that loss broadcast to
the logits' shape (stride 0: nothing of [tokens, vocab] is allocated). The model hands it back as its
`.logits`; the step backpropagates from one of its entries, through the model's outputs, so FSDP2's and DDP's
backward hooks run as for whole logits. The CE and KD values are kept for the step's metrics.

A pipelined student's last stage swaps its output layer for a whole step (`computing_each`): the schedule runs
the stage's forwards in micro-batch order whatever it interleaves, so the k-th forward computes micro-batch k's
objective, and the schedule's loss (which gets the micro-batch's index) reads it back (`loss_of(logits, k)`).
The schedules' metadata says the stage's output has stride 0 (`StudentPipeline.loss_in_head`), and the loss
travels in the stage's logits dtype, its exact float32 value kept for the backward's scale and the metrics. A
held-out evaluation's forward hands the stage's chunks to the evaluation (`evaluating`), as without a pipeline.

It applies (`FusedHead.of`) where the logits reach the loss as the output layer makes them: any student (dp, tp,
cp, pp's last stage: under tp the head is vocab-parallel, each rank computes its vocabulary slice of a
chunk's logits and the losses' vocab-parallel paths combine them), and a model that does not transform its logits
after the head (`LOGIT_TRANSFORMS`: Gemma 2's soft-capping, Granite's scaling, Cohere's scale; a model that does
anyway is stopped at its first step, naming the key); and per micro-batch to one teacher's distribution
(`Distribution`: full, full_bf16, top-k, compact), several teachers' (`Ensemble`: sum, mixture, route), a teacher
of another tokenizer's per aligned group (`GroupDistributions`: uld, gold; a group's distribution also reads the
log-probabilities of its earlier positions' labels, found first by a pass without gradients, and its chunks run last
to first, `GroupDistributions.prepare_chunks`) or no teacher (`kd.kd_ratio: 0`). Under context parallel each cp
rank's head sees its own share of the positions, as the micro-batch and the answer are cut (`shard_micro_batch`,
`TeacherAnswer.shard`), and its loss is over that share, as whole logits' is. Elsewhere the step computes whole
logits as before. In a `model.dtype` other than float32 (mixed precision, or half-precision weights) the chunks'
matmuls run in that dtype, as autocast runs the output layer
(`fused_output_loss`'s `compute_dtype`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.distributed.tensor import DTensor, Shard

from meshkd.core.fused_output import fused_output_loss
from meshkd.core.loss import cross_entropy_loss, kd_objective
from meshkd.recipe.modeling.models import resolve_dtype
from meshkd.recipe.teacher.teacher_answers import LossContext, TeacherAnswer

DEFAULT_CHUNK = 1024
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logits_scaling", "logit_scale", "logit_softcap")
"""Config keys (or model attributes) of transformers models that change the logits after the output layer."""


class FusedHead:
    """The output layer of a laid-out student, swapped for one micro-batch at a time (see the module docstring)."""

    def __init__(self, head: torch.nn.Module, *, kd, vocab_size: int, model_name: str = "the student",
                 compute_dtype: torch.dtype = torch.float32, logits_dtype: torch.dtype = torch.float32) -> None:
        self.head, self.kd, self.vocab_size, self.model_name = head, kd, vocab_size, model_name
        self.compute_dtype, self.logits_dtype = compute_dtype, logits_dtype
        self.values: list[dict[str, torch.Tensor]] = []
        """Per micro-batch of the last `computing_each` (of `computing`: one), its CE and KD values and figures."""
        self._returned: list[tuple[int, torch.Tensor]] = []  # per micro-batch: the returned storage, the exact loss

    @classmethod
    def of(cls, model: torch.nn.Module, config, setup, pipeline, vocab_size: int) -> FusedHead | None:
        """The fused head of a laid-out student (its pipeline, or None) where it applies, else None. A pipeline's
        stages before the last have no output layer, so none; its last stage's training schedule is then told
        that the stage hands the loss (`StudentPipeline.loss_in_head`)."""
        # Under DDP, the wrapped model; pipelined, this stage's.
        causal_lm = pipeline.causal_lm if pipeline is not None else getattr(model, "module", model)
        head = causal_lm.get_output_embeddings() if hasattr(causal_lm, "get_output_embeddings") else None
        transforms = any(getattr(where, key, None) is not None for key in LOGIT_TRANSFORMS
                         for where in (causal_lm.config, causal_lm))
        if not config.kd.fused_output_loss or transforms or not isinstance(head, torch.nn.Linear):
            return None
        if pipeline is not None:
            pipeline.loss_in_head = True
        return cls(head, kd=config.kd, vocab_size=vocab_size, model_name=type(causal_lm).__name__,
                   compute_dtype=resolve_dtype(config.model.dtype),
                   logits_dtype=pipeline.logits_dtype if pipeline is not None else torch.float32)

    def applies(self, answer: TeacherAnswer | None) -> bool:
        """Whether the loss against `answer` can be computed by chunks of positions: every kind of answer has
        `chunk_kd_loss` (one that has no loss refuses there, naming its mode)."""
        return True

    @contextlib.contextmanager
    def computing(self, micro_batch: dict, answer: TeacherAnswer | None, context: LossContext, *,
                  norm: torch.Tensor) -> Iterator[None]:
        """Within it, the model's forward returns the micro-batch's objective as its logits (see the module
        docstring); `values[0]` then holds its CE and KD values and the answer's figures (`chunk_kd_loss`)."""
        with self.computing_each([micro_batch], [answer], context, norm=norm):
            yield

    @contextlib.contextmanager
    def computing_each(self, micro_batches: list[dict], answers: list[TeacherAnswer | None], context: LossContext,
                       *, norm: torch.Tensor) -> Iterator[None]:
        """`computing` of several micro-batches: within it, the output layer's k-th forward computes micro-batch
        k's objective (a pipelined step's forwards on the last stage, in order); `values[k]` holds its figures."""
        kd = self.kd
        self.values, self._returned = [], []
        for answer in answers:
            if answer is not None and kd.kd_ratio > 0:
                answer.check_indices(context, self.vocab_size)

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            index = len(self.values)
            if index == len(micro_batches):
                raise RuntimeError(f"the output layer ran more forwards than the {index} micro-batches it was given")
            sums = {"ce_loss": torch.zeros(()), "kd_loss": torch.zeros(())}
            self.values.append(sums)
            micro_batch, answer = micro_batches[index], answers[index]
            # A cross-tokenizer teacher's groups read their earlier positions' labels: known first, chunks reversed.
            grouped = answer is not None and kd.kd_ratio > 0 and answer.chunks_reversed
            if grouped:
                answer.prepare_chunks(self._label_log_probs(hidden, micro_batch), micro_batch, context)
            loss = self._fused(hidden, self._objective(micro_batch, answer, context, norm, sums), reverse=grouped)
            logits = self._as_logits(loss, hidden)
            local = logits.to_local() if isinstance(logits, DTensor) else logits
            self._returned.append((local.data_ptr(), loss.detach()))
            return logits

        with self._swapped(forward):
            yield

    def _objective(self, micro_batch: dict, answer: TeacherAnswer | None, context: LossContext,
                   norm: torch.Tensor, sums: dict[str, torch.Tensor]) -> Callable[[torch.Tensor, slice], torch.Tensor]:
        """The objective of a chunk of the micro-batch's positions (`fused_output_loss`'s), adding its CE and KD
        values and the answer's figures to `sums`."""
        kd, flat_labels = self.kd, micro_batch["labels"].reshape(-1)

        def objective(logits: torch.Tensor, tokens: slice) -> torch.Tensor:
            ce = kd_term = None
            if kd.kd_ratio < 1:
                ce = cross_entropy_loss(logits, flat_labels[tokens], ignore_index=kd.ignore_index,
                                        num_valid_tokens=norm, chunk_size=logits.shape[0])
                sums["ce_loss"] = sums["ce_loss"].to(ce.device) + ce.detach()
            if kd.kd_ratio > 0:
                student = logits if logits.shape[-1] == self.vocab_size else logits[:, : self.vocab_size]
                kd_term, figures = answer.chunk_kd_loss(student, tokens, micro_batch, context, norm=norm)
                for key, value in {"kd_loss": kd_term, **figures}.items():
                    sums[key] = sums[key].to(value.device) + value.detach() if key in sums else value.detach()
            return kd_objective(ce, kd_term, kd.kd_ratio)
        return objective

    @contextlib.contextmanager
    def evaluating(self, on_chunk: Callable[[torch.Tensor, slice], None]) -> Iterator[None]:
        """Within it (under no_grad), the model's forward hands each chunk's logits [c, vocab] (float32) and its
        slice of the flattened positions to `on_chunk`, and returns zeros as its logits (stride 0)."""
        def objective(logits: torch.Tensor, tokens: slice) -> torch.Tensor:
            on_chunk(logits, tokens)
            return torch.zeros((), device=logits.device)

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            return self._as_logits(self._fused(hidden, objective), hidden)

        with self._swapped(forward):
            yield

    def _fused(self, hidden: torch.Tensor, objective, *, reverse: bool = False) -> torch.Tensor:
        return fused_output_loss(hidden, self.head.weight, objective, bias=self.head.bias,
                                 chunk_size=self.kd.chunk_size or DEFAULT_CHUNK, compute_dtype=self.compute_dtype,
                                 reverse=reverse)

    def _label_log_probs(self, hidden: torch.Tensor, micro_batch: dict) -> torch.Tensor:
        """Each flattened position's log-probability of its label at `kd.temperature` (0 where it has none), chunk
        by chunk, without gradients."""
        labels = micro_batch["labels"].reshape(-1)
        found = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device)

        def objective(logits: torch.Tensor, tokens: slice) -> torch.Tensor:
            scaled = logits[:, : self.vocab_size] / self.kd.temperature
            picked = scaled.gather(-1, labels[tokens].clamp(min=0)[:, None])[:, 0] - scaled.logsumexp(-1)
            found[tokens] = picked.masked_fill(labels[tokens] < 0, 0.0)
            return torch.zeros((), device=logits.device)

        with torch.no_grad():
            self._fused(hidden.detach(), objective)
        return found

    def _as_logits(self, loss: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`loss` as the logits' shape with stride 0 (`_Broadcast`); for a vocab-parallel head a DTensor sharded on
        the vocabulary as its logits are (each rank's share holding its own copy of the loss)."""
        weight, lead, loss = self.head.weight, tuple(hidden.shape[:-1]), loss.to(self.logits_dtype)
        if not isinstance(weight, DTensor):
            return _Broadcast.apply(loss, (*lead, self.head.out_features))
        local = _Broadcast.apply(loss, (*lead, weight.to_local().shape[0]))
        placements = [Shard(len(lead)) if placement == Shard(0) else placement for placement in weight.placements]
        return DTensor.from_local(local, weight.device_mesh, placements, run_check=False,
                                  shape=(*lead, weight.shape[0]), stride=(0,) * (len(lead) + 1))

    @contextlib.contextmanager
    def _swapped(self, forward: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
        # An instance attribute. A tensor-parallel head has one already (transformers' styles wrap the module's
        # forward so): it is put back after, else the class's forward comes back.
        previous = self.head.__dict__.get("forward")
        self.head.forward = forward
        try:
            yield
        finally:
            if previous is None:
                del self.head.forward
            else:
                self.head.forward = previous

    def loss_of(self, logits: torch.Tensor, index: int = 0) -> torch.Tensor:
        """The objective of micro-batch `index` that `computing_each` returned as the model's logits, as a
        differentiable float32 scalar of its exact value (the logits may hold it in a lower precision).

        Raises:
            ConfigError: the model changed what its output layer returned (a transform `of` does not know)."""
        local = logits.to_local() if isinstance(logits, DTensor) else logits  # this rank's copy
        storage, exact = self._returned[index]
        if local.data_ptr() != storage or any(local.stride()):
            from meshkd.recipe.settings.config import ConfigError

            raise ConfigError(f"kd.fused_output_loss: {self.model_name} changes its logits after its output layer, "
                              "which the fused loss cannot follow; set kd.fused_output_loss: false")
        loss = _LossOf.apply(local).float()
        return loss + (exact.float() - loss).detach()


class _Broadcast(torch.autograd.Function):
    """A scalar as a tensor of `shape` all of whose entries are it: one stored value (stride 0), not a view (which
    FSDP2 warns of in a module's output). Backward takes the scalar's gradient from one entry of the incoming
    gradient: `_LossOf`, the one reader of these logits, hands it on there."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        out = torch.empty_strided(shape, (0,) * len(shape), dtype=loss.dtype, device=loss.device)
        out.as_strided((1,), (1,)).copy_(loss.reshape(1))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[(0,) * grad.ndim], None


class _LossOf(torch.autograd.Function):
    """The loss `_Broadcast` made into logits, back as a scalar; backward hands the scalar's gradient on as a
    stride-0 tensor of the logits' shape, so no [tokens, vocab] gradient is allocated either."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        ctx.shape = logits.shape
        return logits[(0,) * logits.ndim].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.reshape((1,) * len(ctx.shape)).expand(ctx.shape)

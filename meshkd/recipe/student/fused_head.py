"""The student's output layer fused with its loss (`kd.fused_output_loss`; `meshkd.core.fused_output`).

Design. The step asks the student for its last hidden states (`hidden_states`: the model's own forward, its output
layer applied to the last position only, `meshkd.parallel.stages.last_hidden_states`) and calls the loss on them
with the output layer's weight (`loss`): the micro-batch's objective, chunk by chunk (`kd.chunk_size` tokens, 1024 when
unset), the [tokens, vocab] logits never whole, the gradients of the hidden states and of the weight made in
forward. The weight is the one the model's forward used (under FSDP2 the root's gathered parameter, kept from
forward to backward; under tp its vocabulary shard, a DTensor), so its gradient reaches the optimizer as a whole
logits' would. A held-out evaluation hands each chunk's logits to the evaluation instead (`evaluate`). The first
forward also checks that the model returned what its output layer made at that one position: a model that changes
its logits after its output layer is stopped at its first step, naming the key.

A pipelined student's last stage hands the schedule its last hidden states (`StudentPipeline.hands_hidden_states`),
and the schedule's loss function calls `loss` on them.

It applies (`FusedHead.of`) where the logits reach the loss as the output layer makes them: any student (dp, tp,
cp, pp's last stage: under tp the head is vocab-parallel, each rank computes its vocabulary slice of a
chunk's logits and the losses' vocab-parallel paths combine them), and a model that does not transform its logits
after the head (`LOGIT_TRANSFORMS`: Gemma 2's soft-capping, Granite's scaling, Cohere's scale); and per
micro-batch to every training answer (`TeacherAnswer.chunk_kd_loss`: one teacher's distribution, several teachers',
a teacher of another tokenizer's per aligned group, whose distribution also reads the log-probabilities of its
earlier positions' labels, found first by a pass without gradients, its chunks then run last to first,
`TeacherAnswer.prepare_chunks`) or no teacher (`kd.kd_ratio: 0`). Under context parallel each cp rank's
hidden states are its own share of the positions, as the micro-batch and the answer are cut (`shard_micro_batch`,
`TeacherAnswer.shard`), and its loss is over that share, as whole logits' is. Elsewhere the step computes whole
logits. In a `model.dtype` other than float32 (mixed precision, or half-precision weights) the chunks' matmuls
run in that dtype, as autocast runs the output layer (`fused_output_loss`'s `compute_dtype`).

Host syncs: none. The figures are summed on the device, starting from zeros made there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshkd.core.fused_output import fused_output_loss
from meshkd.core.loss import cross_entropy_loss, kd_objective
from meshkd.parallel.stages import HeadTransformError, last_hidden_states
from meshkd.recipe.modeling.models import resolve_dtype
from meshkd.recipe.settings.config import ConfigError
from meshkd.recipe.teacher.teacher_answers import LossContext, TeacherAnswer

DEFAULT_CHUNK = 1024
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logits_scaling", "logit_scale", "logit_softcap")
"""Config keys (or model attributes) of transformers models that change the logits after the output layer."""


class FusedHead:
    """The output layer of a laid-out student, applied inside the loss (see the module docstring)."""

    def __init__(self, head: torch.nn.Module, *, kd, vocab_size: int, model_name: str = "the student",
                 compute_dtype: torch.dtype = torch.float32) -> None:
        self.head, self.kd, self.vocab_size, self.model_name = head, kd, vocab_size, model_name
        self.compute_dtype = compute_dtype
        self._head_checked = False

    @classmethod
    def of(cls, model: torch.nn.Module, config, setup, pipeline, vocab_size: int) -> FusedHead | None:
        """The fused head of a laid-out student (its pipeline, or None) where it applies, else None. A pipeline's
        stages before the last have no output layer, so none; its last stage is then told to hand its last hidden
        states (`StudentPipeline.hands_hidden_states`)."""
        # Under DDP, the wrapped model; pipelined, this stage's.
        causal_lm = pipeline.causal_lm if pipeline is not None else getattr(model, "module", model)
        head = causal_lm.get_output_embeddings() if hasattr(causal_lm, "get_output_embeddings") else None
        transforms = any(getattr(where, key, None) is not None for key in LOGIT_TRANSFORMS
                         for where in (causal_lm.config, causal_lm))
        if not config.kd.fused_output_loss or transforms or not isinstance(head, torch.nn.Linear):
            return None
        if pipeline is not None:
            pipeline.hands_hidden_states = True
        return cls(head, kd=config.kd, vocab_size=vocab_size, model_name=type(causal_lm).__name__,
                   compute_dtype=resolve_dtype(config.model.dtype))

    def hidden_states(self, model: torch.nn.Module, pipeline, micro_batch: dict) -> torch.Tensor:
        """[rows, sequence, hidden]: the student's last hidden states of a micro-batch, what its output layer takes
        (a pipelined student's: its last stage's forward, `StudentPipeline.forward`).

        Raises:
            ConfigError: at the first call, the model changes its logits after its output layer."""
        if pipeline is not None:
            return pipeline.forward(micro_batch)
        try:
            hidden = last_hidden_states(model, check_head=not self._head_checked,
                                        input_ids=micro_batch["input_ids"], position_ids=micro_batch["position_ids"],
                                        attention_mask=micro_batch["attention_mask"])
        except HeadTransformError as error:
            raise self.refusal(error) from None
        self._head_checked = True
        return hidden

    def refusal(self, error: HeadTransformError) -> ConfigError:
        """What a run is told when its model changes the logits after the output layer (`last_hidden_states`)."""
        return ConfigError(f"kd.fused_output_loss: {error}, which the fused loss cannot follow; set "
                           "kd.fused_output_loss: false")

    def loss(self, hidden: torch.Tensor, micro_batch: dict, answer: TeacherAnswer | None, context: LossContext, *,
             norm: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(1 - kd_ratio) CE + kd_ratio KD of a micro-batch from its last hidden states `hidden` [rows, sequence,
        hidden] and the output layer's weight, a float32 scalar normalized by `norm` (the step's valid tokens), and
        its ce_loss / kd_loss values with the answer's figures (`chunk_kd_loss`'s, summed over the chunks)."""
        kd = self.kd
        zero = torch.zeros((), dtype=torch.float32, device=hidden.device)
        values = {"ce_loss": zero, "kd_loss": zero}
        with_teacher = answer is not None and kd.kd_ratio > 0
        reverse = with_teacher and answer.chunks_reversed
        if with_teacher:
            answer.check_indices(context, self.vocab_size)
        if reverse:  # a cross-tokenizer teacher's groups read their earlier positions' labels: known first
            answer.prepare_chunks(self._label_log_probs(hidden, micro_batch), micro_batch, context)
        flat_labels = micro_batch["labels"].reshape(-1)

        def objective(logits: torch.Tensor, tokens: slice) -> torch.Tensor:
            ce = kd_term = None
            if kd.kd_ratio < 1:
                ce = cross_entropy_loss(logits, flat_labels[tokens], ignore_index=kd.ignore_index,
                                        num_valid_tokens=norm, chunk_size=logits.shape[0])
                values["ce_loss"] = values["ce_loss"] + ce.detach()
            if with_teacher:
                student = logits if logits.shape[-1] == self.vocab_size else logits[:, : self.vocab_size]
                kd_term, figures = answer.chunk_kd_loss(student, tokens, micro_batch, context, norm=norm)
                for key, value in {"kd_loss": kd_term, **figures}.items():
                    values[key] = values[key] + value.detach() if key in values else value.detach()
            return kd_objective(ce, kd_term, kd.kd_ratio)

        return self._fused(hidden, objective, reverse=reverse), values

    def evaluate(self, hidden: torch.Tensor, on_chunk: Callable[[torch.Tensor, slice], None]) -> None:
        """Hand each chunk's logits [c, vocab] (float32) of the last hidden states `hidden` and its slice of the
        flattened positions to `on_chunk`, without gradients."""
        def objective(logits: torch.Tensor, tokens: slice) -> torch.Tensor:
            on_chunk(logits, tokens)
            return zero

        zero = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.no_grad():
            self._fused(hidden.detach(), objective)

    def _fused(self, hidden: torch.Tensor, objective, *, reverse: bool = False) -> torch.Tensor:
        return fused_output_loss(hidden, self.head.weight, objective, bias=self.head.bias,
                                 chunk_size=self.kd.chunk_size or DEFAULT_CHUNK, compute_dtype=self.compute_dtype,
                                 reverse=reverse)

    def _label_log_probs(self, hidden: torch.Tensor, micro_batch: dict) -> torch.Tensor:
        """Each flattened position's log-probability of its label at `kd.temperature` (0 where it has none), chunk
        by chunk, without gradients."""
        labels = micro_batch["labels"].reshape(-1)
        found = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device)

        def on_chunk(logits: torch.Tensor, tokens: slice) -> None:
            scaled = logits[:, : self.vocab_size] / self.kd.temperature
            picked = scaled.gather(-1, labels[tokens].clamp(min=0)[:, None])[:, 0] - scaled.logsumexp(-1)
            found[tokens] = picked.masked_fill(labels[tokens] < 0, 0.0)

        self.evaluate(hidden, on_chunk)
        return found

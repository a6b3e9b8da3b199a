"""Intermediate-layer KD (`kd.hidden_states`): paired decoder layers' outputs, beside the logits answer.

A pair (student layer s, teacher layer t), 0-based, compares the outputs of the two decoder layers: the
residual stream a layer hands the next, before any final norm on either side. `pairs: kept` pairs each layer a
`model.keep_layers` student kept with the teacher layer it came from (`pairs_of`).

- Each side runs its model's own forward; a `LayerTap` keeps its paired layers' outputs (forward hooks on
  the decoder's layers, `meshkd.parallel.stages.decoder_of`) while it is on.
- The teacher sends them in its training answers, stacked [rows, sequence, pairs, width] under
  "hidden_states" (`meshkd.recipe.teacher.teacher_answers.with_hidden_states`): float32 with logits_transport full,
  bfloat16 otherwise; under teacher tp / cp gathered as its logits are, under its pp sent to the last stage
  (`meshkd.recipe.teacher.teacher_worker.TeacherForward.paired_outputs`); cut for the student's cp like the logits.
  The teacher cache stores them with the rest of the answer (its key records the pairs).
- The student's term (`hidden_state_loss`): at the positions logit KD counts, per pair the mean squared
  difference over the width (`mse`) or 1 - the cosine similarity (`cosine`), summed over the positions,
  averaged over the pairs and divided by the step's valid tokens; the objective adds `weight` times it.
  Where the widths differ a learned projection maps the student's width onto the teacher's
  (`HiddenStateProjections`): float32, trained with the student, saved in checkpoints, not exported.
Refused, naming the key: a pipelined student (its schedule computes the loss on the last stage, which holds
only some layers), several teachers, a teacher with another tokenizer (its positions are not the student's).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshkd.core.answers import HIDDEN_STATES
from meshkd.core.batch_keys import kd_labels
from meshkd.parallel.stages import decoder_of, is_pass_through
from meshkd.recipe.settings.kd_checks import pairs_of


def paired_layers(config, side: str) -> list[int]:
    """The `side` ("student" or "teacher") layers of a run's `kd.hidden_states` pairs, in order; [] without."""
    if config.kd.hidden_states is None:
        return []
    return [pair[side == "teacher"] for pair in pairs_of(config.kd.hidden_states, config.model.keep_layers)]


def check_pairs(pairs: list[tuple[int, int]], *, student_layers: int, teacher_layers: int | None) -> None:
    """ValueError naming `kd.hidden_states.pairs` for a layer outside either model's decoder layers (the teacher's
    unchecked when `teacher_layers` is None: a cache's answers hold the pairs its key records)."""
    for side, index, count in (("student", 0, student_layers), ("teacher", 1, teacher_layers)):
        if count is None:
            continue
        outside = [pair for pair in pairs if not 0 <= pair[index] < count]
        if outside:
            raise ValueError(f"kd.hidden_states.pairs {[list(pair) for pair in outside]}: the {side} has {count} "
                             f"decoder layers, [0, {count})")


class LayerTap:
    """Keeps the outputs of some decoder layers of `model` while `on()`; `take()` hands them over in `layers`'
    order (a layer given twice, twice). Off, as in backward's recomputation, it keeps nothing. On a pipeline
    stage only the layers the stage holds are kept (`held`; `take_held`)."""

    def __init__(self, model: nn.Module, layers: list[int]) -> None:
        self.layers = list(layers)
        self._outputs: dict[int, torch.Tensor] = {}
        self._keeping = False
        decoder_layers = decoder_of(model).layers
        self.held = sorted(index for index in set(self.layers) if not is_pass_through(decoder_layers[index]))
        self._handles = [decoder_layers[index].register_forward_hook(functools.partial(self._keep, index))
                         for index in self.held]

    def _keep(self, index: int, module: nn.Module, args, output) -> None:
        if self._keeping:
            self._outputs[index] = output[0] if isinstance(output, tuple) else output

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        self._outputs.clear()
        self._keeping = True
        try:
            yield
        finally:
            self._keeping = False

    def take(self) -> list[torch.Tensor]:
        """The kept outputs [rows, sequence, width] in `layers`' order, whole (a DTensor's full tensor), and
        forget them."""
        held = self.take_held()
        missing = [index for index in self.layers if index not in held]
        if missing:
            raise RuntimeError(f"decoder layers {missing} did not run in this forward")
        return [held[index] for index in self.layers]

    def take_held(self) -> dict[int, torch.Tensor]:
        """The kept outputs of the layers this model holds, by layer, whole; and forget them."""
        outputs, self._outputs = self._outputs, {}
        return {index: output.full_tensor() if isinstance(output, DTensor) else output
                for index, output in outputs.items()}


class HiddenStateProjections(nn.Module):
    """One learned linear map per pair from the student's width to the teacher's; none (the identity) where the
    widths agree. Each starts as the first min(widths) coordinates copied, the rest 0: no seed to keep."""

    def __init__(self, pairs: list[tuple[int, int]], *, student_width: int, teacher_width: int) -> None:
        super().__init__()
        self.maps = nn.ModuleList()
        if student_width != teacher_width:
            for _ in pairs:
                linear = nn.Linear(student_width, teacher_width, bias=False, dtype=torch.float32)
                with torch.no_grad():
                    linear.weight.zero_()
                    linear.weight.diagonal().fill_(1.0)
                self.maps.append(linear)

    def forward(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.maps[index](hidden) if len(self.maps) else hidden


@dataclass
class StudentHiddenStates:
    """The student's side of `kd.hidden_states`: its tap on the paired layers, the term's weight, the projections
    (replicated on every student rank; `reduce_gradients` sums their gradients as the wrappers do the model's)."""

    tap: LayerTap
    weight: float
    projections: HiddenStateProjections | None = None

    def parameters(self) -> list[nn.Parameter]:
        return list(self.projections.parameters()) if self.projections is not None else []

    def loss(self, student: list[torch.Tensor], answer, micro_batch: dict, kd, *, norm: float) -> torch.Tensor:
        """`kd.hidden_states`' term of a micro-batch: the student's outputs of the paired layers against the
        teacher's that its training answer carries beside its distribution ("hidden_states"), at the positions logit
        KD counts (`hidden_state_loss`).

        Raises:
            ValueError: the answer holds no hidden states (a teacher cache written without kd.hidden_states)."""
        if not isinstance(answer.wire.get(HIDDEN_STATES), torch.Tensor):
            raise ValueError("kd.hidden_states: the teacher's answer holds no hidden states (a teacher cache written "
                             "without kd.hidden_states?)")
        counted = kd_labels(micro_batch, kd.ignore_index) != kd.ignore_index
        return hidden_state_loss(student, answer.wire[HIDDEN_STATES], counted, loss=kd.hidden_states.loss, norm=norm,
                                 projections=self.projections)

    def reduce_gradients(self, groups: list) -> None:
        """Average the projections' gradients over `groups` (the student's dp, then cp), as FSDP2 and DDP average
        the model's: with the loss scaled by their sizes, the sum the step's normalization asks for."""
        for parameter in self.parameters():
            if parameter.grad is None:
                continue
            for group in groups:
                torch.distributed.all_reduce(parameter.grad, group=group)
                parameter.grad.div_(torch.distributed.get_world_size(group))


def hidden_state_loss(student: list[torch.Tensor], teacher: torch.Tensor, counted: torch.Tensor, *, loss: str,
                      norm: float, projections: HiddenStateProjections | None = None) -> torch.Tensor:
    """The hidden-state term of a micro-batch (module docstring), in float32.

    Args:
        student: the student's outputs of the paired layers, each [rows, sequence, student width].
        teacher: the teacher's [rows, sequence, pairs, teacher width].
        counted: bool [rows, sequence], the positions logit KD counts.
        loss: mse or cosine.
        norm: the step's valid tokens.
        projections: the learned maps where the widths differ.
    """
    terms = []
    for index, hidden in enumerate(student):
        ours = hidden.to(torch.promote_types(hidden.dtype, torch.float32))
        if projections is not None:
            ours = projections(index, ours)
        theirs = teacher[:, :, index].to(ours.dtype)
        if ours.shape[-1] != theirs.shape[-1]:
            raise ValueError(f"kd.hidden_states.pairs[{index}]: the student's width {ours.shape[-1]} differs from "
                             f"the teacher's {theirs.shape[-1]} and no projection maps it")
        if loss == "mse":
            per_position = (ours - theirs).pow(2).mean(-1)
        else:
            per_position = 1 - nn.functional.cosine_similarity(ours, theirs, dim=-1)
        # Masked by multiplying, not by indexing: a boolean index would wait for the device to count its entries.
        terms.append((per_position * counted).sum())
    return torch.stack(terms).mean() / norm

"""What every teacher answer is (`meshkd.recipe.teacher.teacher_answers` lists the kinds): the base type and the
contexts a teacher makes an answer in and a student scores it in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshkd.core.cross_tokenizer_loss import VocabularyMap
from meshkd.core.teacher_protocol import Encoded
from meshkd.core.topology import DistributedSetup
from meshkd.parallel.context_parallel import shard_teacher_logits
from meshkd.recipe.settings.config import KDConfig

Figures = dict[str, torch.Tensor]
Cut = tuple[slice, tuple[int, ...]]
"""Some positions of a micro-batch: a slice of its flattened positions and the positions' shape [rows, sequence]."""


@dataclass
class EncodeContext:
    """What the teacher makes its answer with beside its logits: the objective's settings (`kd`: the top-k
    options, the temperature, the cross-tokenizer loss), the seed of top-k tail samples, the student's
    vocabulary size and, for a projected cross-tokenizer teacher, how its vocabulary maps onto the student's."""

    kd: KDConfig
    seed: int
    vocab_size: int
    vocabulary_map: VocabularyMap | None = None


@dataclass
class LossContext:
    """What every answer's KD loss reads beside the student's logits: the objective's settings (`kd`), GOLD's
    vocabulary pairs, several teachers' normalized weights, and the student's cp size (rows answered are
    counted once over the cp ranks' sum).

    `index_checks`: None, each top-k answer's index values are checked where its loss is computed (a host sync
    each); a list, each top-k answer's check (`AnswerEncoding.index_errors`, a device flag) is appended to it
    instead, for the caller to read with the step's other figures (`meshkd.recipe.student.train_step.TrainStep`)."""

    kd: KDConfig
    vocabulary_map: VocabularyMap | None = None
    teacher_weights: dict[str, float] | None = None
    cp_size: int = 1
    index_checks: list[torch.Tensor] | None = None


class TeacherAnswer:
    """One micro-batch's answer: `wire` is its dict as it travelled."""

    def __init__(self, wire: dict) -> None:
        self.wire = wire

    @classmethod
    def encode(cls, logits: torch.Tensor, batch: dict, transport: str, context: EncodeContext) -> Encoded:
        """The wire dict of this kind of answer to a request for `transport`, made by the teacher from its logits
        [rows, its sequence, vocab] of the request's `batch` (over the common vocabulary with one tokenizer,
        its own with `kd.cross_tokenizer`)."""
        raise NotImplementedError(f"{cls.__name__} is not made by one teacher")

    @property
    def wait_s(self) -> dict[str, float]:
        """Seconds each teacher of several was waited for, by name (none for one teacher's answer)."""
        return {}

    def shard(self, setup: DistributedSetup) -> TeacherAnswer:
        """This cp rank's share: every tensor of the answer is [rows, sequence, ...], cut along the sequence
        like the student's batch (`shard_teacher_logits`)."""
        if setup.cp_size == 1:
            return self
        return type(self)({key: shard_teacher_logits(value, setup) if isinstance(value, torch.Tensor)
                           and value.ndim >= 2 else value for key, value in self.wire.items()})

    chunks_reversed = False
    """Whether `chunk_kd_loss` takes the chunks last to first, after `prepare_chunks`."""

    def prepare_chunks(self, label_log_probs: torch.Tensor, micro_batch: dict, context: LossContext) -> None:
        """Before a `chunks_reversed` answer's `chunk_kd_loss`: `label_log_probs` [positions], each flattened
        position's log-probability of its label at `kd.temperature`. Nothing for the others."""

    def kd_loss(self, logits: torch.Tensor, micro_batch: dict, context: LossContext, *,
                norm: float | torch.Tensor) -> tuple[torch.Tensor, Figures]:
        """(the KD term of the micro-batch, summed over its counted positions and divided by `norm`, the
        step's valid tokens; figures for the step's metrics). `logits`: the student's [rows, sequence, vocab]
        over the teacher's vocabulary."""
        raise ValueError(f"a teacher answer of mode {self.wire.get('mode')!r} is no training answer")

    def label_log_probs(self) -> torch.Tensor:
        """[rows, sequence] float32: the teacher's log-probability of each label of its own tokenization, 0 at
        ignored labels (the sum of their negatives is its loss)."""
        raise ValueError(f"a teacher answer of mode {self.wire.get('mode')!r} holds no label log-probabilities")

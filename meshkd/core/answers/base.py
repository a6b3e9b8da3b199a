"""What every teacher answer is, and the registry of its kinds by mode.

A teacher answers a micro-batch with a plain dict on the wire, told apart by its "mode", as the bridge, the
prefetcher, the teacher cache and a served teacher pass it on. Each mode is one `TeacherAnswer` subclass,
registered once under it (`@register`), that makes its wire dict on the teacher's side and reads it on the
student's (`meshkd.core.answers` lists the kinds):

    answer_type(transport, kd).encode(logits, batch, context)   the teacher's logits -> the wire dict
    answer_of(wire)                                       the wire dict -> its type, where the student takes it
    answer.shard(setup)                                   this cp rank's share, cut as the student's batch is
    answer.kd_loss(logits, micro_batch, context, norm=n)  (the KD term, figures for the step's metrics)
    answer.prepare_chunks(...); answer.chunk_kd_loss(logits, tokens, ...)   the same by chunks of positions (the
                                                          fused output layer's), last to first if `chunks_reversed`
    answer.label_log_probs(), answer.kl(...), answer.top1_agreements(...)   an evaluation's figures

What a kind cannot do, its base method refuses with a ValueError naming the mode: every kind has the whole
interface, so no caller asks what an answer has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from meshkd.core.logits import pad_and_shard
from meshkd.core.registry import Registry
from meshkd.core.topology import DistributedSetup, member_mesh

if TYPE_CHECKING:
    from meshkd.core.cross_tokenizer_loss import VocabularyMap

KDConfig = Any
"""The objective's settings, `meshkd.recipe.settings.config.KDConfig` (the recipe's: core reads its fields only)."""

Figures = dict[str, torch.Tensor]
Cut = tuple[slice, tuple[int, ...]]
"""Some positions of a micro-batch: a slice of its flattened positions and the positions' shape [rows, sequence]."""


@dataclass
class EncodeContext:
    """What the teacher makes its answer with beside its logits: the objective's settings (`kd`: the top-k
    options, the temperature, the cross-tokenizer loss), the seed of top-k tail samples, the student's
    vocabulary size, for a projected cross-tokenizer teacher how its vocabulary maps onto the student's, and the
    id of its output layer where answers name it (hidden answers, `meshkd.core.answers.hidden`)."""

    kd: KDConfig
    seed: int
    vocab_size: int
    vocabulary_map: VocabularyMap | None = None
    head_id: str | None = None


@dataclass
class LossContext:
    """What every answer's KD loss reads beside the student's logits: the objective's settings (`kd`), GOLD's
    vocabulary pairs, several teachers' normalized weights, and the student's cp size (rows answered are
    counted once over the cp ranks' sum).

    `index_checks`: None, each top-k answer's index values are checked where its loss is computed (a host sync
    each); a list, each top-k answer's check (`Distribution.index_errors`, a device flag) is appended to it
    instead, for the caller to read with the step's other figures (`meshkd.recipe.student.train_step.TrainStep`)."""

    kd: KDConfig
    vocabulary_map: VocabularyMap | None = None
    teacher_weights: dict[str, float] | None = None
    cp_size: int = 1
    index_checks: list[torch.Tensor] | None = None


class TeacherAnswer:
    """One micro-batch's answer of the kind registered as `name`: `wire` is its dict as it travelled."""

    name: ClassVar[str]
    """The "mode" its wire dicts carry."""
    chunks_reversed: ClassVar[bool] = False
    """Whether `chunk_kd_loss` takes a micro-batch's chunks last to first (after `prepare_chunks`)."""
    reads_hidden: ClassVar[bool] = False
    """Whether `encode` is made from the teacher's last hidden states (its `hidden`) rather than its logits."""

    def __init__(self, wire: dict) -> None:
        self.wire = wire

    @classmethod
    def made_for(cls, transport: str, kd: KDConfig) -> bool:
        """Whether a teacher answers a request for `transport` (`TeacherRequest.logits_transport`) in a run of
        `kd` with this kind (`answer_type` asks every registered kind; none made by a teacher says no)."""
        return False

    @classmethod
    def encode(cls, logits: torch.Tensor | None, batch: dict, context: EncodeContext, *,
               with_label_log_probs: bool = False, hidden: torch.Tensor | None = None) -> dict[str, Any]:
        """The wire dict of this kind of answer, made by the teacher from its logits [rows, its sequence, vocab] of
        the request's `batch` (over the common vocabulary with one tokenizer, its own with `kd.cross_tokenizer`),
        or by a kind that `reads_hidden` from its last hidden states `hidden` [rows, its sequence, H] (its logits
        then only where `with_label_log_probs`: each label's log-probability beside it,
        `TeacherRequest.with_label_log_probs`)."""
        raise ValueError(f"a teacher answer of mode {cls.name!r} is not made by one teacher")

    @property
    def wait_s(self) -> dict[str, float]:
        """Seconds each teacher of several was waited for, by name (none for one teacher's answer)."""
        return {}

    def shard(self, setup: DistributedSetup) -> TeacherAnswer:
        """This cp rank's share: every tensor of the answer is [rows, sequence, ...], cut along the sequence
        like the student's batch (`meshkd.parallel.context_parallel.shard_teacher_logits`)."""
        if setup.cp_size == 1:
            return self
        cp_rank = member_mesh(setup).get_local_rank("cp")
        return type(self)({key: pad_and_shard(value, cp_size=setup.cp_size, cp_rank=cp_rank)
                           if isinstance(value, torch.Tensor) and value.ndim >= 2 else value
                           for key, value in self.wire.items()})

    def check_indices(self, context: LossContext, vocab_size: int) -> None:
        """The check of the answer's vocabulary indices, once a micro-batch: deferred into the step's reduction
        where the step gathers them (`LossContext.index_checks`), else now. Nothing for an answer without."""

    def kd_loss(self, logits: torch.Tensor, micro_batch: dict, context: LossContext, *,
                norm: float | torch.Tensor) -> tuple[torch.Tensor, Figures]:
        """(the KD term of the micro-batch, summed over its counted positions and divided by `norm`, the
        step's valid tokens; figures for the step's metrics). `logits`: the student's [rows, sequence, vocab]
        over the teacher's vocabulary."""
        raise ValueError(f"a teacher answer of mode {self.name!r} is no training answer")

    def prepare_chunks(self, label_log_probs: torch.Tensor, micro_batch: dict, context: LossContext) -> None:
        """Before the micro-batch's `chunk_kd_loss`, for a kind whose chunks need what earlier positions hold
        (`chunks_reversed`): `label_log_probs` [positions], each flattened position's log-probability of its
        label at `kd.temperature`. Nothing to prepare otherwise."""

    def chunk_kd_loss(self, logits: torch.Tensor, tokens: slice, micro_batch: dict, context: LossContext, *,
                      norm: float | torch.Tensor) -> tuple[torch.Tensor, Figures]:
        """`kd_loss`' share of the flattened positions `tokens`, given their logits [c, vocab], and its figures'
        shares: the chunks' add up to them (`meshkd.recipe.student.fused_head`)."""
        raise ValueError(f"a teacher answer of mode {self.name!r} has no loss by chunks of positions")

    def label_log_probs(self) -> torch.Tensor:
        """[rows, sequence] float32: the teacher's log-probability of each label of its own tokenization, 0 at
        ignored labels (the sum of their negatives is its loss)."""
        raise ValueError(f"a teacher answer of mode {self.name!r} holds no label log-probabilities")

    def kl(self, logits: torch.Tensor, labels: torch.Tensor, kd: KDConfig, cut: Cut | None = None) -> torch.Tensor:
        """float64: the forward KL(teacher || student) summed over the valid `labels`' positions."""
        raise ValueError(f"a teacher answer of mode {self.name!r} holds no distribution over the student's vocabulary")

    def top1_agreements(self, logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int,
                        cut: Cut | None = None) -> torch.Tensor:
        """The number of valid labels where the student's likeliest token is the teacher's."""
        raise ValueError(f"a teacher answer of mode {self.name!r} holds no distribution over the student's vocabulary")


def merged_rows(wires: dict[str, dict], rows: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One wire dict for a whole micro-batch from each routed teacher's wire dict for its rows (`rows`: name -> bool
    [rows]): every tensor field [rows, ...] put back at its rows (a floating one as float32, zeros where no teacher
    answered), the other fields as the first teacher's.

    Raises:
        ValueError: a teacher answered other than the rows routed to it.
    """
    for name, wire in wires.items():
        answered = next(value.shape[0] for value in wire.values() if isinstance(value, torch.Tensor))
        if answered != int(rows[name].sum()):
            raise ValueError(f"teacher {name!r} answered {answered} rows, not the {int(rows[name].sum())} routed to it")
    total = next(iter(rows.values())).shape[0]
    merged = {}
    for key, value in next(iter(wires.values())).items():
        if not isinstance(value, torch.Tensor):
            merged[key] = value
            continue
        dtype = torch.float32 if value.is_floating_point() else value.dtype
        merged[key] = value.new_zeros((total, *value.shape[1:]), dtype=dtype)
        for name, wire in wires.items():
            merged[key][rows[name]] = wire[key].to(dtype)
    return merged


ANSWERS: Registry[type[TeacherAnswer]] = Registry(
    "teacher answer", "a teacher answer of mode {name}: the student knows {known}", classes=True)
"""Every registered kind of answer, by mode (filled as `meshkd.recipe.teacher.teacher_answers` imports)."""
register = ANSWERS.register
"""Class decorator: registers the class under its `name`."""


def answer_type(transport: str, kd: KDConfig) -> type[TeacherAnswer]:
    """The kind of answer a teacher makes for a request asking `transport` in a run of `kd`: the one registered
    kind `made_for` it.

    Raises:
        ValueError: none or several are.
    """
    kinds = [kind for kind in ANSWERS.values() if kind.made_for(transport, kd)]
    if len(kinds) != 1:
        raise ValueError(f"a request for {transport!r} is answered by one kind of answer, got "
                         f"{[kind.name for kind in kinds]} (registered: {', '.join(ANSWERS)})")
    return kinds[0]


def answer_of(wire: dict | None) -> TeacherAnswer | None:
    """The typed answer of a dict from the wire (None: no answer, as on pipeline stages before the last).

    Raises:
        ValueError: for anything but a dict of a registered mode.
    """
    if wire is None:
        return None
    if not isinstance(wire, dict):
        raise ValueError(f"a teacher answer is a dict with a mode, got {type(wire).__name__}")
    return ANSWERS.named(wire.get("mode"))(wire)


__all__ = ["ANSWERS", "Cut", "EncodeContext", "Figures", "LossContext", "TeacherAnswer", "answer_of", "answer_type",
           "merged_rows", "register"]

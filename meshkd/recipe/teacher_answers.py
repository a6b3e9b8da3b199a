"""A teacher's answer to a training micro-batch, as a type: each knows its context-parallel share and its KD loss.

The wire carries plain dicts told apart by their "mode" (`meshkd.core.logits_codec`'s encodings, the group
distributions of `meshkd.recipe.aligned_data`, `meshkd.core.teacher_ensemble`'s combined answer), as the
bridge, the prefetcher and the teacher cache pass them on. `answer_of` reads one into its type where the
student takes it from the feed (`meshkd.recipe.train_step`), and the loss step then asks it, whatever it is:

    answer.shard(setup)                                   this cp rank's share, cut as the student's batch is
    answer.kd_loss(logits, micro_batch, context, norm=n)  (the KD term, figures for the step's metrics)

- `Distribution` ("full", "full_bf16", "topk"): the teacher's distribution over the student's vocabulary at
  every position (a cross-tokenizer teacher's projected onto it: `kd.cross_tokenizer.loss: projection`);
  the divergence of `kd.divergence` at the positions KD counts (`kd_labels`).
- `GroupDistributions` ("groups"): a cross-tokenizer teacher's distribution per aligned group of tokens,
  against the student's groups by `kd.cross_tokenizer.loss` `uld` or `gold`.
- `Ensemble` ("teachers"): several teachers' answers, combined by `kd.combine` (sum, mixture, route), with
  each teacher's own divergence, rows answered and (routed) tokens for the metrics.
A new kind of answer is one class here and one entry in `_TYPES`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshkd.core.cross_tokenizer_loss import VocabularyMap
from meshkd.core.loss import kd_loss_encoded
from meshkd.core.teacher_ensemble import ROUTE, TEACHERS, answered_rows, combined_kd_loss
from meshkd.core.topology import DistributedSetup
from meshkd.parallel.context_parallel import shard_teacher_logits
from meshkd.recipe.aligned_data import GROUPS, group_kd_loss, kd_labels
from meshkd.recipe.config import KDConfig

Figures = dict[str, torch.Tensor]


@dataclass
class LossContext:
    """What every answer's KD loss reads beside the student's logits: the objective's settings (`kd`), GOLD's
    vocabulary pairs, several teachers' normalized weights, and the student's cp size (rows answered are
    counted once over the cp ranks' sum)."""

    kd: KDConfig
    vocabulary_map: VocabularyMap | None = None
    teacher_weights: dict[str, float] | None = None
    cp_size: int = 1


def shard_encoding(encoded: dict | None, setup: DistributedSetup) -> dict | None:
    """This cp rank's share of an answer on the wire: every tensor of an encoding is [rows, sequence, ...],
    cut along the sequence like the student's batch (`shard_teacher_logits`); an ensemble's members alike."""
    if encoded is None or setup.cp_size == 1:
        return encoded
    if encoded.get("mode") == TEACHERS:
        members = encoded["answers"]
        return {**encoded, "answers": {name: shard_encoding(member, setup) for name, member in members.items()}}
    return {key: shard_teacher_logits(value, setup) if isinstance(value, torch.Tensor) and value.ndim >= 2
            else value for key, value in encoded.items()}


class TeacherAnswer:
    """One micro-batch's answer: `wire` is its dict as it travelled."""

    def __init__(self, wire: dict) -> None:
        self.wire = wire

    def shard(self, setup: DistributedSetup) -> TeacherAnswer:
        return answer_of(shard_encoding(self.wire, setup))

    def kd_loss(self, logits: torch.Tensor, micro_batch: dict, context: LossContext, *,
                norm: float) -> tuple[torch.Tensor, Figures]:
        """(the KD term of the micro-batch, summed over its counted positions and divided by `norm`, the
        step's valid tokens; figures for the step's metrics). `logits`: the student's [rows, sequence, vocab]
        over the teacher's vocabulary."""
        raise NotImplementedError


class Distribution(TeacherAnswer):
    """The teacher's distribution at every position: full logits, bfloat16 logits or top-k with its tail."""

    def divergence(self, logits: torch.Tensor, micro_batch: dict, context: LossContext, *, norm: float,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """`kd.divergence` at the positions KD counts; `rows`: a bool [rows] mask, the others do not count (no
        indexing of a sharded vocabulary)."""
        kd = context.kd
        counted = kd_labels(micro_batch, kd.ignore_index)
        # chunk_size None: the micro-batch as one chunk, through the same kernel as chunks (the loss module's
        # autograd formula, its reference, makes more passes over the [tokens, vocab] logits).
        if rows is not None:
            counted = counted.masked_fill(~rows[:, None], kd.ignore_index)
        return kd_loss_encoded(logits, self.wire, counted, temperature=kd.temperature, ignore_index=kd.ignore_index,
                               num_valid_tokens=norm, chunk_size=kd.chunk_size or max(micro_batch["labels"].numel(), 1),
                               divergence=kd.divergence, jsd_beta=kd.jsd_beta)

    def kd_loss(self, logits, micro_batch, context, *, norm):
        return self.divergence(logits, micro_batch, context, norm=norm), {}

    def top_tokens(self) -> torch.Tensor:
        """[rows, sequence] the teacher's most likely token at each position (the evaluation's top-1 agreement)."""
        return self.wire["indices"][..., 0] if self.wire["mode"] == "topk" else self.wire["logits"].argmax(-1)


class GroupDistributions(TeacherAnswer):
    """A cross-tokenizer teacher's distribution per aligned group ("log_probs" [groups, teacher vocab])."""

    def kd_loss(self, logits, micro_batch, context, *, norm):
        return group_kd_loss(logits, micro_batch, self.wire["log_probs"], context.kd, num_valid_tokens=norm,
                             vocabulary_map=context.vocabulary_map), {}


class Ensemble(TeacherAnswer):
    """Several teachers' answers ("answers": name -> answer on the wire, "wait_s": name -> seconds waited)."""

    @property
    def wait_s(self) -> dict[str, float]:
        return self.wire.get("wait_s", {})

    def kd_loss(self, logits, micro_batch, context, *, norm):
        kd = context.kd
        routes = micro_batch[ROUTE][:, 0] if kd.combine == "route" else None

        def divergence(encoded: dict, rows: torch.Tensor | None = None) -> torch.Tensor:
            return Distribution(encoded).divergence(logits, micro_batch, context, norm=norm, rows=rows)

        loss, each_teacher = combined_kd_loss(self.wire, divergence, weights=context.teacher_weights,
                                              combine=kd.combine, temperature=kd.temperature, routes=routes)
        answers = self.wire["answers"]
        figures = {f"kd_loss/{name}": value for name, value in each_teacher.items()}
        # The rows each teacher answered (its own only when routed), counted once over the cp ranks' sum.
        figures.update({f"teacher_rows/{name}": torch.tensor(answered_rows(member) / context.cp_size,
                                                             device=logits.device)
                        for name, member in answers.items()})
        if routes is not None:  # each teacher's tokens: the step turns its share into its own mean
            counted = kd_labels(micro_batch, kd.ignore_index) != kd.ignore_index
            figures.update({f"kd_tokens/{name}": (counted & (routes == index)[:, None]).sum()
                            for index, name in enumerate(answers)})
        return loss, figures


_TYPES: dict[str, type[TeacherAnswer]] = {"full": Distribution, "full_bf16": Distribution, "topk": Distribution,
                                          GROUPS: GroupDistributions, TEACHERS: Ensemble}


def answer_of(wire: dict | None) -> TeacherAnswer | None:
    """The typed answer of a dict from the wire (None: no answer, as on pipeline stages before the last).

    Raises:
        ValueError: for a dict of no known mode.
    """
    if wire is None:
        return None
    mode = wire.get("mode") if isinstance(wire, dict) else type(wire).__name__
    if mode not in _TYPES:
        raise ValueError(f"a teacher answer of mode {mode!r}: the student knows {sorted(_TYPES)}")
    return _TYPES[mode](wire)

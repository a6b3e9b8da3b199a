"""Several teachers' answers to one micro-batch, "teachers" (made by `meshkd.core.teacher_ensemble.TeacherEnsemble`),
combined by the combination `kd.combine` names (`meshkd.core.combinations`: sum, mixture of the distributions,
`Distribution.mixture`, or route, each row to its own teacher, the answers put back together by
`Distribution.merged`), with weights w normalized to sum to 1. Two identical teachers give the one-teacher
objective by sum or mixture, and a weight of 0 drops a teacher."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from meshkd.core.answers.base import Figures, LossContext, TeacherAnswer, answer_of, register
from meshkd.core.answers.distribution import Distribution
from meshkd.core.answers.labels import LabelLogProbs
from meshkd.core.batch_keys import kd_labels
from meshkd.core.combinations import combination_named
from meshkd.core.teacher_ensemble import ROUTE, TEACHERS


@register
class Ensemble(TeacherAnswer):
    """Several teachers' answers ("answers": name -> answer on the wire, "wait_s": name -> seconds waited)."""

    name = TEACHERS

    @functools.cached_property
    def members(self) -> dict[str, Distribution | LabelLogProbs]:
        """Each teacher's answer, by name, in the ensemble's order (distributions, or with `kd.divergence:
        sampled_reverse_kl` each label's log-probability: what `divergence` and `merged` read alike)."""
        return {name: answer_of(member) for name, member in self.wire["answers"].items()}

    @property
    def wait_s(self) -> dict[str, float]:
        return self.wire.get("wait_s", {})

    def shard(self, setup):
        if setup.cp_size == 1:
            return self
        return Ensemble({**self.wire, "answers": {name: member.shard(setup).wire
                                                 for name, member in self.members.items()}})

    def check_indices(self, context: LossContext, vocab_size: int) -> None:
        """Each member's (`Distribution.check_indices`)."""
        for member in self.members.values():
            member.check_indices(context, vocab_size)

    def kd_loss(self, logits, micro_batch, context, *, norm):
        """The KD term by `kd.combine` (module docstring); figures: each teacher's own divergence (detached;
        with "mixture" computed for the metrics only), the rows it answered and, routed, its tokens."""
        self.check_indices(context, logits.shape[-1])
        return self._combined(lambda answer, rows=None: answer.divergence(logits, micro_batch, context, norm=norm,
                                                                          rows=rows), micro_batch, context,
                              device=logits.device)

    def chunk_kd_loss(self, logits, tokens, micro_batch, context, *, norm):
        """`kd_loss`' share of the flattened positions `tokens` (`Distribution.chunk_kd_loss`); the rows each
        teacher answered are counted with the micro-batch's first chunk."""
        return self._combined(lambda answer, rows=None: answer.chunk_divergence(logits, tokens, micro_batch, context,
                                                                                norm=norm, rows=rows),
                              micro_batch, context, device=logits.device, tokens=tokens)

    def _combined(self, divergence: Callable[..., torch.Tensor], micro_batch: dict, context: LossContext, *,
                  device: torch.device, tokens: slice | None = None) -> tuple[torch.Tensor, Figures]:
        """`kd.combine` of the members' `divergence(answer, rows=None)` (of the whole micro-batch, or of the
        positions `tokens`), and the figures."""
        kd, weights, members = context.kd, context.teacher_weights, self.members
        combination = combination_named(kd.combine)
        routes = micro_batch[ROUTE][:, 0] if combination.routes_rows else None
        if "_combined_answer" not in self.__dict__:  # made once for the micro-batch whatever the chunks asking
            self._combined_answer = combination.combined(members, weights, routes=routes, temperature=kd.temperature)
        loss, each = combination.loss(members, self._combined_answer, divergence, weights)
        figures = {f"kd_loss/{name}": value.detach() for name, value in each.items()}
        if tokens is None or tokens.start == 0:
            # The rows each teacher answered (its own only when routed), counted once over the cp ranks' sum.
            figures.update({f"teacher_rows/{name}": torch.tensor(member.rows / context.cp_size, device=device)
                            for name, member in members.items()})
        if routes is not None:  # each teacher's tokens: the step turns its share into its own mean
            counted = kd_labels(micro_batch, kd.ignore_index) != kd.ignore_index
            figures.update({f"kd_tokens/{name}": (counted & (routes == index)[:, None]).reshape(-1)[
                tokens if tokens is not None else slice(None)].sum() for index, name in enumerate(members)})
        return loss, figures

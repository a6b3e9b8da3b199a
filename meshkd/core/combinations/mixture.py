"""`mixture`: D(sum_i w_i p_i || student), against the mixture of the teachers' distributions at the temperature
(whole-distribution answers only: `full` or `full_bf16`)."""

from __future__ import annotations

import torch

from meshkd.core.combinations.base import Combination, answer_type, register
from meshkd.core.encodings import choices


@register
class Mixture(Combination):
    name = "mixture"

    def check(self, config):
        whole = choices("logits_transport", whole_distribution=True)
        for teacher in config.teachers:
            transport = teacher.logits_transport or config.kd.logits_transport
            if transport not in whole:
                raise ValueError(f"kd.combine mixture mixes the teachers' whole distributions: "
                                 f"teachers.{teacher.name}.logits_transport (or kd.logits_transport) must be "
                                 f"{' or '.join(whole)}, got {transport!r}")

    def combined(self, members, weights, *, routes, temperature):
        return answer_type(members).mixture(members, weights, temperature=temperature)

    def loss(self, members, combined, divergence, weights):
        with torch.no_grad():  # each teacher's own divergence, for the metrics only
            each = {name: divergence(member) for name, member in members.items()}
        return divergence(combined), each

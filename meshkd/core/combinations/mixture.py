"""`mixture`: D(sum_i w_i p_i || student), against the mixture of the teachers' distributions at the temperature
(whole-distribution answers only: `full` or `full_bf16`)."""

from __future__ import annotations

import torch

from meshkd.core.combinations.base import Combination, answer_type, register


@register
class Mixture(Combination):
    name = "mixture"
    whole_distributions = True

    def combined(self, members, weights, *, routes, temperature):
        return answer_type(members).mixture(members, weights, temperature=temperature)

    def loss(self, members, combined, divergence, weights):
        with torch.no_grad():  # each teacher's own divergence, for the metrics only
            each = {name: divergence(member) for name, member in members.items()}
        return divergence(combined), each

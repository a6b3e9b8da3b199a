"""`sum`: sum_i w_i D(teacher_i || student), each divergence on its own answer, any transport."""

from __future__ import annotations

from meshkd.core.combinations.base import Combination, register


@register
class WeightedSum(Combination):
    name = "sum"

    def loss(self, members, combined, divergence, weights):
        each = {name: divergence(member) for name, member in members.items()}
        return sum(weights[name] * value for name, value in each.items()), each

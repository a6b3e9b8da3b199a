"""Combinations of several teachers' answers into the KD term (`kd.combine`): a registry (`base`), one module
each: `weighted_sum` (sum), `mixture`, `route`."""

from meshkd.core.combinations import mixture, route, weighted_sum  # noqa: F401  (each registers its combination)
from meshkd.core.combinations.base import COMBINATIONS, Combination, combination_named, register

__all__ = ["COMBINATIONS", "Combination", "combination_named", "register"]

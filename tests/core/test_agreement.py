"""Agreement across ranks on a real 3-rank gloo world: every rank learns the same values and the same failure."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshkd.core.agreement import first_failure, gather_values
from tests.world import world_test


def check_every_rank_gathers_every_value_in_rank_order():
    rank = dist.get_rank()
    value = {"rank": rank, "layouts": ["neat"] * rank, "error": None if rank != 1 else "x" * (100 * rank)}
    gathered = gather_values(value)
    assert [g["rank"] for g in gathered] == [0, 1, 2]
    assert gathered[2]["layouts"] == ["neat", "neat"] and gathered[1]["error"] == "x" * 100
    pair = dist.new_group([1, 2])
    if rank in (1, 2):
        assert gather_values(("only", rank), pair) == [("only", 1), ("only", 2)]


def check_values_holding_tensors_are_refused_before_any_collective():
    with pytest.raises(TypeError, match="not tensors"):
        gather_values({"x": torch.zeros(1)})
    with pytest.raises(TypeError, match="cannot send a value of type object"):
        gather_values({"x": object()})


def check_the_lowest_failing_rank_is_reported_to_every_rank():
    rank = dist.get_rank()
    assert first_failure(None) is None
    message = f"rank {rank} failed" if rank >= 1 else None
    assert first_failure(message) == (1, "rank 1 failed")
    long = "é" * 5000 if rank == 2 else None
    origin, text = first_failure(long)
    assert origin == 2 and text.startswith("ééé") and len(text.encode()) <= 2048


test_three_rank_world = world_test(
    3,
    [
        check_every_rank_gathers_every_value_in_rank_order,
        check_values_holding_tensors_are_refused_before_any_collective,
        check_the_lowest_failing_rank_is_reported_to_every_rank,
    ],
)

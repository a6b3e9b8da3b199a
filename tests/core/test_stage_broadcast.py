"""Tests for meshkd.pipeline_parallel: pure checks of the payload materialization, then one 4-rank gloo world.

The world builds its groups once (`check_build_groups`): pipeline pairs [0, 2] and [1, 3] (explicit
groups, and the same pairs from a registered pp_size=2 setup for the pp_group=None default), the whole
world as one 4-stage pipeline (explicit and from a pp_size=4 setup), and one 1-rank group per rank. Every
error check asserts the error on every rank and then runs a collective on the pipeline group and on the
world, which would hang (and time out) if the error had left a peer blocked.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshkd.core import topology
from meshkd.core.stage_broadcast import (
    LossMetricPayload,
    LossMetricPayloadT,
    _materialize_loss_metrics_for_object_broadcast,
    broadcast_loss_metrics_from_last_stage,
    broadcast_obj_from_pp_rank,
    broadcast_tensors_from_last_stage,
)
from tests.world import world_test

WORLD_SIZE = 4

# ----------------------------------------------------------------------------------------------------
# Pure tests (no process group)
# ----------------------------------------------------------------------------------------------------


def test_type_alias_and_typevar():
    assert LossMetricPayloadT.__bound__ == LossMetricPayload


def test_materialize_dict_converts_scalars_and_copies_tensors():
    hist = torch.arange(4.0, requires_grad=True) * 2
    metrics = {
        "loss": torch.tensor(1.5, requires_grad=True),
        "grad_norm": torch.tensor([2.25], dtype=torch.float64),
        "count": torch.tensor([[7]]),
        "flag": torch.tensor(True),
        "bf16": torch.tensor(0.5, dtype=torch.bfloat16),
        "hist": hist,
        "empty": torch.zeros(0),
        "name": "kd",
        "steps": 3,
        "nested": [1, 2],
    }
    result = _materialize_loss_metrics_for_object_broadcast(metrics)
    assert result is not metrics
    assert list(result) == list(metrics)
    assert result["loss"] == 1.5 and type(result["loss"]) is float
    assert result["grad_norm"] == 2.25 and type(result["grad_norm"]) is float
    assert result["count"] == 7.0 and type(result["count"]) is float
    assert result["flag"] == 1.0 and type(result["flag"]) is float
    assert result["bf16"] == 0.5 and type(result["bf16"]) is float
    assert isinstance(result["hist"], torch.Tensor) and not result["hist"].requires_grad
    assert result["hist"].device.type == "cpu"
    torch.testing.assert_close(result["hist"], torch.tensor([0.0, 2.0, 4.0, 6.0]))
    assert result["empty"].shape == (0,)
    assert result["name"] == "kd" and result["steps"] == 3 and result["nested"] is metrics["nested"]
    # The input is left alone.
    assert isinstance(metrics["loss"], torch.Tensor)


def test_materialize_list_of_dicts():
    payload = [{"loss": torch.tensor(1.0)}, {"loss": torch.tensor(2.0), "tokens": 10}, {}]
    result = _materialize_loss_metrics_for_object_broadcast(payload)
    assert result == [{"loss": 1.0}, {"loss": 2.0, "tokens": 10}, {}]
    assert result is not payload and all(new is not old for new, old in zip(result, payload))
    assert _materialize_loss_metrics_for_object_broadcast([]) == []


def test_materialize_stacks_once_per_device_dtype_group(monkeypatch):
    stacked = []
    real_stack = torch.stack

    def counting_stack(tensors, *args, **kwargs):
        stacked.append(len(tensors))
        return real_stack(tensors, *args, **kwargs)

    def no_item(self):
        raise AssertionError("scalar metrics must not be read one .item() at a time")

    monkeypatch.setattr(torch, "stack", counting_stack)
    monkeypatch.setattr(torch.Tensor, "item", no_item)
    payload = [
        {"a": torch.tensor(1.0), "b": torch.tensor(2.0), "c": torch.tensor(3, dtype=torch.int64)},
        {"a": torch.tensor(4.0), "d": torch.tensor(5.0, dtype=torch.float64), "e": torch.ones(3)},
    ]
    result = _materialize_loss_metrics_for_object_broadcast(payload)
    assert sorted(stacked) == [1, 1, 3]  # float32 x3, int64 x1, float64 x1
    assert result[0] == {"a": 1.0, "b": 2.0, "c": 3.0}
    assert result[1]["a"] == 4.0 and result[1]["d"] == 5.0


@pytest.mark.parametrize("payload", [None, (1, 2), "loss", 3.0, [{"a": 1}, 2], [[{"a": 1}]]])
def test_materialize_rejects_other_payloads(payload):
    with pytest.raises(ValueError, match="loss_metrics"):
        _materialize_loss_metrics_for_object_broadcast(payload)


@pytest.mark.parametrize(
    "call",
    [
        lambda: broadcast_obj_from_pp_rank(1),
        lambda: broadcast_loss_metrics_from_last_stage({"loss": 1.0}),
        lambda: broadcast_tensors_from_last_stage({"x": torch.ones(1)}),
    ],
)
def test_without_setup_or_group_raises_runtime_error(call, monkeypatch):
    monkeypatch.setattr(topology, "_current_setup", None)
    with pytest.raises(RuntimeError, match="set_current_setup.*pp_group"):
        call()
    # A registered setup that was never built (or that the rank is not in) has no pipeline group either.
    monkeypatch.setattr(topology, "_current_setup", topology.DistributedSetup(ranks=(0,)))
    with pytest.raises(RuntimeError, match="set_current_setup.*pp_group"):
        call()


# ----------------------------------------------------------------------------------------------------
# The 4-rank world
# ----------------------------------------------------------------------------------------------------

_GROUPS: dict = {}


def _rank() -> int:
    return dist.get_rank()


def _pair_last() -> int:
    """Global rank of the last stage of this rank's pair ([0, 2] or [1, 3])."""
    return 2 + _rank() % 2


def _assert_world_usable(group: dist.ProcessGroup | None) -> None:
    """A collective on `group` and on the world completes: no peer was left inside an earlier collective."""
    for each in (group, None):
        value = torch.ones(1)
        dist.all_reduce(value, group=each)
        assert value.item() == dist.get_world_size(each)


def _expect_everywhere(call, *, last_error, other_error=None, match=None, group, is_last):
    """Assert `call` raises on this rank (last_error on the last stage, other_error elsewhere)."""
    error_type = last_error if is_last or other_error is None else other_error
    with pytest.raises(error_type, match=match):
        call()
    _assert_world_usable(group)


def _tensors_for(seed: int) -> dict[str, torch.Tensor]:
    """The same tensors on every rank that asks with the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(2, 3, generator=gen),
        "bf16": torch.randn(4, generator=gen).to(torch.bfloat16),
        "bool": torch.rand(3, 2, generator=gen) > 0.5,
        "i64": torch.randint(-(2**40), 2**40, (5,), generator=gen),
        "scalar": torch.tensor(float(seed) + 0.25),
        "f16": torch.randn(1, 1, 3, generator=gen).half(),
        "empty": torch.zeros(0, 4, dtype=torch.int32),
        "transposed": torch.randn(3, 4, generator=gen).t(),
    }


def check_build_groups():
    # new_group is collective over the world: every rank creates every group, in the same order.
    for ranks in ([0, 2], [1, 3]):
        group = dist.new_group(ranks)
        if _rank() in ranks:
            _GROUPS["pair"] = group
    for rank in range(WORLD_SIZE):
        group = dist.new_group([rank])
        if rank == _rank():
            _GROUPS["single"] = group
    _GROUPS["all"] = dist.new_group(list(range(WORLD_SIZE)))
    _GROUPS["pp4"] = topology.create_kd_distributed_setups({"distributed": {"pp_size": 4}}, WORLD_SIZE).local
    _GROUPS["pp2"] = topology.create_kd_distributed_setups({"distributed": {"pp_size": 2}}, WORLD_SIZE).local
    _GROUPS["pp1"] = topology.create_kd_distributed_setups({"distributed": {"pp_size": 1}}, WORLD_SIZE).local
    topology.set_current_setup(_GROUPS["pp2"])
    assert topology.get_current_setup().pp_group is not None
    assert dist.get_process_group_ranks(_GROUPS["pp2"].pp_group) == [_rank() % 2, _rank() % 2 + 2]


# -- broadcast_obj_from_pp_rank ------------------------------------------------------------------------


def check_obj_from_middle_stage():
    group = _GROUPS["all"]
    payload = {"step": 5, "ids": torch.arange(3), "text": "hello"}
    obj = payload if _rank() == 1 else None
    result = broadcast_obj_from_pp_rank(obj, pp_group=group)
    if _rank() == 1:
        assert result is payload
    assert result["step"] == 5 and result["text"] == "hello"
    assert torch.equal(result["ids"], torch.arange(3))


def check_obj_default_group_and_keyword():
    # Registered pp_size=2 setup: pipelines [0, 2] and [1, 3]; the first stage of each owns the object.
    obj = ("from", _rank()) if _rank() < 2 else None
    result = broadcast_obj_from_pp_rank(obj=obj)
    assert result == ("from", _rank() % 2)


def check_obj_last_stage_owner_explicit_pair():
    obj = [_rank(), "x" * 1000] if _rank() >= 2 else None
    assert broadcast_obj_from_pp_rank(obj, pp_group=_GROUPS["pair"]) == [_pair_last(), "x" * 1000]


def check_obj_single_stage():
    payload = object()
    assert broadcast_obj_from_pp_rank(payload, pp_group=_GROUPS["single"]) is payload
    with pytest.raises(ValueError, match="only pipeline stage"):
        broadcast_obj_from_pp_rank(None, pp_group=_GROUPS["single"])
    # pp_size=1 setup registered as the default.
    topology.set_current_setup(_GROUPS["pp1"])
    try:
        assert broadcast_obj_from_pp_rank(payload) is payload
    finally:
        topology.set_current_setup(_GROUPS["pp2"])


def check_obj_no_owner_raises_everywhere():
    group = _GROUPS["all"]
    _expect_everywhere(
        lambda: broadcast_obj_from_pp_rank(None, pp_group=group),
        last_error=ValueError,
        match="every pipeline stage",
        group=group,
        is_last=True,
    )


def check_obj_two_owners_raise_everywhere():
    group = _GROUPS["all"]
    obj = "mine" if _rank() in (0, 3) else None
    _expect_everywhere(
        lambda: broadcast_obj_from_pp_rank(obj, pp_group=group),
        last_error=ValueError,
        match=r"global ranks \[0, 3\]",
        group=group,
        is_last=True,
    )


def check_obj_unpicklable_raises_everywhere():
    group = _GROUPS["all"]
    obj = (lambda: None) if _rank() == 2 else None
    _expect_everywhere(
        lambda: broadcast_obj_from_pp_rank(obj, pp_group=group),
        last_error=ValueError,
        other_error=RuntimeError,
        match="pickle",
        group=group,
        is_last=_rank() == 2,
    )


# -- broadcast_loss_metrics_from_last_stage --------------------------------------------------------------


def check_loss_metrics_dict():
    group = _GROUPS["all"]
    is_last = _rank() == 3
    sent = {
        "loss": torch.tensor(1.5, requires_grad=True) * 1,
        "grad_norm": torch.tensor([2.0], dtype=torch.float64),
        "tokens": torch.tensor(128),
        "hist": torch.arange(4.0),
        "lr": 1e-4,
        "tag": "kd",
    }
    # A non-last stage's argument is ignored.
    mine = sent if is_last else ({"junk": 1} if _rank() == 0 else None)
    result = broadcast_loss_metrics_from_last_stage(mine, pp_group=group)
    assert list(result) == list(sent)
    for key in ("loss", "grad_norm", "tokens"):
        assert type(result[key]) is float
    assert (result["loss"], result["grad_norm"], result["tokens"]) == (1.5, 2.0, 128.0)
    assert isinstance(result["hist"], torch.Tensor) and result["hist"].device.type == "cpu"
    assert torch.equal(result["hist"], torch.arange(4.0))
    assert result["lr"] == 1e-4 and result["tag"] == "kd"
    if is_last:
        assert result is not sent and isinstance(sent["loss"], torch.Tensor)


def check_loss_metrics_list_default_group():
    # pp_size=2 setup: the last stages are global ranks 2 and 3, each sending its own values.
    is_last = _rank() >= 2
    sent = [{"loss": torch.tensor(float(_rank()))}, {"loss": torch.tensor(_rank() + 0.5), "n": 4}]
    result = broadcast_loss_metrics_from_last_stage(sent if is_last else None)
    expected = [{"loss": float(_pair_last())}, {"loss": _pair_last() + 0.5, "n": 4}]
    assert result == expected
    if is_last:
        assert result is not sent and result[0] is not sent[0]


def check_loss_metrics_keyword_pp4_setup():
    topology.set_current_setup(_GROUPS["pp4"])
    try:
        sent = {"loss": torch.tensor(0.75)} if _rank() == 3 else None
        assert broadcast_loss_metrics_from_last_stage(loss_metrics=sent) == {"loss": 0.75}
    finally:
        topology.set_current_setup(_GROUPS["pp2"])


def check_loss_metrics_single_stage():
    sent = {"loss": torch.tensor(2.0)}
    assert broadcast_loss_metrics_from_last_stage(sent, pp_group=_GROUPS["single"]) is sent
    with pytest.raises(ValueError, match="None"):
        broadcast_loss_metrics_from_last_stage(None, pp_group=_GROUPS["single"])
    with pytest.raises(ValueError, match="dict"):
        broadcast_loss_metrics_from_last_stage("loss", pp_group=_GROUPS["single"])
    topology.set_current_setup(_GROUPS["pp1"])
    try:
        assert broadcast_loss_metrics_from_last_stage(sent) is sent
    finally:
        topology.set_current_setup(_GROUPS["pp2"])


def check_loss_metrics_last_stage_none_raises_everywhere():
    group = _GROUPS["all"]
    # Even with a non-last stage passing a payload, only the last stage's counts.
    mine = {"loss": 1.0} if _rank() == 0 else None
    _expect_everywhere(
        lambda: broadcast_loss_metrics_from_last_stage(mine, pp_group=group),
        last_error=ValueError,
        other_error=RuntimeError,
        match="None on the last pipeline stage",
        group=group,
        is_last=_rank() == 3,
    )


def check_loss_metrics_bad_payload_raises_everywhere():
    group = _GROUPS["pair"]
    is_last = _rank() >= 2
    for bad in ((1.0, 2.0), 3.0, [{"loss": 1.0}, "oops"]):
        _expect_everywhere(
            lambda bad=bad: broadcast_loss_metrics_from_last_stage(bad if is_last else None, pp_group=group),
            last_error=ValueError,
            other_error=RuntimeError,
            match="dict",
            group=group,
            is_last=is_last,
        )


def check_loss_metrics_unpicklable_raises_everywhere():
    group = _GROUPS["pair"]
    is_last = _rank() >= 2
    sent = {"loss": torch.tensor(1.0), "fn": lambda: None}
    _expect_everywhere(
        lambda: broadcast_loss_metrics_from_last_stage(sent if is_last else None, pp_group=group),
        last_error=ValueError,
        other_error=RuntimeError,
        match="pickle",
        group=group,
        is_last=is_last,
    )


# -- broadcast_tensors_from_last_stage -----------------------------------------------------------------


def _assert_same_tensors(result: dict, expected: dict) -> None:
    assert list(result) == list(expected)
    for name, tensor in expected.items():
        got = result[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert got.device.type == "cpu"
        assert torch.equal(got, tensor), name


def check_tensors_full_pipeline():
    group = _GROUPS["all"]
    expected = _tensors_for(seed=11)
    if _rank() == 3:
        mine = expected
    elif _rank() == 0:
        mine = None
    else:
        mine = {name: None for name in expected}
    result = broadcast_tensors_from_last_stage(mine, pp_group=group)
    _assert_same_tensors(result, expected)
    assert result["scalar"].dim() == 0
    if _rank() == 3:
        assert result is not expected and all(result[name] is expected[name] for name in expected)


def check_tensors_default_group_and_keyword():
    is_last = _rank() >= 2
    sent = _tensors_for(seed=_rank()) if is_last else {"extra": None}
    result = broadcast_tensors_from_last_stage(tensors=sent)
    _assert_same_tensors(result, _tensors_for(seed=_pair_last()))


def check_tensors_single_stage():
    sent = {"x": torch.ones(2), "y": torch.tensor(3)}
    result = broadcast_tensors_from_last_stage(sent, pp_group=_GROUPS["single"])
    assert result == sent and all(result[name] is sent[name] for name in sent)
    with pytest.raises(ValueError, match="None"):
        broadcast_tensors_from_last_stage({"x": None}, pp_group=_GROUPS["single"])
    topology.set_current_setup(_GROUPS["pp1"])
    try:
        assert broadcast_tensors_from_last_stage(sent)["x"] is sent["x"]
    finally:
        topology.set_current_setup(_GROUPS["pp2"])


def check_tensors_none_value_raises_everywhere():
    group = _GROUPS["all"]
    sent = {"ok": torch.ones(2), "missing": None} if _rank() == 3 else None
    _expect_everywhere(
        lambda: broadcast_tensors_from_last_stage(sent, pp_group=group),
        last_error=ValueError,
        match="missing",
        group=group,
        is_last=True,
    )


def check_tensors_bad_input_raises_everywhere():
    group = _GROUPS["pair"]
    is_last = _rank() >= 2
    bad_inputs = (None, {"x": [1.0, 2.0]}, {0: torch.ones(1)}, {"sparse": torch.eye(2).to_sparse()})
    for bad in bad_inputs:
        _expect_everywhere(
            lambda bad=bad: broadcast_tensors_from_last_stage(bad if is_last else None, pp_group=group),
            last_error=ValueError,
            group=group,
            is_last=True,
        )


def check_world_still_usable_at_end():
    _assert_world_usable(_GROUPS["all"])
    assert broadcast_obj_from_pp_rank("done" if _rank() == 0 else None, pp_group=_GROUPS["all"]) == "done"


WORLD_CHECKS = [
    check_build_groups,
    check_obj_from_middle_stage,
    check_obj_default_group_and_keyword,
    check_obj_last_stage_owner_explicit_pair,
    check_obj_single_stage,
    check_obj_no_owner_raises_everywhere,
    check_obj_two_owners_raise_everywhere,
    check_obj_unpicklable_raises_everywhere,
    check_loss_metrics_dict,
    check_loss_metrics_list_default_group,
    check_loss_metrics_keyword_pp4_setup,
    check_loss_metrics_single_stage,
    check_loss_metrics_last_stage_none_raises_everywhere,
    check_loss_metrics_bad_payload_raises_everywhere,
    check_loss_metrics_unpicklable_raises_everywhere,
    check_tensors_full_pipeline,
    check_tensors_default_group_and_keyword,
    check_tensors_single_stage,
    check_tensors_none_value_raises_everywhere,
    check_tensors_bad_input_raises_everywhere,
    check_world_still_usable_at_end,
]

test_world = world_test(WORLD_SIZE, WORLD_CHECKS, timeout_s=60.0)

"""The documented API: every name of both spec pages exists with its documented parameters."""

import inspect

import pytest

from meshkd import kd_utils, pipeline_parallel

KD_UTILS = {
    "create_kd_distributed_setups": ["cfg", "world_size"],
    "materialize_teacher_logits": ["logits", "device_mesh", "sequence_length"],
    "configure_kd_teacher_packing": ["teacher_parts", "student_parts", "control_group"],
    "_mesh_size": ["distributed_cfg", "label"],
    "_model_replicas": ["setup"],
    "_section_to_dict": ["section"],
    "_tree_spec": ["value", "tensors"],
    "_tree_from_spec": ["spec", "tensors"],
}
BRIDGE_METHODS = {
    "__init__": ["self", "setups", "device"],
    "send_batch": ["self", "wave", "batch"],
    "send_logits": ["self", "wave", "logits"],
    "broadcast_command": ["self", "command"],
    "synchronize": ["self"],
    "move_to_device": ["self", "value"],
    "_broadcast_tree": ["self", "value", "route"],
    "match_student_vocab_shard": ["student_logits", "teacher_logits"],
}
PIPELINE = {
    "broadcast_obj_from_pp_rank": ["obj"],
    "broadcast_loss_metrics_from_last_stage": ["loss_metrics"],
    "broadcast_tensors_from_last_stage": ["tensors"],
    "_materialize_loss_metrics_for_object_broadcast": ["loss_metrics"],
}


def leading_parameters(function, count):
    parameters = list(inspect.signature(function).parameters.values())[:count]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters), parameters
    return [p.name for p in parameters]


@pytest.mark.parametrize("name", KD_UTILS)
def test_kd_utils_functions(name):
    assert leading_parameters(getattr(kd_utils, name), len(KD_UTILS[name])) == KD_UTILS[name]


@pytest.mark.parametrize("name", BRIDGE_METHODS)
def test_bridge_methods(name):
    method = inspect.getattr_static(kd_utils.KDMeshBridge, name)
    function = method.__func__ if isinstance(method, staticmethod) else method
    assert leading_parameters(function, len(BRIDGE_METHODS[name])) == BRIDGE_METHODS[name]


@pytest.mark.parametrize("name", PIPELINE)
def test_pipeline_parallel_functions(name):
    assert leading_parameters(getattr(pipeline_parallel, name), len(PIPELINE[name])) == PIPELINE[name]


def test_data_names_and_dataclasses():
    assert (kd_utils.RUN_TEACHER, kd_utils.STOP_TEACHER) == (1, 0)
    assert list(inspect.signature(kd_utils.KDDistributedSetups).parameters) == [
        "student", "teacher", "student_ranks", "teacher_ranks", "separate"]
    assert list(inspect.signature(kd_utils._Replica).parameters) == ["ranks", "input_rank", "output_rank"]
    assert list(inspect.signature(kd_utils._Route).parameters) == ["src", "ranks", "group"]
    assert hasattr(kd_utils._ConfigLike, "get")
    assert pipeline_parallel.LossMetricPayload is not None and pipeline_parallel.LossMetricPayloadT is not None

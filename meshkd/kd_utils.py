"""Distributed topology and tensor transport helpers for KD recipes.

The documented API (`nemo_automodel.recipes.kd_utils`) on plain PyTorch. Each part lives in the module
of its layer; this module gathers the names:

- topology (`meshkd.topology`): `create_kd_distributed_setups`, `KDDistributedSetups`,
  `DistributedSetup`, `_model_replicas`, `_Replica`, `_mesh_size`, `_section_to_dict`, `_ConfigLike`;
- transport (`meshkd.transport`, `meshkd.wire`): `KDMeshBridge`, `_Route`, `RUN_TEACHER`,
  `STOP_TEACHER`, `_tree_spec`, `_tree_from_spec`;
- logits (`meshkd.logits`): `materialize_teacher_logits`;
- packing (`meshkd.packing`): `configure_kd_teacher_packing`.
"""

from meshkd.logits import materialize_teacher_logits
from meshkd.packing import configure_kd_teacher_packing
from meshkd.topology import (
    DistributedSetup,
    KDDistributedSetups,
    _ConfigLike,
    _mesh_size,
    _model_replicas,
    _Replica,
    _section_to_dict,
    create_kd_distributed_setups,
)
from meshkd.transport import RUN_TEACHER, STOP_TEACHER, KDMeshBridge, _Route
from meshkd.wire import _tree_from_spec, _tree_spec

__all__ = [
    "RUN_TEACHER",
    "STOP_TEACHER",
    "DistributedSetup",
    "KDDistributedSetups",
    "KDMeshBridge",
    "configure_kd_teacher_packing",
    "create_kd_distributed_setups",
    "materialize_teacher_logits",
    "_ConfigLike",
    "_Replica",
    "_Route",
    "_mesh_size",
    "_model_replicas",
    "_section_to_dict",
    "_tree_from_spec",
    "_tree_spec",
]

"""Distributed topology and tensor transport helpers for KD recipes.

The documented API (`nemo_automodel.recipes.kd_utils`) on plain PyTorch. Each part lives in the module
of its layer; this module gathers the documented names, underscore-prefixed ones included:

- topology (`meshkd.core.topology`, `meshkd.core.layouts`): `create_kd_distributed_setups`, `KDDistributedSetups`,
  `DistributedSetup`, `_model_replicas`, `_Replica`, `_mesh_size`, `_section_to_dict`, `_ConfigLike`;
- transport (`meshkd.core.bridge`, `meshkd.core.wire`, `meshkd.core.teacher_protocol`): `KDMeshBridge`,
  `_Route`, `RUN_TEACHER`, `STOP_TEACHER`, `_tree_spec`, `_tree_from_spec`;
- logits (`meshkd.core.logits`): `materialize_teacher_logits`;
- packing (`meshkd.core.packing`): `configure_kd_teacher_packing`.
"""

from meshkd.core.bridge import RUN_TEACHER, STOP_TEACHER, KDMeshBridge
from meshkd.core.bridge import Route as _Route
from meshkd.core.layouts import _ConfigLike, _mesh_size, _section_to_dict
from meshkd.core.logits import materialize_teacher_logits
from meshkd.core.packing import configure_kd_teacher_packing
from meshkd.core.topology import DistributedSetup, KDDistributedSetups, create_kd_distributed_setups
from meshkd.core.topology import Replica as _Replica
from meshkd.core.topology import model_replicas as _model_replicas
from meshkd.core.wire import tree_from_spec as _tree_from_spec
from meshkd.core.wire import tree_spec as _tree_spec

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

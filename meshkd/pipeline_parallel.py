"""Pipeline-parallel helpers (documented API, `nemo_rl.models.megatron.pipeline_parallel` on plain PyTorch).

The implementation lives in `meshkd.core.stage_broadcast`; this module gathers its documented names, the
underscore-prefixed one included.
"""

from meshkd.core.stage_broadcast import (
    LossMetricPayload,
    LossMetricPayloadT,
    _materialize_loss_metrics_for_object_broadcast,
    broadcast_loss_metrics_from_last_stage,
    broadcast_obj_from_pp_rank,
    broadcast_tensors_from_last_stage,
)

__all__ = [
    "LossMetricPayload",
    "LossMetricPayloadT",
    "_materialize_loss_metrics_for_object_broadcast",
    "broadcast_loss_metrics_from_last_stage",
    "broadcast_obj_from_pp_rank",
    "broadcast_tensors_from_last_stage",
]

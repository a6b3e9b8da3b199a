"""Pipeline-parallel helpers: hand a value from one pipeline stage to every stage of the pipeline.

Design. Each helper works on one pipeline group: `pp_group` when given, else the pipeline group of the
setup registered with `meshkd.core.topology.set_current_setup` (`create_kd_distributed_setups` registers the
calling rank's own role). With neither (no setup registered, or the calling rank outside it) the helpers
raise RuntimeError. The last stage is the group's last rank (group rank size - 1). A pipeline of one
stage returns its input without any collective.

Errors reach every rank. The sending stage checks and serializes its value before the first collective,
then always runs the same fixed sequence of collectives, sending a failure status (and the error text)
instead of the value when something is wrong; every other stage raises on that status. So no error leaves
a peer blocked in a collective.

Transport. Objects are pickled by the sender and travel as a uint8 tensor behind an int64 header
(status, byte count), on the group's device: the CPU under gloo, the current CUDA device under NCCL.
Tensors travel as metadata (names, shapes, dtypes) and then one broadcast per tensor of its bytes, viewed
as uint8 so that every dtype (bfloat16, bool, float8, ...) works on every backend.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any, TypeAlias, TypeVar

import torch
import torch.distributed as dist

from meshkd.core.agreement import group_device
from meshkd.core.topology import get_current_setup

__all__ = [
    "LossMetricPayload",
    "LossMetricPayloadT",
    "broadcast_loss_metrics_from_last_stage",
    "broadcast_obj_from_pp_rank",
    "broadcast_tensors_from_last_stage",
]

LossMetricPayload: TypeAlias = dict[str, Any] | list[dict[str, Any]]
"""A dict of metrics (name -> value) or a list of such dicts, e.g. one per micro-batch."""

LossMetricPayloadT = TypeVar("LossMetricPayloadT", bound=LossMetricPayload)
"""The concrete payload type: `broadcast_loss_metrics_from_last_stage` returns the shape it was given."""

# Header status sent by the source of a broadcast.
_OK = 1
_FAILED = 0
# Per-stage flags gathered by broadcast_obj_from_pp_rank.
_NO_OBJECT, _HAS_OBJECT, _UNPICKLABLE = 0, 1, 2


def _resolve_pp_group(pp_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """`pp_group`, or the registered setup's pipeline group; RuntimeError when there is neither."""
    if pp_group is None:
        setup = get_current_setup()
        pp_group = setup.pp_group if setup is not None else None
        if pp_group is None:
            reason = "no setup is registered" if setup is None else "the calling rank has no pipeline group in it"
            raise RuntimeError(
                f"no pipeline group: pp_group is None and {reason}; call "
                "meshkd.core.topology.set_current_setup (create_kd_distributed_setups does so) or pass pp_group"
            )
    if dist.get_rank(pp_group) < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of pp_group")
    return pp_group


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (0-dim included); writing into it writes the tensor."""
    return tensor.reshape(-1).view(torch.uint8)


def _error_text(error: BaseException) -> bytearray:
    return bytearray(f"{type(error).__name__}: {error}".encode("utf-8", "replace"))


def _broadcast_bytes(
    data: bytearray, ok: bool, *, group: dist.ProcessGroup, group_src: int, device: torch.device
) -> tuple[bool, bytes | bytearray]:
    """Send (ok, data) from `group_src` to the group; returns what `group_src` sent, on every rank.

    Two collectives whatever happens: a header [ok, byte count], then the bytes (skipped when empty).
    """
    is_src = dist.get_rank(group) == group_src
    header = torch.tensor([_OK if ok else _FAILED, len(data)] if is_src else [0, 0], dtype=torch.int64, device=device)
    dist.broadcast(header, group=group, group_src=group_src)
    sent_ok, num_bytes = (int(value) for value in header.tolist())
    if num_bytes:
        if is_src:
            buffer = torch.frombuffer(data, dtype=torch.uint8).to(device)
        else:
            buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        dist.broadcast(buffer, group=group, group_src=group_src)
        if not is_src:
            data = buffer.cpu().numpy().tobytes()
    return bool(sent_ok == _OK), data


def broadcast_obj_from_pp_rank(obj: Any, *, pp_group: dist.ProcessGroup | None = None) -> Any:
    """Broadcast an object across pipeline parallel ranks.

    Exactly one stage passes the object; every other stage passes None. Every stage first learns which
    stages hold an object (one all_gather), so a missing or duplicated owner fails on every rank at once.

    Args:
        obj: the object on the stage that owns it, None on every other stage. Must be picklable.
        pp_group: the pipeline group; default: the pipeline group of the registered setup (see the module
            docstring).

    Returns:
        The object on every rank: the owner gets `obj` itself, the others an unpickled copy. In a pipeline
        of one stage, `obj` itself.

    Raises:
        ValueError: on every rank, if no stage or more than one stage passed an object. On the owner if
            `obj` cannot be pickled (RuntimeError on the other stages).
        RuntimeError: no pipeline group (see the module docstring).
    """
    group = _resolve_pp_group(pp_group)
    num_stages, stage = dist.get_world_size(group), dist.get_rank(group)
    if num_stages == 1:
        if obj is None:
            raise ValueError("broadcast_obj_from_pp_rank: obj is None on the only pipeline stage")
        return obj

    # The owner pickles before the gather, so a failure to pickle travels in the same gather as the
    # ownership flags and every stage takes the same branch below.
    data, pickle_error = bytearray(), None
    if obj is not None:
        try:
            data = bytearray(pickle.dumps(obj))
        except Exception as error:
            pickle_error = error
    status = _NO_OBJECT if obj is None else (_HAS_OBJECT if pickle_error is None else _UNPICKLABLE)
    device = group_device(group)
    flags = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(num_stages)]
    dist.all_gather(flags, torch.tensor([status, len(data)], dtype=torch.int64, device=device), group=group)
    flags = [tuple(int(value) for value in flag.tolist()) for flag in flags]

    owners = [rank for rank, (flag, _) in enumerate(flags) if flag != _NO_OBJECT]
    if not owners:
        raise ValueError(
            "broadcast_obj_from_pp_rank: obj is None on every pipeline stage; exactly one stage must pass it"
        )
    if len(owners) > 1:
        owner_ranks = [dist.get_global_rank(group, rank) for rank in owners]
        raise ValueError(
            f"broadcast_obj_from_pp_rank: global ranks {owner_ranks} all passed an object; exactly one "
            "pipeline stage may pass a non-None obj"
        )
    owner = owners[0]
    owner_status, num_bytes = flags[owner]
    if owner_status == _UNPICKLABLE:
        if stage == owner:
            raise ValueError(f"broadcast_obj_from_pp_rank: obj cannot be pickled: {pickle_error}") from pickle_error
        raise RuntimeError(
            f"broadcast_obj_from_pp_rank: global rank {dist.get_global_rank(group, owner)} could not pickle its obj"
        )

    # Every stage knows the byte count from the gather, so one broadcast carries the object.
    if stage == owner:
        buffer = torch.frombuffer(data, dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, group=group, group_src=owner)
    if stage == owner:
        return obj
    return pickle.loads(buffer.cpu().numpy().tobytes())


def _check_loss_metrics(loss_metrics: Any) -> list[dict]:
    """The payload's dicts, in order; ValueError unless it is a dict or a list of dicts."""
    if isinstance(loss_metrics, dict):
        return [loss_metrics]
    if isinstance(loss_metrics, list):
        for index, item in enumerate(loss_metrics):
            if not isinstance(item, dict):
                raise ValueError(f"loss_metrics[{index}] is a {type(item).__name__}; expected a dict of metrics")
        return loss_metrics
    raise ValueError(
        f"loss_metrics must be a dict of metrics or a list of such dicts, got {type(loss_metrics).__name__}"
    )


def _materialize_loss_metrics_for_object_broadcast(loss_metrics: LossMetricPayload) -> LossMetricPayload:
    """Convert tensor metrics to host values before object transport.

    Returns a new payload of the same shape (new dicts, and a new list for a list): one-element tensors
    become Python floats, other tensors are detached and moved to the CPU, any other value is kept as is.
    Only the dicts' own values are converted, not values nested inside them.

    Raises:
        ValueError: `loss_metrics` is not a dict or a list of dicts.
    """
    source = _check_loss_metrics(loss_metrics)
    result = [dict(metrics) for metrics in source]
    scalars: dict[tuple[torch.device, torch.dtype], list[tuple[int, Any, torch.Tensor]]] = {}
    for index, metrics in enumerate(result):
        for key, value in metrics.items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.numel() == 1:
                scalars.setdefault((value.device, value.dtype), []).append((index, key, value.detach().reshape(())))
            else:
                metrics[key] = value.detach().cpu()
    for entries in scalars.values():
        # One stack and one device-to-host copy per (device, dtype): an .item() per metric would wait for
        # the device once per metric.
        values = torch.stack([tensor for _, _, tensor in entries]).cpu().tolist()
        for (index, key, _), value in zip(entries, values):
            result[index][key] = float(value)
    return result if isinstance(loss_metrics, list) else result[0]


def broadcast_loss_metrics_from_last_stage(
    loss_metrics: LossMetricPayloadT | None = None, *, pp_group: dist.ProcessGroup | None = None
) -> LossMetricPayloadT:
    """Broadcast loss metrics from the last pipeline stage to all stages.

    Loss is computed only on the last pipeline stage, so every other stage needs the result handed to it
    before it can report metrics. The last stage materializes its payload
    (`_materialize_loss_metrics_for_object_broadcast`) and sends that host copy.

    Args:
        loss_metrics: the payload on the last pipeline stage: a dict of metrics or a list of such dicts;
            the same shape comes back on every rank. Other stages pass None; anything they pass is ignored.
        pp_group: the pipeline group; default: the pipeline group of the registered setup (see the module
            docstring).

    Returns:
        The payload, on every rank. On the last stage this is the materialized copy rather than the object
        that was passed in, because it is what went over the wire. In a pipeline of one stage, the input
        itself.

    Raises:
        ValueError: on the last stage, if it passed None, something other than a dict or a list of dicts,
            or a payload that cannot be pickled.
        RuntimeError: on the other stages, when the last stage sent no payload (it raised the ValueError
            above); also when there is no pipeline group (see the module docstring).
    """
    group = _resolve_pp_group(pp_group)
    num_stages, stage = dist.get_world_size(group), dist.get_rank(group)
    if num_stages == 1:
        if loss_metrics is None:
            raise ValueError("broadcast_loss_metrics_from_last_stage: loss_metrics is None on the only pipeline stage")
        _check_loss_metrics(loss_metrics)
        return loss_metrics

    last = num_stages - 1
    host_copy, data, error = None, bytearray(), None
    if stage == last:
        # Every failure is caught here and sent as a status, so the peers waiting in the broadcast raise too.
        try:
            if loss_metrics is None:
                raise ValueError(
                    "broadcast_loss_metrics_from_last_stage: loss_metrics is None on the last pipeline stage "
                    f"(global rank {dist.get_rank()}), which must pass the payload"
                )
            host_copy = _materialize_loss_metrics_for_object_broadcast(loss_metrics)
            try:
                data = bytearray(pickle.dumps(host_copy))
            except Exception as pickle_error:
                raise ValueError(f"loss_metrics cannot be pickled: {pickle_error}") from pickle_error
        except Exception as caught:
            error, data = caught, _error_text(caught)

    ok, data = _broadcast_bytes(data, error is None, group=group, group_src=last, device=group_device(group))
    if stage == last:
        if error is not None:
            raise error
        return host_copy
    if not ok:
        raise RuntimeError(
            f"broadcast_loss_metrics_from_last_stage: the last pipeline stage (global rank "
            f"{dist.get_global_rank(group, last)}) sent no payload: {bytes(data).decode('utf-8', 'replace')}"
        )
    return pickle.loads(data)


def _check_tensors(tensors: Any) -> dict[str, torch.Tensor]:
    """A new dict of the last stage's tensors; ValueError for anything that cannot be sent."""
    if not isinstance(tensors, Mapping):
        raise ValueError(f"tensors must be a dict of name -> tensor on the last stage, got {type(tensors).__name__}")
    missing = [name for name, tensor in tensors.items() if tensor is None]
    if missing:
        raise ValueError(f"tensors {missing} are None on the last pipeline stage, which must pass every tensor")
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise ValueError(f"tensor names must be strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"tensors[{name!r}] is a {type(tensor).__name__}, not a tensor")
        if tensor.layout != torch.strided:
            raise ValueError(f"tensors[{name!r}] has layout {tensor.layout}; only dense (strided) tensors can be sent")
    return dict(tensors)


def broadcast_tensors_from_last_stage(
    tensors: Mapping[str, torch.Tensor | None] | None, *, pp_group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """Broadcast multiple tensors from the last pipeline stage to all stages.

    The last stage's dict defines the names. Its names, shapes and dtypes travel first, so the other stages
    can allocate, then each tensor is broadcast in the dict's order.

    Args:
        tensors: on the last stage, name -> tensor (any shape, 0-dim included, any dtype). Other stages
            pass None or a dict with None values; whatever they pass is ignored.
        pp_group: the pipeline group; default: the pipeline group of the registered setup (see the module
            docstring).

    Returns:
        name -> tensor, in the last stage's order, on every rank. The last stage gets a new dict holding
        its own tensors; the other stages get new tensors on the group's device (the CPU under gloo, the
        current CUDA device under NCCL).

    Raises:
        ValueError: on every rank, if the last stage passed a None value, a value that is not a dense
            tensor, a name that is not a string, or no dict at all.
        RuntimeError: no pipeline group (see the module docstring).
    """
    group = _resolve_pp_group(pp_group)
    num_stages, stage = dist.get_world_size(group), dist.get_rank(group)
    if num_stages == 1:
        return _check_tensors(tensors)

    last = num_stages - 1
    device = group_device(group)
    checked, data, error = {}, bytearray(), None
    if stage == last:
        # Checked before the first collective so that a bad input fails as a status every stage receives.
        try:
            checked = _check_tensors(tensors)
            metadata = [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in checked.items()]
            data = bytearray(pickle.dumps(metadata))
        except Exception as caught:
            error, data = caught, _error_text(caught)

    ok, data = _broadcast_bytes(data, error is None, group=group, group_src=last, device=device)
    if error is not None:
        raise error
    if not ok:
        raise ValueError(
            f"broadcast_tensors_from_last_stage: the last pipeline stage (global rank "
            f"{dist.get_global_rank(group, last)}) rejected its tensors: {bytes(data).decode('utf-8', 'replace')}"
        )
    metadata = metadata if stage == last else pickle.loads(data)

    received = {}
    for name, shape, dtype in metadata:
        if stage == last:
            # Collectives need contiguous memory on the group's device; the caller keeps its own tensor.
            buffer = checked[name].detach().to(device).contiguous()
        else:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            received[name] = buffer
        # Every stage knows the shape, so all skip an empty tensor together.
        if buffer.numel():
            dist.broadcast(_as_bytes(buffer), group=group, group_src=last)
    return checked if stage == last else received

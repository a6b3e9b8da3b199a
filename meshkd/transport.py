"""Transport: move student batches to the teacher and teacher logits back, between disjoint meshes.

Design. Every pairing of a student replica with a teacher replica is a `_Route`: one source rank and a
process group over the source and its receivers. `num_waves = ceil(student replicas / teacher
replicas)`; in wave w teacher replica t serves student replica w*T + t. A teacher replica without a
partner in the last wave still receives student replica 0's batch, so every rank issues the same
collectives in the same order, but it has no output route. All route groups are created at
construction by every rank (new_group is collective), in one deterministic order.

A value travels along a route as two broadcasts of metadata (spec length, then spec: `meshkd.wire`) and
one broadcast of all its tensor bytes. A sender with nothing valid to send broadcasts an error spec
instead, so its receivers raise too rather than wait forever.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshkd import wire
from meshkd.topology import KDDistributedSetups, _model_replicas, _Replica

RUN_TEACHER = 1
STOP_TEACHER = 0
# Broadcast in place of a command when the first student rank passed an invalid one.
_INVALID_COMMAND = -1


@dataclass(frozen=True)
class _Route:
    """One broadcast path: `src` sends to the other `ranks` (sorted, `src` included) over `group`."""

    src: int
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None


class KDMeshBridge:
    """Move batches and teacher logits between disjoint model meshes.

    Args:
        setups: resolved disjoint student and teacher setups (`separate=True`).
        device: device of the transport buffers (CUDA under NCCL, CPU under gloo).
        timeout: how long a collective of the bridge may wait for a peer before it fails; None takes
            torch's default for the backend.

    Every rank of the world constructs the bridge (it creates process groups) and then calls
    `broadcast_command`, `send_batch` and `send_logits` in the same order on every rank.
    """

    def __init__(
        self, setups: KDDistributedSetups, device: torch.device | str, *, timeout: datetime.timedelta | None = None
    ) -> None:
        if not setups.separate:
            raise ValueError("KDMeshBridge needs separate student and teacher meshes (separate_meshes: true)")
        self.setups = setups
        self.device = torch.device(device)
        self.rank = dist.get_rank()
        self.student_ranks = setups.student_ranks
        self.teacher_ranks = setups.teacher_ranks
        self.is_student = self.rank in self.student_ranks
        self.is_teacher = self.rank in self.teacher_ranks
        self._timeout = timeout
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self.control_group = self._group(sorted(self.student_ranks + self.teacher_ranks))
        self.student_group = self._group(self.student_ranks)
        self.teacher_group = self._group(self.teacher_ranks)
        self.student_replicas = _model_replicas(setups.student)
        self.teacher_replicas = _model_replicas(setups.teacher)
        self.num_waves = math.ceil(len(self.student_replicas) / len(self.teacher_replicas))
        self.input_routes: list[list[_Route]] = []
        self.output_routes: list[list[_Route]] = []
        for wave in range(self.num_waves):
            inputs, outputs = [], []
            for index, teacher in enumerate(self.teacher_replicas):
                partner = wave * len(self.teacher_replicas) + index
                student = self.student_replicas[partner] if partner < len(self.student_replicas) else None
                source = student or self.student_replicas[0]
                inputs.append(self._route(source.input_rank, teacher.ranks))
                if student is not None:
                    outputs.append(self._route(teacher.output_rank, student.ranks))
            self.input_routes.append(inputs)
            self.output_routes.append(outputs)

    def _group(self, ranks: tuple[int, ...] | list[int]) -> dist.ProcessGroup | None:
        key = tuple(sorted(ranks))
        if key not in self._groups:
            self._groups[key] = dist.new_group(ranks=list(key), timeout=self._timeout)
        return self._groups[key]

    def _route(self, src: int, receivers: tuple[int, ...]) -> _Route:
        ranks = tuple(sorted({src, *receivers}))
        return _Route(src=src, ranks=ranks, group=self._group(ranks))

    def _check_wave(self, wave: int) -> None:
        if not 0 <= wave < self.num_waves:
            raise ValueError(f"wave {wave} out of range: this bridge has {self.num_waves} wave(s)")

    def send_batch(self, wave: int, batch: Any | None) -> Any | None:
        """Send one nested batch from each active student replica to a teacher replica.

        Args:
            wave: routing wave index, 0 <= wave < num_waves.
            batch: the nested batch on student input ranks (ignored on other student ranks); None on
                teacher ranks.

        Returns:
            The batch the calling teacher rank is assigned (tensor shapes and dtypes preserved, on
            `device`); None on student ranks.
        """
        self._check_wave(wave)
        error = None
        if self.is_student and batch is None:
            error = f"student rank {self.rank} is an input rank but passed batch=None"
        received = self._broadcast_along(self.input_routes[wave], batch, error)
        return received if self.is_teacher else None

    def send_logits(self, wave: int, logits: torch.Tensor | None) -> torch.Tensor | None:
        """Send full teacher logits back to the assigned student replica.

        Args:
            wave: routing wave index.
            logits: [batch, sequence, vocab] full, replicated teacher logits on teacher output ranks;
                None elsewhere. An unpaired teacher replica in the last wave has no route: its logits
                are dropped.

        Returns:
            [batch, sequence, vocab] on every rank of the student replica served in this wave; None
            elsewhere.
        """
        self._check_wave(wave)
        error = None
        if isinstance(logits, DTensor):
            error = f"teacher rank {self.rank} passed a DTensor: call materialize_teacher_logits first"
        elif not isinstance(logits, torch.Tensor):
            error = f"teacher rank {self.rank} is an output rank but passed logits={type(logits).__name__}"
        received = self._broadcast_along(self.output_routes[wave], logits, error)
        return received if self.is_student else None

    def _broadcast_along(self, routes: list[_Route], value: Any, error: str | None) -> Any:
        """Run every route of a wave this rank is in; `error` applies where this rank is the source.

        A failure on one route does not skip the others (a source may serve several routes, and their
        receivers would wait forever); the first failure is raised after all routes ran.
        """
        received, failure = None, None
        for route in routes:
            if self.rank not in route.ranks:
                continue
            is_source = self.rank == route.src
            try:
                received = self._broadcast_tree(value if is_source else None, route, error=error if is_source else None)
            except (ValueError, RuntimeError) as raised:
                failure = failure or raised
        if failure is not None:
            raise failure
        return received

    def broadcast_command(self, command: int | None = None) -> int:
        """Broadcast one worker command (RUN_TEACHER or STOP_TEACHER) from the first student rank.

        Teacher ranks pass None and wait. An invalid command on the first student rank raises
        ValueError there and RuntimeError on every other rank.
        """
        source = self.student_ranks[0]
        value = _INVALID_COMMAND
        if self.rank == source and command in (RUN_TEACHER, STOP_TEACHER) and not isinstance(command, bool):
            value = int(command)
        flag = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(flag, src=source, group=self.control_group)
        received = int(flag.item())
        if received == _INVALID_COMMAND:
            if self.rank == source:
                raise ValueError(f"command must be RUN_TEACHER (1) or STOP_TEACHER (0), got {command!r}")
            raise RuntimeError(f"student rank {source} sent an invalid command")
        return received

    def synchronize(self) -> None:
        """Wait for both model roles without using the default process group."""
        dist.barrier(group=self.control_group)

    def move_to_device(self, value: Any) -> Any:
        """Move every tensor leaf of a nested value to the bridge device, keeping structure and dtypes."""
        if isinstance(value, torch.Tensor):
            return value.to(self.device)
        if isinstance(value, dict):
            return type(value)((key, self.move_to_device(item)) for key, item in value.items())
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(self.move_to_device(item) for item in value))
        if isinstance(value, (list, tuple)):
            return type(value)(self.move_to_device(item) for item in value)
        return value

    def _broadcast_tree(self, value: Any, route: _Route, *, error: str | None = None) -> Any:
        """Broadcast a nested value along one route.

        Args:
            value: the nested value on `route.src`, None elsewhere. Tensor leaves of any shape and dtype.
            route: source, members and group of the broadcast.
            error: set on the source instead of a value: the receivers raise RuntimeError with it and the
                source raises ValueError, so no member is left waiting.

        Returns:
            The value on route members (tensors on `device`, views of one received buffer); None on
            ranks outside the route.
        """
        if self.rank not in route.ranks:
            return None
        is_source = self.rank == route.src
        tensors: list[torch.Tensor] = []
        if is_source:
            header = wire.encode_error(error) if error else wire.encode_spec(wire._tree_spec(value, tensors))
            header = header.to(self.device)
            length = torch.tensor([header.numel()], dtype=torch.int64, device=self.device)
        else:
            length = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.broadcast(length, src=route.src, group=route.group)
        if not is_source:
            header = torch.empty(wire.checked_spec_length(int(length.item())), dtype=torch.uint8, device=self.device)
        dist.broadcast(header, src=route.src, group=route.group)
        if error:
            raise ValueError(error)
        spec = wire.decode_spec(header)  # on receivers, raises the source's error message if it sent one
        leaves = wire.leaf_specs(spec)
        if leaves:
            buffer = wire.pack_leaves(tensors, self.device) if is_source else wire.receive_buffer(leaves, self.device)
            dist.broadcast(buffer, src=route.src, group=route.group)
            if not is_source:
                tensors = wire.unpack_leaves(buffer, leaves)
        return value if is_source else wire._tree_from_spec(spec, tensors)

    @staticmethod
    def match_student_vocab_shard(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        """Match full teacher logits to a TP-sharded student vocabulary.

        Args:
            student_logits: [batch, sequence, vocab] student logits; a vocabulary-sharded DTensor has
                local shape [batch, sequence, local_vocab] and a Shard(-1) placement.
            teacher_logits: [batch, sequence, vocab] full teacher logits, the same on every rank.

        Returns:
            [batch, sequence, local_vocab]: exactly the vocabulary slice DTensor places on this rank
            (torch.chunk semantics); the teacher logits unchanged for a non-DTensor student.
        """
        if not isinstance(student_logits, DTensor):
            return teacher_logits
        vocab = student_logits.shape[-1]
        if teacher_logits.shape[-1] != vocab:
            raise ValueError(
                f"teacher vocabulary {teacher_logits.shape[-1]} != student vocabulary {vocab}: trim both to the "
                "common vocabulary first"
            )
        vocab_dim = student_logits.ndim - 1
        sharded = any(
            isinstance(placement, Shard) and placement.dim % student_logits.ndim == vocab_dim
            for placement in student_logits.placements
        )
        if not sharded:
            return teacher_logits
        local_shape, offset = compute_local_shape_and_global_offset(
            student_logits.shape, student_logits.device_mesh, student_logits.placements
        )
        return teacher_logits.narrow(-1, offset[vocab_dim], local_shape[vocab_dim])


__all__ = ["RUN_TEACHER", "STOP_TEACHER", "KDMeshBridge", "_Route", "_Replica"]

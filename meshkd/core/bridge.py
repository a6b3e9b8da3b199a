"""Transport: move student batches to the teacher and teacher logits back, between disjoint meshes.

Design. Every pairing of a student replica with a teacher replica is a `Route`: one source rank and a
process group over the source and its receivers. `num_waves = ceil(student replicas / teacher
replicas)`; in wave w teacher replica t serves student replica w*T + t. A teacher replica without a
partner in the last wave still receives student replica 0's batch, so every rank issues the same
collectives in the same order, but it has no output route. Logits go to the last pipeline stage of the
student replica only (all its ranks without pipeline parallelism). All route groups are created at
construction by every rank (new_group is collective), in one deterministic order, as groups meshkd waits on
itself: under NCCL with blocking wait, so a silent peer raises in the waiting thread after `timeout`
(`meshkd.core.groups`). The control group, which carries the student's commands, is a group of its own
(never shared with a route of the same ranks) so that teacher ranks can wait for the next command longer
than for data (`command_timeout`): between two requests the student may be evaluating, saving a checkpoint
or exporting, for longer than any one transfer takes, and a student that is gone still ends that wait at
once (gloo raises on the lost connection; under NCCL `meshkd.recipe.common.faults` aborts the communicators when a
peer process of the host exits). Construction then warms every group up with one small all-reduce, in
that same order on every rank (each rank takes part in its own groups: the first collective not yet done always has
all its members ready, so the sequence cannot deadlock). NCCL creates a group's communicator at its first
collective; the warm-up makes that happen here, during set-up on the thread that builds the bridge, never
first on a `TeacherPrefetcher`'s thread while the training thread creates FSDP2's communicators
(concurrent communicator creation is not something NCCL guarantees to be safe).

A value travels along a route as a one-word header, the structure spec (`meshkd.core.wire`) only when it
differs from the last one on that route, and one broadcast of all its tensor bytes; once a spec keeps
repeating, the header travels with the data (see `KDMeshBridge._broadcast_tree`), so steady-state
batches and logits cost one transfer each. A sender with nothing valid to send broadcasts an error spec
instead, so its receivers raise too rather than wait forever. On the CPU, transfer buffers are reused
once released (`BufferPool`).

What travels in a teacher request, and the loops on both sides, are `meshkd.core.teacher_protocol`'s.
"""

from __future__ import annotations

import datetime
import math
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshkd.core import wire
from meshkd.core.groups import waiting_group
from meshkd.core.route_state import BufferPool, RouteState
from meshkd.core.topology import KDDistributedSetups, Replica, last_stage_ranks, model_replicas

RUN_TEACHER = 1
STOP_TEACHER = 0
# Broadcast in place of a command when the first student rank passed an invalid one.
_INVALID_COMMAND = -1


_WORD_BYTES = 8  # an int64 header word appended to a packed buffer


@dataclass(frozen=True)
class Route:
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
        command_timeout: how long a teacher rank waits for the student's next command (`broadcast_command`);
            None: `timeout`. Student ranks send commands under `timeout`.

    Every rank of the world constructs the bridge (it creates process groups) and then calls
    `broadcast_command`, `send_batch` and `send_logits` in the same order on every rank.
    """

    def __init__(
        self, setups: KDDistributedSetups, device: torch.device | str, *, timeout: datetime.timedelta | None = None,
        command_timeout: datetime.timedelta | None = None,
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
        # The thread a TeacherPrefetcher drives the bridge from (set and cleared by the prefetcher), else None.
        self.owner_thread: int | None = None
        # Per route: the last spec and its repeat streak (`_broadcast_tree`), and CPU buffers to reuse.
        self._pools: dict[tuple, BufferPool] = {}
        self._route_states: dict[tuple[int, tuple[int, ...]], RouteState] = {}
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        # Its own group, whatever the routes' ranks: its timeout is a teacher rank's patience (a per-rank setting).
        patience = command_timeout if self.is_teacher and command_timeout is not None else timeout
        self.control_group = waiting_group(sorted(self.student_ranks + self.teacher_ranks), timeout=patience)
        self.student_group = self._group(self.student_ranks)
        self.teacher_group = self._group(self.teacher_ranks)
        self.student_replicas = model_replicas(setups.student)
        self.teacher_replicas = model_replicas(setups.teacher)
        self.num_waves = math.ceil(len(self.student_replicas) / len(self.teacher_replicas))
        # Student ranks that get teacher logits: the last pipeline stage of each replica (all without pp).
        student_receivers = last_stage_ranks(setups.student)
        self.receives_logits = any(self.rank in ranks for ranks in student_receivers)
        self.input_routes: list[list[Route]] = []
        self.output_routes: list[list[Route]] = []
        for wave in range(self.num_waves):
            inputs, outputs = [], []
            for index, teacher in enumerate(self.teacher_replicas):
                partner = wave * len(self.teacher_replicas) + index
                student = self.student_replicas[partner] if partner < len(self.student_replicas) else None
                source = student or self.student_replicas[0]
                inputs.append(self._route(source.input_rank, teacher.ranks))
                if student is not None:
                    outputs.append(self._route(teacher.output_rank, student_receivers[partner]))
            self.input_routes.append(inputs)
            self.output_routes.append(outputs)
        self._warm_up()

    def _group(self, ranks: tuple[int, ...] | list[int]) -> dist.ProcessGroup | None:
        key = tuple(sorted(ranks))
        if key not in self._groups:
            self._groups[key] = waiting_group(key, timeout=self._timeout)
        return self._groups[key]

    def _warm_up(self) -> None:
        """One all-reduce on every group of this rank, the control group first, then in creation order (see the
        module docstring)."""
        probe = torch.zeros(1, device=self.device)
        dist.all_reduce(probe, group=self.control_group)
        for ranks, group in self._groups.items():
            if self.rank in ranks:
                dist.all_reduce(probe, group=group)

    def _route(self, src: int, receivers: tuple[int, ...]) -> Route:
        ranks = tuple(sorted({src, *receivers}))
        return Route(src=src, ranks=ranks, group=self._group(ranks))

    @property
    def claimed(self) -> bool:
        """Whether a TeacherPrefetcher drives this bridge (then only its thread may use it)."""
        return self.owner_thread is not None

    def _check_caller(self) -> None:
        """While a TeacherPrefetcher drives this bridge, only its thread may issue the bridge's collectives:
        another thread's would interleave with the prefetcher's in an order the other ranks cannot know."""
        owner = self.owner_thread
        if owner is not None and owner != threading.get_ident():
            raise RuntimeError(
                "this KDMeshBridge is driven by a running TeacherPrefetcher: close it (or let it finish) before "
                "using the bridge from another thread"
            )

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
        self._check_caller()
        error = None
        if self.is_student and batch is None:
            error = f"student rank {self.rank} is an input rank but passed batch=None"
        received = self._broadcast_along(self.input_routes[wave], batch, error)
        return received if self.is_teacher else None

    def send_logits(self, wave: int, logits: Any | None, *, error: str | None = None) -> Any | None:
        """Send teacher logits back to the assigned student replica.

        Args:
            wave: routing wave index.
            logits: on teacher output ranks, [batch, sequence, vocab] full, replicated teacher logits, or
                their encoded form (a dict from a kind of `meshkd.core.answers`); None
                elsewhere. An unpaired teacher replica in the last wave has no route: its logits are
                dropped.
            error: on teacher output ranks, why there are no logits: the receivers raise RuntimeError
                with this message instead of waiting (the sender's own exception is the caller's to raise).

        Returns:
            What the teacher sent ([batch, sequence, vocab], or the encoded dict) on every rank of the last
            pipeline stage of the student replica served in this wave (every rank of it without pipeline
            parallelism); None elsewhere.
        """
        self._check_wave(wave)
        self._check_caller()
        values = logits.values() if isinstance(logits, dict) else [logits]
        if error is None and any(isinstance(value, DTensor) for value in values):
            error = f"teacher rank {self.rank} passed a DTensor: call materialize_teacher_logits first"
        elif error is None and not isinstance(logits, (torch.Tensor, dict)):
            error = f"teacher rank {self.rank} is an output rank but passed logits={type(logits).__name__}"
        received = self._broadcast_along(self.output_routes[wave], logits, error)
        return received if self.is_student else None

    def _broadcast_along(self, routes: list[Route], value: Any, error: str | None) -> Any:
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

    def broadcast_command(self, command: int | None = None, *, timeout: datetime.timedelta | None = None) -> int:
        """Broadcast one worker command (RUN_TEACHER or STOP_TEACHER) from the first student rank.

        Teacher ranks pass None and wait (up to the bridge's `command_timeout`). An invalid command on the
        first student rank raises
        ValueError there and RuntimeError on every other rank. `timeout` bounds this call's wait (default:
        the bridge's); past it RuntimeError is raised and the broadcast is abandoned (for a last STOP_TEACHER
        after a failure, when peers may never take part).
        """
        self._check_caller()
        source = self.student_ranks[0]
        value = _INVALID_COMMAND
        if self.rank == source and command in (RUN_TEACHER, STOP_TEACHER) and not isinstance(command, bool):
            value = int(command)
        flag = torch.tensor([value], dtype=torch.int64, device=self.device)
        work = dist.broadcast(flag, src=source, group=self.control_group, async_op=True)
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=timeout)
        received = int(flag.item())
        if received == _INVALID_COMMAND:
            if self.rank == source:
                raise ValueError(f"command must be RUN_TEACHER (1) or STOP_TEACHER (0), got {command!r}")
            raise RuntimeError(f"student rank {source} sent an invalid command")
        return received

    def synchronize(self) -> None:
        """Wait for both model roles without using the default process group."""
        self._check_caller()
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

    def _broadcast_tree(self, value: Any, route: Route, *, error: str | None = None) -> Any:
        """Broadcast a nested value along one route.

        Args:
            value: the nested value on `route.src`, None elsewhere. Tensor leaves of any shape and dtype.
            route: source, members and group of the broadcast.
            error: set on the source instead of a value: the receivers raise RuntimeError with it and the
                source raises ValueError, so no member is left waiting. A value that cannot be sent
                (TypeError from the wire format) is reported the same way.

        Returns:
            The value on route members (tensors on `device`, views of one received buffer); None on
            ranks outside the route.

        Collectives, in this order on every member:
        1. a one-word header: the spec's length, or SAME_SPEC when it repeats the route's last spec;
        2. the spec, only when it changed (or the error document);
        3. the data buffer, when the value has tensor leaves.
        Once a route's spec has repeated a few times in a row (`RouteState.speculating`), receivers expect it
        again and post the data buffer of the cached size together with the header: a value of several leaves
        (packed by a copy anyway) carries the header word at the end of its buffer, one collective in
        all; a single leaf, sent from its own memory, has the word broadcast alongside it asynchronously.
        If the spec changed after all, that buffer travels as filler, and the header's new length is
        followed by 2 and 3 as usual.
        Both ends keep the same per-route state (`RouteState`), updated by the same events (a repeat
        extends the streak; a new spec, an error or a failure clears it), so they always agree on which
        collectives come next.
        """
        if self.rank not in route.ranks:
            return None
        state = self._route_states.setdefault((route.src, route.ranks), RouteState())
        try:
            if self.rank == route.src:
                return self._send_tree(value, route, state, error)
            return self._receive_tree(route, state)
        except BaseException:
            state.forget()
            raise

    def _send_tree(self, value: Any, route: Route, state: RouteState, error: str | None) -> Any:
        tensors: list[torch.Tensor] = []
        document = None
        if not error:
            try:
                document = wire.spec_bytes(wire.tree_spec(value, tensors))
            except TypeError as raised:  # unsendable: tell the receivers instead of leaving them waiting
                error = f"rank {self.rank} cannot send its value: {raised}"
        same = document is not None and document == state.document
        header = None if same else (wire.encode_error(error) if error else wire.bytes_tensor(document)).to(self.device)
        word = torch.tensor([wire.SAME_SPEC if same else header.numel()], dtype=torch.int64, device=self.device)
        if state.speculating and state.inband:
            # The word rides at the end of the packed buffer (packing copies anyway); filler when the spec changed.
            buffer = self._send_buffer(state.nbytes + _WORD_BYTES, route)
            if same:
                wire.pack_leaves(tensors, self.device, out=buffer[: state.nbytes])
            buffer[state.nbytes :].view(torch.int64).copy_(word)
            dist.broadcast(buffer, src=route.src, group=route.group)
        elif state.speculating:
            # Filler when the spec changed: the receivers posted a buffer of the cached size.
            data = (self._pack(tensors, route) if same
                    else torch.empty(state.nbytes, dtype=torch.uint8, device=self.device))
            self._broadcast_pair(word, data, route)
        else:
            dist.broadcast(word, src=route.src, group=route.group)
            if same and tensors:
                dist.broadcast(self._pack(tensors, route), src=route.src, group=route.group)
        if same:
            state.repeats += 1
            return value
        state.forget()
        dist.broadcast(header, src=route.src, group=route.group)
        if error:
            raise ValueError(error)
        state.remember(document, None, wire.receive_nbytes(wire.leaves_of(tensors)), num_leaves=len(tensors))
        if tensors:
            dist.broadcast(self._pack(tensors, route), src=route.src, group=route.group)
        return value

    def _receive_tree(self, route: Route, state: RouteState) -> Any:
        word = torch.empty(1, dtype=torch.int64, device=self.device)
        if state.speculating:
            if state.inband:
                buffer = self._receive_buffer(state.nbytes + _WORD_BYTES, route)
                dist.broadcast(buffer, src=route.src, group=route.group)
                word = buffer[state.nbytes :].view(torch.int64)
            else:
                buffer = self._receive_buffer(state.nbytes, route)
                self._broadcast_pair(word, buffer, route)
            if int(word.item()) == wire.SAME_SPEC:
                state.repeats += 1
                return wire.tree_from_spec(state.spec, wire.unpack_leaves(buffer, state.leaves))
            word = word.clone()
            del buffer  # filler
        else:
            dist.broadcast(word, src=route.src, group=route.group)
        length = int(word.item())
        if length == wire.SAME_SPEC:
            if state.spec is None:
                raise wire.WireFormatError(f"rank {route.src} reused a structure spec this rank never received")
            state.repeats += 1
            spec, leaves = state.spec, state.leaves
        else:
            state.forget()
            header = torch.empty(wire.checked_spec_length(length), dtype=torch.uint8, device=self.device)
            dist.broadcast(header, src=route.src, group=route.group)
            spec = wire.decode_spec(header)  # validates, or raises the source's error message if it sent one
            leaves = wire.leaf_specs(spec)
            state.remember(None, spec, wire.receive_nbytes(leaves) if leaves else 0, num_leaves=len(leaves))
        tensors: list[torch.Tensor] = []
        if leaves:
            buffer = self._receive_buffer(state.nbytes, route)
            dist.broadcast(buffer, src=route.src, group=route.group)
            tensors = wire.unpack_leaves(buffer, leaves)
        return wire.tree_from_spec(spec, tensors)

    @staticmethod
    def _broadcast_pair(word: torch.Tensor, data: torch.Tensor, route: Route) -> None:
        """Header word and data buffer in flight together; both complete before either is read."""
        works = [dist.broadcast(tensor, src=route.src, group=route.group, async_op=True) for tensor in (word, data)]
        for work in works:
            work.wait()

    def _pack(self, tensors: list[torch.Tensor], route: Route) -> torch.Tensor:
        out = None
        if self.device.type == "cpu" and not wire.packs_in_place(tensors, self.device):
            out = self._send_buffer(wire.receive_nbytes(wire.leaves_of(tensors)), route)
        return wire.pack_leaves(tensors, self.device, out=out)

    def _send_buffer(self, nbytes: int, route: Route) -> torch.Tensor:
        # Pooled CPU memory only when the bridge works on the CPU: an NCCL group takes device memory only.
        if self.device.type == "cpu":
            return self._pool(route, "send").take(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _receive_buffer(self, nbytes: int, route: Route) -> torch.Tensor:
        if self.device.type == "cpu":
            return self._pool(route, "receive").take(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _pool(self, route: Route, direction: str) -> BufferPool:
        return self._pools.setdefault((direction, route.src, route.ranks), BufferPool())

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


__all__ = ["RUN_TEACHER", "STOP_TEACHER", "KDMeshBridge", "Replica", "Route"]

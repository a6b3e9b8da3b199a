"""The teacher protocol: one request from the student's micro-batch to the teacher's encoded logits.

Design. The student trains against a `TeacherSource`: `request(batch, logits_transport)` returns the
teacher's answer for that micro-batch in the asked encoding (`meshkd.core.answers`), or None on ranks
that compute no loss (pipeline stages before a student's last), and `prefetch(items, ...)` returns a
`TeacherFeed` of `(item, logits)` pairs, possibly fetched ahead: an iterator to use in a `with` block, so
that whatever fetches ahead is stopped in one place, with one rule for how long to wait after an error.
Two sources exist:

- `LocalTeacher`: the teacher runs on the student's own ranks (shared meshes); a request is a call.
- `TeacherClient`: the teacher runs on its own ranks, driven through `KDMeshBridge`. One request is
  RUN_TEACHER, then `send_batch` and `send_logits` for every routing wave; `TeacherServer.serve(forward)`
  on the teacher ranks answers requests until STOP_TEACHER. `TeacherPrefetcher` runs the same requests
  on a background thread, one micro-batch ahead, so the teacher's forward overlaps the student's step.

A request travels as a `TeacherRequest` (the batch, the answer asked for and whether each label's log-probability
comes beside it). A teacher that fails on
a request sends its error in place of the logits, on every wave, then raises: the student raises the
teacher's message instead of waiting for logits that never come. Every request runs every wave even after
a failure in one (the later waves' peers would otherwise wait forever).
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from meshkd.core.bridge import RUN_TEACHER, STOP_TEACHER, KDMeshBridge

Batch = dict[str, torch.Tensor]
Encoded = dict[str, Any]
LABEL_LOG_PROBS = "label_log_probs"
"""What an evaluation of the teacher's loss asks for instead of an encoding of the logits: each label's
log-probability (4 bytes a token; `meshkd.core.answers.label_log_probs`)."""


@dataclass(frozen=True)
class TeacherRequest:
    """What the student asks of the teacher for one micro-batch."""

    batch: Batch
    """input_ids [batch, sequence]; position_ids and attention_mask (NEAT document indices) as packed."""
    logits_transport: str
    """The answer asked for: an encoding of the logits (a `kd.logits_transport`, `meshkd.core.answers`), or the
    teacher's log-probability of each label (`LABEL_LOG_PROBS`, what an evaluation of its loss needs)."""
    host_batch: Batch | None = None
    """The same rows on the host, where the caller has them already (the batch it copied to the device): a teacher
    that sends rows over a network reads these instead of copying the device's back (None: it copies). They
    never travel in `to_wire`."""
    with_label_log_probs: bool = False
    """Whether each label's log-probability comes beside the encoding asked, in one answer (what an evaluation of
    the KL needs besides the teacher's loss)."""

    def to_wire(self) -> dict[str, Any]:
        return {"batch": self.batch, "logits_transport": self.logits_transport,
                "with_label_log_probs": self.with_label_log_probs}

    @classmethod
    def from_wire(cls, value: Any) -> TeacherRequest:
        """The request a teacher rank received; ValueError naming what is wrong with a malformed one."""
        keys = ["batch", "logits_transport", "with_label_log_probs"]
        if not isinstance(value, dict) or sorted(value) != keys:
            got = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise ValueError(f"teacher request must have the keys {keys}, got {got}")
        if not isinstance(value["logits_transport"], str) or not isinstance(value["with_label_log_probs"], bool):
            raise ValueError("teacher request: logits_transport must be a string (the answer asked for, checked by "
                             "the teacher) and with_label_log_probs a bool")
        check_beside(value["logits_transport"], value["with_label_log_probs"], where="teacher request")
        if not isinstance(value["batch"], dict) or not isinstance(value["batch"].get("input_ids"), torch.Tensor):
            raise ValueError("teacher request: batch must be a dict holding an input_ids tensor")
        return cls(batch=value["batch"], logits_transport=value["logits_transport"],
                   with_label_log_probs=value["with_label_log_probs"])


def check_beside(logits_transport: str, with_label_log_probs: bool, *, where: str) -> None:
    """ValueError, naming `where` the request came from, for each label's log-probability asked beside itself:
    `with_label_log_probs` goes beside an encoding of the logits only."""
    if with_label_log_probs and logits_transport == LABEL_LOG_PROBS:
        raise ValueError(f"{where}: with_label_log_probs goes beside an encoding of the logits, not {LABEL_LOG_PROBS}")


class TeacherFeed:
    """(item, teacher answer) pairs in order, from `TeacherSource.prefetch`: use it in a `with` block.

    Leaving the block closes the feed. Normally that waits for a request in flight (a prefetching feed's
    teacher answers it, its answer is dropped). After an error it waits at most `FAILURE_WAIT_S`: the
    request may wait on peers that are stuck elsewhere, and the error at hand is the one to report; a feed
    that could not close in time leaves its thread to the process exit (and its bridge claimed).

    Args:
        pairs: the pairs, computed lazily or fetched ahead.
        close: stops whatever fetches ahead; takes a timeout in seconds (None: wait) and returns whether it
            stopped. Default: nothing to stop.
    """

    FAILURE_WAIT_S = 5.0

    def __init__(self, pairs: Iterable[tuple[Any, Encoded | None]], *,
                 close: Callable[[float | None], bool] | None = None) -> None:
        self._pairs = iter(pairs)
        self._close = close

    def __iter__(self) -> Iterator[tuple[Any, Encoded | None]]:
        return self

    def __next__(self) -> tuple[Any, Encoded | None]:
        return next(self._pairs)

    def close(self, timeout: float | None = None) -> bool:
        """Stop fetching ahead, waiting at most `timeout` seconds (None: until done); whether it stopped."""
        return self._close(timeout) if self._close is not None else True

    def __enter__(self) -> TeacherFeed:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(timeout=self.FAILURE_WAIT_S if kind is not None else None)


class TeacherSource(Protocol):
    """Where a student's teacher logits come from."""

    def request(self, batch: Batch, logits_transport: str, *, host_batch: Batch | None = None,
                with_label_log_probs: bool = False) -> Encoded | None:
        """The teacher's answer for this rank's micro-batch (None on ranks that compute no loss); `host_batch`: the
        same rows on the host, where the caller has them, and `with_label_log_probs` as `TeacherRequest` says."""

    def prefetch(self, items: Iterable[Any], *, batch_fn: Callable[[Any], TeacherRequest],
                 depth: int = 1) -> TeacherFeed:
        """(item, logits of `batch_fn(item)`) for every item in order; may fetch up to `depth` items ahead."""

    def close(self, timeout: datetime.timedelta | None = None) -> None:
        """Release the teacher: no more requests follow; `timeout` bounds a wait for a remote teacher."""


class LocalTeacher:
    """A teacher on the student's own ranks: `forward(request)` computes the answer in place."""

    def __init__(self, forward: Callable[[TeacherRequest], Encoded | None]) -> None:
        self._forward = forward

    def request(self, batch: Batch, logits_transport: str, *, host_batch: Batch | None = None,
                with_label_log_probs: bool = False) -> Encoded | None:
        return self._forward(TeacherRequest(batch, logits_transport, with_label_log_probs=with_label_log_probs))

    def prefetch(self, items: Iterable[Any], *, batch_fn: Callable[[Any], TeacherRequest],
                 depth: int = 1) -> TeacherFeed:
        return TeacherFeed((item, self._forward(batch_fn(item))) for item in items)

    def close(self, timeout: datetime.timedelta | None = None) -> None:
        pass


class TeacherClient:
    """The student side of a teacher on its own ranks: every student rank calls it in the same order."""

    def __init__(self, bridge: KDMeshBridge) -> None:
        if not bridge.is_student:
            raise ValueError(f"rank {bridge.rank} is not a student rank: only student ranks request teacher logits")
        self.bridge = bridge

    def request(self, batch: Batch, logits_transport: str, *, host_batch: Batch | None = None,
                with_label_log_probs: bool = False) -> Encoded | None:
        return self.exchange(TeacherRequest(batch, logits_transport,
                                            with_label_log_probs=with_label_log_probs).to_wire())

    def exchange(self, payload: Any) -> Any:
        """One request with any nested `payload` (the wire form of a request); what the teacher answered."""
        bridge = self.bridge
        if bridge.broadcast_command(RUN_TEACHER) != RUN_TEACHER:
            # Only the first student rank's command counts: it has stopped the teacher loop (its own run
            # failed, say), so there is nobody left to serve this request.
            raise RuntimeError(f"student rank {bridge.student_ranks[0]} stopped the teacher loop")
        received, failure = None, None
        for wave in range(bridge.num_waves):
            try:
                bridge.send_batch(wave, payload)
                logits = bridge.send_logits(wave, None)
                if logits is not None:
                    received = logits
            except (ValueError, RuntimeError) as raised:
                failure = failure or raised
        if failure is not None:
            raise failure
        if received is None and bridge.receives_logits:
            raise RuntimeError(f"student rank {bridge.rank} received no teacher logits")
        return received

    def prefetch(self, items: Iterable[Any], *, batch_fn: Callable[[Any], TeacherRequest],
                 depth: int = 1) -> TeacherFeed:
        """Depth 0 asks on demand on the caller's thread; otherwise a `TeacherPrefetcher` asks ahead."""
        if depth == 0:
            return TeacherFeed((item, self.exchange(batch_fn(item).to_wire())) for item in items)
        return TeacherPrefetcher(self.bridge, items, depth=depth, batch_fn=lambda item: batch_fn(item).to_wire())

    def close(self, timeout: datetime.timedelta | None = None) -> None:
        """Send STOP_TEACHER (only the first student rank's command counts); `timeout` bounds the wait."""
        self.bridge.broadcast_command(STOP_TEACHER, timeout=timeout)


class TeacherServer:
    """The teacher side: every teacher rank serves requests until the student sends STOP_TEACHER."""

    def __init__(self, bridge: KDMeshBridge) -> None:
        if not bridge.is_teacher:
            raise ValueError(f"rank {bridge.rank} is not a teacher rank: only teacher ranks serve")
        self.bridge = bridge
        self.is_output = bridge.rank in {replica.output_rank for replica in bridge.teacher_replicas}

    def serve(self, forward: Callable[[TeacherRequest], Encoded | None]) -> int:
        """Answer requests with `forward(request)` until STOP_TEACHER; returns how many were served.

        `forward` runs on every rank of the teacher replica (with the request on the device); what it
        returns on the replica's output rank is sent back, the encoded logits. If it raises, the output
        rank sends the error instead and every rank raises it once all waves of the request ran.
        """
        bridge, served = self.bridge, 0
        while bridge.broadcast_command() == RUN_TEACHER:
            failure = None
            for wave in range(bridge.num_waves):
                answer, error = None, None
                try:
                    request = TeacherRequest.from_wire(bridge.move_to_device(bridge.send_batch(wave, None)))
                    answer = forward(request)
                except Exception as raised:  # noqa: BLE001 - sent to the student, then raised here
                    failure = failure or raised
                    error = f"teacher rank {bridge.rank} failed on this batch: {raised}"
                try:  # after `error` the source raises too: the failure is already recorded
                    bridge.send_logits(wave, answer if self.is_output else None,
                                       error=error if self.is_output else None)
                except (ValueError, RuntimeError) as raised:
                    failure = failure or raised
            if failure is not None:
                raise failure
            served += 1
        return served


class TeacherPrefetcher(TeacherFeed):
    """Fetch teacher logits for upcoming micro-batches on a background thread while the caller trains.

    The student side of the teacher loop, double-buffered: while the caller trains on micro-batch i, a
    background thread already runs the request for micro-batch i + 1 (`TeacherClient.exchange`), the very
    collectives a synchronous student issues, in the same order. The teacher loop is unchanged: it serves
    requests in order. The logits, and so the loss curve, are those of the synchronous loop.

    Why it cannot deadlock. The rule: no process group is used from two threads while the prefetcher runs.
    Its thread is the only one to issue the bridge's collectives (the control group and the route groups;
    the bridge refuses other threads), and it issues no other; the caller's own collectives (data-parallel
    reductions, FSDP, the student group's agreements) are on other groups. So each group sees its
    collectives in one thread's program order, the same on every rank: the bridge's in request order
    exactly as in the synchronous loop. Groups of the two threads progress independently of each other.
    The thread creates no communicator: the bridge made every one of its own while it was built (one
    warm-up collective per group, `KDMeshBridge`), so NCCL never creates one on this thread while the
    caller's creates FSDP2's.

    On CUDA the requests run on a stream of their own (NCCL launches a blocking collective on the caller's
    current stream): the bridge's collectives then never queue behind the training kernels the caller
    issues meanwhile, nor training's behind them (one stream shared by two communicators deadlocks when two
    ranks queue their operations in different orders), and the request's `.item()` calls do not wait for
    that training. Events hand the results over: a request's stream first waits for what the caller had
    queued when its item was drawn (an item may hold tensors the caller made, completions say), and the
    caller's current stream waits for the request's event before it gets the item and its logits; the
    tensors crossing streams are recorded on the stream that uses them (`record_stream`), so the caching
    allocator does not reuse their memory too early. Kernels of two communicators running concurrently is
    what NCCL allows but does not guarantee for every launch configuration. On the CPU none of this applies.

    Args:
        bridge: the bridge the teacher loop serves; claimed by the prefetcher until it is closed.
        items: the micro-batches, or any items from which `batch_fn` extracts the nested payload to send
            (only the student input ranks' payloads travel). Drawn lazily on the background thread: at
            most `depth` items beyond the one the caller holds have been drawn.
        depth: requests ahead of the item the caller holds. 1 (default) is double buffering; 0 fetches
            only on demand, which is the synchronous loop (for comparisons).
        batch_fn: item -> nested payload to send; default the item itself.

    Iterating yields `(item, teacher_logits)` in order, teacher_logits as `send_logits` returns them (a
    tensor, or an encoded dict; None on pipeline stages before a student's last). An error on the
    background thread (a teacher that sent an error, a timeout) is raised by the iteration, on the
    caller's thread. Exhausting the items or calling `close()` (also on leaving a `with` block, see
    `TeacherFeed`) ends the thread: a request in flight completes (the teacher answers it; its logits are
    dropped), no new one starts, and the bridge is released, so the caller can then send STOP_TEACHER itself.
    """

    _END = object()

    def __init__(
        self,
        bridge: KDMeshBridge,
        items: Iterable[Any],
        *,
        depth: int = 1,
        batch_fn: Callable[[Any], Any] | None = None,
    ) -> None:
        client = TeacherClient(bridge)
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        if bridge.claimed:
            raise RuntimeError("this KDMeshBridge is already driven by another TeacherPrefetcher")
        self.bridge = bridge
        self.depth = depth
        self._client = client
        self._items = iter(items)
        self._batch_fn = batch_fn or (lambda item: item)
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        # One permit per request the thread may start: `depth` up front, one more each time the caller asks.
        self._permits = threading.Semaphore(depth)
        self._closing = False
        self._closed = False
        self.num_fetched = 0  # requests answered so far (the caller may not have taken them yet)
        # CUDA only: the caller's stream at construction and the requests' own stream (see the docstring).
        self._caller_stream = self._stream = None
        if bridge.device.type == "cuda":
            self._caller_stream = torch.cuda.current_stream(bridge.device)
            self._stream = torch.cuda.Stream(bridge.device)
        self._thread = threading.Thread(target=self._run, name="meshkd-teacher-prefetch", daemon=True)
        self._thread.start()
        bridge.owner_thread = self._thread.ident

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return self

    def __next__(self) -> tuple[Any, Any]:
        if self._closed:
            raise StopIteration
        self._permits.release()
        kind, payload = self._ready.get()
        if kind == "item":
            pair, ready = payload
            if ready is not None:  # CUDA: what the request's stream did comes before the caller's use of it
                stream = torch.cuda.current_stream(self.bridge.device)
                stream.wait_event(ready)
                for tensor in cuda_tensors(pair):
                    tensor.record_stream(stream)
            return pair
        self.close()
        if kind == "error":
            raise payload
        raise StopIteration

    def close(self, timeout: float | None = None) -> bool:
        """Stop requesting, wait for a request in flight to complete, and release the bridge.

        With `timeout` (seconds) it waits at most that long: a request whose peers never take part (after
        a failure elsewhere) would otherwise hold it until the collective timeout. Returns whether the
        bridge was released; if not, the thread is left to the process exit and the bridge stays claimed.
        """
        if self._closed:
            return True
        self._closing = True
        self._permits.release()  # wakes the thread if it waits for a permit; it then sees `_closing`
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self._closed = True
        self.bridge.owner_thread = None
        return True

    def _run(self) -> None:
        try:
            streamed = contextlib.nullcontext()
            if self._stream is not None:
                # Object collectives and new tensors take the current device, which is per thread.
                torch.cuda.set_device(self.bridge.device)
                streamed = torch.cuda.stream(self._stream)
            with streamed:
                while True:
                    self._permits.acquire()
                    if self._closing:
                        return
                    item = next(self._items, self._END)
                    if item is self._END:
                        self._ready.put(("end", None))
                        return
                    payload = self._batch_fn(item)
                    ready = None
                    if self._stream is not None:
                        self._stream.wait_stream(self._caller_stream)
                        for tensor in cuda_tensors(payload):
                            tensor.record_stream(self._stream)
                    logits = self._client.exchange(payload)
                    if self._stream is not None:
                        ready = torch.cuda.Event()
                        ready.record(self._stream)
                    self.num_fetched += 1
                    self._ready.put(("item", ((item, logits), ready)))
        except BaseException as raised:  # noqa: BLE001 - handed to the caller's thread, which raises it
            self._ready.put(("error", raised))


def cuda_tensors(value: Any) -> list[torch.Tensor]:
    """The CUDA tensors of a nested value (dicts, lists, tuples), in traversal order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_cuda else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in cuda_tensors(item)]
    return []

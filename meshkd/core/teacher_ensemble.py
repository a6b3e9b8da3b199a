"""Several teachers as one teacher source: every teacher asked for each micro-batch at once, answers combined.

Design. `TeacherEnsemble` is a `meshkd.core.teacher_protocol.TeacherSource` over named member sources, each
a teacher on the student's ranks (`LocalTeacher`) or on ranks of its own (`TeacherClient`, with a bridge of
its own). Its answer to a request holds every member's answer: `{"mode": TEACHERS, "answers": {name:
answer}}`. Its feed hands each member the same items through `SharedItems` (a thread-safe tee): members
that prefetch draw them on their own threads, so with `kd.overlap_teacher` every teacher works on the same
micro-batch at the same time, while the student trains on the previous one; the step then waits for the
slowest teacher, not for their sum. Without overlap the members are asked in turn. A member's failure is
raised inside `watch(operation, role)` with that teacher's role, so a lost teacher is named.

How the student combines the answers into its KD term (`kd.combine`: sum, mixture, route) is the answer's
own: `meshkd.recipe.teacher.teacher_answers.Ensemble`.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from meshkd.core.teacher_protocol import (
    LABEL_LOG_PROBS,
    Batch,
    Encoded,
    TeacherFeed,
    TeacherRequest,
    TeacherSource,
    cuda_tensors,
)

TEACHERS = "teachers"
"""The mode of an ensemble's answer: {"mode": TEACHERS, "answers": {name: answer}, "wait_s": {name: seconds}}."""
ROUTE = "teacher"
"""The batch field of routed rows: [rows, 1] int64, each row's teacher's index in the ensemble's order."""

Watch = Callable[[str, str], Any]


class SharedItems:
    """One iterator read by several consumers, each seeing every item in order, from any thread.

    The first consumer to need an item draws it (under a lock) and queues it for the others. On CUDA the
    drawing thread's stream is synchronized first: another consumer's thread uses the item on its own stream.
    """

    _END = object()

    def __init__(self, items: Iterable[Any], consumers: int) -> None:
        self._items = iter(items)
        self._lock = threading.Lock()
        self._queues = [collections.deque() for _ in range(consumers)]

    def reader(self, index: int) -> Iterator[Any]:
        queue = self._queues[index]
        while True:
            with self._lock:
                if not queue:
                    item = next(self._items, self._END)
                    if item is self._END:
                        return
                    if cuda_tensors(item):
                        torch.cuda.current_stream().synchronize()
                    for waiting in self._queues:
                        waiting.append(item)
                item = queue.popleft()
            yield item


class TeacherEnsemble:
    """Named teacher sources asked as one (see the module docstring).

    Args:
        sources: teacher name -> its source, in the run's order.
        roles: teacher name -> how failures name it (`TeacherSetups.role`).
        watch: `FaultWatch.watch`: each member's answer is awaited inside `watch(operation, its role)`.
        transports: teacher name -> the encoding its logits travel in, where it is not the one asked for
            (a request for label log-probabilities only is passed on as it is).
        route: each teacher is asked for the rows whose `ROUTE` field holds its index only (possibly none).
    """

    def __init__(self, sources: dict[str, TeacherSource], *, roles: dict[str, str], watch: Watch | None = None,
                 transports: dict[str, str] | None = None, route: bool = False) -> None:
        self.sources = sources
        self.roles = roles
        self.transports = transports or {}
        self.route = route
        self._watch = watch or (lambda operation, role: contextlib.nullcontext())

    @classmethod
    def of(cls, sources: dict[str, TeacherSource], **settings: Any) -> TeacherSource:
        """The run's one teacher source: a single teacher's own (one teacher is the list of one: its answers
        and figures are its own, no ensemble's), several as one `TeacherEnsemble(sources, **settings)`."""
        if len(sources) == 1:
            return next(iter(sources.values()))
        return cls(sources, **settings)

    def _member_request(self, index: int, name: str, request: TeacherRequest) -> TeacherRequest:
        """What member `name` (`index`-th) is asked: its own transport; with `route` only its rows."""
        batch, host = request.batch, request.host_batch
        if self.route:
            rows = batch[ROUTE][:, 0] == index
            batch = {key: value[rows] for key, value in batch.items()}
            if host is not None:
                rows = host[ROUTE][:, 0] == index
                host = {key: value[rows] for key, value in host.items()}
        return TeacherRequest(batch, self._transport(name, request.logits_transport), host,
                              with_label_log_probs=request.with_label_log_probs)

    def _transport(self, name: str, asked: str) -> str:
        """What member `name` is asked for: its own encoding of the logits in place of the one `asked`."""
        return self.transports.get(name, asked) if asked != LABEL_LOG_PROBS else asked

    def request(self, batch: Batch, logits_transport: str, *, host_batch: Batch | None = None,
                with_label_log_probs: bool = False) -> Encoded | None:
        """Every member's answer to the request, in turn (evaluations ask this way)."""
        answers, waits = {}, {}
        for index, (name, source) in enumerate(self.sources.items()):
            started = time.perf_counter()
            request = self._member_request(index, name, TeacherRequest(batch, logits_transport, host_batch,
                                                                       with_label_log_probs))
            with self._watch("the teacher request", self.roles[name]):
                answers[name] = source.request(request.batch, request.logits_transport, host_batch=request.host_batch,
                                               with_label_log_probs=with_label_log_probs)
            waits[name] = time.perf_counter() - started
        return _combined(answers, waits)

    def prefetch(self, items: Iterable[Any], *, batch_fn: Callable[[Any], TeacherRequest],
                 depth: int = 1) -> TeacherFeed:
        shared = SharedItems(items, len(self.sources))

        def member_batch_fn(index: int, name: str) -> Callable[[Any], TeacherRequest]:
            return lambda item: self._member_request(index, name, batch_fn(item))

        feeds = {name: source.prefetch(shared.reader(index), batch_fn=member_batch_fn(index, name), depth=depth)
                 for index, (name, source) in enumerate(self.sources.items())}

        def pairs() -> Iterator[tuple[Any, Encoded | None]]:
            while True:
                item, answers, waits = None, {}, {}
                for name, feed in feeds.items():
                    started = time.perf_counter()
                    with self._watch("the teacher request", self.roles[name]):
                        pair = next(feed, None)
                    if pair is None:
                        return
                    waits[name] = time.perf_counter() - started
                    item, answers[name] = pair
                yield item, _combined(answers, waits)

        def close(timeout: float | None) -> bool:
            return all([feed.close(timeout) for feed in feeds.values()])  # every one, even after a failure

        return TeacherFeed(pairs(), close=close)

    def close(self, timeout=None) -> None:
        """Release every teacher (the first failure is raised once all were asked)."""
        failure = None
        for name, source in self.sources.items():
            try:
                with self._watch("broadcast_command", self.roles[name]):
                    source.close(timeout=timeout)
            except Exception as raised:  # noqa: BLE001 - the others are still released
                failure = failure or raised
        if failure is not None:
            raise failure


def _combined(answers: dict[str, Encoded | None], waits: dict[str, float]) -> Encoded | None:
    """The ensemble's answer, or None where no member answered (pipeline stages before the student's last)."""
    if all(answer is None for answer in answers.values()):
        return None
    return {"mode": TEACHERS, "answers": answers, "wait_s": waits}

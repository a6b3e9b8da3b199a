"""Several teachers as one teacher source: every teacher asked for each micro-batch at once, answers combined.

Design. `TeacherEnsemble` is a `meshkd.core.teacher_protocol.TeacherSource` over named member sources, each
a teacher on the student's ranks (`LocalTeacher`) or on ranks of its own (`TeacherClient`, with a bridge of
its own). Its answer to a request holds every member's answer: `{"mode": TEACHERS, "answers": {name:
answer}}`. Its feed hands each member the same items through `SharedItems` (a thread-safe tee): members
that prefetch draw them on their own threads, so with `kd.overlap_teacher` every teacher works on the same
micro-batch at the same time, while the student trains on the previous one; the step then waits for the
slowest teacher, not for their sum. Without overlap the members are asked in turn. A member's failure is
raised inside `watch(operation, role)` with that teacher's role, so a lost teacher is named.

How answers combine into the KD term (`combined_kd_loss`), with weights w normalized to sum to 1:
- "sum": sum_i w_i D(teacher_i || student), each divergence on its own answer, any transport;
- "mixture": D(sum_i w_i p_i || student), against the mixture of the teachers' distributions at the
  temperature (`mix_full_answers`; whole-distribution answers: full or full_bf16);
- "route": each row's divergence to its own teacher, which alone was asked for it (the rows' `ROUTE` field;
  the answers put back together by `merge_routed_answers`).
Two identical teachers give the one-teacher objective by sum or mixture, and a weight of 0 drops a teacher.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from meshkd.core.logits_codec import LOGITS_MODES
from meshkd.core.teacher_protocol import Batch, Encoded, TeacherFeed, TeacherRequest, TeacherSource, cuda_tensors

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

    def _member_request(self, index: int, name: str, request: TeacherRequest) -> TeacherRequest:
        """What member `name` (`index`-th) is asked: its own transport; with `route` only its rows."""
        batch = request.batch
        if self.route:
            rows = batch[ROUTE][:, 0] == index
            batch = {key: value[rows] for key, value in batch.items()}
        return TeacherRequest(batch, self._transport(name, request.logits_transport))

    def _transport(self, name: str, asked: str) -> str:
        """What member `name` is asked for: its own encoding of the logits in place of the one in `asked`."""
        mode, plus, rest = asked.partition("+")
        return self.transports[name] + plus + rest if name in self.transports and mode in LOGITS_MODES else asked

    def request(self, batch: Batch, logits_transport: str) -> Encoded | None:
        """Every member's answer to the request, in turn (evaluations ask this way)."""
        answers, waits = {}, {}
        for index, (name, source) in enumerate(self.sources.items()):
            started = time.perf_counter()
            request = self._member_request(index, name, TeacherRequest(batch, logits_transport))
            with self._watch("the teacher request", self.roles[name]):
                answers[name] = source.request(request.batch, request.logits_transport)
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


def mix_full_answers(answers: dict[str, Encoded], weights: dict[str, float], *, temperature: float) -> Encoded:
    """One "full" answer whose distribution at `temperature` is the mixture sum_i w_i softmax(z_i / T).

    Its logits are z_r + T log sum_i w_i p_i / p_r, r the first teacher of weight > 0: the mixture's log
    probabilities up to a constant, which the loss's softmax drops. Taken relative to one teacher, so that
    teachers that agree (and teachers of weight 0) give back exactly that teacher's logits."""
    for name, answer in answers.items():
        if answer.get("mode") not in ("full", "full_bf16"):
            raise ValueError(f"teacher {name!r} answered {answer.get('mode')!r}: a mixture of teachers needs their "
                             "whole distributions (logits_transport full or full_bf16)")
    kept = [name for name in answers if weights[name] > 0]
    reference = answers[kept[0]]["logits"].float()
    reference_norm = torch.logsumexp(reference / temperature, dim=-1, keepdim=True)
    terms = []
    for name in kept:  # log(w_i p_i / p_r), from the logits' differences: exactly log w_r for the reference
        logits = answers[name]["logits"].float()
        norm = torch.logsumexp(logits / temperature, dim=-1, keepdim=True)
        terms.append((logits - reference) / temperature - (norm - reference_norm) + math.log(weights[name]))
    return {"mode": "full", "logits": reference + temperature * torch.logsumexp(torch.stack(terms), dim=0)}


def answered_rows(answer: Encoded) -> int:
    """The rows one teacher's answer covers (every tensor of an encoding is [rows, ...])."""
    return next(value.shape[0] for value in answer.values() if isinstance(value, torch.Tensor))


def merge_routed_answers(answers: dict[str, Encoded], rows: dict[str, torch.Tensor]) -> Encoded:
    """One answer for the whole micro-batch from each teacher's answer for its rows (`rows`: name -> bool [rows]).

    The teachers answer in one encoding (full_bf16 next to full is taken as float32)."""
    modes = {answer["mode"].replace("full_bf16", "full") for answer in answers.values()}
    if len(modes) > 1:
        raise ValueError(f"routed teachers answered in different encodings {sorted(modes)}: give them one "
                         "logits_transport")
    for name, answer in answers.items():
        if answered_rows(answer) != int(rows[name].sum()):
            raise ValueError(f"teacher {name!r} answered {answered_rows(answer)} rows, not the "
                             f"{int(rows[name].sum())} routed to it")
    first = next(iter(answers.values()))
    total = next(iter(rows.values())).shape[0]
    merged = {}
    for key, value in first.items():
        if not isinstance(value, torch.Tensor):
            merged[key] = value
            continue
        dtype = torch.float32 if value.is_floating_point() else value.dtype
        merged[key] = value.new_zeros((total, *value.shape[1:]), dtype=dtype)
        for name, answer in answers.items():
            merged[key][rows[name]] = answer[key].to(dtype)
    merged["mode"] = "full" if first["mode"] == "full_bf16" else first["mode"]
    return merged


def combined_kd_loss(answer: Encoded, loss_fn: Callable[..., torch.Tensor], *, weights: dict[str, float],
                     combine: str, temperature: float, routes: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the KD term of an ensemble's answer, each teacher's own divergence, detached) by `combine`.

    `loss_fn(answer, rows=None)`: the divergence of the student's logits to one answer at `temperature`
    (over `rows` only: a bool [rows] mask). "sum" weighs the members' divergences; "mixture" takes the
    divergence to their mixture (`mix_full_answers`), and each member's own divergence for the metrics only;
    "route" the divergence of each row to its teacher (`routes`: [rows] each row's teacher's index)."""
    answers = answer["answers"]
    if combine == "route":
        rows = {name: routes == index for index, name in enumerate(answers)}
        merged = merge_routed_answers(answers, rows)
        each = {name: loss_fn(merged, rows[name]) for name in answers}
        return sum(each.values()), {name: loss.detach() for name, loss in each.items()}
    if combine == "sum":
        each = {name: loss_fn(member) for name, member in answers.items()}
        total = sum(weights[name] * loss for name, loss in each.items())
        return total, {name: loss.detach() for name, loss in each.items()}
    if combine != "mixture":
        raise ValueError(f"combine must be sum, mixture or route, got {combine!r}")
    total = loss_fn(mix_full_answers(answers, weights, temperature=temperature))
    with torch.no_grad():
        each = {name: loss_fn(member).detach() for name, member in answers.items()}
    return total, each

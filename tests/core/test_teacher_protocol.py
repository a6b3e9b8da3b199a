"""The teacher protocol on a real 5-rank gloo world: requests, served answers, failures and prefetching.

A student of 3 replicas asks a teacher of 2 (two routing waves per request). The client's answers are
the teacher's for exactly that batch; a teacher whose forward fails sends its error, so the student raises
the teacher's message instead of waiting; the prefetcher yields the synchronous loop's logits in order,
one request ahead, and raises a teacher's refusal on the caller's thread.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from meshkd.core.bridge import RUN_TEACHER, STOP_TEACHER, KDMeshBridge
from meshkd.core.teacher_protocol import (
    LocalTeacher,
    TeacherClient,
    TeacherPrefetcher,
    TeacherRequest,
    TeacherServer,
)
from meshkd.core.topology import create_kd_distributed_setups
from tests.collectives import audited_collectives
from tests.core.test_bridge import logits_for, make_bridge
from tests.trees import assert_same_tree
from tests.world import world_test

WORLD = 5


def test_a_malformed_request_is_refused_naming_what_is_wrong():
    batch = {"input_ids": torch.zeros(1, 3, dtype=torch.int64)}
    assert TeacherRequest.from_wire(TeacherRequest(batch, "topk").to_wire()).logits_transport == "topk"
    both = TeacherRequest.from_wire(TeacherRequest(batch, "topk", with_label_log_probs=True).to_wire())
    assert both.with_label_log_probs and both.logits_transport == "topk"
    with pytest.raises(ValueError, match=r"keys \['batch', 'logits_transport', 'with_label_log_probs'\], got "
                                         r"\['batch'\]"):
        TeacherRequest.from_wire({"batch": batch})
    with pytest.raises(ValueError, match="with_label_log_probs a bool"):
        TeacherRequest.from_wire({"batch": batch, "logits_transport": "full", "with_label_log_probs": "yes"})
    with pytest.raises(ValueError, match="with_label_log_probs goes beside an encoding of the logits"):
        TeacherRequest.from_wire({"batch": batch, "logits_transport": "label_log_probs", "with_label_log_probs": True})
    with pytest.raises(ValueError, match="input_ids tensor"):
        TeacherRequest.from_wire({"batch": {"ids": batch["input_ids"]}, "logits_transport": "full",
                                  "with_label_log_probs": False})
    with pytest.raises(ValueError, match="got list"):
        TeacherRequest.from_wire([batch])


def test_a_local_teacher_answers_in_place_and_in_order():
    asked = []
    teacher = LocalTeacher(lambda request: asked.append(request) or {"mode": request.logits_transport})
    assert teacher.request({"input_ids": torch.zeros(1, 2)}, "full") == {"mode": "full"}
    pairs = list(teacher.prefetch(range(3), batch_fn=lambda i: TeacherRequest({"input_ids": torch.full((1, 2), i)},
                                                                              "topk")))
    assert [item for item, _ in pairs] == [0, 1, 2] and len(asked) == 4
    teacher.close()


class FakeCudaStreams:
    """torch.cuda's streams and events as recorders (no GPU here): which stream each step runs on, in order."""

    def __init__(self, monkeypatch) -> None:
        self.log: list[tuple[str, ...]] = []
        self.default = self.Stream("caller")
        self._local = threading.local()
        self._events = 0
        streams = self

        class Event:
            def record(self, stream) -> None:
                streams._events += 1
                self.name = f"event{streams._events}"
                streams.log.append((stream.name, "records", self.name))

        self.Event = Event
        for name, value in {"Stream": lambda device=None: self.Stream("own"), "Event": Event,
                            "current_stream": self.current_stream, "stream": self.stream,
                            "set_device": lambda device: None}.items():
            monkeypatch.setattr(torch.cuda, name, value)

    def Stream(self, name: str):  # noqa: N802 - stands in for the class torch.cuda.Stream
        log = self.log

        class Stream:
            def wait_stream(self, other) -> None:
                log.append((self.name, "waits for", other.name))

            def wait_event(self, event) -> None:
                log.append((self.name, "waits for", event.name))

        stream = Stream()
        stream.name = name
        return stream

    def current_stream(self, device=None):
        return getattr(self._local, "stream", self.default)

    @contextlib.contextmanager
    def stream(self, stream):
        self._local.stream = stream
        try:
            yield
        finally:
            del self._local.stream


class FakeCudaBridge:
    """A one-rank student side of a bridge on "cuda" whose collectives are recorded on the current stream."""

    def __init__(self, streams: FakeCudaStreams) -> None:
        self.streams, self.device, self.rank, self.student_ranks = streams, torch.device("cuda", 0), 0, [0]
        self.is_student, self.receives_logits, self.num_waves, self.owner_thread = True, True, 1, None

    @property
    def claimed(self) -> bool:
        return self.owner_thread is not None

    def _record(self, what: str) -> None:
        self.streams.log.append((self.streams.current_stream().name, what))

    def broadcast_command(self, command=None, *, timeout=None) -> int:
        self._record("command")
        return command

    def send_batch(self, wave: int, payload) -> None:
        self._record(f"batch {payload}")

    def send_logits(self, wave: int, logits) -> str:
        self._record("logits")
        return "answer"


def test_on_cuda_the_prefetcher_runs_requests_on_its_own_stream_and_hands_over_by_events(monkeypatch):
    streams = FakeCudaStreams(monkeypatch)
    handed = []
    with TeacherPrefetcher(FakeCudaBridge(streams), range(2)) as prefetcher:
        for item, answer in prefetcher:
            handed.append((item, answer, len(streams.log)))
    log = streams.log
    assert [item for item, _, _ in handed] == [0, 1] and all(answer == "answer" for _, answer, _ in handed)
    for item, event in ((0, "event1"), (1, "event2")):
        # On its own stream, after what the caller had queued; the caller's stream waits for the request's event.
        request = [("own", "waits for", "caller"), ("own", "command"), ("own", f"batch {item}"), ("own", "logits"),
                   ("own", "records", event)]
        start = log.index(request[0], log.index(("own", "records", "event1")) + 1 if item else 0)
        assert log[start : start + len(request)] == request, log
        waited = log.index(("caller", "waits for", event))
        assert waited > start + len(request) - 1 and waited < handed[item][2], log
    assert not [entry for entry in log if entry[0] == "caller" and entry[1] != "waits for"]


def protocol_batch(index: int) -> dict:
    return {"input_ids": torch.full((1, 3), index), "position_ids": torch.arange(3)[None],
            "attention_mask": torch.ones(1, 3, dtype=torch.int64)}


def answer(request: TeacherRequest) -> dict:
    """A fake teacher's encoded answer: depends on the batch, so mixups show."""
    return {"mode": "full", "logits": request.batch["input_ids"].float().unsqueeze(-1) * 10}


def check_client_requests_get_the_teachers_answer_for_their_own_batch():
    bridge = make_bridge({"dp_size": 3}, {"dp_size": 2})
    if bridge.is_teacher:
        assert TeacherServer(bridge).serve(answer) == 6
        return
    client = TeacherClient(bridge)
    replica = next(i for i, r in enumerate(bridge.student_replicas) if dist.get_rank() in r.ranks)
    items = [replica * 10 + i for i in range(3)]
    synchronous = [client.request(protocol_batch(i), "full") for i in items]
    prefetched = list(client.prefetch(items, batch_fn=lambda i: TeacherRequest(protocol_batch(i), "full")))
    assert [item for item, _ in prefetched] == items
    for index, got, (_, ahead) in zip(items, synchronous, prefetched):
        want = answer(TeacherRequest(protocol_batch(index), "full"))
        assert_same_tree(got, want)
        assert_same_tree(ahead, want)
    client.close()


def check_a_failing_teacher_forward_reaches_the_student_and_the_next_request_works():
    bridge = make_bridge({"dp_size": 3}, {"dp_size": 2})
    if bridge.is_teacher:
        def forward(request: TeacherRequest) -> dict:
            if int(request.batch["input_ids"][0, 0]) == 1:
                raise ValueError("no logits for index 1")
            return answer(request)

        server = TeacherServer(bridge)
        with pytest.raises(ValueError, match="no logits for index 1"):
            server.serve(forward)
        assert server.serve(forward) == 1
        return
    client = TeacherClient(bridge)
    with pytest.raises(RuntimeError, match=r"teacher rank [34] failed on this batch: no logits for index 1"):
        client.request(protocol_batch(1), "full")
    assert_same_tree(client.request(protocol_batch(2), "full"), answer(TeacherRequest(protocol_batch(2), "full")))
    client.close()


def serve(bridge: KDMeshBridge, *, fail_on: int | None = None) -> int:
    """A teacher loop on the bare bridge; `fail_on`: a request whose logits every output rank refuses."""
    rank, served = dist.get_rank(), 0
    output_ranks = {r.output_rank for r in bridge.teacher_replicas}
    while bridge.broadcast_command() == RUN_TEACHER:
        for wave in range(bridge.num_waves):
            batch = bridge.send_batch(wave, None)
            time.sleep(0.01)
            logits = logits_for(batch) if rank in output_ranks and served != fail_on else None
            with contextlib.suppress(ValueError):  # this rank's own refusal
                bridge.send_logits(wave, logits)
        served += 1
    return served


def request_batch(index: int) -> dict:
    return {"input_ids": torch.full((1, 3), index), "index": dist.get_rank() * 100 + index}


def check_prefetcher_yields_the_synchronous_sequence_one_ahead():
    bridge = make_bridge({"dp_size": 3}, {"dp_size": 2})
    count = 5
    if bridge.is_teacher:
        assert serve(bridge) == count and serve(bridge) == count
        return
    synchronous = []
    for index in range(count):
        bridge.broadcast_command(RUN_TEACHER)
        for wave in range(bridge.num_waves):
            bridge.send_batch(wave, request_batch(index))
            logits = bridge.send_logits(wave, None)
            if logits is not None:
                synchronous.append(logits)
    bridge.broadcast_command(STOP_TEACHER)
    prefetched = []
    with TeacherPrefetcher(bridge, range(count), batch_fn=request_batch) as prefetcher:
        for position, (item, logits) in enumerate(prefetcher):
            assert item == position
            prefetched.append(logits)
            if position + 1 < count:  # the next request completes while this one is held
                deadline = time.monotonic() + 30
                while prefetcher.num_fetched < position + 2:
                    assert time.monotonic() < deadline, "the next micro-batch was not fetched ahead"
                    time.sleep(0.005)
                # ... and no further: depth 1 keeps one request ahead of the caller.
                time.sleep(0.05)
                assert prefetcher.num_fetched == position + 2
            with pytest.raises(RuntimeError, match="driven by a running TeacherPrefetcher"):
                bridge.broadcast_command(STOP_TEACHER)
    assert len(prefetched) == len(synchronous) == count
    for got, want in zip(prefetched, synchronous):
        assert_same_tree(got, want)
    bridge.broadcast_command(STOP_TEACHER)  # released once the items ran out


def check_prefetcher_raises_teacher_errors_and_closes_cleanly():
    bridge = make_bridge({"dp_size": 3}, {"dp_size": 2})
    if bridge.is_teacher:
        assert serve(bridge, fail_on=2) == 3  # requests 0, 1 and the refused 2; then STOP
        assert serve(bridge) == 2  # stopped early by the caller: the request in flight still completes
        bridge.synchronize()
        return
    taken = []
    prefetcher = TeacherPrefetcher(bridge, range(6), batch_fn=request_batch)
    with pytest.raises(RuntimeError, match="passed logits=NoneType"), prefetcher:
        for item, _ in prefetcher:
            taken.append(item)
    assert taken == [0, 1]
    bridge.broadcast_command(STOP_TEACHER)
    with TeacherPrefetcher(bridge, range(6), batch_fn=request_batch) as prefetcher:
        item, _ = next(prefetcher)
        while prefetcher.num_fetched < 2:  # request 1 is fetched ahead; then the caller stops early
            time.sleep(0.005)
    assert item == 0
    bridge.broadcast_command(STOP_TEACHER)
    bridge.synchronize()


def check_while_prefetching_no_group_is_used_from_two_threads():
    # The prefetcher's rule: its thread issues the bridge's collectives, in the synchronous loop's order, and
    # no other; the caller's own (an all-reduce over the student group per item, as at a step boundary) are
    # on other groups. Every tensor is on the bridge's device. Two fresh bridges: the same route history.
    bridges = [make_bridge({"dp_size": 3}, {"dp_size": 2}) for _ in range(2)]
    count = 4
    if bridges[0].is_teacher:
        assert serve(bridges[0]) == count and serve(bridges[1]) == count
        return
    with audited_collectives(bridges[0].device) as synchronous:
        client = TeacherClient(bridges[0])
        for index in range(count):
            client.exchange(request_batch(index))
    client.close()
    bridge, caller = bridges[1], threading.get_ident()
    with audited_collectives(bridge.device) as calls:
        with TeacherPrefetcher(bridge, range(count), batch_fn=request_batch) as prefetcher:
            for _ in prefetcher:
                dist.all_reduce(torch.ones(1), group=bridge.student_group)
    bridge.broadcast_command(STOP_TEACHER)

    def ranks(group) -> tuple[int, ...]:
        return tuple(dist.get_process_group_ranks(group))

    ahead = [call for call in calls if call.thread != caller]
    own = [call for call in calls if call.thread == caller]
    assert [(c.name, ranks(c.group)) for c in ahead] == [(c.name, ranks(c.group)) for c in synchronous]
    assert own and not {id(c.group) for c in ahead} & {id(c.group) for c in own}


def check_every_bridge_group_is_first_used_while_the_bridge_is_built_on_its_thread():
    # NCCL creates a communicator at a group's first collective: none of the bridge's may be created first on
    # the prefetcher's thread (while the training thread creates FSDP2's), even where the run asks the
    # teacher nothing before it prefetches (a resumed run reads its first evaluation back from the log).
    with audited_collectives(torch.device("cpu")) as calls:
        bridge = make_bridge({"dp_size": 3}, {"dp_size": 2})
        built = len(calls)
        if bridge.is_teacher:
            assert serve(bridge) == 2
        else:
            with TeacherPrefetcher(bridge, range(2), batch_fn=request_batch) as prefetcher:
                assert [item for item, _ in prefetcher] == [0, 1]
            bridge.broadcast_command(STOP_TEACHER)
    first = {}
    for index, call in enumerate(calls):
        first.setdefault(id(call.group), (index, call.thread))
    rank, here = dist.get_rank(), threading.get_ident()
    mine = [bridge.control_group, *(group for ranks, group in bridge._groups.items() if rank in ranks)]
    assert len(mine) >= 3  # the control group, this role's group and at least one route
    for group in mine:
        index, thread = first[id(group)]
        assert index < built and thread == here, (dist.get_process_group_ranks(group), index, built)


def check_a_teacher_waits_for_the_next_command_longer_than_for_data():
    # Between requests the student may save or export for longer than a transfer may take: a teacher rank
    # waits for the command up to `command_timeout` (student ranks send under `timeout`).
    setups = create_kd_distributed_setups({"separate_meshes": True, "distributed": {"dp_size": 3},
                                           "teacher_distributed": {"dp_size": 2}}, WORLD)
    bridge = KDMeshBridge(setups, torch.device("cpu"), timeout=datetime.timedelta(seconds=3),
                          command_timeout=datetime.timedelta(seconds=60))
    if bridge.is_teacher:
        assert serve(bridge) == 1
    else:
        time.sleep(6)  # twice the timeout, as a slow checkpoint save would
        client = TeacherClient(bridge)
        client.exchange(request_batch(0))
        client.close()
    bridge.synchronize()


test_five_rank_world = world_test(
    WORLD,
    [
        check_every_bridge_group_is_first_used_while_the_bridge_is_built_on_its_thread,
        check_client_requests_get_the_teachers_answer_for_their_own_batch,
        check_a_failing_teacher_forward_reaches_the_student_and_the_next_request_works,
        check_prefetcher_yields_the_synchronous_sequence_one_ahead,
        check_prefetcher_raises_teacher_errors_and_closes_cleanly,
        check_while_prefetching_no_group_is_used_from_two_threads,
        check_a_teacher_waits_for_the_next_command_longer_than_for_data,
    ],
)

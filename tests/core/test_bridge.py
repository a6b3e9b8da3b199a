"""KDMeshBridge and teacher-logits materialization on a real 5-rank gloo world.

Each check lays the 5 ranks out differently: uneven replica counts (3 students on 2 teachers, 4 on 1,
1 on 4), a TP x CP teacher, a TP student, a pipelined student (logits to its last stage only), and a
teacher serving loop driven by commands. Later checks cover the per-route spec cache (fewer collectives
and bytes when a structure repeats, exact values when it changes). The request loop on top of the bridge
is tested in test_teacher_protocol.py.
"""

import contextlib
import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshkd.core import wire
from meshkd.core.answers import encode_teacher_logits
from meshkd.core.bridge import RUN_TEACHER, STOP_TEACHER, KDMeshBridge
from meshkd.core.logits import cp_shard, materialize_teacher_logits
from meshkd.core.topology import create_kd_distributed_setups
from tests.collectives import audited_collectives
from tests.trees import assert_same_tree, sample_batch
from tests.world import world_test

WORLD = 5


def make_bridge(student: dict, teacher: dict) -> KDMeshBridge:
    cfg = {"separate_meshes": True, "distributed": student, "teacher_distributed": teacher}
    setups = create_kd_distributed_setups(cfg, WORLD)
    return KDMeshBridge(setups, torch.device("cpu"), timeout=datetime.timedelta(seconds=60))


def logits_for(batch: dict) -> torch.Tensor:
    """What a fake teacher answers for a batch: depends on the batch, so mixups show."""
    return batch["input_ids"].float().unsqueeze(-1) * 10 + batch["index"]


def exchange_every_wave(bridge: KDMeshBridge) -> dict:
    """Run one full step of send_batch / send_logits over all waves; returns what this rank saw."""
    rank = dist.get_rank()
    seen = {"batches": [], "logits": []}
    my_replica = next((i for i, r in enumerate(bridge.student_replicas) if rank in r.ranks), None)
    for wave in range(bridge.num_waves):
        batch = sample_batch(my_replica) if bridge.is_student else None
        received = bridge.send_batch(wave, batch)
        if bridge.is_teacher:
            seen["batches"].append(received)
            is_output = any(rank == r.output_rank for r in bridge.teacher_replicas)
            logits = logits_for(received) if is_output else None
        else:
            assert received is None
            logits = None
        seen["logits"].append(bridge.send_logits(wave, logits))
    return seen


def check_three_student_replicas_on_two_teacher_replicas():
    bridge = make_bridge({"dp_size": 3}, {"dp_size": 2})
    assert bridge.num_waves == 2
    rank, seen = dist.get_rank(), exchange_every_wave(bridge)
    if bridge.is_teacher:
        teacher_index = rank - 3
        # Wave 0: teacher t serves student t. Wave 1: teacher 0 serves student 2; teacher 1 has no
        # partner and still receives student 0's batch, with no route back.
        expected = [teacher_index, 2 if teacher_index == 0 else 0]
        for batch, index in zip(seen["batches"], expected):
            assert_same_tree(batch, sample_batch(index))
        assert seen["logits"] == [None, None]
    else:
        wave = 0 if rank < 2 else 1
        assert_same_tree(seen["logits"][wave], logits_for(sample_batch(rank)))
        assert seen["logits"][1 - wave] is None
    assert len(bridge.output_routes[1]) == 1


def check_four_student_replicas_on_one_teacher_replica():
    bridge = make_bridge({"dp_size": 4}, {"dp_size": 1})
    assert bridge.num_waves == 4
    rank, seen = dist.get_rank(), exchange_every_wave(bridge)
    if bridge.is_teacher:
        for wave, batch in enumerate(seen["batches"]):
            assert_same_tree(batch, sample_batch(wave))
    else:
        for wave, logits in enumerate(seen["logits"]):
            if wave == rank:
                assert_same_tree(logits, logits_for(sample_batch(rank)))
            else:
                assert logits is None


def check_one_student_replica_on_four_teacher_replicas():
    bridge = make_bridge({"dp_size": 1}, {"dp_size": 4})
    assert bridge.num_waves == 1 and len(bridge.output_routes[0]) == 1
    seen = exchange_every_wave(bridge)
    if bridge.is_teacher:
        assert_same_tree(seen["batches"][0], sample_batch(0))  # the three spares compute and drop it
    else:
        assert_same_tree(seen["logits"][0], logits_for(sample_batch(0)))


def check_tp_cp_sharded_teacher_logits_arrive_whole():
    # Student: rank 0. Teacher: ranks 1-4 as cp 2 x tp 2, vocabulary 11 (not divisible by tp).
    bridge = make_bridge({"dp_size": 1}, {"dp_size": 1, "cp_size": 2, "tp_size": 2})
    batch, sequence_length, padded_length, vocab = 2, 7, 8, 11
    full = torch.randn(batch, padded_length, vocab, generator=torch.Generator().manual_seed(7))
    received = bridge.send_batch(0, {"n": torch.tensor(sequence_length)} if bridge.is_student else None)
    logits = None
    if bridge.is_teacher:
        mesh = bridge.setups.teacher.device_mesh
        local = cp_shard(full, cp_size=2, cp_rank=mesh.get_local_rank("cp"), dim=1)
        sharded = distribute_tensor(local, mesh["tp"], [Shard(-1)])
        assert sharded.to_local().shape[-1] == (6 if mesh.get_local_rank("tp") == 0 else 5)
        logits = materialize_teacher_logits(sharded, mesh, int(received["n"]))
        assert not isinstance(logits, DTensor) and logits.is_contiguous() and not logits.requires_grad
        torch.testing.assert_close(logits, full[:, :sequence_length], rtol=0, atol=0)
    arrived = bridge.send_logits(0, logits)
    if bridge.is_student:
        torch.testing.assert_close(arrived, full[:, :sequence_length], rtol=0, atol=0)


def check_logits_reach_every_rank_of_a_tp_student_and_match_its_vocab_shard():
    # Student: ranks 0-1 as tp 2. Teacher: ranks 2-4 as cp 3.
    bridge = make_bridge({"dp_size": 1, "tp_size": 2}, {"dp_size": 1, "cp_size": 3})
    vocab = 10
    full = torch.randn(1, 6, vocab, generator=torch.Generator().manual_seed(3))
    bridge.send_batch(0, {"x": torch.zeros(1)} if bridge.is_student else None)
    logits = full if dist.get_rank() == bridge.teacher_replicas[0].output_rank else None
    arrived = bridge.send_logits(0, logits)
    if bridge.is_student:
        torch.testing.assert_close(arrived, full, rtol=0, atol=0)
        from torch.distributed.device_mesh import DeviceMesh

        tp_mesh = DeviceMesh.from_group(bridge.student_group, "cpu")
        student = distribute_tensor(torch.zeros(1, 6, vocab), tp_mesh, [Shard(-1)])
        shard = KDMeshBridge.match_student_vocab_shard(student, arrived)
        expected = full[..., :5] if dist.get_rank() == 0 else full[..., 5:]
        torch.testing.assert_close(shard, expected, rtol=0, atol=0)
        assert KDMeshBridge.match_student_vocab_shard(torch.zeros(1), arrived) is arrived


def check_logits_reach_only_the_last_stage_of_a_pipelined_student():
    # Student: ranks 0-3 as pp 2 x tp 2 (stage 1 = ranks 2-3). Teacher: rank 4. The batch leaves stage 0.
    bridge = make_bridge({"dp_size": 1, "pp_size": 2, "tp_size": 2}, {"dp_size": 1})
    rank = dist.get_rank()
    batch = sample_batch(0) if rank == 0 else ({"ignored": torch.zeros(1)} if bridge.is_student else None)
    received = bridge.send_batch(0, batch)
    if bridge.is_teacher:
        assert_same_tree(received, sample_batch(0))
    arrived = bridge.send_logits(0, logits_for(received) if bridge.is_teacher else None)
    if rank in (2, 3):
        assert_same_tree(arrived, logits_for(sample_batch(0)))
    else:
        assert arrived is None


def check_vocab_shard_follows_dtensor_chunks_when_vocab_does_not_divide():
    # vocab 10 on tp 4: DTensor places 3, 3, 3, 1 (torch.tensor_split would give 3, 3, 2, 2).
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.new_group([0, 1, 2, 3])
    if dist.get_rank() == 4:
        return
    mesh = DeviceMesh.from_group(group, "cpu")
    teacher = torch.arange(10.0).expand(1, 2, 10)
    student = distribute_tensor(torch.zeros(1, 2, 10), mesh, [Shard(2)])
    shard = KDMeshBridge.match_student_vocab_shard(student, teacher)
    start, size = [(0, 3), (3, 3), (6, 3), (9, 1)][dist.get_rank()]
    assert shard.shape[-1] == student.to_local().shape[-1] == size
    assert torch.equal(shard, teacher[..., start : start + size])


def check_commands_drive_a_teacher_loop_to_a_clean_stop():
    bridge = make_bridge({"dp_size": 2}, {"dp_size": 3})
    rank, steps = dist.get_rank(), 3
    if bridge.is_student:
        for step in range(steps):
            assert bridge.broadcast_command(RUN_TEACHER) == RUN_TEACHER
            for wave in range(bridge.num_waves):
                bridge.send_batch(wave, {"input_ids": torch.full((1, 2), step), "index": rank})
                logits = bridge.send_logits(wave, None)
                if logits is not None:
                    assert torch.equal(logits, torch.full((1, 2, 1), step * 10.0 + rank))
        assert bridge.broadcast_command(STOP_TEACHER) == STOP_TEACHER
    else:
        served = 0
        while bridge.broadcast_command() == RUN_TEACHER:
            for wave in range(bridge.num_waves):
                batch = bridge.send_batch(wave, None)
                bridge.send_logits(wave, logits_for(batch))
            served += 1
        assert served == steps
    bridge.synchronize()


def check_bad_use_raises_on_every_rank_and_leaves_no_peer_blocked():
    with pytest.raises(ValueError, match="needs separate student and teacher meshes"):
        KDMeshBridge(create_kd_distributed_setups({"distributed": {}}, WORLD), torch.device("cpu"))
    bridge = make_bridge({"dp_size": 2}, {"dp_size": 3})
    rank = dist.get_rank()

    with pytest.raises(ValueError if rank == 0 else RuntimeError, match="RUN_TEACHER|invalid command"):
        bridge.broadcast_command(7 if rank == 0 else None)

    with pytest.raises(ValueError, match="wave 5 out of range"):
        bridge.send_batch(5, None)

    # Student replica 0's input rank forgets its batch: it raises, and so do the teachers it feeds
    # (teacher replica 0, and teacher replica 2, which has no partner); the rest carry on.
    batch = None if rank == 0 else ({"x": torch.ones(1)} if bridge.is_student else None)
    if rank in (0, 2, 4):
        with pytest.raises(ValueError if rank == 0 else RuntimeError, match="passed batch=None"):
            bridge.send_batch(0, batch)
    else:
        bridge.send_batch(0, batch)

    # Teacher replica 0's output rank sends nothing: its student replica learns why.
    route = bridge.output_routes[0][0]
    if rank in route.ranks:
        with pytest.raises(ValueError if rank == route.src else RuntimeError, match="passed logits=NoneType"):
            bridge.send_logits(0, None)
    else:
        other_output_rank = bridge.output_routes[0][1].src
        bridge.send_logits(0, torch.ones(1) if rank == other_output_rank else None)

    bridge.synchronize()  # every rank gets here: nobody is blocked


def check_move_to_device_keeps_structure():
    bridge = make_bridge({"dp_size": 2}, {"dp_size": 3})
    value = sample_batch(1)
    assert_same_tree(bridge.move_to_device(value), value)


@contextlib.contextmanager
def counted_broadcasts():
    """Count this rank's dist.broadcast calls and the bytes they carry (the bridge looks it up per call)."""
    counts = {"calls": 0, "bytes": 0}
    original = dist.broadcast

    def counting(tensor, *args, **kwargs):
        counts["calls"] += 1
        counts["bytes"] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.broadcast = counting
    try:
        yield counts
    finally:
        dist.broadcast = original


def my_student_replica(bridge: KDMeshBridge) -> int | None:
    return next((i for i, r in enumerate(bridge.student_replicas) if dist.get_rank() in r.ranks), None)


def check_repeated_structure_costs_fewer_collectives_and_bytes():
    bridge = make_bridge({"dp_size": 3}, {"dp_size": 2})
    per_call = []
    for _ in range(5):
        with counted_broadcasts() as counts:
            exchange_every_wave(bridge)
        per_call.append(dict(counts))
    calls = [c["calls"] for c in per_call]
    sent = [c["bytes"] for c in per_call]
    # Call 0 sends every spec; calls 1-2 only a header word (plus data); from call 3 on, the header rides
    # with the data: in the packed batch buffer, or beside the single logits tensor.
    assert calls[0] > calls[1] == calls[2] > calls[3] == calls[4], calls
    assert sent[0] > sent[1] == sent[2], sent
    assert sent[0] - sent[1] > len(wire.spec_bytes({"value": 0}))  # a spec travelled in call 0 only


def layout_batch(step: int, replica: int, layout: tuple) -> dict:
    shape, dtype = layout
    generator = torch.Generator().manual_seed(step * 10 + replica)
    ids = torch.randint(0, 50, shape, generator=generator)
    return {"ids": ids, "x": torch.randn(shape, generator=generator).to(dtype), "step": step, "replica": replica}


def layout_logits(batch: dict) -> torch.Tensor:
    return (batch["x"] * 2 + batch["ids"].to(batch["x"].dtype)).unsqueeze(-1)


def check_changing_shapes_dtypes_and_errors_arrive_exactly():
    # Routes go through new specs, repeats (speculated after two), changes after a streak (filler), a
    # sender error in the middle of a streak, and back: every value arrives equal, every time.
    bridge = make_bridge({"dp_size": 3}, {"dp_size": 2})
    rank, replica = dist.get_rank(), my_student_replica(bridge)
    output_ranks = {r.output_rank for r in bridge.teacher_replicas}
    f32, f16 = torch.float32, torch.float16
    layouts = [((2, 5), f32)] * 4 + [((3, 5), f32)] * 4 + [((3, 5), f16)] * 3 + [None] + [((2, 5), f32)] * 4
    for step, layout in enumerate(layouts + [((1, 7), f32)]):
        if layout is None:
            # Student replica 0 forgets its batch: it raises on both its routes (wave 0 and the spare route of
            # wave 1), and so do the teachers on them; the other routes carry on.
            for wave in range(bridge.num_waves):
                failing = {r for route in bridge.input_routes[wave] if route.src == 0 for r in route.ranks}
                batch = layout_batch(step, replica, layouts[0]) if bridge.is_student and rank != 0 else None
                if rank in failing:
                    with pytest.raises(ValueError if rank == 0 else RuntimeError, match="passed batch=None"):
                        bridge.send_batch(wave, batch)
                else:
                    bridge.send_batch(wave, batch)
            continue
        for wave in range(bridge.num_waves):
            received = bridge.send_batch(wave, layout_batch(step, replica, layout) if bridge.is_student else None)
            logits = None
            if bridge.is_teacher:
                partner = wave * 2 + (rank - 3)
                assert_same_tree(received, layout_batch(step, partner if partner < 3 else 0, layout))
                logits = layout_logits(received) if rank in output_ranks else None
            arrived = bridge.send_logits(wave, logits)
            if arrived is not None:
                assert_same_tree(arrived, layout_logits(layout_batch(step, replica, layout)))


def check_received_buffers_are_reused_only_once_released():
    bridge = make_bridge({"dp_size": 1}, {"dp_size": 4})
    route = bridge.output_routes[0][0]
    logits = torch.arange(24.0).view(1, 4, 6)
    def send(value):
        bridge.send_batch(0, {"x": torch.zeros(1)} if bridge.is_student else None)
        return bridge.send_logits(0, value if dist.get_rank() == route.src else None)
    held = [send(logits + call) for call in range(4)]  # all kept: each arrives in its own memory
    if bridge.is_student:
        assert len({t.data_ptr() for t in held}) == 4
        for call, value in enumerate(held):
            assert torch.equal(value, logits + call)
        pointers = {t.data_ptr() for t in held}
        del held, value
        again = send(logits + 10)
        assert again.data_ptr() in pointers and torch.equal(again, logits + 10)
    else:
        del held
        send(logits + 10)


def received_travel_as_sent():
    bridge = make_bridge({"dp_size": 3}, {"dp_size": 2})
    full = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(1))
    for mode, options in (("full", {}), ("full_bf16", {}), ("topk", {"k": 4}), ("topk", {"k": 4, "tail_samples": 3})):
        encoded = encode_teacher_logits(full, mode, temperature=1.5, **options)
        for _ in range(3):
            for wave in range(bridge.num_waves):
                bridge.send_batch(wave, {"x": torch.zeros(1)} if bridge.is_student else None)
                arrived = bridge.send_logits(wave, encoded if bridge.is_teacher else None)
                if arrived is not None:
                    assert_same_tree(arrived, encoded)


def check_every_collective_of_the_bridge_is_given_tensors_on_its_device():
    # Multi-tensor batches and top-k answers, repeated past the point where header and data travel together.
    bridge = make_bridge({"dp_size": 3}, {"dp_size": 2})
    rank, replica = dist.get_rank(), my_student_replica(bridge)
    encoded = encode_teacher_logits(torch.randn(2, 5, 30, generator=torch.Generator().manual_seed(2)), "topk", k=4,
                                     tail_samples=2)
    with audited_collectives(bridge.device) as calls:
        for _ in range(6):
            assert bridge.broadcast_command(RUN_TEACHER if rank == 0 else None) == RUN_TEACHER
            for wave in range(bridge.num_waves):
                bridge.send_batch(wave, sample_batch(replica) if bridge.is_student else None)
                arrived = bridge.send_logits(wave, encoded if bridge.is_teacher else None)
                if arrived is not None:
                    assert_same_tree(arrived, encoded)
        bridge.synchronize()
    assert len(calls) > 6 * 3


def check_a_bridge_on_a_device_sends_from_that_device_only():
    # The CPU shows no CUDA device; the meta device stands in for one (the collectives are recorded, not run),
    # so a send buffer taken from CPU memory whatever the device is found. Ranks 0 and 1 only send here.
    bridge = make_bridge({"dp_size": 1}, {"dp_size": 4})
    rank = dist.get_rank()
    if rank not in (0, bridge.teacher_replicas[0].output_rank):
        return
    bridge.device = torch.device("meta")
    encoded = encode_teacher_logits(torch.randn(2, 5, 30), "topk", k=4, tail_samples=2)
    with audited_collectives(bridge.device, forward=False) as calls:
        for _ in range(6):  # repeats 3 on carry the header word in the packed buffer
            if rank == 0:
                bridge.send_batch(0, sample_batch(0))
            else:
                bridge.send_logits(0, encoded)
    assert [call.name for call in calls].count("broadcast") >= 6 + 3


test_five_rank_world = world_test(
    WORLD,
    [
        check_three_student_replicas_on_two_teacher_replicas,
        check_four_student_replicas_on_one_teacher_replica,
        check_one_student_replica_on_four_teacher_replicas,
        check_tp_cp_sharded_teacher_logits_arrive_whole,
        check_logits_reach_every_rank_of_a_tp_student_and_match_its_vocab_shard,
        check_logits_reach_only_the_last_stage_of_a_pipelined_student,
        check_vocab_shard_follows_dtensor_chunks_when_vocab_does_not_divide,
        check_commands_drive_a_teacher_loop_to_a_clean_stop,
        check_bad_use_raises_on_every_rank_and_leaves_no_peer_blocked,
        check_move_to_device_keeps_structure,
        check_repeated_structure_costs_fewer_collectives_and_bytes,
        check_changing_shapes_dtypes_and_errors_arrive_exactly,
        check_received_buffers_are_reused_only_once_released,
        received_travel_as_sent,
        check_every_collective_of_the_bridge_is_given_tensors_on_its_device,
        check_a_bridge_on_a_device_sends_from_that_device_only,
    ],
)

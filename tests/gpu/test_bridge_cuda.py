"""The bridge and the teacher protocol with CUDA tensors: a 4-rank gloo world, every rank on cuda:0.

gloo takes CUDA tensors, so one GPU is enough to drive the bridge's device paths: a student of 2 replicas
(ranks 0-1) and a teacher of tp 2 (ranks 2-3, two routing waves). Requests of several tensors and top-k
answers repeat past the point where the header word rides in the packed buffer; every tensor given to a
collective must be on cuda:0. The prefetcher runs its requests on its own CUDA stream while the caller
keeps its stream busy, and must hand over the synchronous loop's answers.
"""

import datetime

import torch
import torch.distributed as dist

from meshkd.core.answers import encode_teacher_logits
from meshkd.core.bridge import KDMeshBridge
from meshkd.core.teacher_protocol import TeacherClient, TeacherPrefetcher, TeacherRequest, TeacherServer
from meshkd.core.topology import create_kd_distributed_setups
from tests.collectives import audited_collectives
from tests.gpu import CUDA
from tests.trees import assert_same_tree
from tests.world import world_test

pytestmark = CUDA

WORLD = 4
DEVICE = torch.device("cuda", 0)
VOCAB = 64
STEPS = 7  # from the 4th repeat on, header and data travel in one collective


def make_bridge() -> KDMeshBridge:
    torch.cuda.set_device(DEVICE)
    cfg = {"separate_meshes": True, "distributed": {"dp_size": 2}, "teacher_distributed": {"dp_size": 1, "tp_size": 2}}
    return KDMeshBridge(create_kd_distributed_setups(cfg, WORLD), DEVICE, timeout=datetime.timedelta(seconds=120))


def cuda_batch(step: int, replica: int) -> dict:
    """A micro-batch of four tensors on the device, as a student sends it; its values depend on both indices."""
    generator = torch.Generator().manual_seed(step * 10 + replica)
    ids = torch.randint(0, VOCAB, (2, 9), generator=generator)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(9).expand(2, 9).contiguous(),
             "attention_mask": torch.ones(2, 9, dtype=torch.int64)}
    return {key: value.to(DEVICE) for key, value in batch.items()}


def answer(batch: dict) -> dict:
    """A fake teacher's top-k answer with tail samples, computed on the device from the batch."""
    ids = batch["input_ids"].float()
    logits = torch.sin(ids[..., None] * torch.arange(1, VOCAB + 1, device=ids.device) / 7) * 5
    return encode_teacher_logits(logits, "topk", k=8, temperature=2.0, tail_samples=4, seed=int(ids.sum()))


def on_device(value) -> None:
    tensors = [value] if isinstance(value, torch.Tensor) else [v for v in value.values() if isinstance(v, torch.Tensor)]
    assert tensors and all(tensor.device == DEVICE for tensor in tensors), [t.device for t in tensors]


def check_repeated_batches_and_topk_answers_travel_on_the_device():
    bridge = make_bridge()
    rank = dist.get_rank()
    output_ranks = {replica.output_rank for replica in bridge.teacher_replicas}
    with audited_collectives(DEVICE) as calls:
        for step in range(STEPS):
            for wave in range(bridge.num_waves):  # teacher replica 0 serves student replica `wave`
                received = bridge.send_batch(wave, cuda_batch(step, rank) if bridge.is_student else None)
                sent = None
                if bridge.is_teacher:
                    on_device(received)
                    assert_same_tree(received, cuda_batch(step, wave))
                    sent = answer(received) if rank in output_ranks else None
                arrived = bridge.send_logits(wave, sent)
                if arrived is not None:
                    assert rank == wave
                    on_device(arrived)
                    assert_same_tree(arrived, answer(cuda_batch(step, rank)))
        bridge.synchronize()
    assert calls


def check_the_prefetcher_hands_over_by_events_from_its_own_stream():
    bridge = make_bridge()
    count = 6
    if bridge.is_teacher:
        server = TeacherServer(bridge)
        assert server.serve(lambda request: answer(request.batch)) == count
        assert server.serve(lambda request: answer(request.batch)) == count
        return
    rank = dist.get_rank()
    client = TeacherClient(bridge)
    synchronous = [client.request(cuda_batch(step, rank), "topk") for step in range(count)]
    client.close()
    caller_stream = torch.cuda.current_stream()
    busy = torch.randn(2048, 2048, device=DEVICE)
    with audited_collectives(DEVICE):
        prefetcher = TeacherPrefetcher(bridge, range(count),
                                       batch_fn=lambda step: TeacherRequest(cuda_batch(step, rank), "topk").to_wire())
        with prefetcher:
            for step, logits in prefetcher:
                assert torch.cuda.current_stream() == caller_stream  # the caller's stream is left as it was
                for _ in range(8):  # the caller's stream is busy while the next request runs on the other
                    busy = torch.tanh(busy @ busy)
                on_device(logits)
                assert_same_tree(logits, synchronous[step])
    client.close()
    assert torch.isfinite(busy).all()


test_four_rank_cuda_world = world_test(
    WORLD,
    [
        check_repeated_batches_and_topk_answers_travel_on_the_device,
        check_the_prefetcher_hands_over_by_events_from_its_own_stream,
    ],
    timeout_s=120,
    deadline_s=600,
)

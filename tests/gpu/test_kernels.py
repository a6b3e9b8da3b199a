"""The wire format, the logits codecs and the losses on cuda:0 against their CPU results, in fp32 and bf16.

One process, no process group. The same inputs are made on the CPU and copied to the device; values on
the device must match the CPU's within the tolerance of a different reduction order (exactly where no
arithmetic is involved). Tail samples are drawn by a CUDA generator on the device, so they are checked for
validity and their effect on the loss rather than against the CPU's draws.
"""

import pytest
import torch

from meshkd.core import wire
from meshkd.core.answers import encode_teacher_logits, label_log_probs
from meshkd.core.loss import cross_entropy_loss, kd_loss
from tests.gpu import CUDA
from tests.received import kd_loss_of, received
from tests.trees import assert_same_tree, sample_batch

pytestmark = CUDA

DEVICE = torch.device("cuda", 0)
CPU = torch.device("cpu")
VOCAB = 300


def to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(item, device) for item in value)
    return value


def logits(seed: int, dtype: torch.dtype, shape=(2, 7, VOCAB)) -> torch.Tensor:
    return (4 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def labels_for(shape=(2, 7), seed: int = 5) -> torch.Tensor:
    labels = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))
    labels[0, :2] = -100  # some tokens do not count
    return labels


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal within a reduction order's error (bf16 results carry bf16's rounding)."""
    assert actual.device == DEVICE, actual.device
    rtol, atol = (1e-4, 1e-6) if dtype == torch.float32 else (2e-2, 1e-5)
    torch.testing.assert_close(actual.cpu().float(), expected.float(), rtol=rtol, atol=atol)


def test_wire_packs_and_unpacks_on_the_device_what_the_cpu_does():
    batch = sample_batch(3)
    tensors: list[torch.Tensor] = []
    spec = wire.tree_spec(batch, tensors)
    leaves = wire.leaf_specs(spec)
    for sources in (tensors, [tensor.to(DEVICE) for tensor in tensors]):  # CPU leaves are copied over too
        packed = wire.pack_leaves(sources, DEVICE)
        assert packed.device == DEVICE and packed.numel() == wire.receive_nbytes(leaves)
        received = wire.unpack_leaves(packed, leaves)
        assert all(tensor.device == DEVICE for tensor in received)
        assert_same_tree(wire.tree_from_spec(spec, received), batch)  # compared on the CPU
    single = torch.arange(10.0, device=DEVICE)
    assert wire.packs_in_place([single], DEVICE)  # one contiguous leaf on the device travels from its memory
    assert wire.pack_leaves([single], DEVICE).data_ptr() == single.data_ptr()
    assert wire.spec_bytes(wire.decode_spec(wire.encode_spec(spec).to(DEVICE))) == wire.spec_bytes(spec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codecs_on_the_device_match_the_cpu(dtype):
    teacher = logits(1, dtype)
    for mode in ("full", "full_bf16"):
        on_cpu, on_device = encode_teacher_logits(teacher, mode), encode_teacher_logits(teacher.to(DEVICE), mode)
        assert on_device["logits"].device == DEVICE and on_device["logits"].dtype == on_cpu["logits"].dtype
        assert torch.equal(on_device["logits"].cpu(), on_cpu["logits"])  # no arithmetic: exact
    on_cpu = encode_teacher_logits(teacher, "topk", k=16, temperature=1.5)
    on_device = encode_teacher_logits(teacher.to(DEVICE), "topk", k=16, temperature=1.5)
    assert received(on_device, teacher.shape) == "topk"
    close(on_device["log_probs"], on_cpu["log_probs"], torch.float32)  # computed in float32 either way
    close(on_device["tail_log_prob"], on_cpu["tail_log_prob"], torch.float32)
    if dtype == torch.float32:  # bf16 logits tie often: the order among equal values may differ
        assert torch.equal(on_device["indices"].cpu(), on_cpu["indices"])
    sampled = encode_teacher_logits(teacher.to(DEVICE), "topk", k=16, tail_samples=8, seed=3)
    assert received(sampled, teacher.shape) == "topk"
    again = encode_teacher_logits(teacher.to(DEVICE), "topk", k=16, tail_samples=8, seed=3)
    assert torch.equal(sampled["tail_indices"], again["tail_indices"])  # seeded: the same draws
    top = sampled["indices"].unsqueeze(-1) == sampled["tail_indices"].unsqueeze(-2)
    assert not top.any()  # tail samples never repeat a top-k token
    labels = labels_for()
    answer_cpu = label_log_probs(teacher, labels)
    answer_device = label_log_probs(teacher.to(DEVICE), labels.to(DEVICE))
    close(answer_device["log_probs"], answer_cpu["log_probs"], torch.float32)


@pytest.mark.parametrize("chunk_size", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_losses_and_gradients_on_the_device_match_the_cpu(dtype, chunk_size):
    teacher, labels = logits(2, dtype), labels_for()
    topk = encode_teacher_logits(teacher, "topk", k=16, temperature=2.0)
    cases = [
        ("ce", lambda s, t, y, e: cross_entropy_loss(s, y, chunk_size=chunk_size)),
        ("topk", lambda s, t, y, e: kd_loss_of(s, e, y, temperature=2.0, chunk_size=chunk_size)),
        *[(divergence, lambda s, t, y, e, divergence=divergence: kd_loss(
            s, t, y, temperature=2.0, chunk_size=chunk_size, divergence=divergence))
          for divergence in ("forward_kl", "reverse_kl", "jsd")],
    ]
    for name, loss_fn in cases:
        results = {}
        for device in (CPU, DEVICE):
            student = logits(3, dtype).to(device).requires_grad_()
            loss = loss_fn(student, teacher.to(device), labels.to(device), to_device(topk, device))
            loss.backward()
            assert loss.dtype == torch.float32 and student.grad.dtype == dtype, name
            results[device.type] = (loss.detach(), student.grad)
        (loss_cpu, grad_cpu), (loss_device, grad_device) = results["cpu"], results["cuda"]
        close(loss_device, loss_cpu, torch.float32)
        close(grad_device, grad_cpu, dtype)


def test_the_students_sampler_draws_on_the_device_each_row_as_if_alone():
    from meshkd.core.packing import configure_packing
    from meshkd.recipe.student.on_policy import ModelGenerate, SamplingSettings
    from tests.tiny import tiny_llama_model

    model = configure_packing(tiny_llama_model(vocab=258, seed=4)).to(DEVICE)
    settings = SamplingSettings(max_new_tokens=6, temperature=1.0, top_p=0.9, stop_tokens=())

    def sample(prompts, seeds):
        return ModelGenerate(model, settings, pad_token_id=257, device=DEVICE).sample(prompts, seeds)

    prompts = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10]), torch.tensor([11, 12, 13])]
    together = sample(prompts, [1, 2, 3])
    alone = [sample([prompt], [seed])[0] for prompt, seed in zip(prompts, [1, 2, 3])]
    assert all(torch.equal(a, b) for a, b in zip(together, alone)) and all(len(c) == 6 for c in together)
    assert all(torch.equal(a, b) for a, b in zip(together, sample(prompts, [1, 2, 3])))  # seeded: repeatable


def test_host_rows_reach_the_device_whole_through_pinned_copies():
    from meshkd.recipe.corpus.batches import to_device
    from meshkd.recipe.student.train_step import micro_batches
    from meshkd.recipe.teacher.teacher_cache import row_hashes

    batch = {key: torch.randint(0, 100, (4, 64)) for key in ("input_ids", "position_ids", "attention_mask", "labels")}
    values = torch.randn(4, 64, 8)
    moved = to_device(values, DEVICE)
    parts = micro_batches(batch, size=2, device=DEVICE)
    torch.cuda.synchronize()
    assert moved.device == DEVICE and torch.equal(moved.cpu(), values)
    assert torch.equal(torch.cat([part["input_ids"] for part in parts]).cpu(), batch["input_ids"])
    assert row_hashes({key: value.to(DEVICE) for key, value in batch.items()}) == row_hashes(batch)

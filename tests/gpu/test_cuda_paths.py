"""What only the CPU suite ran, on cuda:0: the skew KL and TVD kernels against float64, the fused output layer in
bfloat16 against whole logits under autocast, and `meshkd train` with top-k and compact answers.

The kernels and the fused layer run in one process, no process group; a run is a real `meshkd train` on one
GPU (`tests.gpu.test_train_nccl.train`), both models on its one rank.
"""

import math

import pytest
import torch

from meshkd.core.fused_output import chunk_answer, fused_output_loss
from meshkd.core.loss import kd_loss
from tests.core.test_fused_output import case, objective_of
from tests.gpu import CUDA

pytestmark = CUDA

DEVICE = torch.device("cuda", 0)
VOCAB = 300


@pytest.mark.parametrize("chunk_size", [None, 5])
@pytest.mark.parametrize("divergence", ["skew_forward_kl", "skew_reverse_kl", "tvd"])
def test_skew_kl_and_tvd_on_the_device_match_float64(divergence, chunk_size):
    """The loss and its gradient from float32 logits on the device equal float64's on the device, chunked or
    whole, within float32's rounding."""
    generator = torch.Generator().manual_seed(7)
    student = (4 * torch.randn(2, 9, VOCAB, generator=generator)).to(DEVICE)
    teacher = (4 * torch.randn(2, 9, VOCAB, generator=generator)).to(DEVICE)
    labels = torch.randint(0, VOCAB, (2, 9), generator=generator).to(DEVICE)
    labels[0, :3] = -100
    results = {}
    for dtype in (torch.float32, torch.float64):
        logits = student.to(dtype, copy=True).requires_grad_()
        loss = kd_loss(logits, teacher.to(dtype), labels, temperature=2.0, chunk_size=chunk_size,
                       divergence=divergence, skew_alpha=0.1)
        loss.backward()
        assert loss.device == DEVICE and math.isfinite(loss.item())
        results[dtype] = (loss.detach().double(), logits.grad.double())
    (loss32, grad32), (loss64, grad64) = results[torch.float32], results[torch.float64]
    torch.testing.assert_close(loss32, loss64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad32, grad64, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["full", "topk_tail"])
def test_the_fused_bfloat16_path_equals_whole_logits_under_autocast_on_the_device(mode):
    """`compute_dtype=torch.bfloat16` on the device: the loss and gradients of whole logits made by autocast's
    bfloat16 output layer, up to bfloat16's rounding (the fused weight gradient is summed over chunks in float32)."""
    hidden, weight, _, labels, answer = case(2, mode)
    hidden = hidden.detach().to(DEVICE).requires_grad_()
    weight = weight.detach().to(DEVICE).requires_grad_()
    labels = labels.to(DEVICE)
    answer = {key: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for key, value in answer.items()}
    on_chunk, loss = objective_of(answer, labels)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = hidden @ weight.T
    expected = loss(logits.float().reshape(-1, logits.shape[-1]), chunk_answer(answer, slice(None),
                                                                                 tuple(labels.shape)),
                    labels.reshape(-1))
    grads = torch.autograd.grad(expected, (hidden, weight))
    for chunk_size in (7, 1000):
        got = fused_output_loss(hidden, weight, on_chunk, chunk_size=chunk_size, compute_dtype=torch.bfloat16)
        assert got.device == DEVICE
        torch.testing.assert_close(got, expected, rtol=2e-3, atol=1e-4)
        for mine, theirs in zip(torch.autograd.grad(got, (hidden, weight)), grads):
            torch.testing.assert_close(mine, theirs, rtol=2e-2, atol=1e-3)


@pytest.mark.world
@pytest.mark.parametrize("encoding", ["exact", "compact"])
def test_top_k_answers_train_on_one_gpu(tmp_path, encoding):
    """Top-k answers (`kd.topk_encoding` exact or compact) through the fused output layer in a bf16 run: every
    step's loss finite, and the KD term falls."""
    from tests.gpu.test_train_nccl import one_gpu, train

    config = one_gpu(tmp_path, f"topk_{encoding}", dtype="bfloat16")
    config["kd"].update(logits_transport="topk", topk=8, topk_encoding=encoding)
    records = train(config)
    assert [record["step"] for record in records] == list(range(1, config["step_scheduler"]["max_steps"] + 1))
    assert all(math.isfinite(record["loss"]) and math.isfinite(record["kd_loss"]) for record in records)
    assert records[-1]["kd_loss"] < records[0]["kd_loss"]

"""The output layer fused with the loss (`meshkd.core.fused_output`): the loss and the gradients with respect to
the hidden states, the output weight (tied or not) and a bias equal the unfused path's, for CE and KD against
full, bfloat16 and top-k answers and every divergence; bad inputs refused."""

import pytest
import torch

from meshkd.core.answers import encode_teacher_logits
from meshkd.core.fused_output import chunk_answer, fused_output_loss
from meshkd.core.loss import DIVERGENCES, cross_entropy_loss
from tests.received import kd_loss_of
from tests.world import world_test

VOCAB, WIDTH = 300, 24


def objective_of(answer, labels, *, divergence="forward_kl", temperature=2.0, kd_ratio=0.5):
    """(1 - r) CE + r KD of a micro-batch, as a function of a chunk of its logits (and the whole-logits form)."""
    norm = (labels != -100).sum()
    flat = labels.reshape(-1)

    def loss(logits, answer, labels):
        ce = cross_entropy_loss(logits, labels, num_valid_tokens=norm, chunk_size=logits.shape[0])
        kd = kd_loss_of(logits, answer, labels, temperature=temperature, num_valid_tokens=norm,
                             chunk_size=logits.shape[0], divergence=divergence)
        return (1 - kd_ratio) * ce + kd_ratio * kd

    def on_chunk(logits, tokens):
        return loss(logits, chunk_answer(answer, tokens, tuple(labels.shape)), flat[tokens])

    return on_chunk, loss


def case(seed: int, mode: str, *, tied: bool = False, bias: bool = False, vocab: int = VOCAB):
    torch.manual_seed(seed)
    hidden = torch.randn(2, 37, WIDTH, requires_grad=True)
    weight = torch.randn(vocab, WIDTH, requires_grad=True)
    b = torch.randn(vocab, requires_grad=True) if bias else None
    labels = torch.randint(0, vocab, (2, 37))
    labels[0, :5] = -100
    teacher = torch.randn(2, 37, vocab) * 3
    answer = encode_teacher_logits(teacher, "topk" if mode.startswith("topk") else mode, k=16, temperature=2.0,
                                   tail_samples=8 if mode == "topk_tail" else 0, seed=1)
    return hidden, weight, b, labels, answer


@pytest.mark.parametrize("mode, divergence", [("full", d) for d in DIVERGENCES] + [
    ("full_bf16", "forward_kl"), ("topk", "forward_kl"), ("topk_tail", "forward_kl")])
def test_loss_and_gradients_equal_the_unfused_path(mode, divergence):
    hidden, weight, _, labels, answer = case(0, mode)
    on_chunk, loss = objective_of(answer, labels, divergence=divergence)
    expected = loss((hidden @ weight.T).reshape(-1, VOCAB), answer if mode.startswith("full") and False else
                    chunk_answer(answer, slice(None), tuple(labels.shape)), labels.reshape(-1))
    grads = torch.autograd.grad(expected, (hidden, weight))
    for chunk_size in (7, 16, 74, 1000):
        got = fused_output_loss(hidden, weight, on_chunk, chunk_size=chunk_size)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        for mine, theirs in zip(torch.autograd.grad(got, (hidden, weight)), grads):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_in_bfloat16_compute_it_equals_the_output_layer_under_autocast(weights):
    """`compute_dtype=torch.bfloat16` (a mixed-precision student, whose output layer autocast runs in bfloat16;
    or one whose weights are bfloat16 themselves): the loss and the gradients of autocast's unfused path, up to
    the rounding of the weight's gradient, which the fused path sums over chunks in float32."""
    hidden, weight, _, labels, answer = case(2, "topk_tail")
    weight = weight.detach().to(getattr(torch, weights)).requires_grad_()
    on_chunk, loss = objective_of(answer, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = hidden @ weight.T
    assert logits.dtype == torch.bfloat16
    expected = loss(logits.float().reshape(-1, VOCAB), chunk_answer(answer, slice(None), tuple(labels.shape)),
                    labels.reshape(-1))
    grads = torch.autograd.grad(expected, (hidden, weight))
    for chunk_size in (7, 1000):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as in the student's forward: turned off inside
            got = fused_output_loss(hidden, weight, on_chunk, chunk_size=chunk_size, compute_dtype=torch.bfloat16)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        mine = torch.autograd.grad(got, (hidden, weight))
        assert [g.dtype for g in mine] == [g.dtype for g in grads]
        torch.testing.assert_close(mine[0], grads[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mine[1].float(), grads[1].float(), rtol=2e-2, atol=2e-3)
    float32 = fused_output_loss(hidden, weight, on_chunk, chunk_size=7)
    assert abs(float(float32.detach()) - float(expected.detach())) > 1e-5  # the bfloat16 rounding is matched


def test_a_tied_weight_and_a_bias_get_the_unfused_gradients():
    """A weight shared with the input embeddings gets both uses' gradients; a bias its own."""
    hidden, weight, bias, labels, answer = case(1, "topk_tail", bias=True)
    ids = torch.randint(0, VOCAB, (2, 37))
    on_chunk, loss = objective_of(answer, labels)

    def total(fused: bool):
        h = hidden + weight[ids]  # the embedding lookup reads the same weight
        if fused:
            return fused_output_loss(h, weight, on_chunk, chunk_size=10, bias=bias)
        logits = (h @ weight.T + bias).reshape(-1, VOCAB)
        return loss(logits, chunk_answer(answer, slice(None), tuple(labels.shape)), labels.reshape(-1))

    expected = total(False)
    grads = torch.autograd.grad(expected, (hidden, weight, bias))
    got = total(True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(torch.autograd.grad(got, (hidden, weight, bias)), grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_without_gradients_only_the_value_and_bad_inputs_refused():
    hidden, weight, _, labels, answer = case(2, "full")
    on_chunk, loss = objective_of(answer, labels)
    with torch.no_grad():
        value = fused_output_loss(hidden, weight, on_chunk, chunk_size=9)
    assert not value.requires_grad
    expected = loss((hidden @ weight.T).reshape(-1, VOCAB), chunk_answer(answer, slice(None), tuple(labels.shape)),
                    labels.reshape(-1))
    torch.testing.assert_close(value, expected.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"chunk_size must be >= 1, got 0"):
        fused_output_loss(hidden, weight, on_chunk, chunk_size=0)
    with pytest.raises(ValueError, match=r"hidden states of width 24 do not fit an output weight \(300, 23\)"):
        fused_output_loss(hidden, weight[:, :23], on_chunk)


def check_a_vocab_parallel_output_layer_gets_the_unfused_loss_and_gradients():
    """A weight (and bias) sharded over the vocabulary on tp 2, evenly (300) and not (301: 151 and 150 rows):
    the objective sees DTensor logits, and the loss and every gradient equal the unfused single-process path's;
    the hidden states' gradient is summed over the ranks whether they come as a replicated DTensor, a tensor, or
    a DTensor sharded on the sequence (gathered first)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for vocab, mode, given in ((300, "topk_tail", "replicated"), (301, "full", "replicated"), (301, "topk", "tensor"),
                               (300, "full", "sequence")):
        hidden, weight, bias, labels, answer = case(4, mode, bias=True, vocab=vocab)
        on_chunk, loss = objective_of(answer, labels)
        expected = loss((hidden @ weight.T + bias).reshape(-1, vocab),
                        chunk_answer(answer, slice(None), tuple(labels.shape)), labels.reshape(-1))
        grads = torch.autograd.grad(expected, (hidden, weight, bias))
        placements = {"replicated": [Replicate()], "sequence": [Shard(1)]}.get(given)
        sharded_hidden = (hidden.detach().clone() if placements is None
                          else distribute_tensor(hidden.detach(), mesh, placements)).requires_grad_()
        sharded_weight, sharded_bias = (distribute_tensor(value.detach(), mesh, [Shard(0)]).requires_grad_()
                                        for value in (weight, bias))
        seen = []

        def objective(logits, tokens, seen=seen, on_chunk=on_chunk):
            seen.append((isinstance(logits, DTensor), tuple(logits.shape)))
            return on_chunk(logits, tokens)

        got = fused_output_loss(sharded_hidden, sharded_weight, objective, chunk_size=7, bias=sharded_bias)
        got.backward()
        assert seen == [(True, (min(7, 74 - start), vocab)) for start in range(0, 74, 7)]
        torch.testing.assert_close(got.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
        mine = [value.grad.full_tensor() if isinstance(value.grad, DTensor) else value.grad
                for value in (sharded_hidden, sharded_weight, sharded_bias)]
        for got_grad, want in zip(mine, grads):
            torch.testing.assert_close(got_grad, want, rtol=1e-5, atol=1e-6)


test_vocab_parallel = world_test(2, [check_a_vocab_parallel_output_layer_gets_the_unfused_loss_and_gradients])

"""Tests for meshkd.core.loss: pure single-process checks, then one 4-rank gloo world for the vocab-parallel path."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from meshkd.core.answers import encode_teacher_logits
from meshkd.core.loss import cross_entropy_loss, kd_loss, kd_objective, top1_agreements
from tests.received import kd_loss_of
from tests.world import world_test


def _inputs(shape=(2, 5, 7), *, dtype=torch.float64, seed=0, ignored=(1, 6)):
    """Student logits (leaf, requires grad), teacher logits, labels with a few ignored positions."""
    generator = torch.Generator().manual_seed(seed)
    student = (3 * torch.randn(shape, generator=generator, dtype=dtype)).requires_grad_()
    teacher = 3 * torch.randn(shape, generator=generator, dtype=dtype)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=generator)
    flat = labels.view(-1)
    flat[list(ignored)] = -100
    return student, teacher, labels


def _reference_kd(student, teacher, labels, temperature, ignore_index=-100):
    """The formula written out token by token in float64."""
    student, teacher = student.detach().double(), teacher.double()
    vocab = student.shape[-1]
    total, count = 0.0, 0
    for s, t, y in zip(student.reshape(-1, vocab), teacher.reshape(-1, vocab), labels.reshape(-1)):
        if y == ignore_index:
            continue
        count += 1
        p_t = torch.exp(t / temperature) / torch.exp(t / temperature).sum()
        p_s = torch.exp(s / temperature) / torch.exp(s / temperature).sum()
        for v in range(vocab):
            if p_t[v] > 0:
                total += float(p_t[v] * (torch.log(p_t[v]) - torch.log(p_s[v])))
    return temperature**2 * total / max(count, 1)


def _value_and_grad(loss_fn, student, *args, **kwargs):
    student.grad = None
    loss = loss_fn(student, *args, **kwargs)
    loss.backward()
    return loss.detach(), student.grad.clone()


# ---------------------------------------------------------------------------------------------- pure


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_kd_plain_matches_reference_formula(temperature):
    student, teacher, labels = _inputs()
    loss = kd_loss(student, teacher, labels, temperature=temperature)
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(_reference_kd(student, teacher, labels, temperature), rel=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 10, 1000])
def test_kd_chunked_matches_plain(temperature, chunk_size):
    student, teacher, labels = _inputs()
    want, want_grad = _value_and_grad(kd_loss, student, teacher, labels, temperature=temperature)
    got, got_grad = _value_and_grad(kd_loss, student, teacher, labels, temperature=temperature, chunk_size=chunk_size)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_kd_gradient_matches_autograd_of_the_formula(chunk_size):
    # Independent of the library's own plain path: autograd through the written-out formula.
    student, teacher, labels = _inputs()
    valid = (labels != -100)[..., None]
    log_p_s = torch.log_softmax(student / 2.0, -1)
    p_t = torch.softmax(teacher / 2.0, -1)
    want = (valid * p_t * (p_t.log() - log_p_s)).sum() * 4.0 / valid.sum()
    (want_grad,) = torch.autograd.grad(want, student)
    got, got_grad = _value_and_grad(kd_loss, student, teacher, labels, temperature=2.0, chunk_size=chunk_size)
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_kd_temperature_scaling(chunk_size):
    # Dividing logits by T and multiplying by T^2: scaling both logits by T gives T^2 times the T=1 loss.
    student, teacher, labels = _inputs()
    base = kd_loss(student, teacher, labels, chunk_size=chunk_size)
    scaled = kd_loss(3.0 * student, 3.0 * teacher, labels, temperature=3.0, chunk_size=chunk_size)
    torch.testing.assert_close(scaled, 9.0 * base, rtol=1e-12, atol=0)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_ignored_tokens_do_not_count(chunk_size):
    student, teacher, labels = _inputs()
    labels.view(-1)[3] = -1  # a custom ignore_index; -100 is then an ordinary (unused) label value
    labels[labels == -100] = 0
    ignored = labels == -1
    for loss_fn, extra in ((kd_loss, (teacher,)), (cross_entropy_loss, ())):
        loss, grad = _value_and_grad(loss_fn, student, *extra, labels, ignore_index=-1, chunk_size=chunk_size)
        assert torch.all(grad[ignored] == 0)
        assert torch.any(grad[~ignored] != 0)
        with torch.no_grad():
            changed = student.detach().clone()
            changed[ignored] = 1e3
        assert loss_fn(changed, *extra, labels, ignore_index=-1, chunk_size=chunk_size) == loss


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_num_valid_tokens_normalizes_the_sum(chunk_size):
    student, teacher, labels = _inputs()
    local = int((labels != -100).sum())
    for loss_fn, extra in ((kd_loss, (teacher,)), (cross_entropy_loss, ())):
        mean = loss_fn(student, *extra, labels, chunk_size=chunk_size)
        for normalizer in (37, torch.tensor(37)):
            got, grad = _value_and_grad(
                loss_fn, student, *extra, labels, num_valid_tokens=normalizer, chunk_size=chunk_size
            )
            torch.testing.assert_close(got * 37, mean.detach() * local, rtol=1e-12, atol=0)
            _, mean_grad = _value_and_grad(loss_fn, student, *extra, labels, chunk_size=chunk_size)
            torch.testing.assert_close(grad * 37, mean_grad * local, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("num_valid_tokens", [None, 0])
def test_all_ignored_is_exactly_zero_with_finite_grads(chunk_size, num_valid_tokens):
    student, teacher, labels = _inputs()
    labels.fill_(-100)
    teacher[0, 0] = -math.inf  # a degenerate ignored row must not leak NaN either
    for loss_fn, extra in ((kd_loss, (teacher,)), (cross_entropy_loss, ())):
        loss, grad = _value_and_grad(
            loss_fn, student, *extra, labels, num_valid_tokens=num_valid_tokens, chunk_size=chunk_size
        )
        assert loss.item() == 0.0
        assert torch.all(grad == 0)


@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_kd_minus_inf_teacher_logits(chunk_size):
    student, teacher, labels = _inputs()
    teacher[0, 0, :3] = -math.inf
    teacher[1, 2, 1:] = -math.inf  # one-hot teacher
    loss, grad = _value_and_grad(kd_loss, student, teacher, labels, temperature=1.5, chunk_size=chunk_size)
    assert loss.item() == pytest.approx(_reference_kd(student, teacher, labels, 1.5), rel=1e-12)
    assert torch.isfinite(grad).all()
    _, want_grad = _value_and_grad(kd_loss, student, teacher, labels, temperature=1.5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)


def test_kd_zero_when_student_equals_teacher():
    student, _, labels = _inputs()
    for chunk_size in (None, 3):
        loss, grad = _value_and_grad(kd_loss, student, student.detach(), labels, chunk_size=chunk_size)
        assert abs(loss.item()) < 1e-12
        assert grad.abs().max() < 1e-12


def test_top1_agreements_count_the_valid_positions_where_both_argmaxes_agree():
    student, teacher, labels = _inputs((2, 5, 7), seed=5)
    student = student.detach()
    agree = (student.argmax(-1) == teacher.argmax(-1)) & (labels != -100)
    assert 0 < int(agree.sum()) < 8, "both kinds of position occur"
    assert top1_agreements(student, teacher.argmax(-1), labels).item() == int(agree.sum())
    # A tie for the student's largest logit counts as agreement with either token.
    student[0, 0, :2] = student[0, 0].max() + 1
    labels[0, 0] = 0
    for choice in (0, 1):
        top = teacher.argmax(-1)
        top[0, 0] = choice
        expected = int(((student.argmax(-1) == top) & (labels != -100)).sum()) + (choice == 1)
        assert top1_agreements(student, top, labels).item() == expected
    assert top1_agreements(student, teacher.argmax(-1), torch.full_like(labels, -100)).item() == 0


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 10])
def test_cross_entropy_matches_torch(chunk_size):
    student, _, labels = _inputs()
    want = F.cross_entropy(student.detach().reshape(-1, 7), labels.reshape(-1))  # mean over valid tokens
    want_grad = torch.autograd.grad(F.cross_entropy(student.reshape(-1, 7), labels.reshape(-1)), student)[0]
    got, grad = _value_and_grad(cross_entropy_loss, student, labels, chunk_size=chunk_size)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)


def test_tokens_by_vocab_layout_and_upstream_gradient_scale():
    # [tokens, vocab] inputs; a weighted sum of losses (kd_objective) scales the chunked gradients correctly.
    student, teacher, labels = _inputs((9, 6))
    grads = []
    for chunk_size in (None, 2):
        student.grad = None
        ce = cross_entropy_loss(student, labels, chunk_size=chunk_size)
        kd = kd_loss(student, teacher, labels, temperature=2.0, chunk_size=chunk_size)
        kd_objective(ce, kd, 0.3).backward()
        grads.append(student.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-14)


def test_chunked_low_precision_student_and_no_grad():
    student, teacher, labels = _inputs(dtype=torch.float32)
    want, want_grad = _value_and_grad(kd_loss, student, teacher, labels)
    low = student.detach().bfloat16().requires_grad_()
    got = kd_loss(low, teacher.bfloat16(), labels, chunk_size=4)
    got.backward()
    assert got.dtype == torch.float32 and low.grad.dtype == torch.bfloat16
    torch.testing.assert_close(got.detach(), want, rtol=0.05, atol=0.02)
    torch.testing.assert_close(low.grad.float(), want_grad, rtol=0.05, atol=0.01)
    with torch.no_grad():
        no_grad = kd_loss(student, teacher, labels, chunk_size=3)
    assert not no_grad.requires_grad
    torch.testing.assert_close(no_grad, want, rtol=1e-6, atol=0)


def test_chunked_second_backward_fails_loudly():
    student, teacher, labels = _inputs()
    loss = kd_loss(student, teacher, labels, chunk_size=3)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_kd_objective():
    ce, kd = torch.tensor(2.0), torch.tensor(4.0)
    assert kd_objective(ce, kd, 0.25).item() == pytest.approx(0.75 * 2.0 + 0.25 * 4.0)
    assert kd_objective(None, kd, 1.0) is kd
    assert kd_objective(ce, None, 0.0) is ce
    assert kd_objective(ce, torch.tensor(math.inf), 0.0) is ce
    for ratio in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="kd_ratio must lie in"):
            kd_objective(ce, kd, ratio)
    with pytest.raises(ValueError, match="ce is required"):
        kd_objective(None, kd, 0.5)
    with pytest.raises(ValueError, match="kd is required"):
        kd_objective(ce, None, 0.5)


def test_argument_errors():
    student, teacher, labels = _inputs()
    with pytest.raises(ValueError, match=r"teacher_logits shape \(2, 5, 8\) does not match .* \(2, 5, 7\)"):
        kd_loss(student, torch.zeros(2, 5, 8), labels)
    with pytest.raises(ValueError, match=r"labels shape \(2, 4\) must be .* \(2, 5, 7\)"):
        kd_loss(student, teacher, labels[:, :4])
    with pytest.raises(ValueError, match=r"labels shape \(10,\)"):
        cross_entropy_loss(student, labels.reshape(-1))
    with pytest.raises(ValueError, match="student_logits must be"):
        cross_entropy_loss(student.reshape(-1), labels.reshape(-1))
    for temperature in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="temperature"):
            kd_loss(student, teacher, labels, temperature=temperature)
    for chunk_size in (0, -3):
        with pytest.raises(ValueError, match="chunk_size"):
            kd_loss(student, teacher, labels, chunk_size=chunk_size)
        with pytest.raises(ValueError, match="chunk_size"):
            cross_entropy_loss(student, labels, chunk_size=chunk_size)
    with pytest.raises(ValueError, match="num_valid_tokens"):
        kd_loss(student, teacher, labels, num_valid_tokens=-1)


def test_chunked_kd_leaves_its_inputs_untouched():
    # The chunked path works in place on its own copies only.
    student, teacher, labels = _inputs(dtype=torch.float32)
    before = (student.detach().clone(), teacher.clone())
    for temperature in (1.0, 2.0):
        kd_loss(student, teacher, labels, temperature=temperature, chunk_size=3).backward()
    assert torch.equal(student.detach(), before[0]) and torch.equal(teacher, before[1])


# ------------------------------------------------------------------------------- encoded teacher logits


def _reference_topk(student, encoded, labels, temperature, ignore_index=-100):
    """The top-k KL written out token by token in float64 with autograd: the k tokens, then the rest bucket
    (via 1 - sum of the student's top-k probabilities, not the implementation's logsumexp) or the tail samples."""
    vocab = student.shape[-1]
    k = encoded["log_probs"].shape[-1]
    rows = student.double().reshape(-1, vocab)
    log_p = encoded["log_probs"].double().reshape(-1, k)
    index = encoded["indices"].long().reshape(-1, k)
    tail = encoded["tail_log_prob"].double().reshape(-1)
    sampled = "tail_indices" in encoded
    if sampled:
        m = encoded["tail_indices"].shape[-1]
        sample_index = encoded["tail_indices"].long().reshape(-1, m)
        sample_log_p = encoded["tail_log_probs"].double().reshape(-1, m)
    total, count = rows.new_zeros(()), 0
    for token, label in enumerate(labels.reshape(-1).tolist()):
        if label == ignore_index:
            continue
        count += 1
        log_q = torch.log_softmax(rows[token] / temperature, dim=-1)
        p = log_p[token].exp()
        total = total + (p * (log_p[token] - log_q[index[token]])).sum()
        p_rest = tail[token].exp()
        if p_rest > 0 and sampled:
            total = total + p_rest * (sample_log_p[token] - log_q[sample_index[token]]).mean()
        elif p_rest > 0:
            q_rest = 1 - log_q[index[token]].exp().sum()
            total = total + p_rest * (tail[token] - q_rest.log())
    return temperature**2 * total / max(count, 1)


TOPK_CASES = [(1, 0), (3, 0), (7, 0), (3, 4), (1, 2)]  # (k, tail samples) on a vocab of 7


@pytest.mark.parametrize("k, samples", TOPK_CASES)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_topk_matches_the_reference_formula_and_its_autograd_gradient(k, samples, temperature):
    student, teacher, labels = _inputs()
    encoded = encode_teacher_logits(teacher, "topk", k=k, temperature=temperature, tail_samples=samples, seed=1)
    leaf = student.detach().clone().requires_grad_()
    want = _reference_topk(leaf, encoded, labels, temperature)
    want.backward()
    for chunk_size in (None, 3, 100):
        got, grad = _value_and_grad(kd_loss_of, student, encoded, labels, temperature=temperature,
                                    chunk_size=chunk_size)  # fmt: skip
        assert got.dtype == torch.float64
        assert got.item() == pytest.approx(want.item(), rel=1e-10)
        torch.testing.assert_close(grad, leaf.grad, rtol=1e-9, atol=1e-12)
        assert torch.isfinite(grad).all()


def test_topk_rest_bucket_never_overestimates_and_is_exact_at_full_k():
    student, teacher, labels = _inputs(shape=(3, 8, 30), seed=2)
    full = kd_loss(student, teacher, labels, temperature=1.5).item()
    previous = 0.0
    for k in (1, 4, 12, 29):
        value = kd_loss_of(student, encode_teacher_logits(teacher, "topk", k=k, temperature=1.5), labels,
                                temperature=1.5).item()  # fmt: skip
        # A finer partition of the vocabulary: closer from below (to float32 log-probabilities' precision).
        assert previous - 1e-6 * full <= value <= full * (1 + 1e-6)
        previous = value
    exact = kd_loss_of(student, encode_teacher_logits(teacher, "topk", k=30, temperature=1.5), labels,
                            temperature=1.5)  # fmt: skip
    assert exact.item() == pytest.approx(full, rel=1e-6)  # float32 log-probs on the wire


def test_topk_sampled_tail_is_unbiased():
    student, teacher, labels = _inputs(shape=(2, 10, 50), seed=3)
    full = kd_loss(student, teacher, labels, temperature=2.0).item()
    estimates = [
        kd_loss_of(student,
                        encode_teacher_logits(teacher, "topk", k=5, temperature=2.0, tail_samples=4, seed=seed),
                        labels, temperature=2.0).item()
        for seed in range(200)
    ]  # fmt: skip
    mean = sum(estimates) / len(estimates)
    spread = (sum((e - mean) ** 2 for e in estimates) / (len(estimates) - 1)) ** 0.5
    assert abs(mean - full) < 4 * spread / len(estimates) ** 0.5 + 1e-9
    bucket = kd_loss_of(student, encode_teacher_logits(teacher, "topk", k=5, temperature=2.0), labels,
                             temperature=2.0).item()  # fmt: skip
    assert abs(mean - full) < abs(bucket - full)


def test_encoded_full_modes_are_kd_loss_on_the_carried_logits():
    student, teacher, labels = _inputs(dtype=torch.float32)
    for chunk_size in (None, 4):
        full = kd_loss_of(student, encode_teacher_logits(teacher, "full"), labels, temperature=2.0,
                               chunk_size=chunk_size)  # fmt: skip
        assert full.item() == kd_loss(student, teacher, labels, temperature=2.0, chunk_size=chunk_size).item()
        half = kd_loss_of(student, encode_teacher_logits(teacher, "full_bf16"), labels, temperature=2.0,
                               chunk_size=chunk_size)  # fmt: skip
        rounded = kd_loss(student, teacher.to(torch.bfloat16), labels, temperature=2.0, chunk_size=chunk_size)
        assert half.item() == rounded.item() and half.dtype == torch.float32
        assert half.item() == pytest.approx(full.item(), rel=2e-2)


@pytest.mark.parametrize("samples", [0, 3])
def test_topk_ignored_tokens_and_all_ignored(samples):
    student, teacher, labels = _inputs(seed=5)
    encoded = encode_teacher_logits(teacher, "topk", k=3, tail_samples=samples)
    for chunk_size in (None, 3):
        _, grad = _value_and_grad(kd_loss_of, student, encoded, labels, chunk_size=chunk_size)
        assert torch.all(grad.view(-1, 7)[[1, 6]] == 0)
        nothing = labels.clone().fill_(-100)
        loss, grad = _value_and_grad(kd_loss_of, student, encoded, nothing, chunk_size=chunk_size)
        assert loss.item() == 0.0 and torch.all(grad == 0)


def test_encoded_loss_argument_errors():
    student, teacher, labels = _inputs()
    encoded = encode_teacher_logits(teacher, "topk", k=3, temperature=2.0)
    with pytest.raises(ValueError, match="encoded at temperature 2.0, the loss asks for 1.0"):
        kd_loss_of(student, encoded, labels, temperature=1.0)
    with pytest.raises(ValueError, match="do not fit student logits"):
        kd_loss_of(student[:1], encoded, labels[:1], temperature=2.0)
    with pytest.raises(ValueError, match="a teacher answer is a dict with a mode, got Tensor"):
        kd_loss_of(student, teacher, labels)
    with pytest.raises(ValueError, match="chunk_size"):
        kd_loss_of(student, encoded, labels, temperature=2.0, chunk_size=0)


# ------------------------------------------------------------------------------------- divergences


def _reference_divergence(student, teacher, labels, temperature, divergence, beta=0.5):
    """Each divergence written out token by token in float64, through autograd for the gradient."""
    student64 = student.detach().double().requires_grad_()
    vocab = student.shape[-1]
    terms = []
    for s, t, y in zip(student64.reshape(-1, vocab), teacher.double().reshape(-1, vocab), labels.reshape(-1)):
        if y == -100:
            continue
        p, q = torch.softmax(t / temperature, -1), torch.softmax(s / temperature, -1)
        if divergence == "forward_kl":
            terms.append((p * (p.log() - q.log())).sum())
        elif divergence == "reverse_kl":
            terms.append((q * (q.log() - p.log())).sum())
        elif divergence == "skew_forward_kl":  # DistiLLM eq. 2, alpha = beta
            m = beta * p + (1 - beta) * q
            terms.append((p * (p.log() - m.log())).sum())
        elif divergence == "skew_reverse_kl":  # DistiLLM eq. 3
            m = (1 - beta) * p + beta * q
            terms.append((q * (q.log() - m.log())).sum())
        elif divergence == "tvd":
            terms.append(0.5 * (p - q).abs().sum())
        else:
            m = beta * p + (1 - beta) * q
            terms.append(beta * (p * (p.log() - m.log())).sum() + (1 - beta) * (q * (q.log() - m.log())).sum())
    loss = temperature**2 * torch.stack(terms).sum() / max(len(terms), 1)
    (grad,) = torch.autograd.grad(loss, student64)
    return loss.detach(), grad


@pytest.mark.parametrize("divergence,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.1),
                                             ("jsd", 0.9), ("skew_forward_kl", 0.1), ("skew_forward_kl", 0.7),
                                             ("skew_reverse_kl", 0.1), ("skew_reverse_kl", 0.7), ("tvd", 0.5)])
@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_divergences_match_the_written_out_formula_and_its_gradient(divergence, beta, chunk_size, temperature):
    student, teacher, labels = _inputs()
    want, want_grad = _reference_divergence(student, teacher, labels, temperature, divergence, beta)
    got, got_grad = _value_and_grad(kd_loss, student, teacher, labels, temperature=temperature,
                                    chunk_size=chunk_size, divergence=divergence, jsd_beta=beta, skew_alpha=beta)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("alpha", [0.9, 0.99])
def test_the_chunked_skew_reverse_kl_gradient_keeps_float32_precision_as_alpha_nears_one(alpha):
    """In float32 the chunked gradient stays within 5e-6 (relative norm) of float64's: h less its constants
    measured 1.8e-6 / 1.4e-6 at alpha 0.9 / 0.99, h = log q - log m - alpha q / m as written 1.5e-5 / 1.1e-4,
    plain float32 autograd 7.1e-6 / 4.0e-5."""
    student, teacher, labels = _inputs((8, 64, 1000), ignored=())
    _, want = _value_and_grad(kd_loss, student, teacher, labels, divergence="skew_reverse_kl", skew_alpha=alpha)
    student32 = student.detach().float().requires_grad_()
    _, got = _value_and_grad(kd_loss, student32, teacher.float(), labels, chunk_size=64,
                             divergence="skew_reverse_kl", skew_alpha=alpha)
    assert (got.double() - want).norm() / want.norm() < 5e-6


def test_divergences_are_zero_at_the_teacher_and_order_as_expected():
    student, teacher, labels = _inputs()
    for divergence in ("reverse_kl", "jsd", "skew_forward_kl", "skew_reverse_kl", "tvd"):
        same = kd_loss(teacher.clone().requires_grad_(), teacher, labels, divergence=divergence, chunk_size=4)
        assert abs(same.item()) < 1e-12
    # JSD is bounded by log 2 per token (beta 0.5), TVD by 1; reverse and forward KL are not symmetric.
    jsd = kd_loss(student, teacher, labels, divergence="jsd")
    assert 0 < jsd.item() <= math.log(2)
    assert 0 < kd_loss(student, teacher, labels, divergence="tvd").item() <= 1
    # The skew bounds the KL by -log(alpha) per token (the mixture holds alpha of the target), and the skewed
    # KL lies below the plain one.
    for skewed, plain in (("skew_forward_kl", "forward_kl"), ("skew_reverse_kl", "reverse_kl")):
        value = kd_loss(student, teacher, labels, divergence=skewed, skew_alpha=0.1).item()
        assert 0 < value < min(-math.log(0.1), kd_loss(student, teacher, labels, divergence=plain).item())
    assert kd_loss(student, teacher, labels, divergence="reverse_kl").item() != pytest.approx(
        kd_loss(student, teacher, labels).item())


def test_divergence_errors_and_full_encodings():
    student, teacher, labels = _inputs()
    with pytest.raises(ValueError, match="divergence must be one of"):
        kd_loss(student, teacher, labels, divergence="total_variation")
    with pytest.raises(ValueError, match="jsd_beta must lie strictly between 0 and 1"):
        kd_loss(student, teacher, labels, divergence="jsd", jsd_beta=1.0)
    with pytest.raises(ValueError, match="skew_alpha must lie strictly between 0 and 1"):
        kd_loss(student, teacher, labels, divergence="skew_reverse_kl", skew_alpha=0.0)
    for divergence in ("skew_forward_kl", "tvd"):
        with pytest.raises(ValueError, match="needs the teacher's whole distribution"):
            kd_loss_of(student, encode_teacher_logits(teacher, "topk", k=3), labels, divergence=divergence)
    with pytest.raises(ValueError, match="needs the teacher's whole distribution"):
        kd_loss_of(student, encode_teacher_logits(teacher, "topk", k=3), labels, divergence="reverse_kl")
    for mode in ("full", "full_bf16"):
        encoded = encode_teacher_logits(teacher, mode)
        got = kd_loss_of(student, encoded, labels, divergence="jsd", jsd_beta=0.3)
        want = kd_loss(student, encoded["logits"], labels, divergence="jsd", jsd_beta=0.3)
        assert got.item() == want.item()


# ------------------------------------------------------------------------------------ vocab-parallel
# One 4-rank world. Every rank builds the same inputs from a seed, computes the single-process plain
# reference itself, and compares it with the vocab-parallel loss and the gathered student gradient.


@functools.cache
def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _tp4():
    return _mesh((4,), ("tp",))


def _dp2_tp2():
    return _mesh((2, 2), ("dp", "tp"))


def _sharded(tensor, mesh, *, requires_grad=False):
    """`tensor` as a DTensor sharded on its last dim over the mesh's tp axis (replicated on any other)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements = [Shard(-1) if name == "tp" else Replicate() for name in mesh.mesh_dim_names]
    return distribute_tensor(tensor.detach(), mesh, placements).requires_grad_(requires_grad)


def _teacher_forms(teacher, mesh):
    """The three accepted teacher forms: DTensor, the local slice (DTensor's own offsets), the full tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dtensor = _sharded(teacher, mesh)
    local_shape, offset = compute_local_shape_and_global_offset(teacher.shape, mesh, dtensor.placements)
    local = teacher.narrow(-1, offset[-1], local_shape[-1])
    assert torch.equal(local, dtensor.to_local())
    return [dtensor, local, teacher]


def _compare(loss_fn, mesh, student, labels, *, teacher=(), teacher_in=None, rtol, **kwargs):
    """Vocab-parallel loss and gathered gradient vs. the plain path on the full tensors.

    `teacher` is () for cross-entropy; `teacher_in` is the form handed to the vocab-parallel call.
    """
    extra = (teacher,) if isinstance(teacher, torch.Tensor) else ()
    want, want_grad = _value_and_grad(loss_fn, student, *extra, labels, **kwargs)
    sharded = _sharded(student, mesh, requires_grad=True)
    # The gradient as the loss hands it back, before it is accumulated into `.grad`: torch 2.11 lays an
    # unevenly sharded leaf's `.grad` out again as Replicate (its local strides differ from the global ones).
    grads = []
    sharded.register_hook(grads.append)
    extra_in = (teacher if teacher_in is None else teacher_in,) if extra else ()
    got = loss_fn(sharded, *extra_in, labels, **kwargs)
    got.backward()
    assert not hasattr(got, "device_mesh"), "the loss is a plain tensor"
    torch.testing.assert_close(got.detach(), want, rtol=rtol, atol=1e-7)
    assert grads[0].placements == sharded.placements
    torch.testing.assert_close(grads[0].full_tensor(), want_grad, rtol=rtol, atol=1e-7)


def check_kd_vocab_parallel_uneven_shards():
    # vocab 10 on tp 4 is 3, 3, 3, 1 (torch.chunk, not tensor_split's 3, 3, 2, 2); vocab 5 is 2, 2, 1, 0.
    for vocab, dtype in ((10, torch.float64), (5, torch.float32), (10, torch.float32)):
        student, teacher, labels = _inputs((2, 5, vocab), dtype=dtype, seed=vocab)
        rtol = 1e-10 if dtype == torch.float64 else 1e-5
        for teacher_in in _teacher_forms(teacher, _tp4()):
            for chunk_size in (None, 3):
                for temperature in (1.0, 2.0):
                    _compare(kd_loss, _tp4(), student, labels, teacher=teacher, teacher_in=teacher_in, rtol=rtol,
                             temperature=temperature, chunk_size=chunk_size)  # fmt: skip


def check_kd_vocab_parallel_2d_mesh():
    # vocab 11 on tp 2 (6, 5), replicated over a dp axis: only the tp group takes part in the reductions.
    student, teacher, labels = _inputs((3, 4, 11), dtype=torch.float32, seed=11)
    for teacher_in in _teacher_forms(teacher, _dp2_tp2()):
        _compare(kd_loss, _dp2_tp2(), student, labels, teacher=teacher, teacher_in=teacher_in, rtol=1e-5,
                 temperature=1.5, chunk_size=5)  # fmt: skip
    _compare(kd_loss, _dp2_tp2(), student, labels, teacher=teacher, rtol=1e-5, num_valid_tokens=torch.tensor(40))


def check_kd_vocab_parallel_minus_inf_teacher():
    # Rank 0's slice of token 0 is all -inf: its local max is -inf, the global one is not.
    student, teacher, labels = _inputs((2, 5, 10), seed=3)
    teacher[0, 0, :3] = -math.inf
    teacher[1, 1, 3:] = -math.inf
    _compare(kd_loss, _tp4(), student, labels, teacher=teacher, rtol=1e-10, chunk_size=4)
    assert math.isfinite(kd_loss(_sharded(student, _tp4()), teacher, labels).item())


def check_ce_vocab_parallel():
    for mesh, vocab in ((_tp4(), 10), (_tp4(), 5), (_dp2_tp2(), 11)):
        student, _, labels = _inputs((2, 5, vocab), dtype=torch.float32, seed=vocab)
        labels[0, :] = vocab - 1  # the last vocab entry: the last (possibly short) slice owns it
        for chunk_size in (None, 3, 1000):
            _compare(cross_entropy_loss, mesh, student, labels, rtol=1e-5, chunk_size=chunk_size)


def check_vocab_parallel_all_ignored():
    student, teacher, labels = _inputs((2, 5, 10), seed=4)
    labels.fill_(-100)
    for loss_fn, extra in ((kd_loss, (teacher,)), (cross_entropy_loss, ())):
        sharded = _sharded(student, _tp4(), requires_grad=True)
        loss = loss_fn(sharded, *extra, labels, chunk_size=3)
        loss.backward()
        assert loss.item() == 0.0
        assert torch.all(sharded.grad.full_tensor() == 0)


def check_vocab_parallel_errors():
    # Raised before any collective, on every rank alike.
    from torch.distributed.tensor import Replicate, distribute_tensor

    student, teacher, labels = _inputs((2, 5, 10), seed=5)
    replicated = distribute_tensor(student.detach(), _tp4(), [Replicate()])
    with pytest.raises(ValueError, match="sharded on the vocab dim"):
        kd_loss(replicated, teacher, labels)
    with pytest.raises(ValueError, match="sharded on the vocab dim"):
        cross_entropy_loss(replicated, labels)
    with pytest.raises(ValueError, match=r"matches neither .* \(2, 5, 10\) nor its local vocab slice"):
        kd_loss(_sharded(student, _tp4()), teacher[..., :4], labels)
    with pytest.raises(ValueError, match=r"teacher_logits shape \(2, 5, 9\) does not match"):
        kd_loss(_sharded(student, _tp4()), _sharded(teacher[..., :9], _tp4()), labels)




def check_vocab_parallel_communication():
    # Only all-reduces, all in forward: per chunk one MAX and one SUM, plus KD's final scalar SUM.
    from torch.distributed.tensor.debug import CommDebugMode

    student, teacher, labels = _inputs((2, 5, 10), seed=6)  # 10 tokens: chunks of 3 -> 4 chunks
    for loss_fn, extra, forward_count in ((kd_loss, (teacher,), 9), (cross_entropy_loss, (), 8)):
        sharded = _sharded(student, _tp4(), requires_grad=True)
        with CommDebugMode() as forward:
            loss = loss_fn(sharded, *extra, labels, chunk_size=3)
        with CommDebugMode() as backward:  # autograd.grad: the loss's backward without torch 2.11's re-layout
            torch.autograd.grad(loss, sharded)  # of an unevenly sharded leaf's `.grad` (an all-gather)
        counts = {str(op): count for op, count in forward.get_comm_counts().items() if count}
        assert counts == {"c10d.allreduce_": forward_count}, counts
        assert backward.get_total_counts() == 0, backward.get_comm_counts()


def check_divergences_vocab_parallel():
    # Reverse KL and JSD on uneven shards (vocab 10 on tp 4: 3, 3, 3, 1), one more SUM per chunk than KD.
    for divergence, beta in (("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.2), ("skew_forward_kl", 0.1),
                             ("skew_reverse_kl", 0.3), ("tvd", 0.5)):
        for vocab, dtype, rtol in ((10, torch.float64, 1e-10), (5, torch.float32, 1e-5)):
            student, teacher, labels = _inputs((2, 5, vocab), dtype=dtype, seed=vocab + 1)
            for chunk_size in (None, 3):
                _compare(kd_loss, _tp4(), student, labels, teacher=teacher, rtol=rtol, temperature=1.5,
                         chunk_size=chunk_size, divergence=divergence, jsd_beta=beta, skew_alpha=beta)  # fmt: skip
            want, _ = _reference_divergence(student, teacher, labels, 1.5, divergence, beta)
            got = kd_loss(_sharded(student, _tp4()), teacher, labels, temperature=1.5, divergence=divergence,
                          jsd_beta=beta, skew_alpha=beta)
            assert got.item() == pytest.approx(want.item(), rel=rtol)


def check_kd_topk_vocab_parallel():
    # vocab 10 on tp 4 (3, 3, 3, 1) and vocab 5 (2, 2, 1, 0: a rank owns nothing), rest bucket and tail samples.
    for vocab, k, samples in ((10, 3, 0), (10, 3, 2), (5, 2, 0), (5, 1, 3), (10, 10, 0)):
        student, teacher, labels = _inputs((2, 5, vocab), dtype=torch.float64, seed=vocab + k)
        for temperature in (1.0, 2.0):
            encoded = encode_teacher_logits(teacher, "topk", k=k, temperature=temperature, tail_samples=samples)
            for chunk_size in (None, 3):
                want, want_grad = _value_and_grad(kd_loss_of, student, encoded, labels,
                                                  temperature=temperature)  # fmt: skip
                sharded = _sharded(student, _tp4(), requires_grad=True)
                got = kd_loss_of(sharded, encoded, labels, temperature=temperature, chunk_size=chunk_size)
                got.backward()
                torch.testing.assert_close(got.detach(), want, rtol=1e-10, atol=1e-12)
                torch.testing.assert_close(sharded.grad.full_tensor(), want_grad, rtol=1e-9, atol=1e-12)
    # One MAX and one SUM all-reduce per chunk, all in forward; nothing else.
    from torch.distributed.tensor.debug import CommDebugMode

    student, teacher, labels = _inputs((2, 5, 10), seed=6)
    sharded = _sharded(student, _tp4(), requires_grad=True)
    with CommDebugMode() as forward:
        loss = kd_loss_of(sharded, encode_teacher_logits(teacher, "topk", k=3), labels, chunk_size=3)
    with CommDebugMode() as backward:  # autograd.grad: as in check_vocab_parallel_communication
        torch.autograd.grad(loss, sharded)
    counts = {str(op): count for op, count in forward.get_comm_counts().items() if count}
    assert counts == {"c10d.allreduce_": 8}, counts
    assert backward.get_total_counts() == 0


def check_top1_vocab_parallel():
    # Each vocab slice compares its own entries (vocab 5 on tp 4: a rank holds none); the same counts as plain.
    for mesh, vocab in ((_tp4(), 10), (_tp4(), 5), (_dp2_tp2(), 11)):
        student, teacher, labels = _inputs((3, 6, vocab), dtype=torch.float32, seed=vocab)
        student = student.detach()
        top = teacher.argmax(-1)
        top[0, :] = vocab - 1  # the last (possibly short) slice owns it
        student[0, 0, vocab - 1] = 100.0
        want = top1_agreements(student, top, labels)
        assert 0 < want.item() < 16
        assert top1_agreements(_sharded(student, mesh), top, labels).item() == want.item()


test_vocab_parallel = world_test(
    4,
    [
        check_kd_vocab_parallel_uneven_shards,
        check_kd_vocab_parallel_2d_mesh,
        check_kd_vocab_parallel_minus_inf_teacher,
        check_ce_vocab_parallel,
        check_vocab_parallel_all_ignored,
        check_vocab_parallel_errors,
        check_vocab_parallel_communication,
        check_kd_topk_vocab_parallel,
        check_divergences_vocab_parallel,
        check_top1_vocab_parallel,
    ],
)

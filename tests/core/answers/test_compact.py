"""Compact top-k answers (`meshkd.core.answers.compact`): bytes a token, what decodes exactly, the decoded answer's
KL to the exact one within the documented bound, the loss on the decoded answer, and malformed answers refused."""

import math

import pytest
import torch

from meshkd.core.answers import LossContext, answer_of, encode_teacher_logits
from meshkd.core.answers.compact import COMPACT, elias_fano_bits, nbytes_per_token, pack_topk, unpack_topk
from meshkd.recipe.settings.config import KDConfig
from tests.received import kd_loss_of, received

BOUND = (1 / 32) ** 2 / 2  # the module docstring's second-order bound, nats a token


def test_bytes_a_token():
    # Sorted indices in Elias-Fano form: l low bits each, then a bitmap of n ones and a zero per high part.
    assert elias_fano_bits(64, 49152) == (9, 64 * 9 + 64 + 96)
    assert elias_fano_bits(32, 49152) == (10, 32 * 10 + 32 + 48)
    assert nbytes_per_token(64, 32, 49152) == 215  # (736 + 400 + 6) bits, 64 value bytes, two float32
    assert nbytes_per_token(64, 32, 151936) == 235
    assert nbytes_per_token(64, 0, 49152) == 161  # no tail samples: no mean of theirs
    assert nbytes_per_token(8, 4, 262) == 28
    assert nbytes_per_token(64, 32, 49152) * 5 > 772  # a fifth is below what 96 indices carry (module docstring)


@pytest.mark.parametrize("vocab, k, m, temperature", [(49152, 64, 32, 1.0), (151936, 64, 32, 2.0), (262, 8, 4, 0.5),
                                                     (262, 8, 0, 1.0), (8, 8, 0, 1.0)])
def test_indices_and_tail_mass_decode_exactly_and_the_values_within_the_bound(vocab, k, m, temperature):
    torch.manual_seed(vocab + k)
    logits = torch.randn(2, 40, vocab) * 4
    exact = encode_teacher_logits(logits, "topk", k=k, temperature=temperature, tail_samples=m, seed=3)
    compact = pack_topk(exact, vocab)
    assert compact["mode"] == COMPACT and compact["packed"].dtype == torch.uint8
    assert tuple(compact["packed"].shape) == (2, 40, nbytes_per_token(k, m, vocab))
    decoded = unpack_topk(compact)
    assert received(decoded, (2, 40, vocab)) == "topk"
    assert set(decoded) == set(exact) and decoded["temperature"] == temperature
    for key in ("tail_log_prob", *(("tail_indices",) if m else ())):
        assert torch.equal(decoded[key], exact[key]), key
    # The top indices as a set, each with its own value, in decreasing order, the top-1 in its place.
    assert torch.equal(decoded["indices"].sort(-1).values, exact["indices"].sort(-1).values)
    assert torch.equal(decoded["indices"][..., 0], exact["indices"][..., 0])
    assert (decoded["log_probs"][..., 1:] <= decoded["log_probs"][..., :-1]).all()
    exact_value = torch.full(logits.shape, math.nan).scatter(-1, exact["indices"].long(), exact["log_probs"])
    own = exact_value.gather(-1, decoded["indices"].long())
    kept = own > -15  # above the quantizer's floor (e^-15.97)
    assert (own - decoded["log_probs"])[kept].abs().max() <= 1 / 16
    # A proper distribution with the exact tail mass, its KL to the exact answer within the bound.
    mass = decoded["log_probs"].exp().sum(-1) + decoded["tail_log_prob"].exp()
    assert torch.allclose(mass, torch.ones_like(mass), atol=1e-5)
    kl = (exact["log_probs"].exp() * (exact["log_probs"] - decoded["log_probs"])).sum(-1)
    assert kl.max() <= BOUND and kl.min() >= -1e-6
    if m:  # the samples' log-probabilities by their mean, all the loss reads of them
        mean = exact["tail_log_probs"].mean(-1, keepdim=True)
        assert torch.allclose(decoded["tail_log_probs"], mean.expand_as(decoded["tail_log_probs"]), atol=1e-6)


def test_the_loss_on_the_decoded_answer_is_close_to_the_exact_ones():
    """The loss moves by sum (p - p_hat)(log p - log q) over the k entries: small, but tied to the student's log q,
    not to the bound alone; its gradient T (p_s - p_hat) by at most e^(1/16) - 1 of each teacher probability."""
    torch.manual_seed(0)
    vocab = 4096
    teacher, student = torch.randn(3, 50, vocab) * 3, torch.randn(3, 50, vocab, requires_grad=True)
    labels = torch.randint(0, vocab, (3, 50))
    losses, grads = [], []
    for packed in (False, True):
        encoded = encode_teacher_logits(teacher, "topk", k=64, tail_samples=0)
        encoded = unpack_topk(pack_topk(encoded, vocab)) if packed else encoded
        loss = kd_loss_of(student, encoded, labels, temperature=1.0)
        (grad,) = torch.autograd.grad(loss, student)
        losses.append(loss.item())
        grads.append(grad)
    assert abs(losses[1] - losses[0]) <= 1e-3 * losses[0]
    assert (grads[1] - grads[0]).abs().max() <= 0.05 / (3 * 50)  # p_hat moves by at most e^(1/16) - 1 of p


def test_a_malformed_compact_answer_is_refused_naming_what_does_not_fit():
    exact = encode_teacher_logits(torch.randn(1, 4, 262), "topk", k=8, tail_samples=4)
    compact = pack_topk(exact, 262)
    with pytest.raises(ValueError, match=r"packs 28 bytes a token \(uint8 \[\.\.\., 28\]\), got torch.uint8 "
                                         r"\(1, 4, 27\)"):
        unpack_topk({**compact, "packed": compact["packed"][..., :27]})
    with pytest.raises(ValueError, match=r"needs integers k >= 1, tail_samples >= 0 and vocab >= k"):
        unpack_topk({**compact, "vocab": 4})
    with pytest.raises(ValueError, match=r"got torch.int32"):
        unpack_topk({**compact, "packed": compact["packed"].int()})
    # A damaged index bitmap (a one more or less: bit 50 lies in the top indices' bitmap, after 8 x 4 low bits),
    # or every index bit set: the index check refuses the answer (once a micro-batch, its flag deferred).
    def index_errors(answer) -> bool:
        checks = LossContext(KDConfig(), index_checks=[])
        answer_of(answer).check_indices(checks, 262)
        return bool(checks.index_checks[0])

    assert elias_fano_bits(8, 262) == (4, 57) and not index_errors(compact)
    index_bytes = math.ceil((57 + elias_fano_bits(4, 262)[1] + 3) / 8)
    for damage in ("flip", "fill"):
        bad = compact["packed"].clone()
        if damage == "flip":
            bad[0, 0, 50 // 8] ^= 1 << 50 % 8
        else:
            bad[0, 0, :index_bytes] = 255
        assert index_errors({**compact, "packed": bad}), damage
    with pytest.raises(ValueError, match=r"indices must be distinct per token and lie in \[0, 262\).*bitmaps hold"):
        received({**compact, "packed": bad}, (1, 4, 262))
    assert math.isfinite(unpack_topk(compact)["log_probs"].sum().item())

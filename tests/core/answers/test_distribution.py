"""The kinds of distribution a teacher answers in (`meshkd.core.answers`): what each carries, how many bytes, and the
checks of a received one.

Pure functions, no process group. The KD losses of the kinds are tested in tests/core/test_loss.py, their
transport in tests/core/test_bridge.py.
"""

import math

import pytest
import torch

from meshkd.core.answers import LABEL_LOG_PROBS, LossContext, answer_of, encode_teacher_logits, label_log_probs
from meshkd.core.wire import payload_nbytes as encoded_nbytes
from meshkd.recipe.settings.config import KDConfig


def check_encoded_logits(encoded, shape) -> str:
    """The checks a student makes of a received answer: its kind (by mode), its fields against the student's logits
    of `shape`, its index values (at once here); the kind's name."""
    answer = answer_of(encoded)
    answer.check(answer.encoding, tuple(shape))
    answer.check_indices(LossContext(KDConfig()), shape[-1])
    return answer.name


def teacher_logits(shape=(2, 3, 40), seed=0, dtype=torch.float32):
    return 4 * torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_full_modes_carry_the_logits():
    logits = teacher_logits()
    full = encode_teacher_logits(logits, "full")
    assert set(full) == {"mode", "logits"} and full["mode"] == "full"
    assert full["logits"].data_ptr() == logits.data_ptr()  # sent from the teacher's own memory
    half = encode_teacher_logits(logits, "full_bf16")
    assert half["logits"].dtype == torch.bfloat16 and torch.equal(half["logits"], logits.to(torch.bfloat16))
    assert encoded_nbytes(full) == 2 * 3 * 40 * 4 and encoded_nbytes(half) == encoded_nbytes(full) // 2
    assert answer_of(full).wire["logits"] is full["logits"] and answer_of(half).wire["logits"] is half["logits"]
    # `full` keeps the teacher's dtype: a bfloat16 teacher's logits travel as bfloat16, 2 bytes each.
    bf16 = encode_teacher_logits(logits.to(torch.bfloat16), "full")
    assert bf16["logits"].dtype == torch.bfloat16 and encoded_nbytes(bf16) == encoded_nbytes(half)


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_topk_carries_top_log_probs_indices_and_the_exact_tail(temperature):
    logits = teacher_logits(dtype=torch.float64)
    encoded = encode_teacher_logits(logits, "topk", k=5, temperature=temperature, chunk_size=4)
    assert set(encoded) == {"mode", "temperature", "log_probs", "indices", "tail_log_prob"}
    assert encoded["temperature"] == temperature
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    top, index = log_p.topk(5, dim=-1)
    assert encoded["indices"].dtype == torch.int32 and torch.equal(encoded["indices"].long(), index)
    assert encoded["log_probs"].dtype == torch.float32
    torch.testing.assert_close(encoded["log_probs"].double(), top, rtol=0, atol=1e-5)
    tail = torch.log1p(-top.exp().sum(-1))
    torch.testing.assert_close(encoded["tail_log_prob"].double(), tail, rtol=1e-5, atol=1e-6)
    padded = [-(-size // 16) * 16 for size in (2 * 3 * 5 * 4, 2 * 3 * 5 * 4, 2 * 3 * 4)]  # leaves start 16-aligned
    assert encoded_nbytes(encoded) == sum(padded)


def test_topk_tail_is_exact_when_tiny_and_minus_inf_when_empty():
    logits = torch.tensor([[30.0, 0.0, -10.0, -10.0]])
    encoded = encode_teacher_logits(logits, "topk", k=1)
    # 1 - p_top is 9.4e-14: log1p(-sum) in float32 would be 0 or garbage; the tail's own logsumexp is exact.
    expected = torch.logsumexp(logits[0, 1:].double(), 0) - torch.logsumexp(logits[0].double(), 0)
    assert encoded["tail_log_prob"].item() == pytest.approx(expected.item(), rel=1e-6)
    everything = encode_teacher_logits(logits, "topk", k=4)
    assert everything["tail_log_prob"].item() == -math.inf


def test_tail_samples_follow_the_tail_distribution():
    # One distribution over 8 tokens, repeated: the top-2 are never sampled, the rest in proportion.
    logits = torch.tensor([5.0, 4.0, 2.0, 1.5, 1.0, 0.0, -1.0, -3.0]).expand(4000, 8)
    encoded = encode_teacher_logits(logits, "topk", k=2, tail_samples=3, seed=3, temperature=1.5)
    samples = encoded["tail_indices"].long()
    assert samples.shape == (4000, 3) and encoded["tail_log_probs"].shape == (4000, 3)
    assert not torch.isin(samples, torch.tensor([0, 1])).any()
    log_p = torch.log_softmax(logits[0] / 1.5, dim=-1)
    torch.testing.assert_close(encoded["tail_log_probs"], log_p[samples])
    frequencies = torch.bincount(samples.flatten(), minlength=8).double() / samples.numel()
    tail = log_p.exp().double()
    tail[:2] = 0
    torch.testing.assert_close(frequencies, tail / tail.sum(), rtol=0, atol=0.01)
    assert encoded_nbytes(encoded) == 4000 * (2 * 8 + 4 + 3 * 8)
    again = encode_teacher_logits(logits, "topk", k=2, tail_samples=3, seed=3, temperature=1.5)
    other = encode_teacher_logits(logits, "topk", k=2, tail_samples=3, seed=4, temperature=1.5)
    assert torch.equal(again["tail_indices"], encoded["tail_indices"])
    assert not torch.equal(other["tail_indices"], encoded["tail_indices"])


def test_tail_samples_of_a_row_without_tail_carry_no_weight():
    logits = torch.tensor([[1.0, 2.0, -math.inf, -math.inf]])
    encoded = encode_teacher_logits(logits, "topk", k=2, tail_samples=2)
    assert encoded["tail_log_prob"].item() == -math.inf  # so the samples' weight P_rest / m is 0
    assert ((encoded["tail_indices"] >= 0) & (encoded["tail_indices"] < 4)).all()


def test_label_log_probs_are_minus_the_per_token_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11) * 3
    labels = torch.randint(0, 11, (2, 5))
    labels[0, 1] = labels[1, 4] = -100
    answer = label_log_probs(logits, labels, ignore_index=-100, chunk_size=3)
    assert answer["mode"] == LABEL_LOG_PROBS and answer["log_probs"].dtype == torch.float32
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(answer["log_probs"].reshape(-1), -ce, atol=1e-6, rtol=0)
    assert answer["log_probs"][0, 1] == 0 and answer["log_probs"][1, 4] == 0
    with pytest.raises(ValueError, match="do not fit"):
        label_log_probs(logits, labels[:, :4])


def test_an_answer_with_label_log_probs_carries_them_beside_its_distribution():
    logits, labels = teacher_logits(), torch.tensor([[1, 2, -100], [0, 3, 4]])
    encoded = encode_teacher_logits(logits, "topk", k=3)
    log_probs = label_log_probs(logits, labels)["log_probs"]
    answer = answer_of({**encoded, LABEL_LOG_PROBS: log_probs})
    assert answer.encoding == encoded and answer.label_log_probs() is log_probs
    assert check_encoded_logits({**encoded, LABEL_LOG_PROBS: log_probs}, logits.shape) == "topk"
    with pytest.raises(ValueError, match="must hold a label_log_probs tensor"):
        answer_of(encoded).label_log_probs()


def test_encode_rejects_bad_arguments():
    logits = teacher_logits()
    with pytest.raises(ValueError, match="a teacher answer of mode 'top_k': the student knows"):
        encode_teacher_logits(logits, "top_k")
    with pytest.raises(ValueError, match="'label_log_probs' is no encoding of the teacher's logits"):
        encode_teacher_logits(logits, LABEL_LOG_PROBS)
    with pytest.raises(ValueError, match=r"1 <= k <= vocab \(40\)"):
        encode_teacher_logits(logits, "topk", k=41)
    with pytest.raises(ValueError, match=r"1 <= k <= vocab"):
        encode_teacher_logits(logits, "topk")
    with pytest.raises(ValueError, match="temperature"):
        encode_teacher_logits(logits, "topk", k=3, temperature=0.0)
    with pytest.raises(ValueError, match="tail_samples >= 0"):
        encode_teacher_logits(logits, "topk", k=3, tail_samples=-1)
    with pytest.raises(ValueError, match="floating-point"):
        encode_teacher_logits(torch.ones(2, 3, dtype=torch.int64), "full")


def test_check_accepts_what_encode_makes():
    logits = teacher_logits()
    for mode, options in (("full", {}), ("full_bf16", {}), ("topk", {"k": 3}), ("topk", {"k": 3, "tail_samples": 2})):
        assert check_encoded_logits(encode_teacher_logits(logits, mode, **options), logits.shape) == mode


def corrupt(**changes):
    encoded = encode_teacher_logits(teacher_logits(), "topk", k=3, tail_samples=2)
    for name, value in changes.items():
        if value is None:
            del encoded[name]
        else:
            encoded[name] = value
    return encoded


@pytest.mark.parametrize(
    "encoded, message",
    [
        (torch.zeros(2, 3, 40), "a teacher answer is a dict with a mode, got Tensor"),
        ({"mode": "sparse"}, "a teacher answer of mode 'sparse'"),
        ({"mode": "full", "logits": torch.zeros(2, 3, 39)}, r"are \(2, 3, 39\), the student's are \(2, 3, 40\)"),
        ({"mode": "full", "logits": torch.zeros(2, 3, 40), "extra": 1}, "need fields"),
        (corrupt(tail_log_prob=None), "need fields"),
        (corrupt(tail_indices=None), "need fields"),
        (corrupt(temperature=2), "positive finite float"),
        (corrupt(indices=torch.zeros(2, 3, 4, dtype=torch.int32)), "do not fit student logits"),
        (corrupt(log_probs=torch.zeros(2, 3, 41), indices=torch.zeros(2, 3, 41, dtype=torch.int32)), "1 <= k"),
        (corrupt(indices=torch.zeros(2, 3, 3, dtype=torch.float32)), "int32 or int64"),
        (corrupt(indices=torch.tensor([0, 1, 40], dtype=torch.int32).expand(2, 3, 3)), r"lie in \[0, 40\)"),
        (corrupt(indices=torch.tensor([0, 1, 1], dtype=torch.int32).expand(2, 3, 3)), "distinct per token"),
        (corrupt(tail_indices=torch.full((2, 3, 2), -1, dtype=torch.int32)), "tail indices too"),
        (corrupt(tail_log_probs=torch.zeros(2, 3, 5)), r"\[..., m\]"),
    ],
)
def test_check_rejects_malformed_encodings(encoded, message):
    with pytest.raises(ValueError, match=message):
        check_encoded_logits(encoded, (2, 3, 40))

"""Cross-tokenizer losses (no process group): reductions to `kd_loss`, the chain rule, ULD, GOLD, the projection."""

import math

import pytest
import torch
import torch.nn.functional as F

from meshkd.core.aligned_packing import pack_aligned
from meshkd.core.cross_tokenizer_loss import (
    bits_per_byte,
    gold_loss,
    group_log_probs,
    group_nll_and_bytes,
    nll_and_bytes,
    project_teacher_logits,
    projected_kd_loss,
    uld_loss,
)
from meshkd.core.loss import kd_loss
from meshkd.core.token_alignment import IGNORE_INDEX
from meshkd.core.token_bytes import token_bytes
from meshkd.core.vocabulary_map import VocabularyMap, build_vocabulary_map
from tests.core.tokenizers_on_the_fly import TOKENIZERS


def _same_tokenizer_batch(name="bytelevel_bpe_300"):
    tokenizer = TOKENIZERS[name]()
    documents = ["héllo wörld 😀  東京", "  a\tb  ", "naïve café " * 3, "x"]
    batch = pack_aligned(documents, tokenizer, tokenizer, student_sequence_length=24, teacher_sequence_length=24)
    return tokenizer, batch


def _value_and_grad(loss_fn, student):
    student = student.detach().clone().requires_grad_(True)
    value = loss_fn(student)
    (grad,) = torch.autograd.grad(value, student)
    return value.detach(), grad


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_gold_with_one_tokenizer_is_kd_loss(divergence, temperature):
    tokenizer, batch = _same_tokenizer_batch()
    vocabulary_map = build_vocabulary_map(tokenizer, tokenizer)
    labels = batch.student["labels"].reshape(-1)
    vocab = len(tokenizer)
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(len(labels), vocab, generator=generator, dtype=torch.float64) * 3
    teacher = torch.randn(len(labels), vocab, generator=generator, dtype=torch.float64) * 3
    groups = batch.groups

    def gold(s):
        teacher_groups = group_log_probs(teacher, labels, groups.teacher_first, groups.teacher_last,
                                         temperature=temperature)
        return gold_loss(s, labels, teacher_groups, vocabulary_map, student_first=groups.student_first,
                         student_last=groups.student_last, temperature=temperature, divergence=divergence)

    expected, expected_grad = _value_and_grad(
        lambda s: kd_loss(s, teacher, labels, temperature=temperature, divergence=divergence), student
    )
    value, grad = _value_and_grad(gold, student)
    assert abs(float(value) - float(expected)) <= 1e-6 * max(1.0, abs(float(expected)))
    assert float((grad - expected_grad).abs().max()) <= 1e-6
    assert float(expected) > 0.1  # not trivially zero


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_projection_with_one_tokenizer_is_kd_loss(divergence, temperature):
    tokenizer, batch = _same_tokenizer_batch("unigram_120")
    vocabulary_map = build_vocabulary_map(tokenizer, tokenizer)
    labels = batch.student["labels"].reshape(-1)
    generator = torch.Generator().manual_seed(1)
    student = torch.randn(len(labels), len(tokenizer), generator=generator, dtype=torch.float64) * 2
    teacher = torch.randn(len(labels), len(tokenizer), generator=generator, dtype=torch.float64) * 2
    groups = batch.groups
    expected, expected_grad = _value_and_grad(
        lambda s: kd_loss(s, teacher, labels, temperature=temperature, divergence=divergence), student
    )
    value, grad = _value_and_grad(lambda s: projected_kd_loss(
        s, teacher, vocabulary_map, student_positions=groups.student_first, teacher_positions=groups.teacher_first,
        temperature=temperature, divergence=divergence,
    ), student)  # fmt: skip
    assert abs(float(value) - float(expected)) <= 1e-6 * max(1.0, abs(float(expected)))
    assert float((grad - expected_grad).abs().max()) <= 1e-6


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_one_tokenizer_with_bos_reduces_every_path_to_kd_loss(name):
    tokenizer = TOKENIZERS[name]()
    bos = tokenizer.bos_token_id is not None
    documents = ["héllo wörld 😀  東京", "  a\tb  ", "naïve café " * 3, "x", "🇫🇷👍🏽\n\n"]
    batch = pack_aligned(documents, tokenizer, tokenizer, student_sequence_length=24, teacher_sequence_length=24,
                         student_add_bos=bos, teacher_add_bos=bos)
    labels = batch.student["labels"].reshape(-1)
    groups = batch.groups
    assert torch.equal(groups.student_first, (labels != IGNORE_INDEX).nonzero()[:, 0])
    vocabulary_map = build_vocabulary_map(tokenizer, tokenizer)
    generator = torch.Generator().manual_seed(5)
    student = torch.randn(len(labels), len(tokenizer), generator=generator, dtype=torch.float64)
    teacher = torch.randn(len(labels), len(tokenizer), generator=generator, dtype=torch.float64)
    expected, expected_grad = _value_and_grad(lambda s: kd_loss(s, teacher, labels), student)
    teacher_groups = group_log_probs(teacher, labels, groups.teacher_first, groups.teacher_last)
    paths = {
        "gold": lambda s: gold_loss(s, labels, teacher_groups, vocabulary_map, student_first=groups.student_first,
                                   student_last=groups.student_last),
        "projection": lambda s: projected_kd_loss(s, teacher, vocabulary_map, student_positions=groups.student_first,
                                                  teacher_positions=groups.teacher_first),
    }
    for path, loss_fn in paths.items():
        value, grad = _value_and_grad(loss_fn, student)
        assert abs(float(value) - float(expected)) <= 1e-6, path
        assert float((grad - expected_grad).abs().max()) <= 1e-6, path


def test_group_log_probs_follow_the_chain_rule():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 5, generator=generator, dtype=torch.float64)
    targets = torch.tensor([3, 1, 4, 0, 2, IGNORE_INDEX])
    merged = group_log_probs(logits, targets, torch.tensor([0, 3, 4]), torch.tensor([2, 3, 4]), temperature=1.5)
    log_p = F.log_softmax(logits / 1.5, dim=-1)
    # Group 0 = positions 0..2: the entry of its last target is the log probability of all three targets.
    assert torch.allclose(merged[0, 4], log_p[0, 3] + log_p[1, 1] + log_p[2, 4])
    # Its row sums to the probability of the earlier targets; one-token groups are the plain log-softmax.
    assert torch.allclose(merged[0].logsumexp(-1), log_p[0, 3] + log_p[1, 1])
    assert torch.allclose(merged[1:], log_p[3:5])
    with pytest.raises(ValueError, match="not a token id"):
        group_log_probs(logits, torch.tensor([3, 1, 4, IGNORE_INDEX, 2, 0]), torch.tensor([3]), torch.tensor([4]))
    with pytest.raises(ValueError, match="0 <= first <= last < 6"):
        group_log_probs(logits, targets, torch.tensor([3]), torch.tensor([2]))


def test_uld_is_the_sorted_l1_and_ignores_token_identity():
    student = torch.tensor([[2.0, 0.0, -1.0]], dtype=torch.float64)
    teacher_probs = torch.tensor([[0.1, 0.2, 0.6, 0.1]], dtype=torch.float64)
    first = last = torch.tensor([0])
    targets = torch.tensor([0])
    p_s = torch.softmax(student[0], -1)
    sorted_teacher = torch.tensor([0.6, 0.2, 0.1], dtype=torch.float64)
    expected = (torch.sort(p_s, descending=True).values - sorted_teacher).abs().sum()
    expected = expected + 0.1  # the student's vocabulary is one shorter: zero-padded
    value = uld_loss(student, targets, teacher_probs.log(), student_first=first, student_last=last)
    assert torch.allclose(value, expected)
    # A permutation of the teacher's vocabulary changes nothing; identical sorted vectors give zero.
    permuted = teacher_probs[:, [3, 2, 0, 1]].log()
    assert torch.allclose(uld_loss(student, targets, permuted, student_first=first, student_last=last), value)
    same = F.log_softmax(student[:, [2, 0, 1]], -1)
    assert float(uld_loss(student, targets, same, student_first=first, student_last=last)) < 1e-12


def test_gold_across_tokenizers_splits_matched_and_unmatched_mass():
    student_tokenizer, teacher_tokenizer = TOKENIZERS["byte"](), TOKENIZERS["bytelevel_bpe_400"]()
    vocabulary_map = build_vocabulary_map(student_tokenizer, teacher_tokenizer)
    # The 256 single bytes and EOS / PAD match (the teacher's learned byte alphabet is a subset).
    teacher_table = token_bytes(teacher_tokenizer)
    single_bytes = sum(1 for entry in teacher_table if entry is not None and len(entry) == 1)
    assert len(vocabulary_map.exact_teacher_ids) == single_bytes + 2
    batch = pack_aligned(["héllo wörld 😀", "naïve café"], student_tokenizer, teacher_tokenizer,
                         student_sequence_length=32, teacher_sequence_length=16)
    groups = batch.groups
    generator = torch.Generator().manual_seed(3)
    s_labels, t_labels = batch.student["labels"].reshape(-1), batch.teacher["labels"].reshape(-1)
    student = torch.randn(len(s_labels), len(student_tokenizer), generator=generator, requires_grad=True)
    teacher = torch.randn(len(t_labels), len(teacher_tokenizer), generator=generator)
    teacher_groups = group_log_probs(teacher, t_labels, groups.teacher_first, groups.teacher_last)
    kwargs = dict(student_first=groups.student_first, student_last=groups.student_last)
    loss = gold_loss(student, s_labels, teacher_groups, vocabulary_map, **kwargs)
    loss.backward()
    assert torch.isfinite(loss) and loss > 0 and torch.isfinite(student.grad).all()
    # The adaptive weights: pure ULD when nothing is matched, and the two parts add up.
    matched = gold_loss(student, s_labels, teacher_groups, vocabulary_map, matched_weight=1.0, unmatched_weight=0.0,
                        **kwargs)
    unmatched = gold_loss(student, s_labels, teacher_groups, vocabulary_map, matched_weight=0.0, unmatched_weight=1.0,
                          **kwargs)
    w = len(vocabulary_map.exact_teacher_ids) / len(teacher_tokenizer)
    assert torch.allclose(loss, w * matched + (1 - w) * unmatched, rtol=1e-5)
    assert matched >= 0 and unmatched >= 0
    empty = torch.empty(0, dtype=torch.int64)
    none = gold_loss(student, s_labels, teacher_groups[:0], vocabulary_map, student_first=empty, student_last=empty)
    assert float(none.detach()) == 0.0


def test_projection_moves_teacher_mass_to_the_student_token_starting_its_bytes():
    student_tokenizer, teacher_tokenizer = TOKENIZERS["byte"](), TOKENIZERS["bytelevel_bpe_400"]()
    vocabulary_map = build_vocabulary_map(student_tokenizer, teacher_tokenizer)
    teacher_table = token_bytes(teacher_tokenizer)
    # Every teacher token with bytes lands on the byte it starts with; specials on their role.
    for teacher_id, student_id in zip(vocabulary_map.projection_teacher_ids.tolist(),
                                      vocabulary_map.projection_student_ids.tolist()):
        entry = teacher_table[teacher_id]
        assert student_id == (entry[0] if entry is not None else student_id)
    mapped = set(vocabulary_map.projection_teacher_ids.tolist())
    assert all(entry is None or i in mapped for i, entry in enumerate(teacher_table))
    generator = torch.Generator().manual_seed(4)
    teacher = torch.randn(5, len(teacher_tokenizer), generator=generator, dtype=torch.float64)
    projected = project_teacher_logits(teacher, vocabulary_map, temperature=2.0, student_vocab_size=300)
    p_student = torch.softmax(projected / 2.0, -1)
    assert projected.shape == (5, 300) and torch.allclose(p_student.sum(-1), torch.ones(5, dtype=torch.float64))
    p_teacher = torch.softmax(teacher / 2.0, -1)
    starting_with_a = [i for i, entry in enumerate(teacher_table) if entry is not None and entry[:1] == b"a"]
    mapped_mass = p_teacher[:, sorted(mapped)].sum(-1)
    assert torch.allclose(p_student[:, ord("a")], p_teacher[:, starting_with_a].sum(-1) / mapped_mass)


def test_bad_inputs_raise_value_errors():
    logits = torch.zeros(4, 10)
    targets = torch.zeros(4, dtype=torch.int64)
    one = torch.tensor([1])
    with pytest.raises(ValueError, match="temperature"):
        group_log_probs(logits, targets, one, one, temperature=0.0)
    with pytest.raises(ValueError, match=r"teacher_log_probs must be \[groups, teacher vocab\] with 1 groups"):
        uld_loss(logits, targets, torch.zeros(2, 7), student_first=one, student_last=one)
    tokenizer = TOKENIZERS["bytelevel_bpe_300"]()
    vocabulary_map = build_vocabulary_map(tokenizer, tokenizer)
    with pytest.raises(ValueError, match="names student token 299 but the student logits have 10 entries"):
        gold_loss(logits, targets, torch.zeros(1, 300), vocabulary_map, student_first=one, student_last=one)
    with pytest.raises(ValueError, match="divergence"):
        gold_loss(logits, targets, torch.zeros(1, 300), vocabulary_map, student_first=one, student_last=one,
                  divergence="jsd")
    with pytest.raises(ValueError, match="must pair up"):
        projected_kd_loss(torch.zeros(4, 300), torch.zeros(4, 300), vocabulary_map, student_positions=one,
                          teacher_positions=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="num_bytes must be positive"):
        bits_per_byte(1.0, 0)


def test_bits_per_byte_compare_tokenizers_on_the_same_text():
    text = ["héllo wörld 😀 naïve café, hello world!"]
    byte = TOKENIZERS["byte"]()
    bpe = TOKENIZERS["bytelevel_bpe_400"]()
    batch = pack_aligned(text, byte, bpe, student_sequence_length=64, teacher_sequence_length=64)
    # A uniform model over the byte tokenizer's 258 entries costs log2(258) bits per byte.
    labels = batch.student["labels"]
    nll, num_bytes = nll_and_bytes(torch.zeros(*labels.shape, len(byte)), labels, batch.student_target_bytes)
    assert math.isclose(bits_per_byte(nll, num_bytes), math.log2(258), rel_tol=1e-6)
    # Every byte but the first token's is counted, on each side.
    assert int(num_bytes) == len(text[0].encode()) - 1
    t_labels = batch.teacher["labels"]
    _, t_bytes = nll_and_bytes(torch.zeros(*t_labels.shape, len(bpe)), t_labels, batch.teacher_target_bytes)
    first_teacher_token = int(batch.teacher["input_ids"][0, 0])
    assert int(t_bytes) == len(text[0].encode()) - len(token_bytes(bpe)[first_teacher_token])
    # On the aligned groups both sides count the same bytes, and a uniform byte model still costs log2(258).
    groups = batch.groups
    s_flat, t_flat = labels.reshape(-1), t_labels.reshape(-1)
    s_nll, s_bytes = group_nll_and_bytes(torch.zeros(len(s_flat), len(byte)), s_flat, groups.student_first,
                                         groups.student_last, groups.num_bytes)
    t_nll, t_group_bytes = group_nll_and_bytes(torch.randn(len(t_flat), len(bpe)), t_flat, groups.teacher_first,
                                               groups.teacher_last, groups.num_bytes)
    assert int(s_bytes) == int(t_group_bytes) > 0 and float(t_nll) > 0
    assert math.isclose(bits_per_byte(s_nll, s_bytes), math.log2(258), rel_tol=1e-6)


def test_group_nll_with_one_tokenizer_is_the_token_nll():
    tokenizer, batch = _same_tokenizer_batch()
    labels = batch.student["labels"]
    logits = torch.randn(*labels.shape, len(tokenizer), generator=torch.Generator().manual_seed(6))
    groups = batch.groups
    nll, num_bytes = nll_and_bytes(logits, labels, batch.student_target_bytes)
    group_nll, group_bytes = group_nll_and_bytes(logits.flatten(0, 1), labels.reshape(-1), groups.student_first,
                                                 groups.student_last, groups.num_bytes)
    assert int(num_bytes) == int(group_bytes) and torch.allclose(nll, group_nll)


def test_gradients_through_multi_token_groups_match_finite_differences():
    generator = torch.Generator().manual_seed(7)
    student = torch.randn(6, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([1, 2, 0, 3, 4, IGNORE_INDEX])
    first, last = torch.tensor([0, 2, 4]), torch.tensor([1, 3, 4])  # two 2-token groups and one 1-token group
    teacher = F.log_softmax(torch.randn(3, 7, generator=generator, dtype=torch.float64), -1) - 0.3
    exact = VocabularyMap(5, 7, torch.tensor([0, 1, 2]), torch.tensor([4, 5, 6]), torch.tensor([0]), torch.tensor([0]),
                          torch.ones(1), "test")
    kwargs = dict(student_first=first, student_last=last, temperature=1.3)
    assert torch.autograd.gradcheck(lambda s: uld_loss(s, targets, teacher, **kwargs), (student,))
    assert torch.autograd.gradcheck(lambda s: gold_loss(s, targets, teacher, exact, matched_weight=0.6, **kwargs),
                                    (student,))

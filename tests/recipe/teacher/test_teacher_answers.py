"""Teacher answers as types (no process group): each kind made by the teacher as asked and read from the wire
by its mode, its KD loss the one the objective defines, its evaluation figures, an ensemble's mixture and
merged routed answers; the recipe's runs (tests/recipe/lifecycle/test_recipe.py, test_teachers.py,
test_cross_tokenizer.py) show the curves they train."""

import pytest
import torch

from meshkd.core.answers import LABEL_LOG_PROBS, encode_teacher_logits, label_log_probs
from meshkd.core.answers.ensemble import Ensemble
from meshkd.core.answers.full import Bfloat16Logits, FullLogits
from meshkd.core.answers.labels import LabelLogProbs
from meshkd.core.answers.topk import TopK
from meshkd.core.loss import kd_loss
from meshkd.core.teacher_ensemble import TEACHERS
from meshkd.recipe.settings.config import CrossTokenizerConfig, KDConfig
from meshkd.recipe.teacher.teacher_answers import (
    Distribution,
    EncodeContext,
    GroupDistributions,
    LossContext,
    answer_of,
    answer_type,
)

ROWS, LENGTH, VOCAB = 2, 6, 11


def micro_batch() -> dict:
    labels = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    labels[0, :2] = -100
    return {"labels": labels}


def logits(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, LENGTH, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_each_answer_is_read_by_its_mode_and_an_unknown_one_is_named():
    assert answer_of(None) is None
    assert type(answer_of(encode_teacher_logits(logits(0), "full_bf16"))) is Bfloat16Logits
    assert type(answer_of({"mode": TEACHERS, "answers": {}})) is Ensemble
    with pytest.raises(ValueError, match=r"a teacher answer of mode 'logits'"):
        answer_of({"mode": "logits"})


def test_a_distributions_loss_is_kd_loss_and_an_ensemble_sums_its_members_by_weight():
    student, batch, norm = logits(2).requires_grad_(), micro_batch(), 9.0
    kd = KDConfig(temperature=2.0, combine="sum")
    teachers = {"a": logits(3), "b": logits(4)}
    context = LossContext(kd, teacher_weights={"a": 0.25, "b": 0.75})
    expected = {name: kd_loss(student, teacher, batch["labels"], temperature=2.0, num_valid_tokens=norm)
                for name, teacher in teachers.items()}
    loss, figures = answer_of(encode_teacher_logits(teachers["a"])).kd_loss(student, batch, context, norm=norm)
    torch.testing.assert_close(loss, expected["a"])
    assert figures == {}
    wire = {"mode": TEACHERS, "answers": {name: encode_teacher_logits(t) for name, t in teachers.items()}}
    loss, figures = answer_of(wire).kd_loss(student, batch, context, norm=norm)
    torch.testing.assert_close(loss, 0.25 * expected["a"] + 0.75 * expected["b"])
    torch.testing.assert_close(figures["kd_loss/b"], expected["b"].detach())
    assert figures["teacher_rows/a"] == figures["teacher_rows/b"] == ROWS


@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd", "skew_forward_kl", "skew_reverse_kl", "tvd"])
def test_a_distributions_loss_takes_the_configured_divergence_and_its_parameter(divergence):
    student, batch, teacher = logits(2).requires_grad_(), micro_batch(), logits(3)
    kd = KDConfig(temperature=2.0, divergence=divergence, jsd_beta=0.3, skew_alpha=0.2)
    loss, _ = answer_of(encode_teacher_logits(teacher)).kd_loss(student, batch, LossContext(kd), norm=7.0)
    expected = kd_loss(student, teacher, batch["labels"], temperature=2.0, num_valid_tokens=7.0,
                       divergence=divergence, jsd_beta=0.3, skew_alpha=0.2)
    torch.testing.assert_close(loss, expected)
    if divergence.startswith("skew_"):  # the parameter reaches the loss
        other = kd_loss(student, teacher, batch["labels"], temperature=2.0, num_valid_tokens=7.0,
                        divergence=divergence, skew_alpha=0.5)
        assert abs(loss.item() - other.item()) > 1e-4


def test_the_teacher_makes_the_kind_of_answer_asked_and_the_student_reads_it_back():
    kd = KDConfig(logits_transport="topk", topk=4, topk_tail_samples=2, temperature=2.0)
    context = EncodeContext(kd, seed=7, vocab_size=VOCAB)
    batch = {"input_ids": torch.zeros(ROWS, LENGTH, dtype=torch.long), **micro_batch()}
    assert answer_type(LABEL_LOG_PROBS, kd) is LabelLogProbs
    assert answer_type("topk", kd) is TopK
    assert answer_type("full", KDConfig(cross_tokenizer=CrossTokenizerConfig(loss="uld"))) is GroupDistributions
    assert answer_type("full", KDConfig(cross_tokenizer=CrossTokenizerConfig(loss="projection"))) is FullLogits
    teacher = logits(5)
    expected = label_log_probs(teacher, batch["labels"])["log_probs"]
    answer = answer_of(LabelLogProbs.encode(teacher, batch, context))
    assert type(answer) is LabelLogProbs
    torch.testing.assert_close(answer.label_log_probs(), expected, rtol=0, atol=0)
    both = answer_of(TopK.encode(teacher, batch, context, with_label_log_probs=True))
    torch.testing.assert_close(both.label_log_probs(), expected, rtol=0, atol=0)
    assert "label_log_probs" not in both.encoding and set(both.encoding) < set(both.wire)
    with pytest.raises(ValueError, match="asked with_label_log_probs must hold a label_log_probs tensor"):
        answer_of(encode_teacher_logits(teacher)).label_log_probs()
    with pytest.raises(ValueError, match="of mode 'groups' holds no label log-probabilities"):
        answer_of({"mode": "groups", "log_probs": teacher[0]}).label_log_probs()


def test_a_distributions_evaluation_figures_are_the_kl_and_the_top1_agreements():
    student, labels, kd = logits(2), micro_batch()["labels"], KDConfig(temperature=2.0)
    teacher = logits(3)
    answer = answer_of(encode_teacher_logits(teacher))
    expected = kd_loss(student, teacher, labels, temperature=2.0, num_valid_tokens=1).double() / 4
    torch.testing.assert_close(answer.kl(student, labels, kd), expected)
    valid = labels != -100
    agreeing = ((student.argmax(-1) == teacher.argmax(-1)) & valid).sum()
    assert answer.top1_agreements(student, labels, ignore_index=-100) == agreeing
    top = answer_of(encode_teacher_logits(teacher, "topk", k=3))
    assert torch.equal(top.top_tokens(), teacher.argmax(-1))


@pytest.mark.parametrize("chunks", [None, 5])
def test_the_speculative_acceptance_is_the_mass_both_distributions_share(chunks):
    """sum_v min(p_teacher(v), p_student(v)) at temperature 1 per valid label, summed (= 1 - TVD): the expected rate at
    which the teacher accepts the student's drafted token; whatever kd.temperature, whole or by chunks."""
    student, labels, kd = logits(2), micro_batch()["labels"], KDConfig(temperature=2.0, chunk_size=chunks)
    teacher = logits(3) * 2
    shared = torch.minimum(teacher.softmax(-1), student.softmax(-1)).sum(-1).double()
    expected = shared[labels != -100].sum()
    answer = answer_of(encode_teacher_logits(teacher))
    torch.testing.assert_close(answer.acceptance(student, labels, kd), expected, rtol=1e-6, atol=1e-6)
    cut = (slice(3, 9), (ROWS, LENGTH))  # some flattened positions, as the fused output layer hands them
    flat_student, flat_labels = student.reshape(-1, VOCAB)[3:9], labels.reshape(-1)[3:9]
    torch.testing.assert_close(answer.acceptance(flat_student, flat_labels, kd, cut),
                               shared.reshape(-1)[3:9][flat_labels != -100].sum(), rtol=1e-6, atol=1e-6)
    assert answer_of(encode_teacher_logits(teacher, "full")).acceptance(teacher, labels, kd) == pytest.approx(
        float((labels != -100).sum()))  # a student equal to its teacher: every draft accepted


def test_the_mixture_of_agreeing_teachers_is_that_teacher_and_routed_answers_merge_row_by_row():
    same = {name: answer_of(encode_teacher_logits(logits(3))) for name in ("a", "b")}
    mixed = Distribution.mixture(same, {"a": 0.5, "b": 0.5}, temperature=2.0)
    torch.testing.assert_close(mixed.wire["logits"], logits(3), rtol=0, atol=0)
    with pytest.raises(ValueError, match="a mixture of teachers needs their whole distributions"):
        Distribution.mixture({"a": answer_of(encode_teacher_logits(logits(3), "topk", k=3))}, {"a": 1.0},
                             temperature=1.0)
    rows = {"a": torch.tensor([True, False]), "b": torch.tensor([False, True])}
    parts = {"a": answer_of(encode_teacher_logits(logits(3)[:1])),
             "b": answer_of(encode_teacher_logits(logits(4)[1:], "full_bf16"))}
    merged = Distribution.merged(parts, rows)
    assert merged.wire["mode"] == "full" and merged.rows == ROWS
    assert torch.equal(merged.wire["logits"][0], logits(3)[0])
    assert torch.equal(merged.wire["logits"][1], logits(4)[1].bfloat16().float())
    with pytest.raises(ValueError, match="answered 1 rows, not the 2 routed to it"):
        Distribution.merged(parts, {"a": torch.tensor([True, True]), "b": torch.tensor([False, True])})

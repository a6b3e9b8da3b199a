"""Each label's log-probability as a training answer (`meshkd.core.answers.labels`): the reverse KL estimated on
the student's sampled tokens, k1 by its score-function gradient and k3 by its own, whole or by chunks, against a
teacher's 4-byte-a-token answer."""

import pytest
import torch

from meshkd.core.answers import LossContext, answer_of, label_log_probs
from meshkd.core.answers.labels import sampled_reverse_kl
from meshkd.recipe.settings.config import KDConfig

ROWS, LENGTH, VOCAB = 2, 7, 13


def inputs():
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(ROWS, LENGTH, VOCAB, generator=generator)
    teacher = 2 * torch.randn(ROWS, LENGTH, VOCAB, generator=generator)
    labels = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
    labels[0, :3] = -100  # a prompt: never counted
    return student, teacher, labels


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_the_estimate_and_its_gradient_are_the_estimators(estimator):
    student, teacher, labels = inputs()
    valid = labels != -100
    t = label_log_probs(teacher, labels)["log_probs"]
    logits = student.clone().requires_grad_()
    loss = sampled_reverse_kl(logits, labels, t, estimator=estimator, norm=9.0)
    loss.backward()
    reference = student.clone().requires_grad_()
    s = reference.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    log_ratio = torch.where(valid, s - t, 0.0)
    if estimator == "k1":  # value: the mean log-ratio; gradient: (log pi_s - log pi_t) d log pi_s
        value = log_ratio.sum() / 9
        (log_ratio.detach() * torch.where(valid, s, 0.0)).sum().div(9).backward()
    else:  # value and gradient of r - 1 - log r, r = pi_t / pi_s
        value = (torch.exp(-log_ratio) - 1 + log_ratio).sum() / 9
        value.backward()
    torch.testing.assert_close(loss.detach(), value.detach())
    torch.testing.assert_close(logits.grad, reference.grad)
    assert logits.grad[0, :3].abs().sum() == 0  # the prompt's positions get nothing


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_a_label_log_probs_answer_trains_whole_or_by_chunks_alike(estimator):
    student, teacher, labels = inputs()
    answer = answer_of(label_log_probs(teacher, labels))
    context = LossContext(KDConfig(divergence="sampled_reverse_kl", sampled_estimator=estimator))
    whole, _ = answer.kd_loss(student, {"labels": labels}, context, norm=9.0)
    flat = student.reshape(-1, VOCAB)
    chunks = sum(answer.chunk_kd_loss(flat[start : start + 4], slice(start, start + 4), {"labels": labels}, context,
                                      norm=9.0)[0] for start in range(0, ROWS * LENGTH, 4))
    torch.testing.assert_close(chunks, whole)
    assert (whole.item() > 0) if estimator == "k3" else True  # k3 is never negative
    with pytest.raises(ValueError, match="kd.sampled_estimator must be one of"):
        sampled_reverse_kl(student, labels, answer.label_log_probs(), estimator="k2", norm=1.0)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_rows_routed_to_two_teachers_train_on_their_own_teachers_log_probs(estimator):
    """`kd.combine: route`: each teacher answers its own rows' label log-probabilities; the ensemble's loss is each
    row's estimate against its own teacher, as if one answer held them all, whole or by chunks."""
    from meshkd.core.teacher_ensemble import ROUTE, TEACHERS

    student, teacher, labels = inputs()
    other = teacher.flip(-1)  # the second teacher: another distribution
    routes = torch.tensor([[1], [0]])
    own = torch.where(routes[:, :, None] == 0, teacher, other)  # each row's own teacher's logits
    context = LossContext(KDConfig(divergence="sampled_reverse_kl", sampled_estimator=estimator, combine="route"),
                          teacher_weights={"a": 1.0, "b": 1.0})
    micro_batch = {"labels": labels, ROUTE: routes}
    members = {"a": label_log_probs(teacher[1:], labels[1:]), "b": label_log_probs(other[:1], labels[:1])}

    def ensemble():
        return answer_of({"mode": TEACHERS, "answers": members})

    routed, figures = ensemble().kd_loss(student, micro_batch, context, norm=9.0)
    expected, _ = answer_of(label_log_probs(own, labels)).kd_loss(student, {"labels": labels}, context, norm=9.0)
    torch.testing.assert_close(routed, expected)
    assert figures["teacher_rows/a"] == figures["teacher_rows/b"] == 1
    assert figures["kd_tokens/a"] == (labels[1] != -100).sum() and figures["kd_tokens/b"] == (labels[0] != -100).sum()
    torch.testing.assert_close(figures["kd_loss/a"] + figures["kd_loss/b"], expected)
    flat, answer = student.reshape(-1, VOCAB), ensemble()
    chunks = sum(answer.chunk_kd_loss(flat[start : start + 4], slice(start, start + 4), micro_batch, context,
                                      norm=9.0)[0] for start in range(0, ROWS * LENGTH, 4))
    torch.testing.assert_close(chunks, expected)
    members["b"] = label_log_probs(other, labels)  # both rows: not the one routed to it
    with pytest.raises(ValueError, match="teacher 'b' answered 2 rows, not the 1 routed to it"):
        ensemble().kd_loss(student, micro_batch, context, norm=9.0)

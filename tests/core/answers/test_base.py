"""The registry of teacher answer kinds (`meshkd.core.answers`): a kind registered by a test alone is read from the
wire by its mode and chosen for the requests it is made for; what a kind cannot do is refused naming its mode.
Pure tier."""

from __future__ import annotations

import pytest
import torch

from meshkd.core.answers import ANSWERS, LossContext, TeacherAnswer, answer_of, answer_type, register
from meshkd.recipe.settings.config import KDConfig
from meshkd.recipe.teacher import teacher_answers  # noqa: F401 - registers the built-in kinds


@pytest.fixture
def squared_error():
    @register
    class SquaredError(TeacherAnswer):
        """A made-up kind: the teacher's logits, the loss their mean squared difference."""

        name = "squared_error"

        @classmethod
        def made_for(cls, transport, kd):
            return transport == cls.name

        @classmethod
        def encode(cls, logits, batch, transport, context):
            return {"mode": cls.name, "logits": logits}

        def kd_loss(self, logits, micro_batch, context, *, norm):
            return (logits - self.wire["logits"]).pow(2).sum() / norm, {}

    yield SquaredError
    del ANSWERS["squared_error"]


def test_a_kind_registered_alone_is_read_by_its_mode_and_chosen_for_its_requests(squared_error):
    kd = KDConfig()
    assert answer_type("squared_error", kd) is squared_error and answer_type("full", kd).name == "full"
    teacher, student = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    answer = answer_of(squared_error.encode(teacher, {}, "squared_error", None))
    assert type(answer) is squared_error and not answer.chunks_reversed
    loss, figures = answer.kd_loss(student, {}, LossContext(kd), norm=6.0)
    torch.testing.assert_close(loss, (student - teacher).pow(2).sum() / 6.0)
    answer.prepare_chunks(torch.zeros(6), {}, LossContext(kd))  # nothing to prepare: the default
    with pytest.raises(ValueError, match="mode 'squared_error' has no loss by chunks of positions"):
        answer.chunk_kd_loss(student[0], slice(0, 3), {}, LossContext(kd), norm=6.0)
    with pytest.raises(ValueError, match="mode 'squared_error' holds no label log-probabilities"):
        answer.label_log_probs()
    with pytest.raises(ValueError, match="registered twice"):
        register(squared_error)


def test_an_unknown_mode_and_a_request_no_kind_answers_are_refused():
    with pytest.raises(ValueError, match="a teacher answer of mode 'logits': the student knows full, full_bf16, "
                                         "hidden, hidden_bf16, topk, topk_compact, label_log_probs, teachers, groups"):
        answer_of({"mode": "logits"})
    with pytest.raises(ValueError, match="a teacher answer is a dict with a mode, got list"):
        answer_of([])
    with pytest.raises(ValueError, match=r"a request for 'logits' is answered by one kind of answer, got \[\]"):
        answer_type("logits", KDConfig())
    assert answer_type("label_log_probs", KDConfig()).name == "label_log_probs"
    assert [name for name, kind in ANSWERS.items() if kind.chunks_reversed] == ["groups"]

"""Teacher answers as types (no process group): each kind read from the wire by its mode, its KD loss the one
the objective defines; the recipe's runs (tests/recipe/test_recipe.py, test_teachers.py, test_cross_tokenizer.py)
show the curves they train."""

import pytest
import torch

from meshkd.core.logits_codec import encode_teacher_logits
from meshkd.core.loss import kd_loss
from meshkd.core.teacher_ensemble import TEACHERS
from meshkd.recipe.config import KDConfig
from meshkd.recipe.teacher_answers import Distribution, Ensemble, LossContext, answer_of

ROWS, LENGTH, VOCAB = 2, 6, 11


def micro_batch() -> dict:
    labels = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    labels[0, :2] = -100
    return {"labels": labels}


def logits(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, LENGTH, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_each_answer_is_read_by_its_mode_and_an_unknown_one_is_named():
    assert answer_of(None) is None
    assert type(answer_of(encode_teacher_logits(logits(0), "full_bf16"))) is Distribution
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

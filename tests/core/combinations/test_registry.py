"""The combination registry (`meshkd.core.combinations`, `kd.combine`): every registered combination of agreeing
teachers is the one-teacher objective, and a new combination, one class registered by name, reaches the config
checks and the student's loss with no other change."""

import pytest
import torch

from meshkd.core.answers import encode_teacher_logits
from meshkd.core.combinations import COMBINATIONS, Combination, combination_named, register
from meshkd.core.loss import kd_loss
from meshkd.core.teacher_ensemble import ROUTE, TEACHERS
from meshkd.recipe.settings.config import ConfigError, KDConfig
from meshkd.recipe.settings.config_loading import config_from_dict
from meshkd.recipe.teacher.teacher_answers import LossContext, answer_of
from tests.recipe.teacher.test_teachers import MIXED, ONE_PROCESS, with_teachers

ROWS, LENGTH, VOCAB, NORM = 2, 6, 11, 9.0


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, LENGTH, VOCAB, generator=torch.Generator().manual_seed(seed))


def _micro_batch() -> dict:
    labels = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    labels[0, :2] = -100
    return {"labels": labels, ROUTE: torch.tensor([[0], [1]]).expand(ROWS, LENGTH)}  # row 0 to "a", row 1 to "b"


def _ensemble(teachers: dict[str, torch.Tensor], routed: bool) -> dict:
    """Each teacher's answer: of every row, or (routed) of the rows routed to it."""
    return {"mode": TEACHERS, "answers": {name: encode_teacher_logits(logits[index:index + 1] if routed else logits)
                                          for index, (name, logits) in enumerate(teachers.items())}}


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_agreeing_teachers_give_the_one_teacher_objective_by_every_combination(name):
    student, batch, teacher = _logits(2).requires_grad_(), _micro_batch(), _logits(3)
    combination = combination_named(name)
    context = LossContext(KDConfig(temperature=2.0, combine=name), teacher_weights={"a": 0.25, "b": 0.75})
    wire = _ensemble({"a": teacher, "b": teacher}, combination.routes_rows)
    loss, figures = answer_of(wire).kd_loss(student, batch, context, norm=NORM)
    expected = kd_loss(student, teacher, batch["labels"], temperature=2.0, num_valid_tokens=NORM)
    torch.testing.assert_close(loss, expected)
    assert {f"kd_loss/{teacher}" for teacher in "ab"} <= set(figures)
    loss.backward()  # the term trains the student
    assert student.grad is not None and student.grad.abs().sum() > 0


class Worst(Combination):
    """A contributor's new combination: the largest of the teachers' divergences (a minimax objective)."""

    name = "worst"

    def loss(self, members, combined, divergence, weights):
        each = {name: divergence(member) for name, member in members.items()}
        return torch.stack(list(each.values())).max(), each


@pytest.fixture
def worst_registered():
    register(Worst)
    yield COMBINATIONS["worst"]
    del COMBINATIONS["worst"]


def test_a_new_combination_is_one_registered_class(tmp_path, worst_registered):
    config = with_teachers(tmp_path, ONE_PROCESS, MIXED, combine="worst")
    kd = config_from_dict(config).kd  # the config checks take the new value
    student, batch = _logits(2), _micro_batch()
    teachers = {"a": _logits(3), "b": 4 * _logits(4)}
    loss, figures = answer_of(_ensemble(teachers, routed=False)).kd_loss(
        student, batch, LossContext(kd, teacher_weights={"a": 0.5, "b": 0.5}), norm=NORM)
    each = [kd_loss(student, teacher, batch["labels"], temperature=kd.temperature, num_valid_tokens=NORM)
            for teacher in teachers.values()]
    torch.testing.assert_close(loss, max(each))
    torch.testing.assert_close(figures["kd_loss/b"], each[1])


def test_unknown_combinations_are_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"kd.combine must be one of mixture, route, sum, got 'worst'"):
        config_from_dict(with_teachers(tmp_path, ONE_PROCESS, MIXED, combine="worst"))
    with pytest.raises(ValueError, match="registered twice"):
        register(type("Again", (Combination,), {"name": "sum"}))

"""The teacher-source registry (`meshkd.recipe.teacher.sources`): every teacher's config describes exactly one
kind of source, and a new kind, one class registered by name, is what preflight checks the teacher with and what
the run would ask, with no other change."""

import dataclasses

import pytest

from meshkd.recipe.lifecycle.preflight import preflight
from meshkd.recipe.settings.config_loading import config_from_dict
from meshkd.recipe.teacher.sources import KINDS, SourceKind, kind_of, register
from meshkd.recipe.teacher.sources.base import model_check
from tests.tiny import base_config, with_layout

URL = "http://127.0.0.1:9"
COMPLETIONS = {"logits_transport": "topk", "topk_tail_samples": 0, "temperature": 1.0}


def _config(tmp_path, case: str):
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, {"dp_size": 1} if case == "own_ranks" else None)
    if case in ("cache", "writing_cache"):
        config["kd"]["teacher_cache"] = str(tmp_path / "cache")
    if case in ("served", "completions"):
        config["teacher_model"]["url"] = URL
    if case == "completions":
        config["teacher_model"]["api"] = "completions"
        config["kd"].update(COMPLETIONS)
    return config_from_dict(config)


@pytest.mark.parametrize("case, expected", [("student_ranks", "student_ranks"), ("own_ranks", "own_ranks"),
                                            ("cache", "cache"), ("served", "served"),
                                            ("completions", "completions"), ("writing_cache", "student_ranks")])
def test_every_teacher_config_describes_exactly_one_kind(tmp_path, case, expected):
    config = _config(tmp_path, case)
    kind = kind_of(config, config.teacher_named(), writing_cache=case == "writing_cache")
    assert kind.name == expected
    assert kind.own_ranks == (expected == "own_ranks") and kind.loads_here == (expected == "student_ranks")
    others = [other.name for other in KINDS.values() if other is not kind
              and other.describes(config, config.teacher_named(), writing_cache=case == "writing_cache")]
    assert not others


class Echo(SourceKind):
    """A contributor's new kind: a teacher at an address of its own scheme, `teacher_model.url: echo://...` (its
    checks here are the in-job teacher's)."""

    name = "echo"

    def describes(self, config, teacher, *, writing_cache):
        return str(teacher.model.url).startswith("echo://")

    def check(self, config, teacher, tokenizer, *, student_rows):
        return dataclasses.replace(model_check(teacher), report={"asked": "echo"})


@pytest.fixture
def echo_registered():
    register(Echo)
    yield KINDS["echo"]
    del KINDS["echo"]


def test_a_new_kind_is_one_registered_class(tmp_path, echo_registered):
    config = _config(tmp_path, "student_ranks")
    echo = dataclasses.replace(config, teacher_model=dataclasses.replace(config.teacher_model, url="echo://a"))
    checked = preflight(echo)
    assert checked.source is echo_registered and checked.teacher.report == {"asked": "echo"}
    assert checked.teacher_vocab_rows == preflight(config).teacher_vocab_rows
    with pytest.raises(ValueError, match="registered twice"):
        register(Echo)


def test_kinds_that_overlap_are_refused_naming_them(tmp_path, echo_registered):
    greedy = type("Greedy", (Echo,), {"name": "greedy", "describes": lambda self, config, teacher, writing_cache: True})
    register(greedy)
    config = _config(tmp_path, "student_ranks")
    try:
        with pytest.raises(ValueError, match=r"describes 2 kinds of teacher source \(student_ranks, greedy\)"):
            kind_of(config, config.teacher_named())
    finally:
        del KINDS["greedy"]

"""The kinds of distribution among the registered answers (`meshkd.core.answers`): what every one promises, how `kd`
keys choose one, and that a new one, one class registered by name, reaches the config checks, the loss, the
student's answers and the teacher cache's key with no other change."""

import math

import pytest
import torch

from meshkd.core.answers import (
    ANSWERS,
    answer_bytes,
    answer_of,
    answer_settings,
    choices,
    distributions,
    encode_teacher_logits,
    register,
    selected,
)
from meshkd.core.answers.full import Bfloat16Logits, FullLogits
from meshkd.core.loss import kd_loss
from meshkd.recipe.settings.config import ConfigError
from meshkd.recipe.settings.config_loading import config_from_dict
from tests.received import kd_loss_of, received
from tests.tiny import base_config, with_layout

V, K, M = 50, 8, 4


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    teacher = 3 * torch.randn(2, 6, V, generator=generator)
    student = torch.randn(2, 6, V, generator=generator)
    labels = torch.randint(0, V, (2, 6), generator=generator)
    labels[0, :2] = -100
    return teacher, student, labels


@pytest.mark.parametrize("name", sorted(kind.name for kind in distributions() if not kind.reads_hidden))
def test_every_encoding_sizes_checks_and_scores_its_own_answers(name):
    """(Hidden answers, made from the teacher's hidden states: `tests/recipe/teacher/test_hidden_answers.py`.)"""
    encoding, (teacher, student, labels) = ANSWERS.named(name), _inputs()
    answer = encode_teacher_logits(teacher, name, k=K, tail_samples=M, seed=3)
    assert answer["mode"] == name and received(answer, student.shape) == name
    tensors = [value for value in answer.values() if isinstance(value, torch.Tensor)]
    on_wire = sum(t.numel() * t.element_size() for t in tensors) / labels.numel()
    assert on_wire == encoding.bytes_per_token(V, k=K, tail_samples=M, logits_bytes=teacher.element_size())
    decoded = encoding.decode(answer)
    assert ANSWERS.named(decoded["mode"]).whole_distribution == encoding.whole_distribution
    loss = kd_loss_of(student, answer, labels)
    reference = kd_loss(student, teacher, labels)
    # Whole logits score exactly (bf16: rounding only); top-k's tail estimate stays near the full KL.
    tolerance = {"full": 1e-6, "full_bf16": 2e-2}.get(name, 0.3)
    assert math.isclose(float(loss), float(reference), rel_tol=tolerance)
    with pytest.raises(ValueError, match=r"do not fit|the student's are"):
        received(answer, (2, 5, V))


def test_kd_keys_choose_the_most_specific_registered_encoding():
    assert selected(logits_transport="full", topk_encoding="exact").name == "full"
    assert selected(logits_transport="full", topk_encoding="compact").name == "full"  # full reads no topk_encoding
    assert selected(logits_transport="topk", topk_encoding="exact").name == "topk"
    assert selected(logits_transport="topk", topk_encoding="compact").name == "topk_compact"
    with pytest.raises(ValueError, match=r"no answer encoding is chosen by .*'topk_encoding': 'zip'"):
        selected(logits_transport="topk", topk_encoding="zip")
    assert choices("logits_transport") == ("full", "full_bf16", "hidden", "hidden_bf16", "topk")
    assert choices("logits_transport", whole_distribution=True) == ("full", "full_bf16", "hidden", "hidden_bf16")
    assert choices("topk_encoding") == ("exact", "compact")
    with pytest.raises(ValueError, match="needs the teacher's whole distribution: use logits transport full or "
                                         "full_bf16 or hidden or hidden_bf16"):
        ANSWERS.named("topk").check_divergence("reverse_kl")
    with pytest.raises(ValueError, match="registered twice"):
        register(type("Again", (FullLogits,), {"name": "full"}))


class Float16Logits(Bfloat16Logits):
    """A contributor's new encoding: the teacher's logits rounded to float16 (2 V bytes a position, as bfloat16's)."""

    name = "full_fp16"
    selected_by = {"logits_transport": "full_fp16"}

    @classmethod
    def encode_logits(cls, logits, **options):
        return {"mode": cls.name, "logits": logits.to(torch.float16)}


@pytest.fixture
def float16_registered():
    register(Float16Logits)
    yield ANSWERS.named("full_fp16")
    del ANSWERS["full_fp16"]


def test_a_new_encoding_is_one_registered_class(tmp_path, float16_registered):
    teacher, student, labels = _inputs()
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, None)
    config["kd"] = {**config["kd"], "logits_transport": "full_fp16"}
    kd = config_from_dict(config).kd  # the config checks take the new value
    answer = answer_of(encode_teacher_logits(teacher, "full_fp16"))
    assert answer.whole_distribution and answer.wire["logits"].dtype == torch.float16
    assert answer_settings(kd) == {} and answer_bytes(kd, V, logits_bytes=4) == 2 * V
    loss = kd_loss_of(student, answer.wire, labels, divergence="reverse_kl")
    assert math.isclose(float(loss), float(kd_loss(student, teacher, labels, divergence="reverse_kl")), rel_tol=1e-2)
    config["kd"]["divergence"] = "tvd"
    config_from_dict(config)  # a whole distribution takes every divergence


def test_values_no_encoding_takes_are_refused_naming_the_key(tmp_path):
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, None)
    for key, value, message in [("logits_transport", "full_fp16", r"kd.logits_transport must be full or full_bf16 or "
                                 r"hidden or hidden_bf16 or topk, got 'full_fp16'"),
                                ("topk_encoding", "zip", r"kd.topk_encoding must be exact or compact, got 'zip'")]:
        with pytest.raises(ConfigError, match=message):
            config_from_dict({**config, "kd": {**config["kd"], key: value}})

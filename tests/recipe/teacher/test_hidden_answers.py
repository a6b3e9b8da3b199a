"""Hidden answers (`kd.logits_transport: hidden`, `hidden_bf16`): the teacher sends its last hidden states and the
student's side rebuilds its logits with the teacher's own output layer.

The head on the student's side makes exactly the teacher's logits, soft-capped (Gemma 2) and tied heads included,
and any slice of them; the loss of a hidden answer is that of the full answer for every divergence; a run with
hidden answers trains the curve of the same run with full answers (float32: 1e-5) with a teacher on ranks of its
own, a tensor, context or pipeline parallel student, a tied and soft-capped teacher, on-policy and several
teachers (summed, mixed, routed);
bfloat16 hidden states stay within what their rounding gives. The served and cached teachers' hidden answers are
tested with the other answers (`test_teacher_service.py`, `test_teacher_cache.py`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from meshkd.core.answers import answer_of
from meshkd.core.answers.base import LossContext
from meshkd.core.answers.hidden import HEADS, hold_head
from meshkd.core.loss import DIVERGENCES
from meshkd.recipe.common.metrics import read_metrics
from meshkd.recipe.settings.config import KDConfig, ModelConfig
from meshkd.recipe.teacher.teacher_head import TeacherHead
from tests.recipe.lifecycle.test_recipe import TrainRun
from tests.tiny import base_config, tiny_llama, with_layout
from tests.world import run_world

GEMMA2 = {"random_init": {"model_type": "gemma2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 262,
                          "max_position_embeddings": 256, "final_logit_softcapping": 3.0, "sliding_window": 8},
          "tokenizer": "byte", "seed": 5, "attn_implementation": "eager"}


def saved_model(tmp_path: Path, model_type: str, **settings) -> tuple[torch.nn.Module, str]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=96,
                                  max_position_embeddings=64, **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / model_type)
    return model, str(tmp_path / model_type)


@pytest.fixture(autouse=True)
def no_heads_left():
    yield
    HEADS.clear()


@pytest.mark.parametrize("model_type, settings", [("gemma2", {"final_logit_softcapping": 3.0}),
                                                  ("llama", {"tie_word_embeddings": True}),
                                                  ("granite", {"logits_scaling": 4.0})])
def test_the_head_makes_the_teachers_own_logits_and_any_slice_of_them(tmp_path, model_type, settings):
    model, path = saved_model(tmp_path, model_type, **settings)
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        output = model(input_ids=ids, output_hidden_states=True)
    hidden, logits = output.hidden_states[-1].flatten(0, 1), output.logits.flatten(0, 1)
    head = TeacherHead.of(ModelConfig(path=path), vocab_size=90)
    assert torch.equal(head.logits(hidden, slice(None)), logits[:, :90])
    assert torch.equal(head.logits(hidden, slice(30, 61)), logits[:, 30:61])
    if model_type == "gemma2":  # the soft-cap is applied: no logit beyond the cap
        assert logits.abs().max() < 3.0
    again = TeacherHead.from_bytes(head.to_bytes())
    assert again.id == head.id and torch.equal(again.logits(hidden, slice(None)), logits[:, :90])
    kept = TeacherHead.of(ModelConfig(path=path), vocab_size=90, held=slice(45, 90))
    assert kept.id == head.id and kept.weight.shape[0] == 45
    assert torch.equal(kept.logits(hidden, slice(50, 90)), logits[:, 50:90])
    with pytest.raises(ValueError, match=r"keeps vocabulary entries \[45, 90\), asked for \[0, 90\)"):
        kept.logits(hidden, slice(None))


def test_another_teachers_weights_give_another_id(tmp_path):
    _, path = saved_model(tmp_path, "llama")
    head = TeacherHead.of(ModelConfig(path=path), vocab_size=96)
    assert TeacherHead.of(ModelConfig(path=path), vocab_size=96).id == head.id
    assert TeacherHead.of(ModelConfig(path=path), vocab_size=95).id != head.id
    other = TeacherHead.of(ModelConfig(path=path), vocab_size=96)
    other.weight[0, 0] += 1
    assert TeacherHead.from_bytes(other.to_bytes()).id != head.id


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_a_hidden_answers_loss_and_figures_are_the_full_answers(tmp_path, divergence):
    model, path = saved_model(tmp_path, "gemma2", final_logit_softcapping=3.0)
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        output = model(input_ids=ids, output_hidden_states=True)
    head = TeacherHead.of(ModelConfig(path=path), vocab_size=96)
    hold_head(head)
    hidden = answer_of({"mode": "hidden", "hidden": output.hidden_states[-1], "head": head.id})
    full = answer_of({"mode": "full", "logits": output.logits})
    kd = KDConfig(divergence=divergence, temperature=2.0)
    micro_batch = {"labels": ids.roll(-1, 1).masked_fill(torch.rand(2, 7) < 0.3, -100)}
    student = torch.randn(2, 7, 96, requires_grad=True)
    losses = []
    for answer in (hidden, full):
        loss, _ = answer.kd_loss(student, micro_batch, LossContext(kd), norm=5)
        (grad,) = torch.autograd.grad(loss, student)
        chunked = sum(answer.chunk_kd_loss(student.flatten(0, 1)[start : start + 4], slice(start, start + 4),
                                           micro_batch, LossContext(kd), norm=5)[0] for start in range(0, 14, 4))
        figures = [answer.kl(student.detach(), micro_batch["labels"], kd), answer.acceptance(
            student.detach(), micro_batch["labels"], kd), answer.top1_agreements(
            student.detach(), micro_batch["labels"], ignore_index=-100)]
        losses.append((loss, grad, chunked, figures))
    (loss, grad, chunked, figures), (full_loss, full_grad, full_chunked, full_figures) = losses
    assert torch.allclose(loss, full_loss, rtol=1e-6, atol=1e-7) and torch.allclose(chunked, full_chunked, rtol=1e-6)
    assert torch.allclose(grad, full_grad, rtol=1e-5, atol=1e-8)
    for figure, expected in zip(figures, full_figures):
        assert torch.allclose(figure.double(), expected.double(), rtol=1e-6)


def test_an_answer_of_a_head_the_student_does_not_hold_is_refused_naming_it(tmp_path):
    _, path = saved_model(tmp_path, "llama")
    hold_head(TeacherHead.of(ModelConfig(path=path), vocab_size=96))
    answer = answer_of({"mode": "hidden", "hidden": torch.zeros(1, 3, 32), "head": "f00d" * 16})
    with pytest.raises(ValueError, match="names output head f00df00df00d, which the student's side does not hold"):
        answer.kd_loss(torch.zeros(1, 3, 96), {"labels": torch.zeros(1, 3, dtype=torch.long)}, LossContext(KDConfig()),
                       norm=1)


# ---------------------------------------------------------------------------------------------------------- runs


def run(base: dict, tmp: Path, name: str, *, kd: dict, student: dict | None = None, teacher: dict | None = None,
        **keys) -> dict:
    config = with_layout(base, student or {"dp_size": 1}, teacher)
    config["kd"].update(kd)
    config.update(copy.deepcopy(keys))
    config["logging"]["run_dir"] = str(tmp / name)
    return config


def several(base: dict, combine: str, transport: str) -> dict:
    """Two teachers, by `combine`."""
    config = copy.deepcopy(base)
    config.pop("teacher_model")
    config["teachers"] = [{"name": "small", "model": tiny_llama(2, seed=7), "weight": 1.0},
                          {"name": "large", "model": tiny_llama(3, seed=2), "weight": 2.0}]
    config["kd"].update(combine=combine, logits_transport=transport)
    if combine == "route":
        for member in config["teachers"]:
            member.pop("weight")
        corpus = Path(base["dataset"]["paths"][0]).parent.parent / "routed.jsonl"
        corpus.write_text("".join(json.dumps({"text": f"def f{i}(): return {i * 7}\n" * 3,
                                              "teacher": ("small", "large")[i % 2]}) + "\n" for i in range(24)))
        config["dataset"].update(paths=[str(corpus)], teacher_key="teacher")
    return config


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Each run twice, with full and with hidden answers: in a world of two ranks."""
    tmp = tmp_path_factory.mktemp("hidden_runs")
    base = base_config(tmp)
    configs = {}
    for transport in ("full", "hidden", "hidden_bf16"):
        kd = {"logits_transport": transport}
        for divergence in ("forward_kl", "reverse_kl", "jsd", "tvd") if transport != "hidden_bf16" else ("jsd",):
            configs[f"own_ranks_{divergence}_{transport}"] = run(
                base, tmp, f"own_ranks_{divergence}_{transport}", kd={**kd, "divergence": divergence},
                teacher={"dp_size": 1})
        if transport == "hidden_bf16":
            continue
        for layout in ("tp", "cp", "pp"):  # the head's vocabulary slice; the answer cut; the last stage's loss
            configs[f"{layout}2_{transport}"] = run(base, tmp, f"{layout}2_{transport}",
                                                    kd={**kd, "divergence": "reverse_kl"},
                                                    student={"dp_size": 1, f"{layout}_size": 2})
        configs[f"gemma2_{transport}"] = run(base, tmp, f"gemma2_{transport}", kd={**kd, "divergence": "reverse_kl"},
                                             student={"dp_size": 2}, teacher_model=GEMMA2)
        configs[f"on_policy_{transport}"] = run(
            base, tmp, f"on_policy_{transport}", kd={**kd, "divergence": "reverse_kl", "mode": "on_policy",
                                                     "on_policy_fraction": 0.5,
                                                     "generation": {"prompt_tokens": 8, "max_new_tokens": 8}},
            teacher={"dp_size": 1})
        for combine in ("sum", "mixture", "route"):
            configs[f"{combine}_{transport}"] = run(several(base, combine, transport), tmp, f"{combine}_{transport}",
                                                    kd={}, student={"dp_size": 2})
    results = run_world(2, [TrainRun(config, name=name) for name, config in configs.items()], timeout_s=60,
                        deadline_s=600)
    for name in configs:
        results.check(name)
    return configs


def curve(config: dict) -> list[dict]:
    return [{key: value for key, value in record.items() if not key.split("/")[0].endswith("_s")}
            for record in read_metrics(config["logging"]["run_dir"])]


def largest_difference(records: list[dict], expected: list[dict]) -> float:
    """The largest relative difference of a loss or held-out figure, the records' keys and steps checked equal."""
    assert [sorted(r) for r in records] == [sorted(r) for r in expected]
    largest = 0.0
    for record, reference in zip(records, expected):
        for key, value in reference.items():
            if isinstance(value, float) and ("loss" in key or key.startswith("val_")):
                largest = max(largest, abs(record[key] - value) / max(abs(value), 1e-3))
    return largest


pytestmark = pytest.mark.world


@pytest.mark.parametrize("name", ["own_ranks_forward_kl", "own_ranks_reverse_kl", "own_ranks_jsd", "own_ranks_tvd",
                                  "tp2", "cp2", "pp2", "gemma2", "on_policy", "sum", "mixture", "route"])
def test_a_run_with_hidden_answers_trains_the_curve_of_full_answers(runs, name):
    hidden, full = curve(runs[f"{name}_hidden"]), curve(runs[f"{name}_full"])
    assert largest_difference(hidden, full) < 1e-5
    assert any(record.get("kd_loss", 0) > 0 for record in hidden)
    evaluations = [record for record in hidden if record["kind"] == "eval"]
    assert all("val_kl" in record and "val_acceptance" in record for record in evaluations)


def test_bfloat16_hidden_states_stay_within_their_rounding(runs):
    """Rounding the hidden states to bfloat16 moves each by at most 2^-9 of its magnitude: the curve by less than
    1e-3 here."""
    assert largest_difference(curve(runs["own_ranks_jsd_hidden_bf16"]), curve(runs["own_ranks_jsd_full"])) < 1e-3

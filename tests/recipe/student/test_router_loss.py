"""An MoE student's router load-balancing loss: the model's own function on packed batches, in the objective."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from meshkd.core.packing import configure_packing
from meshkd.recipe.modeling.models import load_causal_lm
from meshkd.recipe.student.router_loss import RouterLoss
from tests.recipe.lifecycle.test_recipe import RecipeRuns, curve
from tests.tiny import base_config, with_layout

SHAPE = dict(vocab_size=262, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
MOE = {"qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
       "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}


@pytest.mark.parametrize("family", list(MOE))
def test_the_router_loss_is_the_models_own_on_real_tokens(family):
    model = load_causal_lm(random_init={"model_type": family, **SHAPE, **MOE[family]}, seed=3)
    plain = copy.deepcopy(model)
    router = RouterLoss.for_student(configure_packing(model), None)
    assert router.coefficient == model.config.router_aux_loss_coef > 0  # the model's own weight by default
    ids = torch.randint(0, 262, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])  # a padded row: a packed row of one document
    positions = torch.tensor([list(range(9)), list(range(6)) + [0] * 3])
    with router.recording():
        model(input_ids=ids, attention_mask=mask, position_ids=positions)
    want = plain(input_ids=ids, attention_mask=mask, position_ids=positions, output_router_logits=True).aux_loss
    torch.testing.assert_close(router.local_loss(router.statistics(mask)), want, rtol=1e-6, atol=0)
    # Two documents in one row count the same tokens as one: the document indices only mark real tokens.
    torch.testing.assert_close(router.local_loss(router.statistics(mask * torch.tensor([[1] * 4 + [2] * 5, [1] * 9]))),
                               want)
    # Layers split over pipeline stages: the statistics of the parts add up to the whole, value and gradient.
    logits = tuple(layer.detach().requires_grad_() for layer in router._logits)
    whole = router.local_loss(router.statistics(mask, logits))
    parts = router.local_loss(router.statistics(mask, logits[:1]) + router.statistics(mask, logits[1:]))
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=0)
    for a, b in zip(torch.autograd.grad(whole, logits), torch.autograd.grad(parts, logits)):
        torch.testing.assert_close(a, b)
    with torch.no_grad():  # outside `recording` nothing is kept
        model(input_ids=ids, attention_mask=mask, position_ids=positions)
    assert router._recorded is None


def test_a_dense_student_has_none_and_asking_for_one_names_the_key():
    dense = load_causal_lm(random_init={"model_type": "llama", **SHAPE}, seed=3)
    assert RouterLoss.for_student(dense, None) is None
    assert RouterLoss.for_student(load_causal_lm(random_init={"model_type": "mixtral", **SHAPE, **MOE["mixtral"]},
                                                 seed=3), 0.0) is None
    with pytest.raises(ValueError, match=r"kd.router_aux_loss_coef is 0.1, but the student \(LlamaForCausalLM\)"):
        RouterLoss.for_student(dense, 0.1)


def moe_student_config(tmp_path, coefficient: float | None = 0.05, family: str = "qwen3_moe") -> dict:
    config = base_config(tmp_path)
    config["model"]["random_init"].update(model_type=family, **MOE[family])
    config["kd"]["router_aux_loss_coef"] = coefficient
    config["checkpoint"] = {"enabled": True, "save_hf": True}  # the trained student, exported
    return config


# Whole experts spread over the tp ranks (tp2_ep2), or over the dp ranks, which hold different rows (dp2_ep2).
LAYOUTS = (("dp2", {"dp_size": 2}, {"dp_size": 1}), ("tp2", {"dp_size": 1, "tp_size": 2}, None),
           ("tp2_ep2", {"dp_size": 1, "tp_size": 2, "ep_size": 2}, {"dp_size": 1}),
           ("dp2_ep2", {"dp_size": 2, "ep_size": 2}, {"dp_size": 1}))
SPLIT_LAYOUTS = (("pp2", {"dp_size": 1, "pp_size": 2}), ("cp2", {"dp_size": 1, "cp_size": 2}))


def router_runs(tmp: Path) -> dict[str, tuple[dict, bool]]:
    """Every run of this module: name -> (config, resume)."""
    runs = {"single": (with_layout(moe_student_config(tmp / "single"), {"dp_size": 1}, None), False)}
    for name, student, teacher in LAYOUTS:
        runs[name] = (with_layout(moe_student_config(tmp / name), student, teacher), False)
    # Experts over the dp ranks checkpoint and resume: stopped after step 3 (checkpoint of step 2), resumed.
    config = with_layout(moe_student_config(tmp / "resumed"), {"dp_size": 2, "ep_size": 2}, {"dp_size": 1})
    config["step_scheduler"]["ckpt_every_steps"] = 2
    first = copy.deepcopy(config)
    first["step_scheduler"]["max_steps"] = 3
    first["lr_scheduler"]["total_steps"] = config["step_scheduler"]["max_steps"]
    runs["resumed_first"], runs["resumed"] = (first, False), (config, True)
    runs["off"] = (with_layout(moe_student_config(tmp / "off", 0.0), {"dp_size": 1}, None), False)
    # The default coefficient (the model config's), 3 steps, one process and split over pipeline stages or cp.
    for family in MOE:
        base = moe_student_config(tmp / family, None, family)
        base["step_scheduler"]["max_steps"] = 3
        base["checkpoint"] = {"enabled": False}
        runs[f"{family}_single"] = (with_layout(base, {"dp_size": 1}, None), False)
        for name, student in SPLIT_LAYOUTS:
            config = with_layout(base, student, None)
            config["logging"]["run_dir"] = str(tmp / family / name)
            runs[f"{family}_{name}"] = (config, False)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> RecipeRuns:
    return RecipeRuns(router_runs(tmp_path_factory.mktemp("router")))


def exported_student(runs: RecipeRuns, name: str) -> dict[str, torch.Tensor]:
    return dict(load_causal_lm(path=Path(runs.configs[name]["logging"]["run_dir"], "hf_student")).named_parameters())


@pytest.mark.world
def test_moe_students_train_with_the_router_loss_in_every_layout(runs):
    reference = [r for r in runs.records("single") if r["kind"] == "train"]
    for record in reference:
        objective = 0.5 * record["ce_loss"] + 0.5 * record["kd_loss"] + 0.05 * record["router_loss"]
        assert record["loss"] == pytest.approx(objective, rel=1e-6) and record["router_loss"] > 0
    exported = exported_student(runs, "single")
    for name, _, _ in LAYOUTS:
        records = runs.records(name)
        assert curve(records) == pytest.approx(curve(reference), rel=1e-4), name
        routed = [r["router_loss"] for r in records if r["kind"] == "train"]
        assert routed == pytest.approx([r["router_loss"] for r in reference], rel=1e-4), name
        for key, parameter in exported_student(runs, name).items():
            torch.testing.assert_close(parameter, exported[key], rtol=1e-3, atol=1e-5, msg=f"{name} {key}")
    runs.records("resumed_first")
    resumed = [r for r in runs.records("resumed") if r["kind"] == "train" and r["step"] > 2]
    assert curve(resumed) == pytest.approx(curve(reference)[6:], rel=1e-4)
    assert all("router_loss" not in r for r in runs.records("off"))


@pytest.mark.world
@pytest.mark.parametrize("family", list(MOE))
def test_pipelined_and_context_parallel_students_train_the_same_router_loss(runs, family):
    """The default coefficient (the model config's): each stage and cp shard adds its part of the loss."""
    reference = [r for r in runs.records(f"{family}_single") if r["kind"] == "train"]
    assert all(r["router_loss"] > 0 for r in reference)
    for name, _ in SPLIT_LAYOUTS:
        records = [r for r in runs.records(f"{family}_{name}") if r["kind"] == "train"]
        assert curve(records) == pytest.approx(curve(reference), rel=1e-4), name
        assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference], rel=1e-4)
        routed = [r["router_loss"] for r in records]
        assert routed == pytest.approx([r["router_loss"] for r in reference], rel=1e-4), name

"""LoRA students (`peft`): adapters alone train, from a seeded init that starts as the base; every layout gives
the one-process curve; checkpoints hold the adapters and resume exactly; the export is a merged student that
plain transformers loads and that scores the reported loss, and an adapter directory that peft loads."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from meshkd.recipe.common.metrics import read_metrics
from meshkd.recipe.modeling.adapters import add_adapters, export_adapters, trainable_parameters
from meshkd.recipe.modeling.models import load_causal_lm, save_hf_model
from meshkd.recipe.settings.config import ConfigError, PeftConfig
from meshkd.recipe.settings.config_loading import config_from_dict
from tests.recipe.lifecycle.test_recipe import RecipeRuns, curve
from tests.recipe.modeling.test_export import num_parameters, plain_val_loss
from tests.tiny import base_config, tiny_llama, with_layout

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def tiny_student(seed: int = 5):
    return load_causal_lm(random_init=tiny_llama(2, seed=seed)["random_init"], seed=seed)


def test_adapters_alone_train_and_start_as_the_base():
    model = tiny_student()
    ids = torch.randint(0, 262, (2, 12), generator=torch.Generator().manual_seed(0))
    before = model(ids).logits
    add_adapters(model, PeftConfig(**LORA), seed=3)
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    # Two layers, three adapted projections each, an A and a B per projection.
    assert len(trainable) == 2 * 3 * 2 and len(trainable_parameters(model)) == len(trainable)
    assert torch.equal(model(ids).logits, before), "B = 0: the student starts as its base"
    again = tiny_student()
    add_adapters(again, PeftConfig(**LORA), seed=3)
    assert all(torch.equal(a, b) for a, b in zip(trainable_parameters(model), trainable_parameters(again)))
    with pytest.raises(ValueError, match=r"peft\.target_modules \['nowhere'\]: .*not found"):
        add_adapters(tiny_student(), PeftConfig(target_modules=["nowhere"]), seed=3)


def test_the_export_merges_the_adapters_and_writes_an_adapter_peft_loads(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    save_hf_model(tiny_student(), None, tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    add_adapters(model, PeftConfig(**LORA), seed=3)
    with torch.no_grad():  # as if trained: B no longer 0
        for parameter in trainable_parameters(model):
            parameter.normal_(0, 0.1)
    ids = torch.randint(0, 262, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = model(ids).logits
    merged = export_adapters(model.state_dict(), config=model.config, section=PeftConfig(**LORA),
                             base_path=str(tmp_path / "base"), adapter_dir=tmp_path / "adapter")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain(ids).logits, expected, rtol=1e-5, atol=1e-5)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(tmp_path / "base")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]),
                                       tmp_path / "adapter")
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("changes", "message"), [
    ({"peft": {"rank": 0}}, r"peft\.rank must be >= 1, got 0"),
    ({"peft": {"dropout": 1.0}}, r"peft\.dropout must be in \[0, 1\)"),
    ({"peft": {"target_modules": []}}, r"peft\.target_modules is empty"),
    ({"peft": {}, "distributed": {"dp_size": 1, "tp_size": 2}}, r"peft with distributed\.tp_size\(2\) > 1 is not "
                                                                 r"supported"),
    ({"peft": {}, "model": {**tiny_llama(2, seed=1), "dtype": "bfloat16", "pure_half_precision": True}},
     r"peft with model\.pure_half_precision"),
])
def test_bad_peft_settings_are_refused_naming_the_key(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({**base_config(tmp_path), **changes})


# ---------------------------------------------------------------------------------------------------------
# Training: every layout, checkpoints, the export


LAYOUTS = {"one_process": {"dp_size": 1}, "fsdp2_dp2": {"dp_size": 2}, "ddp_dp2": {"dp_size": 2, "strategy": "ddp"},
           "cp2": {"dp_size": 1, "cp_size": 2}, "pp2": {"dp_size": 1, "pp_size": 2}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, RecipeRuns]:
    """A LoRA student of a Hugging Face directory in each layout (the teacher on the student's ranks), and the
    one-process run stopped after step 3 and resumed to the end."""
    root = tmp_path_factory.mktemp("adapters")
    save_hf_model(tiny_student(), None, root / "base")
    runs = {}
    for layout, section in LAYOUTS.items():
        config = base_config(root / layout)
        config["model"] = {"path": str(root / "base"), "tokenizer": "byte", "seed": 7}
        config["peft"] = dict(LORA)
        config["dataset"]["packing"] = False  # one document a row: plain transformers scores it as the trainer
        config["step_scheduler"].update(max_steps=5, global_batch_size=4, local_batch_size=2)
        config["checkpoint"] = {"enabled": True, "save_hf": True}
        config["step_scheduler"]["ckpt_every_steps"] = 2
        runs[layout] = (with_layout(config, section, None), False)
    for layout in ("one_process", "fsdp2_dp2"):  # the base in bfloat16, the adapters float32 masters
        config = copy.deepcopy(runs[layout][0])
        config["model"]["dtype"] = "bfloat16"
        config["logging"]["run_dir"] = str(root / f"bfloat16_{layout}" / "run")
        runs[f"bfloat16_{layout}"] = (config, False)
    first = copy.deepcopy(runs["one_process"][0])
    first["logging"]["run_dir"] = str(root / "resumed" / "run")
    first["step_scheduler"]["max_steps"] = 3
    first["lr_scheduler"]["total_steps"] = 5
    runs["resume_first"] = (first, False)
    resumed = copy.deepcopy(first)
    resumed["step_scheduler"]["max_steps"] = 5
    runs["resumed"] = (resumed, True)
    return root, RecipeRuns(runs)


@pytest.mark.world
@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "one_process"])
def test_every_layout_trains_the_one_process_curve(runs, layout):
    _, recipe_runs = runs
    reference, laid_out = curve(recipe_runs.records("one_process")), curve(recipe_runs.records(layout))
    assert laid_out[:3] == pytest.approx(reference[:3], rel=1e-5)
    assert laid_out == pytest.approx(reference, rel=1e-4)


@pytest.mark.world
def test_a_bfloat16_student_keeps_its_base_in_bfloat16_and_its_adapters_in_float32(runs):
    from torch.distributed.checkpoint import FileSystemReader

    _, recipe_runs = runs
    # CURVE_RTOL of tests/recipe/student/test_precision.py: one bfloat16 rounding unit.
    reference = curve(recipe_runs.records("one_process"))
    assert curve(recipe_runs.records("bfloat16_one_process")) == pytest.approx(reference, rel=2e-3)
    assert curve(recipe_runs.records("bfloat16_fsdp2_dp2")) == pytest.approx(
        curve(recipe_runs.records("bfloat16_one_process")), rel=2e-3)
    run_dir = Path(recipe_runs.configs["bfloat16_fsdp2_dp2"]["logging"]["run_dir"])
    saved = FileSystemReader(str(run_dir / "checkpoints" / "step_00000004")).read_metadata().state_dict_metadata
    dtypes = {saved[key].properties.dtype for key in saved if key.startswith(("model.", "optim.state."))}
    assert dtypes == {torch.float32}


def test_adapters_on_a_bfloat16_base_are_float32():
    model = load_causal_lm(random_init=tiny_llama(2, seed=5)["random_init"], seed=5, dtype="bfloat16")
    add_adapters(model, PeftConfig(**LORA), seed=3)
    dtypes = {(parameter.requires_grad, parameter.dtype) for parameter in model.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}


@pytest.mark.world
def test_checkpoints_hold_the_adapters_and_resume_exactly(runs):
    from torch.distributed.checkpoint import FileSystemReader

    _, recipe_runs = runs
    reference = curve(recipe_runs.records("one_process"))
    assert curve(recipe_runs.records("resumed")) == reference  # steps 1-3, then 4-5 after the resume
    run_dir = Path(recipe_runs.configs["one_process"]["logging"]["run_dir"])
    saved = FileSystemReader(str(run_dir / "checkpoints" / "step_00000004")).read_metadata().state_dict_metadata
    model_keys = [key for key in saved if key.startswith("model.")]
    assert model_keys and all(".lora_A." in key or ".lora_B." in key for key in model_keys)
    assert {key for key in saved if key.startswith("optim.state.")} and all(
        ".lora_" in key for key in saved if key.startswith("optim.state."))


@pytest.mark.world
@pytest.mark.parametrize("layout", ["one_process", "fsdp2_dp2", "pp2"])
def test_the_export_is_the_merged_student_and_the_adapters(runs, layout):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, recipe_runs = runs
    config = recipe_runs.configs[layout]
    records = recipe_runs.records(layout)
    run_dir = Path(config["logging"]["run_dir"])
    base = AutoModelForCausalLM.from_pretrained(root / "base")
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "hf_student")
    assert num_parameters(merged) == num_parameters(base)
    # The frozen weights are the base's; the adapted ones moved.
    assert torch.equal(merged.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert torch.equal(merged.model.layers[0].self_attn.k_proj.weight, base.model.layers[0].self_attn.k_proj.weight)
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight)
    reported = [r for r in records if r["kind"] == "eval"][-1]["val_loss"]
    dp_size = LAYOUTS[layout]["dp_size"]
    assert plain_val_loss(merged, config, dp_size) == pytest.approx(reported, abs=1e-5)
    adapted = PeftModel.from_pretrained(base, run_dir / "hf_adapter")
    assert plain_val_loss(adapted, config, dp_size) == pytest.approx(reported, abs=1e-5)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["hf_adapter_dir"] == str((run_dir / "hf_adapter").resolve())
    assert read_metrics(run_dir)[-1]["val_loss"] < [r for r in records if r["kind"] == "eval"][0]["val_loss"]

"""What a run ships is the model it was configured with, and it scores what the trainer reported.

A tied (Qwen3, `tie_word_embeddings`) and an untied (Llama) student, each read from a Hugging Face
directory (so loaded in shards where the layout allows), trained a few steps in one process, with DDP dp 2,
FSDP2 dp 2 and tp 2 (every run of one world size in one world): the exported `hf_student`, loaded by plain
transformers, has one tied matrix where the config ties them, exactly the parameter count of
`from_pretrained` of the directory it started from, and its held-out loss, computed by plain transformers
on the validation rows, equals the trainer's last `val_loss`.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from meshkd.recipe.common.metrics import read_metrics
from meshkd.recipe.corpus import data
from meshkd.recipe.corpus.batches import eval_batches
from meshkd.recipe.modeling.models import byte_tokenizer, load_causal_lm, save_hf_model
from meshkd.recipe.settings.config_loading import config_from_dict
from tests.recipe.lifecycle.test_recipe import TrainRun
from tests.tiny import base_config, with_layout
from tests.world import WorldsBySize

pytestmark = pytest.mark.world

SHAPE = dict(vocab_size=262, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
STUDENTS = {"tied": {"model_type": "qwen3", "head_dim": 8, "tie_word_embeddings": True, **SHAPE},
            "untied": {"model_type": "llama", "tie_word_embeddings": False, **SHAPE}}
LAYOUTS = {"one_process": (1, {"dp_size": 1}), "ddp_dp2": (2, {"dp_size": 2, "strategy": "ddp"}),
           "fsdp2_dp2": (2, {"dp_size": 2}), "tp2": (2, {"dp_size": 1, "tp_size": 2})}


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied matrix once


def plain_val_loss(model, config: dict, dp_size: int) -> float:
    """Held-out loss per token of the validation rows the run's `dp_size` ranks evaluate (unpacked: one document
    a row), by plain transformers."""
    section = config_from_dict(config)
    _, val_set = data.build_run_datasets(byte_tokenizer(), section.dataset,
                                         sequence_length=section.step_scheduler.sequence_length)
    total, count = 0.0, 0
    steps = section.step_scheduler
    batches = [batch for dp_rank in range(dp_size) for batch in itertools.islice(
        eval_batches(val_set, batch_size=steps.local_batch_size, dp_rank=dp_rank, dp_size=dp_size),
        steps.val_batches)]
    with torch.no_grad():
        for batch in batches:
            mask = (batch["attention_mask"] != 0).long()
            logits = model(input_ids=batch["input_ids"], attention_mask=mask).logits.float()
            labels = batch["labels"]
            total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                             ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
    return total / count


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, dict], WorldsBySize]:
    """Both students in every layout, trained in one world per world size: (root, configs, worlds), each
    run named `layout_student` and kept under root / layout / student."""
    root = tmp_path_factory.mktemp("export")
    for name, architecture in STUDENTS.items():
        save_hf_model(load_causal_lm(random_init=architecture, seed=5), None, root / f"{name}_start")
    configs, checks = {}, []
    for layout, (world_size, section) in LAYOUTS.items():
        for name in STUDENTS:
            config = base_config(root / layout / name)
            config["model"] = {"path": str(root / f"{name}_start"), "tokenizer": "byte"}
            # One document a row: plain transformers scores it as the trainer does.
            config["dataset"]["packing"] = False
            config["step_scheduler"].update(max_steps=3, global_batch_size=4, local_batch_size=2)
            config["checkpoint"] = {"enabled": True, "save_hf": True}
            configs[f"{layout}_{name}"] = config = with_layout(config, section, None)
            checks.append((world_size, TrainRun(config, name=f"{layout}_{name}")))
    return root, configs, WorldsBySize(checks)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_exported_student_is_the_configured_model_and_scores_the_reported_loss(runs, layout):
    root, configs, worlds = runs
    _, section = LAYOUTS[layout]
    for name in STUDENTS:
        worlds.check(f"{layout}_{name}")
    from transformers import AutoModelForCausalLM

    for name in STUDENTS:
        config = configs[f"{layout}_{name}"]
        started = AutoModelForCausalLM.from_pretrained(root / f"{name}_start")
        exported = AutoModelForCausalLM.from_pretrained(Path(config["logging"]["run_dir"], "hf_student"))
        tied = exported.lm_head.weight is exported.get_input_embeddings().weight
        assert tied == (name == "tied"), f"{layout} {name}: output head tied {tied}"
        assert num_parameters(exported) == num_parameters(started), f"{layout} {name}"
        reported = [r for r in read_metrics(config["logging"]["run_dir"]) if r["kind"] == "eval"][-1]["val_loss"]
        scored = plain_val_loss(exported, config, section["dp_size"])
        assert scored == pytest.approx(reported, abs=1e-5), f"{layout} {name}"

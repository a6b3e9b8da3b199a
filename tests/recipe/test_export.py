"""What a run ships is the model it was configured with, and it scores what the trainer reported.

A tied (Qwen3, `tie_word_embeddings`) and an untied (Llama) student, each read from a Hugging Face
directory (so loaded in shards where the layout allows), trained a few steps in one process, with DDP dp 2,
FSDP2 dp 2 and tp 2 (both students in one world per layout): the exported `hf_student`, loaded by plain
transformers, has one tied matrix where the config ties them, exactly the parameter count of
`from_pretrained` of the directory it started from, and its held-out loss, computed by plain transformers
on the validation rows, equals the trainer's last `val_loss`.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from meshkd.recipe import data
from meshkd.recipe.config import config_from_dict
from meshkd.recipe.metrics import read_metrics
from meshkd.recipe.models import byte_tokenizer, load_causal_lm, save_hf_model
from tests.recipe.test_recipe import TrainRun
from tests.tiny import base_config, with_layout
from tests.world import run_world

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
        data.eval_batches(val_set, batch_size=steps.local_batch_size, dp_rank=dp_rank, dp_size=dp_size),
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


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_exported_student_is_the_configured_model_and_scores_the_reported_loss(tmp_path, layout):
    world_size, section = LAYOUTS[layout]
    configs = {}
    for name, architecture in STUDENTS.items():
        directory = tmp_path / f"{name}_start"
        save_hf_model(load_causal_lm(random_init=architecture, seed=5), None, directory)
        config = base_config(tmp_path / name)
        config["model"] = {"path": str(directory), "tokenizer": "byte"}
        config["dataset"]["packing"] = False  # one document a row: plain transformers scores it as the trainer does
        config["step_scheduler"].update(max_steps=3, global_batch_size=4, local_batch_size=2)
        config["checkpoint"] = {"enabled": True, "save_hf": True}
        configs[name] = with_layout(config, section, None)
    runs = []
    for name, config in configs.items():
        runs.append(TrainRun(config))
        runs[-1].__name__ = f"train_{name}"
    results = run_world(world_size, runs, timeout_s=60, deadline_s=300)
    for run in runs:
        results.check(run.__name__)
    from transformers import AutoModelForCausalLM

    for name, config in configs.items():
        started = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}_start")
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / name / "run" / "hf_student")
        tied = exported.lm_head.weight is exported.get_input_embeddings().weight
        assert tied == (name == "tied"), f"{layout} {name}: output head tied {tied}"
        assert num_parameters(exported) == num_parameters(started), f"{layout} {name}"
        reported = [r for r in read_metrics(config["logging"]["run_dir"]) if r["kind"] == "eval"][-1]["val_loss"]
        scored = plain_val_loss(exported, config, section["dp_size"])
        assert scored == pytest.approx(reported, abs=1e-5), f"{layout} {name}"


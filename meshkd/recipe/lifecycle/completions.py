"""Greedy completions of one prompt by the teacher, the pruned student and the trained student: what the
loss figures mean, shown (`meshkd demo` prints them). One process, the models' own `generate`."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from meshkd.parallel.pruning import prune_layers
from meshkd.recipe.modeling import models
from meshkd.recipe.modeling.loaders import load_section_model, load_section_tokenizer


def greedy_completion(model, tokenizer, prompt: str, *, max_new_tokens: int) -> str:
    """The text `model` appends to `prompt`, choosing the likeliest token each time (with the KV cache)."""
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens,
                                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def compare_completions(teacher_section, keep_layers: list[int], trained: dict[str, str | Path], prompt: str, *,
                        max_new_tokens: int = 32) -> dict[str, str]:
    """{"teacher", "pruned student", *trained: completion}: the pruned student is the teacher with only
    `keep_layers`; `trained` names the HF directories the runs wrote."""
    tokenizer = load_section_tokenizer(teacher_section)
    with models.loading_quietly():
        teacher = load_section_model(teacher_section)
        students = {name: models.load_causal_lm(path=directory) for name, directory in trained.items()}
    pruned = prune_layers(copy.deepcopy(teacher), keep_layers)
    return {name: greedy_completion(model, tokenizer, prompt, max_new_tokens=max_new_tokens)
            for name, model in {"teacher": teacher, "pruned student": pruned, **students}.items()}

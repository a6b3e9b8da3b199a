"""A teacher with another tokenizer (`kd.cross_tokenizer`): the recipe trains from its answers projected onto
the student's vocabulary, and every teacher and student layout follows the single-process curve.

The student reads the byte tokenizer; the teacher a byte-level BPE trained on the test corpus in-process, so
the two tokenize every row differently (the teacher's rows are shorter) and the alignment has groups of
several student tokens.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from meshkd.recipe.config import ConfigError, config_from_dict
from tests.recipe.test_recipe import RecipeRuns, curve
from tests.tiny import STEPS, base_config, with_layout

pytestmark = pytest.mark.world


def teacher_tokenizer_dir(directory: Path, corpus: str) -> tuple[str, int]:
    """A byte-level BPE of 320 entries trained on the corpus, saved as an HF tokenizer; (path, its length)."""
    import glob

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([Path(path).read_text() for path in sorted(glob.glob(corpus))], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(directory)
    return str(directory), len(tokenizer)


def cross_config(tmp: Path, student: dict, teacher: dict | None, *, same_tokenizer: bool = False) -> dict:
    config = base_config(tmp)
    config["kd"]["cross_tokenizer"] = {"teacher_sequence_length": 32}
    if same_tokenizer:  # the byte tokenizer's 258 entries fill the models' tables: nothing to renormalize
        for key in ("model", "teacher_model"):
            config[key]["random_init"]["vocab_size"] = 258
    else:
        path, size = teacher_tokenizer_dir(tmp / "teacher_tokenizer", config["dataset"]["paths"][0])
        config["teacher_model"]["tokenizer"] = path
        config["teacher_model"]["random_init"]["vocab_size"] = size
    return with_layout(config, student, teacher)


LAYOUTS = {
    "teacher_tp2": ({"dp_size": 1}, {"dp_size": 1, "tp_size": 2}),
    "teacher_cp2": ({"dp_size": 1}, {"dp_size": 1, "cp_size": 2}),
    "teacher_pp2": ({"dp_size": 1}, {"dp_size": 1, "pp_size": 2}),
    "student_dp2": ({"dp_size": 2}, {"dp_size": 1}),
    "student_tp2": ({"dp_size": 1, "tp_size": 2}, {"dp_size": 1}),
}


def cross_runs(tmp: Path) -> dict[str, tuple[dict, bool]]:
    runs = {"reference": (cross_config(tmp / "reference", {"dp_size": 1}, None), False)}
    for name, (student, teacher) in LAYOUTS.items():
        runs[name] = (cross_config(tmp / name, student, teacher), False)
    same = cross_config(tmp / "same", {"dp_size": 1}, None, same_tokenizer=True)
    plain = copy.deepcopy(same)
    plain["kd"].pop("cross_tokenizer")
    plain["logging"]["run_dir"] = str(tmp / "plain" / "run")
    runs["same_tokenizer"], runs["plain_kd"] = (same, False), (plain, False)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> RecipeRuns:
    return RecipeRuns(cross_runs(tmp_path_factory.mktemp("cross_tokenizer")))


def test_one_tokenizer_through_the_cross_tokenizer_path_trains_plain_kd(runs):
    """Same tokenizer on both sides: every label is an aligned position and the projection the identity."""
    cross, plain = curve(runs.records("same_tokenizer")), curve(runs.records("plain_kd"))
    assert len(cross) == 3 * STEPS
    assert cross == pytest.approx(plain, rel=1e-5, abs=1e-6)


def test_another_tokenizer_trains_and_evaluates_the_teacher_in_its_own_tokens(runs):
    records = runs.records("reference")
    steps = [r for r in records if r["kind"] == "train"]
    assert len(steps) == STEPS and all(math.isfinite(r["kd_loss"]) and r["kd_loss"] > 0 for r in steps)
    first = next(r for r in records if r["kind"] == "eval" and r["step"] == 0)
    # A random-init teacher of 320 entries is near uniform over its own vocabulary, not the student's 262.
    assert first["teacher_val_loss"] == pytest.approx(math.log(320), rel=0.05)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_follows_the_single_process_curve(runs, layout):
    reference, records = curve(runs.records("reference")), curve(runs.records(layout))
    assert len(records) == len(reference) == 3 * STEPS
    assert records[:3] == pytest.approx(reference[:3], rel=1e-5, abs=1e-6)
    assert records == pytest.approx(reference, rel=1e-4, abs=1e-5)


def test_unsupported_combinations_are_refused_naming_the_key(tmp_path):
    config = cross_config(tmp_path, {"dp_size": 1}, None, same_tokenizer=True)
    for change, key in (({"loss": "gold"}, "kd.cross_tokenizer.loss"),
                        ({"teacher_sequence_length": 1}, "kd.cross_tokenizer.teacher_sequence_length")):
        bad = copy.deepcopy(config)
        bad["kd"]["cross_tokenizer"].update(change)
        with pytest.raises(ConfigError, match=key):
            config_from_dict(bad)
    for change, named in (({"divergence": "reverse_kl"}, "reverse_kl"),
                          ({"mode": "on_policy", "generation": {"prompt_tokens": 8, "max_new_tokens": 8}}, "on_policy"),
                          ({"teacher_cache": str(tmp_path)}, "kd.teacher_cache")):
        bad = copy.deepcopy(config)
        bad["kd"].update(change)
        with pytest.raises(ConfigError, match=named):
            config_from_dict(bad)
    with pytest.raises(ConfigError, match="distributed.pp_size"):
        config_from_dict(with_layout(config, {"dp_size": 1, "pp_size": 2}, {"dp_size": 1}))

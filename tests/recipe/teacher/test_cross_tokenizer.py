"""A teacher with another tokenizer (`kd.cross_tokenizer`): the recipe trains from its answers projected onto
the student's vocabulary, and every teacher and student layout follows the single-process curve.

The student reads the byte tokenizer; the teacher a byte-level BPE trained on the test corpus in-process, so
the two tokenize every row differently (the teacher's rows are shorter) and the alignment has groups of
several student tokens.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import yaml

from meshkd.recipe.common.metrics import read_metrics
from meshkd.recipe.settings.config import ConfigError
from meshkd.recipe.settings.config_loading import config_from_dict
from meshkd.recipe.settings.typed_yaml import parse_yaml
from tests.recipe.lifecycle.test_recipe import TrainRun, config_world_size, curve
from tests.recipe.teacher.test_teacher_cache import WriteCache
from tests.tiny import STEPS, base_config, with_layout
from tests.world import WorldsBySize

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


EXAMPLE = Path(__file__).parents[3] / "examples" / "tiny_cross_tokenizer.yaml"


def example_config(tmp: Path) -> dict:
    """examples/tiny_cross_tokenizer.yaml as it is (its tokenizer path from the repository root), for `STEPS`
    steps into `tmp` without checkpoints."""
    config = parse_yaml(EXAMPLE.read_text())
    config["teacher_model"]["tokenizer"] = str(EXAMPLE.parents[1] / config["teacher_model"]["tokenizer"])
    config["step_scheduler"]["max_steps"] = STEPS
    config.update(checkpoint={"enabled": False}, logging={"run_dir": str(tmp / "run"), "progress_bar": False})
    return config


def swapped(config: dict) -> dict:
    """`config` with the tokenizers (and vocabularies) of its two sides exchanged: the teacher's is the finer."""
    config = copy.deepcopy(config)
    student, teacher = config["model"], config["teacher_model"]
    student["tokenizer"], teacher["tokenizer"] = teacher["tokenizer"], student["tokenizer"]
    student["random_init"]["vocab_size"], teacher["random_init"]["vocab_size"] = (
        teacher["random_init"]["vocab_size"], student["random_init"]["vocab_size"])
    return config


LAYOUTS = {
    "teacher_tp2": ({"dp_size": 1}, {"dp_size": 1, "tp_size": 2}),
    "teacher_cp2": ({"dp_size": 1}, {"dp_size": 1, "cp_size": 2}),
    "teacher_pp2": ({"dp_size": 1}, {"dp_size": 1, "pp_size": 2}),
    "student_dp2": ({"dp_size": 2}, {"dp_size": 1}),
    "student_tp2": ({"dp_size": 1, "tp_size": 2}, {"dp_size": 1}),
}


TOPK = {"logits_transport": "topk", "topk": 16, "topk_tail_samples": 4}


def cached(config: dict, name: str, cache: Path, student: dict, teacher: dict | None = None,
           kd: dict | None = None) -> dict:
    """`config` (its teacher_model kept) at another layout, reading or writing the teacher cache `cache`."""
    config = with_layout(config, student, teacher)
    config["kd"].update(kd or {}, teacher_cache=str(cache))
    config["logging"]["run_dir"] = str(cache.parent / name)
    return config


def cross_checks(tmp: Path) -> tuple[dict[str, dict], list]:
    """name -> config of every run, and the (world size, check) list that trains or writes each."""
    reference = cross_config(tmp / "reference", {"dp_size": 1}, None)
    runs = {"reference": reference}
    for name, (student, teacher) in LAYOUTS.items():
        runs[name] = cross_config(tmp / name, student, teacher)
    same = cross_config(tmp / "same", {"dp_size": 1}, None, same_tokenizer=True)
    plain = copy.deepcopy(same)
    plain["kd"].pop("cross_tokenizer")
    plain["logging"]["run_dir"] = str(tmp / "plain" / "run")
    runs.update(same_tokenizer=same, plain_kd=plain)
    live_topk = copy.deepcopy(reference)
    live_topk["kd"].update(TOPK)
    live_topk["logging"]["run_dir"] = str(tmp / "live_topk" / "run")
    runs["live_topk"] = live_topk
    gold_same = copy.deepcopy(same)
    gold_same["kd"]["cross_tokenizer"]["loss"] = "gold"
    gold_same["logging"]["run_dir"] = str(tmp / "gold_same" / "run")
    runs["gold_same_tokenizer"] = gold_same
    for loss, (student, teacher) in {"uld": ({"dp_size": 1}, {"dp_size": 1, "tp_size": 2}),
                                     "gold": ({"dp_size": 2}, {"dp_size": 1, "pp_size": 2})}.items():
        for name, layout in ((f"{loss}_reference", ({"dp_size": 1}, None)), (f"{loss}_layout", (student, teacher))):
            config = cross_config(tmp / name, *layout)
            config["kd"]["cross_tokenizer"]["loss"] = loss
            runs[name] = config
    for name, teacher in (("on_policy", None), ("on_policy_separate", {"dp_size": 1}), ("on_policy_gold", None)):
        config = with_layout(reference, {"dp_size": 1}, teacher)
        config["kd"].update(mode="on_policy", on_policy_fraction=0.5,
                            generation={"prompt_tokens": 8, "max_new_tokens": 12})
        if name.endswith("gold"):  # groups of the student's own samples, merged on both sides
            config["kd"]["cross_tokenizer"] = {"teacher_sequence_length": 32, "loss": "gold"}
        config["logging"]["run_dir"] = str(tmp / name / "run")
        runs[name] = config
    for name, (student, teacher, kd) in {"topk": ({"dp_size": 1}, None, TOPK),
                                         "tp2": ({"dp_size": 2}, {"dp_size": 1, "tp_size": 2}, None)}.items():
        runs[f"write_{name}"] = cached(reference, f"write_{name}", tmp / f"cache_{name}" / "cache", student, teacher,
                                       kd)
        runs[f"cached_{name}"] = cached(reference, f"cached_{name}", tmp / f"cache_{name}" / "cache", student,
                                        None, kd)
    runs["example"] = example_config(tmp / "example")
    checks = []
    for name, config in runs.items():
        check = WriteCache(config, name) if name.startswith("write") else TrainRun(config, name=name)
        checks.append((config_world_size(config), check))
    return runs, checks


class CrossRuns:
    def __init__(self, tmp: Path) -> None:
        self.configs, checks = cross_checks(tmp)
        self._worlds = WorldsBySize(checks)

    def records(self, name: str) -> list[dict]:
        self._worlds.check(name)
        return read_metrics(self.configs[name]["logging"]["run_dir"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> CrossRuns:
    return CrossRuns(tmp_path_factory.mktemp("cross_tokenizer"))


def test_one_tokenizer_through_the_cross_tokenizer_path_trains_plain_kd(runs):
    """Same tokenizer on both sides: every label is an aligned position and the projection the identity."""
    cross, plain = curve(runs.records("same_tokenizer")), curve(runs.records("plain_kd"))
    assert len(cross) == 3 * STEPS
    assert cross == pytest.approx(plain, rel=1e-5, abs=1e-6)
    first = [next(r for r in runs.records(run) if r["kind"] == "eval") for run in ("same_tokenizer", "plain_kd")]
    for key in ("val_bits_per_byte", "teacher_val_bits_per_byte", "teacher_val_loss"):
        assert first[0][key] == pytest.approx(first[1][key], rel=1e-6), key


def test_gold_with_one_tokenizer_is_plain_kd(runs):
    """One tokenizer: every group one token, every entry an exact match: GOLD's hybrid is the forward KL."""
    gold, plain = curve(runs.records("gold_same_tokenizer")), curve(runs.records("plain_kd"))
    assert gold == pytest.approx(plain, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("loss", ["uld", "gold"])
def test_group_losses_train_and_follow_the_single_process_curve_in_another_layout(runs, loss):
    """ULD beside a tp 2 teacher; GOLD with a dp 2 student and a pp 2 teacher."""
    reference, records = curve(runs.records(f"{loss}_reference")), curve(runs.records(f"{loss}_layout"))
    assert len(reference) == 3 * STEPS and all(value > 0 for value in reference[2::3])
    assert reference != pytest.approx(curve(runs.records("reference")), rel=1e-3)  # not the projection's
    assert records[:3] == pytest.approx(reference[:3], rel=1e-5, abs=1e-6)
    assert records == pytest.approx(reference, rel=1e-4, abs=1e-5)


def test_another_tokenizer_trains_and_evaluates_the_teacher_in_its_own_tokens(runs):
    records = runs.records("reference")
    steps = [r for r in records if r["kind"] == "train"]
    assert len(steps) == STEPS and all(math.isfinite(r["kd_loss"]) and r["kd_loss"] > 0 for r in steps)
    first = next(r for r in records if r["kind"] == "eval" and r["step"] == 0)
    # A random-init teacher of 320 entries is near uniform over its own vocabulary, not the student's 262.
    assert first["teacher_val_loss"] == pytest.approx(math.log(320), rel=0.05)
    # Per byte the two sides compare: each divides its own loss by the bytes of its own tokens, the same text.
    assert first["teacher_val_bits_per_byte"] < first["val_bits_per_byte"]  # near-uniform; longer tokens
    assert "val_kl" not in first  # a distribution over another vocabulary: no same-vocabulary KL
    # Each step's record holds the share of the training rows' positions filled on each side, from the rows.
    from meshkd.recipe.corpus.aligned_data import row_fill
    from meshkd.recipe.lifecycle.preflight import preflight
    from meshkd.recipe.student.step_data import run_datasets

    config = config_from_dict(runs.configs["reference"])
    checked = preflight(config)
    fill = row_fill(run_datasets(config, checked.tokenizer, checked.teacher_tokenizer)[0])
    assert set(fill) == {"row_fill", "teacher_row_fill"}
    for step in steps:
        assert {key: step[key] for key in fill} == pytest.approx(fill, rel=1e-12)
    # The teacher's BPE takes about half the tokens for the same bytes: its rows of 32 are half empty.
    assert fill["row_fill"] > 0.9 and 0.4 < fill["teacher_row_fill"] < 0.6
    summary = json.loads(Path(runs.configs["reference"]["logging"]["run_dir"], "summary.json").read_text())
    assert {"val_bits_per_byte_before", "val_bits_per_byte_after", "teacher_val_bits_per_byte"} <= set(summary)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_follows_the_single_process_curve(runs, layout):
    reference, records = curve(runs.records("reference")), curve(runs.records(layout))
    assert len(records) == len(reference) == 3 * STEPS
    assert records[:3] == pytest.approx(reference[:3], rel=1e-5, abs=1e-6)
    assert records == pytest.approx(reference, rel=1e-4, abs=1e-5)


def test_unsupported_combinations_are_refused_naming_the_key(tmp_path):
    config = cross_config(tmp_path, {"dp_size": 1}, None, same_tokenizer=True)
    for change, key in (({"loss": "gkd"}, "kd.cross_tokenizer.loss"),
                        ({"teacher_sequence_length": 1}, "kd.cross_tokenizer.teacher_sequence_length")):
        bad = copy.deepcopy(config)
        bad["kd"]["cross_tokenizer"].update(change)
        with pytest.raises(ConfigError, match=key):
            config_from_dict(bad)
    for change, named in (({"divergence": "reverse_kl"}, "reverse_kl"),
                          ({"cross_tokenizer": {"loss": "uld"}, "logits_transport": "topk"}, "kd.logits_transport"),
                          ({"cross_tokenizer": {"loss": "uld"}, "divergence": "jsd"}, "kd.divergence"),
                          ({"cross_tokenizer": {"loss": "gold"}, "teacher_cache": "cache"}, "kd.teacher_cache")):
        bad = copy.deepcopy(config)
        bad["kd"].update(change)
        with pytest.raises(ConfigError, match=named):
            config_from_dict(bad)
    with pytest.raises(ConfigError, match="distributed.pp_size"):
        config_from_dict(with_layout(config, {"dp_size": 1, "pp_size": 2}, {"dp_size": 1}))
    gold = copy.deepcopy(config)
    gold["kd"]["cross_tokenizer"]["loss"] = "gold"
    with pytest.raises(ConfigError, match="distributed.tp_size"):
        config_from_dict(with_layout(gold, {"dp_size": 1, "tp_size": 2}, {"dp_size": 1}))


@pytest.mark.parametrize("name, live", [("cached_topk", "live_topk"), ("cached_tp2", "student_dp2")])
def test_a_run_from_a_cross_tokenizer_cache_follows_the_live_teacher(runs, name, live):
    """Top-k answers cached by a one-rank teacher; full answers by a tp 2 teacher, read by a dp 2 student."""
    records, expected = curve(runs.records(name)), curve(runs.records(live))
    assert len(records) == len(expected) == 3 * STEPS
    assert records == pytest.approx(expected, rel=1e-5, abs=1e-6)
    first = [next(r for r in runs.records(run) if r["kind"] == "eval") for run in (name, live)]
    assert first[0]["teacher_val_loss"] == pytest.approx(first[1]["teacher_val_loss"], rel=1e-6)


def test_the_cache_keeps_the_teachers_tokenizer_and_refuses_another(runs, tmp_path):
    from meshkd.commands import prepare_data_command
    from meshkd.recipe.lifecycle.preflight import preflight

    config = runs.configs["cached_topk"]
    runs.records("cached_topk")
    without_teacher = copy.deepcopy(config)
    without_teacher.pop("teacher_model")  # the cache's own tokenizer packs the teacher's side
    assert preflight(config_from_dict(without_teacher)).teacher_tokenizer is not None
    # So does it for `meshkd prepare-data`: the store holds the teacher's tokens, by the cache's tokenizer.
    without_teacher["dataset"]["token_store"] = str(tmp_path / "store")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(without_teacher))
    assert prepare_data_command(str(path), []) == 0
    manifests = [json.loads(found.read_text()) for found in (tmp_path / "store").rglob("manifest.json")]
    assert manifests and all("teacher_tokens" in manifest for manifest in manifests)
    other = copy.deepcopy(config)
    other["teacher_model"]["tokenizer"] = "byte"
    with pytest.raises(ConfigError, match="teacher_model.tokenizer"):
        preflight(config_from_dict(other))


def test_on_policy_the_teacher_reads_its_own_tokenization_of_the_students_samples(runs):
    """Half the micro-batches are the student's completions, decoded to text and tokenized by the teacher;
    a teacher on its own ranks gives the curve of one on the student's ranks."""
    records = runs.records("on_policy")
    steps = [r for r in records if r["kind"] == "train"]
    assert len(steps) == STEPS and sum(r["generated_tokens"] for r in steps) > 0
    assert all(math.isfinite(r["kd_loss"]) and r["kd_loss"] > 0 for r in steps)
    evals = [r for r in records if r["kind"] == "eval"]
    assert all(math.isfinite(r["teacher_nll_of_samples"]) and r["sample_length"] > 0 for r in evals)
    # Near-uniform random teacher: about log(320) nats per token of its own.
    assert evals[0]["teacher_nll_of_samples"] == pytest.approx(math.log(320), rel=0.1)
    assert curve(runs.records("on_policy_separate")) == pytest.approx(curve(records), rel=1e-5, abs=1e-6)


def test_on_policy_with_a_group_loss_trains_on_the_students_samples(runs):
    steps = [r for r in runs.records("on_policy_gold") if r["kind"] == "train"]
    assert len(steps) == STEPS and sum(r["generated_tokens"] for r in steps) > 0
    assert all(math.isfinite(r["kd_loss"]) and r["kd_loss"] > 0 for r in steps)
    assert curve(runs.records("on_policy_gold")) != pytest.approx(curve(runs.records("on_policy")), rel=1e-3)


def test_the_example_config_trains_with_rows_full_on_both_sides(runs):
    """examples/tiny_cross_tokenizer.yaml: the byte tokenizer beside a BPE of 1024 entries, a tp 2 teacher."""
    records = runs.records("example")
    steps = [r for r in records if r["kind"] == "train"]
    assert len(steps) == STEPS and all(math.isfinite(r["kd_loss"]) and r["kd_loss"] > 0 for r in steps)
    assert steps[0]["row_fill"] > 0.9 and steps[0]["teacher_row_fill"] > 0.8
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals[-1]["val_bits_per_byte"] < evals[0]["val_bits_per_byte"]
    assert evals[0]["teacher_val_bits_per_byte"] < evals[0]["val_bits_per_byte"]  # its tokens are longer


def test_a_row_too_short_for_an_aligned_group_is_refused_before_any_process_starts(tmp_path, monkeypatch, capsys):
    """A group (the tokens of both sides covering the same bytes) is never split: a side whose row cannot
    hold one is refused by `meshkd train` at preflight, naming that side's key and the length it needs."""
    import yaml

    from meshkd import cli, launcher

    monkeypatch.setattr(launcher, "launch", lambda *args: pytest.fail("processes were started"))
    config = cross_config(tmp_path, {"dp_size": 1}, None)
    # A byte-level teacher (the finer tokenizer): one BPE token of the student's is several teacher tokens.
    finer_teacher = swapped(config)
    finer_teacher["kd"]["cross_tokenizer"]["teacher_sequence_length"] = 4
    short_student = copy.deepcopy(config)
    short_student["step_scheduler"]["sequence_length"] = 4
    path = tmp_path / "run.yaml"
    for bad, key in ((finer_teacher, "kd.cross_tokenizer.teacher_sequence_length"),
                     (short_student, "step_scheduler.sequence_length")):
        path.write_text(yaml.safe_dump(bad))
        assert cli.main(["train", str(path)]) == 2
        error = capsys.readouterr().err
        assert re.fullmatch(rf"meshkd: error: {re.escape(key)} \(4\) is too short: document \d+: group \d+ "
                            r"\(bytes \d+\.\.\d+\) has \d+ student and \d+ teacher tokens covering the same bytes, "
                            r"and a group is never split across rows; use at least \d+\n", error), error
        assert not Path(bad["logging"]["run_dir"]).exists()  # no worker ever ran
        # The workers' own packing (a corpus too large for preflight to read) names the key too.
        from meshkd.recipe.lifecycle.preflight import preflight
        from meshkd.recipe.student.step_data import run_datasets

        parsed = config_from_dict(bad)
        checked = preflight(config_from_dict(config if key.startswith("step") else swapped(config)))
        with pytest.raises(ConfigError, match=re.escape(key)):
            run_datasets(parsed, checked.tokenizer, checked.teacher_tokenizer)
        capsys.readouterr()  # that preflight's warning


def test_rows_a_side_leaves_under_filled_are_warned_of_with_the_length_that_fills_both(tmp_path, monkeypatch,
                                                                                         capsys):
    """The teacher's BPE takes about half the student's byte tokens: rows of 32 teacher tokens are half empty,
    rows of 8 leave the student's mostly empty; the length preflight names fills both alike, unwarned."""
    from meshkd.recipe.common import metrics
    from meshkd.recipe.corpus.aligned_data import check_row_lengths
    from meshkd.recipe.lifecycle.preflight import preflight

    monkeypatch.delenv(metrics.WARNED_ENV, raising=False)
    monkeypatch.setattr(metrics, "warned", [])
    config = cross_config(tmp_path, {"dp_size": 1}, None)
    checked = preflight(config_from_dict(config))
    texts = [path.read_text() for path in sorted(Path(tmp_path, "corpus").glob("*.txt"))]

    def measured(teacher_length: int) -> tuple[dict, str]:
        changed = copy.deepcopy(config)
        changed["kd"]["cross_tokenizer"]["teacher_sequence_length"] = teacher_length
        fill = check_row_lengths(config_from_dict(changed), texts, checked.tokenizer, checked.teacher_tokenizer)
        return fill, capsys.readouterr().err

    long_rows, warned = measured(32)
    best = long_rows["teacher_row_length"]
    assert 14 <= best <= 18 and long_rows["teacher_row_fill"] < 0.6 < 0.9 < long_rows["row_fill"]
    assert re.fullmatch(rf"meshkd: warning: kd.cross_tokenizer.teacher_sequence_length: rows fill \d+% of the "
                        rf"student's 32 tokens and \d+% of the teacher's 32 \(measured on the first 24 "
                        rf"document\(s\)\); the teacher's tokenizer takes 0\.\d+ tokens per student token of "
                        rf"this text, so kd.cross_tokenizer.teacher_sequence_length: {best} fills both sides "
                        r"alike\n", warned), warned
    short_rows, warned = measured(8)
    assert short_rows["row_fill"] < 0.6 < 0.9 < short_rows["teacher_row_fill"]
    assert f"rows fill {short_rows['row_fill']:.0%} of the student's 32" in warned
    assert short_rows["teacher_row_length"] == best  # the ratio of the two tokenizations, whatever the rows
    filled, warned = measured(best)
    assert warned == "" and min(filled["row_fill"], filled["teacher_row_fill"]) > 0.8

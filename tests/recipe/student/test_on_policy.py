"""On-policy distillation: what the student samples, what counts in the loss, and the recipe end to end.

The recipe runs train tiny random-init Llamas on the student's own completions: every layout's curve
equals the single-process run's, only generated tokens count, and a resumed run continues exactly.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from meshkd.core.packing import configure_packing
from meshkd.core.teacher_ensemble import ROUTE
from meshkd.recipe.student.on_policy import (
    ModelGenerate,
    SamplingSettings,
    build_prompt_set,
    completion_batch,
    is_on_policy,
    prompts_of,
    row_seed,
)
from tests.recipe.lifecycle.test_recipe import RecipeRuns, curve
from tests.tiny import STEPS, base_config, tiny_llama_model, with_layout

EOS, PAD = 256, 257


def _sampler(model, **settings):
    values = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "stop_tokens": (), **settings}
    return ModelGenerate(model, SamplingSettings(**values), pad_token_id=PAD, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def model():
    return configure_packing(tiny_llama_model(vocab=258, seed=4))


PROMPTS = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10]), torch.tensor([11, 12, 13])]


def test_each_row_samples_the_same_completion_whatever_it_is_batched_with(model):
    together = _sampler(model).sample(PROMPTS, [1, 2, 3])
    alone = [_sampler(model).sample([prompt], [seed])[0] for prompt, seed in zip(PROMPTS, [1, 2, 3])]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    assert all(len(c) == 6 for c in together)
    other = _sampler(model).sample(PROMPTS, [4, 5, 6])
    assert not all(torch.equal(a, b) for a, b in zip(together, other)), "another seed, other samples"


def test_temperature_zero_is_the_models_greedy_generate(model):
    got = _sampler(model, temperature=0.0).sample(PROMPTS[:1], [0])[0]
    want = model.generate(input_ids=PROMPTS[0][None], attention_mask=torch.ones(1, 4, dtype=torch.long),
                          do_sample=False, max_new_tokens=6, pad_token_id=PAD, eos_token_id=[])[0, 4:]
    assert torch.equal(got, want)
    # A nucleus too small to hold two tokens leaves the likeliest one: greedy again, whatever the seed.
    assert torch.equal(_sampler(model, top_p=1e-6).sample(PROMPTS[:1], [7])[0], want)


def test_a_completion_ends_at_its_first_stop_token(model):
    free = _sampler(model).sample(PROMPTS, [1, 2, 3])
    stop = int(free[0][2])
    cut = _sampler(model, stop_tokens=(stop,)).sample(PROMPTS, [1, 2, 3])
    for whole, part in zip(free, cut):
        position = next((i for i, token in enumerate(whole.tolist()) if token == stop), len(whole) - 1)
        assert torch.equal(part, whole[: position + 1])
    assert len(cut[0]) <= 3


def test_only_completion_tokens_are_labels():
    prompts = [torch.tensor([1, 2, 3]), None, torch.tensor([4])]
    completions = [torch.tensor([7, 8]), torch.tensor([9]), torch.tensor([5, 6, 7])]
    batch = completion_batch(prompts, completions, sequence_length=8, pad_token_id=PAD)
    assert batch["input_ids"][0].tolist() == [1, 2, 3, 7, 8, PAD, PAD, PAD]
    # Logits at the prompt's last token predict the first generated one; nothing else counts.
    assert batch["labels"][0].tolist() == [-100, -100, 7, 8, -100, -100, -100, -100]
    assert batch["labels"][2].tolist() == [5, 6, 7, -100, -100, -100, -100, -100]
    assert batch["attention_mask"][0].tolist() == [1] * 5 + [0] * 3
    assert batch["position_ids"][2].tolist() == [0, 1, 2, 3, 0, 0, 0, 0]
    assert (batch["labels"][1] == -100).all() and (batch["attention_mask"][1] == 0).all()  # a padding row
    with pytest.raises(ValueError, match="exceed the sequence length 4"):
        completion_batch(prompts[:1], completions[:1], sequence_length=4, pad_token_id=PAD)
    # Routed prompts (kd.combine route): each completion row keeps its prompt's teacher, padding rows none.
    routed = completion_batch(prompts, completions, sequence_length=8, pad_token_id=PAD,
                              routes=torch.tensor([[1], [-1], [0]]))
    assert routed[ROUTE].tolist() == [[1], [-1], [0]]
    assert all(torch.equal(routed[key], batch[key]) for key in batch)


def test_prompts_are_each_rows_first_document_without_its_end():
    batch = {"input_ids": torch.tensor([[1, 2, 3, EOS, 8, 9], [4, EOS, 5, 6, 7, EOS], [PAD] * 6]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 2, 2], [1, 1, 2, 2, 2, 2], [0] * 6])}
    prompts = prompts_of(batch, limit=2, eos_token_id=EOS)
    assert [p.tolist() if p is not None else None for p in prompts] == [[1, 2], [4], None]
    assert prompts_of(batch, limit=None, eos_token_id=EOS)[0].tolist() == [1, 2, 3]


def test_row_seeds_and_on_policy_choices_are_pure_functions():
    assert row_seed(0, 3, 5) == row_seed(0, 3, 5) != row_seed(0, 3, 6)
    assert row_seed(0, 3, 5) != row_seed(1, 3, 5) != row_seed(0, 4, 5)
    chosen = [is_on_policy(0, step, index, 0.3) for step in range(200) for index in range(4)]
    assert 0.22 < sum(chosen) / len(chosen) < 0.38
    assert all(is_on_policy(0, step, 0, 1.0) for step in range(10))
    assert not any(is_on_policy(0, step, 0, 0.0) for step in range(10))


def test_prompts_under_a_key_are_whole_and_bounded(tmp_path):
    from meshkd.recipe.modeling.models import byte_tokenizer
    from meshkd.recipe.settings.config import DatasetConfig

    lines = [{"prompt": f"p{i}:", "text": f"p{i}: answer {i}"} for i in range(10)]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    dataset = DatasetConfig(paths=[str(path)], prompt_key="prompt", val_fraction=0.2)
    train, val = build_prompt_set(byte_tokenizer(), dataset, max_prompt_tokens=8)
    assert len(train) == 8 and len(val) == 2
    tokenizer = byte_tokenizer()
    assert tokenizer.decode(prompts_of(train[0], limit=None, eos_token_id=EOS)[0]).startswith("p")
    with pytest.raises(ValueError, match=r"dataset.prompt_key 'prompt': .* beyond the limit of 2 tokens"):
        build_prompt_set(tokenizer, dataset, max_prompt_tokens=2)
    with pytest.raises(ValueError, match=r"dataset.prompt_key 'question'"):
        build_prompt_set(tokenizer, DatasetConfig(paths=[str(path)], prompt_key="question"), max_prompt_tokens=8)


def test_whole_prompts_carry_the_teacher_their_line_names(tmp_path):
    from meshkd.recipe.modeling.models import byte_tokenizer
    from meshkd.recipe.settings.config import DatasetConfig

    lines = [{"prompt": f"p{i}:", "text": f"p{i}: answer", "teacher": ("code", "prose")[i % 3 == 0]}
             for i in range(12)]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    tokenizer = byte_tokenizer()
    dataset = DatasetConfig(paths=[str(path)], prompt_key="prompt", val_fraction=0.0, teacher_key="teacher")
    train, _ = build_prompt_set(tokenizer, dataset, max_prompt_tokens=8, routes=["code", "prose"])
    rows = train[:]
    prompts = [tokenizer.decode(prompt) for prompt in prompts_of(rows, limit=None, eos_token_id=EOS)]
    teachers = {line["prompt"]: line["teacher"] for line in lines}
    assert sorted(prompts) == sorted(teachers)
    assert [["code", "prose"][index] for index in rows[ROUTE][:, 0].tolist()] == [teachers[p] for p in prompts]


# ------------------------------------------------------------------------------------------- recipe


def on_policy_config(tmp_path, **kd) -> dict:
    config = base_config(tmp_path)
    config["kd"].update({"mode": "on_policy", "kd_ratio": 1.0, "divergence": "reverse_kl",
                         "generation": {"max_new_tokens": 8, "prompt_tokens": 8}, **kd})
    return config


ON_POLICY_LAYOUTS = {
    "student_dp2_teacher_tp2": ({"dp_size": 2}, {"dp_size": 1, "tp_size": 2}),
    "student_tp2_teacher_cp2": ({"dp_size": 1, "tp_size": 2}, {"dp_size": 1, "cp_size": 2}),
    "student_ddp2_shared": ({"dp_size": 2, "strategy": "ddp"}, None),
}


def on_policy_runs(tmp: Path) -> dict[str, tuple[dict, bool]]:
    """Every recipe run of this module but the failing one: name -> (config, resume)."""
    runs = {"reference": (with_layout(on_policy_config(tmp / "reference"), {"dp_size": 1}, None), False)}
    for layout, (student, teacher) in ON_POLICY_LAYOUTS.items():
        runs[layout] = (with_layout(on_policy_config(tmp / layout), student, teacher), False)
    config = with_layout(on_policy_config(tmp / "resumed"), {"dp_size": 1}, {"dp_size": 1})
    config["checkpoint"] = {"enabled": True, "save_hf": False}
    config["step_scheduler"]["ckpt_every_steps"] = 2
    first = copy.deepcopy(config)
    first["step_scheduler"]["max_steps"] = 3
    first["lr_scheduler"]["total_steps"] = STEPS
    runs["resumed_first"], runs["resumed"] = (first, False), (config, True)
    share = on_policy_config(tmp / "share", on_policy_fraction=0.5, divergence="forward_kl", kd_ratio=0.5,
                             logits_transport="topk", topk=8)
    runs["share_with_topk"] = (with_layout(share, {"dp_size": 1}, {"dp_size": 1}), False)
    for estimator in ("k1", "k3"):  # the teacher on its own rank answers each label's log-probability only
        sampled = on_policy_config(tmp / f"sampled_{estimator}", divergence="sampled_reverse_kl",
                                   sampled_estimator=estimator, logits_transport="topk", topk=8)
        runs[f"sampled_{estimator}"] = (with_layout(sampled, {"dp_size": 1}, {"dp_size": 1}), False)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> RecipeRuns:
    return RecipeRuns(on_policy_runs(tmp_path_factory.mktemp("on_policy")))


@pytest.fixture(scope="module")
def on_policy_reference(runs) -> list[dict]:
    return runs.records("reference")


@pytest.mark.world
def test_the_reference_learns_on_its_own_completions_and_counts_only_them(on_policy_reference):
    train = [r for r in on_policy_reference if r["kind"] == "train"]
    assert len(train) == STEPS
    for record in train:
        # The loss's tokens are exactly the generated ones: prompts and padding never count.
        assert record["num_tokens"] == record["generated_tokens"] > 0
        assert record["on_policy_share"] == 1.0 and 0 < record["mean_completion_length"] <= 8
        assert record["ce_loss"] == 0.0 and record["kd_loss"] > 0
    evals = [r for r in on_policy_reference if r["kind"] == "eval"]
    assert all(r["teacher_nll_of_samples"] > 0 and 0 < r["sample_length"] <= 8 for r in evals)
    assert train[-1]["kd_loss"] < train[0]["kd_loss"]


@pytest.mark.world
@pytest.mark.parametrize("layout", list(ON_POLICY_LAYOUTS))
def test_on_policy_curve_equals_single_process(layout, runs, on_policy_reference):
    records = runs.records(layout)
    # Step 1, before any update, within 1e-5; later steps follow the updates, where float32 rounding of the
    # layouts' different reduction orders grows (lr 1e-2), as for off-policy runs.
    assert curve(records)[:3] == pytest.approx(curve(on_policy_reference)[:3], rel=1e-5)
    # ... and so is the norm of step 1's gradient, which each layout computes from its own shards.
    first, expected = (next(r for r in rs if r["kind"] == "train") for rs in (records, on_policy_reference))
    assert first["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    assert curve(records) == pytest.approx(curve(on_policy_reference), rel=1e-4)
    generated = [r["generated_tokens"] for r in records if r["kind"] == "train"]
    assert generated == [r["generated_tokens"] for r in on_policy_reference if r["kind"] == "train"]


@pytest.mark.world
def test_resumed_on_policy_run_draws_and_trains_exactly_as_the_uninterrupted_one(runs, on_policy_reference):
    runs.records("resumed_first")
    resumed = [r for r in runs.records("resumed") if r["kind"] == "train" and r["step"] > 2]
    assert [r["step"] for r in resumed] == [3, 4, 5]
    assert curve(resumed) == pytest.approx(curve(on_policy_reference)[6:], rel=1e-4)


@pytest.mark.world
def test_a_share_of_micro_batches_on_policy_with_topk_transport(runs):
    train = [r for r in runs.records("share_with_topk") if r["kind"] == "train"]
    expected = [sum(is_on_policy(0, step, index, 0.5) for index in range(4)) / 4 for step in range(STEPS)]
    assert [r["on_policy_share"] for r in train] == expected
    assert 0 < sum(expected) < STEPS, "both kinds of micro-batch occur"
    for record, share in zip(train, expected):
        # Text micro-batches count all their targets: more tokens than were generated whenever there are any.
        assert (record["num_tokens"] > record["generated_tokens"]) == (share < 1)
        assert record["ce_loss"] > 0 and record["kd_loss"] > 0


@pytest.mark.world
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_the_reverse_kl_estimated_on_the_sampled_tokens_trains_against_label_log_probs(runs, estimator):
    train = [r for r in runs.records(f"sampled_{estimator}") if r["kind"] == "train"]
    assert len(train) == STEPS
    for record in train:  # the estimate over the generated tokens only, finite, nonnegative in expectation
        assert record["num_tokens"] == record["generated_tokens"] > 0 and record["ce_loss"] == 0.0
        assert math.isfinite(record["kd_loss"]) and math.isfinite(record["grad_norm"]) and record["grad_norm"] > 0
    if estimator == "k3":
        assert all(record["kd_loss"] > 0 for record in train)  # r - 1 - log r is never negative


@pytest.mark.world
def test_a_failure_while_generating_ends_every_rank_within_seconds(tmp_path):
    from tests.recipe.lifecycle.test_reliability import WORLD_TIMEOUT_S, FailOnStudentRankOne
    from tests.world import run_world

    config = with_layout(on_policy_config(tmp_path), {"dp_size": 2}, {"dp_size": 1})
    config["collective_timeout_s"] = 30
    # Rank 1 fails completing its second micro-batch of step 1 (the first is with the teacher already): the
    # first evaluation samples twice (val_batches 2), then step 1 once per micro-batch (2).
    check = FailOnStudentRankOne("a_failure_while_generating_ends_every_rank_within_seconds", config,
                                 owner=ModelGenerate, method="sample", call=4,
                                 message="out of memory while generating (simulated)")
    errors = run_world(3, [check], timeout_s=WORLD_TIMEOUT_S, deadline_s=120).errors(check.__name__)
    assert "out of memory while generating (simulated)" in (errors.get(1) or ""), errors
    assert errors.get(0) is None and errors.get(2) is None, errors


# ------------------------------------------------------------------------- several teachers routed per prompt


def routed_on_policy_runs(tmp: Path) -> dict[str, tuple[dict, bool]]:
    """Two teachers (a Llama "code", a Qwen2 "prose"), each prompt routed to the one its JSONL line names, two rows
    a micro-batch: both teachers in the job; "prose" on a rank of its own; the sampled reverse KL."""
    from tests.recipe.teacher.test_teachers import llama_teacher, qwen_teacher, routed_corpus, teacher, with_teachers

    corpus = routed_corpus(tmp / "corpus")
    routed = [teacher("code", llama_teacher(), 1.0), teacher("prose", qwen_teacher(), 1.0)]
    own_ranks = [routed[0], {**routed[1], "distributed": {"dp_size": 1}}]
    sampled = {"divergence": "sampled_reverse_kl", "sampled_estimator": "k3"}
    runs = {}
    for name, teachers, kd in (("in_job", routed, {}), ("own_ranks", own_ranks, {}), ("sampled", own_ranks, sampled)):
        config = with_teachers(tmp / name, {"dp_size": 1}, teachers, combine="route",
                               **on_policy_config(tmp / name, **kd)["kd"])
        config["dataset"].update(paths=[corpus["both"]], teacher_key="teacher")
        config["step_scheduler"]["local_batch_size"] = 2
        runs[name] = (config, False)
    return runs


@pytest.fixture(scope="module")
def routed_runs(tmp_path_factory) -> RecipeRuns:
    return RecipeRuns(routed_on_policy_runs(tmp_path_factory.mktemp("routed_on_policy")))


@pytest.mark.world
@pytest.mark.parametrize("name", ["in_job", "own_ranks", "sampled"])
def test_each_teacher_scores_only_the_completions_of_its_own_prompts(routed_runs, name):
    from tests.recipe.teacher.test_teachers import expected_routes

    records = routed_runs.records(name)
    train = [record for record in records if record["kind"] == "train"]
    # The prompts are the rows' first documents: per step, as many completions reach each teacher as the step's
    # rows name it, and both teachers are asked within some step.
    expected = expected_routes(routed_runs.configs[name])
    assert len(train) == STEPS
    answered = [{teacher: record[f"teacher_rows/{teacher}"] for teacher in ("code", "prose")} for record in train]
    assert answered == expected
    assert any(0 < counts["code"] < 4 for counts in expected)
    for record, counts in zip(train, expected):
        assert record["num_tokens"] == record["generated_tokens"] > 0 and record["on_policy_share"] == 1.0
        # Each teacher's own divergence per token of its own completions, which together are all the step's.
        assert record["kd_tokens/code"] + record["kd_tokens/prose"] == record["num_tokens"]
        own = {teacher: record[f"kd_loss/{teacher}"] for teacher in counts if counts[teacher]}
        mixed = sum(own[teacher] * record[f"kd_tokens/{teacher}"] for teacher in own) / record["num_tokens"]
        assert mixed == pytest.approx(record["kd_loss"], rel=1e-5, abs=1e-7)
        assert math.isfinite(record["grad_norm"]) and record["grad_norm"] > 0
    if name == "own_ranks":  # a teacher on ranks of its own answers as in the job: the same completions and curve
        reference = routed_runs.records("in_job")
        assert curve(records)[:3] == pytest.approx(curve(reference)[:3], rel=1e-5)
        assert curve(records) == pytest.approx(curve(reference), rel=1e-4)
    if name == "sampled":  # k3 is never negative
        assert all(record["kd_loss"] > 0 for record in train)


ROUTED_REFUSALS = {
    "the sampled estimate summed over teachers": (
        lambda c: (c["kd"].update(combine="sum"), c["dataset"].update(teacher_key=None)),
        "kd.divergence sampled_reverse_kl with several teachers takes kd.combine route (each row's label "
        "log-probabilities from its own teacher), got kd.combine sum"),
    "the sampled estimate of a mixture": (
        lambda c: (c["kd"].update(combine="mixture"), c["dataset"].update(teacher_key=None)),
        "kd.divergence sampled_reverse_kl with several teachers takes kd.combine route"),
    "a cached routed teacher": (lambda c: c["teachers"][1].update(cache="cache"),
                                "teachers.prose.cache does not yet work with kd.combine route"),
    "a share of text micro-batches": (lambda c: c["kd"].update(on_policy_fraction=0.5),
                                      "it needs kd.mode on_policy with kd.on_policy_fraction 1"),
}


@pytest.mark.parametrize("case", ROUTED_REFUSALS)
def test_routed_on_policy_configs_that_cannot_work_are_refused_naming_the_key(tmp_path, case):
    from meshkd.recipe.settings.config import ConfigError
    from meshkd.recipe.settings.config_loading import config_from_dict

    runs = routed_on_policy_runs(tmp_path)
    for name in ("in_job", "sampled"):  # what the runs above train is accepted
        config_from_dict(runs[name][0])
    config = copy.deepcopy(runs["sampled"][0])
    change, expected = ROUTED_REFUSALS[case]
    change(config)
    with pytest.raises(ConfigError) as raised:
        config_from_dict(config)
    assert expected in str(raised.value)

"""The recipe on chat rows: only the answers train, and no layout, cache or teacher list changes that.

A one-process run on chat rows made from the standard library counts exactly the answer tokens of the rows
each step draws, and its held-out loss before training equals plain transformers' next-token loss over the
answers alone; a context-parallel and a pipelined student, a student reading the teacher's cache, two
identical teachers at 0.5 / 0.5 and rows read from the token store all train its curve. On-policy, the student
completes the rows' own prompts, read from the token store wherever it is kept.
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import pytest

from meshkd.recipe.settings.config_loading import config_from_dict
from tests.recipe.lifecycle.test_recipe import curve
from tests.recipe.teacher.test_teacher_cache import run_all, train_records, variant
from tests.tiny import STEPS, base_config

pytestmark = pytest.mark.world


def chat_config(tmp: Path) -> dict:
    """base_config on 40 chat rows (question and answer cut so that a 256-token row holds one or two)."""
    from meshkd.bench.corpora import stdlib_chat_rows

    rows = []
    for row in stdlib_chat_rows(max_rows=40, max_answer_chars=50):
        question, answer = (message["content"] for message in row["messages"])
        rows.append({"messages": [{"role": "user", "content": question[:30]},
                                  {"role": "assistant", "content": answer}]})
    path = tmp / "chat.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = base_config(tmp)
    config["dataset"] = {"paths": [str(path)], "records": "chat", "val_fraction": 0.2, "seed": 3}
    config["step_scheduler"]["sequence_length"] = 256
    config["kd"]["logits_transport"] = "full_bf16"  # what a cache can hold exactly
    return config


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("chat_one_rank")
    base = chat_config(tmp)
    runs = {"reference": variant(base, tmp, "reference", student={"dp_size": 1}),
            "write_cache": variant(base, tmp, "write_cache", student={"dp_size": 1}, cache=str(tmp / "cache")),
            "cached": variant(base, tmp, "cached", student={"dp_size": 1}, cache=str(tmp / "cache"))}
    twins = copy.deepcopy(runs["reference"])
    teacher = twins.pop("teacher_model")
    twins["teachers"] = [{"name": "a", "model": teacher, "weight": 0.5}, {"name": "b", "model": teacher, "weight": 0.5}]
    twins["logging"]["run_dir"] = str(tmp / "twins")
    runs["twins"] = twins
    stored = variant(base, tmp, "stored", student={"dp_size": 1})
    stored["dataset"]["token_store"] = str(tmp / "tokens")
    runs["stored"] = stored
    on_policy = variant(base, tmp, "on_policy", student={"dp_size": 1},
                        kd={"mode": "on_policy", "generation": {"max_new_tokens": 8}})
    on_policy["step_scheduler"]["max_steps"] = 2
    runs["on_policy"] = on_policy
    on_policy_stored = copy.deepcopy(on_policy)
    on_policy_stored["dataset"]["token_store"] = str(tmp / "on_policy_tokens")
    on_policy_stored["logging"]["run_dir"] = str(tmp / "on_policy_stored")
    runs["on_policy_stored"] = on_policy_stored
    return run_all(1, runs)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("chat_three_ranks")
    base = chat_config(tmp)
    runs = {name: variant(base, tmp, name, student=student, teacher={"dp_size": 1})
            for name, student in (("student_cp2", {"dp_size": 1, "cp_size": 2}),
                                  ("student_pp2", {"dp_size": 1, "pp_size": 2}))}
    runs["student_cp2"]["dataset"]["token_store"] = str(tmp / "tokens")  # two student ranks share one store
    return run_all(3, runs)


def test_each_step_counts_exactly_the_answer_tokens_of_its_rows(one_rank):
    from meshkd.recipe.corpus import data
    from meshkd.recipe.corpus.batches import iterate_batches
    from meshkd.recipe.modeling.models import byte_tokenizer

    config = one_rank["reference"]
    parsed = config_from_dict(config)
    tokenizer = byte_tokenizer()
    train, _ = data.build_run_datasets(tokenizer, parsed.dataset, sequence_length=256)
    batches = iterate_batches(train, global_batch_size=4, dp_rank=0, dp_size=1, seed=parsed.dataset.seed)
    expected = []
    for batch in itertools.islice(batches, STEPS):
        counted = batch["labels"] != -100
        targets = tokenizer.decode(batch["labels"][counted])
        assert "<|im_start|>" not in targets and "user\n" not in targets  # no prompt, no header
        assert targets.count("<|im_end|>") > 0
        expected.append(int(counted.sum()))
    records = train_records(config)
    assert [r["num_tokens"] for r in records if r["kind"] == "train"] == expected


def test_held_out_loss_before_training_is_the_answers_next_token_loss(one_rank):
    import torch

    from meshkd.recipe.corpus import data
    from meshkd.recipe.modeling.models import byte_tokenizer, load_causal_lm

    config = one_rank["reference"]
    parsed = config_from_dict(config)
    _, rows = data.build_run_datasets(byte_tokenizer(), parsed.dataset, sequence_length=256)
    model = load_causal_lm(random_init=config["model"]["random_init"], seed=config["model"]["seed"]).eval()
    total = tokens = 0.0
    for index in range(min(len(rows), config["step_scheduler"]["val_batches"])):
        row = rows[index : index + 1]
        documents = row["attention_mask"][0]
        with torch.no_grad():  # each document of the row on its own: what the packed mask lets a token see
            for document in range(1, int(documents.max()) + 1):
                at = documents == document
                logits = model(input_ids=row["input_ids"][0][at][None]).logits[0]
                labels = row["labels"][0][at]
                losses = torch.nn.functional.cross_entropy(logits.double(), labels.clamp(min=0), reduction="none")
                total += float(losses[labels != -100].sum())
                tokens += float((labels != -100).sum())
    before = next(r for r in train_records(config) if r["kind"] == "eval")
    assert before["val_loss"] == pytest.approx(total / tokens, rel=1e-5)


@pytest.mark.parametrize("name", ["cached", "twins", "stored"])
def test_a_cache_two_identical_teachers_and_the_token_store_follow_the_curve(name, one_rank):
    reference = curve(train_records(one_rank["reference"]))
    assert curve(train_records(one_rank[name])) == pytest.approx(reference, abs=1e-5)


@pytest.mark.parametrize("name", ["student_cp2", "student_pp2"])
def test_context_parallel_and_pipelined_students_follow_the_curve(name, one_rank, three_ranks):
    reference = curve(train_records(one_rank["reference"]))
    values = curve(train_records(three_ranks[name]))
    assert values[:3] == pytest.approx(reference[:3], abs=1e-5)
    assert values == pytest.approx(reference, abs=1e-4)


def test_on_policy_completes_the_rows_own_prompts(one_rank):
    """The student completes each chat row up to its last answer (the assistant header included) with 8 tokens."""
    steps = [r for r in train_records(one_rank["on_policy"]) if r["kind"] == "train"]
    assert len(steps) == 2
    for record in steps:
        assert record["on_policy_share"] == 1.0 and 0 < record["mean_completion_length"] <= 8
        assert record["num_tokens"] == record["generated_tokens"]  # only the completions count


def test_on_policy_prompts_read_from_the_token_store_train_the_same_curve(one_rank):
    """The on-policy run with its rows and prompts in a store of its own (`dataset.token_store`) draws the same
    completions and trains the curve of the run whose store is in the cache directory; its evaluations score the
    same validation prompts' completions."""
    reference, stored = (train_records(one_rank[name]) for name in ("on_policy", "on_policy_stored"))
    assert curve(stored) == pytest.approx(curve(reference), abs=1e-6)
    for key in ("generated_tokens", "num_tokens"):
        assert [r[key] for r in stored if r["kind"] == "train"] == [r[key] for r in reference if r["kind"] == "train"]
    evals = [[r["teacher_nll_of_samples"] for r in records if r["kind"] == "eval"] for records in (stored, reference)]
    assert len(evals[0]) == 2 and evals[0] == pytest.approx(evals[1], abs=1e-6)
    store = Path(one_rank["on_policy_stored"]["dataset"]["token_store"])
    keys = [json.loads(manifest.read_text())["key"] for manifest in store.glob("*/manifest.json")]
    assert sorted(key.get("prompts", False) for key in keys) == [False, True]  # the rows' store and the prompts'

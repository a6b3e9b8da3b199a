"""A served teacher: `meshkd serve-teacher` answers students that name it by `teacher_model.url`.

Real processes on the CPU: one server (a tp 2 teacher on two ranks, with a bearer token) serves students that
train at the same time, each on the curve of a run with the teacher in its own job (top-k and full answers,
within 1e-6), while a third student is killed mid-run. The server refuses a wrong token (401, no answer) and
100 malformed bodies (4xx each, still serving), and drains on SIGTERM. A server killed mid-run and started
again on its address costs the student a wait, not the run, nor its curve. Preflight names the key and the
address of a teacher that is not there, or not the one the config describes.
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from meshkd.core import wire
from meshkd.recipe.lifecycle.preflight import preflight
from meshkd.recipe.settings.config import ConfigError
from meshkd.recipe.settings.config_loading import config_from_dict
from meshkd.recipe.teacher.completions_teacher import CompletionsTeacher
from meshkd.recipe.teacher.served_protocol import ANSWER_PATH, TOKEN_VARIABLE, AnswerRequest
from meshkd.recipe.teacher.served_teacher import ServedTeacher, ServedTeacherError
from tests.recipe.lifecycle.test_recipe import TrainRun, curve
from tests.recipe.teacher.test_teacher_cache import COMPACT, TOPK, train_records
from tests.recipe.teacher.test_teacher_cache import assert_same_curve as assert_same_cached_curve
from tests.tiny import base_config, with_layout
from tests.world import run_world

pytestmark = pytest.mark.world

TOKEN = "served-teacher-test-token"
FULL = {"logits_transport": "full"}
HIDDEN = {"logits_transport": "hidden", "divergence": "reverse_kl"}
COMPLETIONS = {"logits_transport": "topk", "topk": 8, "topk_tail_samples": 0, "temperature": 1.0}
"""What a completions server's prompt_logprobs answer: the top k at temperature 1, no tail samples."""


def server_config(tmp: Path) -> dict:
    """The tiny run, its teacher laid out as tp 2 on ranks of its own (what the server runs)."""
    config = with_layout(base_config(tmp), {"dp_size": 1}, {"dp_size": 1, "tp_size": 2})
    config["step_scheduler"]["max_steps"] = 8
    return config


def student(config: dict, tmp: Path, name: str, url: str, kd: dict) -> dict:
    config = copy.deepcopy(config)
    config["teacher_model"]["url"] = url
    config["kd"].update(kd)
    config["logging"]["run_dir"] = str(tmp / name)
    return config


def assert_same_curve(records: list[dict], expected: list[dict]) -> None:
    """Every record of a run equals the reference run's: the same keys, the losses and held-out figures within
    1e-6 (perplexities, exp of a loss, relative), the gradient norm within a relative 1e-5 (a tp 2 teacher's and
    a batched forward's sums differ from one rank's in their last bits, which the norm of a gradient moves by
    more than the losses)."""
    assert [sorted(record) for record in records] == [sorted(record) for record in expected]
    for record, reference in zip(records, expected):
        for key, value in reference.items():
            relative = key.endswith("perplexity") or key == "grad_norm"
            close = dict(abs=0, rel=1e-5 if key == "grad_norm" else 1e-6) if relative else dict(abs=1e-6, rel=0)
            if not key.split("/")[0].endswith("_s"):  # timings: seconds, tokens_per_s
                assert record[key] == (pytest.approx(value, **close) if isinstance(value, float) else value), key


def write(config: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """`meshkd serve-teacher` in a process group of its own, on `port`; `options`: more of its command line."""

    def __init__(self, config_path: Path, port: int, log: Path, options: tuple[str, ...] = ()) -> None:
        self.address_file = log.with_suffix(".address")
        self.address_file.unlink(missing_ok=True)
        self.log = log
        command = [sys.executable, "-m", "meshkd", "serve-teacher", str(config_path), "--port", str(port),
                   "--address-file", str(self.address_file), *options]
        self.process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                        env=dict(os.environ, **{TOKEN_VARIABLE: TOKEN}), start_new_session=True)
        deadline = time.monotonic() + 180
        while not self.address_file.exists():
            assert self.process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        self.url = self.address_file.read_text()

    def health(self) -> dict:
        request = urllib.request.Request(self.url + "/health", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> int:
        """SIGTERM, as a scheduler sends it: the server drains and exits."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


def train(config_path: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshkd", "train", str(config_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, **{TOKEN_VARIABLE: TOKEN}, **env),
                            start_new_session=True)


def finished(process: subprocess.Popen) -> str:
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    return output


def wait_for_metrics(run_dir: str, process: subprocess.Popen) -> None:
    """Until the run has logged its first record (its first evaluation, before any step)."""
    deadline = time.monotonic() + 120
    while not Path(run_dir, "metrics.jsonl").exists() or not Path(run_dir, "metrics.jsonl").read_text():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
        time.sleep(0.02)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    """One server, five students at once (top-k exact and compact, full, hidden with the reverse KL, and one killed
    mid-run)."""
    tmp = tmp_path_factory.mktemp("served")
    config = server_config(tmp)
    server = Server(write(config, tmp / "server.yaml"), 0, tmp / "server.log")
    runs = {}
    try:
        modes = (("topk", TOPK), ("compact", COMPACT), ("full", FULL), ("hidden", HIDDEN), ("killed", TOPK))
        for name, kd in modes:
            runs[f"served_{name}"] = student(config, tmp, f"served_{name}", server.url, kd)
        students = {name: train(write(runs[f"served_{name}"], tmp / f"{name}.yaml"))
                    for name in ("topk", "compact", "full", "hidden", "killed")}
        wait_for_metrics(runs["served_killed"]["logging"]["run_dir"], students["killed"])
        os.killpg(students["killed"].pid, signal.SIGKILL)
        for name in ("topk", "compact", "full", "hidden"):
            finished(students[name])
        runs["health"] = server.health()
        runs["server"], runs["url"] = server, server.url
        yield runs
    finally:
        if server.process.poll() is None:
            server.stop()


@pytest.fixture(scope="module")
def in_job(served, tmp_path_factory) -> dict:
    """The same students with the teacher in their own job (on the student's rank)."""
    tmp = tmp_path_factory.mktemp("in_job")
    runs = {}
    for name in ("topk", "compact", "full", "hidden"):
        config = copy.deepcopy(served[f"served_{name}"])
        del config["teacher_model"]["url"]
        config.pop("separate_meshes"), config.pop("teacher_distributed")
        config["logging"]["run_dir"] = str(tmp / name)
        runs[name] = config
    results = run_world(1, [TrainRun(config, name=name) for name, config in runs.items()], timeout_s=60,
                        deadline_s=300)
    for name in runs:
        results.check(name)
    return runs


@pytest.mark.parametrize("mode", ["topk", "compact", "full", "hidden"])
def test_students_of_one_served_teacher_follow_the_in_job_curve(served, in_job, mode):
    """Four students trained at once against one server (a fifth killed beside them) each follow the curve of
    their run with the teacher in their own job, held-out figures of the teacher's distribution included; the
    compact one's answers travel packed, the hidden one's are read with the output layer the server hands it."""
    records = train_records(served[f"served_{mode}"])
    assert_same_curve(records, train_records(in_job[mode]))
    assert any(record.get("kd_loss", 0) > 0 for record in records)
    assert "val_kl" in records[0] and "teacher_val_loss" in records[0]


def test_the_server_reports_its_teacher_and_load_and_drains_on_sigterm(served):
    health = served["health"]
    assert health["vocab_rows"] == 262 and health["hidden_size"] == 32 and health["protocol"] == 1
    assert health["teacher"]["teacher_model.seed"] == 2
    load = health["load"]
    assert load["served_requests"] > 0 and load["served_tokens"] >= 32 * load["served_requests"]
    assert 0 < load["busy_share"] <= 1 and load["queued_requests"] == 0
    # Two students asking at once: some forwards answered requests of both.
    assert load["forwards"] < load["served_requests"]


def post(url: str, body: bytes, token: str | None = TOKEN, *, path: str = ANSWER_PATH) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def a_request(rows: int = 2, length: int = 16, transport: str = "topk") -> AnswerRequest:
    ids = torch.randint(0, 262, (rows, length))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "position_ids": torch.arange(length).repeat(rows, 1),
             "attention_mask": torch.ones(rows, length, dtype=torch.int64)}
    settings = {"transport": transport, "with_label_log_probs": False, "vocab_size": 262, "seed": 0, "topk": 8,
                "topk_tail_samples": 4, "topk_encoding": "exact", "temperature": 2.0, "ignore_index": -100,
                "hidden_layers": [], "cross_tokenizer_loss": None}
    return AnswerRequest(batch, settings)


def test_a_wrong_or_missing_token_gets_401_and_no_answer(served):
    body = a_request().to_bytes()
    for token in ("not-the-token", None):
        status, answer = post(served["url"], body, token)
        assert status == 401 and b"bearer token" in answer and b"log_probs" not in answer
    status, answer = post(served["url"], body)
    assert status == 200 and wire.from_bytes(answer)["mode"] == "topk"


def malformed_bodies(count: int) -> list[bytes]:
    """Random bytes, cut and flipped requests, and well-formed byte strings of wrong requests."""
    rng, good = random.Random(0), a_request().to_bytes()
    bodies = [b"", b"{}", good[:7], good[:-1], good + b"\0"]
    wrong = [a_request(transport="groups"), a_request(rows=0), a_request(length=70000)]
    bodies += [request.to_bytes() for request in wrong]
    request = a_request()
    request.batch["input_ids"][0, 0] = 10**6
    bodies.append(request.to_bytes())
    request = a_request()
    bodies.append(wire.to_bytes({"batch": request.batch, "settings": {**request.settings, "topk": -1}}))
    bodies.append(wire.to_bytes({"batch": {**request.batch, "labels": request.batch["labels"].float()},
                                 "settings": request.settings}))
    bodies.append(wire.to_bytes({"batch": request.batch}))
    while len(bodies) < count:
        kind = rng.randrange(3)
        if kind == 0:
            bodies.append(rng.randbytes(rng.randrange(1, 400)))
        else:
            flipped = bytearray(good)
            for _ in range(rng.randrange(1, 4)):  # kind 1: in the spec; 2: anywhere
                position = rng.randrange(8, 200) if kind == 1 else rng.randrange(len(flipped))
                flipped[position] ^= 1 << rng.randrange(8)
            bodies.append(bytes(flipped))
    return bodies[:count]


def test_malformed_bodies_get_a_4xx_each_and_the_server_keeps_serving(served):
    statuses = []
    for body in malformed_bodies(100):
        status, answer = post(served["url"], body)
        if status == 200:  # a flipped bit in the tensor bytes can still be a valid request
            wire.from_bytes(answer)
        else:
            assert 400 <= status < 500 and json.loads(answer)["error"], (status, answer)
        statuses.append(status)
    assert statuses.count(200) < 60 and 413 in statuses and 400 in statuses
    status, _ = post(served["url"], a_request().to_bytes())
    assert status == 200 and served["server"].health()["load"]["queued_requests"] == 0


def test_a_server_killed_and_started_again_costs_a_wait_not_the_run(tmp_path, in_job):
    config = server_config(tmp_path)
    port = free_port()
    path = write(config, tmp_path / "server.yaml")
    server = Server(path, port, tmp_path / "first.log")
    config = student(config, tmp_path, "student", server.url, TOPK)
    run = train(write(config, tmp_path / "student.yaml"))
    try:
        wait_for_metrics(config["logging"]["run_dir"], run)
        server.kill()
        server = Server(path, port, tmp_path / "second.log")
        finished(run)
        assert server.health()["load"]["served_requests"] > 0  # the run went on against the new server
    finally:
        server.stop()
    assert_same_curve(train_records(config), train_records(in_job["topk"]))


def test_over_tls_a_server_that_does_not_come_back_ends_the_run_naming_its_address(tmp_path):
    """HTTPS with a certificate the student trusts (SSL_CERT_FILE); the server killed for good: after
    `collective_timeout_s` of retries the run ends with one line naming the address, its checkpoints kept."""
    import trustme

    authority = trustme.CA()
    certificate = authority.issue_cert("127.0.0.1")
    certificate.private_key_and_cert_chain_pem.write_to_path(tmp_path / "server.pem")
    authority.cert_pem.write_to_path(tmp_path / "authority.pem")
    config = server_config(tmp_path)
    files = ("--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.pem"))
    server = Server(write(config, tmp_path / "server.yaml"), 0, tmp_path / "server.log", files)
    assert server.url.startswith("https://127.0.0.1:")
    config = student(config, tmp_path, "student", server.url, TOPK)
    config.update(collective_timeout_s=3, checkpoint={"enabled": True, "save_hf": False})
    config["step_scheduler"].update(max_steps=400, ckpt_every_steps=1)
    run = train(write(config, tmp_path / "student.yaml"), SSL_CERT_FILE=str(tmp_path / "authority.pem"))
    try:
        deadline = time.monotonic() + 120
        while not list(Path(config["logging"]["run_dir"], "checkpoints").glob("step_*")):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0]
            time.sleep(0.05)
    finally:
        server.kill()
    output, _ = run.communicate(timeout=120)
    assert run.returncode == 1
    assert (f"meshkd: error: rank 0: teacher_model.url: the served teacher at {server.url} did not answer for 3 s"
            in output), output
    assert "Traceback" not in output and "Unclosed" not in output, output
    assert list(Path(config["logging"]["run_dir"], "checkpoints").glob("step_*"))


def test_a_served_teacher_of_another_tokenizer_trains_the_in_job_curve_with_uld_and_gold(tmp_path):
    """The rows' teacher side travels in the request, the answer is per aligned group (a forward of its own)."""
    from tests.recipe.teacher.test_cross_tokenizer import cross_config

    config = cross_config(tmp_path, {"dp_size": 1}, {"dp_size": 1})
    server = Server(write(config, tmp_path / "server.yaml"), 0, tmp_path / "server.log")
    try:
        runs = {}
        for loss in ("uld", "gold"):
            runs[loss] = student(config, tmp_path, loss, server.url, {})
            runs[loss]["kd"]["cross_tokenizer"]["loss"] = loss
            runs[f"{loss}_in_job"] = in_job_config(runs[loss])
        results = run_world(1, [TrainWithToken(run, name=name) for name, run in runs.items()], timeout_s=60,
                            deadline_s=300)
        for name in runs:
            results.check(name)
    finally:
        server.stop()
    for loss in ("uld", "gold"):
        records = train_records(runs[loss])
        assert_same_curve(records, train_records(runs[f"{loss}_in_job"]))
        assert any(record.get("kd_loss", 0) > 0 for record in records)


def test_a_teacher_that_is_not_there_or_not_the_configs_is_refused_at_preflight(served, monkeypatch):
    config = copy.deepcopy(served["served_topk"])
    config["teacher_model"]["url"] = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServedTeacherError, match=r"teacher_model.url: no served teacher answers at http://127"):
        preflight(config_from_dict(config))
    config["teacher_model"]["url"] = served["url"]
    config["teacher_model"]["seed"] = 5
    with pytest.raises(ServedTeacherError, match="teacher_model.url: .* answered HTTP 401: a bearer token"):
        preflight(config_from_dict(config))
    monkeypatch.setenv(TOKEN_VARIABLE, TOKEN)
    with pytest.raises(ConfigError, match=r"teacher_model: the teacher served at .*\(teacher_model.seed: served 2, "):
        preflight(config_from_dict(config))
    config["teacher_model"]["seed"] = 2
    config["kd"]["hidden_states"] = {"pairs": [[0, 3]]}  # the served teacher has 3 decoder layers
    with pytest.raises(ConfigError, match=r"kd.hidden_states.pairs"):
        preflight(config_from_dict(config))


@pytest.mark.parametrize("change, message", [
    ({"teacher_model": {"api": "completions"}}, "kd.logits_transport: a completions server's prompt_logprobs"),
    ({"teacher_model": {"api": "vllm"}}, "teacher_model.api must be meshkd or completions"),
    ({"kd": {"cross_tokenizer": {}}}, "kd.cross_tokenizer.loss projection does not yet work with a served"),
    ({"teacher_model": {"url": "127.0.0.1:8100"}}, "teacher_model.url must be an http"),
    ({"model": {"url": "http://127.0.0.1:8100"}}, "model.url: the student is trained here"),
])
def test_a_served_teacher_config_that_cannot_work_is_refused_naming_the_key(tmp_path, change, message):
    config = student(server_config(tmp_path), tmp_path, "run", "http://127.0.0.1:8100", {})
    for section, values in change.items():
        config[section].update(values)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(config)


def in_job_config(config: dict) -> dict:
    """`config` with its teacher on the student's own ranks instead of at its url."""
    config = copy.deepcopy(config)
    for teacher in [config.get("teacher_model", {})] + [entry["model"] for entry in config.get("teachers") or []]:
        teacher.pop("url", None), teacher.pop("api", None)
    config.pop("separate_meshes", None), config.pop("teacher_distributed", None)
    config["logging"]["run_dir"] += "_in_job"
    return config


def layout_runs(served: dict, tmp: Path) -> dict[str, dict]:
    """Students of two ranks in each layout, of the served tp 2 teacher; on-policy; and a served teacher beside one
    on the student's ranks (`teachers`)."""
    base = served["served_topk"]
    runs = {}
    for name, layout in (("dp2", {"dp_size": 2}), ("tp2", {"dp_size": 1, "tp_size": 2}),
                         ("pp2", {"dp_size": 1, "pp_size": 2})):
        runs[name] = student(base, tmp, name, served["url"], {})
        runs[name]["distributed"] = layout
    runs["on_policy"] = student(base, tmp, "on_policy", served["url"], {
        "mode": "on_policy", "kd_ratio": 1.0, "divergence": "reverse_kl", "logits_transport": "full",
        "generation": {"max_new_tokens": 8, "prompt_tokens": 8}})
    runs["on_policy"]["distributed"] = {"dp_size": 2}
    runs["hidden_states"] = student(base, tmp, "hidden_states", served["url"], {
        "hidden_states": {"pairs": [[0, 0], [1, 2]], "loss": "cosine", "weight": 1.0}})
    runs["hidden_states"]["distributed"] = {"dp_size": 2}
    runs["completions"] = student(base, tmp, "completions", served["url"], COMPLETIONS)
    runs["completions"]["teacher_model"]["api"] = "completions"
    runs["completions"]["distributed"] = {"dp_size": 2}
    teachers = student(base, tmp, "teachers", served["url"], {})
    model = teachers.pop("teacher_model")
    teachers.pop("separate_meshes"), teachers.pop("teacher_distributed")
    teachers["teachers"] = [{"name": "served", "model": model}, {"name": "here", "model": {
        **{key: value for key, value in model.items() if key != "url"}, "seed": 7}, "weight": 0.5}]
    teachers["distributed"] = {"dp_size": 2}
    runs["teachers"] = teachers
    return runs


class TrainWithToken(TrainRun):
    """`TrainRun` on a rank whose environment holds the server's token."""

    def __call__(self) -> None:
        os.environ[TOKEN_VARIABLE] = TOKEN
        try:
            super().__call__()
        finally:
            del os.environ[TOKEN_VARIABLE]


@pytest.fixture(scope="module")
def layouts(served, tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """name -> (the run with the served teacher, the same run with it on the student's ranks), in one world."""
    runs = {name: (config, in_job_config(config)) for name, config in layout_runs(
        served, tmp_path_factory.mktemp("layouts")).items()}
    checks = [TrainWithToken(config, name=f"{name}_{side}") for name, pair in runs.items()
              for side, config in zip(("served", "in_job"), pair)]
    results = run_world(2, checks, timeout_s=60, deadline_s=400)
    for check in checks:
        results.check(check.__name__)
    return runs


@pytest.mark.parametrize("name", ["dp2", "tp2", "pp2", "teachers", "completions", "hidden_states"])
def test_every_student_layout_and_a_mix_of_teachers_follow_the_in_job_curve(layouts, name):
    served_run, in_job = layouts[name]
    records = train_records(served_run)
    assert_same_curve(records, train_records(in_job))
    assert any(record.get("kd_loss", 0) > 0 for record in records)


def test_on_policy_distillation_from_a_served_teacher_follows_the_in_job_curve(layouts):
    """Within the tolerance of on-policy layouts (`test_on_policy`: relative 1e-4), or 1e-6: the student's
    completions follow its weights, which the teacher's last bits (tp 2 served, one rank in the job) move apart
    step by step."""
    records, expected = (train_records(config) for config in layouts["on_policy"])
    assert curve(records)[:3] == pytest.approx(curve(expected)[:3], rel=1e-5)
    assert curve(records) == pytest.approx(curve(expected), rel=1e-4, abs=1e-6)
    generated = [record["generated_tokens"] for record in records if record["kind"] == "train"]
    assert generated == [record["generated_tokens"] for record in expected if record["kind"] == "train"]
    assert sum(generated) > 0


def packed_rows() -> dict[str, torch.Tensor]:
    """Two rows of 16 tokens: three documents and padding, then one document."""
    documents = torch.tensor([[1] * 5 + [2] * 6 + [3] * 3 + [0] * 2, [1] * 16])
    ids = torch.randint(0, 262, (2, 16))
    labels = ids.roll(-1, 1).masked_fill(documents != documents.roll(-1, 1), -100).masked_fill(documents == 0, -100)
    labels[:, -1] = -100
    positions = torch.stack([torch.cat([torch.arange(5), torch.arange(6), torch.arange(3), torch.zeros(2).long()]),
                             torch.arange(16)])
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "attention_mask": documents}


def test_the_completions_client_on_the_servers_subset_equals_the_native_top_k(served, monkeypatch):
    """vLLM's fields (`prompt_logprobs` of token-id prompts) against `meshkd serve-teacher`'s subset of them: the same
    top k, rest and label log-probabilities as the native answer where a loss reads them."""
    monkeypatch.setenv(TOKEN_VARIABLE, TOKEN)
    settings = {"vocab_size": 262, "seed": 0, "topk": 8, "topk_tail_samples": 0, "topk_encoding": "exact",
                "temperature": 1.0,
                "ignore_index": -100, "hidden_layers": [], "cross_tokenizer_loss": None}
    batch = packed_rows()
    native = ServedTeacher(served["url"], settings=settings, device=torch.device("cpu"))
    client = CompletionsTeacher(served["url"], settings=settings, device=torch.device("cpu"))
    try:
        expected = native.request(batch, "topk", with_label_log_probs=True)
        answer = client.request(batch, "topk", with_label_log_probs=True)
    finally:
        native.close(), client.close()
    counted = batch["labels"] != -100
    assert counted.sum() == 4 + 5 + 2 + 15
    assert torch.equal(answer["indices"][counted], expected["indices"][counted])
    for key in ("log_probs", "tail_log_prob", "label_log_probs"):
        torch.testing.assert_close(answer[key][counted], expected[key][counted], rtol=1e-5, atol=1e-6)


def test_a_cache_written_from_a_served_teacher_trains_the_served_curve(served, tmp_path):
    """`meshkd cache-teacher` asks the server (one writer process, no teacher rank), then a run reads the cache
    and trains as the run that asked the server did (`test_teacher_cache`'s comparison: 1e-6, the gradient norm
    too, but for the held-out figures of the teacher's distribution, which a cache does not hold)."""
    config = copy.deepcopy(served["served_topk"])
    config["kd"]["teacher_cache"] = str(tmp_path / "cache")
    config["logging"]["run_dir"] = str(tmp_path / "from_cache")
    command = [sys.executable, "-m", "meshkd", "cache-teacher", str(write(config, tmp_path / "cache.yaml"))]
    written = subprocess.run(command, capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, **{TOKEN_VARIABLE: TOKEN}))
    assert written.returncode == 0, written.stdout + written.stderr
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["teacher"] == served["health"]["teacher"]
    results = run_world(1, [TrainRun(config)], timeout_s=60, deadline_s=300)  # no server asked: no token
    results.check("train")
    assert_same_cached_curve(train_records(config), train_records(served["served_topk"]))


def test_a_completions_request_beyond_the_subset_is_refused_naming_the_field(served):
    for body, field in (({"prompt": "text", "prompt_logprobs": 2}, "prompt"), ({"prompt": [1, 2]}, "prompt_logprobs"),
                        ({"prompt": [1, 2], "prompt_logprobs": 2, "max_tokens": 5}, "max_tokens")):
        status, answer = post(served["url"], json.dumps(body).encode(), path="/v1/completions")
        assert status == 400 and json.loads(answer)["error"].startswith(field), answer


def test_sigterm_drains_the_server_and_every_rank_exits_cleanly(served):
    """The module's last test of the shared server: like `meshkd train`, a stop every rank obeyed is 128 + the
    signal's number."""
    assert served["server"].stop() == 128 + signal.SIGTERM
    log = served["server"].log.read_text()
    assert "answering the 0 queued request(s), then stopping" in log and "ended with" not in log, log


def test_the_example_serves_its_teacher_on_the_ranks_of_its_layout_and_caches_from_it_with_one_writer():
    from meshkd.commands import _teacher_world_size
    from meshkd.recipe.settings.config_loading import load_config

    config = load_config(str(Path(__file__).parents[3] / "examples" / "tiny_served.yaml"), [])
    teacher = config.teacher_named()
    assert _teacher_world_size(config, teacher, None) == 2  # teacher_distributed: tp 2, though it names its url
    assert _teacher_world_size(config, teacher, None, asks_server=True) == 1

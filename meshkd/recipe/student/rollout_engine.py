"""On-policy completions drawn by a running vLLM server whose weights follow the student's (`kd.generation.engine`).

- Sampling (`ServerSampler`, a `meshkd.recipe.student.on_policy.Sampler`): one `/v1/completions` request a row, the
  prompt as token ids, the `kd.generation` settings and the row's own seed (`row_seed`), `ignore_eos` with the stop
  tokens as `stop_token_ids`, the completion's token ids asked back (`return_token_ids`): nothing is tokenized
  again. The requests of a rank go together (`max_concurrent_requests` in flight), so the server batches them.
  Every data-parallel rank sends its own prompts.
- Weight sync (`WeightSync`): every `sync_every` optimizer steps the student's full weights are gathered as the HF
  export gathers them (FSDP2 and tensor-parallel shards; a LoRA student's adapters merged), written by the
  student's first rank as safetensors with config.json to `weights_dir`, and reloaded in place by
  `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}` (a server started with
  VLLM_SERVER_DEV_MODE=1). The other ranks wait at the group's agreement, so no rank samples from weights being
  replaced. The first step a process trains always syncs: the server's weights are then the run's, also on resume.
- One step ahead (`Rollouts`, with `max_staleness` >= 1): once step n's completions are in and the weights synced,
  step n + 1's requests go out from a background thread while step n's teacher answers and update run; step n + 1
  waits only for what is not back yet. The staleness of a step's completions is the number of optimizer steps
  between the weights that drew them and the step's own (0: synchronous, every completion from the current
  weights, as `generate`). Per step: `rollout_staleness`, `rollout_wait_s` (time the step waited for its
  completions) and `weight_sync_s`.
- Failures: a server that refuses or does not answer ends the run with one line naming `kd.generation.engine.url`
  and the address (`RolloutEngineError`); the ranks agree on it first, so none is left in a collective.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshkd.core.agreement import first_failure, group_device
from meshkd.recipe.common.metrics import is_logging_rank
from meshkd.recipe.modeling import checkpoint as ckpt
from meshkd.recipe.modeling.adapters import export_adapters
from meshkd.recipe.modeling.models import resolve_dtype
from meshkd.recipe.student.on_policy import SamplingSettings

URL_KEY = "kd.generation.engine.url"
COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
RELOAD_PATH = "/collective_rpc"


class RolloutEngineError(ConnectionError):
    """The rollout server refused a request, answered something unreadable, or did not answer."""


class VLLMServer:
    """The few calls meshkd makes of a vLLM OpenAI-compatible server: its models, a sampled completion, the
    log-probabilities of a text, and a reload of its weights from a directory."""

    def __init__(self, url: str, *, model: str | None = None, timeout_s: float = 600.0) -> None:
        self.url, self.timeout_s, self._model = url.rstrip("/"), timeout_s, model

    def call(self, path: str, body: dict | None = None, *, timeout_s: float | None = None) -> Any:
        """`GET path` (no body) or `POST path` with a JSON body; the decoded JSON answer.

        Raises RolloutEngineError naming the key and the address, with the server's own message on an HTTP error."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                text = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace").strip()[:500]
            raise RolloutEngineError(f"{URL_KEY}: the vLLM server at {self.url} answered {path} with HTTP "
                                     f"{error.code}: {detail}") from None
        except (OSError, TimeoutError) as error:
            reason = getattr(error, "reason", None) or error
            raise RolloutEngineError(f"{URL_KEY}: the vLLM server at {self.url} did not answer {path}: "
                                     f"{reason}") from None
        try:
            return json.loads(text) if text else None
        except ValueError:
            raise RolloutEngineError(f"{URL_KEY}: the vLLM server at {self.url} answered {path} with something "
                                     f"that is not JSON: {text[:200]!r}") from None

    def models(self) -> list[dict]:
        """The entries of `GET /v1/models` (`id`, `root`, `max_model_len`, ...)."""
        return self.call(MODELS_PATH, timeout_s=min(self.timeout_s, 30.0))["data"]

    @functools.cached_property
    def model(self) -> str:
        """The `model` the requests name: the configured one, else the server's first."""
        return self._model or self.models()[0]["id"]

    def complete(self, prompt: list[int], *, settings: SamplingSettings, seed: int) -> list[int]:
        """The token ids of one completion of `prompt`, drawn with `seed`: up to `max_new_tokens`, ending at and
        including the first stop token."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": settings.max_new_tokens,
                "temperature": settings.temperature, "top_p": settings.top_p, "seed": seed,
                # The server's own end of text does not stop a completion; the run's stop tokens do.
                "ignore_eos": True, "stop_token_ids": list(settings.stop_tokens), "return_token_ids": True,
                "skip_special_tokens": False}
        choice = self.call(COMPLETIONS_PATH, body)["choices"][0]
        tokens = choice.get("token_ids")
        if tokens is None:
            raise RolloutEngineError(f"{URL_KEY}: the vLLM server at {self.url} returned no token_ids (a vLLM "
                                     f"without return_token_ids? meshkd is tested with vLLM 0.32)")
        return list(tokens)

    def prompt_logprobs(self, tokens: list[int]) -> list[float]:
        """log p(tokens[j] | tokens[:j]) for j = 1 .. len - 1 (vLLM's `prompt_logprobs`), e.g. to compare the
        server's weights with the student's."""
        body = {"model": self.model, "prompt": tokens, "max_tokens": 1, "prompt_logprobs": 1, "temperature": 0.0}
        entries = self.call(COMPLETIONS_PATH, body)["choices"][0]["prompt_logprobs"]
        return [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], tokens[1:])]

    def reload(self, weights_dir: Path) -> None:
        """Reload every weight in place from `weights_dir`'s safetensors (same architecture)."""
        self.call(RELOAD_PATH, {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}})


class ServerSampler:
    """A `Sampler` whose completions the server draws: one request a row, `max_concurrent_requests` at a time.

    `submit` sends them from a background thread and returns at once (one step ahead); `sample` waits."""

    def __init__(self, server: VLLMServer, settings: SamplingSettings, *, max_concurrent_requests: int) -> None:
        self.server, self.settings = server, settings
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrent_requests, thread_name_prefix="rollouts")

    def submit(self, prompts: list[torch.Tensor], seeds: list[int]) -> list[concurrent.futures.Future]:
        """One future a row: its completion's token ids."""
        return [self._pool.submit(self.server.complete, prompt.tolist(), settings=self.settings, seed=seed)
                for prompt, seed in zip(prompts, seeds)]

    def sample(self, prompts: list[torch.Tensor], seeds: list[int]) -> list[torch.Tensor]:
        """One completion per prompt (`Sampler.sample`)."""
        return [torch.tensor(future.result(), dtype=torch.int64) for future in self.submit(prompts, seeds)]

    def close(self) -> None:
        """Stop taking requests; those in flight end on their own (their answers dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class WeightSync:
    """Writes the student's full weights for the server and has it reload them; every student rank calls.

    Args:
        model: the laid-out student (FSDP2, tensor-parallel or DDP).
        config: the recipe config (`kd.generation.engine`, `model.dtype`, `peft`).
        server: the rollout server.
        weights_dir: the directory written (the server must read the same path).
        group: the student ranks' group (None: the world).
    """

    def __init__(self, model: torch.nn.Module, config, server: VLLMServer, *, weights_dir: Path,
                 group: dist.ProcessGroup | None) -> None:
        engine = config.kd.generation.engine
        self.model, self.server, self.weights_dir, self.group = model, server, weights_dir, group
        self.dtype = resolve_dtype(engine.dtype or config.model.dtype)
        self.merge: Callable[[dict], dict] | None = None
        if config.peft is not None:
            self.merge = functools.partial(_merged, config=getattr(model, "module", model).config,
                                           section=config.peft, base_path=config.model.path)

    def __call__(self) -> None:
        # Gathered to the first student rank and written there (export_hf ends with the group's barrier); only
        # that rank asks for the reload; the agreement after it is the others' wait.
        ckpt.export_hf(self.weights_dir, model=self.model, pipeline=None, tokenizer=None, group=self.group,
                       dtype=self.dtype, merge_adapters=self.merge)
        problem = None
        if is_logging_rank():
            try:
                self.server.reload(self.weights_dir.resolve())
            except RolloutEngineError as error:
                problem = str(error)
        agree(problem, self.group)


def _merged(state_dict: dict, *, config, section, base_path: str | None) -> dict:
    """A LoRA student's weights with its adapters merged (its adapter files written to a directory dropped after)."""
    with tempfile.TemporaryDirectory(prefix="meshkd-adapters-") as adapters:
        return export_adapters(state_dict, config=config, section=section, base_path=base_path,
                               adapter_dir=Path(adapters))


def agree(problem: str | None, group: dist.ProcessGroup | None) -> None:
    """Raise RolloutEngineError on every student rank when one had `problem` (the lowest rank's message)."""
    if not dist.is_initialized():
        failure = None if problem is None else (0, problem)
    else:
        failure = first_failure(problem, group, device=group_device(group)) if dist.get_world_size(group) > 1 else (
            None if problem is None else (dist.get_rank(), problem))
    if failure is not None:
        raise RolloutEngineError(failure[1])


@dataclass
class Drawn:
    """A step's completions (by micro-batch index, one token tensor a row) and how they were drawn."""

    completions: dict[int, list[torch.Tensor]]
    staleness: int  # optimizer steps between the weights that drew them and the step's own
    wait_s: float  # time the step waited for them
    sync_s: float  # time the step spent syncing the weights (0 when it did not)


class Rollouts:
    """A run's completions from the server, synchronous or one step ahead (`kd.generation.engine`).

    Args:
        sampler: sends the requests.
        sync: the weight sync (every student rank calls it at the same steps).
        sync_every: optimizer steps between syncs.
        ahead: draw step n + 1's completions while step n trains (max_staleness >= 1).
        group: the student ranks' group, on which a failure is agreed.
    """

    def __init__(self, sampler: ServerSampler, sync: Callable[[], None], *, sync_every: int, ahead: bool,
                 group: dist.ProcessGroup | None) -> None:
        self.sampler, self.sync, self.sync_every, self.ahead, self.group = sampler, sync, sync_every, ahead, group
        self.version: int | None = None  # the optimizer step whose weights the server holds; None: not synced yet
        self._pending: tuple[int, int, dict[int, list[concurrent.futures.Future]]] | None = None

    def draw(self, step: int, rows: dict[int, tuple[list[torch.Tensor], list[int]]],
             upcoming: Callable[[], dict[int, tuple[list[torch.Tensor], list[int]]] | None]) -> Drawn:
        """Step `step`'s completions of `rows` (micro-batch index -> (prompts, seeds)); with `ahead`, sends those
        of the next step (`upcoming()`: its rows, None after the last step) before returning."""
        started = time.perf_counter()
        futures, version = None, None
        if self._pending is not None and self._pending[0] == step:
            _, version, futures = self._pending
            self._pending = None
            completions, problem = _results(futures)
            agree(problem, self.group)
        wait_s = time.perf_counter() - started
        sync_s = 0.0
        if self.version is None or step % self.sync_every == 0:
            if self.version != step:
                began = time.perf_counter()
                self.sync()
                self.version, sync_s = step, time.perf_counter() - began
        if futures is None:  # synchronous, or the first step of this process
            began = time.perf_counter()
            version = self.version
            completions, problem = _results(self._send(rows))
            agree(problem, self.group)
            wait_s += time.perf_counter() - began
        if self.ahead:
            following = upcoming()
            if following is not None:
                self._pending = (step + 1, self.version, self._send(following))
        return Drawn(completions, staleness=step - version, wait_s=wait_s, sync_s=sync_s)

    def _send(self, rows: dict[int, tuple[list[torch.Tensor], list[int]]]) -> dict[int, list]:
        return {index: self.sampler.submit(prompts, seeds) for index, (prompts, seeds) in rows.items()}

    def close(self) -> None:
        """Drop what was sent ahead and stop the sender."""
        self._pending = None
        self.sampler.close()


def _results(futures: dict[int, list[concurrent.futures.Future]]) -> tuple[dict[int, list[torch.Tensor]], str | None]:
    """(each micro-batch's completions, None) or ({}, the first failure's message)."""
    try:
        return ({index: [torch.tensor(future.result(), dtype=torch.int64) for future in row]
                 for index, row in futures.items()}, None)
    except RolloutEngineError as error:
        return {}, str(error)


def check_server(engine, *, architecture: str, vocab_rows: int, sequence_length: int) -> None:
    """Preflight of `kd.generation.engine`: the server answers, serves a model of the student's `architecture` and
    `vocab_rows` token ids with room for `sequence_length` tokens, and has its reload endpoint (dev mode).

    The architecture is read from the config.json of the directory the server serves, where this machine can read
    it (the server reads the weights this run writes, so it usually can); the vocabulary is probed: the last id
    taken, the next refused. Raises RolloutEngineError naming the key and the address."""
    server = VLLMServer(engine.url, model=engine.served_model, timeout_s=min(engine.timeout_s, 60.0))
    where = f"{URL_KEY}: the vLLM server at {server.url}"
    models = server.models()
    served = {entry["id"]: entry for entry in models}
    if engine.served_model is not None and engine.served_model not in served:
        raise RolloutEngineError(f"{where} serves {sorted(served)}, not kd.generation.engine.served_model "
                                 f"{engine.served_model!r}")
    entry = served[server.model]
    if entry.get("max_model_len") is not None and entry["max_model_len"] < sequence_length:
        raise RolloutEngineError(f"{where} takes {entry['max_model_len']} tokens a sequence (--max-model-len), fewer "
                                 f"than step_scheduler.sequence_length {sequence_length}")
    try:
        info = server.call("/server_info?config_format=json")
    except RolloutEngineError as error:
        if "HTTP 404" not in str(error):
            raise
        raise RolloutEngineError(f"{where} has no /server_info nor /collective_rpc: start it with "
                                 f"VLLM_SERVER_DEV_MODE=1 so that it can reload the student's weights") from None
    root = Path(str(info["vllm_config"]["model_config"]["model"]))
    if (root / "config.json").is_file():
        served_config = json.loads((root / "config.json").read_text())
        if architecture not in (served_config.get("architectures") or [architecture]):
            raise RolloutEngineError(f"{where} serves {served_config.get('architectures')} ({root}), not the "
                                     f"student's {architecture}")
    for token, taken in ((vocab_rows - 1, True), (vocab_rows, False)):
        try:
            server.call(COMPLETIONS_PATH, {"model": server.model, "prompt": [token], "max_tokens": 1})
            answered = True
        except RolloutEngineError as error:
            if "HTTP 400" not in str(error):
                raise
            answered = False
        if answered != taken:
            raise RolloutEngineError(f"{where} {'refuses' if taken else 'takes'} token id {token}: its vocabulary "
                                     f"is not the student's {vocab_rows} rows")

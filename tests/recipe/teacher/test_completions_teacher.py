"""`CompletionsTeacher` against a completions server that behaves as vLLM does where it matters here: it refuses
a request with no prompt (400 "You must pass at least one prompt") and otherwise answers each prompt's
`prompt_logprobs`. A micro-batch with no prompt (no rows, or padding only) is answered without a request, with
placeholders of the micro-batch's shape; one with prompts is asked once.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from meshkd.recipe.teacher.completions_teacher import COMPLETIONS_PATH, CompletionsTeacher

K = 4
SETTINGS = {"vocab_size": 64, "seed": 0, "topk": K, "topk_tail_samples": 0, "topk_encoding": "exact",
            "temperature": 1.0, "ignore_index": -100, "hidden_layers": [], "cross_tokenizer_loss": None}


class VllmLike:
    """An aiohttp server on a thread of its own, on a free port: `posts` counts the requests it was sent."""

    def __init__(self) -> None:
        self.posts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)

    async def _start(self) -> str:
        from aiohttp import web

        app = web.Application()
        app.router.add_post(COMPLETIONS_PATH, self._completions)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _completions(self, request):
        from aiohttp import web

        self.posts += 1
        prompts = (await request.json())["prompt"]
        if not prompts:
            return web.json_response({"object": "error", "message": "You must pass at least one prompt"}, status=400)
        choices = [{"index": index, "prompt_logprobs": [None] + [
            {**{str(token): {"logprob": -1.0 - rank, "rank": rank + 1} for rank, token in enumerate(range(K))},
             str(prompt[column]): {"logprob": -3.0, "rank": None}} for column in range(1, len(prompt))]}
            for index, prompt in enumerate(prompts)]
        return web.json_response({"choices": choices})

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


@pytest.fixture
def vllm():
    server = VllmLike()
    teacher = CompletionsTeacher(server.url, settings=SETTINGS, device=torch.device("cpu"), wait_s=5.0)
    try:
        yield server, teacher
    finally:
        teacher.close()
        server.close()


def rows(count: int, length: int = 8, *, padding: bool = False) -> dict[str, torch.Tensor]:
    """`count` rows of one document each (or of padding only)."""
    ids = torch.randint(4, 64, (count, length))
    mask = torch.zeros(count, length, dtype=torch.int64) if padding else torch.ones(count, length, dtype=torch.int64)
    labels = ids.roll(-1, 1).masked_fill(mask == 0, -100)
    labels[:, -1] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(length).repeat(count, 1),
            "attention_mask": mask}


@pytest.mark.parametrize("batch", [rows(0), rows(2, padding=True)], ids=["no rows", "padding only"])
@pytest.mark.parametrize("transport", ["topk", "label_log_probs"])
def test_a_micro_batch_with_no_prompt_is_answered_without_a_request(vllm, batch, transport):
    server, teacher = vllm
    answer = teacher.request(batch, transport, with_label_log_probs=transport == "topk")
    assert server.posts == 0
    shape = tuple(batch["input_ids"].shape)
    if transport == "label_log_probs":
        assert answer["mode"] == "label_log_probs" and answer["log_probs"].shape == shape
        return
    assert answer["mode"] == "topk" and answer["indices"].shape == answer["log_probs"].shape == (*shape, K)
    assert answer["tail_log_prob"].shape == answer["label_log_probs"].shape == shape


def test_a_micro_batch_with_prompts_is_asked_once_and_read(vllm):
    server, teacher = vllm
    batch = rows(2)
    answer = teacher.request(batch, "topk", with_label_log_probs=True)
    assert server.posts == 1
    counted = batch["labels"] != -100
    assert torch.equal(answer["indices"][counted], torch.arange(K, dtype=torch.int32).expand(int(counted.sum()), K))
    assert torch.all(answer["label_log_probs"][counted] == -3.0)

"""`ServedTeacher`'s two copies, against a real aiohttp server in the test that records each body and answers a
fixed wire answer: the rows are sent from the host copy the caller has (a batch on a device that cannot be copied
back, the meta device, is never read), the request's bytes the same as from the rows themselves; the answer
arrives equal, on the teacher's device, in one copy (`wire.from_bytes(..., device=...)`; pinned for a GPU).
"""

from __future__ import annotations

import asyncio
import threading

import torch

from meshkd.core import wire
from meshkd.recipe.teacher.served_protocol import ANSWER_PATH, AnswerRequest
from meshkd.recipe.teacher.served_teacher import ServedTeacher

SETTINGS = {"vocab_size": 64, "seed": 0, "topk": 4, "topk_tail_samples": 0, "topk_encoding": "exact",
            "temperature": 1.0, "ignore_index": -100, "hidden_layers": [], "cross_tokenizer_loss": None}
ANSWER = {"mode": "topk", "temperature": 1.0, "log_probs": torch.randn(2, 8, 4),
          "indices": torch.randint(0, 64, (2, 8, 4), dtype=torch.int32), "tail_log_prob": torch.randn(2, 8)}


class Recorder:
    """An aiohttp server on a thread of its own answering every POST with `ANSWER`; `bodies`: what it was sent."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)

    async def _start(self) -> str:
        from aiohttp import web

        async def answer(request):
            self.bodies.append(await request.read())
            return web.Response(body=wire.to_bytes(ANSWER), content_type="application/octet-stream")

        app = web.Application(client_max_size=1 << 24)
        app.router.add_post(ANSWER_PATH, answer)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def rows() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 8))
    return {"input_ids": ids, "labels": ids.roll(-1, 1), "position_ids": torch.arange(8).repeat(2, 1),
            "attention_mask": torch.ones(2, 8, dtype=torch.int64)}


def test_rows_go_from_the_host_copy_with_the_same_bytes_and_the_answer_arrives_equal():
    server = Recorder()
    teacher = ServedTeacher(server.url, settings=SETTINGS, device=torch.device("cpu"), wait_s=5.0)
    try:
        host = rows()
        on_device = {key: value.to("meta") for key, value in host.items()}  # never copied back: it cannot be
        answer = teacher.request(on_device, "topk", host_batch=host)
        from_rows = teacher.request(host, "topk")  # no host copy given: the batch's own rows
    finally:
        teacher.close()
        server.close()
    expected = AnswerRequest(host, {"transport": "topk", "with_label_log_probs": False, **SETTINGS}).to_bytes()
    assert server.bodies == [expected, expected]
    for got in (answer, from_rows):
        assert got.keys() == ANSWER.keys() and got["mode"] == "topk"
        for key in ("log_probs", "indices", "tail_log_prob"):
            assert torch.equal(got[key], ANSWER[key]) and got[key].device.type == "cpu"

"""The HTTP side of `meshkd serve-teacher`: rank 0's aiohttp server (`HttpServer`, on a thread of its own) and
the parsing of what it is sent (`served_protocol`'s paths, and the subset of the OpenAI-compatible completions
API that scores prompts). The ranks, the queue and the forwards are `meshkd.recipe.lifecycle.teacher_service`'s.

A request is checked here before it is queued (`parse_request`, `completion_prompts`): a bad one gets a 4xx and
the server goes on. A queued request's handler waits on its `Entry`'s future, which the serving thread resolves
(`HttpServer.resolve`) with the answer's bytes or the forward's error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import json
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from meshkd.core import wire
from meshkd.recipe.common.files import write_atomically
from meshkd.recipe.teacher.completions_teacher import COMPLETIONS_PATH, MODELS_PATH
from meshkd.recipe.teacher.served_protocol import (
    ANSWER_PATH,
    HEAD_PATH,
    HEALTH_PATH,
    AnswerRequest,
    TooLarge,
    bearer_token,
    parse_request,
)
from meshkd.recipe.teacher.teacher_head import TeacherHead

if TYPE_CHECKING:
    from meshkd.recipe.lifecycle.teacher_service import TeacherService


@dataclass(eq=False)  # each entry is itself: a queue removes the ones it took by identity
class Entry:
    """A queued request and where its answer goes (a future of the HTTP thread's loop)."""

    request: AnswerRequest
    digest: str
    future: asyncio.Future


class HttpServer:
    """The HTTP side of rank 0: an aiohttp application on a thread of its own (`served_protocol`'s paths)."""

    def __init__(self, service: TeacherService) -> None:
        self.service, self.options = service, service.options
        # The largest body either POST path reads: four int64 columns of the most tokens a request may hold, and
        # the spec (a completions prompt's JSON takes fewer bytes a token than that).
        self.max_body = 4 * 8 * self.options.max_request_tokens + (64 << 10)
        self.draining = False
        self._heads: dict[int, bytes] = {}  # the teacher's output layer, by vocabulary size (`_head`)
        self._token = bearer_token()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="meshkd-serve-teacher", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result()
        print(f"meshkd serve-teacher: serving {self.service.model_name} at {self.url}", flush=True)
        if self.options.address_file:
            write_atomically(Path(self.options.address_file), self.url.encode())

    async def _listen(self) -> str:
        from aiohttp import web

        options = self.options

        @web.middleware
        async def authorize(request, handler):
            if not self._authorized(request):
                return self._error(401, "a bearer token is required (MESHKD_TEACHER_TOKEN), and this one is not it")
            return await handler(request)

        app = web.Application(client_max_size=self.max_body, middlewares=[authorize])
        app.router.add_get(HEALTH_PATH, self._health)
        app.router.add_post(ANSWER_PATH, self._answer)
        app.router.add_post(COMPLETIONS_PATH, self._completions)
        app.router.add_get(MODELS_PATH, self._models)
        app.router.add_get(HEAD_PATH, self._head)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        context = None
        if options.tls_cert:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(options.tls_cert, options.tls_key)
        site = web.TCPSite(self._runner, options.host, options.port, ssl_context=context)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        host = f"[{options.host}]" if ":" in options.host else options.host
        return f"{'https' if context else 'http'}://{host}:{port}"

    def close(self) -> None:
        """Stop listening (a handler still waiting gets its connection closed) and end the thread."""
        done = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        concurrent.futures.wait([done], timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def resolve(self, future: asyncio.Future, result: tuple[int, bytes | str]) -> None:
        """From the serving thread: give a waiting handler its answer (dropped if its client went away)."""
        def give() -> None:
            if not future.done():
                future.set_result(result)
        self._loop.call_soon_threadsafe(give)

    @staticmethod
    def _error(status: int, message: str):
        from aiohttp import web

        return web.json_response({"error": message}, status=status)

    async def _body(self, request) -> bytes:
        """The request's body, decoded as its Content-Encoding says; Refused (413 or 400) for one this server does
        not read. A declared length above the limit is refused before a byte is read: the client may never send
        the bytes it declared, and a handler waiting for them would answer nothing."""
        from aiohttp import web

        declared = request.content_length
        if declared is not None and declared > self.max_body:
            raise Refused(413, f"the body declares {declared} bytes, more than this server's limit of "
                               f"{self.max_body} (--max-request-tokens {self.options.max_request_tokens})")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge as error:
            raise Refused(413, f"the body is larger than this server's limit: {error.text}") from None
        except web.RequestPayloadError as error:  # a gzip / deflate / br body that does not decode, or cut short
            # The connection's parser stops at a body it cannot decode, so no more of it ever arrives; marked at
            # its end, the body is not read on after the answer (aiohttp reads an unread body for a while before
            # it closes, and would log this error again with its traceback).
            request.content.feed_eof()
            raise Refused(400, f"the body could not be read as its headers describe it ({error.__cause__ or error}); "
                               "send it plain or in a Content-Encoding that decodes") from None

    def _refusal(self, error: Refused | ValueError):
        """The 4xx of a request that is not answered: a refused body's (the connection closed after it, since what is
        left of the body is unread), 413 for one over the limits once parsed, else 400."""
        if isinstance(error, Refused):
            response = self._error(error.status, str(error))
            response.force_close()
            return response
        return self._error(413 if isinstance(error, TooLarge) else 400, str(error))

    def _authorized(self, request) -> bool:
        if self._token is None:
            return True
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self._token}".encode())

    async def _health(self, request):
        from aiohttp import web

        return web.json_response(asdict(self.service.health) | {"load": self.service.load(),
                                                                "draining": self.draining})

    async def _answer(self, request):
        from aiohttp import web

        if self.draining:
            return self._error(503, "this teacher is stopping; ask again (another server may take its address)")
        try:
            body = await self._body(request)
            parsed = parse_request(body, vocab_rows=self.service.vocab_rows, num_layers=self.service.num_layers,
                                   max_tokens=self.options.max_request_tokens)
        except (Refused, ValueError) as error:
            return self._refusal(error)
        future = self._loop.create_future()
        self.service.queue.put(Entry(parsed, hashlib.sha256(body).hexdigest(), future))
        status, result = await future
        if status != 200:
            return self._error(status, result)
        return web.Response(body=result, content_type="application/octet-stream")

    async def _head(self, request):
        """The teacher's output layer over the vocabulary a student's hidden answers cover (`HEAD_PATH`), read once
        a vocabulary size (from its checkpoint: off the event loop)."""
        from aiohttp import web

        try:
            vocab_size = int(request.query.get("vocab_size", ""))
            if not 1 <= vocab_size <= self.service.vocab_rows:
                raise ValueError(f"vocab_size must be in [1, {self.service.vocab_rows}], got {vocab_size}")
        except ValueError as error:
            return self._error(400, f"{HEAD_PATH}?vocab_size=N: {error}")
        if vocab_size not in self._heads:
            self._heads[vocab_size] = await asyncio.get_running_loop().run_in_executor(
                None, lambda: TeacherHead.of(self.service.teacher.model, vocab_size=vocab_size).to_bytes())
        return web.Response(body=self._heads[vocab_size], content_type="application/octet-stream")

    # ---- the subset of the OpenAI-compatible completions API that scores prompts (vLLM's prompt_logprobs) ----

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.service.model_name, "object": "model",
                                                              "owned_by": "meshkd"}]})

    async def _completions(self, request):
        """`completions_teacher`'s request: the top `prompt_logprobs` of every prompt position (and the prompt token
        itself), one greedy token with `max_tokens: 1`; nothing else of the API (400 naming the field)."""
        from aiohttp import web

        if self.draining:
            return self._error(503, "this teacher is stopping; ask again (another server may take its address)")
        try:
            body = json_body(await self._body(request))
            prompts, k = completion_prompts(body, self.service.vocab_rows)
            requests = [parse_request(prompt_request(prompt, k, self.service.vocab_rows).to_bytes(),
                                      vocab_rows=self.service.vocab_rows, num_layers=self.service.num_layers,
                                      max_tokens=self.options.max_request_tokens) for prompt in prompts]
        except (Refused, ValueError) as error:
            return self._refusal(error)
        futures = []
        for parsed in requests:
            futures.append(self._loop.create_future())
            self.service.queue.put(Entry(parsed, hashlib.sha256(parsed.to_bytes()).hexdigest(), futures[-1]))
        answers = []
        for future in futures:
            status, result = await future
            if status != 200:
                return self._error(status, result)
            answers.append(wire.from_bytes(result))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choices = [completion_choice(index, prompt, answer, body.get("max_tokens", 16), self._token_text(as_ids))
                   for index, (prompt, answer) in enumerate(zip(prompts, answers))]
        tokens = sum(len(prompt) for prompt in prompts)
        generated = sum(len(choice["token_ids"]) for choice in choices)
        return web.json_response({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                                  "created": int(time.time()), "model": self.service.model_name, "choices": choices,
                                  "usage": {"prompt_tokens": tokens, "completion_tokens": generated,
                                            "total_tokens": tokens + generated}})

    def _token_text(self, as_ids: bool):
        tokenizer = self.service.tokenizer
        return (lambda token: f"token_id:{token}") if as_ids else (lambda token: tokenizer.decode([token]))


class Refused(Exception):
    """A request body the server does not read (a 4xx): its HTTP status and the message the client gets."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def json_body(body: bytes):
    """The JSON value of a request body; ValueError for one that is not JSON, nested too deep included (json's
    parser recurses once per level, and Python's recursion limit would end a deeper one)."""
    try:
        return json.loads(body)
    except RecursionError:
        raise ValueError("the body is JSON nested too deep to read") from None
    except ValueError as error:  # UnicodeDecodeError and JSONDecodeError among them
        raise ValueError(f"the body is not JSON: {error}") from None


def completion_prompts(body, vocab_rows: int) -> tuple[list[list[int]], int]:
    """The prompts (token ids) and k of a completions request this server answers; ValueError naming the field."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    prompt, k = body.get("prompt"), body.get("prompt_logprobs")
    prompts = [prompt] if isinstance(prompt, list) and all(type(token) is int for token in prompt) else prompt
    if not isinstance(prompts, list) or not prompts or not all(
            isinstance(ids, list) and ids and all(type(token) is int for token in ids) for ids in prompts):
        raise ValueError("prompt: give token ids (a list of integers, or a list of such lists); this server does "
                         "not tokenize text")
    if type(k) is not int or not 1 <= k <= vocab_rows:
        raise ValueError(f"prompt_logprobs: give the number of entries a position, 1..{vocab_rows}; this server "
                         "scores prompts")
    if body.get("max_tokens", 16) not in (0, 1) or body.get("n", 1) != 1 or body.get("stream"):
        raise ValueError("max_tokens: this server scores prompts and generates at most one token (max_tokens 0 or "
                         "1, n 1, no stream)")
    return prompts, k


def prompt_request(prompt: list[int], k: int, vocab_rows: int) -> AnswerRequest:
    """The native request of one prompt: one row, one document, its top k and each next token's log-probability."""
    ids = torch.tensor([prompt], dtype=torch.int64)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(ids.shape[1])[None],
             "attention_mask": torch.ones_like(ids)}
    return AnswerRequest(batch, {"transport": "topk", "with_label_log_probs": True, "vocab_size": vocab_rows, "seed": 0,
                                 "topk": k, "topk_tail_samples": 0, "topk_encoding": "exact", "temperature": 1.0,
                                 "ignore_index": -100, "hidden_layers": [], "cross_tokenizer_loss": None})


def completion_choice(index: int, prompt: list[int], answer: dict, max_tokens: int, text: Callable) -> dict:
    """One `CompletionResponseChoice` (vLLM's fields) from the native answer to `prompt_request`; `text`: a
    token's `decoded_token`."""
    log_probs, indices = answer["log_probs"][0].tolist(), answer["indices"][0].tolist()
    labels = answer["label_log_probs"][0].tolist()
    entries = [None]
    for column in range(1, len(prompt)):
        entry = {str(token): {"logprob": value, "rank": rank + 1, "decoded_token": text(token)}
                 for rank, (token, value) in enumerate(zip(indices[column - 1], log_probs[column - 1]))}
        # The prompt token's own entry, which vLLM always adds; its rank is known here only within the top k.
        entry.setdefault(str(prompt[column]), {"logprob": labels[column - 1], "rank": None,
                                               "decoded_token": text(prompt[column])})
        entries.append(entry)
    generated = [indices[-1][0]] if max_tokens == 1 else []
    return {"index": index, "text": "".join(text(token) for token in generated), "logprobs": None,
            "finish_reason": "length", "stop_reason": None, "token_ids": generated, "prompt_logprobs": entries,
            "prompt_token_ids": prompt}

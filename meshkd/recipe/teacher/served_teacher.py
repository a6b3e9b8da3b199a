"""A teacher served elsewhere (`meshkd serve-teacher`, `teacher_model.url`), asked over HTTP: a student's
`meshkd.core.teacher_protocol.TeacherSource`.

Design. `ServedTeacher` owns one event loop, on a thread of its own, with one aiohttp session; a request is a
coroutine on that loop and the caller only waits on its future, so several requests can be in flight at once:
`prefetch` asks for up to `depth` micro-batches beyond the one the caller trains on. Every student rank that
computes a loss asks for its own micro-batch (the ranks of one replica ask for the same rows; the server
computes identical requests once), other ranks ask nothing. A request that finds no server (refused, reset,
timed out, or 503 from a server that is draining) is retried with backoff, 0.25 s doubling to 4 s, until
`wait_s` (the run's `collective_timeout_s`) has passed since its first try: a server restarted meanwhile costs
a wait, and since an answer is a pure function of its request (`served_protocol`) the run's curve is the
same. After that the run ends with one line naming the address. A 4xx is the server refusing the request:
raised at once, with its message.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import datetime
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

import torch

from meshkd.core import wire
from meshkd.core.teacher_protocol import Batch, Encoded, TeacherFeed, TeacherRequest
from meshkd.recipe.teacher.served_protocol import ANSWER_PATH, HEALTH_PATH, AnswerRequest, auth_headers, request_keys

RETRY_FIRST_S, RETRY_MAX_S = 0.25, 4.0


class ServedTeacherError(ConnectionError):
    """A served teacher that refused a request, or did not answer within the wait."""


def health(url: str, *, path: str = HEALTH_PATH, label: str = "teacher_model.url", timeout_s: float = 10.0) -> dict:
    """The server's `GET path` report (`/health`); ServedTeacherError naming `label` and the address when there is
    none."""
    body = fetch(url, path, label=label, timeout_s=timeout_s)
    try:
        return json.loads(body)
    except ValueError:
        raise ServedTeacherError(f"{label}: the server at {url} answered {path} with no report: "
                                 f"{_message(body)}") from None


def fetch(url: str, path: str, *, label: str = "teacher_model.url", timeout_s: float = 60.0) -> bytes:
    """The body of the server's answer to `GET path`; ServedTeacherError naming `label` and the address when there
    is none."""
    request = urllib.request.Request(url.rstrip("/") + path, headers=auth_headers())
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as error:
        raise ServedTeacherError(f"{label}: the served teacher at {url} answered HTTP {error.code}: "
                                 f"{_message(error.read())}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise ServedTeacherError(f"{label}: no served teacher answers at {url} ({reason}); start it with "
                                 "`meshkd serve-teacher CONFIG`") from None


def host_rows(request: TeacherRequest) -> Batch:
    """The request's rows on the host: the caller's host copy where it has one, else the batch copied back."""
    if request.host_batch is not None:
        return request.host_batch
    return {key: value.cpu() for key, value in request.batch.items()}


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


class ServedTeacher:
    """The student side of a served teacher at `url`.

    Args:
        settings: what every request carries besides its rows and kind of answer
            (`meshkd.recipe.teacher.served_protocol.answer_settings`).
        device: where the answers' tensors go.
        receives: whether this rank computes a loss (asks at all); elsewhere answers are None.
        wait_s: how long a request is retried while no server answers.
        label: the config key errors name.
    """

    def __init__(self, url: str, *, settings: dict, device: torch.device, receives: bool = True,
                 wait_s: float = 600.0, label: str = "teacher_model.url") -> None:
        import aiohttp

        self.url, self.settings, self.device = url.rstrip("/"), settings, device
        self.receives, self.wait_s, self.label = receives, wait_s, label
        self.retries = 0  # requests sent again after no server answered
        self._aiohttp = aiohttp
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="meshkd-served-teacher", daemon=True)
        self._thread.start()
        self._session = self._submit(self._open()).result()
        atexit.register(self.close)  # a run that fails never closes its sources: the session still closes

    async def _open(self):
        return self._aiohttp.ClientSession(headers=auth_headers(), timeout=self._aiohttp.ClientTimeout(
            total=None, sock_connect=10))

    def _submit(self, coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def request(self, batch: Batch, logits_transport: str, *, host_batch: Batch | None = None,
                with_label_log_probs: bool = False) -> Encoded | None:
        if not self.receives:
            return None
        return self._answer(self._ask(TeacherRequest(batch, logits_transport, host_batch, with_label_log_probs)))

    def _ask(self, request: TeacherRequest) -> concurrent.futures.Future:
        """The future of the answer's body (what `_answer` reads). The rows are sent from the host copy the caller
        has, where it has one (no copy back from the device per micro-batch)."""
        rows = host_rows(request)
        body = AnswerRequest({key: rows[key] for key in request_keys(rows)},
                             {"transport": request.logits_transport,
                              "with_label_log_probs": request.with_label_log_probs, **self.settings}).to_bytes()
        return self._submit(self._post(ANSWER_PATH, body))

    async def _post(self, path: str, body: bytes | None = None, *, json_body: dict | None = None) -> bytes:
        """POST to `path` until a server answers (with retries, see the module docstring); the answer's bytes."""
        aiohttp, started, delay = self._aiohttp, time.monotonic(), RETRY_FIRST_S
        while True:
            try:
                async with self._session.post(self.url + path, data=body, json=json_body) as response:
                    payload = await response.read()
                    if response.status == 200:
                        return payload
                    if response.status < 500:
                        raise ServedTeacherError(f"{self.label}: the served teacher at {self.url} refused a request "
                                                 f"(HTTP {response.status}): {_message(payload)}")
                    last = f"HTTP {response.status}: {_message(payload)}"
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as error:
                last = str(error) or type(error).__name__
            if time.monotonic() - started + delay > self.wait_s:
                raise ServedTeacherError(f"{self.label}: the served teacher at {self.url} did not answer for "
                                         f"{self.wait_s:.0f} s (collective_timeout_s): {last}")
            self.retries += 1
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)

    def _answer(self, future: concurrent.futures.Future) -> Encoded:
        """The answer on `device`: its tensor bytes in one copy (from pinned memory to a GPU), cut into leaves
        there."""
        return wire.from_bytes(future.result(), device=self.device)

    def prefetch(self, items: Iterable[Any], *, batch_fn: Callable[[Any], TeacherRequest],
                 depth: int = 1) -> TeacherFeed:
        """(item, answer) in order, with up to `depth` requests in flight beyond the item the caller holds."""
        if not self.receives:
            return TeacherFeed((item, None) for item in items)
        pending = collections.deque()

        def pairs():
            for item in items:  # drawn only when the caller asks for the answer `depth` items before it
                pending.append((item, self._ask(batch_fn(item))))
                if len(pending) > depth:
                    item, future = pending.popleft()
                    yield item, self._answer(future)
            while pending:
                item, future = pending.popleft()
                yield item, self._answer(future)

        def close(timeout: float | None) -> bool:
            for _, future in pending:
                future.cancel()
            pending.clear()
            return True

        return TeacherFeed(pairs(), close=close)

    def close(self, timeout: datetime.timedelta | None = None) -> None:
        """Close the session and end the loop's thread (requests in flight are dropped)."""
        atexit.unregister(self.close)
        if not self._thread.is_alive():
            return
        self._submit(self._session.close()).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

"""`meshkd serve-teacher`'s HTTP side: a malformed request gets a 4xx at once, the server's log no traceback.

A real server (one teacher rank on the CPU, started here with a bearer token) is sent what a broken or hostile
client sends: bodies whose Content-Encoding does not decode, JSON and wire specs nested past the parser's
recursion, and lengths declared far above the limit with the bytes never sent. Each is answered at once (a
client that waited would time out), and the server answers a good request afterwards.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from pathlib import Path

import pytest

from tests.recipe.lifecycle.test_teacher_service import TOKEN, Server, a_request, write
from tests.tiny import base_config, with_layout

pytestmark = pytest.mark.world

ANSWER, COMPLETIONS = "/v1/answer", "/v1/completions"
PROMPT = {"prompt": [[1, 2, 3]], "prompt_logprobs": 2, "max_tokens": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One teacher rank behind HTTP (the default --max-request-tokens: a 2 MiB and 64 KiB body limit)."""
    tmp = tmp_path_factory.mktemp("http")
    config = with_layout(base_config(tmp), {"dp_size": 1}, {"dp_size": 1})
    running = Server(write(config, tmp / "server.yaml"), 0, tmp / "server.log")
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.stop()


def send(url: str, path: str, body: bytes, *, headers: dict | None = None, timeout_s: float = 20.0) -> tuple[int, dict]:
    """POST `body` as it is (its length declared by `headers` when they name one); the status and the JSON error.
    A server that does not answer within `timeout_s` fails the test (socket.timeout)."""
    address = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=timeout_s)
    try:
        connection.putrequest("POST", path, skip_accept_encoding=True)
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Length": str(len(body)), **(headers or {})}
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.endheaders(body)
        response = connection.getresponse()
        payload = response.read()
        return response.status, json.loads(payload) if response.status != 200 else {}
    finally:
        connection.close()


@pytest.mark.parametrize("path", [ANSWER, COMPLETIONS])
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_whose_content_encoding_does_not_decode_gets_400(server, path, encoding):
    body = a_request().to_bytes() if path == ANSWER else json.dumps(PROMPT).encode()
    status, answer = send(server.url, path, body, headers={"Content-Encoding": encoding})
    assert status == 400 and "Content-Encoding" in answer["error"], answer


def test_json_nested_50000_deep_gets_400(server):
    deep = b"[" * 50_000 + b"]" * 50_000
    status, answer = send(server.url, COMPLETIONS, b'{"prompt": ' + deep + b', "prompt_logprobs": 2}')
    assert status == 400 and "nested too deep" in answer["error"], answer
    spec = b'{"version":1,"tree":' + b'{"list":[' * 50_000 + b']}' * 50_000 + b"}"
    status, answer = send(server.url, ANSWER, len(spec).to_bytes(8, "little") + spec)
    assert status == 400 and "nested more than 64 levels" in answer["error"], answer


@pytest.mark.parametrize("path, declared", [(ANSWER, 10**12), (COMPLETIONS, 10**12), (ANSWER, 3 << 20)])
def test_a_declared_length_above_the_limit_gets_413_before_the_body_is_sent(server, path, declared):
    """The client declares the length and sends 100 bytes of it: the server answers without waiting for the rest."""
    status, answer = send(server.url, path, b"x" * 100, headers={"Content-Length": str(declared)})
    assert status == 413 and f"declares {declared} bytes" in answer["error"], answer


def test_the_server_still_answers_and_logged_no_traceback(server):
    """Run after the malformed requests above (pytest keeps a module's order): a good request is answered, and no
    handler's error reached the log."""
    status, _ = send(server.url, ANSWER, a_request().to_bytes())
    assert status == 200
    status, _ = send(server.url, COMPLETIONS, json.dumps(PROMPT).encode())
    assert status == 200
    log = Path(server.log).read_text()
    assert "Traceback" not in log and "Error handling request" not in log, log

"""`meshkd serve-teacher`: one teacher, on ranks of its own, answering any number of students over HTTP
(`meshkd.recipe.teacher.served_protocol`; the students' side is `meshkd.recipe.teacher.served_teacher`).

Every rank of the world is a teacher rank, laid out as the teacher's section says (`teacher_distributed` on
separate meshes, else `distributed`), as `meshkd cache-teacher` lays it out. Rank 0 also runs the HTTP
server (`meshkd.recipe.lifecycle.teacher_http.HttpServer`, aiohttp on a thread of its own): each request is
checked there (a bad one gets a 4xx and the server goes on) and queued. The ranks' main threads loop on work
from rank 0: the queued requests that can share a forward (same settings and row length; identical requests
once), up to `max_batch_tokens`, broadcast to every rank as one `meshkd.core.wire` byte string. Each
data-parallel replica of the teacher answers its share of the rows, its output rank sends that answer to rank
0, and rank 0 cuts the whole answer back into one per request: every tensor of an answer is row by row, and
`Distribution.encode` seeds each row's tail samples by its own tokens, so a row's answer does not depend on the
rows it was batched with. With nothing queued rank 0 broadcasts an idle word every second, so no rank waits
past the collective timeout. A failing forward answers its requests with a 500 and the server goes on. SIGINT /
SIGTERM (or `meshkd`'s stop file) drain: new requests get 503 (students retry them), queued ones are answered,
then every rank ends.

A teacher with another tokenizer than its students answers `kd.cross_tokenizer.loss` `uld` and `gold` (per aligned
group, each such request a forward of its own); not `projection`, which would need the student's tokenizer here.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from meshkd.core import wire
from meshkd.core.agreement import group_device
from meshkd.core.teacher_protocol import TeacherRequest
from meshkd.core.topology import create_kd_distributed_setups, model_replicas
from meshkd.parallel.stages import decoder_of
from meshkd.recipe.common.faults import StopRequest, about
from meshkd.recipe.lifecycle.teacher_http import Entry, HttpServer
from meshkd.recipe.lifecycle.world import run_role
from meshkd.recipe.modeling.loaders import load_section_tokenizer
from meshkd.recipe.settings.config import ConfigError, KDRecipeConfig, TeacherConfig
from meshkd.recipe.teacher.served_protocol import Health, answer_kd, bearer_token, vocabulary_fingerprint
from meshkd.recipe.teacher.teacher_cache import teacher_identity
from meshkd.recipe.teacher.teacher_worker import TeacherForward, lay_out_teacher, load_teacher

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
IDLE_S = 1.0  # rank 0 tells the other ranks it is still there at least this often
_IDLE, _STOP = -1, 0  # words broadcast in place of a work's length


@dataclass(frozen=True)
class ServeOptions:
    """Where and how `meshkd serve-teacher` listens (its command-line options)."""

    host: str = "127.0.0.1"
    port: int = 8100  # 0: any free port (the address is printed, and written to `address_file`)
    max_batch_tokens: int = 8192  # tokens of queued requests one forward takes at most (one larger runs alone)
    max_request_tokens: int = 65536  # a request holding more is refused (413)
    tls_cert: str | None = None  # PEM certificate and key: serve HTTPS
    tls_key: str | None = None
    address_file: str | None = None  # where to write the address once it listens

    def check(self) -> None:
        """Refuse a server reachable from other hosts without a token, and TLS given by halves."""
        if self.host not in LOCAL_HOSTS and bearer_token() is None:
            raise ConfigError(f"--host {self.host}: a teacher served beyond this host needs a bearer token: set "
                              "MESHKD_TEACHER_TOKEN (here and for every student)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"--{name.replace('_', '-')}: no file {path}")
        if self.max_batch_tokens < 1 or self.max_request_tokens < 1:
            raise ConfigError("--max-batch-tokens and --max-request-tokens must be >= 1")


class Queue:
    """Requests waiting for the teacher, taken as compatible groups (`AnswerRequest.compatible_key`)."""

    def __init__(self, max_batch_tokens: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self._entries: list[Entry] = []
        self._ready = threading.Condition()

    def put(self, entry: Entry) -> None:
        with self._ready:
            self._entries.append(entry)
            self._ready.notify()

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, wait_s: float) -> list[Entry]:
        """The first queued request and those that can share its forward, identical ones at no cost, up to the
        token budget; [] if none came within `wait_s`."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._entries, timeout=wait_s):
                return []
            first = self._entries[0]
            key, tokens, digests, taken = first.request.compatible_key(), 0, set(), []
            for entry in self._entries:
                if entry.request.compatible_key() != key:
                    continue
                cost = 0 if entry.digest in digests else entry.request.tokens
                if taken and tokens + cost > self.max_batch_tokens:
                    break
                taken.append(entry)
                digests.add(entry.digest)
                tokens += cost
            self._entries = [entry for entry in self._entries if entry not in taken]
            return taken


class TeacherService:
    """One rank of `meshkd serve-teacher`: `run()` loads and lays out the teacher, then serves until stopped."""

    def __init__(self, config: KDRecipeConfig, teacher: TeacherConfig, options: ServeOptions,
                 device: torch.device) -> None:
        self.config, self.teacher, self.options, self.device = config, teacher, options, device
        self.stop = StopRequest()
        self.is_server = dist.get_rank() == 0
        self.stats = {"served_requests": 0, "served_tokens": 0, "forwards": 0, "busy_s": 0.0}
        self._started = time.monotonic()
        self._forwards: dict[tuple, TeacherForward] = {}

    def run(self) -> dict:
        config = self.config
        setup = create_kd_distributed_setups({"separate_meshes": False, "distributed": config.layout_of(self.teacher)},
                                             dist.get_world_size(),
                                             timeout=datetime.timedelta(seconds=config.collective_timeout_s)).student
        model, checkpoint = load_teacher(self.teacher)
        self.vocab_rows = model.get_output_embeddings().weight.shape[0]
        self.num_layers = len(decoder_of(model).layers)
        self.runner = lay_out_teacher(model, checkpoint, setup, device=self.device)
        self.replicas = model_replicas(setup)
        self.replica = next(index for index, replica in enumerate(self.replicas) if dist.get_rank() in replica.ranks)
        self.wire_device = group_device(dist.group.WORLD)
        self.queue = Queue(self.options.max_batch_tokens)
        if self.is_server:
            with about("teacher_model.tokenizer"):
                self.tokenizer = tokenizer = load_section_tokenizer(self.teacher.model)
            self.model_name = str(self.teacher.model.path or "teacher_model")
            self.health = Health(teacher=teacher_identity(self.teacher), vocabulary=vocabulary_fingerprint(tokenizer),
                                 vocab_rows=self.vocab_rows, num_layers=self.num_layers,
                                 hidden_size=model.config.get_text_config().hidden_size, load={})
            self.http = HttpServer(self)
            self.http.start()
        try:
            while self._serve_one():
                pass
        finally:
            if self.is_server:
                self.http.close()
        return dict(self.stats)

    # ---- every rank ----

    def _serve_one(self) -> bool:
        """Take (rank 0) and run one work on every rank; False once rank 0 said stop."""
        entries, body, word = [], None, 0
        if self.is_server:
            if self.stop.requested() and not self.http.draining:
                self.http.draining = True
                print(f"meshkd serve-teacher: got {self.stop.reason()}: answering the {len(self.queue)} queued "
                      "request(s), then stopping", flush=True)
            entries = self.queue.take(IDLE_S)
            body = self._merged(entries) if entries else None
            word = len(body) if body else _STOP if self.http.draining and not len(self.queue) else _IDLE
        length = torch.tensor([word], dtype=torch.int64, device=self.wire_device)
        dist.broadcast(length, src=0)
        if int(length) == _STOP:
            return False
        if int(length) == _IDLE:
            return True
        data = wire.bytes_tensor(body) if self.is_server else torch.empty(int(length), dtype=torch.uint8)
        data = data.to(self.wire_device)
        dist.broadcast(data, src=0)
        started = time.monotonic()
        answers = self._answer(wire.from_bytes(data.cpu().numpy().tobytes()))
        if self.is_server:
            self._reply(entries, answers)
            self.stats["busy_s"] += time.monotonic() - started
            self.stats["forwards"] += 1
        return True

    def _answer(self, work: dict) -> list[dict] | None:
        """Every replica's answer to its share of the work's rows, on rank 0 (None elsewhere): each a wire dict,
        or {"error": message}."""
        rows = work["batch"]["input_ids"].shape[0]
        shares = [share for share in torch.arange(rows).tensor_split(len(self.replicas)) if len(share)]
        answer = None
        if self.replica < len(shares):
            share = shares[self.replica]
            batch = {key: value[share[0] : share[-1] + 1].to(self.device) for key, value in work["batch"].items()}
            try:
                settings = work["settings"]
                answer = self._forward(settings)(TeacherRequest(
                    batch, settings["transport"], with_label_log_probs=settings["with_label_log_probs"]))
            except Exception as error:  # noqa: BLE001 - the requests are answered with it; the server goes on
                answer = {"error": f"the teacher failed on this batch: {error}"}
            if answer is not None:
                answer = {key: value.cpu() if isinstance(value, torch.Tensor) else value
                          for key, value in answer.items()}
        answers = []
        for index in range(len(shares)):
            output = self.replicas[index].output_rank
            if output == 0 and self.is_server:
                answers.append(answer)
            elif self.is_server:
                answers.append(self._receive(output))
            elif dist.get_rank() == output:
                self._send(answer)
        return answers if self.is_server else None

    def _forward(self, settings: dict) -> TeacherForward:
        key = json.dumps({name: value for name, value in settings.items()
                          if name not in ("transport", "with_label_log_probs")}, sort_keys=True)
        if key not in self._forwards:
            self._forwards[key] = TeacherForward(self.runner, vocab_size=settings["vocab_size"],
                                                 kd=answer_kd(self.config.kd, settings), seed=settings["seed"],
                                                 encodes=self.runner.is_last,
                                                 hidden_layers=settings["hidden_layers"] or None,
                                                 section=self.teacher.model)
        return self._forwards[key]

    def _send(self, value: dict) -> None:
        data = wire.bytes_tensor(wire.to_bytes(value)).to(self.wire_device)
        dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=self.wire_device), dst=0)
        dist.send(data, dst=0)

    def _receive(self, source: int) -> dict:
        length = torch.empty(1, dtype=torch.int64, device=self.wire_device)
        dist.recv(length, src=source)
        data = torch.empty(int(length), dtype=torch.uint8, device=self.wire_device)
        dist.recv(data, src=source)
        return wire.from_bytes(data.cpu().numpy().tobytes())

    # ---- rank 0 ----

    def _merged(self, entries: list[Entry]) -> bytes:
        """The work of `entries`: their distinct requests' rows stacked, their common settings."""
        distinct = list({entry.digest: entry.request for entry in entries}.values())
        batch = {key: torch.cat([request.batch[key] for request in distinct]) for key in distinct[0].batch}
        return wire.to_bytes({"batch": batch, "settings": distinct[0].settings})

    def _reply(self, entries: list[Entry], answers: list[dict]) -> None:
        """Cut the replicas' answers into one per request and hand each to its waiting handler."""
        failed = next((answer["error"] for answer in answers if "error" in answer), None)
        whole = None if failed else {key: torch.cat([answer[key] for answer in answers])
                                     if isinstance(value, torch.Tensor) else value
                                     for key, value in answers[0].items()}
        first_row, rows, bodies = {}, 0, {}
        for entry in entries:
            if entry.digest not in first_row:
                first_row[entry.digest], rows = rows, rows + entry.request.batch["input_ids"].shape[0]
        for entry in entries:
            if failed is None and len(first_row) == 1:  # the whole answer (a cross-tokenizer one is per group)
                bodies[entry.digest] = bodies.get(entry.digest) or wire.to_bytes(whole)
            elif failed is None and entry.digest not in bodies:
                start, count = first_row[entry.digest], entry.request.batch["input_ids"].shape[0]
                bodies[entry.digest] = wire.to_bytes({key: value[start : start + count] if isinstance(
                    value, torch.Tensor) else value for key, value in whole.items()})
            result = (500, failed) if failed else (200, bodies[entry.digest])
            self.http.resolve(entry.future, result)
            self.stats["served_requests"] += 1
            self.stats["served_tokens"] += entry.request.tokens

    def load(self) -> dict:
        """What `GET /health` reports as the teacher's load."""
        uptime = time.monotonic() - self._started
        return {**self.stats, "queued_requests": len(self.queue), "uptime_s": uptime,
                "busy_share": self.stats["busy_s"] / uptime if uptime > 0 else 0.0}


def serve_teacher(config: KDRecipeConfig, teacher: TeacherConfig, options: ServeOptions) -> dict:
    """`meshkd serve-teacher` of `teacher` on this rank: in the current world, or a new one from the environment."""
    options.check()
    return run_role(config, lambda device: TeacherService(config, teacher, options, device))


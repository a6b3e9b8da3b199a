"""A teacher served over HTTP: the step time of `meshkd train` against `meshkd serve-teacher` on this host
against the same run with the teacher in the job, the answers' bytes a token on the wire, and the teacher's
busy share with one student and with two.

    meshkd bench --only served [--quick] [--json OUT]

What is measured: `meshkd train` runs of one student with one teacher, the teacher either in the job
("in_job": `separate_meshes: true`, `teacher_distributed: {dp_size: 1}`, so on a rank of its own: 2
processes, the student's rank 0 and the teacher's rank 1, a bridge between them) or served ("served": the
same teacher on 1 process of `meshkd serve-teacher --nproc 1` on a free port of 127.0.0.1, started once for
the section, and the student on 1 process naming it by `teacher_model.url`: 2 processes again). The models
are random-init Llamas reading one byte-level BPE of 4096 entries trained here on the bench's text
(`meshkd.bench.cross_tokenizer.bench_texts`: the standard library's json and email sources): the student
hidden 128, 2 layers (seed 1); the teacher hidden 512, 8 layers (MLP 2048, seed 2), the same weights on both
sides, so a teacher's forward, not the student's step, sets the pace. A step: 4 rows of 256 tokens in 2
micro-batches of 2, kd_ratio 1, top-k answers (`kd.logits_transport: topk`, topk 64, 32 tail samples),
OMP_NUM_THREADS 1 a process (the server's too) unless set. The runs alternate in-job, served, in-job,
served, ... in one bench run (`repeats` of each). The figures:
- the median `step_time_s` over the steps after the second of every run of a side, the ratio served / in-job
  of those medians, and the medians of `teacher_wait_s` (the step's wait for the teacher's answers);
- bytes a token on the wire, measured: after the served runs, one request of a training micro-batch's shape
  (the first 2 rows of 256 tokens the recipe's packing makes of the bench's text) with the runs' settings is
  POSTed to the server as top-k and again as `full` (float32 logits over the student's 4096 entries); the
  figures are the HTTP bodies' lengths (`meshkd.core.wire` byte strings: spec and tensors) over the request's
  tokens, the request's own beside the answers', and the answers' tensor bytes alone
  (`meshkd.core.wire.payload_nbytes`) for the spec's share;
- the teacher's busy share: the growth of the server's `load.busy_s` (`GET /health`: seconds spent on
  forwards and their answers) over the growth of its `load.uptime_s`, both sampled every 0.1 s, from the end
  of a forward to the end of another (as the samples first see them) in the window in which every student
  running has logged its second step and none has logged its last; with one student (the served runs above,
  their windows summed), then with two students started at once against the same server (3 processes; the
  second reads its rows in another order, `dataset.seed` 1, so the two ask for different rows, which the
  server may batch into one forward), with the two students' median step times. The sampling goes on
  through the in-job runs too (the server idle), so its cost weighs on both sides.

Asked over HTTP, an answer costs its encoding into a wire body, a localhost connection and its decoding
instead of a bridge's send; either way the student asks one micro-batch ahead (`kd.overlap_teacher` at its
default). The target (the served-teacher issue): served / in-job <= 1.10 where every process has cores of
its own (here 2 a side). On a machine with fewer cores than processes the figure is reported as measured,
not held to the target; `cores_per_process_served` says which case a run was, `cores_per_process_two_students`
the same of the two-student run (3 processes), whose step times are reported as measured.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from meshkd.bench.cross_tokenizer import MAX_CHARS, TEXT_PATTERNS, bench_texts, random_llama, train_records
from meshkd.bench.teachers import _median

TARGET_RATIO = 1.10
SIZES = {"student_hidden": 128, "student_layers": 2, "teacher_hidden": 512, "teacher_layers": 8, "vocab": 4096,
         "sequence": 256}
TOPK = {"logits_transport": "topk", "topk": 64, "topk_tail_samples": 32}
SIDES = ("in_job", "served")
POLL_S = 0.1
ROWS = 2  # a micro-batch's rows: 4 a step in 2 micro-batches
START_S = 300.0  # how long the server may take to listen


def _config(root: Path, name: str, tokenizer: str, steps: int, sizes: dict, *, url: str | None = None,
            data_seed: int = 0) -> dict:
    """`meshkd train` of the student (seed 1) with the teacher (seed 2) on a rank of its own, or at `url`;
    `data_seed`: the order the student reads its rows in."""
    teacher = random_llama(sizes["teacher_hidden"], sizes["teacher_layers"], sizes["vocab"], tokenizer, 2)
    if url is not None:
        teacher["url"] = url
    return {
        "model": random_llama(sizes["student_hidden"], sizes["student_layers"], sizes["vocab"], tokenizer, 1),
        "teacher_model": teacher,
        "separate_meshes": True, "distributed": {"dp_size": 1}, "teacher_distributed": {"dp_size": 1},
        "kd": {"kd_ratio": 1.0, "chunk_size": 256, **TOPK},
        "dataset": {"paths": TEXT_PATTERNS, "val_fraction": 0.05, "max_document_chars": MAX_CHARS,
                    "seed": data_seed},
        "step_scheduler": {"max_steps": steps, "global_batch_size": 4, "local_batch_size": ROWS,
                           "sequence_length": sizes["sequence"], "val_batches": 1},
        "optimizer": {"lr": 1e-3}, "checkpoint": {"enabled": False},
        "logging": {"run_dir": str(root / name), "progress_bar": False},
    }


class _Server:
    """`meshkd serve-teacher CONFIG --nproc 1` on a free port of 127.0.0.1, in a process group of its own, its
    output in `log`; OMP_NUM_THREADS 1 unless set."""

    def __init__(self, config: dict, path: Path, log: Path) -> None:
        path.write_text(yaml.safe_dump(config))
        address, self.log = log.with_suffix(".address"), log
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        with log.open("w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "meshkd", "serve-teacher", str(path), "--nproc", "1", "--port", "0",
                 "--address-file", str(address)], stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)
        deadline = time.monotonic() + START_S
        while not address.exists():
            code = self.process.poll()
            if code is not None or time.monotonic() > deadline:
                self.stop()
                why = f"exited with {code}" if code is not None else f"did not listen within {START_S:.0f} s"
                raise RuntimeError(f"meshkd serve-teacher {why}:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        self.url = address.read_text()

    def load(self) -> dict:
        """`load` of the server's `GET /health`."""
        from meshkd.recipe.teacher.served_teacher import health

        return health(self.url, label="meshkd bench --only served")["load"]

    def post(self, body: bytes) -> bytes:
        """The body of the server's answer to the request `body` (an `AnswerRequest`'s bytes)."""
        from meshkd.recipe.teacher.served_protocol import ANSWER_PATH, auth_headers

        request = urllib.request.Request(self.url + ANSWER_PATH, data=body, headers=auth_headers(), method="POST")
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.read()

    def stop(self) -> None:
        """SIGTERM (the server drains and exits), SIGKILL to its group after 60 s."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _train_count(run_dir: str) -> int:
    """The train records in `run_dir`'s metrics.jsonl so far (whole lines only)."""
    path = Path(run_dir, "metrics.jsonl")
    text = path.read_text() if path.exists() else ""
    return sum(json.loads(line)["kind"] == "train" for line in text.split("\n")[:-1] if line)


class _Busy:
    """While its runs go on (a context manager): every `poll_s`, the server's `busy_s` and `uptime_s` and how many
    train records each of `run_dirs` holds."""

    def __init__(self, server: _Server, run_dirs: list[str], poll_s: float = POLL_S) -> None:
        self.server, self.run_dirs, self.poll_s = server, run_dirs, poll_s
        self.samples: list[tuple[float, float, list[int]]] = []  # (uptime_s, busy_s, train records of each run)
        self.error: Exception | None = None  # what ended the sampling early (a server gone)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="meshkd-bench-served", daemon=True)

    def __enter__(self) -> _Busy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.poll_s):
            counts = [_train_count(run_dir) for run_dir in self.run_dirs]
            try:
                load = self.server.load()
            except ConnectionError as error:  # the run fails too, saying more; `window` says this
                self.error = error
                return
            self.samples.append((load["uptime_s"], load["busy_s"], counts))

    def window(self, steps: int) -> tuple[float, float] | None:
        """(busy seconds, seconds) of the server between the first sample that saw a forward end (`busy_s` grown
        since the sample before) once every run had logged its second step and the last that saw one before any
        had logged its last (`steps`), or None when fewer than two forwards ended in that window (runs started
        together that did not overlap long enough). Both ends lag their forward's end by less than `poll_s`, and
        every forward between them counts whole."""
        if self.error is not None:
            raise RuntimeError(f"the server's load could not be sampled: {self.error}")
        ended = [index for index in range(1, len(self.samples)) if self.samples[index][1] > self.samples[index - 1][1]]
        steady = [index for index in ended if min(self.samples[index][2]) >= 2 and max(self.samples[index][2]) < steps]
        if len(steady) < 2:  # the runs did not overlap long enough (a loaded machine starts one late): no figure
            return None
        (up_start, busy_start, _), (up_end, busy_end, _) = self.samples[steady[0]], self.samples[steady[-1]]
        return busy_end - busy_start, up_end - up_start


def first_rows(tokenizer_dir: str, sequence: int) -> dict:
    """The first `ROWS` rows of `sequence` tokens the recipe makes of the bench's text (the runs' documents, all
    of them: no validation share), its token store in a directory of its own."""
    from meshkd.recipe.corpus.data import build_run_datasets
    from meshkd.recipe.modeling.models import load_tokenizer
    from meshkd.recipe.settings.config import DatasetConfig

    with tempfile.TemporaryDirectory(prefix="meshkd-bench-served-rows-") as store:
        dataset = DatasetConfig(paths=TEXT_PATTERNS, val_fraction=0.0, max_document_chars=MAX_CHARS,
                                token_store=store)
        train, _ = build_run_datasets(load_tokenizer(path=tokenizer_dir), dataset, sequence_length=sequence)
        return train[0:ROWS]


def wire_bytes(server: _Server, tokenizer_dir: str, sizes: dict) -> dict:
    """Bytes a token of one request of a micro-batch's shape and of the server's top-k and full answers to it."""
    import torch

    from meshkd.core import wire
    from meshkd.core.wire import payload_nbytes
    from meshkd.recipe.corpus.rows import BATCH_KEYS
    from meshkd.recipe.settings.config import KDConfig
    from meshkd.recipe.teacher.served_protocol import AnswerRequest, answer_settings

    rows = first_rows(tokenizer_dir, sizes["sequence"])
    settings = answer_settings(KDConfig(**TOPK), seed=0, vocab_size=sizes["vocab"])
    result: dict = {"rows": ROWS, "sequence": sizes["sequence"]}
    for transport in ("topk", "full"):
        request = AnswerRequest({key: rows[key] for key in BATCH_KEYS},
                                {"transport": transport, "with_label_log_probs": False, **settings})
        body = request.to_bytes()
        answer = server.post(body)
        tensors = payload_nbytes({key: value for key, value in wire.from_bytes(answer).items()
                                  if isinstance(value, torch.Tensor)})
        result["tokens"] = request.tokens
        result[f"{transport}_request_bytes_per_token"] = len(body) / request.tokens
        result[f"{transport}_answer_bytes_per_token"] = len(answer) / request.tokens
        result[f"{transport}_answer_tensor_bytes_per_token"] = tensors / request.tokens
    return result


def run(*, repeats: int, steps: int, sizes: dict = SIZES, poll_s: float = POLL_S) -> dict:
    """The section's figures: `repeats` runs of each side, alternating, of `steps` steps each, then the wire
    bytes, then two students at once against the same server; the server's load sampled every `poll_s`."""
    from meshkd.recipe.modeling.transplant import train_byte_level_bpe

    records: dict[str, list[dict]] = {side: [] for side in SIDES}
    busy_one = [0.0, 0.0]
    with tempfile.TemporaryDirectory(prefix="meshkd-bench-served-") as scratch:
        root = Path(scratch)
        tokenizer = str(root / "tokenizer")
        train_byte_level_bpe(bench_texts(), sizes["vocab"]).save_pretrained(tokenizer)
        server = _Server(_config(root, "server", tokenizer, steps, sizes), root / "server.yaml", root / "server.log")
        try:
            for repeat in range(repeats):
                for side in SIDES:
                    config = _config(root, f"{side}{repeat}", tokenizer, steps, sizes,
                                     url=server.url if side == "served" else None)
                    # Sampled on both sides (the server idles through the in-job runs): its cost weighs on both.
                    with _Busy(server, [config["logging"]["run_dir"]], poll_s) as busy:
                        records[side] += train_records(config, root / f"{side}{repeat}.yaml")
                    if side == "served":
                        window = busy.window(steps)  # None: too few forwards seen in its steady steps
                        if window is not None:
                            busy_one = [total + part for total, part in zip(busy_one, window)]
            wire = wire_bytes(server, tokenizer, sizes)
            pair = [_config(root, f"student{index}", tokenizer, steps, sizes, url=server.url, data_seed=index)
                    for index in range(2)]
            paths = [root / f"student{index}.yaml" for index in range(2)]
            with _Busy(server, [config["logging"]["run_dir"] for config in pair], poll_s) as busy, \
                    concurrent.futures.ThreadPoolExecutor(2) as pool:
                together = list(pool.map(train_records, pair, paths))  # started at once
            busy_two = busy.window(steps)
            load = server.load()
        finally:
            server.stop()
    result: dict = {"sizes": dict(sizes), "repeats": repeats, "steps": steps, "target_ratio": TARGET_RATIO,
                    "processes": {"in_job": 2, "served": 2, "two_students": 3}, "cpus": os.cpu_count(),
                    "steps_measured": {side: len(side_records) for side, side_records in records.items()}}
    result["cores_per_process_served"] = (result["cpus"] or 1) / result["processes"]["served"]
    result["cores_per_process_two_students"] = (result["cpus"] or 1) / result["processes"]["two_students"]
    for side in SIDES:
        result[f"step_time_{side}_s"] = _median(records[side], "step_time_s")
        result[f"teacher_wait_{side}_s"] = _median(records[side], "teacher_wait_s")
    result["step_time_ratio_served_over_in_job"] = result["step_time_served_s"] / result["step_time_in_job_s"]
    result["wire"] = wire
    windows = {"one_student": busy_one if busy_one[1] > 0 else None, "two_students": busy_two}
    for students, window in windows.items():  # None: not measured (see `_Busy.window`)
        result[f"teacher_busy_share_{students}"] = window[0] / window[1] if window else None
    result["busy_window_s"] = {students: window[1] if window else None for students, window in windows.items()}
    result["step_time_two_students_s"] = [_median(student, "step_time_s") for student in together]
    result["steps_measured_two_students"] = [len(student) for student in together]
    result["server_load"] = load
    return result


def run_section(quick: bool) -> dict:
    """{"served": results}, printed as they are measured; `quick`: two runs of each side, 6 steps (else three
    of 16)."""
    started = time.perf_counter()
    results = run(repeats=2 if quick else 3, steps=6 if quick else 16)
    wire, cpus = results["wire"], results["cpus"]
    shared = results["cores_per_process_served"] < 1
    print(f"served: the teacher in the job on its own rank {results['step_time_in_job_s']:.3f} s a step (teacher "
          f"wait {results['teacher_wait_in_job_s']:.3f} s), served on localhost {results['step_time_served_s']:.3f} "
          f"s (teacher wait {results['teacher_wait_served_s']:.3f} s); ratio served / in-job "
          f"{results['step_time_ratio_served_over_in_job']:.3f} (target <= {TARGET_RATIO} where every process has "
          f"cores of its own; {cpus} CPUs for 2 processes{': shared, reported as measured' if shared else ''}; "
          f"medians of {results['steps_measured']['in_job']} and {results['steps_measured']['served']} steps)")
    print(f"on the wire, a token: top-k 64 + 32 tail answer {wire['topk_answer_bytes_per_token']:.1f} B "
          f"({wire['topk_answer_tensor_bytes_per_token']:.1f} B of tensors), full answer "
          f"{wire['full_answer_bytes_per_token']:.1f} B ({wire['full_answer_tensor_bytes_per_token']:.1f} B of "
          f"tensors), the request {wire['topk_request_bytes_per_token']:.1f} B ({wire['rows']} rows of "
          f"{wire['sequence']} tokens)")
    first, second = results["step_time_two_students_s"]

    def share(students: str) -> str:
        value, window = results[f"teacher_busy_share_{students}"], results["busy_window_s"][students]
        return f"{value:.3f} (over {window:.1f} s)" if value is not None else "not measured (the runs did not overlap)"

    print(f"teacher busy share: one student {share('one_student')}, two at once {share('two_students')}, their "
          f"steps {first:.3f} s and {second:.3f} s ({cpus} CPUs for 3 processes"
          f"{': shared, reported as measured' if results['cores_per_process_two_students'] < 1 else ''}; the "
          f"section took {time.perf_counter() - started:.0f} s)")
    return {"served": results}

"""Benchmarks of logits transport, batch transport, teacher overlap and KD-loss memory.

    meshkd bench [--quick] [--json OUT] [--only bandwidth,latency,modes,overlap,memory]

Every figure is a median over repeats of a ratio whose two sides were measured side by side, in
alternating order, in the same run, so that a machine shared with other work biases both sides alike.

Sections:
  bandwidth  send_logits (steady state: spec cached) vs a raw dist.broadcast of the same bytes on the
             same route group, 1 MiB to 256 MiB. Ratio: raw time / send_logits time (effective bandwidth
             over raw bandwidth).
  latency    send_batch of a small nested batch vs the reference design: the structure pickled by
             broadcast_object_list on every call, then one broadcast per tensor leaf. Ratio: meshkd time /
             reference time.
  modes      wire bytes per token and KD-loss error of each logits transport mode against full float32,
             on the demo teacher's real logits (SmolLM2-135M-Instruct) for standard-library source, for
             two students: the demo's (8 of 30 layers, before distillation, far from the teacher) and a
             near one (26 of 30 layers). Beside them, the bytes `kd.hidden_states` adds: one pair, and the
             demo student's 8 kept layers. Top-k with a rest bucket and top-k with sampled tail tokens. Each
             repeat is a different text sample; also the relative error of d loss / d logits and of the
             output-head weight gradient those logit gradients produce.
  overlap    steady-state time per micro-batch with TeacherPrefetcher (teacher overlapped) and with the
             synchronous loop, student and teacher compute simulated by time.sleep; ratio to
             max(student, teacher).
  memory     peak memory of the chunked KD loss (forward and backward) vs the plain full-softmax loss at
             sequence 2048. Each measurement runs in a fresh process: after the inputs exist, the kernel's
             peak-RSS counter is reset (/proc/self/clear_refs, "5") and VmHWM is read after backward, so the
             figure is the loss's own peak above its inputs, the [tokens, vocab] logit gradient included, as
             the allocator really touched it (tracemalloc does not see torch's allocations; RSS also counts
             what the allocator keeps after a free, so it errs on the high side). On CUDA:
             max_memory_allocated. The values are also compared with a float64 evaluation.

Process groups: gloo on the CPU; NCCL with one GPU per rank when at least two GPUs are present. The
modes and memory sections run without a world, in `meshkd.bench.modes` and `meshkd.bench.memory`.
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshkd.bench import memory, modes
from meshkd.bench.measure import MIB, median_ratio
from meshkd.core.local_world import spawn_world

SECTIONS = ("bandwidth", "latency", "modes", "overlap", "memory")


def _settings(quick: bool) -> dict:
    if quick:
        return {
            "sizes_mib": [1, 16, 64], "bandwidth_repeats": 3, "latency_calls": 100, "latency_repeats": 3,
            "mode_samples": 2, "mode_rows": 1, "mode_sequence": 512, "topk": [16, 64, 256],
            "topk_sampled": [(16, 48), (64, 32)],
            "overlap": [(0.2, 0.2)], "overlap_micro_batches": 5, "overlap_repeats": 2,
            "memory_vocabs": [49152, 131072], "memory_sequence": 512, "memory_repeats": 1,
            "memory_chunk_sizes": [128, 1024], "output_tokens": [2048], "output_whole_up_to": 2048,
            "output_bfloat16_tokens": [2048],
        }  # fmt: skip
    return {
        "sizes_mib": [1, 4, 16, 64, 256], "bandwidth_repeats": 9, "latency_calls": 300, "latency_repeats": 7,
        "mode_samples": 6, "mode_rows": 2, "mode_sequence": 512, "topk": [16, 64, 256],
        "topk_sampled": [(16, 48), (64, 32)],
        "overlap": [(0.2, 0.2), (0.1, 0.2), (0.2, 0.1)], "overlap_micro_batches": 8, "overlap_repeats": 3,
        "memory_vocabs": [49152, 131072], "memory_sequence": 2048, "memory_repeats": 3,
        "memory_chunk_sizes": [128, 1024], "output_tokens": [2048, 8192, 32768], "output_whole_up_to": 8192,
        "output_bfloat16_tokens": [2048, 8192, 32768],
    }  # fmt: skip


# --------------------------------------------------------------------------------------- the world


def world_backend() -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"


def _world_main(rank: int, backend: str, sections: list[str], settings: dict, out: str):
    from meshkd.core.bridge import KDMeshBridge
    from meshkd.core.topology import create_kd_distributed_setups

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    cfg = {"separate_meshes": True, "distributed": {"dp_size": 1}, "teacher_distributed": {"dp_size": 1}}
    bridge = KDMeshBridge(create_kd_distributed_setups(cfg, 2), device)
    results = {}
    for name in sections:
        results[name] = {"bandwidth": _bandwidth, "latency": _latency, "overlap": _overlap}[name](bridge, settings)
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def _run_world(sections: list[str], settings: dict) -> dict:
    backend = world_backend()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "world.json"))
        failure = spawn_world(2, _world_main, (backend, sections, settings, out), backend=backend, timeout_s=300)
        if failure is not None:
            raise RuntimeError(f"benchmark world failed: {failure}")
        results = json.loads(Path(out).read_text())
    results["backend"] = backend
    return results


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(function, device: torch.device) -> float:
    """Seconds from a common start (barrier) until `function` is done on every rank (max over ranks)."""
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    function()
    _sync(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        elapsed = elapsed.to(device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _paired(first, second, repeats: int, device: torch.device) -> tuple[list[float], list[float]]:
    """`repeats` timings of each function, alternating which goes first."""
    a_times, b_times = [], []
    for repeat in range(repeats):
        order = [(first, a_times), (second, b_times)]
        for function, sink in order if repeat % 2 == 0 else order[::-1]:
            sink.append(_timed(function, device))
    return a_times, b_times


# ---------------------------------------------------------------------------------- (a) bandwidth


def _bandwidth(bridge, settings: dict) -> list[dict]:
    route = bridge.output_routes[0][0]
    is_teacher = bridge.is_teacher
    rows = []
    for size_mib in settings["sizes_mib"]:
        nbytes = size_mib * MIB
        vocab = 32768
        shape = (1, nbytes // (4 * vocab), vocab)
        logits = torch.randn(shape, generator=torch.Generator().manual_seed(size_mib)).to(bridge.device)
        raw = logits.clone()  # what the receiver's raw broadcast overwrites; also the expected value
        inner = max(1, 128 // size_mib)  # each timing moves at least 128 MiB

        def send_logits(inner=inner, logits=logits):
            for _ in range(inner):
                bridge.send_logits(0, logits if is_teacher else None)

        def raw_broadcast(inner=inner, raw=raw):
            for _ in range(inner):
                dist.broadcast(raw, src=route.src, group=route.group)

        # Warm up: the first calls carry the spec, later ones find it cached and the header rides along.
        for _ in range(3):
            arrived = bridge.send_logits(0, logits if is_teacher else None)
        assert is_teacher or torch.equal(arrived, raw)
        raw_broadcast()
        meshkd_times, raw_times = _paired(send_logits, raw_broadcast, settings["bandwidth_repeats"], bridge.device)
        moved = nbytes * inner
        rows.append({
            "size_mib": size_mib,
            "meshkd_gbps": moved / statistics.median(meshkd_times) / 1e9,
            "raw_gbps": moved / statistics.median(raw_times) / 1e9,
            "ratio": median_ratio(raw_times, meshkd_times),
        })  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------ (b) latency


def _small_batch(device: torch.device) -> dict:
    """The shape of a recipe micro-batch plus a nested extra: 5 tensors, 36 KiB."""
    ids = torch.arange(2 * 512, device=device).view(2, 512)
    return {
        "input_ids": ids, "labels": ids + 1, "attention_mask": torch.ones_like(ids),
        "position_ids": ids % 512, "meta": {"documents": torch.arange(16, dtype=torch.int32, device=device), "step": 3},
    }  # fmt: skip


def _reference_send_batch(value, route, device: torch.device):
    """The reference design: pickle the structure every call, then one broadcast per tensor leaf."""
    from meshkd.core import wire

    is_source = dist.get_rank() == route.src
    tensors: list[torch.Tensor] = []
    holder = [wire.tree_spec(value, tensors) if is_source else None]
    dist.broadcast_object_list(holder, src=route.src, group=route.group, device=device)
    if not is_source:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in wire.leaf_specs(holder[0])]
    for tensor in tensors:
        dist.broadcast(tensor, src=route.src, group=route.group)
    return value if is_source else wire.tree_from_spec(holder[0], tensors)


def _latency(bridge, settings: dict) -> dict:
    route = bridge.input_routes[0][0]
    batch = _small_batch(bridge.device) if bridge.is_student else None
    calls = settings["latency_calls"]

    def meshkd():
        for _ in range(calls):
            bridge.send_batch(0, batch)

    def reference():
        for _ in range(calls):
            _reference_send_batch(batch, route, bridge.device)

    meshkd()  # warm up both, and check that both deliver the same batch
    reference()
    arrived = (bridge.send_batch(0, batch), _reference_send_batch(batch, route, bridge.device))
    if bridge.is_teacher:
        expected = _small_batch(bridge.device)
        for got in arrived:
            assert all(torch.equal(got[key], expected[key]) for key in ("input_ids", "labels", "position_ids"))
    meshkd_times, reference_times = _paired(meshkd, reference, settings["latency_repeats"], bridge.device)
    from meshkd.core import wire

    return {
        "batch_bytes": wire.payload_nbytes(_small_batch(torch.device("cpu"))),
        "num_leaves": 5,
        "meshkd_us": statistics.median(meshkd_times) / calls * 1e6,
        "reference_us": statistics.median(reference_times) / calls * 1e6,
        "ratio": median_ratio(meshkd_times, reference_times),
    }


# ------------------------------------------------------------------------------------ (d) overlap


def _overlap(bridge, settings: dict) -> list[dict]:
    from meshkd.core.teacher_protocol import TeacherClient, TeacherRequest, TeacherServer

    logits = torch.randn(2, 256, 2048, device=bridge.device)  # 4 MiB of float32 logits per micro-batch
    count = settings["overlap_micro_batches"]
    rows = []
    teacher = TeacherClient(bridge) if bridge.is_student else None
    for student_s, teacher_s in settings["overlap"]:
        if bridge.is_teacher:
            def forward(request, teacher_s=teacher_s) -> dict:
                time.sleep(teacher_s)
                return {"mode": "full", "logits": logits}

            for _ in range(2 * settings["overlap_repeats"]):  # the recipe's teacher loop
                TeacherServer(bridge).serve(forward)
            continue

        def request(index: int) -> TeacherRequest:
            return TeacherRequest({"input_ids": torch.full((2, 256), index, device=bridge.device)}, "full")

        def synchronous(student_s=student_s) -> list[float]:
            marks = [time.perf_counter()]
            for index in range(count):
                teacher.request(request(index).batch, "full")
                time.sleep(student_s)  # train on the micro-batch
                marks.append(time.perf_counter())
            teacher.close()
            return marks

        def overlapped(student_s=student_s) -> list[float]:
            marks = [time.perf_counter()]
            with teacher.prefetch(range(count), batch_fn=request) as prefetcher:
                for _ in prefetcher:
                    time.sleep(student_s)
                    marks.append(time.perf_counter())
            teacher.close()
            return marks

        sync_steps, overlap_steps = [], []
        for repeat in range(settings["overlap_repeats"]):
            order = [(synchronous, sync_steps), (overlapped, overlap_steps)]
            for function, sink in order if repeat % 2 == 0 else order[::-1]:
                marks = function()
                # Steady state: skip the first micro-batch (it waits for a teacher that had no head start).
                sink.append(statistics.median(b - a for a, b in itertools.pairwise(marks[1:])))
        bound = max(student_s, teacher_s)
        rows.append({
            "student_ms": student_s * 1e3, "teacher_ms": teacher_s * 1e3,
            "sync_ms": statistics.median(sync_steps) * 1e3, "overlap_ms": statistics.median(overlap_steps) * 1e3,
            "sync_ratio": statistics.median(t / bound for t in sync_steps),
            "overlap_ratio": statistics.median(t / bound for t in overlap_steps),
            "overlap_vs_sync": median_ratio(overlap_steps, sync_steps),
        })  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------- report


def _targets(results: dict) -> list[dict]:
    targets = []

    def add(name, value, goal, met):
        targets.append({"target": name, "value": value, "goal": goal, "met": bool(met)})

    for row in results.get("bandwidth", []):
        if row["size_mib"] >= 16:
            add(f"send_logits / raw broadcast bandwidth, {row['size_mib']} MiB", row["ratio"], ">= 0.95",
                row["ratio"] >= 0.95)
    if "latency" in results:
        ratio = results["latency"]["ratio"]
        add("send_batch latency / reference", ratio, "<= 0.5", ratio <= 0.5)
    seen_bytes = set()
    for row in results.get("modes", {}).get("rows", []):
        where = f"{row['student']} student, T={row['temperature']:g}"
        compact = ("full_bf16", "topk k=64 (rest bucket)", "topk k=64 +32 tail samples")
        if row["mode"] in compact and row["mode"] not in seen_bytes:
            seen_bytes.add(row["mode"])  # bytes depend on neither the student nor T
            goal, met = ("= 0.5", abs(row["bytes_ratio"] - 0.5) < 1e-9) if row["mode"] == "full_bf16" else (
                "<= 0.005", row["bytes_ratio"] <= 0.005)
            add(f"{row['mode']}: bytes / full fp32", row["bytes_ratio"], goal, met)
        if " k=64 " in row["mode"]:
            add(f"{row['mode']}: KD rel error, {where}", row["kd_rel_error"], "|.| <= 0.01",
                abs(row["kd_rel_error"]) <= 0.01)
        if "decode_kl_max" in row:
            add(f"{row['mode']}: decoded answer's KL to the exact top-k, largest a token, {where}",
                row["decode_kl_max"], "<= 1e-3", row["decode_kl_max"] <= 1e-3)
    for row in results.get("overlap", []):
        if row["student_ms"] == 200 and row["teacher_ms"] == 200:
            add("overlapped step / max(student, teacher), 200 ms each", row["overlap_ratio"], "<= 1.15",
                row["overlap_ratio"] <= 1.15)
    for row in results.get("loading", {}).get("layouts", []):
        if row["loading"] == "sharded":
            add(f"loading peak memory / tp 1, {row['model']} {row['layout']}, largest rank", max(row["ratio"]),
                "<= 0.6", max(row["ratio"]) <= 0.6)
    if "cache" in results:
        value = results["cache"]["bytes_per_position"]
        add("teacher cache bytes per training position, top-64 + 32 tail", value, "<= 1024", value <= 1024)
    if "data" in results:
        data = results["data"]
        add("token store: prepare / tokenizer batch-encoding throughput, largest corpus",
            data["rows"][-1]["throughput_ratio"], ">= 0.8", data["rows"][-1]["throughput_ratio"] >= 0.8)
        add("token store: a rank's peak memory, largest / smallest corpus", data["peak_growth"], "<= 1.1",
            data["peak_growth"] <= 1.1)
        add("token store: seconds to the first batch, largest corpus", data["rows"][-1]["first_batch_s"], "<= 5",
            data["rows"][-1]["first_batch_s"] <= 5)
    for row in results.get("output_layer", []):
        if "ratio" in row:
            add(f"fused / whole-logits output layer + loss peak memory, {row['tokens']} tokens", row["ratio"],
                "<= 0.1 at 32k", row["tokens"] < 32768 or row["ratio"] <= 0.1)
        if "time_ratio" in row and row["tokens"] == 2048:
            add("fused / whole-logits output layer + loss time, 2048 tokens", row["time_ratio"], "<= 1.1",
                row["time_ratio"] <= 1.1)
    for row in results.get("memory", []):
        name = f"vocab {row['vocab']}, chunk {row['chunk_size']}"
        add(f"chunked / naive KD loss peak memory, {name}", row["ratio"], "<= 0.25", row["ratio"] <= 0.25)
        add(f"chunked KD loss value vs float64, {name}", row["chunked_vs_float64"], "<= 1e-6",
            row["chunked_vs_float64"] <= 1e-6)
        add(f"chunked vs naive KD loss value, {name}", row["chunked_vs_naive"], "<= 1e-6",
            row["chunked_vs_naive"] <= 1e-6)
    return targets


def _table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in header]] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [title, "  ".join(c.rjust(w) for c, w in zip(cells[0], widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells[1:]]
    return "\n".join(lines)


def _report(results: dict) -> str:
    meta = results["meta"]
    parts = [f"backend: {meta['backend']}, torch {meta['torch']}, {meta['cpus']} CPUs, quick={meta['quick']}"]
    if "bandwidth" in results:
        parts.append(_table(
            "(a) send_logits vs raw dist.broadcast (same bytes, same route group); "
            "ratio = median(raw time / meshkd time)",
            ["MiB", "meshkd GB/s", "raw GB/s", "ratio"],
            [[r["size_mib"], r["meshkd_gbps"], r["raw_gbps"], r["ratio"]] for r in results["bandwidth"]],
        ))  # fmt: skip
    if "latency" in results:
        r = results["latency"]
        parts.append(_table(
            "(b) send_batch latency, small nested batch; ratio = median(meshkd time / reference time)",
            ["bytes", "leaves", "meshkd us", "reference us", "ratio"],
            [[r["batch_bytes"], r["num_leaves"], r["meshkd_us"], r["reference_us"], r["ratio"]]],
        ))  # fmt: skip
    if "modes" in results:
        m = results["modes"]
        parts.append(_table(
            f"(c) logits modes on demo-teacher logits (vocab {m['vocab']}, {m['samples']} samples x "
            f"{m['tokens_per_sample']} tokens; medians over samples; worst = largest |error|; grad errors are "
            "relative L2 errors of d loss / d logits and of the output-head weight gradient)",
            ["student", "mode", "T", "bytes/token", "bytes / fp32", "KD full", "KD rel err", "worst",
             "logit grad err", "head grad err"],
            [[r["student"], r["mode"], r["temperature"], r["bytes_per_token"], r["bytes_ratio"], r["kd_full"],
              r["kd_rel_error"], r["kd_rel_error_worst"], r["grad_rel_error"], r["head_grad_rel_error"]]
             for r in m["rows"]],
        ))  # fmt: skip
        parts.append(_table(
            "(c'') answers that travel packed (topk_compact: kd.topk_encoding: compact): the decoded answer's KL to "
            "the answer it packs, nats a token (mean, largest); DistillKit's offline top-50 format: about 114 bytes "
            "a token",
            ["student", "mode", "T", "bytes/token", "decode KL mean", "decode KL max"],
            [[r["student"], r["mode"], r["temperature"], r["bytes_per_token"], r["decode_kl_mean"],
              r["decode_kl_max"]] for r in m["rows"] if "decode_kl_mean" in r],
        ))  # fmt: skip
        c = m["cache_coding"]
        parts.append(_table(
            f"(c''') the teacher cache's top-k answers on {c['tokens']} tokens (coding tables fitted on "
            f"{c['fit_tokens']} others): shard bytes a token, the decoded answer's KL to the exact top-k (nats "
            "a token, mean, largest), write and read tokens/s on one thread; DistillKit's budget setting (quoted): "
            "114 bytes a token at k = 50, KL 4.7e-2 mean / 2.58 largest",
            ["k", "tail", "form", "bytes/token", "KL mean", "KL max", "write tok/s", "read tok/s", "= fixed"],
            [[r["k"], r["tail_samples"], r["form"], r["bytes_per_token"], r.get("kl_mean", 0.0), r.get("kl_max", 0.0),
              r["write_tokens_per_s"], r["read_tokens_per_s"], r.get("same_as_fixed", "")] for r in c["rows"]],
        ))  # fmt: skip
        parts.append(_table(
            "(c4) wire bytes a token of each kind of answer (random logits and hidden states; the cache holds the "
            "same, compact answers entropy coded as above), and the teacher head a student rank holds for hidden "
            "answers (bfloat16; under tp 2 half of it)",
            ["vocab", "width", "mode", "bytes/token", "head MiB"],
            [[r["vocab"], r["width"], r["mode"], r["bytes_per_token"], r["head_mib"]] for r in m["answer_sizes"]],
        ))  # fmt: skip
        parts.append(_table(
            "(c') kd.hidden_states beside the logits: wire bytes per token of the teacher's paired layers' outputs",
            ["pairs", "dtype", "width", "bytes/token"],
            [[r["pairs"], r["dtype"], r["width"], r["bytes_per_token"]] for r in m["hidden_states"]],
        ))  # fmt: skip
    if "overlap" in results:
        parts.append(_table(
            "(d) time per micro-batch, steady state; ratios to max(student, teacher)",
            ["student ms", "teacher ms", "sync ms", "overlap ms", "sync ratio", "overlap ratio", "overlap / sync"],
            [[r["student_ms"], r["teacher_ms"], r["sync_ms"], r["overlap_ms"], r["sync_ratio"], r["overlap_ratio"],
              r["overlap_vs_sync"]] for r in results["overlap"]],
        ))  # fmt: skip
    if "memory" in results:
        parts.append(_table(
            "(e) KD loss peak memory above its inputs, the [tokens, vocab] logit gradient included (forward + "
            "backward, fresh process each); ratio = chunked / naive; value columns: relative differences",
            ["vocab", "sequence", "chunk", "inputs MiB", "naive MiB", "chunked MiB", "ratio", "chunked vs naive",
             "chunked vs fp64", "naive vs fp64"],
            [[r["vocab"], r["sequence"], r["chunk_size"], r["input_mib"], r["naive_mib"], r["chunked_mib"], r["ratio"],
              r["chunked_vs_naive"], r["chunked_vs_float64"], r["naive_vs_float64"]] for r in results["memory"]],
        ))  # fmt: skip
    if "output_layer" in results:
        parts.append(_table(
            "(f) one micro-batch's output layer + CE + KD (top-64 + 32 tail), forward + backward, vocabulary 151936, "
            "width 896: peak MiB above the inputs, whole logits (hidden @ W^T, then the chunked losses) against the "
            "output layer fused with the loss (chunks of 1024 tokens), the output layer's matmuls in float32 or "
            "bfloat16; whole logits only where they fit",
            ["dtype", "tokens", "logits MiB", "whole MiB", "fused MiB", "ratio", "whole s", "fused s", "time ratio",
             "value diff"],
            [[r["dtype"], r["tokens"], r["logits_mib"], r.get("whole_mib", "-"), r["fused_mib"], r.get("ratio", "-"),
              r.get("whole_s", "-"), r["fused_s"], r.get("time_ratio", "-"), r.get("value_difference", "-")]
             for r in results["output_layer"]],
        ))  # fmt: skip
    parts.append(_table(
        "targets", ["target", "value", "goal", "met"],
        [[t["target"], t["value"], t["goal"], "yes" if t["met"] else "NO"] for t in results["targets"]],
    ))  # fmt: skip
    return "\n\n".join(parts)


def run(sections: list[str], quick: bool) -> dict:
    """The results of `sections` (of SECTIONS); the world sections share one world."""
    settings = _settings(quick)
    results: dict = {}
    world_sections = [name for name in ("bandwidth", "latency", "overlap") if name in sections]
    if world_sections:
        world = _run_world(world_sections, settings)
        world.pop("backend")
        results.update(world)
    if "modes" in sections:
        results["modes"] = modes.measure(settings)
    if "memory" in sections:
        results["memory"] = memory.measure(settings)
        results["output_layer"] = memory.output_layer(settings["output_tokens"],
                                                      whole_up_to=settings["output_whole_up_to"])
        # A bfloat16 student's fused path beside float32's; the whole logits' peak is the float32 rows'.
        results["output_layer"] += memory.output_layer(settings["output_bfloat16_tokens"], whole_up_to=0,
                                                       dtype="bfloat16")
    return results


def report(results: dict) -> str:
    """The tables of the sections in `results`, the targets they meet or miss, what was skipped or failed."""
    results["targets"] = _targets(results)
    notes = [f"skipped {name}: {why}" for name, why in results.get("skipped", {}).items()]
    notes += [f"FAILED {name}: {error}" for name, error in results.get("failed", {}).items()]
    return "\n\n".join([_report(results), *notes])

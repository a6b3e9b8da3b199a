"""The transport bench's `memory` section: peak memory of the chunked KD loss against the plain one, and of one
micro-batch's output layer and loss, fused (`meshkd.core.fused_output`) against whole logits.

Each measurement runs in a fresh process (`python -m meshkd.bench.memory --memory-probe ...`): after the
inputs exist the kernel's peak-RSS counter is reset and VmHWM is read after backward (on CUDA:
max_memory_allocated); the values are compared with a float64 evaluation. See `meshkd.bench.transport`
for the whole bench.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from meshkd.bench.measure import MIB, median_ratio, status_kib


def _memory_probe(kind: str, vocab: int, sequence: int, chunk_size: int) -> dict:
    """Run in a fresh process: peak bytes of one KD loss forward + backward above its inputs, and its value.

    kind: "naive" (the plain full-softmax path), "chunked", or "float64" (the value only, chunked in float64
    without a gradient: the reference both float32 values are compared with).
    """
    from meshkd.core.loss import kd_loss

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    generator = torch.Generator(device=device).manual_seed(0)
    student = 3 * torch.randn(sequence, vocab, generator=generator, device=device)
    teacher = 3 * torch.randn(sequence, vocab, generator=generator, device=device)
    labels = torch.zeros(sequence, dtype=torch.int64, device=device)
    if kind == "float64":
        with torch.no_grad():
            value = kd_loss(student.double(), teacher.double(), labels, chunk_size=chunk_size)
        return {"peak_bytes": 0, "value": float(value)}
    student.requires_grad_()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS (inputs touched already)
        base = status_kib("VmRSS") * 1024
    loss = kd_loss(student, teacher, labels, chunk_size=None if kind == "naive" else chunk_size)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = status_kib("VmHWM") * 1024
    return {"peak_bytes": peak - base, "value": float(loss.detach())}


OUTPUT_VOCAB, OUTPUT_WIDTH = 151936, 896  # Qwen2.5-0.5B's vocabulary and width


def _output_probe(kind: str, tokens: int, chunk_size: int, dtype: str = "float32") -> dict:
    """Run in a fresh process: peak bytes above the inputs of one micro-batch's output layer, CE and KD against a
    top-64 + 32 tail answer (0.5 each), forward and backward, by whole logits ("whole": hidden @ W^T, then the
    chunked losses) or fused ("fused"), and its seconds; `dtype` "bfloat16": the output layer's matmul in
    bfloat16 on float32 weights (whole: under autocast; fused: its `compute_dtype`). On CUDA the pass runs once
    to warm up (kernels, cuBLAS workspace) and the second is measured."""
    import time

    from meshkd.core.answers.topk import TopK
    from meshkd.core.fused_output import chunk_answer, fused_output_loss
    from meshkd.core.loss import cross_entropy_loss
    from meshkd.recipe.settings.config import KDConfig

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    generator = torch.Generator().manual_seed(0)
    vocab, k, m = OUTPUT_VOCAB, 64, 32
    hidden = torch.randn(tokens, OUTPUT_WIDTH, generator=generator).to(device).requires_grad_()
    weight = (torch.randn(vocab, OUTPUT_WIDTH, generator=generator) * 0.02).to(device).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
    spread = (torch.arange(k + m) * 1500 + torch.randint(0, vocab, (tokens, 1), generator=generator)) % vocab
    mass = torch.randn(tokens, k + 1, generator=generator).mul(3).log_softmax(-1)
    top = mass[:, :k].sort(dim=-1, descending=True).values
    answer = {"mode": "topk", "temperature": 1.0, "log_probs": top, "indices": spread[:, :k].to(torch.int32),
              "tail_log_prob": mass[:, k], "tail_indices": spread[:, k:].to(torch.int32),
              "tail_log_probs": (mass[:, k:] - math.log(m)).expand(-1, m).contiguous()}
    answer = {key: value.to(device) if torch.is_tensor(value) else value for key, value in answer.items()}

    def objective(logits, tokens_of, cut=lambda a: a):
        ce = cross_entropy_loss(logits, labels[tokens_of], num_valid_tokens=tokens, chunk_size=chunk_size)
        kd = TopK.kernel(logits, cut(answer), labels[tokens_of], KDConfig(), norm=tokens, chunk_size=chunk_size)
        return 0.5 * ce + 0.5 * kd

    compute_dtype = getattr(torch, dtype)

    def one_pass():
        if kind == "whole":
            with torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
                logits = hidden @ weight.T
            loss = objective(logits.float(), slice(None))
        else:
            loss = fused_output_loss(hidden, weight, lambda logits, cut: objective(
                logits, cut, lambda a: chunk_answer(a, cut, (tokens,))), chunk_size=chunk_size,
                compute_dtype=compute_dtype)
        loss.backward()
        return loss

    if cuda:
        one_pass()
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")
        base = status_kib("VmRSS") * 1024
    started = time.perf_counter()
    loss = one_pass()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if cuda else status_kib("VmHWM") * 1024
    return {"peak_bytes": peak - base, "seconds": seconds, "value": float(loss.detach())}


def output_layer(tokens_list: list[int], *, whole_up_to: int, chunk_size: int = 1024,
                 dtype: str = "float32") -> list[dict]:
    """Per token count: both paths' peak MiB, seconds and loss value (whole logits only up to `whole_up_to`
    tokens, beyond what fits this machine's memory); `dtype`: the output layer's compute dtype."""
    rows = []
    for tokens in tokens_list:
        row = {"tokens": tokens, "vocab": OUTPUT_VOCAB, "width": OUTPUT_WIDTH, "dtype": dtype,
               "logits_mib": tokens * OUTPUT_VOCAB * 4 / MIB}
        for kind in ("fused", "whole") if tokens <= whole_up_to else ("fused",):
            command = [sys.executable, "-m", __name__, "--output-probe", kind, str(tokens), str(chunk_size), dtype]
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            row.update({f"{kind}_mib": result["peak_bytes"] / MIB, f"{kind}_s": result["seconds"],
                        f"{kind}_value": result["value"]})
        if "whole_mib" in row:
            row.update(ratio=row["fused_mib"] / row["whole_mib"], time_ratio=row["fused_s"] / row["whole_s"],
                       value_difference=abs(row["fused_value"] / row["whole_value"] - 1))
        rows.append(row)
        print(f"meshkd bench memory, output layer: {json.dumps(row)}", flush=True)
    return rows


def _step_probe(kind: str, tokens: int) -> dict:
    """Run in a fresh process: peak bytes above the model of one micro-batch's forward and backward through a
    transformers model (a one-layer Llama of width 64 with Qwen2.5's vocabulary, CE on `tokens` positions, as
    the trainer computes it): "whole" from its logits, "fused" from its last hidden states through `FusedHead.loss`
    (what `meshkd train` does), so the peak counts what the model hands back and its gradient too, not the kernel
    alone."""
    import time

    from transformers import LlamaConfig, LlamaForCausalLM

    from meshkd.core.loss import cross_entropy_loss
    from meshkd.recipe.settings.config import KDConfig
    from meshkd.recipe.student.fused_head import FusedHead
    from meshkd.recipe.teacher.teacher_answers import LossContext

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=OUTPUT_VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    ids = torch.randint(0, OUTPUT_VOCAB, (1, tokens))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "position_ids": torch.arange(tokens)[None],
             "attention_mask": torch.ones_like(ids)}
    kd = KDConfig(kd_ratio=0.0, chunk_size=1024)
    head = FusedHead(model.lm_head, kd=kd, vocab_size=OUTPUT_VOCAB)
    norm = torch.tensor(float(tokens))
    Path("/proc/self/clear_refs").write_text("5")
    base = status_kib("VmRSS") * 1024
    started = time.perf_counter()
    if kind == "whole":
        logits = model(input_ids=ids, position_ids=batch["position_ids"]).logits
        loss = cross_entropy_loss(logits, batch["labels"], num_valid_tokens=norm, chunk_size=1024)
    else:
        loss, _ = head.loss(head.hidden_states(model, None, batch), batch, None, LossContext(kd), norm=norm)
    loss.backward()
    return {"peak_bytes": status_kib("VmHWM") * 1024 - base, "seconds": time.perf_counter() - started,
            "value": float(loss.detach())}


def training_step(tokens_list: list[int]) -> list[dict]:
    """Per token count: `_step_probe`'s peak MiB, seconds and loss of both paths, side by side."""
    rows = []
    for tokens in tokens_list:
        row = {"tokens": tokens, "vocab": OUTPUT_VOCAB, "logits_mib": tokens * OUTPUT_VOCAB * 4 / MIB}
        for kind in ("fused", "whole"):
            command = [sys.executable, "-m", "meshkd.bench.memory", "--step-probe", kind, str(tokens)]
            result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True)
                                .stdout.strip().splitlines()[-1])
            row.update({f"{kind}_mib": result["peak_bytes"] / MIB, f"{kind}_s": result["seconds"],
                        f"{kind}_value": result["value"]})
        row.update(ratio=row["fused_mib"] / row["whole_mib"], time_ratio=row["fused_s"] / row["whole_s"])
        rows.append(row)
        print(f"meshkd bench memory, training step: {json.dumps(row)}", flush=True)
    return rows


def _probe(kind: str, vocab: int, sequence: int, chunk_size: int) -> dict:
    command = [sys.executable, "-m", __name__, "--memory-probe", kind, str(vocab), str(sequence), str(chunk_size)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(settings: dict) -> list[dict]:
    """The section's rows: per vocabulary and chunk size, peak MiB of both losses (medians) and their errors."""
    sequence = settings["memory_sequence"]
    rows = []
    for vocab in settings["memory_vocabs"]:
        exact = _probe("float64", vocab, sequence, 128)["value"]
        naive, chunked = [], {size: [] for size in settings["memory_chunk_sizes"]}
        for repeat in range(settings["memory_repeats"]):
            order = [("naive", None, naive)] + [("chunked", size, sink) for size, sink in chunked.items()]
            for kind, size, sink in order if repeat % 2 == 0 else order[::-1]:
                sink.append(_probe(kind, vocab, sequence, size or 0))
        for size, runs in chunked.items():
            rows.append({
                "vocab": vocab, "sequence": sequence, "chunk_size": size,
                "input_mib": 2 * sequence * vocab * 4 / MIB,
                "naive_mib": statistics.median(r["peak_bytes"] for r in naive) / MIB,
                "chunked_mib": statistics.median(r["peak_bytes"] for r in runs) / MIB,
                "ratio": median_ratio([r["peak_bytes"] for r in runs], [r["peak_bytes"] for r in naive]),
                "chunked_vs_naive": max(abs(c["value"] / n["value"] - 1) for c, n in zip(runs, naive)),
                "chunked_vs_float64": max(abs(c["value"] / exact - 1) for c in runs),
                "naive_vs_float64": max(abs(n["value"] / exact - 1) for n in naive),
            })  # fmt: skip
    return rows


if __name__ == "__main__":  # the memory section's fresh processes
    if len(sys.argv) > 1 and sys.argv[1] == "--memory-probe":
        kind, vocab, sequence, chunk = sys.argv[2], *map(int, sys.argv[3:6])
        print(json.dumps(_memory_probe(kind, vocab, sequence, chunk)))
    elif len(sys.argv) > 1 and sys.argv[1] == "--output-probe":
        print(json.dumps(_output_probe(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])))
    elif len(sys.argv) > 1 and sys.argv[1] == "--step-probe":
        print(json.dumps(_step_probe(sys.argv[2], int(sys.argv[3]))))
    elif len(sys.argv) > 1 and sys.argv[1] == "--training-step":  # rows of both paths: --training-step 2048 8192
        training_step([int(tokens) for tokens in sys.argv[2:]])

"""Step time and peak memory of one student trained in float32, mixed bfloat16 and pure bfloat16.

    meshkd bench --only precision [--quick] [--json OUT]

The same work for each: a random Llama (hidden 512, 8 layers, vocabulary 32000, untied: 56 M parameters;
hidden 256, 4 layers, vocabulary 8192, 7 M, with --quick) trains 4 steps of one row of 128 tokens (64)
with AdamW, CE loss, gradient clipping (few tokens: the weights and optimizer states, which the precision
changes, dominate the peak), laid out by `parallelize_student` on one rank as
`meshkd train` lays out a one-process student: float32 (`model.dtype: float32`), mixed (`bfloat16`: float32
master weights and optimizer states, forward under autocast) and pure (`bfloat16` with
`pure_half_precision`). Each runs in a fresh process, so that its peak is its own: VmHWM above the import
floor on the CPU (Linux), `torch.cuda.max_memory_allocated` on a GPU. Step time: the median of the steps
after the second. State bytes: parameters, their gradients and the optimizer states, per parameter.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from meshkd.bench.measure import status_kib
from meshkd.core.local_world import spawn_world

VARIANTS = {"float32": ("float32", "float32"), "mixed bfloat16": ("float32", "bfloat16"),
            "pure bfloat16": ("bfloat16", "bfloat16")}  # name: (parameter dtype, compute dtype)


def _student(quick: bool) -> dict:
    hidden, layers, vocab = (256, 4, 8192) if quick else (512, 8, 32000)
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": hidden * 11 // 4,
            "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": vocab,
            "max_position_embeddings": 1024, "tie_word_embeddings": False}


def _rank_main(rank: int, variant: str, quick: bool, out: str, lora: dict | None = None) -> None:
    """Train the student as `variant` says (with `lora`: a `PeftConfig`'s keys, its adapters alone) and write
    OUT/result.json."""
    import torch

    from meshkd.core.loss import cross_entropy_loss
    from meshkd.core.topology import create_kd_distributed_setups
    from meshkd.parallel.data_parallel import clip_grad_norm, parallelize_student
    from meshkd.recipe.modeling.models import load_causal_lm

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    parameter_dtype, compute_dtype = VARIANTS[variant]
    setup = create_kd_distributed_setups({"distributed": {"dp_size": 1}}, 1).student
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident memory
    floor = 0 if cuda else status_kib("VmRSS")
    random_init = _student(quick)
    # A LoRA student's frozen base is kept in the compute dtype, as `meshkd train` keeps it.
    model = load_causal_lm(random_init=random_init, dtype=compute_dtype if lora is not None else parameter_dtype)
    if lora is not None:
        from meshkd.recipe.modeling.adapters import add_adapters
        from meshkd.recipe.settings.config import PeftConfig

        add_adapters(model, PeftConfig(**lora), seed=0)
    model = parallelize_student(model.to(device).train(), setup, compute_dtype=getattr(torch, compute_dtype))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, foreach=False)
    rows, length = 1, (64 if quick else 128)
    generator = torch.Generator().manual_seed(0)
    times, state_bytes = [], 0
    for _ in range(4):
        tokens = torch.randint(0, random_init["vocab_size"], (rows, length + 1), generator=generator).to(device)
        started = time.perf_counter()
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = cross_entropy_loss(logits, tokens[:, 1:], num_valid_tokens=rows * length)
        loss.backward()
        clip_grad_norm(trained, 1.0)
        state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # weights
        state_bytes += sum(p.numel() * p.element_size() for p in trained)  # gradients
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    optimizer_bytes = sum(value.numel() * value.element_size() for state in optimizer.state.values()
                          for value in state.values() if torch.is_tensor(value) and value.dim() > 0)
    state_bytes += optimizer_bytes
    peak_mib = torch.cuda.max_memory_allocated() / 2**20 if cuda else (status_kib("VmHWM") - floor) / 1024
    parameters = sum(p.numel() for p in model.parameters())
    Path(out, "result.json").write_text(json.dumps({
        "step_time_s": statistics.median(times[2:]), "peak_mib": peak_mib, "parameters": parameters,
        "trainable_parameters": sum(p.numel() for p in trained), "optimizer_state_bytes": optimizer_bytes,
        "state_bytes_per_parameter": state_bytes / parameters, "final_loss": loss.item()}))


def measure(variant: str, quick: bool, lora: dict | None = None) -> dict:
    """One variant's figures (`_rank_main`'s result.json), measured in a fresh one-rank world."""
    with tempfile.TemporaryDirectory() as out:
        failure = spawn_world(1, _rank_main, (variant, quick, out, lora), timeout_s=600,
                              backend="nccl" if torch.cuda.is_available() else "gloo")
        if failure is not None:
            raise RuntimeError(f"{variant} benchmark{' with LoRA' if lora else ''} failed: {failure}")
        return json.loads(Path(out, "result.json").read_text())


def run_section(quick: bool) -> dict:
    """{"precision": results}, printed as they are measured; ratios are to float32's."""
    rows = []
    for variant in VARIANTS:
        row = {"variant": variant, **measure(variant, quick)}
        baseline = rows[0] if rows else row
        row.update(step_time_ratio=row["step_time_s"] / baseline["step_time_s"],
                   peak_ratio=row["peak_mib"] / baseline["peak_mib"])
        rows.append(row)
        print(f"precision {variant:>14}: step {row['step_time_s']:.3f} s ({row['step_time_ratio']:.2f} of float32), "
              f"peak {row['peak_mib']:.0f} MiB ({row['peak_ratio']:.2f}), "
              f"{row['state_bytes_per_parameter']:.1f} state bytes / parameter ({row['parameters'] / 1e6:.1f} M)")
    return {"precision": {"rows": rows, "student": _student(quick)}}

"""One process's training step: `meshkd train` against a hand-written loop of the same work.

    meshkd bench --only step [--quick] [--json OUT]

The work: the demo teacher (SmolLM2-135M-Instruct, 30 layers) and a student of 8 of its layers (0-3 and
26-29, tied embeddings as the teacher), 8 rows of 256 tokens a step in one micro-batch, float32, AdamW,
forward KL at temperature 1 (kd_ratio 1), gradient clipping at 1. `meshkd train` runs it in one process
(shared meshes, dp 1) on the standard library sources as the demo does; the hand loop, `hand_loop` below, is
written with plain transformers and torch only: the student pruned with `nn.ModuleList`, teacher logits under
`no_grad`, `log_softmax`, `kl_div` over the real tokens, backward, `clip_grad_norm_`, `AdamW.step`. Each runs
in a fresh process, in turn (meshkd, hand loop, meshkd, ...), so they never share the cores; the figure is
the median step time of each (the first step of a run left out: allocation and warm-up), and the ratio
meshkd / hand loop. A third side runs the same global batch in the demo's layout: 4 processes, the student
on 2 ranks (FSDP2, 4 rows each) and the teacher on 2 others (separate meshes), the demo's chunks of 1024
tokens. The hand loop's rows are unpacked runs of the same sources; both attend causally within
a row, meshkd within each packed document (its 4D masks are part of its work).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

KEEP_LAYERS = [0, 1, 2, 3, 26, 27, 28, 29]
ROWS, SEQUENCE, LR = 8, 256, 5e-4


def _settings(quick: bool) -> dict:
    return {"steps": 4 if quick else 7, "rounds": 2 if quick else 3}


def hand_loop(teacher_dir: str, steps: int) -> list[float]:
    """Seconds of each of `steps` training steps of the plain loop (transformers and torch only)."""
    import glob

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    student.model.layers = torch.nn.ModuleList(student.model.layers[i] for i in KEEP_LAYERS)
    student.config.num_hidden_layers = len(KEEP_LAYERS)
    for index, layer in enumerate(student.model.layers):
        layer.self_attn.layer_idx = index
    student.train()
    optimizer = torch.optim.AdamW(student.parameters(), lr=LR, weight_decay=0.0)
    stream: list[int] = []
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        stream.extend(tokenizer(Path(path).read_text(errors="replace"))["input_ids"])
        if len(stream) >= steps * ROWS * (SEQUENCE + 1):
            break
    times = []
    for step in range(steps):
        start = step * ROWS * (SEQUENCE + 1)
        ids = torch.tensor(stream[start:start + ROWS * (SEQUENCE + 1)]).view(ROWS, SEQUENCE + 1)
        inputs, labels = ids[:, :-1], ids[:, 1:]
        started = time.perf_counter()
        with torch.no_grad():
            teacher_logits = teacher(input_ids=inputs).logits
        logits = student(input_ids=inputs).logits
        real = labels.reshape(-1) >= 0
        student_log_probs = torch.log_softmax(logits.float().flatten(0, 1)[real], dim=-1)
        teacher_log_probs = torch.log_softmax(teacher_logits.float().flatten(0, 1)[real], dim=-1)
        loss = torch.nn.functional.kl_div(student_log_probs, teacher_log_probs, log_target=True, reduction="sum")
        (loss / real.sum()).backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return times


def _meshkd_config(teacher_dir: str, run_dir: Path, steps: int, demo_layout: bool) -> dict:
    stdlib = sysconfig.get_paths()["stdlib"]
    layout = {"separate_meshes": False, "distributed": {"dp_size": 1}}
    if demo_layout:
        layout = {"separate_meshes": True, "distributed": {"dp_size": 2}, "teacher_distributed": {"dp_size": 2}}
    return {
        "model": {"path": teacher_dir, "keep_layers": KEEP_LAYERS},
        "teacher_model": {"path": teacher_dir},
        **layout,
        "kd": {"kd_ratio": 1.0, "temperature": 1.0, "chunk_size": 1024 if demo_layout else None},
        "dataset": {"paths": [f"{stdlib}/*.py"], "val_fraction": 0.05, "max_documents": 160,
                    "max_document_chars": 6000, "seed": 0},
        "step_scheduler": {"max_steps": steps, "global_batch_size": ROWS, "local_batch_size": ROWS // 2 if demo_layout
                           else ROWS,
                           "sequence_length": SEQUENCE, "val_batches": 1},
        "optimizer": {"lr": LR, "weight_decay": 0.0, "max_grad_norm": 1.0},
        "lr_scheduler": {"warmup_steps": 0},
        "checkpoint": {"enabled": False},
        "logging": {"run_dir": str(run_dir), "progress_bar": False},
    }


def _meshkd_steps(teacher_dir: str, directory: Path, steps: int, name: str) -> list[float]:
    import yaml

    run_dir = directory / name
    config = directory / f"{name}.yaml"
    config.write_text(yaml.safe_dump(_meshkd_config(teacher_dir, run_dir, steps, name.startswith("demo"))))
    subprocess.run([sys.executable, "-m", "meshkd", "train", str(config)], check=True, capture_output=True,
                   text=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record["step_time_s"] for record in records if record["kind"] == "train"]


def _hand_steps(teacher_dir: str, steps: int) -> list[float]:
    done = subprocess.run([sys.executable, "-m", "meshkd.bench.step", teacher_dir, str(steps)], check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_section(quick: bool) -> dict:
    """{"step": results}, printed when measured; `quick`: 2 rounds of 4 steps of each side (else 3 of 7)."""
    from meshkd.recipe.modeling.models import converted_gguf, demo_teacher_source

    settings = _settings(quick)
    source = demo_teacher_source()
    teacher_dir = str(converted_gguf(source["path"], source["gguf_file"]))
    times: dict[str, list[float]] = {"meshkd": [], "hand_loop": [], "demo_layout": []}
    with tempfile.TemporaryDirectory() as directory:
        for round_index in range(settings["rounds"]):
            steps = settings["steps"]
            times["meshkd"] += _meshkd_steps(teacher_dir, Path(directory), steps, f"one_{round_index}")[1:]
            times["hand_loop"] += _hand_steps(teacher_dir, steps)[1:]
            times["demo_layout"] += _meshkd_steps(teacher_dir, Path(directory), steps, f"demo_{round_index}")[1:]
    medians = {name: statistics.median(values) for name, values in times.items()}
    hand_s = medians["hand_loop"]
    result = {"rows": ROWS, "sequence": SEQUENCE, "student_layers": len(KEEP_LAYERS), **settings,
              **{f"{name}_s": value for name, value in medians.items()},
              "ratio": medians["meshkd"] / hand_s, "demo_layout_ratio": medians["demo_layout"] / hand_s,
              **{f"{name}_steps_s": values for name, values in times.items()}}
    print(f"step of {ROWS} x {SEQUENCE} tokens, demo teacher + 8-layer student, fp32 (medians of "
          f"{len(times['meshkd'])} steps each): hand-written loop {hand_s:.2f} s; meshkd train in one process "
          f"{medians['meshkd']:.2f} s, ratio {result['ratio']:.2f} (goal <= 1.0); in the demo's 4-process layout "
          f"{medians['demo_layout']:.2f} s, ratio {result['demo_layout_ratio']:.2f}", flush=True)
    return {"step": result}


if __name__ == "__main__":  # the hand loop's own process: prints its step times as JSON
    print(json.dumps(hand_loop(sys.argv[1], int(sys.argv[2]))))

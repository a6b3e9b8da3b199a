"""Per-rank peak memory while loading a teacher of about 2 GB, laid out tp 2, pp 2 or ep 2, relative to tp 1.

    meshkd bench --only loading [--quick] [--json OUT]

A random Llama (hidden 2048, 8 layers, vocabulary 32000, untied: about 2.0 GB in float32) and a random
Qwen3-MoE (hidden 1024, 8 layers, 16 experts of width 768 per layer: about 1.6 GB) are written as
safetensors to a temporary directory, under the names transformers writes (the MoE's experts one tensor per
expert and projection, merged into the model's expert tensors while loading). Each layout then runs in fresh
processes (gloo): every rank imports torch and transformers, resets the kernel's peak-RSS counter
(/proc/self/clear_refs, "5"), builds the teacher as `meshkd train` does, runs one forward (so that every
weight it serves with is resident, memory-mapped ones included) and reads VmHWM: the peak resident memory of
loading, laying out and serving, above the import floor. Layouts: tp 1 (one process: the baseline), tp 2 and
pp 2 (two processes each; the MoE: tp 2, and ep 2, whole experts spread over the two tp ranks), with sharded
loading (`meshkd.parallel.sharded_loading`: meta parameters, layout, then this rank's share) and, for the
Llama, also the whole model loaded by every rank and then sharded. Ratio: a rank's peak / the tp 1 peak of
the same loading path. Linux only.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from meshkd.bench.measure import status_kib
from meshkd.core.local_world import spawn_world


def _write_model(directory: Path, kind: str, hidden: int, layers: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig
    from transformers.core_model_loading import revert_weight_conversion

    if kind == "llama":
        config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.6875),
                             num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                             tie_word_embeddings=False)
    else:  # a Qwen3-MoE of about the same size, most of it in 16 experts per layer
        config = Qwen3MoeConfig(vocab_size=32000, hidden_size=hidden // 2, num_hidden_layers=layers,
                                num_attention_heads=16, num_key_value_heads=8, head_dim=64, num_experts=16,
                                num_experts_per_tok=2, moe_intermediate_size=hidden * 3 // 8,
                                tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # The values do not matter for memory: uninitialized storage is written as it is, under the names
    # transformers stores them with (the MoE's experts one tensor per expert and projection).
    state = revert_weight_conversion(model, {name: torch.empty(tensor.shape) for name, tensor in
                                             model.state_dict().items()})
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(str(directory))


def _rank_main(rank: int, world: int, directory: str, layout: dict, sharded: bool, out: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401  (the import floor includes it)

    from meshkd.core.topology import create_kd_distributed_setups
    from meshkd.parallel.sharded_loading import empty_causal_lm, load_shards
    from meshkd.parallel.teacher_runner import TeacherRunner
    from meshkd.recipe.modeling.models import load_causal_lm

    setup = create_kd_distributed_setups({"distributed": layout}, world).student
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    floor = status_kib("VmRSS")
    if sharded:
        model, checkpoint = empty_causal_lm(directory, keep_layers=None, dtype=torch.float32,
                                            attn_implementation=None)
        runner = TeacherRunner(model, setup, device="cpu")
        load_shards(model, checkpoint, device="cpu")
    else:
        runner = TeacherRunner(load_causal_lm(path=directory), setup, device="cpu")
    # One forward, so that every weight the rank serves with is resident (a memory-mapped one counts too;
    # random token ids, so that an MoE routes them to many experts).
    runner.logits({"input_ids": torch.randint(0, 32000, (1, 64), generator=torch.Generator().manual_seed(0))})
    peak = status_kib("VmHWM") - floor
    Path(out, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "peak_mib": peak / 1024}))
    dist.barrier()


def _measure(directory: Path, layout: dict, world: int, sharded: bool) -> list[float]:
    with tempfile.TemporaryDirectory() as out:
        failure = spawn_world(world, _rank_main, (world, str(directory), layout, sharded, out), timeout_s=600)
        if failure is not None:
            raise RuntimeError(f"loading benchmark world failed: {failure}")
        records = sorted((json.loads(p.read_text()) for p in Path(out).glob("rank*.json")), key=lambda r: r["rank"])
    return [record["peak_mib"] for record in records]


def run_section(quick: bool) -> dict:
    """{"loading": results}, printed as they are measured; `quick`: teachers of hidden 1024 (about a quarter)."""
    hidden, layers = (1024, 8) if quick else (2048, 8)
    results: dict = {"layouts": []}
    tp2, pp2 = {"tp_size": 2, "dp_size": 1}, {"pp_size": 2, "dp_size": 1}
    ep2 = {"tp_size": 2, "ep_size": 2, "dp_size": 1}
    runs = (("llama", True, {"tp 2": tp2, "pp 2": pp2}), ("llama", False, {"tp 2": tp2, "pp 2": pp2}),
            ("qwen3_moe", True, {"tp 2": tp2, "ep 2 (tp 2)": ep2}))
    for kind in ("llama", "qwen3_moe"):
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            _write_model(directory, kind, hidden, layers)
            size = (directory / "model.safetensors").stat().st_size / 2**20
            print(f"{kind} teacher checkpoint: {size:.0f} MiB")
            for _, sharded, layouts in (run for run in runs if run[0] == kind):
                path = "sharded" if sharded else "whole, then sharded"
                baseline = _measure(directory, {"dp_size": 1}, 1, sharded)[0]
                for name, layout in layouts.items():
                    peaks = _measure(directory, layout, 2, sharded)
                    ratios = [peak / baseline for peak in peaks]
                    results["layouts"].append({"model": kind, "checkpoint_mib": size, "loading": path, "layout": name,
                                               "tp1_peak_mib": baseline, "peak_mib": peaks, "ratio": ratios})
                    print(f"{kind} {path:>20} {name}: per-rank peak {', '.join(f'{p:.0f}' for p in peaks)} MiB, "
                          f"/ tp 1 ({baseline:.0f} MiB) = {', '.join(f'{r:.2f}' for r in ratios)}")
    return {"loading": results}

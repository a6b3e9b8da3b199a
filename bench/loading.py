"""Per-rank peak memory while loading a teacher of about 2 GB, laid out tp 2 or pp 2, relative to tp 1.

    python bench/loading.py [--json OUT] [--hidden 2048] [--layers 8]

A random Llama (hidden 2048, 8 layers, vocabulary 32000, untied: about 2.0 GB in float32) is written once
as safetensors to a temporary directory. Each layout then runs in fresh processes (gloo): every rank
imports torch and transformers, resets the kernel's peak-RSS counter (/proc/self/clear_refs, "5"), builds
the teacher as `meshkd train` does, runs one forward (so that every weight it serves with is resident,
memory-mapped ones included) and reads VmHWM: the peak resident memory of loading, laying out and
serving, above the import floor. Layouts: tp 1 (one process: the baseline), tp 2 and pp 2 (two processes each),
each with sharded loading (`meshkd.sharded_loading`: meta parameters, layout, then this rank's share) and,
for comparison, the whole model loaded by every rank and then sharded. Ratio: a rank's peak / the tp 1
peak of the same loading path. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch.multiprocessing as mp


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _write_model(directory: Path, hidden: int, layers: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.6875),
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {name: tensor.shape for name, tensor in LlamaForCausalLM(config).state_dict().items()}
    # The values do not matter for memory: uninitialized storage is written as it is.
    save_file({name: torch.empty(shape) for name, shape in shapes.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(str(directory))


def _rank_main(rank: int, world: int, port: int, directory: str, layout: dict, sharded: bool, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401  (the import floor includes it)

    from meshkd.models import load_causal_lm
    from meshkd.parallel import TeacherRunner
    from meshkd.sharded_loading import empty_causal_lm, load_shards
    from meshkd.topology import create_kd_distributed_setups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    setup = create_kd_distributed_setups({"distributed": layout}, world).student
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    floor = _status_kib("VmRSS")
    if sharded:
        model, checkpoint = empty_causal_lm(directory, keep_layers=None, dtype=torch.float32,
                                            attn_implementation=None)
        runner = TeacherRunner(model, setup, device="cpu")
        load_shards(model, checkpoint, device="cpu")
    else:
        runner = TeacherRunner(load_causal_lm(path=directory), setup, device="cpu")
    # One forward, so that every weight the rank serves with is resident (a memory-mapped one counts too).
    runner.logits({"input_ids": torch.zeros(1, 16, dtype=torch.int64)})
    peak = _status_kib("VmHWM") - floor
    Path(out, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "peak_mib": peak / 1024}))
    dist.barrier()
    dist.destroy_process_group()


def _measure(directory: Path, layout: dict, world: int, sharded: bool) -> list[float]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank_main, args=(world, port, str(directory), layout, sharded, out), nprocs=world,
                           start_method="spawn", join=True)
        records = sorted((json.loads(p.read_text()) for p in Path(out).glob("rank*.json")), key=lambda r: r["rank"])
    return [record["peak_mib"] for record in records]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    results: dict = {"layouts": []}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        _write_model(directory, args.hidden, args.layers)
        results["checkpoint_mib"] = (directory / "model.safetensors").stat().st_size / 2**20
        print(f"teacher checkpoint: {results['checkpoint_mib']:.0f} MiB")
        for sharded in (True, False):
            path = "sharded" if sharded else "whole, then sharded"
            baseline = _measure(directory, {"dp_size": 1}, 1, sharded)[0]
            for name, layout in (("tp 2", {"tp_size": 2, "dp_size": 1}), ("pp 2", {"pp_size": 2, "dp_size": 1})):
                peaks = _measure(directory, layout, 2, sharded)
                ratios = [peak / baseline for peak in peaks]
                results["layouts"].append({"loading": path, "layout": name, "tp1_peak_mib": baseline,
                                           "peak_mib": peaks, "ratio": ratios})
                print(f"{path:>20} {name}: per-rank peak {', '.join(f'{p:.0f}' for p in peaks)} MiB, "
                      f"/ tp 1 ({baseline:.0f} MiB) = {', '.join(f'{r:.2f}' for r in ratios)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()

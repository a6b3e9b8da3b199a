"""The `meshkd` command: train, demo, plot.

`meshkd train CONFIG` validates the config in the calling process (a typo fails in a second, before any
process starts), then starts `--nproc` local processes through torch's own launcher
(torch.distributed.run: gloo on CPU, NCCL on CUDA). Inside an existing torchrun world it trains in that
world directly, so `torchrun --nproc-per-node 8 -m meshkd train CONFIG` works unchanged on a cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

from meshkd.config import ConfigError, KDRecipeConfig, load_config, required_world_size

_DEMO_CONFIG = "demo.yaml"


def _inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE", "LOCAL_RANK"} <= set(os.environ)


def _launch(nproc: int, args: list[str]) -> int:
    """Run `python -m meshkd ARGS` on `nproc` local processes under torch.distributed.run."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "meshkd", *args]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.call(command, env=env)


def _world_size(config: KDRecipeConfig, nproc: int | None) -> int:
    needed = required_world_size(config)
    if nproc is None:
        if needed is None:
            raise ConfigError("distributed.dp_size is null: pass --nproc N to say how many processes to start")
        return needed
    if needed is not None and needed != nproc:
        raise ConfigError(f"the config lays out {needed} ranks but --nproc is {nproc}")
    return nproc


def _train_here(config: KDRecipeConfig, resume: bool) -> dict:
    from meshkd.recipe import KDRecipe

    return KDRecipe(config, resume=resume).run()


def _train(config_path: str, overrides: list[str], nproc: int | None, resume: bool) -> int:
    config = load_config(config_path, overrides)
    if _inside_torchrun():
        _train_here(config, resume)
        return 0
    args = ["train", config_path, *[item for o in overrides for item in ("--set", o)]] + (["--resume"] if resume else [])
    return _launch(_world_size(config, nproc), args)


def demo_overrides(run_dir: str, extra: list[str]) -> list[str]:
    """Fill the embedded demo config with the installed teacher's location."""
    from meshkd.models import demo_teacher_source

    source = demo_teacher_source()
    overrides = []
    for section in ("model", "teacher_model"):
        overrides += [f"{section}.path={source['path']}", f"{section}.gguf_file={source['gguf_file']}"]
    return [*overrides, f"logging.run_dir={run_dir}", *extra]


def _demo(args: argparse.Namespace) -> int:
    config_path = str(resources.files("meshkd") / "configs" / _DEMO_CONFIG)
    runs = [("kd", args.run_dir, [])]
    if args.compare:
        runs.append(("ce", args.run_dir + "_ce_only", ["kd.kd_ratio=0.0"]))
    summaries = {}
    for name, run_dir, extra in runs:
        print(f"meshkd demo: healing the pruned student with {'KD' if name == 'kd' else 'CE only'} -> {run_dir}")
        code = _train(config_path, demo_overrides(run_dir, extra + args.set), None, False)
        if code != 0:
            return code
        summaries[name] = json.loads(Path(run_dir, "summary.json").read_text())
    kd = summaries["kd"]
    print("\nvalidation loss (nats/token) on held-out Python standard library sources:")
    print(f"  teacher (SmolLM2-135M-Instruct, 30 layers) {kd['teacher_val_loss']:.4f}")
    print(f"  pruned student before healing              {kd['val_loss_before']:.4f}")
    print(f"  pruned student after KD healing            {kd['val_loss_after']:.4f}")
    if "ce" in summaries:
        print(f"  pruned student after CE-only healing       {summaries['ce']['val_loss_after']:.4f}")
    if "hf_dir" in kd:
        print(f"HF-format student written to {kd['hf_dir']}")
    return 0


def _plot(run_dir: str, out: str | None) -> int:
    from meshkd.plot import plot_run

    print(plot_run(run_dir, out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshkd", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="distill a teacher into a student as a YAML config says")
    train.add_argument("config", help="YAML config file (see examples/)")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set step_scheduler.max_steps=10 (repeatable)")
    train.add_argument("--nproc", type=int, default=None,
                       help="local processes to start (default: the ranks the config lays out); "
                            "ignored inside torchrun")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint of the run")

    demo = commands.add_parser("demo", help="heal a pruned SmolLM2 student by distilling the full model (CPU)")
    demo.add_argument("--compare", action="store_true", help="also heal with CE only and print both results")
    demo.add_argument("--run-dir", default="runs/demo", help="where runs are written (default runs/demo)")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a demo config value")

    plot = commands.add_parser("plot", help="draw a run's loss curves to a PNG")
    plot.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args.config, args.set, args.nproc, args.resume)
        if args.command == "demo":
            return _demo(args)
        return _plot(args.run_dir, args.out)
    except (ConfigError, FileNotFoundError) as error:
        print(f"meshkd: error: {error}", file=sys.stderr)
        return 2

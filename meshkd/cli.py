"""The `meshkd` command: train, cache-teacher, prepare-data, prune, demo, bench, plot.

`meshkd train CONFIG` validates the config and runs the recipe's preflight checks in the calling process
(a typo or a missing file fails in seconds, before any process starts), then starts `--nproc` local
processes through torch's own launcher (torch.distributed.run: gloo on CPU, NCCL on CUDA). Inside an
existing torchrun world it trains in that world directly, so `torchrun --nproc-per-node 8 -m meshkd train
CONFIG` works unchanged on a cluster. `meshkd cache-teacher CONFIG` does the same with the teacher's
ranks only, writing the teacher's answers to `kd.teacher_cache` (`meshkd.recipe.cache_writer`).

Exit status of `meshkd train` (and of `meshkd cache-teacher`): 0 when the run finished; 2 for a bad
config or input found before any process started; 1 when a worker failed (each failing worker prints one
`meshkd: error: rank R: ...` line); 128 + the signal number (130 for SIGINT, 143 for SIGTERM) after a
stop request that every process obeyed. How the workers are started, stopped and reported:
`meshkd.launcher`; the demo's sequence of commands: `meshkd.demo`.
"""

from __future__ import annotations

import argparse
import math
import sys

from meshkd import launcher
from meshkd.recipe.config import ConfigError, load_config, required_world_size


def _world_size(needed: int | None, nproc: int | None, dp_key: str = "distributed.dp_size") -> int:
    if nproc is None:
        if needed is None:
            raise ConfigError(f"{dp_key} is null: pass --nproc N to say how many processes to start")
        return needed
    if needed is not None and needed != nproc:
        raise ConfigError(f"the config lays out {needed} ranks but --nproc is {nproc}")
    return nproc


def _set_args(overrides: list[str]) -> list[str]:
    return [item for override in overrides for item in ("--set", override)]


def selected_layers(config_path: str, overrides: list[str], *, resume: bool = False) -> list[str]:
    """`["model.keep_layers=[...]"]` when the config asks for `{auto: N}` (measured, or read from the run
    directory's record; see `meshkd.recipe.layer_selection`), else `[]`."""
    config = load_config(config_path, overrides)
    if not isinstance(config.model.keep_layers, dict):
        return []
    from meshkd.recipe import layer_selection
    from meshkd.recipe.loaders import load_section_tokenizer

    keep = layer_selection.resolve(config, load_section_tokenizer(config.model), resume=resume,
                                   measure_here=not launcher.inside_torchrun())
    return [f"model.keep_layers={keep}"]


def _converted_gguf_sources(config_path: str, overrides: list[str]) -> list[str]:
    """Overrides pointing each GGUF model section at its model converted once to an HF directory
    (`meshkd.recipe.models.converted_gguf`): every worker then loads only its share, and in a fraction of
    the time. Under the user's own torchrun the ranks load the GGUF file as it is (they would race)."""
    if launcher.inside_torchrun():
        return []
    from meshkd.recipe.models import converted_gguf

    config, converted = load_config(config_path, overrides), []
    for label in ("model", "teacher_model"):
        section = getattr(config, label)
        if section.path is not None and (section.gguf_file is not None or str(section.path).endswith(".gguf")):
            directory = converted_gguf(section.path, section.gguf_file)
            converted += [f"{label}.path={directory}", f"{label}.gguf_file="]
    return converted


def _resolved(config_path: str, overrides: list[str], *, resume: bool = False) -> list[str]:
    """The overrides plus those that GGUF conversion and layer selection add for the workers."""
    overrides = [*overrides, *_converted_gguf_sources(config_path, overrides)]
    return [*overrides, *selected_layers(config_path, overrides, resume=resume)]


def train_command(config_path: str, overrides: list[str], nproc: int | None, resume: bool) -> int:
    """`meshkd train`: as one rank inside torchrun, else preflight here and launch the workers."""
    overrides = _resolved(config_path, overrides, resume=resume)
    config = load_config(config_path, overrides)
    if launcher.inside_torchrun():
        from meshkd.recipe.run import KDRecipe

        return launcher.run_here(lambda: KDRecipe(config, resume=resume).run())
    from meshkd.recipe.preflight import preflight_teachers
    from meshkd.recipe.world import check_gpu_count

    preflight_teachers(config)
    world_size = _world_size(required_world_size(config), nproc)
    check_gpu_count(config, world_size)  # every process is started on this node
    resuming = ["--resume"] if resume else []
    return launcher.launch(world_size, ["train", config_path, *_set_args(overrides), *resuming])


def cached_teacher(config, teacher: str | None):
    """The one-teacher config whose cache `meshkd cache-teacher` writes: the config itself, or with several
    teachers (`teachers`) the view of the one named by `--teacher` (its `cache`, its `distributed` layout)."""
    if not config.teachers:
        if teacher is not None:
            raise ConfigError("--teacher names one of several teachers (teachers); this config has one teacher")
        return config
    names = [entry.name for entry in config.teachers]
    if teacher is None and len(names) > 1:
        raise ConfigError(f"this config has several teachers: name the one whose cache to write with --teacher NAME "
                          f"(one of {names})")
    teacher = teacher or names[0]
    if teacher not in names:
        raise ConfigError(f"--teacher {teacher!r} is none of the teachers {names}")
    view = config.teacher_views()[teacher]
    if view.kd.teacher_cache is None:
        raise ConfigError(f"teachers.{teacher}.cache: set it to the directory to write the cache to")
    return view


def cache_teacher_command(config_path: str, overrides: list[str], nproc: int | None, shard_rows: int | None,
                          teacher: str | None = None) -> int:
    """`meshkd cache-teacher`: as `train_command`, with the teacher's ranks only."""
    overrides = _resolved(config_path, overrides)
    config = cached_teacher(load_config(config_path, overrides), teacher)
    if config.kd.teacher_cache is None:
        raise ConfigError("kd.teacher_cache: set it to the directory to write the cache to "
                          "(e.g. --set kd.teacher_cache=runs/teacher_cache)")
    if launcher.inside_torchrun():
        from meshkd.recipe.cache_writer import cache_teacher

        return launcher.run_here(lambda: cache_teacher(config, shard_rows=shard_rows))
    from meshkd.recipe.preflight import preflight
    from meshkd.recipe.world import check_gpu_count

    preflight(config, writing_cache=True)
    layout = config.teacher_layout
    sizes = (layout.dp_size, layout.tp_size, layout.cp_size, layout.pp_size)
    needed = None if layout.dp_size is None else math.prod(sizes)
    dp_key = "teacher_distributed.dp_size" if layout is config.teacher_distributed else "distributed.dp_size"
    world_size = _world_size(needed, nproc, dp_key)
    check_gpu_count(config, world_size)
    extra = ["--shard-rows", str(shard_rows)] if shard_rows is not None else []
    extra += ["--teacher", teacher] if teacher is not None else []
    return launcher.launch(world_size, ["cache-teacher", config_path, *_set_args(overrides), *extra])


def _prune(config_path: str, overrides: list[str]) -> int:
    config = load_config(config_path, overrides)
    if not isinstance(config.model.keep_layers, dict):
        raise ConfigError("model.keep_layers: set it to {auto: N} to have the N most important layers chosen "
                          "(e.g. --set 'model.keep_layers={auto: 8}')")
    _resolved(config_path, overrides)
    return 0


def _plot(run_dirs: list[str], out: str | None, labels: list[str] | None) -> int:
    from meshkd.recipe.plot import plot_runs

    print(plot_runs(run_dirs, out, labels))
    return 0


def _prepare_data(config_path: str, overrides: list[str]) -> int:
    """`meshkd prepare-data`: the token store of the config's corpus and its packing, written here."""
    config = load_config(config_path, overrides)
    if config.dataset.token_store is None:
        raise ConfigError("dataset.token_store is null: set it to the directory that holds token stores")
    from meshkd.recipe import data
    from meshkd.recipe.loaders import load_section_tokenizer

    train, val = data.build_run_datasets(load_section_tokenizer(config.model), config.dataset,
                                         sequence_length=config.step_scheduler.sequence_length,
                                         store_wait_s=config.setup_timeout_s)
    print(f"meshkd prepare-data: {train.store.directory}: {train.store.manifest['documents']} documents, "
          f"{train.store.manifest['tokens']} tokens ({train.store.manifest['token_dtype']}); training {len(train)} "
          f"rows, validation {len(val)} rows of {config.step_scheduler.sequence_length} tokens")
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
    train.add_argument("--quiet", action="store_true",
                       help="no end-of-run report (logging.summary=false); summary.json holds the figures")

    cache = commands.add_parser("cache-teacher", help="run only the teacher and write its answers to kd.teacher_cache")
    cache.add_argument("config", help="YAML config file: the same as for train")
    cache.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set kd.teacher_cache=runs/cache (repeatable)")
    cache.add_argument("--nproc", type=int, default=None,
                       help="local processes to start (default: the ranks the teacher's layout needs)")
    cache.add_argument("--shard-rows", type=int, default=None,
                       help="rows per shard file (default: about 256 MiB of answers per shard)")
    cache.add_argument("--teacher", default=None, metavar="NAME",
                       help="with several teachers: the one whose answers to write to its teachers[i].cache")
    cache.add_argument("--quiet", action="store_true", help="no closing line (logging.summary=false)")

    demo = commands.add_parser("demo", help="heal a pruned SmolLM2 student by distilling the full model (CPU)")
    demo.add_argument("--compare", action="store_true", help="also heal with CE only and print both results")
    demo.add_argument("--cache", action="store_true",
                      help="take the teacher's answers from a cache next to the run (written on first use)")
    demo.add_argument("--on-policy", action="store_true",
                      help="heal on the student's own completions, scored by the teacher (with --compare: "
                           "against off-policy at about the same trained tokens)")
    demo.add_argument("--cross-tokenizer", action="store_true",
                      help="distill into the pruned student with a tokenizer of its own (a byte-level BPE trained on "
                           "the training split, embeddings transplanted from the teacher's; with --compare: "
                           "against CE only)")
    demo.add_argument("--run-dir", default="runs/demo", help="where runs are written (default runs/demo)")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a demo config value")

    prepare = commands.add_parser("prepare-data", help="tokenize the corpus once into dataset.token_store (a run "
                                                       "otherwise does it on first use)")
    prepare.add_argument("config", help="YAML config file: the same as for train")
    prepare.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="override a config value, e.g. --set dataset.token_store=~/tokens (repeatable)")

    prune = commands.add_parser("prune", help="choose the student's layers by measured importance "
                                              "(model.keep_layers: {auto: N}) and record them in the run directory")
    prune.add_argument("config", help="YAML config file: the same as for train")
    prune.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set 'model.keep_layers={auto: 8}' (repeatable)")

    bench = commands.add_parser("bench", help="meshkd's benchmarks (transport, cache, loading): ratios measured "
                                              "side by side", add_help=False)
    bench.add_argument("bench_args", nargs="*", help="see meshkd bench --help")

    plot = commands.add_parser("plot", help="draw a run's loss curves to a PNG; several runs on one figure")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    plot.add_argument("--out", default=None,
                      help="PNG path (default RUN_DIR/curves.png; with several runs FIRST_RUN_DIR/compare.png)")
    plot.add_argument("--label", action="append", default=None, metavar="NAME",
                      help="a run's name in the legend, one per RUN_DIR in order (default: the directory names)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own options, parsed by meshkd.bench
        from meshkd.bench import main as bench

        return bench(argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "quiet", False):
        args.set.append("logging.summary=false")
    try:
        if args.command == "train":
            return train_command(args.config, args.set, args.nproc, args.resume)
        if args.command == "cache-teacher":
            return cache_teacher_command(args.config, args.set, args.nproc, args.shard_rows, args.teacher)
        if args.command == "demo":
            from meshkd.demo import run_demo

            return run_demo(args)
        if args.command == "prune":
            return _prune(args.config, args.set)
        if args.command == "prepare-data":
            return _prepare_data(args.config, args.set)
        return _plot(args.run_dirs, args.out, args.label)
    except (ConfigError, ValueError, OSError) as error:
        print(f"meshkd: error: {error}", file=sys.stderr)
        return 2

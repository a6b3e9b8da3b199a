"""The `meshkd` command: train, cache-teacher, prune, demo, bench, plot.

`meshkd train CONFIG` validates the config and runs the recipe's preflight checks in the calling process
(a typo or a missing file fails in seconds, before any process starts), then starts `--nproc` local
processes through torch's own launcher (torch.distributed.run: gloo on CPU, NCCL on CUDA). Inside an
existing torchrun world it trains in that world directly, so `torchrun --nproc-per-node 8 -m meshkd train
CONFIG` works unchanged on a cluster. `meshkd cache-teacher CONFIG` does the same with the teacher's
ranks only, writing the teacher's answers to `kd.teacher_cache` (`meshkd.recipe.cache_writer`).

Exit status of `meshkd train` (and of `meshkd cache-teacher`): 0 when the run finished; 2 for a bad
config or input found before any process started; 1 when a worker failed (each failing worker prints one
`meshkd: error: rank R: ...` line);
128 + the signal number (130 for SIGINT, 143 for SIGTERM) after a stop request that every process obeyed.
The first SIGINT or SIGTERM asks the workers to stop at the next step boundary (they save a checkpoint of
that step); a second one hands the stop to torchrun, which signals the workers and kills them after
`SHUTDOWN_GRACE_S` (5 s; torchrun's own is 30 s). The same grace ends the workers left when one failed:
a peer frozen mid-collective is gone within the collective timeout and that grace.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from meshkd.recipe.config import ConfigError, load_config, required_world_size

_DEMO_CONFIG = "demo.yaml"
# Ends inside the code, so that the instruct teacher continues the function rather than explaining it.
_DEMO_PROMPT = 'def is_palindrome(text):\n    """Return True if text reads the same backwards."""\n    return'
# Seconds the launcher waits for workers to exit after SIGTERM before it kills them (torchrun's own: 30 s).
SHUTDOWN_GRACE_S = 5


def _report(line: str) -> None:
    """Write one line to stderr in one system call: workers and the launcher share it, whole lines stay whole."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (line + "\n").encode(errors="replace"))


def _inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE", "LOCAL_RANK"} <= set(os.environ)


# The launcher process: torch.distributed.run, with its failure report cut to one line per failed worker.
_LAUNCHER = "import sys; from meshkd.cli import _torchrun; sys.exit(_torchrun(sys.argv[1:]))"


def _torchrun(argv: list[str]) -> int:
    """Run torch.distributed.run with `argv`; a worker failure or a signal gives an exit status, not a traceback."""
    from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    # When a worker fails, torchrun signals the others and waits 30 s before it kills them; that wait is
    # fixed where it first sees the failure (`--shutdown-timeout` only covers its final shutdown). A worker
    # frozen mid-collective never answers the signal, so every close of the workers gets our grace.
    close = PContext.close
    # torchrun's own warnings and errors about its workers (SIGTERM sent, exit codes) would repeat, in its log
    # format, what the workers and this function say in one line each.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    PContext.close = lambda self, death_sig=None, timeout=30: close(self, death_sig, min(timeout, SHUTDOWN_GRACE_S))
    try:
        main(argv)
    except ChildFailedError as error:
        for rank, failure in sorted(error.failures.items()):
            code = failure.exitcode
            how = f"exit code {code}"
            if code < 0:  # ended by a signal
                how = f"signal {signal.Signals(-code).name if -code in signal.valid_signals() else -code}"
            _report(f"meshkd: worker rank {rank} (pid {failure.pid}) ended with {how}")
        return 1
    except SignalException as error:
        return 128 + int(error.sigval)
    return 0


def _end_with_parent() -> None:
    """In the launcher before exec: get SIGTERM if `meshkd train` dies, so no launcher or worker outlives it."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def threads_per_process(nproc: int) -> str:
    """OMP_NUM_THREADS for each of `nproc` local processes: the user's, else the cores shared among them.

    torchrun's default is one thread each, which leaves a single process computing on one core of many.
    """
    return os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))


def _launch(nproc: int, args: list[str]) -> int:
    """Run `python -m meshkd ARGS` on `nproc` local processes under torch.distributed.run.

    The launcher runs in its own session, so a Ctrl-C at the terminal reaches this process only. The first
    SIGINT / SIGTERM creates the stop file the workers poll at step boundaries (see
    `meshkd.recipe.faults.STOP_FILE_ENV`); a later one is forwarded to the launcher. Returns the launcher's exit
    status, or 128 + the first signal's number when every process exited cleanly after it.
    """
    from meshkd.recipe.faults import STOP_FILE_ENV
    from meshkd.recipe.metrics import WARNED_ENV, warned

    with tempfile.TemporaryDirectory(prefix="meshkd-") as scratch:
        stop_file = Path(scratch, "stop")
        command = [sys.executable, "-c", _LAUNCHER, "--standalone", f"--nproc-per-node={nproc}", "-m", "meshkd", *args]
        env = dict(os.environ, OMP_NUM_THREADS=threads_per_process(nproc))
        env[STOP_FILE_ENV] = str(stop_file)
        env[WARNED_ENV] = json.dumps(warned)  # the preflight's warnings, said once here
        launcher = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_end_with_parent)
        received: list[int] = []

        def forward(signum: int, frame) -> None:
            received.append(signum)
            if len(received) == 1:
                stop_file.touch()
                # os.write, not print: a print interrupted by this handler would be re-entered.
                os.write(2, f"meshkd: got {signal.Signals(signum).name}: stopping at the next step boundary "
                            "(send it again to stop at once)\n".encode())
            else:
                launcher.send_signal(signum)

        previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = launcher.wait()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    return 128 + received[0] if received and code == 0 else code


def _world_size(needed: int | None, nproc: int | None, dp_key: str = "distributed.dp_size") -> int:
    if nproc is None:
        if needed is None:
            raise ConfigError(f"{dp_key} is null: pass --nproc N to say how many processes to start")
        return needed
    if needed is not None and needed != nproc:
        raise ConfigError(f"the config lays out {needed} ranks but --nproc is {nproc}")
    return nproc


def _run_here(work: Callable[[], object]) -> int:
    """Run `work` as one rank of the current world; a user error or a lost peer prints one line and returns 1.

    Other exceptions (bugs) keep their traceback.
    """
    from meshkd.core.wire import SenderError  # a peer's own error, forwarded in place of its data
    from meshkd.recipe.faults import PeerLostError, SetupError

    # The recipe handles SIGINT / SIGTERM while it runs; before and after, a worker on its way out ignores
    # them (torchrun signals every worker once one fails), so that it ends with its own exit status.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    try:
        work()
    except (ValueError, OSError, PeerLostError, SetupError, SenderError) as error:
        _report(f"meshkd: error: rank {os.environ.get('RANK', '?')}: {error}")
        return 1
    return 0


def _set_args(overrides: list[str]) -> list[str]:
    return [item for override in overrides for item in ("--set", override)]


def _layer_selection(config_path: str, overrides: list[str], *, resume: bool = False) -> list[str]:
    """`["model.keep_layers=[...]"]` when the config asks for `{auto: N}` (measured, or read from the run
    directory's record; see `meshkd.recipe.layer_selection`), else `[]`."""
    config = load_config(config_path, overrides)
    if not isinstance(config.model.keep_layers, dict):
        return []
    from meshkd.recipe import layer_selection
    from meshkd.recipe.loaders import load_section_tokenizer

    keep = layer_selection.resolve(config, load_section_tokenizer(config.model), resume=resume,
                                   measure_here=not _inside_torchrun())
    return [f"model.keep_layers={keep}"]


def _converted_gguf_sources(config_path: str, overrides: list[str]) -> list[str]:
    """Overrides pointing each GGUF model section at its model converted once to an HF directory
    (`meshkd.recipe.models.converted_gguf`): every worker then loads only its share, and in a fraction of
    the time. Under the user's own torchrun the ranks load the GGUF file as it is (they would race)."""
    if _inside_torchrun():
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
    return [*overrides, *_layer_selection(config_path, overrides, resume=resume)]


def _train(config_path: str, overrides: list[str], nproc: int | None, resume: bool) -> int:
    overrides = _resolved(config_path, overrides, resume=resume)
    config = load_config(config_path, overrides)
    if _inside_torchrun():
        from meshkd.recipe.run import KDRecipe

        return _run_here(lambda: KDRecipe(config, resume=resume).run())
    from meshkd.recipe.preflight import preflight
    from meshkd.recipe.world import check_gpu_count

    preflight(config)
    world_size = _world_size(required_world_size(config), nproc)
    check_gpu_count(config, world_size)  # every process is started on this node
    return _launch(world_size, ["train", config_path, *_set_args(overrides), *(["--resume"] if resume else [])])


def _cache_teacher(config_path: str, overrides: list[str], nproc: int | None, shard_rows: int | None) -> int:
    overrides = _resolved(config_path, overrides)
    config = load_config(config_path, overrides)
    if config.kd.teacher_cache is None:
        raise ConfigError("kd.teacher_cache: set it to the directory to write the cache to "
                          "(e.g. --set kd.teacher_cache=runs/teacher_cache)")
    if _inside_torchrun():
        from meshkd.recipe.cache_writer import cache_teacher

        return _run_here(lambda: cache_teacher(config, shard_rows=shard_rows))
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
    return _launch(world_size, ["cache-teacher", config_path, *_set_args(overrides), *extra])


@functools.lru_cache(maxsize=1)
def _demo_teacher_directory() -> Path:
    """The demo teacher as an HF directory; found (the GGUF file hashed) once per process."""
    from meshkd.recipe.models import converted_gguf, demo_teacher_source

    source = demo_teacher_source()
    return converted_gguf(source["path"], source["gguf_file"])


def demo_overrides(run_dir: str, extra: list[str]) -> list[str]:
    """Fill the embedded demo config with the installed teacher, converted once from GGUF to an HF directory
    (every process of every run then loads it in a fraction of the time, and sharded)."""
    directory = _demo_teacher_directory()
    return [f"model.path={directory}", f"teacher_model.path={directory}", f"logging.run_dir={run_dir}", *extra]


def _demo_cache(config_path: str, overrides: list[str]) -> int:
    """Write the demo's teacher cache unless the one there already fits the run (then the teacher never runs)."""
    from meshkd.recipe.preflight import preflight

    config = load_config(config_path, overrides)
    try:
        preflight(config)
        print(f"meshkd demo: the teacher's answers come from the cache {config.kd.teacher_cache}")
        return 0
    except ConfigError as error:
        if not str(error).startswith("kd.teacher_cache:"):
            raise
    print("meshkd demo: computing the teacher's answers once (meshkd cache-teacher)")
    return _cache_teacher(config_path, overrides, None, None)


# `meshkd demo --on-policy`: short rows so the student's completions fit a few minutes on 2 CPU cores. The
# student completes the first 32 tokens of each row with 32 of its own, trained on by reverse KL; the
# off-policy run it is compared with (--compare) trains on text rows of the same length with half the steps,
# so both train on about as many tokens (each text row has 63 targets, each completion at most 32). Both take
# 4 rows a step at lr 1e-3, not the text demo's 2 rows at 5e-4 (as the README's on-policy figures were measured).
_ON_POLICY_STEPS = ["step_scheduler.global_batch_size=4", "step_scheduler.local_batch_size=2",
                    "step_scheduler.val_batches=4", "optimizer.lr=1e-3"]
_ON_POLICY = [*_ON_POLICY_STEPS, "kd.mode=on_policy", "kd.divergence=reverse_kl", "kd.generation.prompt_tokens=32",
              "kd.generation.max_new_tokens=32", "step_scheduler.sequence_length=64", "step_scheduler.max_steps=30",
              "lr_scheduler.warmup_steps=3"]
_OFF_POLICY_BESIDE = [*_ON_POLICY_STEPS, "kd.generation.evaluate=true", "step_scheduler.max_steps=15",
                      "kd.generation.prompt_tokens=32", "kd.generation.max_new_tokens=32",
                      "step_scheduler.sequence_length=64"]


def _demo(args: argparse.Namespace) -> int:
    config_path = str(resources.files("meshkd") / "configs" / _DEMO_CONFIG)
    if args.on_policy:
        return _demo_on_policy(config_path, args)
    # Top-k with sampled tail tokens: 772 bytes a token; full logits would be 192 KiB a token here.
    cache = ["kd.logits_transport=topk", f"kd.teacher_cache={args.run_dir}_teacher_cache"] if args.cache else []
    # The student's layers are measured once, in the KD run's directory, and every run of the demo keeps them.
    layers = _layer_selection(config_path, demo_overrides(args.run_dir, cache + args.set))
    runs = [("kd", args.run_dir, [])]
    if args.compare:
        runs.append(("ce", args.run_dir + "_ce_only", ["kd.kd_ratio=0.0"]))
    if cache:
        code = _demo_cache(config_path, demo_overrides(args.run_dir, cache + args.set + layers))
        if code != 0:
            return code
    summaries = {}
    for name, run_dir, extra in runs:
        print(f"meshkd demo: healing the pruned student with {'KD' if name == 'kd' else 'CE only'} -> {run_dir}")
        code = _train(config_path, demo_overrides(run_dir, extra + cache + args.set + layers), None, False)
        if code != 0:
            return code
        summaries[name] = json.loads(Path(run_dir, "summary.json").read_text())
    _demo_report(load_config(config_path, demo_overrides(args.run_dir, cache + args.set + layers)), summaries)
    return 0


def _demo_on_policy(config_path: str, args: argparse.Namespace) -> int:
    """On-policy distillation of the pruned student (and with --compare, off-policy at about the same tokens)."""
    if args.cache:
        raise ConfigError("meshkd demo --on-policy: the teacher scores the student's own completions, which no "
                          "cache holds; leave out --cache")
    from meshkd.recipe import metrics

    run_dir = args.run_dir + "_on_policy"
    layers = _layer_selection(config_path, demo_overrides(run_dir, _ON_POLICY + args.set))
    runs = [("on-policy", run_dir, _ON_POLICY)]
    if args.compare:
        runs.append(("off-policy", run_dir + "_beside", _OFF_POLICY_BESIDE))
    names = {"forward_kl": "forward KL", "reverse_kl": "reverse KL", "jsd": "JSD"}
    runs = [(f"{name} ({names[load_config(config_path, demo_overrides(directory, extra + args.set)).kd.divergence]})",
             directory, extra) for name, directory, extra in runs]  # as --set may have changed it
    for name, directory, extra in runs:
        print(f"meshkd demo: healing the pruned student {name} -> {directory}")
        code = _train(config_path, demo_overrides(directory, extra + args.set + layers), None, False)
        if code != 0:
            return code
    print("\n(losses in nats/token)                  trained    held-out  teacher's loss on the student's")
    print("                                         tokens     text      greedy completions, before -> after")
    for name, directory, _ in runs:
        records = metrics.read_metrics(directory)
        trained = sum(record["num_tokens"] for record in records if record["kind"] == "train")
        evals = [record for record in records if record["kind"] == "eval"]
        print(f"  {name:<37} {trained:>7.0f}    {evals[-1]['val_loss']:.4f}    "
              f"{evals[0]['teacher_nll_of_samples']:.4f} -> {evals[-1]['teacher_nll_of_samples']:.4f}")
    teacher = evals[0]["teacher_val_loss"]
    print(f"  teacher on the held-out text: {teacher:.4f}; pruned student before healing: {evals[0]['val_loss']:.4f}")
    from meshkd.recipe.completions import compare_completions

    config = load_config(config_path, demo_overrides(run_dir, _ON_POLICY + args.set + layers))
    trained = {f"{name} student": json.loads(Path(directory, "summary.json").read_text())["hf_dir"]
               for name, directory, _ in runs}
    print(f"\ngreedy completions of {_DEMO_PROMPT!r}:")
    for name, text in compare_completions(config.teacher_model, config.model.keep_layers, trained, _DEMO_PROMPT,
                                          max_new_tokens=16).items():
        print(f"--- {name}\n{_DEMO_PROMPT}{text}")
    return 0


def _demo_report(config, summaries: dict[str, dict]) -> None:
    """Losses, the share of the pruned student's gap to the teacher that healing closed, completions, curves."""
    kd = summaries["kd"]
    teacher, before = kd["teacher_val_loss"], kd["val_loss_before"]

    def closed(after: float) -> str:
        return f"{(before - after) / (before - teacher):.0%} of the gap to the teacher closed"

    rows = [("teacher (SmolLM2-135M-Instruct, 30 layers)", teacher, ""),
            (f"pruned student ({len(config.model.keep_layers)} layers) before healing", before, ""),
            ("after KD healing", kd["val_loss_after"], closed(kd["val_loss_after"]))]
    if "ce" in summaries:
        ce = summaries["ce"]["val_loss_after"]
        rows.append(("after CE-only healing", ce, f"{closed(ce)}; KD {(ce - kd['val_loss_after']) / ce:.1%} lower"))
    print("\nvalidation loss (nats/token) on held-out Python standard library sources:")
    for label, loss, note in rows:
        print(f"  {label:<44} {loss:.4f}" + (f"  ({note})" if note else ""))
    if "hf_dir" in kd:
        from meshkd.recipe.completions import compare_completions

        print(f"HF-format student written to {kd['hf_dir']}\n\ngreedy completions of {_DEMO_PROMPT!r}:")
        texts = compare_completions(config.teacher_model, config.model.keep_layers, {"trained student": kd["hf_dir"]},
                                    _DEMO_PROMPT, max_new_tokens=16)
        for name, text in texts.items():
            print(f"--- {name}\n{_DEMO_PROMPT}{text}")
    with contextlib.suppress(RuntimeError):  # matplotlib missing: the figures above stand
        from meshkd.recipe.plot import plot_run

        print(f"\ncurves: {plot_run(config.logging.run_dir)}")


def _prune(config_path: str, overrides: list[str]) -> int:
    config = load_config(config_path, overrides)
    if not isinstance(config.model.keep_layers, dict):
        raise ConfigError("model.keep_layers: set it to {auto: N} to have the N most important layers chosen "
                          "(e.g. --set 'model.keep_layers={auto: 8}')")
    _resolved(config_path, overrides)
    return 0


def _plot(run_dir: str, out: str | None) -> int:
    from meshkd.recipe.plot import plot_run

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

    cache = commands.add_parser("cache-teacher", help="run only the teacher and write its answers to kd.teacher_cache")
    cache.add_argument("config", help="YAML config file: the same as for train")
    cache.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set kd.teacher_cache=runs/cache (repeatable)")
    cache.add_argument("--nproc", type=int, default=None,
                       help="local processes to start (default: the ranks the teacher's layout needs)")
    cache.add_argument("--shard-rows", type=int, default=None,
                       help="rows per shard file (default: about 256 MiB of answers per shard)")

    demo = commands.add_parser("demo", help="heal a pruned SmolLM2 student by distilling the full model (CPU)")
    demo.add_argument("--compare", action="store_true", help="also heal with CE only and print both results")
    demo.add_argument("--cache", action="store_true",
                      help="take the teacher's answers from a cache next to the run (written on first use)")
    demo.add_argument("--on-policy", action="store_true",
                      help="heal on the student's own completions, scored by the teacher (with --compare: "
                           "against off-policy at about the same trained tokens)")
    demo.add_argument("--run-dir", default="runs/demo", help="where runs are written (default runs/demo)")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a demo config value")

    prune = commands.add_parser("prune", help="choose the student's layers by measured importance "
                                              "(model.keep_layers: {auto: N}) and record them in the run directory")
    prune.add_argument("config", help="YAML config file: the same as for train")
    prune.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set 'model.keep_layers={auto: 8}' (repeatable)")

    bench = commands.add_parser("bench", help="meshkd's benchmarks (transport, cache, loading): ratios measured "
                                              "side by side", add_help=False)
    bench.add_argument("bench_args", nargs="*", help="see meshkd bench --help")

    plot = commands.add_parser("plot", help="draw a run's loss curves to a PNG")
    plot.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own options, parsed by meshkd.bench
        from meshkd.bench import main as bench

        return bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args.config, args.set, args.nproc, args.resume)
        if args.command == "cache-teacher":
            return _cache_teacher(args.config, args.set, args.nproc, args.shard_rows)
        if args.command == "demo":
            return _demo(args)
        if args.command == "prune":
            return _prune(args.config, args.set)
        return _plot(args.run_dir, args.out)
    except (ConfigError, ValueError, OSError) as error:
        print(f"meshkd: error: {error}", file=sys.stderr)
        return 2

"""The `meshkd` command line: train, cache-teacher, serve-teacher, prepare-data, prune, demo, bench, plot.

Each subcommand parses its arguments and calls its function in `meshkd.commands` (the demo: `meshkd.demo`;
the benchmarks: `meshkd.bench`); a bad config or input found before any process started is one
`meshkd: error: ...` line on stderr.

Exit status of `meshkd train` (and of `meshkd cache-teacher`): 0 when the run finished; 2 for a bad
config or input found before any process started; 1 when a worker failed (each failing worker prints one
`meshkd: error: rank R: ...` line); 128 + the signal number (130 for SIGINT, 143 for SIGTERM) after a
stop request that every process obeyed. How the workers are started, stopped and reported:
`meshkd.launcher`; the demo's sequence of commands: `meshkd.demo`.
"""

from __future__ import annotations

import argparse
import sys

from meshkd import commands
from meshkd.recipe.settings.config import ConfigError


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

    serve = commands.add_parser("serve-teacher", help="serve the config's teacher over HTTP to students that name "
                                                      "it by address (teacher_model.url)")
    serve.add_argument("config", help="YAML config file: its teacher_model and the teacher's layout are served")
    serve.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value (repeatable)")
    serve.add_argument("--nproc", type=int, default=None,
                       help="local processes to start (default: the ranks the teacher's layout needs)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; another needs MESHKD_TEACHER_TOKEN)")
    serve.add_argument("--port", type=int, default=8100, help="port to listen on (default 8100; 0: any free one)")
    serve.add_argument("--max-batch-tokens", type=int, default=8192,
                       help="tokens of queued requests one forward takes at most (default 8192)")
    serve.add_argument("--max-request-tokens", type=int, default=65536,
                       help="a request holding more tokens is refused (default 65536)")
    serve.add_argument("--tls-cert", default=None, help="PEM certificate file: serve HTTPS (with --tls-key)")
    serve.add_argument("--tls-key", default=None, help="PEM private key file of --tls-cert")
    serve.add_argument("--address-file", default=None, help="write the address here once it listens")

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
    demo.add_argument("--hidden-states", action="store_true",
                      help="also heal with KD plus intermediate-layer KD (kd.hidden_states, pairs: kept), print both")
    demo.add_argument("--run-dir", default="runs/demo", help="where runs are written (default runs/demo)")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a demo config value")

    prepare = commands.add_parser("prepare-data", help="tokenize the corpus (and an on-policy run's whole prompts) "
                                                       "once into its token store (dataset.token_store, else "
                                                       "$MESHKD_CACHE's; a run otherwise does it on first use)")
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


def serve_options(args: argparse.Namespace):
    from meshkd.recipe.lifecycle.teacher_service import ServeOptions

    return ServeOptions(host=args.host, port=args.port, max_batch_tokens=args.max_batch_tokens,
                        max_request_tokens=args.max_request_tokens, tls_cert=args.tls_cert, tls_key=args.tls_key,
                        address_file=args.address_file)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own options, parsed by meshkd.bench
        from meshkd.bench import main as bench

        return bench(argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "quiet", False):
        args.set.append("logging.summary=false")
    try:
        if args.command != "plot":
            from meshkd.recipe.common.versions import check_versions

            check_versions()  # before any model is built or worker started
        if args.command == "train":
            return commands.train_command(args.config, args.set, args.nproc, args.resume)
        if args.command == "cache-teacher":
            return commands.cache_teacher_command(args.config, args.set, args.nproc, args.shard_rows, args.teacher)
        if args.command == "serve-teacher":
            return commands.serve_teacher_command(args.config, args.set, args.nproc, serve_options(args))
        if args.command == "demo":
            from meshkd.demo import run_demo

            return run_demo(args)
        if args.command == "prune":
            return commands.prune_command(args.config, args.set)
        if args.command == "prepare-data":
            return commands.prepare_data_command(args.config, args.set)
        return commands.plot_command(args.run_dirs, args.out, args.label)
    except (ConfigError, ValueError, OSError) as error:
        print(f"meshkd: error: {error}", file=sys.stderr)
        return 2

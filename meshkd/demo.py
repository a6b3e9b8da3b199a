"""`meshkd demo`: heal a pruned SmolLM2 student by distilling the full model, on the CPU, and report it.

The demo is a sequence of ordinary `meshkd` commands on the embedded `configs/demo.yaml`, filled in by
`demo_overrides` (`meshkd.demo_runs`) with the installed demo teacher (converted once from GGUF to an HF
directory): choose the student's layers once (`meshkd prune`), optionally write the teacher's answers to a cache
(`meshkd cache-teacher`), then `meshkd train` the KD run and, with --compare, the run it is compared with
(CE only; or off-policy at about the same trained tokens for --on-policy), and with --hidden-states the same
KD run with intermediate-layer KD beside it (`kd.hidden_states`, each kept layer paired with the teacher layer it
came from). It ends with the validation
losses, the share of the pruned student's gap to the teacher that healing closed, bits per byte of the
teacher and of the student before and after, the student's KL to the teacher and top-1 agreement with it
before and after, greedy completions of one prompt, and the loss curves.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

from meshkd import commands
from meshkd.demo_cross_tokenizer import run_cross_tokenizer_demo
from meshkd.demo_runs import demo_overrides, figures_report, print_curves
from meshkd.recipe.settings.config import ConfigError
from meshkd.recipe.settings.config_loading import load_config

_DEMO_CONFIG = "demo.yaml"
# Ends inside the code, so that the instruct teacher continues the function rather than explaining it.
_DEMO_PROMPT = 'def is_palindrome(text):\n    """Return True if text reads the same backwards."""\n    return'


def _demo_cache(config_path: str, overrides: list[str]) -> int:
    """Write the demo's teacher cache unless the one there already fits the run (then the teacher never runs)."""
    from meshkd.recipe.lifecycle.preflight import preflight

    config = load_config(config_path, overrides)
    try:
        preflight(config)
        print(f"meshkd demo: the teacher's answers come from the cache {config.kd.teacher_cache}")
        return 0
    except ConfigError as error:
        if not str(error).startswith("kd.teacher_cache:"):
            raise
    print("meshkd demo: computing the teacher's answers once (meshkd cache-teacher)")
    return commands.cache_teacher_command(config_path, overrides, None, None)


# `meshkd demo --on-policy`: short rows so the student's completions fit a few minutes on 2 CPU cores. The
# student completes the first 32 tokens of each row with 32 of its own, trained on by reverse KL; the
# off-policy run it is compared with (--compare) trains on text rows of the same length with half the steps,
# so both train on about as many tokens (each text row has 63 targets, each completion at most 32). Both take
# 4 rows a step at lr 1e-3, not the text demo's 2 rows at 5e-4 (as docs/on-policy.md's figures were measured).
_ON_POLICY_STEPS = ["step_scheduler.global_batch_size=4", "step_scheduler.local_batch_size=2",
                    "step_scheduler.val_batches=4", "optimizer.lr=1e-3"]
_ON_POLICY = [*_ON_POLICY_STEPS, "kd.mode=on_policy", "kd.divergence=reverse_kl", "kd.generation.prompt_tokens=32",
              "kd.generation.max_new_tokens=32", "step_scheduler.sequence_length=64", "step_scheduler.max_steps=30",
              "lr_scheduler.warmup_steps=3"]
_OFF_POLICY_BESIDE = [*_ON_POLICY_STEPS, "kd.generation.evaluate=true", "step_scheduler.max_steps=15",
                      "kd.generation.prompt_tokens=32", "kd.generation.max_new_tokens=32",
                      "step_scheduler.sequence_length=64"]


def run_demo(args: argparse.Namespace) -> int:
    """`meshkd demo`: heal the pruned student (with --compare also by CE only; --on-policy on its own
    completions), then report the losses and completions; returns the exit status."""
    config_path = str(resources.files("meshkd") / "configs" / _DEMO_CONFIG)
    if args.on_policy and args.cross_tokenizer:
        raise ConfigError("meshkd demo: --on-policy and --cross-tokenizer do not combine (kd.cross_tokenizer "
                          "trains off-policy only)")
    if args.hidden_states and (args.on_policy or args.cross_tokenizer):
        raise ConfigError("meshkd demo: --hidden-states compares with the text demo's KD run; leave out --on-policy "
                          "and --cross-tokenizer")
    if args.on_policy:
        return _demo_on_policy(config_path, args)
    if args.cross_tokenizer:
        return run_cross_tokenizer_demo(config_path, args)
    # Top-k with sampled tail tokens: 772 bytes a token; full logits would be 192 KiB a token here.
    cache = ["kd.logits_transport=topk", f"kd.teacher_cache={args.run_dir}_teacher_cache"] if args.cache else []
    # The student's layers are measured once, in the KD run's directory, and every run of the demo keeps them.
    layers = commands.selected_layers(load_config(config_path, demo_overrides(args.run_dir, cache + args.set)))
    runs = [("kd", args.run_dir, [])]
    if args.compare:
        runs.append(("ce", args.run_dir + "_ce_only", ["kd.kd_ratio=0.0"]))
    if args.hidden_states:
        runs.append(("hidden", args.run_dir + "_hidden_states", [_HIDDEN_STATES]))
    if cache:
        code = _demo_cache(config_path, demo_overrides(args.run_dir, cache + args.set + layers))
        if code != 0:
            return code
    summaries = {}
    for name, run_dir, extra in runs:
        print(f"meshkd demo: healing the pruned student with {_LABELS[name]} -> {run_dir}")
        overrides = demo_overrides(run_dir, extra + cache + args.set + layers)
        code = commands.train_command(config_path, overrides, None, False)
        if code != 0:
            return code
        summaries[name] = json.loads(Path(run_dir, "summary.json").read_text())
    _demo_report(load_config(config_path, demo_overrides(args.run_dir, cache + args.set + layers)), summaries,
                 {name: run_dir for name, run_dir, _ in runs})
    return 0


def _demo_on_policy(config_path: str, args: argparse.Namespace) -> int:
    """On-policy distillation of the pruned student (and with --compare, off-policy at about the same tokens)."""
    if args.cache:
        raise ConfigError("meshkd demo --on-policy: the teacher scores the student's own completions, which no "
                          "cache holds; leave out --cache")
    from meshkd.recipe.common import metrics

    run_dir = args.run_dir + "_on_policy"
    layers = commands.selected_layers(load_config(config_path, demo_overrides(run_dir, _ON_POLICY + args.set)))
    runs = [("on-policy", run_dir, _ON_POLICY)]
    if args.compare:
        runs.append(("off-policy", run_dir + "_beside", _OFF_POLICY_BESIDE))
    names = {"forward_kl": "forward KL", "reverse_kl": "reverse KL", "jsd": "JSD", "skew_forward_kl": "skew KL",
             "skew_reverse_kl": "skew reverse KL", "tvd": "TVD"}
    runs = [(f"{name} ({names[load_config(config_path, demo_overrides(directory, extra + args.set)).kd.divergence]})",
             directory, extra) for name, directory, extra in runs]  # as --set may have changed it
    for name, directory, extra in runs:
        print(f"meshkd demo: healing the pruned student {name} -> {directory}")
        code = commands.train_command(config_path, demo_overrides(directory, extra + args.set + layers), None, False)
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
    from meshkd.recipe.lifecycle.completions import compare_completions

    config = load_config(config_path, demo_overrides(run_dir, _ON_POLICY + args.set + layers))
    trained = {f"{name} student": json.loads(Path(directory, "summary.json").read_text())["hf_dir"]
               for name, directory, _ in runs}
    print(f"\ngreedy completions of {_DEMO_PROMPT!r}:")
    for name, text in compare_completions(config.teacher_named().model, config.model.keep_layers, trained, _DEMO_PROMPT,
                                          max_new_tokens=16).items():
        print(f"--- {name}\n{_DEMO_PROMPT}{text}")
    print_curves({name: directory for name, directory, _ in runs})
    return 0


_LABELS = {"kd": "KD", "ce": "CE only", "hidden": "KD + hidden-state KD"}
_HIDDEN_STATES = "kd.hidden_states={pairs: kept}"


def _demo_report(config, summaries: dict[str, dict], run_dirs: dict[str, str]) -> None:
    """Losses, the share of the pruned student's gap to the teacher that healing closed, completions, and the
    runs' curves on one figure."""
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
    if "hidden" in summaries:
        hidden = summaries["hidden"]["val_loss_after"]
        rows.append(("after KD + hidden-state KD healing", hidden, closed(hidden)))
    print("\nvalidation loss (nats/token) on held-out Python standard library sources:")
    for label, loss, note in rows:
        print(f"  {label:<44} {loss:.4f}" + (f"  ({note})" if note else ""))
    figures_report(kd, {_LABELS[name].replace("CE only", "CE-only"): summary for name, summary in summaries.items()
                        if name != "kd"})
    if "hf_dir" in kd:
        from meshkd.recipe.lifecycle.completions import compare_completions

        print(f"HF-format student written to {kd['hf_dir']}\n\ngreedy completions of {_DEMO_PROMPT!r}:")
        texts = compare_completions(config.teacher_named().model, config.model.keep_layers,
                                    {"trained student": kd["hf_dir"]}, _DEMO_PROMPT, max_new_tokens=16)
        for name, text in texts.items():
            print(f"--- {name}\n{_DEMO_PROMPT}{text}")
    print_curves({_LABELS[name]: run_dir for name, run_dir in run_dirs.items()})

"""Healing settings for `meshkd demo`, side by side: `python bench/demo_settings.py [NAME ...]`.

One process, so settings compare on compute alone: the demo's teacher answers the demo's training rows once
(kept in memory in bf16), then each setting heals a fresh copy of the demo's pruned student on the rows its
steps visit and reports the held-out loss on the demo's 16 validation rows. Every setting trains on the same
60 rows (steps x rows a step), so they differ only in how those tokens are used. The student's layers are
those `meshkd prune` records for the demo (measured here once if no run directory holds them).
"""

from __future__ import annotations

import argparse
import sys
import time
from importlib import resources

import torch

from meshkd.core.loss import cross_entropy_loss, kd_loss, kd_objective
from meshkd.core.masks import attention_windows, layer_masks
from meshkd.demo_runs import demo_overrides
from meshkd.parallel.pruning import prune_layers
from meshkd.recipe.corpus import data
from meshkd.recipe.corpus.batches import iterate_batches, training_rows
from meshkd.recipe.modeling import models
from meshkd.recipe.settings.config_loading import load_config
from meshkd.recipe.student import layer_selection
from meshkd.recipe.student.train_step import lr_factor

# name: (steps, rows a step, peak lr, kd_ratio); the demo config's optimizer and schedule otherwise.
SETTINGS = {
    "15x4 lr 1e-3 KD": (15, 4, 1e-3, 1.0),
    "15x4 lr 5e-4 KD": (15, 4, 5e-4, 1.0),
    "30x2 lr 5e-4 KD": (30, 2, 5e-4, 1.0),
    "30x2 lr 5e-4 CE": (30, 2, 5e-4, 0.0),
}
_VAL_ROWS = 16


def _logits(model, batch):
    documents = batch["attention_mask"]
    masks = layer_masks(documents, attention_windows(model.config, model), dtype=torch.float32)
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=masks,
                 use_cache=False).logits


def _val_loss(model, val) -> float:
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, _VAL_ROWS, 4):
            batch = val[start: start + 4]
            labels = batch["labels"]
            total += float(torch.nn.functional.cross_entropy(_logits(model, batch).flatten(0, 1), labels.flatten(),
                                                             reduction="sum"))
            tokens += int((labels != -100).sum())
    return total / tokens


def _heal(config, keep: list[int], train, val, teacher: dict[int, torch.Tensor], steps: int, rows: int, lr: float,
          kd_ratio: float) -> float:
    torch.manual_seed(0)
    with models.loading_quietly():
        student = prune_layers(models.load_causal_lm(path=config.model.path), keep).train()
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr, betas=tuple(config.optimizer.betas),
                                  weight_decay=config.optimizer.weight_decay, eps=config.optimizer.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config.lr_scheduler, steps))
    batches = iterate_batches(train, global_batch_size=rows, dp_rank=0, dp_size=1, seed=config.dataset.seed)
    for _, batch in zip(range(steps), batches):
        logits, labels = _logits(student, batch), batch["labels"]
        tokens = int((labels != -100).sum())
        ce = cross_entropy_loss(logits, labels, num_valid_tokens=tokens) if kd_ratio < 1 else None
        kd = None
        if kd_ratio > 0:
            answers = torch.stack([teacher[_row_key(row)] for row in batch["input_ids"]]).float()
            kd = kd_loss(logits, answers, labels, num_valid_tokens=tokens, chunk_size=config.kd.chunk_size)
        loss = kd_objective(ce, kd, kd_ratio)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), config.optimizer.max_grad_norm)
        optimizer.step()
        scheduler.step()
    student.eval()
    return _val_loss(student, val)


def _row_key(input_ids: torch.Tensor) -> int:
    return hash(tuple(input_ids.tolist()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"settings to run (default: all of {list(SETTINGS)})")
    parser.add_argument("--run-dir", default="runs/demo", help="where the demo's layer selection is (or goes)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    config = load_config(resources.files("meshkd") / "configs" / "demo.yaml", demo_overrides(args.run_dir, []))
    tokenizer = models.load_tokenizer(path=config.model.path)
    keep = layer_selection.resolve(config, tokenizer)
    train, val = data.build_run_datasets(tokenizer, config.dataset,
                                         sequence_length=config.step_scheduler.sequence_length)
    with models.loading_quietly():
        teacher_model = models.load_causal_lm(path=config.model.path).eval()
    started = time.perf_counter()
    rows = training_rows(train, global_batch_size=1, seed=config.dataset.seed, num_steps=60)
    teacher = {}
    with torch.no_grad():
        for start in range(0, len(rows), 4):
            batch = train[torch.tensor(rows[start: start + 4])]
            for ids, logits in zip(batch["input_ids"], _logits(teacher_model, batch)):
                teacher[_row_key(ids)] = logits.to(torch.bfloat16)
        teacher_loss = _val_loss(teacher_model, val)
    print(f"teacher answered {len(rows)} rows in {time.perf_counter() - started:.0f} s; held-out loss "
          f"{teacher_loss:.4f}; student layers {keep}", flush=True)
    before = _val_loss(prune_layers(teacher_model, keep), val)  # the teacher's part is done: pruned in place
    print(f"pruned student before healing: {before:.4f}")
    for name in args.names or SETTINGS:
        started = time.perf_counter()
        steps, per_step, lr, kd_ratio = SETTINGS[name]
        after = _heal(config, keep, train, val, teacher, steps, per_step, lr, kd_ratio)
        closed = (before - after) / (before - teacher_loss)
        seconds = time.perf_counter() - started
        print(f"{name:<18} held-out {after:.4f}  ({closed:.0%} of the gap closed; {seconds:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What each training step trains on, on one data-parallel rank, and the training of each next step on it.

`batches.iterate_batches` gives this rank's share of each remaining step's global batch; `StepData` cuts it
into micro-batches (each with its step's valid-token count: `train_step.step_items`) and pairs them with the
teacher's answers in a `TeacherFeed`. With `kd.overlap_teacher` a teacher on its own ranks is asked for the
next micro-batch while this one trains (the next step's micro-batches under pipeline parallel, whose
schedule takes a whole step at once): the same requests in the same order, so the same answers. Under
`kd.mode: on_policy` each step makes its own feed from the student's completions (`OnPolicyStep`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from meshkd.core.teacher_protocol import TeacherFeed, TeacherRequest, TeacherSource
from meshkd.recipe.corpus import data
from meshkd.recipe.corpus.aligned_data import row_fill, run_packing
from meshkd.recipe.corpus.batches import iterate_batches
from meshkd.recipe.corpus.routing import route_names
from meshkd.recipe.settings.config import KDRecipeConfig
from meshkd.recipe.student.on_policy import OnPolicyStep, build_prompt_set
from meshkd.recipe.student.train_step import TrainStep, micro_batches, step_items


def run_datasets(config: KDRecipeConfig, tokenizer, teacher_tokenizer) -> tuple:
    """(training rows, validation rows, training prompts, validation prompts) of a run; the prompts are None
    unless the student completes whole prompts (`DatasetConfig.whole_prompts`). With `kd.cross_tokenizer` the
    rows carry the teacher's tokenization too (`meshkd.recipe.corpus.aligned_data`); with `dataset.teacher_key` the
    rows and the prompts their teacher (`meshkd.recipe.corpus.routing`)."""
    steps = config.step_scheduler
    train, val = data.build_run_datasets(tokenizer, config.dataset, sequence_length=steps.sequence_length,
                                         pack_texts=run_packing(config, tokenizer, teacher_tokenizer),
                                         routes=route_names(config), store_wait_s=config.setup_timeout_s)
    if not (config.dataset.whole_prompts and config.kd.generates):
        return train, val, None, None
    max_prompt_tokens = steps.sequence_length - config.kd.generation.max_new_tokens
    return train, val, *build_prompt_set(tokenizer, config.dataset, max_prompt_tokens=max_prompt_tokens,
                                         routes=route_names(config))


class StepData:
    """The remaining steps' data of one data-parallel rank, from `start_step` to `max_steps`, and the training
    of each next step on it (`train_next`)."""

    def __init__(self, config: KDRecipeConfig, *, dp_rank: int, dp_size: int, start_step: int,
                 device: torch.device, train_set, train_prompts, teacher: TeacherSource, train_step: TrainStep,
                 on_policy_step: OnPolicyStep | None) -> None:
        self.config, self.dp_rank, self.dp_size = config, dp_rank, dp_size
        self.start_step, self.device = start_step, device
        self.train_step, self.on_policy_step = train_step, on_policy_step
        self._text = self.batches(train_set)
        self._prompts = None if train_prompts is None else self.batches(train_prompts)
        # With kd.cross_tokenizer each step's metrics also hold the rows' row_fill and teacher_row_fill
        # (`meshkd.recipe.corpus.aligned_data.row_fill`: the same every step).
        self._fill = row_fill(train_set)
        self._next: list[tuple[list[dict], list[dict]]] = []  # a step read ahead for its prompts (on-policy)
        self.feed = TeacherFeed(()) if on_policy_step is not None else self.teacher_feed(
            teacher, self.items(self._text),
            pipeline_depth=train_step.num_micro_batches if train_step.pipeline is not None else 0)
        """The answers to every remaining micro-batch, in order; the run closes it at its end (an on-policy
        step makes its own each step)."""

    def batches(self, rows) -> Iterator[dict]:
        """This rank's share of each remaining step's global batch of `rows`."""
        steps = self.config.step_scheduler
        return iterate_batches(rows, global_batch_size=steps.global_batch_size, dp_rank=self.dp_rank,
                                    dp_size=self.dp_size, seed=self.config.dataset.seed, start_step=self.start_step)

    def micro_batches(self, batch: dict) -> list[dict]:
        return micro_batches(batch, size=self.config.step_scheduler.local_batch_size, device=self.device)

    def items(self, batches: Iterator[dict]) -> Iterator[dict]:
        """The micro-batches of every remaining step in order, each with its step's local valid-token count and
        its rows on the host (`host_batch`: views of the batch the data gave, which a served teacher sends)."""
        size = self.config.step_scheduler.local_batch_size
        for _ in range(self.start_step, self.config.step_scheduler.max_steps):
            batch = next(batches)
            host = micro_batches(batch, size=size, device=torch.device("cpu"))  # views: the batch is on the host
            for item, host_batch in zip(step_items(self.micro_batches(batch), ignore_index=self.config.kd.ignore_index),
                                        host):
                yield item | {"host_batch": host_batch}

    def teacher_feed(self, teacher: TeacherSource, items: Iterator[dict], *, pipeline_depth: int) -> TeacherFeed:
        """(item, encoded teacher answer) in order; the answers are None when the loss needs no teacher.

        `pipeline_depth`: the micro-batches a pipelined student's schedule takes at once (0: not pipelined)."""
        kd = self.config.kd
        if kd.kd_ratio == 0:
            return TeacherFeed((item, None) for item in items)
        depth = (pipeline_depth or 1) if kd.overlap_teacher else 0
        return teacher.prefetch(items, depth=depth,
                                batch_fn=lambda item: TeacherRequest(item["micro_batch"], kd.training_answer,
                                                                     item.get("host_batch")))

    def train_next(self, skipped_steps: int) -> dict[str, float]:
        """Train the next step (`skipped_steps`: the non-finite steps skipped so far); its metrics."""
        if self.on_policy_step is None:
            return self.train_step(self.feed, skipped_steps=skipped_steps) | self._fill
        step = self.train_step.scheduler.last_epoch
        text, prompts = self._next.pop() if self._next else self._read()

        def upcoming() -> list[dict] | None:  # the next step's prompts (drawn ahead), None after the last step
            if step + 1 >= self.config.step_scheduler.max_steps:
                return None
            if not self._next:
                self._next.append(self._read())
            return self._next[0][1]

        return self.on_policy_step(text, prompts, step=step, skipped_steps=skipped_steps,
                                   upcoming=upcoming) | self._fill

    def _read(self) -> tuple[list[dict], list[dict]]:
        """The next step's (text micro-batches, prompt micro-batches) of an on-policy run."""
        text = self.micro_batches(next(self._text))
        return text, text if self._prompts is None else self.micro_batches(next(self._prompts))

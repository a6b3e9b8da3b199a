"""The student's evaluations: held-out loss, the teacher's loss of the student's samples, the first one.

`Evaluation.held_out` is the validation cross-entropy (and perplexity) of the student, with the
teacher's beside it when asked; `samples` scores the student's greedy completions of the validation
prompts by the teacher; `first` is step 0's evaluation, which a resumed run reads back from its run
directory instead of computing it again. Every student rank takes part: sums over the dp and cp ranks,
and from a pipelined student's last stage to the others, so every rank returns the same figures.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshkd.core.agreement import gather_values, group_device
from meshkd.core.logits_codec import LABEL_LOG_PROBS
from meshkd.core.loss import cross_entropy_loss
from meshkd.core.stage_broadcast import broadcast_tensors_from_last_stage
from meshkd.core.teacher_protocol import TeacherSource
from meshkd.core.topology import DistributedSetup
from meshkd.parallel.student_pipeline import StudentPipeline
from meshkd.recipe import data
from meshkd.recipe.aligned_data import teacher_side
from meshkd.recipe.config import KDRecipeConfig
from meshkd.recipe.metrics import is_logging_rank, read_metrics
from meshkd.recipe.on_policy import StudentCompletions
from meshkd.recipe.train_step import shard, student_logits, sum_over_ranks


class Evaluation:
    """A student rank's evaluations (see the module docstring).

    Args:
        model, pipeline: the laid-out student and its pipeline (or None).
        teacher: the run's teacher source.
        val_set, val_prompts: the held-out rows, and the prompts of sample evaluation (None: `val_set`'s).
        completions: makes the student's greedy `StudentCompletions` with its current weights.
        watch: `FaultWatch.watch`, around each teacher request.
        group: the student ranks' group (None: the world).
    """

    def __init__(self, config: KDRecipeConfig, setup: DistributedSetup, *, model: torch.nn.Module,
                 pipeline: StudentPipeline | None, teacher: TeacherSource, val_set, val_prompts,
                 completions: Callable[[], StudentCompletions], watch: Callable[[str, str], Any],
                 group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.config, self.setup, self.model, self.pipeline, self.teacher = config, setup, model, pipeline, teacher
        self.val_set, self.val_prompts, self.completions = val_set, val_prompts, completions
        self.watch, self.group, self.device = watch, group, device
        self.dp_rank = setup.dp_mesh.get_local_rank()

    def _batches(self, rows) -> Any:
        steps = self.config.step_scheduler
        batches = data.eval_batches(rows, batch_size=steps.local_batch_size, dp_rank=self.dp_rank,
                                    dp_size=self.setup.dp_size)
        for index, batch in enumerate(batches):
            if steps.val_batches is not None and index >= steps.val_batches:
                return
            yield batch

    def _teacher_log_probs(self, batch: dict) -> dict:
        with self.watch("the teacher request", "teacher"):
            return self.teacher.request(batch, LABEL_LOG_PROBS)

    @torch.no_grad()
    def held_out(self, *, with_teacher: bool = False) -> dict[str, float]:
        """Validation CE (and perplexity) of the student, and of the teacher when asked."""
        ignore = self.config.kd.ignore_index
        # student CE, teacher CE, student tokens, teacher tokens (its own with kd.cross_tokenizer)
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)
        self.model.eval()
        for batch in self._batches(self.val_set):
            micro_batch = {key: value.to(self.device) for key, value in batch.items()}
            answer = self._teacher_log_probs(micro_batch) if with_teacher else None
            micro_batch, answer = shard(micro_batch, answer, self.setup, ignore_index=ignore)
            labels = micro_batch["labels"]
            logits = student_logits(self.model, self.pipeline, micro_batch)
            if logits is None:  # a pipeline stage before the last: the last stage's sums arrive below
                continue
            sums[0] += cross_entropy_loss(logits, labels, ignore_index=ignore, num_valid_tokens=1).double()
            if with_teacher:  # 0 at ignored labels
                sums[1] -= answer["log_probs"].sum().double()
                sums[3] += (teacher_side(micro_batch)["labels"] != ignore).sum()
            sums[2] += (labels != ignore).sum()
        self.model.train()
        if self.pipeline is not None:
            last = {"sums": sums.cpu()} if self.pipeline.is_last else None
            sums = broadcast_tensors_from_last_stage(last, pp_group=self.setup.pp_group)["sums"]
        student_sum, teacher_sum, count, teacher_count = sum_over_ranks(sums, self.setup, device=self.device,
                                                                        and_cp=True)
        count = max(count, 1.0)
        result = {"val_loss": student_sum / count, "val_perplexity": math.exp(min(student_sum / count, 50.0))}
        if with_teacher:
            result["teacher_val_loss"] = teacher_sum / max(teacher_count, 1.0)
        return result

    @torch.no_grad()
    def samples(self) -> dict[str, float]:
        """The teacher's loss per token of the student's greedy completions of the validation prompts.

        How far the student's own text is from what the teacher would write: the quantity on-policy
        distillation lowers, measured the same way for any mode."""
        completer, sums = self.completions(), [0.0, 0.0, 0.0]  # teacher NLL, tokens, completions
        for batch in self._batches(self.val_set if self.val_prompts is None else self.val_prompts):
            rows, tokens, completed = completer.rows(batch, [0] * batch["input_ids"].shape[0])
            answer = self._teacher_log_probs(rows)
            sums = [sums[0] - float(answer["log_probs"].sum()), sums[1] + tokens, sums[2] + completed]
        nll, tokens, completions = sum_over_ranks(sums, self.setup, device=self.device)
        return {"teacher_nll_of_samples": nll / max(tokens, 1.0), "sample_length": tokens / max(completions, 1.0)}

    def full(self, *, with_teacher: bool = False, with_samples: bool) -> dict[str, float]:
        """The held-out figures, and the samples' when asked."""
        result = self.held_out(with_teacher=with_teacher)
        if with_samples:
            result.update(self.samples())
        return result

    def first(self, run_dir: Path, *, start_step: int, with_samples: bool) -> tuple[dict[str, float], bool]:
        """Step 0's evaluation (student and teacher) and whether it was computed now (else read back).

        A resumed run reuses the one its run directory logged: rank 0 reads the run's metrics and hands
        what it found to every student rank, so all take the same branch (the run directory need not be
        shared across hosts).
        """
        logged = None
        if start_step > 0 and is_logging_rank():
            with contextlib.suppress(FileNotFoundError):
                logged = next((record for record in read_metrics(run_dir)
                               if record["kind"] == "eval" and record["step"] == 0 and "teacher_val_loss" in record),
                              None)
        if start_step > 0:
            logged = gather_values(logged, self.group, device=group_device(self.group))[0]
        if logged is not None:
            return logged, False
        return self.full(with_teacher=True, with_samples=with_samples), True

"""The student's evaluations: held-out loss, the teacher's loss of the student's samples, the first one.

`Evaluation.held_out` gives, on the validation rows:

- `val_loss` (and `val_perplexity`): the student's cross-entropy per valid label, in nats; with the
  teacher asked, `teacher_val_loss` beside it.
- `val_nats_per_byte` / `val_bits_per_byte` (and `teacher_val_*` with the teacher): the loss per byte of
  held-out text, which compares across tokenizers. A label covers the UTF-8 bytes of its token
  (`meshkd.core.token_bytes.token_byte_lengths`, built once); special tokens such as EOS cover none and
  are left out of both sums, as `meshkd.core.cross_tokenizer_loss.nll_and_bytes` does, so two
  tokenizations of the same text divide the same bytes. Each side divides its own negative log-likelihood
  by the bytes of its own labels; with one tokenizer the teacher's labels are the student's, so the bytes
  are the same. A teacher with another tokenizer (`kd.cross_tokenizer`) is scored on its own tokenization
  of the rows: `teacher_val_loss` per its own valid label, its bytes by its own tokens.
- With the teacher asked and one vocabulary on both sides, what distillation optimizes: `val_kl`, the
  forward KL(teacher || student) per valid label in nats at `kd.temperature` (the training's forward-KL
  `kd_loss` is T^2 times it), against the teacher's answer in the run's `kd.logits_transport`: exact for
  full and full_bf16, for topk the same top-k estimate the training uses (`meshkd.core.answers.topk`:
  with a rest bucket a lower bound of the full KL, with sampled tail tokens an unbiased estimate); and
  `val_top1_agreement`, the share of valid labels where the student's likeliest token is the teacher's
  (the teacher's from its full logits, or the first of its top-k). Both over the vocabulary the two
  share (the student's logits cut to it, as in training). One request per batch carries the encoding
  and each label's log-probability (`with_label_log_probs`); the typed answer gives each figure
  (`meshkd.recipe.teacher.teacher_answers`: `label_log_probs`, `Distribution.kl`, `Distribution.top1_agreements`).
  A teacher cache holds only the labels' log-probabilities for validation rows, and a teacher with another
  tokenizer answers over its own vocabulary: these two figures are then left out, and the evaluation says
  why.

Which evaluations ask the teacher: the first (step 0) and the last, one teacher request per validation
batch each (`step_scheduler.val_batches` bounds them). The periodic ones (`val_every_steps`) report the
student's figures only: they run between steps while a prefetching teacher feed may already be asking for
the next step's micro-batches on the bridge, and they stay as cheap as the student's forward.

Where the training's output layer is fused with its loss (`kd.fused_output_loss`), the held-out sums are made
through it too, chunk by chunk (`FusedHead.evaluate`): the [tokens, vocab] logits are never whole there either.

`samples` scores the student's greedy completions of the validation prompts by the teacher; `first` is
step 0's evaluation, which a resumed run reads back from its run directory instead of computing it again.
Every student rank takes part: sums over the dp and cp ranks, and from a pipelined student's last stage to
the others, so every rank returns the same figures.
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
from meshkd.core.answers import LABEL_LOG_PROBS, LossContext
from meshkd.core.loss import cross_entropy_loss
from meshkd.core.stage_broadcast import broadcast_tensors_from_last_stage
from meshkd.core.teacher_protocol import TeacherSource
from meshkd.core.topology import DistributedSetup
from meshkd.parallel.student_pipeline import StudentPipeline
from meshkd.recipe.common.metrics import is_logging_rank, read_metrics, warn0
from meshkd.recipe.corpus.batches import eval_batches, to_device
from meshkd.recipe.corpus.rows import teacher_side
from meshkd.recipe.settings.config import KDConfig, KDRecipeConfig
from meshkd.recipe.student.fused_head import FusedHead
from meshkd.recipe.student.on_policy import StudentCompletions
from meshkd.recipe.student.train_step import shard_micro_batch, student_logits, sum_over_ranks
from meshkd.recipe.teacher.teacher_answers import ANSWERS, Cut, Distribution, TeacherAnswer, answer_of, selected_kind


def before_and_after(figures: dict[str, float], suffix: str) -> dict[str, float]:
    """The summary's keys of an evaluation's figures: the student's with `suffix` ("_before" / "_after"), the
    teacher's per byte as they are (the teacher does not train); of several teachers each one's too, as
    KEY_before/NAME or KEY/NAME. Figures an evaluation did not report (an older run's step 0 read back, or
    KL and top-1 from a teacher cache) are left out."""
    student = ("val_nats_per_byte", "val_bits_per_byte", "val_kl", "val_top1_agreement", "val_acceptance")
    teacher = ("teacher_val_loss", "teacher_val_nats_per_byte", "teacher_val_bits_per_byte")
    result = {}
    for key, value in figures.items():
        base, slash, name = key.partition("/")
        if base in student:
            result[base + suffix + slash + name] = value
        elif base in teacher and (slash or base != "teacher_val_loss"):  # the plain one is the summary's own
            result[key] = value
    return result


# Slots of the held-out sums, added over batches and ranks.
(_STUDENT_CE, _TEACHER_CE, _TOKENS, _TEACHER_TOKENS, _STUDENT_NLL, _TEACHER_NLL, _STUDENT_BYTES, _TEACHER_BYTES, _KL,
 _TOP1, _ACCEPTANCE, _INDEX_ERRORS) = range(12)


class Evaluation:
    """A student rank's evaluations (see the module docstring).

    Args:
        config: the run's.
        kd: `config.kd` as the teacher answers it (`KDRecipeConfig.kd_of`).
        model, pipeline: the laid-out student and its pipeline (or None).
        teacher: the teacher's source.
        val_set, val_prompts: the held-out rows, and the prompts of sample evaluation (None: `val_set`'s).
        completions: makes the student's greedy `StudentCompletions` with its current weights.
        watch: `FaultWatch.watch`, around each teacher request.
        group: the student ranks' group (None: the world).
        byte_lengths: UTF-8 bytes of each student vocabulary id (`token_byte_lengths`), 0 for specials.
        teacher_byte_lengths: the same of the teacher's vocabulary (None: one tokenizer, `byte_lengths`).
        vocab_size: the vocabulary the teacher's answers cover (the student's logits are cut to it).
        teacher_role: how a lost teacher is named (one of several: `TeacherSetups.role`).
        validation_answer: the one encoding the teacher answers validation rows in (a teacher cache's), where
            it cannot answer in others; None: the one asked.
        fused_head: the training's fused output layer (`FusedHead.of`), through which the held-out figures are
            summed chunk by chunk too (None: from whole logits).
    """

    def __init__(self, config: KDRecipeConfig, setup: DistributedSetup, *, kd: KDConfig, model: torch.nn.Module,
                 pipeline: StudentPipeline | None, teacher: TeacherSource, val_set, val_prompts,
                 completions: Callable[[], StudentCompletions], watch: Callable[[str, str], Any],
                 group: dist.ProcessGroup | None, device: torch.device, byte_lengths: torch.Tensor,
                 vocab_size: int, teacher_byte_lengths: torch.Tensor | None = None,
                 teacher_role: str = "teacher", validation_answer: str | None = None,
                 fused_head: FusedHead | None = None) -> None:
        self.config, self.kd, self.setup, self.model = config, kd, setup, model
        self.pipeline, self.teacher = pipeline, teacher
        self.val_set, self.val_prompts, self.completions = val_set, val_prompts, completions
        self.watch, self.group, self.device, self.teacher_role = watch, group, device, teacher_role
        self.byte_lengths, self.vocab_size = byte_lengths.to(device), vocab_size
        self.teacher_byte_lengths = (self.byte_lengths if teacher_byte_lengths is None
                                     else teacher_byte_lengths.to(device))
        self.dp_rank, self.fused_head = setup.dp_mesh.get_local_rank(), fused_head
        self.answer_kind = selected_kind(kd)
        """The kind of distribution the teacher answers held-out rows with (where it answers one)."""
        self.without_distribution = None
        """Why `val_kl` and `val_top1_agreement` are left out of evaluations with the teacher (None: they are not)."""
        if validation_answer is not None and not issubclass(ANSWERS.named(validation_answer), Distribution):
            self.without_distribution = ("kd.teacher_cache holds only each label's log-probability for validation "
                                         "rows, not the teacher's distribution")
        if kd.cross_tokenizer is not None:
            self.without_distribution = "with kd.cross_tokenizer the teacher predicts over its own vocabulary"

    def _batches(self, rows) -> Any:
        steps = self.config.step_scheduler
        batches = eval_batches(rows, batch_size=steps.local_batch_size, dp_rank=self.dp_rank,
                                    dp_size=self.setup.dp_size)
        for index, batch in enumerate(batches):
            if steps.val_batches is not None and index >= steps.val_batches:
                return
            yield batch

    def _teacher_answer(self, batch: dict, transport: str = LABEL_LOG_PROBS, *, host_batch: dict | None = None,
                        with_label_log_probs: bool = False) -> TeacherAnswer | None:
        with self.watch("the teacher request", self.teacher_role):
            return answer_of(self.teacher.request(batch, transport, host_batch=host_batch,
                                                  with_label_log_probs=with_label_log_probs))

    @torch.no_grad()
    def held_out(self, *, with_teacher: bool = False) -> dict[str, float]:
        """The held-out figures of the student, and of the teacher beside it when asked (module docstring)."""
        kd = self.kd
        with_distribution = with_teacher and self.without_distribution is None
        if with_teacher and self.without_distribution is not None:
            warn0(f"the evaluations report no val_kl or val_top1_agreement: {self.without_distribution}")
        transport = kd.logits_transport if with_distribution else LABEL_LOG_PROBS
        sums = torch.zeros(12, dtype=torch.float64, device=self.device)
        # Each answer's index check, read with the sums (no host sync a batch, none a chunk).
        checks = LossContext(kd, index_checks=[])
        self.model.eval()
        for batch in self._batches(self.val_set):
            micro_batch = {key: to_device(value, self.device) for key, value in batch.items()}
            answer = self._teacher_answer(micro_batch, transport, host_batch=batch,
                                          with_label_log_probs=with_distribution) if with_teacher else None
            if with_distribution and answer is not None:
                answer.check_indices(checks, self.vocab_size)
            micro_batch = shard_micro_batch(micro_batch, self.setup, ignore_index=kd.ignore_index)
            answer = answer.shard(self.setup) if answer is not None else None
            labels = micro_batch["labels"]
            label_bytes = self._label_bytes(labels, self.byte_lengths)
            # The labels that cover text: the loss per byte leaves out those that cover none (EOS).
            text_labels = torch.where(label_bytes > 0, labels, kd.ignore_index)
            if not self._add_student(sums, micro_batch, text_labels, answer, with_distribution=with_distribution):
                continue  # a pipeline stage before the last: the last stage's sums arrive below
            self._add_batch(sums, labels, label_bytes, answer, teacher_side(micro_batch)["labels"])
        self.model.train()
        if checks.index_checks:
            sums[_INDEX_ERRORS] = torch.stack(checks.index_checks).sum()
        if self.pipeline is not None:
            last = {"sums": sums.cpu()} if self.pipeline.is_last else None
            sums = broadcast_tensors_from_last_stage(last, pp_group=self.setup.pp_group)["sums"]
        summed = sum_over_ranks(sums, self.setup, device=self.device, and_cp=True)
        if summed[_INDEX_ERRORS]:
            raise ValueError(f"a teacher answer to a held-out batch is malformed: "
                             f"{self.answer_kind.index_message(self.vocab_size)}")
        return self._figures(summed, with_teacher=with_teacher, with_distribution=with_distribution,
                             with_acceptance=with_distribution and self.answer_kind.whole_distribution)

    def _add_student(self, sums: torch.Tensor, micro_batch: dict, text_labels: torch.Tensor,
                     answer: TeacherAnswer | None, *, with_distribution: bool) -> bool:
        """Add the sums of the student's logits of a micro-batch (`_add_logits`): through the fused output layer
        chunk by chunk (no [tokens, vocab] logits), or from its whole logits; False on a pipeline stage before
        the last, which has none."""
        labels = micro_batch["labels"]
        if self.fused_head is None:
            logits = student_logits(self.model, self.pipeline, micro_batch)
            if logits is not None:
                self._add_logits(sums, logits, labels, text_labels, answer, with_distribution=with_distribution)
            return logits is not None
        flat, text = labels.reshape(-1), text_labels.reshape(-1)

        def on_chunk(logits: torch.Tensor, tokens: slice) -> None:
            self._add_logits(sums, logits, flat[tokens], text[tokens], answer, with_distribution=with_distribution,
                             cut=(tokens, tuple(labels.shape)))

        hidden = self.fused_head.hidden_states(self.model, self.pipeline, micro_batch)
        with self.pipeline.gathered() if self.pipeline is not None else contextlib.nullcontext():
            self.fused_head.evaluate(hidden, on_chunk)
        return True

    def _label_bytes(self, labels: torch.Tensor, byte_lengths: torch.Tensor) -> torch.Tensor:
        """Each label's UTF-8 bytes by `byte_lengths`, 0 at ignored labels."""
        valid = labels != self.kd.ignore_index
        return torch.where(valid, byte_lengths[labels.clamp(min=0)], 0)

    def _add_logits(self, sums: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, text_labels: torch.Tensor,
                    answer: TeacherAnswer | None, *, with_distribution: bool, cut: Cut | None = None) -> None:
        """Add the sums the student's logits give: of a micro-batch (this rank's share), or of some of its
        positions (`cut`: `logits` [c, vocab] and the labels [c] of those flattened positions)."""
        kd, ignore = self.kd, self.kd.ignore_index
        sums[_STUDENT_CE] += cross_entropy_loss(logits, labels, ignore_index=ignore, num_valid_tokens=1).double()
        sums[_STUDENT_NLL] += cross_entropy_loss(logits, text_labels, ignore_index=ignore, num_valid_tokens=1).double()
        if answer is None or not with_distribution:
            return
        kd_logits = logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]
        sums[_KL] += answer.kl(kd_logits, labels, kd, cut)
        sums[_TOP1] += answer.top1_agreements(kd_logits, labels, ignore_index=ignore, cut=cut)
        if answer.whole_distribution:
            sums[_ACCEPTANCE] += answer.acceptance(kd_logits, labels, kd, cut)

    def _add_batch(self, sums: torch.Tensor, labels: torch.Tensor, label_bytes: torch.Tensor,
                   answer: TeacherAnswer | None, teacher_labels: torch.Tensor) -> None:
        """Add the sums of one micro-batch (this rank's share) beside the student's logits': its tokens and
        bytes (`label_bytes`: each label's), and the teacher's figures from `answer` (its labels'
        log-probabilities), or None; `teacher_labels`: those of its tokenization (the student's with one
        tokenizer)."""
        ignore = self.kd.ignore_index
        sums[_STUDENT_BYTES] += label_bytes.sum()
        sums[_TOKENS] += (labels != ignore).sum()
        if answer is None:
            return
        log_probs = answer.label_log_probs().to(self.device).double()  # 0 at ignored labels
        sums[_TEACHER_CE] -= log_probs.sum()
        teacher_bytes = self._label_bytes(teacher_labels, self.teacher_byte_lengths)
        sums[_TEACHER_TOKENS] += (teacher_labels != ignore).sum()
        sums[_TEACHER_NLL] -= torch.where(teacher_bytes > 0, log_probs, 0.0).sum()
        sums[_TEACHER_BYTES] += teacher_bytes.sum()

    @staticmethod
    def _figures(sums: list[float], *, with_teacher: bool, with_distribution: bool,
                 with_acceptance: bool = False) -> dict[str, float]:
        tokens = max(sums[_TOKENS], 1.0)
        loss = sums[_STUDENT_CE] / tokens
        result = {"val_loss": loss, "val_perplexity": math.exp(min(loss, 50.0))}
        sides = [("val", _STUDENT_NLL, _STUDENT_BYTES)] + ([("teacher_val", _TEACHER_NLL, _TEACHER_BYTES)]
                                                            if with_teacher else [])
        if with_teacher:
            result["teacher_val_loss"] = sums[_TEACHER_CE] / max(sums[_TEACHER_TOKENS], 1.0)
        for name, nll, num_bytes in sides:
            if sums[num_bytes] > 0:  # held-out text of no byte (only special tokens): no loss per byte
                result[f"{name}_nats_per_byte"] = sums[nll] / sums[num_bytes]
                result[f"{name}_bits_per_byte"] = sums[nll] / sums[num_bytes] / math.log(2)
        if with_distribution:
            result["val_kl"] = sums[_KL] / tokens
            result["val_top1_agreement"] = sums[_TOP1] / tokens
        if with_acceptance:
            result["val_acceptance"] = sums[_ACCEPTANCE] / tokens
        return result

    @torch.no_grad()
    def samples(self) -> dict[str, float]:
        """The teacher's loss per token of the student's greedy completions of the validation prompts (per
        token of its own tokenization of them with `kd.cross_tokenizer`).

        How far the student's own text is from what the teacher would write: the quantity on-policy
        distillation lowers, measured the same way for any mode."""
        # teacher NLL, tokens generated, completions, the teacher's tokens scored (its own of the same text)
        completer, sums = self.completions(), [0.0, 0.0, 0.0, 0.0]
        for batch in self._batches(self.val_set if self.val_prompts is None else self.val_prompts):
            rows, tokens, completed = completer.rows(batch, [0] * batch["input_ids"].shape[0])
            answer = self._teacher_answer(rows)
            scored = int((teacher_side(rows)["labels"] != self.kd.ignore_index).sum())
            sums = [sums[0] - float(answer.label_log_probs().sum()), sums[1] + tokens, sums[2] + completed,
                    sums[3] + scored]
        nll, tokens, completions, scored = sum_over_ranks(sums, self.setup, device=self.device)
        return {"teacher_nll_of_samples": nll / max(scored, 1.0), "sample_length": tokens / max(completions, 1.0)}

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


class TeachersEvaluation:
    """The evaluations of a run with several teachers: one `Evaluation` per teacher, merged.

    The student's figures are reported once; each teacher's figures (its loss, per byte, the KL to it and the
    top-1 agreement with it, its loss of the student's samples) under KEY/NAME, and their means weighted as
    the objective weighs the teachers under KEY. Each teacher is asked in turn, beside a forward of the
    student each time.
    """

    _TEACHER_KEYS = ("teacher_", "val_kl", "val_top1_agreement", "val_acceptance")

    def __init__(self, members: dict[str, Evaluation], *, weights: dict[str, float]) -> None:
        self.members, self.weights = members, weights
        self.group = next(iter(members.values())).group

    @classmethod
    def of(cls, members: dict[str, Evaluation], *, weights: dict[str, float]) -> Evaluation | TeachersEvaluation:
        """The run's evaluation: one teacher's own `Evaluation` (its figures under their plain keys), several
        merged."""
        return next(iter(members.values())) if len(members) == 1 else cls(members, weights=weights)

    def _merged(self, figures: dict[str, dict[str, float]]) -> dict[str, float]:
        """The student's figures once; each teacher's under KEY/NAME; their weighted mean under KEY where every
        teacher reports KEY (a cached teacher's validation answers may hold its loss only)."""
        result = {key: value for key, value in next(iter(figures.values())).items()
                  if not key.startswith(self._TEACHER_KEYS)}
        keys = dict.fromkeys(key for values in figures.values() for key in values if key.startswith(self._TEACHER_KEYS))
        for key in keys:
            if all(key in values for values in figures.values()):
                result[key] = sum(self.weights[name] * values[key] for name, values in figures.items())
            result.update({f"{key}/{name}": values[key] for name, values in figures.items() if key in values})
        return result

    def held_out(self, *, with_teacher: bool = False) -> dict[str, float]:
        if not with_teacher:
            return next(iter(self.members.values())).held_out()
        return self._merged({name: member.held_out(with_teacher=True) for name, member in self.members.items()})

    def samples(self) -> dict[str, float]:
        return self._merged({name: member.samples() for name, member in self.members.items()})

    full = Evaluation.full
    first = Evaluation.first

"""A teacher's answer to a micro-batch, as a type: how the teacher makes it, its cp share, its KD loss, its
evaluation figures.

The wire carries plain dicts told apart by their "mode", as the bridge, the prefetcher and the teacher cache
pass them on. The classes here make them on the teacher's side and read them on the student's:

    answer_type(transport, kd).encode(logits, batch, transport, context)   the teacher's logits -> the wire dict
    answer_of(wire)                                       the wire dict -> its type, where the student takes it
    answer.shard(setup)                                   this cp rank's share, cut as the student's batch is
    answer.kd_loss(logits, micro_batch, context, norm=n)  (the KD term, figures for the step's metrics)
    answer.chunk_kd_loss(logits, tokens, ...)             the same of some positions (the fused output layer's)
    answer.label_log_probs(), answer.kl(...), answer.top1_agreements(...)   an evaluation's figures

- `Distribution` (every answer encoding of `meshkd.core.encodings`): the teacher's
  distribution over the student's vocabulary at every position (a cross-tokenizer teacher's projected onto
  it: `kd.cross_tokenizer.loss: projection`); the divergence of `kd.divergence` at the positions KD counts
  (`kd_labels`). Asked `with_label_log_probs`, it carries each label's log-probability besides.
- `GroupDistributions` ("groups", `meshkd.recipe.teacher.group_answers`): a cross-tokenizer teacher's distribution
  per aligned group of tokens, against the student's groups by `kd.cross_tokenizer.loss` `uld` or `gold`.
- `LabelLogProbs` ("label_log_probs"): the teacher's log-probability of each label of its own tokenization,
  what an evaluation of the teacher's loss asks for.
- `Ensemble` ("teachers"): several teachers' answers (made by `meshkd.core.teacher_ensemble.TeacherEnsemble`),
  combined by the combination `kd.combine` names (`meshkd.core.combinations`: sum, mixture of the
  distributions, `Distribution.mixture`, or route, each row to its own teacher, the answers put back together by
  `Distribution.merged`), with weights w normalized to sum to 1. Two identical teachers give the one-teacher
  objective by sum or mixture, and a weight of 0 drops a teacher.
A `Distribution` answering a training request may carry the teacher's hidden states of `kd.hidden_states`'
paired layers beside it (`with_hidden_states`); `Distribution.hidden_state_loss` is their term
(`meshkd.recipe.teacher.hidden_states`).
The base type, the contexts and the registry are `meshkd.core.answers`'; `Distribution` is one kind a mode
(`FullAnswer`, `Bfloat16Answer`, `TopKAnswer`, `CompactTopKAnswer`). A new kind of answer is one class registered
under its mode (`@register`, here or in a module of its own as `group_answers`), with `made_for` if a teacher
makes it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from meshkd.core.answers import (
    ANSWERS,
    Cut,
    EncodeContext,
    Figures,
    LossContext,
    TeacherAnswer,
    answer_of,
    answer_type,
    register,
)
from meshkd.core.combinations import combination_named
from meshkd.core.cross_tokenizer_loss import project_teacher_logits
from meshkd.core.encodings import ENCODINGS, AnswerEncoding, encoding_named, selected
from meshkd.core.encodings.compact import CompactTopK
from meshkd.core.encodings.full import Bfloat16Logits, FullLogits
from meshkd.core.encodings.topk import TopK
from meshkd.core.fused_output import chunk_answer
from meshkd.core.logits_codec import (
    LABEL_LOG_PROBS,
    LOGITS_MODES,
    encode_teacher_rows,
    kd_loss_encoded,
    label_log_probs,
    split_label_log_probs,
)
from meshkd.core.loss import top1_agreements as _top1_agreements
from meshkd.core.teacher_ensemble import ROUTE, TEACHERS
from meshkd.recipe.corpus.rows import TEACHER_POSITIONS, group_positions, kd_labels, teacher_side
from meshkd.recipe.settings.config import KDConfig
from meshkd.recipe.teacher.group_answers import GroupDistributions
from meshkd.recipe.teacher.hidden_states import HIDDEN_STATES, HiddenStateProjections, hidden_state_loss


class Distribution(TeacherAnswer):
    """The teacher's distribution at every position in one answer encoding (`meshkd.core.encodings`), a kind
    each below: full logits, bfloat16 logits, top-k with its tail, compact top-k."""

    def __init__(self, wire: dict) -> None:
        wire = encoding_named(wire.get("mode")).decode(wire)  # a packed answer unpacked where the student takes it
        super().__init__(wire)
        # An evaluation's answer carries each label's log-probability beside the encoding (`with_label_log_probs`),
        # a training answer perhaps the teacher's hidden states (`with_hidden_states`).
        beside = ("label_log_probs", HIDDEN_STATES)
        self.encoding = wire if not any(key in wire for key in beside) else {
            key: value for key, value in wire.items() if key not in beside}

    @property
    def encoded_as(self) -> AnswerEncoding:
        """The (decoded) answer's encoding."""
        return ENCODINGS[self.wire["mode"]]

    @classmethod
    def made_for(cls, transport, kd):
        """A request for a `kd.logits_transport` encoding (`transport`, perhaps `with_label_log_probs`) whose
        encoding with `kd.topk_encoding` is this kind's, with one tokenizer or a projected cross-tokenizer teacher."""
        mode = transport.partition("+")[0]
        return (mode in LOGITS_MODES and (kd.cross_tokenizer is None or kd.cross_tokenizer.loss == "projection")
                and selected(logits_transport=mode, topk_encoding=kd.topk_encoding).name == cls.name)

    @classmethod
    def encode(cls, logits, batch, transport, context):
        """This kind's encoding (`encode_teacher_rows`), of a cross-tokenizer teacher's
        distribution projected onto the student's vocabulary (`projected`); asked `with_label_log_probs`, each
        label's log-probability besides, as "label_log_probs" (what an evaluation asks for the held-out KL).

        Each row's tail samples are seeded by that row's tokens, so a resumed run, and a teacher cache
        written ahead of time, draw the same ones whatever the rows are batched with."""
        kd = context.kd
        mode, with_labels, _ = transport.partition("+")
        distribution = logits if kd.cross_tokenizer is None else cls.projected(logits, batch, context)
        encoding = ENCODINGS[cls.name]
        # Only tail samples read their seeds: one host sync for the whole batch then, not one per row.
        sampled = encoding.seeded(tail_samples=kd.topk_tail_samples)
        seeds = [context.seed + total for total in batch["input_ids"].sum(dim=-1).tolist()] if sampled else (
            [0] * batch["input_ids"].shape[0])
        wire = encode_teacher_rows(distribution, encoding.name, seeds=seeds, k=min(kd.topk, distribution.shape[-1]),
                                   temperature=kd.temperature, tail_samples=kd.topk_tail_samples)
        if with_labels:
            wire["label_log_probs"] = LabelLogProbs.encode(logits, batch, LABEL_LOG_PROBS, context)["log_probs"]
        return wire

    @staticmethod
    def settings(kd: KDConfig) -> dict:
        """The keys besides the logits that the encoding `kd` chooses depends on (`AnswerEncoding.settings_keys`,
        what a teacher cache records): for top-k its size, tail samples, temperature and, when compact, its
        encoding and its layout; none for full logits (the loss applies T)."""
        encoding = selected_encoding(kd)
        layout = {} if encoding.layout is None else {f"{encoding.name} layout": encoding.layout}
        return {**{f"kd.{key}": getattr(kd, key) for key in encoding.settings_keys}, **layout}

    @staticmethod
    def nbytes_per_token(kd: KDConfig, vocab_size: int, *, logits_bytes: int) -> int:
        """Bytes of one position's answer in the encoding `kd` chooses; `logits_bytes`: a full logit's (`full`
        keeps the teacher's dtype)."""
        return selected_encoding(kd).nbytes_per_token(vocab_size, k=min(kd.topk, vocab_size),
                                                      tail_samples=kd.topk_tail_samples, logits_bytes=logits_bytes)

    @staticmethod
    def projected(logits: torch.Tensor, batch: dict, context: EncodeContext) -> torch.Tensor:
        """[rows, student sequence, student vocab]: at each student position KD counts (`kd_labels`), a
        cross-tokenizer teacher's distribution at the paired teacher position projected onto the student's
        vocabulary (as logits at `kd.temperature`); 0 elsewhere."""
        ignore, vocab_size = context.kd.ignore_index, context.vocab_size
        counted = kd_labels(batch, ignore) != ignore
        paired = group_positions(batch, TEACHER_POSITIONS, logits.shape[1], ignore)  # in `counted`'s order
        projected = project_teacher_logits(logits.flatten(0, 1)[paired], context.vocabulary_map,
                                           temperature=context.kd.temperature, student_vocab_size=vocab_size)
        result = projected.new_zeros(*counted.shape, vocab_size)
        result[counted] = projected
        return result

    @property
    def carries_logits(self) -> bool:
        """Whether the answer holds the teacher's whole logits ("logits" [rows, sequence, vocab]), not its top-k."""
        return self.encoded_as.whole_distribution

    @property
    def rows(self) -> int:
        """The rows the answer covers (a routed teacher's: its own only)."""
        return next(value.shape[0] for value in self.wire.values() if isinstance(value, torch.Tensor))

    def divergence(self, logits: torch.Tensor, micro_batch: dict, context: LossContext, *, norm: float | torch.Tensor,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """`kd.divergence` at the positions KD counts; `rows`: a bool [rows] mask, the others do not count (no
        indexing of a sharded vocabulary)."""
        self.check_indices(context, logits.shape[-1])
        # chunk_size None: the micro-batch as one chunk, through the same kernel as chunks (the loss module's
        # autograd formula, its reference, makes more passes over the [tokens, vocab] logits). That kernel reads
        # only indices in range, so a deferred check of their values still comes before any update.
        return self._divergence(logits, self.encoding, self._counted(micro_batch, context, rows), context, norm=norm,
                                chunk_size=context.kd.chunk_size or max(micro_batch["labels"].numel(), 1))

    def kd_loss(self, logits, micro_batch, context, *, norm):
        return self.divergence(logits, micro_batch, context, norm=norm), {}

    def chunk_kd_loss(self, logits: torch.Tensor, tokens: slice, micro_batch: dict, context: LossContext, *,
                      norm: float | torch.Tensor) -> tuple[torch.Tensor, Figures]:
        """`kd_loss`' share of the flattened positions `tokens`, given their logits [c, vocab], and its figures'
        shares: the chunks' add up to them (`meshkd.recipe.student.fused_head`; the index check is
        `check_indices`', once a micro-batch)."""
        return self.chunk_divergence(logits, tokens, micro_batch, context, norm=norm), {}

    def check_indices(self, context: LossContext, vocab_size: int) -> None:
        """A top-k answer's index check, once for a micro-batch whose loss runs in chunks (`chunk_divergence`):
        deferred into the step's reduction where the step gathers them (`LossContext.index_checks`), else now."""
        encoding = self.encoded_as
        if not encoding.has_indices:
            return
        errors = encoding.index_errors(self.encoding, vocab_size)
        if context.index_checks is not None:
            context.index_checks.append(errors)
        elif bool(errors):
            raise ValueError(encoding.index_message(vocab_size))

    def chunk_divergence(self, logits: torch.Tensor, tokens: slice, micro_batch: dict, context: LossContext, *,
                         norm: float | torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`divergence`'s share of the flattened positions `tokens`, given their logits [c, vocab]: the chunks'
        shares add up to it."""
        counted = self._counted(micro_batch, context, rows).reshape(-1)[tokens]
        answer = chunk_answer(self.encoding, tokens, tuple(micro_batch["labels"].shape))
        return self._divergence(logits, answer, counted, context, norm=norm, chunk_size=logits.shape[0])

    @staticmethod
    def _counted(micro_batch: dict, context: LossContext, rows: torch.Tensor | None) -> torch.Tensor:
        """The labels KD counts (`kd_labels`), those of rows outside `rows` (a bool [rows] mask) left out."""
        ignore = context.kd.ignore_index
        counted = kd_labels(micro_batch, ignore)
        return counted if rows is None else counted.masked_fill(~rows[:, None], ignore)

    @staticmethod
    def _divergence(logits: torch.Tensor, encoding: dict, counted: torch.Tensor, context: LossContext, *,
                    norm: float | torch.Tensor, chunk_size: int) -> torch.Tensor:
        kd = context.kd
        return kd_loss_encoded(logits, encoding, counted, temperature=kd.temperature, ignore_index=kd.ignore_index,
                               num_valid_tokens=norm, chunk_size=chunk_size, divergence=kd.divergence,
                               jsd_beta=kd.jsd_beta, skew_alpha=kd.skew_alpha, check_indices=False)

    def hidden_state_loss(self, student: list[torch.Tensor], micro_batch: dict, context: LossContext, *, norm: float,
                          projections: HiddenStateProjections | None = None) -> torch.Tensor:
        """`kd.hidden_states`' term against the student's outputs of the paired layers, at the positions KD counts."""
        if HIDDEN_STATES not in self.wire:
            raise ValueError("kd.hidden_states: the teacher's answer holds no hidden states (a teacher cache written "
                             "without kd.hidden_states?)")
        kd = context.kd
        counted = kd_labels(micro_batch, kd.ignore_index) != kd.ignore_index
        return hidden_state_loss(student, self.wire[HIDDEN_STATES], counted, loss=kd.hidden_states.loss, norm=norm,
                                 projections=projections)

    def label_log_probs(self) -> torch.Tensor:
        return split_label_log_probs(self.wire)[1]

    def top_tokens(self, cut: Cut | None = None) -> torch.Tensor:
        """[rows, sequence] the teacher's most likely token at each position (`cut`: at those positions only)."""
        top = self.wire["logits"].argmax(-1) if self.carries_logits else self.wire["indices"][..., 0]
        return top if cut is None else top.reshape(-1)[cut[0]]

    def kl(self, logits: torch.Tensor, labels: torch.Tensor, kd: KDConfig, cut: Cut | None = None) -> torch.Tensor:
        """float64: the forward KL(teacher || student) summed over the valid `labels`' positions, at
        `kd.temperature` (the training's forward-KL `kd_loss` is T^2 times it); exact for full logits, the
        top-k estimate the training uses for top-k. `cut`: `logits` [c, vocab] and `labels` [c] are those of
        some flattened positions only (the fused output layer's chunk)."""
        encoding = self.encoding if cut is None else chunk_answer(self.encoding, *cut)
        kl = kd_loss_encoded(logits, encoding, labels, temperature=kd.temperature, ignore_index=kd.ignore_index,
                             num_valid_tokens=1, chunk_size=kd.chunk_size or max(labels.numel(), 1))
        return kl.double() / kd.temperature**2

    def top1_agreements(self, logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int,
                        cut: Cut | None = None) -> torch.Tensor:
        """The number of valid labels where the student's likeliest token is the teacher's (`top_tokens`)."""
        return _top1_agreements(logits, self.top_tokens(cut), labels, ignore_index=ignore_index)

    @staticmethod
    def mixture(members: dict[str, Distribution], weights: dict[str, float], *, temperature: float) -> Distribution:
        """One "full" answer whose distribution at `temperature` is the mixture sum_i w_i softmax(z_i / T).

        Its logits are z_r + T log sum_i w_i p_i / p_r, r the first teacher of weight > 0: the mixture's log
        probabilities up to a constant, which the loss's softmax drops. Taken relative to one teacher, so that
        teachers that agree (and teachers of weight 0) give back exactly that teacher's logits.

        Raises:
            ValueError: a member answered top-k (no whole distribution).
        """
        for name, member in members.items():
            if not member.carries_logits:
                raise ValueError(f"teacher {name!r} answered {member.wire.get('mode')!r}: a mixture of teachers needs "
                                 "their whole distributions (logits_transport full or full_bf16)")
        kept = [name for name in members if weights[name] > 0]
        reference = members[kept[0]].wire["logits"].float()
        reference_norm = torch.logsumexp(reference / temperature, dim=-1, keepdim=True)
        terms = []
        for name in kept:  # log(w_i p_i / p_r), from the logits' differences: exactly log w_r for the reference
            logits = members[name].wire["logits"].float()
            norm = torch.logsumexp(logits / temperature, dim=-1, keepdim=True)
            terms.append((logits - reference) / temperature - (norm - reference_norm) + math.log(weights[name]))
        return answer_of({"mode": FullLogits.name,
                          "logits": reference + temperature * torch.logsumexp(torch.stack(terms), dim=0)})

    @staticmethod
    def merged(members: dict[str, Distribution], rows: dict[str, torch.Tensor]) -> Distribution:
        """One answer for the whole micro-batch from each teacher's answer for its rows (`rows`: name -> bool
        [rows]). The teachers answer in one encoding (whole distributions of any precision are taken as float32,
        `full`).

        Raises:
            ValueError: the teachers answered in different encodings, or one not the rows routed to it.
        """
        def merged_mode(mode: str) -> str:
            return FullLogits.name if encoding_named(mode).whole_distribution else mode

        modes = {merged_mode(member.wire["mode"]) for member in members.values()}
        if len(modes) > 1:
            raise ValueError(f"routed teachers answered in different encodings {sorted(modes)}: give them one "
                             "logits_transport")
        for name, member in members.items():
            if member.rows != int(rows[name].sum()):
                raise ValueError(f"teacher {name!r} answered {member.rows} rows, not the "
                                 f"{int(rows[name].sum())} routed to it")
        first = next(iter(members.values())).wire
        total = next(iter(rows.values())).shape[0]
        merged = {}
        for key, value in first.items():
            if not isinstance(value, torch.Tensor):
                merged[key] = value
                continue
            dtype = torch.float32 if value.is_floating_point() else value.dtype
            merged[key] = value.new_zeros((total, *value.shape[1:]), dtype=dtype)
            for name, member in members.items():
                merged[key][rows[name]] = member.wire[key].to(dtype)
        merged["mode"] = merged_mode(first["mode"])
        return answer_of(merged)


@register
class FullAnswer(Distribution):
    """The teacher's logits in its dtype (`meshkd.core.encodings.full.FullLogits`)."""

    name = FullLogits.name


@register
class Bfloat16Answer(Distribution):
    """The teacher's logits rounded to bfloat16 (`meshkd.core.encodings.full.Bfloat16Logits`)."""

    name = Bfloat16Logits.name


@register
class TopKAnswer(Distribution):
    """The teacher's top-k log-probabilities with its tail (`meshkd.core.encodings.topk.TopK`)."""

    name = TopK.name


@register
class CompactTopKAnswer(Distribution):
    """A top-k answer packed (`meshkd.core.encodings.compact.CompactTopK`), unpacked where the student takes it."""

    name = CompactTopK.name


@register
class LabelLogProbs(TeacherAnswer):
    """The teacher's log-probability of each label ("log_probs" [rows, sequence], 0 at ignored labels)."""

    name = LABEL_LOG_PROBS

    @classmethod
    def made_for(cls, transport, kd):
        return transport == cls.name

    @classmethod
    def encode(cls, logits, batch, transport, context):
        """Of the labels of the teacher's own tokenization (`teacher_side`), at temperature 1, whichever
        tokenizer (`meshkd.core.logits_codec.label_log_probs`)."""
        return label_log_probs(logits, teacher_side(batch)["labels"], ignore_index=context.kd.ignore_index)

    def label_log_probs(self) -> torch.Tensor:
        return self.wire["log_probs"]


@register
class Ensemble(TeacherAnswer):
    """Several teachers' answers ("answers": name -> answer on the wire, "wait_s": name -> seconds waited)."""

    name = TEACHERS

    @functools.cached_property
    def members(self) -> dict[str, Distribution]:
        """Each teacher's answer, by name, in the ensemble's order."""
        return {name: answer_of(member) for name, member in self.wire["answers"].items()}

    @property
    def wait_s(self) -> dict[str, float]:
        return self.wire.get("wait_s", {})

    def shard(self, setup):
        if setup.cp_size == 1:
            return self
        return Ensemble({**self.wire, "answers": {name: member.shard(setup).wire
                                                 for name, member in self.members.items()}})

    def check_indices(self, context: LossContext, vocab_size: int) -> None:
        """Each member's (`Distribution.check_indices`)."""
        for member in self.members.values():
            member.check_indices(context, vocab_size)

    def kd_loss(self, logits, micro_batch, context, *, norm):
        """The KD term by `kd.combine` (module docstring); figures: each teacher's own divergence (detached;
        with "mixture" computed for the metrics only), the rows it answered and, routed, its tokens."""
        return self._combined(lambda answer, rows=None: answer.divergence(logits, micro_batch, context, norm=norm,
                                                                          rows=rows), micro_batch, context,
                              device=logits.device)

    def chunk_kd_loss(self, logits, tokens, micro_batch, context, *, norm):
        """`kd_loss`' share of the flattened positions `tokens` (`Distribution.chunk_kd_loss`); the rows each
        teacher answered are counted with the micro-batch's first chunk."""
        return self._combined(lambda answer, rows=None: answer.chunk_divergence(logits, tokens, micro_batch, context,
                                                                                norm=norm, rows=rows),
                              micro_batch, context, device=logits.device, tokens=tokens)

    def _combined(self, divergence: Callable[..., torch.Tensor], micro_batch: dict, context: LossContext, *,
                  device: torch.device, tokens: slice | None = None) -> tuple[torch.Tensor, Figures]:
        """`kd.combine` of the members' `divergence(answer, rows=None)` (of the whole micro-batch, or of the
        positions `tokens`), and the figures."""
        kd, weights, members = context.kd, context.teacher_weights, self.members
        combination = combination_named(kd.combine)
        routes = micro_batch[ROUTE][:, 0] if combination.routes_rows else None
        if "_combined_answer" not in self.__dict__:  # made once for the micro-batch whatever the chunks asking
            self._combined_answer = combination.combined(members, weights, routes=routes, temperature=kd.temperature)
        loss, each = combination.loss(members, self._combined_answer, divergence, weights)
        figures = {f"kd_loss/{name}": value.detach() for name, value in each.items()}
        if tokens is None or tokens.start == 0:
            # The rows each teacher answered (its own only when routed), counted once over the cp ranks' sum.
            figures.update({f"teacher_rows/{name}": torch.tensor(member.rows / context.cp_size, device=device)
                            for name, member in members.items()})
        if routes is not None:  # each teacher's tokens: the step turns its share into its own mean
            counted = kd_labels(micro_batch, kd.ignore_index) != kd.ignore_index
            figures.update({f"kd_tokens/{name}": (counted & (routes == index)[:, None]).reshape(-1)[
                tokens if tokens is not None else slice(None)].sum() for index, name in enumerate(members)})
        return loss, figures


def selected_encoding(kd: KDConfig) -> AnswerEncoding:
    """The answer encoding `kd.logits_transport` and `kd.topk_encoding` choose (`meshkd.core.encodings.selected`)."""
    return selected(logits_transport=kd.logits_transport, topk_encoding=kd.topk_encoding)


def with_hidden_states(wire: dict, hidden: list[torch.Tensor] | None, transport: str) -> dict:
    """`wire` with the teacher's outputs of the paired layers (`kd.hidden_states`; each [rows, sequence, width])
    stacked under "hidden_states" when the request is a training one (a distribution's encoding alone): float32
    for `full`, else bfloat16, as the logits travel. Evaluations' answers go without them."""
    if not hidden or transport not in LOGITS_MODES:
        return wire
    dtype = torch.float32 if transport == "full" else torch.bfloat16
    return {**wire, HIDDEN_STATES: torch.stack(hidden, dim=2).to(dtype)}


__all__ = ["ANSWERS", "Bfloat16Answer", "CompactTopKAnswer", "Cut", "Distribution", "EncodeContext", "Ensemble",
           "Figures", "FullAnswer", "GroupDistributions", "LabelLogProbs", "LossContext", "TeacherAnswer", "TopKAnswer",
           "answer_of", "answer_type", "selected_encoding", "with_hidden_states"]

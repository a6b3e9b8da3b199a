"""A teacher's distribution over the student's vocabulary at every position: what each kind of it (full logits,
bfloat16 logits, top-k with its tail, compact top-k) shares, on both sides of the wire.

A kind is one `Distribution` subclass in a module of this package, registered under its mode (`@register`).
It owns everything that varies with how the distribution travels:

    encode_logits(logits, k=, ...)    the teacher's logits -> its wire dict (`encode`: a batch's, row-seeded)
    decode(wire)                      what the loss reads (a packed answer unpacked), where the student takes it
    check(decoded, shape)             fields, dtypes and shapes against the student's logits, naming what is wrong
    index_errors(decoded, vocab)      its vocabulary indices out of range or repeated, a device flag (`has_indices`)
    kernel(student_logits, decoded, labels, kd, ...)   its fields checked, the KD loss kernel it needs
                                      (`meshkd.core.loss`)
    bytes_per_token(vocab, ...)       its size, for the bench and the cache's size estimate
    settings_keys, layout             the `kd` keys its answers depend on and a packed layout's version (the
                                      teacher cache's key records them)
    selected_by                       the `kd` keys' values that choose it (the config checks read the choices)

and, as every answer, its KD loss of a micro-batch (`kd_loss`, or by chunks: `chunk_kd_loss`), its index check
once a micro-batch (`check_indices`), an evaluation's figures (`kl`, `top1_agreements`) and several teachers'
mixture and routed merge. A top-k KD loss is three calls from the step: `kd_loss` -> `kernel` ->
`meshkd.core.loss.kd_loss_topk`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from meshkd.core.answers.base import ANSWERS, Cut, EncodeContext, KDConfig, LossContext, TeacherAnswer, merged_rows
from meshkd.core.batch_keys import TEACHER_POSITIONS, group_positions, kd_labels, teacher_side
from meshkd.core.cross_tokenizer_loss import project_teacher_logits
from meshkd.core.fused_output import chunk_answer
from meshkd.core.loss import check_divergence as check_divergence_settings
from meshkd.core.loss import top1_agreements as _top1_agreements
from meshkd.core.teacher_protocol import LABEL_LOG_PROBS

HIDDEN_STATES = "hidden_states"
"""The field beside a training answer: the teacher's outputs of `kd.hidden_states`' paired layers."""
BESIDE = (LABEL_LOG_PROBS, HIDDEN_STATES)


class Distribution(TeacherAnswer):
    """The teacher's distribution at every position, in the kind's encoding (see the module docstring).
    Subclasses set the class attributes and implement `encode_logits`, `check`, `bytes_per_token` and `kernel`."""

    selected_by: ClassVar[dict[str, str]]
    """The `kd` keys (without the prefix) and values that choose it, e.g. {"logits_transport": "topk",
    "topk_encoding": "exact"}; a key it does not name does not matter to it."""
    settings_keys: ClassVar[tuple[str, ...]] = ()
    """The `kd` keys besides the teacher's logits that its answers depend on."""
    whole_distribution: ClassVar[bool] = False
    """Whether it carries the teacher's whole logits ("logits" [..., vocab]): every divergence takes it, and a
    mixture of teachers."""
    keeps_dtype: ClassVar[bool] = False
    """Whether its values keep the teacher's dtype (full logits; the others are rounded or quantized)."""
    has_indices: ClassVar[bool] = False
    """Whether its answers hold vocabulary indices whose values `index_errors` checks."""
    layout: ClassVar[str | None] = None
    """The version of a packed layout, recorded in the teacher cache's key where set: a cache written in another
    layout is then refused as another run's, not misread."""

    def __init__(self, wire: dict) -> None:
        self.damaged: Tensor | None = None
        """A device flag: the packing itself was damaged (a compact answer's bitmaps), read with the index check."""
        super().__init__(self._decoded(wire))
        # An evaluation's answer carries each label's log-probability beside the distribution, a training answer
        # perhaps the teacher's hidden states (`with_hidden_states`).
        self.encoding = {key: value for key, value in self.wire.items() if key not in BESIDE}

    def _decoded(self, wire: dict) -> dict:
        return self.decode(wire)

    # -- the encoding ------------------------------------------------------------------------------------

    @classmethod
    def encode_logits(cls, logits: Tensor, *, k: int | None, temperature: float, tail_samples: int, seed: int,
                      chunk_size: int) -> dict[str, Any]:
        """The wire dict for [..., vocab] teacher logits (replicated, trimmed to the student's vocabulary)."""
        raise NotImplementedError

    @classmethod
    def seeded(cls, *, tail_samples: int) -> bool:
        """Whether `encode_logits` draws from its seed (then each row is encoded with a seed of its own)."""
        return False

    @classmethod
    def decode(cls, wire: dict[str, Any]) -> dict[str, Any]:
        """What the loss reads of an answer: the answer itself unless it is packed."""
        return wire

    @classmethod
    def check(cls, decoded: dict[str, Any], shape: tuple[int, ...]) -> None:
        """ValueError naming what does not fit the student's logits of (global) `shape`."""
        raise NotImplementedError

    @classmethod
    def index_errors(cls, decoded: dict[str, Any], vocab: int) -> Tensor:
        """A 0-dim bool tensor: whether an index is out of [0, vocab) or repeated (`has_indices` kinds). Nothing
        is read back: the caller decides when to wait for the flag."""
        raise NotImplementedError(f"{cls.name} answers hold no indices")

    @classmethod
    def index_message(cls, vocab: int) -> str:
        """What a check says of indices that `index_errors` finds wrong."""
        raise NotImplementedError(f"{cls.name} answers hold no indices")

    @classmethod
    def bytes_per_token(cls, vocab: int, *, k: int, tail_samples: int, logits_bytes: int,
                        width: int | None = None) -> int:
        """Bytes one position's answer takes; `logits_bytes`: a teacher logit's, for kinds that keep its dtype;
        `width`: the teacher's hidden size, for kinds that send its hidden states."""
        raise NotImplementedError

    @classmethod
    def check_divergence(cls, divergence: str) -> None:
        """ValueError if its answers cannot carry `divergence`: every divergence but forward KL weighs vocabulary
        entries by the student's probability, or compares the distributions entry by entry, so it needs the
        teacher's whole distribution."""
        if divergence != "forward_kl" and not cls.whole_distribution:
            whole = " or ".join(choices("logits_transport", whole_distribution=True))
            raise ValueError(f"divergence {divergence} needs the teacher's whole distribution: use logits transport "
                             f"{whole} ({cls.name} keeps part of it and combines with forward_kl only)")

    @classmethod
    def kernel(cls, student_logits: Tensor, decoded: dict[str, Any], labels: Tensor, kd: KDConfig, *,
               norm: float | Tensor, chunk_size: int | None, divergence: str | None = None) -> Tensor:
        """`kd.divergence` (or `divergence`) of the student's logits against the decoded answer's fields (`checked`
        first) at the valid `labels`, at `kd.temperature`, summed and divided by `norm`: the loss of
        `meshkd.core.loss` the kind needs. The index values are `check_indices`' (the kernels read only the
        indices in range)."""
        raise NotImplementedError

    @classmethod
    def checked(cls, decoded: dict[str, Any], student_logits: Tensor, kd: KDConfig, divergence: str) -> None:
        """ValueError for fields that do not fit the student's logits (`check`) or a divergence the kind cannot
        carry, before its kernel runs."""
        cls.check(decoded, tuple(student_logits.shape))
        check_divergence_settings(divergence, kd.jsd_beta, skew_alpha=kd.skew_alpha)
        cls.check_divergence(divergence)

    # -- the teacher's side ------------------------------------------------------------------------------

    @classmethod
    def made_for(cls, transport, kd):
        """A request for a `kd.logits_transport` encoding (`transport`) that with `kd.topk_encoding` chooses this
        kind, with one tokenizer or a projected cross-tokenizer teacher."""
        return (transport in choices("logits_transport") and (kd.cross_tokenizer is None
                                                              or kd.cross_tokenizer.loss == "projection")
                and selected(logits_transport=transport, topk_encoding=kd.topk_encoding) is cls)

    @classmethod
    def encode(cls, logits, batch, context, *, with_label_log_probs=False):
        """This kind's encoding of the teacher's logits (of a cross-tokenizer teacher's distribution projected onto
        the student's vocabulary: `projected`); asked `with_label_log_probs`, each label's log-probability besides,
        as "label_log_probs" (what an evaluation asks for the held-out KL).

        Each row's tail samples are seeded by that row's tokens, so a resumed run, and a teacher cache
        written ahead of time, draw the same ones whatever the rows are batched with."""
        kd = context.kd
        distribution = logits if kd.cross_tokenizer is None else cls.projected(logits, batch, context)
        # Only tail samples read their seeds: one host sync for the whole batch then, not one per row.
        sampled = cls.seeded(tail_samples=kd.topk_tail_samples)
        seeds = [context.seed + total for total in batch["input_ids"].sum(dim=-1).tolist()] if sampled else None
        wire = cls.encode_rows(distribution, seeds=seeds, k=min(kd.topk, distribution.shape[-1]),
                               temperature=kd.temperature, tail_samples=kd.topk_tail_samples)
        if with_label_log_probs:
            wire[LABEL_LOG_PROBS] = label_log_probs(logits, teacher_side(batch)["labels"],
                                                    ignore_index=kd.ignore_index)["log_probs"]
        return wire

    @classmethod
    def encode_rows(cls, logits: Tensor, *, seeds: list[int] | None, chunk_size: int = 1024,
                    **options: Any) -> dict[str, Any]:
        """`encode_logits` of [rows, sequence, vocab] logits, with one tail-sampling seed a row where it samples.

        A row's encoding then depends on that row alone, not on the rows it was batched with, so an encoding
        computed ahead of time for each row (an offline cache) equals the one computed live for any batch."""
        logits = logits.detach()
        if not seeds or not cls.seeded(tail_samples=options.get("tail_samples", 0)):  # none: an empty routed share
            return cls.encode_logits(logits, seed=0, chunk_size=chunk_size, **options)
        if len(seeds) != logits.shape[0]:
            raise ValueError(f"need one seed per row: {logits.shape[0]} rows, {len(seeds)} seeds")
        rows = [cls.encode_logits(logits[i : i + 1], seed=seed, chunk_size=chunk_size, **options)
                for i, seed in enumerate(seeds)]
        return {key: torch.cat([row[key] for row in rows]) if isinstance(value, Tensor) else value
                for key, value in rows[0].items()}

    @staticmethod
    def projected(logits: Tensor, batch: dict, context: EncodeContext) -> Tensor:
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

    # -- the student's side ------------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        """The rows the answer covers (a routed teacher's: its own only)."""
        return next(value.shape[0] for value in self.wire.values() if isinstance(value, Tensor))

    def check_indices(self, context: LossContext, vocab_size: int) -> None:
        """The index check of a kind `has_indices`, once a micro-batch (its loss, in chunks or not, reads only the
        indices in range): deferred into the step's reduction where the step gathers them
        (`LossContext.index_checks`), else now (a host sync)."""
        if not self.has_indices:
            return
        errors = self.index_errors(self.encoding, vocab_size)
        if self.damaged is not None:
            errors = errors | self.damaged
        if context.index_checks is not None:
            context.index_checks.append(errors)
        elif bool(errors):
            raise ValueError(self.index_message(vocab_size))

    def kd_loss(self, logits, micro_batch, context, *, norm):
        self.check_indices(context, logits.shape[-1])
        return self.divergence(logits, micro_batch, context, norm=norm), {}

    def chunk_kd_loss(self, logits, tokens, micro_batch, context, *, norm):
        """`kd_loss`' share of the flattened positions `tokens`, given their logits [c, vocab] (the index check is
        `check_indices`', once a micro-batch)."""
        return self.chunk_divergence(logits, tokens, micro_batch, context, norm=norm), {}

    def divergence(self, logits: Tensor, micro_batch: dict, context: LossContext, *, norm: float | Tensor,
                   rows: Tensor | None = None) -> Tensor:
        """`kd.divergence` at the positions KD counts, as one chunk unless `kd.chunk_size` says otherwise; `rows`: a
        bool [rows] mask, the others do not count (no indexing of a sharded vocabulary)."""
        kd = context.kd
        return self.kernel(logits, self.encoding, kd_labels(micro_batch, kd.ignore_index, rows), kd, norm=norm,
                           chunk_size=kd.chunk_size or max(micro_batch["labels"].numel(), 1))

    def chunk_divergence(self, logits: Tensor, tokens: slice, micro_batch: dict, context: LossContext, *,
                         norm: float | Tensor, rows: Tensor | None = None) -> Tensor:
        """`divergence`'s share of the flattened positions `tokens`, given their logits [c, vocab]: the chunks'
        shares add up to it."""
        counted = kd_labels(micro_batch, context.kd.ignore_index, rows).reshape(-1)[tokens]
        answer = chunk_answer(self.encoding, tokens, tuple(micro_batch["labels"].shape))
        return self.kernel(logits, answer, counted, context.kd, norm=norm, chunk_size=logits.shape[0])

    def label_log_probs(self) -> Tensor:
        if not isinstance(self.wire.get(LABEL_LOG_PROBS), Tensor):
            raise ValueError("a teacher answer asked with_label_log_probs must hold a label_log_probs tensor")
        return self.wire[LABEL_LOG_PROBS]

    def whole_logits(self) -> Tensor:
        """[rows, sequence, vocab] the teacher's logits, of a kind that carries its `whole_distribution`."""
        return self.wire["logits"]

    def top_tokens(self, cut: Cut | None = None) -> Tensor:
        """[rows, sequence] the teacher's most likely token at each position (`cut`: at those positions only)."""
        top = self.wire["logits"].argmax(-1) if self.whole_distribution else self.wire["indices"][..., 0]
        return top if cut is None else top.reshape(-1)[cut[0]]

    def kl(self, logits: Tensor, labels: Tensor, kd: KDConfig, cut: Cut | None = None) -> Tensor:
        """float64: the forward KL(teacher || student) summed over the valid `labels`' positions, at
        `kd.temperature` (the training's forward-KL `kd_loss` is T^2 times it); exact for full logits, the
        top-k estimate the training uses for top-k. `cut`: `logits` [c, vocab] and `labels` [c] are those of
        some flattened positions only (the fused output layer's chunk). The index values are `check_indices`'."""
        encoding = self.encoding if cut is None else chunk_answer(self.encoding, *cut)
        kl = self.kernel(logits, encoding, labels, kd, norm=1, chunk_size=kd.chunk_size or max(labels.numel(), 1),
                         divergence="forward_kl")
        return kl.double() / kd.temperature**2

    def acceptance(self, logits: Tensor, labels: Tensor, kd: KDConfig, cut: Cut | None = None) -> Tensor:
        """float64: the sum over the valid `labels`' positions of sum_v min(p_teacher(v), p_student(v)) at
        temperature 1, which is 1 - TVD: the expected rate at which the teacher accepts the student's token when
        the student drafts for it under speculative sampling (whole distributions only). `cut` as for `kl`."""
        encoding = self.encoding if cut is None else chunk_answer(self.encoding, *cut)
        tvd = self.kernel(logits, encoding, labels, dataclasses.replace(kd, temperature=1.0), norm=1,
                          chunk_size=kd.chunk_size or max(labels.numel(), 1), divergence="tvd")
        return (labels != kd.ignore_index).sum().double() - tvd.double()

    def top1_agreements(self, logits: Tensor, labels: Tensor, *, ignore_index: int,
                        cut: Cut | None = None) -> Tensor:
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
            if not member.whole_distribution:
                raise ValueError(f"teacher {name!r} answered {member.name!r}: a mixture of teachers needs their whole "
                                 "distributions (logits_transport full or full_bf16)")
        kept = [name for name in members if weights[name] > 0]
        reference = members[kept[0]].whole_logits().float()
        reference_norm = torch.logsumexp(reference / temperature, dim=-1, keepdim=True)
        terms = []
        for name in kept:  # log(w_i p_i / p_r), from the logits' differences: exactly log w_r for the reference
            logits = members[name].whole_logits().float()
            norm = torch.logsumexp(logits / temperature, dim=-1, keepdim=True)
            terms.append((logits - reference) / temperature - (norm - reference_norm) + math.log(weights[name]))
        whole = selected(logits_transport="full")
        return whole({"mode": whole.name, "logits": reference + temperature * torch.logsumexp(torch.stack(terms), 0)})

    @staticmethod
    def merged(members: dict[str, Distribution], rows: dict[str, Tensor]) -> Distribution:
        """One answer for the whole micro-batch from each teacher's answer for its rows (`rows`: name -> bool
        [rows]). The teachers answer in one kind (whole distributions of any precision are taken as float32,
        `full`).

        Raises:
            ValueError: the teachers answered in different kinds, or one not the rows routed to it.
        """
        whole = selected(logits_transport="full")
        kinds = {whole if member.whole_distribution else ANSWERS.named(member.wire["mode"])
                 for member in members.values()}
        if len(kinds) > 1:
            raise ValueError(f"routed teachers answered in different encodings {sorted(k.name for k in kinds)}: give "
                             "them one logits_transport")
        # Whole distributions meet as logits (hidden answers' made by their own heads).
        merged = merged_rows({name: {"mode": whole.name, "logits": member.whole_logits()} if member.whole_distribution
                              else member.wire for name, member in members.items()}, rows)
        kind = kinds.pop()
        merged["mode"] = kind.name
        return kind(merged)


def distributions() -> list[type[Distribution]]:
    """Every registered kind of distribution, in the order they were registered."""
    return [kind for kind in ANSWERS.values() if issubclass(kind, Distribution)]


def choices(key: str, *, whole_distribution: bool | None = None) -> tuple[str, ...]:
    """The values of the `kd` key `key` that choose some registered kind (of `whole_distribution`, if given)."""
    values = [kind.selected_by[key] for kind in distributions() if key in kind.selected_by
              and whole_distribution in (None, kind.whole_distribution)]
    return tuple(dict.fromkeys(values))


def selected(**keys: str) -> type[Distribution]:
    """The kind that `kd` keys' values choose, e.g. `selected(logits_transport="topk", topk_encoding="exact")`:
    one whose every selecting key has its value here, the most specific where several do.

    Raises:
        ValueError: naming the values and what the registered kinds take.
    """
    matches = [kind for kind in distributions()
               if all(keys.get(key) == value for key, value in kind.selected_by.items())]
    if not matches:
        known = "; ".join(f"{kind.name}: {kind.selected_by}" for kind in distributions())
        raise ValueError(f"no answer encoding is chosen by {keys} (registered: {known})")
    return max(matches, key=lambda kind: len(kind.selected_by))


def selected_kind(kd: KDConfig) -> type[Distribution]:
    """The kind `kd.logits_transport` and `kd.topk_encoding` choose."""
    return selected(logits_transport=kd.logits_transport, topk_encoding=kd.topk_encoding)


def answer_settings(kd: KDConfig) -> dict:
    """The keys besides the logits that the kind `kd` chooses depends on (`settings_keys`, what a teacher cache
    records): for top-k its size, tail samples, temperature and, when compact, its encoding and its layout; none
    for full logits (the loss applies T)."""
    kind = selected_kind(kd)
    layout = {} if kind.layout is None else {f"{kind.name} layout": kind.layout}
    return {**{f"kd.{key}": getattr(kd, key) for key in kind.settings_keys}, **layout}


def answer_bytes(kd: KDConfig, vocab_size: int, *, logits_bytes: int, width: int | None = None) -> int:
    """Bytes of one position's answer in the kind `kd` chooses; `logits_bytes`: a full logit's (`full` keeps the
    teacher's dtype); `width`: the teacher's hidden size (hidden answers)."""
    return selected_kind(kd).bytes_per_token(vocab_size, k=min(kd.topk, vocab_size),
                                             tail_samples=kd.topk_tail_samples, logits_bytes=logits_bytes,
                                             width=width)


def encode_teacher_logits(logits: Tensor, mode: str = "full", *, k: int | None = None, temperature: float = 1.0,
                          tail_samples: int = 0, seed: int = 0, chunk_size: int = 1024) -> dict[str, Any]:
    """The wire dict of the kind of distribution `mode` names for [..., vocab] teacher logits (replicated, trimmed to
    the student's vocabulary): `Distribution.encode_logits` with its defaults, for a caller without a batch.

    Args:
        mode: a registered kind's name: "full", "full_bf16", "topk", "topk_compact".
        k: entries kept per token by top-k, 1 <= k <= vocab; ignored otherwise.
        temperature: top-k log-probabilities are taken at this temperature, and the loss must use the same.
        tail_samples: m >= 0 tail tokens sampled per token by top-k (0: the rest-bucket loss), seeded by `seed`.
        chunk_size: tokens encoded at a time by top-k (bounds the float32 working memory).
    """
    kind = ANSWERS.named(mode)
    if not issubclass(kind, Distribution) or kind.reads_hidden:
        raise ValueError(f"{mode!r} is no encoding of the teacher's logits: one of "
                         f"{[d.name for d in distributions() if not d.reads_hidden]}")
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.ndim < 2:
        raise ValueError("teacher logits must be a floating-point tensor [..., vocab]")
    return kind.encode_logits(logits.detach(), k=k, temperature=temperature, tail_samples=tail_samples, seed=seed,
                              chunk_size=chunk_size)


def label_log_probs(logits: Tensor, labels: Tensor, *, ignore_index: int = -100,
                    chunk_size: int = 1024) -> dict[str, Any]:
    """The teacher's log-probability of each label: {"mode": LABEL_LOG_PROBS, "log_probs": [...] float32}.

    Args:
        logits: [batch, sequence, vocab] full teacher logits (temperature 1).
        labels: [batch, sequence] targets aligned with the logits; positions holding `ignore_index` get 0.
        chunk_size: tokens at a time (bounds the float32 working memory).

    The sum of -log_probs over valid labels is the teacher's cross-entropy on them.
    """
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels {tuple(labels.shape)} do not fit teacher logits {tuple(logits.shape)}")
    rows, targets = logits.detach().reshape(-1, logits.shape[-1]), labels.reshape(-1)
    valid = targets != ignore_index
    out = torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, rows.shape[0], chunk_size):
        chunk = slice(start, start + chunk_size)
        log_p = torch.log_softmax(rows[chunk].float(), dim=-1)
        picked = log_p.gather(-1, targets[chunk].clamp(min=0)[:, None])[:, 0]
        out[chunk] = torch.where(valid[chunk], picked, 0.0)
    return {"mode": LABEL_LOG_PROBS, "log_probs": out.view(labels.shape)}


__all__ = ["BESIDE", "HIDDEN_STATES", "LABEL_LOG_PROBS", "Distribution", "answer_bytes", "answer_settings", "choices",
           "distributions", "encode_teacher_logits", "label_log_probs", "selected", "selected_kind"]

"""Cross-tokenizer losses: distill a teacher whose vocabulary differs from the student's.

The unit is an aligned group (`meshkd.core.token_alignment`): tokens of both sides covering the same
bytes, predicted from the same text. Three losses, all sums over groups divided by `num_valid_tokens`
(default: the number of groups; with none, zero and a zero gradient), times T^2 as `kd_loss`, computed in
float32 (float64 if an input is), the teacher a constant:
- `uld_loss` (ULD, Boizard et al. 2024): L1 between the sorted probability vectors; no vocabulary map.
- `gold_loss` (TRL's GOLD hybrid): entries whose tokens match exactly compared directly, the rest by ULD.
- `projected_kd_loss` (as NeMo RL's X-Token): the teacher's next-token distribution projected onto the
  student's vocabulary by a sparse map, then `meshkd.core.loss.kd_loss` unchanged.

ULD and GOLD compare group distributions merged by the chain rule (`group_log_probs`): the distribution
at a group's last position times the probability of the group's earlier tokens, so that the entry of the
actual last token is the probability of the group's whole text. The projection compares the distributions
at a group's first position instead: both sides predict the next token from the same bytes there, and a
teacher token maps to the student token that starts its bytes. `meshkd.core.vocabulary_map.VocabularyMap` holds
the exact matches and the projection, built once from the two tokenizers and cacheable. `bits_per_byte` makes
held-out losses of different tokenizers comparable (`nll_and_bytes` per side, `group_nll_and_bytes` on the aligned
groups).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from meshkd.core.chunked_loss import result_dtype, token_normalizer
from meshkd.core.loss import kd_loss
from meshkd.core.vocabulary_map import VocabularyMap


def group_log_probs(
    logits: Tensor, targets: Tensor, first: Tensor, last: Tensor, *, temperature: float = 1.0
) -> Tensor:
    """Chain-rule log-probabilities of aligned groups: [groups, vocab].

    Row g is log softmax(logits[last[g]] / T) plus sum over p in [first[g], last[g]) of
    log softmax(logits[p] / T)[targets[p]]: the entry of the group's actual last token is the log
    probability of the group's whole text, and the row sums to the probability of its earlier tokens
    (TRL GOLD's "bayesian" merge). A one-token group (first == last) is the plain log-softmax.

    Args:
        logits: [tokens, vocab] (a [batch, sequence, vocab] tensor is flattened).
        targets: [tokens] labels aligned with the logits (the token each position predicts); those inside a
            group before its last position must be valid token ids.
        first, last: [groups] flat positions with first <= last (`AlignedGroups`).
        temperature: T > 0.
    """
    _check_temperature(temperature)
    logits = logits.flatten(0, -2)
    targets = targets.reshape(-1)
    if targets.shape[0] != logits.shape[0]:
        raise ValueError(f"targets hold {targets.shape[0]} positions but logits {logits.shape[0]}")
    first, last = first.reshape(-1).long(), last.reshape(-1).long()
    if first.shape != last.shape:
        raise ValueError(f"first and last need one entry per group, got {tuple(first.shape)} and {tuple(last.shape)}")
    if len(first) and (bool((first > last).any()) or int(first.min()) < 0 or int(last.max()) >= logits.shape[0]):
        raise ValueError(f"group positions must satisfy 0 <= first <= last < {logits.shape[0]} (the logits' tokens)")
    dtype = result_dtype(logits)
    log_p = F.log_softmax(logits[last].to(dtype) / temperature, dim=-1)
    lengths = last - first
    if int(lengths.sum()) == 0:
        return log_p
    # Earlier tokens of each group: only their target's log-probability is needed, not a full row each.
    group_of = torch.repeat_interleave(torch.arange(len(first), device=first.device), lengths)
    starts = torch.repeat_interleave(first, lengths)
    offsets = torch.arange(len(group_of), device=first.device) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths
    )
    positions = starts + offsets
    prefix_targets = targets[positions].long()
    if bool(((prefix_targets < 0) | (prefix_targets >= logits.shape[-1])).any()):
        raise ValueError("a target inside a group (before its last position) is not a token id: groups must lie "
                         "within documents, where every position but the last has a target")
    rows = logits[positions].to(dtype) / temperature
    token_log_p = rows.gather(-1, prefix_targets[:, None])[:, 0] - rows.logsumexp(-1)
    prefix = torch.zeros(len(first), dtype=dtype, device=logits.device).index_add(0, group_of, token_log_p)
    return log_p + prefix[:, None]


def _sorted_l1(student_p: Tensor, teacher_p: Tensor) -> Tensor:
    """Per row sum |sort(p_s) - sort(p_t)| (descending, the shorter zero-padded): [rows]."""
    width = max(student_p.shape[-1], teacher_p.shape[-1])
    student_sorted = F.pad(student_p.sort(dim=-1, descending=True).values, (0, width - student_p.shape[-1]))
    teacher_sorted = F.pad(teacher_p.sort(dim=-1, descending=True).values, (0, width - teacher_p.shape[-1]))
    return (student_sorted - teacher_sorted).abs().sum(-1)


def _student_groups(student_logits, student_targets, teacher_log_probs, first, last, temperature):
    log_q = group_log_probs(student_logits, student_targets, first, last, temperature=temperature)
    if teacher_log_probs.ndim != 2 or teacher_log_probs.shape[0] != log_q.shape[0]:
        raise ValueError(
            f"teacher_log_probs must be [groups, teacher vocab] with {log_q.shape[0]} groups, got "
            f"{tuple(teacher_log_probs.shape)}"
        )
    dtype = result_dtype(log_q, teacher_log_probs)
    return log_q.to(dtype), teacher_log_probs.detach().to(dtype), dtype


def uld_loss(
    student_logits: Tensor,
    student_targets: Tensor,
    teacher_log_probs: Tensor,
    *,
    student_first: Tensor,
    student_last: Tensor,
    temperature: float = 1.0,
    num_valid_tokens: int | Tensor | None = None,
) -> Tensor:
    """Universal Logit Distillation (Boizard et al. 2024, arXiv 2402.12030) over aligned groups.

    T^2 * sum over groups of sum_k |sort(p_s)_k - sort(p_t)_k| / num_valid_tokens, the probability vectors
    sorted in decreasing order and the shorter one zero-padded: the paper's closed form of the
    Wasserstein-1 distance when every pair of distinct tokens is one unit apart. It ignores token identity,
    so it needs no vocabulary map. p are the chain-rule group distributions (`group_log_probs`).

    Args:
        student_logits: [tokens, student vocab].
        student_targets: [tokens] the student's labels (targets of the positions).
        teacher_log_probs: [groups, teacher vocab] `group_log_probs` of the teacher at the same temperature.
        student_first, student_last: [groups] the student's positions of each group (`AlignedGroups`).
        temperature: T > 0.
        num_valid_tokens: normaliser; defaults to the number of groups.
    """
    log_q, log_p, dtype = _student_groups(
        student_logits, student_targets, teacher_log_probs, student_first, student_last, temperature
    )
    terms = uld_terms(log_q, log_p)
    valid = torch.ones(len(terms), dtype=torch.bool, device=terms.device)
    return terms.sum() * temperature**2 / token_normalizer(num_valid_tokens, valid, dtype)


def uld_terms(log_q: Tensor, log_p: Tensor) -> Tensor:
    """`uld_loss`' term of each group, before T^2 and the normaliser: [groups], of the student's and teacher's group
    log-probabilities (`group_log_probs`) [groups, each one's vocabulary]."""
    return _sorted_l1(log_q.exp(), log_p.exp())


def _generalized_kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """Per row sum of p log(p / q) - p + q: KL for unnormalized measures, >= 0, the KL when both sum to 1.

    Entries with p = 0 contribute q; with q = 0 < p the result is infinite.
    """
    p, q = log_p.exp(), log_q.exp()
    log_ratio = torch.where(p > 0, log_p - log_q, 0.0)
    return (p * log_ratio - p + q).sum(-1)


def gold_loss(
    student_logits: Tensor,
    student_targets: Tensor,
    teacher_log_probs: Tensor,
    vocabulary_map: VocabularyMap,
    *,
    student_first: Tensor,
    student_last: Tensor,
    temperature: float = 1.0,
    num_valid_tokens: int | Tensor | None = None,
    divergence: str = "forward_kl",
    matched_weight: float | None = None,
    unmatched_weight: float | None = None,
) -> Tensor:
    """GOLD's hybrid loss (TRL, `trl/experimental/gold/gold_trainer.py`, `uld_use_hybrid_loss`).

    On the chain-rule group distributions (`group_log_probs`) p_t (teacher) and p_s (student):
    T^2 * sum over groups of [w_m * D(matched entries) + w_u * ULD(unmatched entries)] / num_valid_tokens.
    Matched entries are the exact pairs of `vocabulary_map` (same bytes, or the same special role);
    D is the KL for unnormalized measures, sum p log(p / q) - p + q, with (p, q) = (p_t, p_s) for
    "forward_kl" and (p_s, p_t) for "reverse_kl": it is the KL itself when the matched entries carry all the
    mass, so with one tokenizer on both sides the loss is `kd_loss`. ULD is the sorted L1 of `uld_loss` over
    the remaining entries of each side. Weights default to TRL's adaptive ones: w_m = matched pairs /
    teacher vocabulary size (of the map), w_u = 1 - w_m.

    Args:
        vocabulary_map: from `build_vocabulary_map`; its ids must lie within both logits' widths.
        divergence: "forward_kl" or "reverse_kl".
        matched_weight, unmatched_weight: w_m and w_u; None takes the adaptive default (w_u = 1 - w_m).
        Others: as for `uld_loss`.
    """
    log_q, log_p, dtype = _student_groups(
        student_logits, student_targets, teacher_log_probs, student_first, student_last, temperature
    )
    terms = gold_terms(log_q, log_p, vocabulary_map, divergence=divergence, matched_weight=matched_weight,
                       unmatched_weight=unmatched_weight)
    valid = torch.ones(len(terms), dtype=torch.bool, device=terms.device)
    return terms.sum() * temperature**2 / token_normalizer(num_valid_tokens, valid, dtype)


def gold_terms(log_q: Tensor, log_p: Tensor, vocabulary_map: VocabularyMap, *, divergence: str = "forward_kl",
               matched_weight: float | None = None, unmatched_weight: float | None = None) -> Tensor:
    """`gold_loss`' term of each group, before T^2 and the normaliser: [groups], of the student's and teacher's
    group log-probabilities (`group_log_probs`) [groups, each one's vocabulary] (arguments as there).

    The map's entries are read once per pair of widths and device (`_gold_entries`), so that a loss called chunk by
    chunk neither checks nor copies them again."""
    if divergence not in ("forward_kl", "reverse_kl"):
        raise ValueError(f"divergence must be 'forward_kl' or 'reverse_kl', got {divergence!r}")
    student_ids, teacher_ids, student_rest, teacher_rest = _gold_entries(vocabulary_map, log_q.shape[-1],
                                                                         log_p.shape[-1], log_q.device)
    if matched_weight is None:
        matched_weight = len(teacher_ids) / max(1, vocabulary_map.teacher_vocab_size)
    if unmatched_weight is None:
        unmatched_weight = 1.0 - matched_weight
    matched_q, matched_p = log_q[:, student_ids], log_p[:, teacher_ids]
    if divergence == "forward_kl":
        matched = _generalized_kl(matched_p, matched_q)
    else:
        matched = _generalized_kl(matched_q, matched_p)
    terms = matched_weight * matched
    if unmatched_weight != 0 and (len(student_rest) or len(teacher_rest)):
        terms = terms + unmatched_weight * _sorted_l1(log_q[:, student_rest].exp(), log_p[:, teacher_rest].exp())
    return terms


# vocabulary map -> {(student width, teacher width, device): its `_gold_entries`}; held no longer than the map.
_GOLD_ENTRIES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _gold_entries(vocabulary_map: VocabularyMap, student_width: int, teacher_width: int,
                  device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The exact pairs' student and teacher ids and the ids of each side's other entries (ascending), on `device`,
    checked against the widths: made once per map, widths and device (the ids live on the host, and reading or
    copying them for every chunk of a loss would make the host wait each time)."""
    key = (student_width, teacher_width, torch.device(device))
    made = _GOLD_ENTRIES.setdefault(vocabulary_map, {})
    if key not in made:
        student_ids, teacher_ids = vocabulary_map.exact_student_ids, vocabulary_map.exact_teacher_ids
        _check_ids(student_ids, student_width, "student")
        _check_ids(teacher_ids, teacher_width, "teacher")
        entries = []
        for ids, width in ((student_ids, student_width), (teacher_ids, teacher_width)):
            rest = torch.ones(width, dtype=torch.bool, device=ids.device)
            rest[ids] = False
            entries.append(rest.nonzero()[:, 0])
        made[key] = tuple(ids.to(device) for ids in (student_ids, teacher_ids, *entries))
    return made[key]


def project_teacher_logits(
    teacher_logits: Tensor, vocabulary_map: VocabularyMap, *, temperature: float = 1.0,
    student_vocab_size: int | None = None,
) -> Tensor:
    """The teacher's next-token distributions on the student's vocabulary, as logits: [rows, student vocab].

    p'[u] = sum_v W[u, v] softmax(teacher_logits / T)[v] over the map's projection W, renormalized over the
    student vocabulary (mass of teacher tokens the map drops, such as unmatched specials, is given back in
    proportion). The result is T * log p', so that softmax(result / T) = p' and `kd_loss` at temperature T
    sees exactly p'; student entries no teacher token reaches are -inf (infinite reverse KL, by design of
    `kd_loss`). No gradient flows.

    Args:
        teacher_logits: [rows, teacher vocab], e.g. the teacher's logits at the groups' first positions.
        student_vocab_size: width of the result (the student's logits may be wider than its tokenizer);
            default the map's student vocabulary size.
    """
    _check_temperature(temperature)
    width = vocabulary_map.student_vocab_size if student_vocab_size is None else student_vocab_size
    if width < vocabulary_map.student_vocab_size:
        raise ValueError(f"student_vocab_size {width} is below the map's {vocabulary_map.student_vocab_size}")
    rows_in, cols = vocabulary_map.projection_student_ids, vocabulary_map.projection_teacher_ids
    _check_ids(cols, teacher_logits.shape[-1], "teacher")
    dtype = result_dtype(teacher_logits)
    log_p = F.log_softmax(teacher_logits.detach().flatten(0, -2).to(dtype) / temperature, dim=-1)
    device = log_p.device
    weights = vocabulary_map.projection_weights.to(device=device, dtype=dtype)
    projected = torch.zeros(log_p.shape[0], width, dtype=dtype, device=device)
    projected.index_add_(1, rows_in.to(device), log_p[:, cols.to(device)].exp() * weights)
    log_projected = projected.log()
    log_projected = log_projected - log_projected.logsumexp(-1, keepdim=True)
    return log_projected * temperature


def projected_kd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    vocabulary_map: VocabularyMap,
    *,
    student_positions: Tensor,
    teacher_positions: Tensor,
    temperature: float = 1.0,
    num_valid_tokens: int | Tensor | None = None,
    divergence: str = "forward_kl",
    jsd_beta: float = 0.5,
) -> Tensor:
    """`kd_loss` between the student and the teacher projected onto the student's vocabulary (X-Token style).

    Compares student_logits[student_positions] with `project_teacher_logits(teacher_logits[
    teacher_positions])`; pass the groups' first positions (`AlignedGroups.student_first`, `teacher_first`),
    where both models predict the next token from the same bytes. Divergences, temperature and normaliser
    are `kd_loss`'s (num_valid_tokens defaults to the number of groups). A teacher side that projects
    before sending can call `kd_loss` directly with the projected logits.
    """
    student_positions, teacher_positions = student_positions.reshape(-1).long(), teacher_positions.reshape(-1).long()
    if student_positions.shape != teacher_positions.shape:
        raise ValueError(
            f"student_positions and teacher_positions must pair up, got {len(student_positions)} and "
            f"{len(teacher_positions)} positions"
        )
    student = student_logits.flatten(0, -2)[student_positions]
    teacher = project_teacher_logits(
        teacher_logits.flatten(0, -2)[teacher_positions], vocabulary_map, temperature=temperature,
        student_vocab_size=student.shape[-1],
    )  # fmt: skip
    labels = torch.zeros(len(student_positions), dtype=torch.int64, device=student.device)
    return kd_loss(student, teacher, labels, temperature=temperature, num_valid_tokens=num_valid_tokens,
                   divergence=divergence, jsd_beta=jsd_beta)


def _check_temperature(temperature: float) -> None:
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")


def _check_ids(ids: Tensor, width: int, side: str) -> None:
    if len(ids) and int(ids.max()) >= width:
        raise ValueError(
            f"the vocabulary map names {side} token {int(ids.max())} but the {side} logits have {width} entries: "
            f"build the map from this {side}'s tokenizer"
        )


def nll_and_bytes(
    logits: Tensor, labels: Tensor, target_bytes: Tensor, *, ignore_index: int = -100
) -> tuple[Tensor, Tensor]:
    """Summed next-token negative log-likelihood (nats) and the UTF-8 bytes its targets cover.

    Only positions whose label is valid and names a token of at least one byte count (special tokens such
    as EOS cover no text, and tokenizers differ in them), so sums from two tokenizations of the same text
    compare; accumulate both over a held-out set and call `bits_per_byte`. No gradient is needed, none kept.

    Args:
        logits: [batch, sequence, vocab] or [tokens, vocab].
        labels: the logits' shape without the vocab dim.
        target_bytes: same shape: bytes of each label's token (`AlignedBatch.*_target_bytes`).
    """
    if labels.shape != logits.shape[:-1] or target_bytes.shape != labels.shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} and target_bytes {tuple(target_bytes.shape)} must both be the logits' "
            f"shape {tuple(logits.shape)} without the vocab dim"
        )
    with torch.no_grad():
        flat_labels, flat_bytes = labels.reshape(-1), target_bytes.reshape(-1).to(logits.device)
        counted = (flat_labels != ignore_index) & (flat_bytes > 0)
        rows = logits.flatten(0, -2)[counted].to(result_dtype(logits))
        nll = F.cross_entropy(rows, flat_labels[counted].long(), reduction="sum")
        return nll, flat_bytes[counted].sum()


def group_nll_and_bytes(
    logits: Tensor, targets: Tensor, first: Tensor, last: Tensor, num_bytes: Tensor
) -> tuple[Tensor, Tensor]:
    """`nll_and_bytes` over aligned groups: both models of a pair are scored on exactly the same bytes.

    Sums -log P(all targets of the group) over the groups that cover text (`AlignedGroups.num_bytes` > 0),
    with their bytes; call it once per side with that side's logits, targets and positions.
    """
    with torch.no_grad():
        first, last = first.reshape(-1).long(), last.reshape(-1).long()
        counted = num_bytes.reshape(-1).to(first.device) > 0
        first, last = first[counted], last[counted]
        merged = group_log_probs(logits, targets, first, last)
        final = targets.reshape(-1)[last].long().to(merged.device)
        return -merged.gather(-1, final[:, None]).sum(), num_bytes.reshape(-1)[counted.cpu()].sum()


def bits_per_byte(nll_nats: Tensor | float, num_bytes: Tensor | int) -> float:
    """Held-out loss per byte of text, in bits: nll_nats / num_bytes / ln 2; comparable across tokenizers."""
    num_bytes = float(num_bytes)
    if num_bytes <= 0:
        raise ValueError(f"num_bytes must be positive, got {num_bytes}")
    return float(nll_nats) / num_bytes / math.log(2)

"""A cross-tokenizer teacher's answer per aligned group ("groups", `kd.cross_tokenizer.loss` `uld` or `gold`): the
teacher's chain-rule distribution of each group over its own vocabulary, against the student's groups
(`meshkd.recipe.corpus.aligned_data`; the losses are `meshkd.core.cross_tokenizer_loss`'s), of whole logits or
chunk by chunk (the fused output layer: the chunks cut by the micro-batch's `GroupLayout`, read on the host, so that
none waits for the device)."""

from __future__ import annotations

import torch

from meshkd.core.answers import LossContext, TeacherAnswer, choices, register
from meshkd.core.chunked_loss import token_normalizer
from meshkd.core.cross_tokenizer_loss import (
    VocabularyMap,
    gold_loss,
    gold_terms,
    group_log_probs,
    uld_loss,
    uld_terms,
)
from meshkd.recipe.corpus.batches import to_device
from meshkd.recipe.corpus.rows import (
    GROUP_ENDS,
    GROUP_LAYOUT,
    TEACHER_GROUP_ENDS,
    TEACHER_POSITIONS,
    group_layout,
    group_positions,
    teacher_side,
)

GROUPS = "groups"
"""The mode of a `uld` / `gold` teacher answer: {"mode": GROUPS, "log_probs": [groups, teacher vocab]}."""


def merges_groups(kd) -> bool:
    """Whether `kd` distills a cross-tokenizer teacher group by group (`kd.cross_tokenizer.loss` `uld` or `gold`)."""
    return kd.cross_tokenizer is not None and kd.cross_tokenizer.loss != "projection"


def teacher_group_log_probs(logits: torch.Tensor, batch: dict, *, temperature: float,
                            ignore_index: int) -> torch.Tensor:
    """[groups, teacher vocab]: the teacher's chain-rule distribution of each group KD counts
    (`meshkd.core.cross_tokenizer_loss.group_log_probs`), from its logits of the batch's teacher side."""
    teacher = teacher_side(batch)
    length = teacher["input_ids"].shape[1]
    # The next token: inside a group it is the same document's, and the group's merge reads only those.
    targets = torch.roll(teacher["input_ids"], -1, dims=1)
    return group_log_probs(logits, targets, group_positions(batch, TEACHER_POSITIONS, length, ignore_index),
                           group_positions(batch, TEACHER_GROUP_ENDS, length, ignore_index), temperature=temperature)


def group_kd_loss(logits: torch.Tensor, batch: dict, teacher_log_probs: torch.Tensor, kd, *,
                  num_valid_tokens: float | torch.Tensor, vocabulary_map: VocabularyMap | None) -> torch.Tensor:
    """`kd.cross_tokenizer.loss` `uld` or `gold` of a micro-batch: the student's groups against the teacher's
    group distributions (`teacher_group_log_probs`), summed and divided by `num_valid_tokens`."""
    length, ignore = batch["input_ids"].shape[1], kd.ignore_index
    common = {"student_first": group_positions(batch, None, length, ignore),
              "student_last": group_positions(batch, GROUP_ENDS, length, ignore),
              "temperature": kd.temperature, "num_valid_tokens": num_valid_tokens}
    if kd.cross_tokenizer.loss == "uld":
        return uld_loss(logits, batch["labels"], teacher_log_probs, **common)
    return gold_loss(logits, batch["labels"], teacher_log_probs, vocabulary_map, divergence=kd.divergence, **common)


@register
class GroupDistributions(TeacherAnswer):
    """A cross-tokenizer teacher's distribution per aligned group ("log_probs" [groups, teacher vocab]).

    Registered from the recipe, not kept in `meshkd.core`: it reads the cross-tokenizer batch keys that pair a
    group's positions (`meshkd.recipe.corpus.rows`), which belong to the recipe's batch schema."""

    name = GROUPS
    chunks_reversed = True  # a group's earlier positions' labels are known (`prepare_chunks`) before its last

    @classmethod
    def made_for(cls, transport, kd):
        """Any request for a distribution (`uld` and `gold` take `full`) from a cross-tokenizer teacher whose loss
        compares groups."""
        return transport in choices("logits_transport") and merges_groups(kd)

    @classmethod
    def encode(cls, logits, batch, context, *, with_label_log_probs=False):
        """The teacher's chain-rule distribution of each group KD counts (`teacher_group_log_probs`), at
        `kd.temperature`, whatever encoding is asked (`kd.cross_tokenizer.loss` `uld` and `gold` take `full`)."""
        return {"mode": GROUPS, "log_probs": teacher_group_log_probs(
            logits, batch, temperature=context.kd.temperature, ignore_index=context.kd.ignore_index)}

    def kd_loss(self, logits, micro_batch, context, *, norm):
        return group_kd_loss(logits, micro_batch, self.wire["log_probs"], context.kd, num_valid_tokens=norm,
                             vocabulary_map=context.vocabulary_map), {}

    def check_indices(self, context: LossContext, vocab_size: int) -> None:
        """Nothing to check: a group's distribution is over the teacher's whole vocabulary, no indices."""

    def prepare_chunks(self, label_log_probs: torch.Tensor, micro_batch: dict, context: LossContext) -> None:
        """Before `chunk_kd_loss`, which then takes the chunks last to first (`fused_output_loss(reverse=True)`):
        `label_log_probs` [positions], each flattened position's log-probability of its label at `kd.temperature`.

        A group's distribution is its last position's plus the log-probabilities of its earlier positions' labels
        (`group_log_probs`), which may lie in earlier chunks: those enter with these values, and their gradient is
        carried back to their chunk as the group's derivative with respect to them (`pending`), known by then.

        Where the groups lie is the micro-batch's `GroupLayout`, read on the host (`GROUP_LAYOUT`, which the step
        adds from its host rows; without it the micro-batch is copied to the host here, one wait per
        micro-batch), so that neither this nor a chunk waits for the device.

        Raises:
            ValueError: a target inside a group (before its last position) is no token id, or the answer holds
                another number of groups than the micro-batch."""
        kd = context.kd
        layout = micro_batch.get(GROUP_LAYOUT)
        if layout is None:
            layout = group_layout(micro_batch, ignore_index=kd.ignore_index)
        if layout.malformed:
            raise ValueError("a target inside a group (before its last position) is not a token id: groups must lie "
                             "within documents, where every position but the last has a target")
        if len(self.wire["log_probs"]) != layout.num_groups:
            raise ValueError(f"the teacher answered {len(self.wire['log_probs'])} groups, the micro-batch has "
                             f"{layout.num_groups}")
        device, num_groups = label_log_probs.device, layout.num_groups
        group_of = to_device(layout.group_of, device)
        # One slot past the groups takes the positions of none, so that no mask has to be counted on the host.
        prefix = label_log_probs.new_zeros(num_groups + 1).index_add(0, group_of, label_log_probs)[:num_groups]
        self._chunks = {"layout": layout, "last": to_device(layout.last, device), "group_of": group_of,
                        "prefix": prefix, "label_log_probs": label_log_probs,
                        "pending": label_log_probs.new_zeros(num_groups + 1)}

    def chunk_kd_loss(self, logits, tokens, micro_batch, context, *, norm):
        """`kd_loss`' share of the flattened positions `tokens` given their logits [c, vocab]: the groups that end
        there, and the gradient of those that end in a later chunk through their labels here (no value). The
        chunks run last to first after `prepare_chunks`; the groups that end in a chunk are a range known on the
        host (`GroupLayout.ending`), so a chunk only slices."""
        state, kd = self._chunks, context.kd
        start = tokens.start
        end = start + logits.shape[0]
        first, stop = state["layout"].ending(start, end)
        count = stop - first
        scaled = logits.float() / kd.temperature
        log_z = scaled.logsumexp(-1)
        labels = micro_batch["labels"].reshape(-1)[start:end]
        live = scaled.gather(-1, labels.clamp(min=0)[:, None])[:, 0] - log_z  # each label's log-probability
        # A group's earlier position here belongs to a group that ends at or after `start`: one that ends in
        # this chunk (index below `stop`), one that ends later, or none (`num_groups`).
        owner = state["group_of"][start:end]
        slot = (owner - first).clamp(max=count)  # slot `count`: the positions of a group that ends later, or none
        live_sum = live.new_zeros(count + 1).index_add(0, slot, live)[:count]
        known_sum = live.new_zeros(count + 1).index_add(0, slot, state["label_log_probs"][start:end])[:count]
        # The earlier chunks' share of each group's prefix, as a leaf: its gradient is what they are owed.
        outside = (state["prefix"][first:stop] - known_sum).detach().requires_grad_()
        rows = state["last"][first:stop] - start
        log_q = scaled[rows] - log_z[rows, None] + (live_sum + outside)[:, None]
        teacher = self.wire["log_probs"][first:stop].detach().to(log_q.dtype)
        if kd.cross_tokenizer.loss == "uld":
            terms = uld_terms(log_q, teacher)
        else:
            terms = gold_terms(log_q, teacher, context.vocabulary_map, divergence=kd.divergence)
        inside = owner < state["layout"].num_groups
        loss = terms.sum() * kd.temperature**2 / token_normalizer(norm, inside, log_q.dtype)
        if count and loss.requires_grad:
            (state["pending"][first:stop],) = torch.autograd.grad(loss, outside, retain_graph=True)
        # The positions of groups that end in a later chunk carry those groups' gradient (`pending`, which is 0 at
        # the slot of none); a group that ends here has had its gradient through `loss` already.
        carried = torch.where(owner >= stop, live * state["pending"][owner], 0.0).sum()
        return loss + (carried - carried.detach()), {}

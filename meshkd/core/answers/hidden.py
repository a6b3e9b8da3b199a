"""The teacher's last hidden states, from which the student's side rebuilds the teacher's whole distribution:
"hidden" (in the teacher's dtype) and "hidden_bf16" (rounded to bfloat16).

The teacher's distribution is softmax(head(h) / T), h its final norm's output and head its output layer with what
its forward does after it (a soft-cap, a scale). h is 2 H bytes a position in bfloat16 against 2 V for the logits.
The teacher sends h ("hidden" [rows, sequence, H]) and its head's identity ("head": `OutputHead.id`); the student's
side holds that head (an `OutputHead`, loaded once by `meshkd.recipe.teacher.teacher_head` and kept in `HEADS`) and
rebuilds the teacher's logits where the loss reads them: by the fused output layer's chunks of positions, so never
[tokens, vocab] whole, or a micro-batch's at once without it (as full logits arrive). Next to a tensor-parallel
student's vocabulary-sharded logits the head makes the same vocabulary slice of the teacher's, as the loss's
vocab-parallel path takes them. Every divergence, a mixture and routed teachers take it, as full logits: the kernel
is the full answer's.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshkd.core.answers.base import register
from meshkd.core.answers.distribution import Distribution, label_log_probs
from meshkd.core.answers.full import FullLogits
from meshkd.core.batch_keys import teacher_side
from meshkd.core.fused_output import chunk_answer
from meshkd.core.loss import top1_agreements as _top1_agreements
from meshkd.core.teacher_protocol import LABEL_LOG_PROBS

FINAL_HIDDEN = "hidden"
"""The field of a hidden answer holding the teacher's last hidden states."""


class OutputHead:
    """A teacher's output layer on the student's side (`meshkd.recipe.teacher.teacher_head.TeacherHead`)."""

    id: str
    """What tells this head from any other (its weights and the model's settings): answers name it."""

    def logits(self, hidden: Tensor, columns: slice) -> Tensor:
        """float32 [positions, columns]: the teacher's logits of the vocabulary entries `columns` at the hidden
        states [positions, H], as its forward makes them."""
        raise NotImplementedError


HEADS: dict[str, OutputHead] = {}
"""The teacher heads this process holds, by id (`hold_head`): a hidden answer is read with the head that it names."""


def hold_head(head: OutputHead) -> None:
    """Keep `head` for the hidden answers that name it."""
    HEADS[head.id] = head


def held_head(head_id: Any) -> OutputHead:
    """The held head of id `head_id`.

    Raises:
        ValueError: the student's side holds no such head (answers of another teacher, or of a cache of one).
    """
    if head_id not in HEADS:
        held = ", ".join(key[:12] for key in HEADS) or "none"
        raise ValueError(f"a hidden teacher answer names output head {str(head_id)[:12]}, which the student's side "
                         f"does not hold (it holds {held}): its answers are read with the output layer of the "
                         "teacher that made them")
    return HEADS[head_id]


@register
class HiddenStates(Distribution):
    """The teacher's last hidden states in its dtype ("hidden" [rows, sequence, H]) and its head's id ("head")."""

    name = "hidden"
    selected_by = {"logits_transport": "hidden"}
    whole_distribution = True
    keeps_dtype = True
    reads_hidden: ClassVar[bool] = True

    @classmethod
    def made_for(cls, transport, kd):
        return transport == cls.name and kd.cross_tokenizer is None

    @classmethod
    def encode(cls, logits, batch, context, *, with_label_log_probs=False, hidden=None):
        """`hidden` [rows, sequence, H] the teacher's final norm's outputs; the head's id is `context.head_id`.
        Asked `with_label_log_probs`, each label's log-probability beside them, from `logits`."""
        if hidden is None or context.head_id is None:
            raise ValueError(f"a {cls.name} answer is made from the teacher's last hidden states and its head's id")
        wire = {"mode": cls.name, FINAL_HIDDEN: cls.rounded(hidden.detach()), "head": context.head_id}
        if with_label_log_probs:
            wire[LABEL_LOG_PROBS] = label_log_probs(logits, teacher_side(batch)["labels"],
                                                    ignore_index=context.kd.ignore_index)["log_probs"]
        return wire

    @staticmethod
    def rounded(hidden: Tensor) -> Tensor:
        return hidden

    @classmethod
    def check(cls, decoded: dict[str, Any], shape) -> None:
        if set(decoded) != {"mode", FINAL_HIDDEN, "head"}:
            raise ValueError(f"a {cls.name} teacher answer needs fields ['head', 'hidden', 'mode'], got "
                             f"{sorted(decoded)}")
        hidden = decoded[FINAL_HIDDEN]
        if not isinstance(hidden, Tensor) or not hidden.is_floating_point() or hidden.ndim != len(shape) \
                or tuple(hidden.shape[:-1]) != tuple(shape[:-1]):
            got = tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
            raise ValueError(f"a teacher's hidden states are {got}, the student's logits {tuple(shape)}: one "
                             "vector a position")
        held_head(decoded["head"])

    @classmethod
    def bytes_per_token(cls, vocab, *, k, tail_samples, logits_bytes, width=None):
        if width is None:
            raise ValueError(f"the bytes of a {cls.name} answer are the teacher's width's, not its vocabulary's")
        return logits_bytes * width

    @classmethod
    def kernel(cls, student_logits, decoded, labels, kd, *, norm, chunk_size, divergence=None):
        cls.checked(decoded, student_logits, kd, divergence or kd.divergence)
        teacher = {"mode": FullLogits.name, "logits": teacher_logits(decoded, student_logits)}
        return FullLogits.kernel(student_logits, teacher, labels, kd, norm=norm, chunk_size=chunk_size,
                                 divergence=divergence)

    def whole_logits(self) -> Tensor:
        return _head_logits(self.encoding, slice(None))

    def top1_agreements(self, logits, labels, *, ignore_index, cut=None):
        """The valid labels where the student's likeliest token is the teacher's; next to a vocabulary-sharded
        student, the teacher's likeliest over the ranks' slices."""
        encoding = self.encoding if cut is None else chunk_answer(self.encoding, *cut)
        teacher = teacher_logits(encoding, logits)
        top = _sharded_argmax(teacher) if isinstance(teacher, DTensor) else teacher.argmax(-1)
        return _top1_agreements(logits, top, labels, ignore_index=ignore_index)


@register
class Bfloat16HiddenStates(HiddenStates):
    """The teacher's last hidden states rounded to bfloat16."""

    name = "hidden_bf16"
    selected_by = {"logits_transport": "hidden_bf16"}
    keeps_dtype = False

    @staticmethod
    def rounded(hidden: Tensor) -> Tensor:
        return hidden.to(torch.bfloat16)

    @classmethod
    def bytes_per_token(cls, vocab, *, k, tail_samples, logits_bytes, width=None):
        return super().bytes_per_token(vocab, k=k, tail_samples=tail_samples, logits_bytes=2, width=width)


def teacher_logits(decoded: dict[str, Any], student_logits: Tensor) -> Tensor:
    """float32: the teacher's logits that the student's `student_logits` [..., vocab] meet, from a hidden answer's
    fields; next to a vocabulary-sharded DTensor, a DTensor of its layout whose every rank made its own slice."""
    if not isinstance(student_logits, DTensor):
        return _head_logits(decoded, slice(None))
    local = student_logits.to_local()
    _, offsets = compute_local_shape_and_global_offset(student_logits.shape, student_logits.device_mesh,
                                                       student_logits.placements)
    logits = _head_logits(decoded, slice(offsets[-1], offsets[-1] + local.shape[-1]))
    return DTensor.from_local(logits, student_logits.device_mesh, student_logits.placements,
                              run_check=False, shape=student_logits.shape, stride=student_logits.stride())


@torch.no_grad()
def _head_logits(decoded: dict[str, Any], columns: slice) -> Tensor:
    """[..., columns] float32: the logits of the vocabulary entries `columns` that the answer's head makes of its
    hidden states [..., H]."""
    hidden = decoded[FINAL_HIDDEN]
    logits = held_head(decoded["head"]).logits(hidden.reshape(-1, hidden.shape[-1]), columns)
    return logits.view(*hidden.shape[:-1], logits.shape[-1])


def _sharded_argmax(teacher: DTensor) -> Tensor:
    """[positions] the index of the largest of vocabulary-sharded logits [positions, vocab] (over the ranks' slices)."""
    _, offsets = compute_local_shape_and_global_offset(teacher.shape, teacher.device_mesh, teacher.placements)
    axis = next(index for index, placement in enumerate(teacher.placements) if placement.is_shard())
    group = teacher.device_mesh.get_group(axis)
    local = teacher.to_local().reshape(-1, teacher.to_local().shape[-1])
    if local.shape[-1]:
        where = local.argmax(-1)
        best = local.gather(-1, where[:, None])[:, 0]
        where = where + offsets[-1]
    else:  # an empty slice: nothing to win
        best = local.new_full(local.shape[:1], -torch.inf)
        where = torch.zeros(local.shape[:1], dtype=torch.long, device=local.device)
    size = dist.get_world_size(group)
    bests, wheres = [torch.empty_like(best) for _ in range(size)], [torch.empty_like(where) for _ in range(size)]
    dist.all_gather(bests, best, group=group)
    dist.all_gather(wheres, where, group=group)
    bests, wheres = torch.stack(bests), torch.stack(wheres)
    # The first slice holding the largest value holds the lowest index of a tie.
    return wheres.gather(0, (bests == bests.max(0).values).float().argmax(0)[None])[0].view(teacher.shape[:-1])


__all__ = ["FINAL_HIDDEN", "HEADS", "Bfloat16HiddenStates", "HiddenStates", "OutputHead", "held_head", "hold_head",
           "teacher_logits"]

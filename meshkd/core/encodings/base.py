"""What an answer encoding is, and the registry of them by name.

An answer encoding is how a teacher's distribution at each position travels from the teacher to the student's
loss: on the bridge's wire, in the teacher cache and from a served teacher. Each is one `AnswerEncoding`
subclass in a module of this package, registered once under the name its answers carry as their "mode"
(`@register`); everything that varies with the encoding asks the registry:

    encode(logits, ...)            the teacher's logits -> the answer dict (`meshkd.core.logits_codec`)
    decode(answer)                 what the loss reads (a packed answer unpacked), where the student takes it
    check(answer, shape)           fields, dtypes and shapes against the student's logits, naming what is wrong
    loss(student_logits, answer, labels, ...)   the KD loss kernel it needs
    nbytes_per_token(vocab, ...)   its size, for the bench and the cache's size estimate
    settings_keys                  the `kd` keys its answers depend on (recorded in the teacher cache's key)
    layout                         the version of a packed layout (recorded there too)
    selected_by                    the `kd` keys' values that choose it (the config checks read the choices)

Adding an encoding is one module here (imported by `meshkd/core/encodings/__init__.py`) and its test.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from meshkd.core.registry import Registry


class AnswerEncoding:
    """One way a teacher's answer travels. Subclasses set the class attributes and implement `encode`,
    `check`, `nbytes_per_token` and `loss`."""

    name: ClassVar[str]
    """The "mode" its answers carry."""
    selected_by: ClassVar[dict[str, str]]
    """The `kd` keys (without the prefix) and values that choose it, e.g. {"logits_transport": "topk",
    "topk_encoding": "exact"}; a key it does not name does not matter to it."""
    settings_keys: ClassVar[tuple[str, ...]] = ()
    """The `kd` keys besides the teacher's logits that its answers depend on."""
    whole_distribution: ClassVar[bool] = False
    """Whether it carries the teacher's whole logits ("logits" [..., vocab]): every divergence takes it, and a
    mixture of teachers."""
    has_indices: ClassVar[bool] = False
    """Whether its answers hold vocabulary indices whose values `index_errors` checks."""
    layout: ClassVar[str | None] = None
    """The version of a packed layout, recorded in the teacher cache's key where set: a cache written in another
    layout is then refused as another run's, not misread."""

    def encode(self, logits: Tensor, *, k: int | None, temperature: float, tail_samples: int, seed: int,
               chunk_size: int) -> dict[str, Any]:
        """The answer for [..., vocab] teacher logits (see `meshkd.core.logits_codec.encode_teacher_logits`)."""
        raise NotImplementedError

    def seeded(self, *, tail_samples: int) -> bool:
        """Whether `encode` draws from its seed (then each row is encoded with a seed of its own)."""
        return False

    def decode(self, answer: dict[str, Any]) -> dict[str, Any]:
        """What the loss reads of an answer: the answer itself unless it is packed."""
        return answer

    def check(self, answer: dict[str, Any], shape: tuple[int, ...], *, check_indices: bool) -> None:
        """ValueError naming what does not fit the student's logits of (global) `shape`."""
        raise NotImplementedError

    def index_errors(self, answer: dict[str, Any], vocab: int) -> Tensor:
        """A 0-dim bool tensor: whether an index is out of [0, vocab) or repeated (`has_indices` encodings)."""
        raise NotImplementedError(f"{self.name} answers hold no indices")

    def index_message(self, vocab: int) -> str:
        """What a check says of indices that `index_errors` finds wrong."""
        raise NotImplementedError(f"{self.name} answers hold no indices")

    def nbytes_per_token(self, vocab: int, *, k: int, tail_samples: int, logits_bytes: int) -> int:
        """Bytes one position's answer takes; `logits_bytes`: a teacher logit's, for encodings that keep its dtype."""
        raise NotImplementedError

    def check_divergence(self, divergence: str) -> None:
        """ValueError if its answers cannot carry `divergence`: every divergence but forward KL weighs vocabulary
        entries by the student's probability, or compares the distributions entry by entry, so it needs the
        teacher's whole distribution."""
        if divergence != "forward_kl" and not self.whole_distribution:
            whole = " or ".join(choices("logits_transport", whole_distribution=True))
            raise ValueError(f"divergence {divergence} needs the teacher's whole distribution: use logits transport "
                             f"{whole} ({self.name} keeps part of it and combines with forward_kl only)")

    def loss(self, student_logits: Tensor, answer: dict[str, Any], labels: Tensor, **options: Any) -> Tensor:
        """The KD loss against its (decoded, checked) answer; `options`: `meshkd.core.loss.kd_loss`'s keywords."""
        raise NotImplementedError


ENCODINGS: Registry[AnswerEncoding] = Registry("answer encoding", "encoded teacher logits need a mode of {known}, "
                                                                    "got {name}")
"""Every registered encoding, by name (filled as `meshkd.core.encodings` imports its modules)."""
register = ENCODINGS.register
"""Class decorator: registers one instance of the class under its `name`."""
encoding_named = ENCODINGS.named
"""The registered encoding of answers of mode `name`; ValueError naming the known ones."""


def choices(key: str, *, whole_distribution: bool | None = None) -> tuple[str, ...]:
    """The values of the `kd` key `key` that choose some registered encoding (of `whole_distribution`, if given)."""
    values = [encoding.selected_by[key] for encoding in ENCODINGS.values() if key in encoding.selected_by
              and whole_distribution in (None, encoding.whole_distribution)]
    return tuple(dict.fromkeys(values))


def selected(**keys: str) -> AnswerEncoding:
    """The encoding that `kd` keys' values choose, e.g. `selected(logits_transport="topk", topk_encoding="exact")`:
    one whose every selecting key has its value here, the most specific where several do.

    Raises:
        ValueError: naming the values and what the registered encodings take.
    """
    matches = [encoding for encoding in ENCODINGS.values()
               if all(keys.get(key) == value for key, value in encoding.selected_by.items())]
    if not matches:
        known = "; ".join(f"{name}: {encoding.selected_by}" for name, encoding in ENCODINGS.items())
        raise ValueError(f"no answer encoding is chosen by {keys} (registered: {known})")
    return max(matches, key=lambda encoding: len(encoding.selected_by))

"""Token alignment: pair two tokenizations of the same text by UTF-8 byte offsets, and pack both sides.

Design. Every token carries a byte span [start, end) in its document's UTF-8 text (`TokenSpans` of
`meshkd.core.token_bytes`); special tokens (BOS, EOS) carry an empty span at the byte where they sit. A byte
position is a cut of one side when no token of that side spans across it; the common cuts of both sides
split the document into the finest groups (student tokens i..j, teacher tokens k..l) that cover the same
bytes. Groups are monotone, every byte lies in exactly one group, and a group never crosses a document.
Empty-span tokens at a group boundary form a boundary group of their own (EOS with EOS, paired in order when
both sides have as many; a BOS that one side alone has is a group with no token on the other side); one
strictly inside a group joins it. Offsets, not decoded strings, are compared, so multibyte characters,
whitespace runs and one-sided specials need no special case.

Two texts that differ but share passages (a chat row under two templates, the same answers in different
wrapping) are aligned passage by passage (`align_shared_spans`); every token outside them is a group of its
own with no partner.

Packing both sides into rows: `meshkd.core.aligned_packing`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from meshkd.core.token_bytes import TokenSpans

IGNORE_INDEX = -100
"""Label of positions without a target, as in `meshkd.recipe.corpus.data`."""


@dataclass(frozen=True)
class Alignment:
    """Groups of one document: group g holds student tokens [student_bounds[g], student_bounds[g + 1]),
    teacher tokens [teacher_bounds[g], teacher_bounds[g + 1]) and bytes [byte_bounds[g], byte_bounds[g + 1]).

    Each bounds tuple has num_groups + 1 non-decreasing entries from 0 to the side's token count (or the
    document's byte count), so groups are contiguous on both sides and cover every token and byte once.
    A group with an empty byte range is a boundary group of empty-span tokens; it may lack one side.
    """

    student_bounds: tuple[int, ...]
    teacher_bounds: tuple[int, ...]
    byte_bounds: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return len(self.byte_bounds) - 1


def check_token_spans(spans: TokenSpans, name: str = "tokens") -> None:
    """ValueError naming the first token whose span is outside the text or out of order.

    Spans must lie in [0, num_bytes] with start <= end, and both starts and ends must be non-decreasing in
    token order (an empty-span token sits between the tokens ending at or before it and those starting at
    or after it).
    """
    n = len(spans.ids)
    if len(spans.starts) != n or len(spans.ends) != n:
        raise ValueError(f"{name}: {n} ids but {len(spans.starts)} starts and {len(spans.ends)} ends")
    if spans.num_bytes < 0:
        raise ValueError(f"{name}: num_bytes must be >= 0, got {spans.num_bytes}")
    previous_start = previous_end = 0
    for i, (start, end) in enumerate(zip(spans.starts, spans.ends)):
        if not 0 <= start <= end <= spans.num_bytes:
            raise ValueError(
                f"{name}: token {i} (id {spans.ids[i]}) has byte span [{start}, {end}), which is not inside the "
                f"text's {spans.num_bytes} bytes with start <= end"
            )
        if start < previous_start or end < previous_end:
            raise ValueError(
                f"{name}: token {i} (id {spans.ids[i]}) spans [{start}, {end}) but token {i - 1} spans "
                f"[{spans.starts[i - 1]}, {spans.ends[i - 1]}): spans must be in text order"
            )
        previous_start, previous_end = start, end


def _cuts(spans: TokenSpans) -> list[bool]:
    """cut[b] for b in 0..num_bytes: no token of this side spans across byte position b."""
    depth = [0] * (spans.num_bytes + 2)
    for start, end in zip(spans.starts, spans.ends):
        if end - start > 1:  # interior positions start + 1 .. end - 1
            depth[start + 1] += 1
            depth[end] -= 1
    cuts, inside = [], 0
    for b in range(spans.num_bytes + 1):
        inside += depth[b]
        cuts.append(inside == 0)
    return cuts


def align_token_spans(student: TokenSpans, teacher: TokenSpans) -> Alignment:
    """The finest monotone grouping of two tokenizations of one text that pairs equal byte ranges.

    Raises ValueError when the two sides disagree on the text's length or a side's spans are invalid
    (`check_token_spans`).
    """
    check_token_spans(student, "student tokens")
    check_token_spans(teacher, "teacher tokens")
    if student.num_bytes != teacher.num_bytes:
        raise ValueError(
            f"student and teacher tokens describe texts of different lengths ({student.num_bytes} and "
            f"{teacher.num_bytes} bytes): align tokenizations of the same document"
        )
    num_bytes = student.num_bytes
    sides = (student, teacher)
    student_cuts, teacher_cuts = _cuts(student), _cuts(teacher)
    common = [b for b in range(num_bytes + 1) if student_cuts[b] and teacher_cuts[b]]
    # A byte range that one side covers with no token of its own (a gap in its spans) cannot stand alone:
    # it joins the previous range (the next one at the start of the text).
    num_segments = len(common) - 1
    has_text = [[False] * num_segments for _ in sides]
    for side, flags in zip(sides, has_text):
        for start, end in zip(side.starts, side.ends):
            if start < end:
                flags[_segment(common, start)] = True
    ends: list[int] = []
    for segment in range(num_segments):
        if all(flags[segment] for flags in has_text) or not ends and segment == num_segments - 1:
            ends.append(common[segment + 1])
        elif ends:
            ends[-1] = common[segment + 1]
    text_bounds = [0, *ends]
    # Each token goes to a (group, slot): slot 0 = the boundary group before text range r, 1 = text range r.
    # Text range r spans [text_bounds[r], text_bounds[r + 1]); boundary r sits at byte text_bounds[r].
    boundary_index = {byte: r for r, byte in enumerate(text_bounds)}

    def key(start: int, end: int) -> tuple[int, int]:
        if start == end and start in boundary_index:
            return boundary_index[start], 0
        return _segment(text_bounds, start), 1

    keys = [[key(s, e) for s, e in zip(side.starts, side.ends)] for side in sides]
    num_text = len(text_bounds) - 1
    slots = sorted({k for side_keys in keys for k in side_keys} | {(r, 1) for r in range(num_text)})
    bounds: list[list[int]] = [[0], [0]]
    byte_bounds = [0]
    for slot in slots:
        r, is_text = slot
        counts = []
        for side_index, side_keys in enumerate(keys):
            count = bounds[side_index][-1]
            while count < len(side_keys) and side_keys[count] == slot:
                count += 1
            counts.append(count - bounds[side_index][-1])
        # Empty-span tokens at one boundary pair up in order when both sides have as many (BOS with BOS).
        split = counts[0] if not is_text and counts[0] == counts[1] else 1
        for _ in range(split):
            for side_index in range(2):
                bounds[side_index].append(bounds[side_index][-1] + counts[side_index] // split)
            byte_bounds.append(text_bounds[r + 1] if is_text else text_bounds[r])
    for side_index, side in enumerate(sides):
        assert bounds[side_index][-1] == len(side.ids), "tokens out of group order despite validated spans"
    return Alignment(tuple(bounds[0]), tuple(bounds[1]), tuple(byte_bounds))


def align_shared_spans(student: TokenSpans, teacher: TokenSpans,
                       shared: Sequence[tuple[int, int, int]]) -> Alignment:
    """Groups of two tokenizations of texts that differ but hold some identical passages (a chat row rendered
    by two templates: the answers are the same bytes, the wrapping around them is not).

    `shared` lists the passages as (student byte start, teacher byte start, byte length), in text order on
    both sides. Each passage is aligned as `align_token_spans` aligns a whole text, between the first and
    the last byte position that is a cut of both sides inside it (a token reaching across a passage's edge
    pairs with nothing). Every other token is a group of its own with no token on the other side: it pairs
    with nothing, and a document can be cut before any of them. `byte_bounds` count the student's bytes.

    Raises ValueError for invalid spans (`check_token_spans`) or passages out of order or outside a text.
    """
    check_token_spans(student, "student tokens")
    check_token_spans(teacher, "teacher tokens")
    sides = (student, teacher)
    cut_points = [_cut_points(side) for side in sides]
    bounds: list[list[int]] = [[0], [0]]
    byte_bounds = [0]
    aligned_up_to = [0, 0]  # each side's byte where the last aligned passage ended

    def alone(side_index: int, stop: int) -> None:
        """Each of the side's tokens before `stop` not yet in a group, as a group of its own."""
        other = 1 - side_index
        for k in range(bounds[side_index][-1], stop):
            bounds[side_index].append(k + 1)
            bounds[other].append(bounds[other][-1])
            byte_bounds.append(max(byte_bounds[-1], student.ends[k]) if side_index == 0 else byte_bounds[-1])

    for student_start, teacher_start, length in shared:
        starts = (student_start, teacher_start)
        for side, start, name in zip(sides, starts, ("student", "teacher")):
            if length < 0 or start < 0 or start + length > side.num_bytes:
                raise ValueError(f"shared passage ({student_start}, {teacher_start}, {length}) is outside the "
                                 f"{name} text's {side.num_bytes} bytes")
        common = sorted(set.intersection(*({point - start for point in points if start <= point <= start + length}
                                           for points, start in zip(cut_points, starts))))
        if len(common) < 2:
            continue  # no stretch of the passage that both sides cut alike at both ends
        low, high = common[0], common[-1]
        pieces = []
        for side_index, (side, start) in enumerate(zip(sides, starts)):
            if start + low < aligned_up_to[side_index]:
                raise ValueError(f"shared passage ({student_start}, {teacher_start}, {length}) overlaps the one "
                                 f"before it on the {('student', 'teacher')[side_index]} side: give them in text "
                                 f"order")
            aligned_up_to[side_index] = start + high
            first = bisect.bisect_left(side.starts, start + low, lo=bounds[side_index][-1])
            stop = bisect.bisect_right(side.ends, start + high, lo=first)
            pieces.append((first, stop))
            alone(side_index, first)
        spans = [TokenSpans(side.ids[first:stop], tuple(b - start - low for b in side.starts[first:stop]),
                            tuple(b - start - low for b in side.ends[first:stop]), high - low)
                 for side, start, (first, stop) in zip(sides, starts, pieces)]
        inner = align_token_spans(*spans)
        for g in range(inner.num_groups):
            bounds[0].append(pieces[0][0] + inner.student_bounds[g + 1])
            bounds[1].append(pieces[1][0] + inner.teacher_bounds[g + 1])
            byte_bounds.append(max(byte_bounds[-1], student_start + low + inner.byte_bounds[g + 1]))
    alone(0, len(student.ids))
    alone(1, len(teacher.ids))
    return Alignment(tuple(bounds[0]), tuple(bounds[1]), tuple(byte_bounds))


def _cut_points(side: TokenSpans) -> set[int]:
    """Byte positions where no token of `side` reaches across: each token's start and end unless an
    overlapping token (parts of one character left unsplit) covers it."""
    points = {0, side.num_bytes}
    for k, (start, end) in enumerate(zip(side.starts, side.ends)):
        if k == 0 or side.ends[k - 1] <= start:
            points.add(start)
        if k + 1 == len(side.ids) or side.starts[k + 1] >= end:
            points.add(end)
    return points


def _segment(bounds: list[int], byte: int) -> int:
    """Index r of the range [bounds[r], bounds[r + 1]) holding `byte` (the last range for the end)."""
    return min(max(bisect.bisect_right(bounds, byte) - 1, 0), len(bounds) - 2)

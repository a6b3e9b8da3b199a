"""Token bytes (no process group): byte spans of real tokenizers and the bytes of their vocabularies."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkd.core.token_alignment import check_token_spans
from meshkd.core.token_bytes import decode_with_byte_spans, encode_with_byte_spans, token_byte_lengths, token_bytes
from tests.core.tokenizers_on_the_fly import CORPUS, TOKENIZERS


def test_byte_tokenizer_splits_multibyte_characters_by_their_bytes():
    tokenizer = TOKENIZERS["byte"]()
    (spans,) = encode_with_byte_spans(tokenizer, ["é😀"])
    assert spans.ids == (*"é😀".encode(), tokenizer.eos_token_id)
    assert spans.starts == (0, 1, 2, 3, 4, 5, 6) and spans.ends == (1, 2, 3, 4, 5, 6, 6)


def test_token_bytes_follow_each_backend():
    tables = {name: token_bytes(TOKENIZERS[name]()) for name in ("byte", "unigram_120", "wordpiece_160")}
    assert tables["byte"][:256] == [bytes([b]) for b in range(256)] and tables["byte"][256:] == [None, None]
    unigram = TOKENIZERS["unigram_120"]()
    assert any(entry is not None and entry.startswith(b" ") for entry in tables["unigram_120"])
    assert all(entry is None or b"\xe2\x96\x81" not in entry for entry in tables["unigram_120"])  # no "▁" left
    assert tables["unigram_120"][unigram.eos_token_id] is None
    wordpiece = TOKENIZERS["wordpiece_160"]()
    inner = [i for i, token in enumerate(wordpiece.convert_ids_to_tokens(list(range(len(wordpiece)))))
             if token.startswith("##")]
    assert inner and all(not tables["wordpiece_160"][i].startswith(b"#") for i in inner)


def test_add_bos_without_a_bos_token_raises():
    with pytest.raises(ValueError, match="has no bos_token"):
        encode_with_byte_spans(TOKENIZERS["byte"](), ["x"], add_bos=True)


@pytest.mark.parametrize("name", ["byte", "bytelevel_bpe_300", "unigram_120"])
def test_token_byte_lengths_of_a_documents_tokens_add_up_to_its_utf8_bytes(name):
    """What a held-out loss per byte divides by: the tokens of a document (EOS covering none) cover its text."""
    tokenizer = TOKENIZERS[name]()
    lengths = token_byte_lengths(tokenizer, size=len(tokenizer) + 3)
    assert lengths.shape == (len(tokenizer) + 3,) and lengths[len(tokenizer):].tolist() == [0, 0, 0]
    assert lengths[tokenizer.eos_token_id] == 0
    for text in CORPUS[:6]:  # accents, CJK, emoji, whitespace runs, code
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        covered = int(lengths[ids].sum())
        # SentencePiece-style models prefix a space the text does not have.
        assert covered - len(text.encode()) in ((0, 1) if name.startswith("unigram") else (0,)), (text, covered)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 261), max_size=40))
def test_sampled_tokens_spell_a_text_their_spans_tile(ids):
    """Any byte-token sequence (invalid UTF-8, ids past the tokenizer included) spells a text another
    tokenizer can read; the spans tile its UTF-8 in order, and valid bytes are kept as they are."""
    table = token_bytes(TOKENIZERS["byte"]())
    text, spans = decode_with_byte_spans(ids, table)
    check_token_spans(spans)
    assert spans.num_bytes == len(text.encode()) and spans.ids == tuple(ids)
    data = b"".join(table[i] or b"" for i in ids if i < len(table))
    try:
        assert text == data.decode()  # valid UTF-8: the text itself, each token at its own bytes
        offsets = [0]
        for i in ids:
            offsets.append(offsets[-1] + len(table[i] or b"" if i < len(table) else b""))
        assert list(spans.starts) == offsets[:-1] and list(spans.ends) == offsets[1:]
    except UnicodeDecodeError:  # the valid characters kept in order, each invalid byte one U+FFFD
        assert text.replace("\ufffd", "") == data.decode(errors="ignore")
        assert text.count("\ufffd") == len(data) - len(data.decode(errors="ignore").encode())


def test_invalid_bytes_read_as_one_replacement_character_each():
    table = token_bytes(TOKENIZERS["byte"]())
    ids = [*"é".encode(), 0x80, ord("a"), *"😀".encode()[:2], 256]  # a lone continuation byte, a cut emoji, EOS
    text, spans = decode_with_byte_spans(ids, table)
    assert text == "é\ufffda\ufffd\ufffd"
    assert spans.starts == (0, 1, 2, 5, 6, 9, 12) and spans.ends == (1, 2, 5, 6, 9, 12, 12)

"""Token bytes: tokenize documents into tokens with UTF-8 byte spans, and read the bytes of a vocabulary.

Design. Every token carries a byte span [start, end) in its document's UTF-8 text (`TokenSpans`); special
tokens (BOS, EOS) carry an empty span at the byte where they sit. `encode_with_byte_spans` turns a fast
tokenizer's character offsets into byte spans: a character split over several byte tokens is split by the
tokens' own bytes when they are known (byte-level BPE), else the tokens share its span (and so fall in one
group when aligned); bytes no token covers (trimmed or dropped whitespace) go to the following token, so a
side tiles its text. `token_bytes` gives the bytes each vocabulary entry stands for, read from the backend's
own conventions (byte-level BPE, SentencePiece, WordPiece): the known bytes above, and what
`meshkd.core.cross_tokenizer_loss` matches vocabularies by. `decode_with_byte_spans` goes the other way,
for tokens a model sampled: the text they spell, with each token's span in it. Pairing two sides' spans is
`meshkd.core.token_alignment`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenSpans:
    """One document's tokens with their UTF-8 byte spans: `ids[i]` covers bytes [starts[i], ends[i]).

    `num_bytes` is the length of the document's UTF-8 text; an empty span (start == end) marks a token that
    covers no text (BOS, EOS). Validated by `meshkd.core.token_alignment.check_token_spans`.
    """

    ids: tuple[int, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    num_bytes: int

    def __len__(self) -> int:
        return len(self.ids)


def token_bytes(tokenizer) -> list[bytes | None]:
    """The UTF-8 bytes each vocabulary entry stands for, by id (None for special tokens).

    Read from the backend's own conventions (its serialized JSON): byte-level BPE spells bytes in GPT-2's
    alphabet ("\u0120hello" is b" hello", and a token may hold part of a character); SentencePiece-style models
    write spaces as U+2581 and unknown bytes as "<0xNN>"; WordPiece marks word-inner pieces with a prefix
    ("##llo" is b"llo") and drops spaces, so its word-initial pieces carry none. Anything else is the
    token's own string. `tokenizer` is a transformers fast tokenizer; ids run over `len(tokenizer)`.
    """
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    kinds = _component_types(backend.get("decoder")) | _component_types(backend.get("pre_tokenizer"))
    model = backend.get("model") or {}
    byte_level = "ByteLevel" in kinds
    metaspace = "Metaspace" in kinds or _replaces_metaspace(backend.get("decoder"))
    wordpiece_prefix = model.get("continuing_subword_prefix") if model.get("type") == "WordPiece" else None
    alphabet = {symbol: byte for byte, symbol in enumerate(byte_alphabet())}
    special = set(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False)
    }
    table: list[bytes | None] = []
    for i, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i in special or token is None:
            table.append(None)
        elif byte_level and all(symbol in alphabet for symbol in token):
            table.append(bytes(alphabet[symbol] for symbol in token))
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">") and model.get("byte_fallback"):
            table.append(bytes([int(token[3:5], 16)]))
        elif metaspace:
            table.append(token.replace("\u2581", " ").encode())
        elif wordpiece_prefix and token.startswith(wordpiece_prefix) and len(token) > len(wordpiece_prefix):
            table.append(token[len(wordpiece_prefix) :].encode())
        else:
            table.append(token.encode())
    return table


def token_byte_lengths(tokenizer, *, size: int = 0):
    """UTF-8 byte length of each vocabulary id as an int64 tensor (0 for special tokens), from `token_bytes`.

    What a label covers of its text: summed over held-out labels, the bytes that a loss per byte divides by
    (`meshkd.recipe.student.evaluation`). `size` pads the table with zeros to at least that many ids (an output
    embedding with rows past the tokenizer's vocabulary)."""
    lengths = [len(piece) if piece is not None else 0 for piece in token_bytes(tokenizer)]
    return torch.tensor(lengths + [0] * max(size - len(lengths), 0), dtype=torch.int64)


def _component_types(component) -> set[str]:
    """Types of a serialized normalizer / pre-tokenizer / decoder, looking inside Sequence components."""
    if not isinstance(component, dict):
        return set()
    types = {component.get("type")}
    for key in ("decoders", "pretokenizers"):
        for inner in component.get(key) or []:
            types |= _component_types(inner)
    return types


def _replaces_metaspace(decoder) -> bool:
    """Whether a (Sequence) decoder replaces U+2581 by a space, as converted SentencePiece tokenizers do."""
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "Replace" and "\u2581" in json.dumps(decoder.get("pattern"), ensure_ascii=False):
        return True
    return any(_replaces_metaspace(inner) for inner in decoder.get("decoders") or [])


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 byte values, indexed by byte (the byte-level BPE alphabet)."""
    # Printable Latin-1 bytes spell themselves; the rest are shifted past 255 so no token is whitespace or
    # a control character.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    spelling = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(256 + shifted)
            shifted += 1
    return [spelling[byte] for byte in range(256)]


def encode_with_byte_spans(
    tokenizer,
    texts: Sequence[str],
    *,
    add_bos: bool = False,
    add_eos: bool | Sequence[bool] = True,
    byte_table: Sequence[bytes | None] | None = None,
) -> list[TokenSpans]:
    """Tokenize documents without the tokenizer's own special tokens and give every token its byte span.

    Character offsets (the fast tokenizer's offset mapping) become UTF-8 byte offsets. Several tokens on
    one character (a multibyte character split by byte-level BPE) get consecutive pieces of its bytes when
    their own bytes (`byte_table`, default `token_bytes(tokenizer)`) spell it, else keep their overlapping
    spans (and so share a group). Bytes that no token covers go to the next token (the last one takes
    trailing bytes), so a side tiles its text. BOS (when `add_bos`) and EOS (when `add_eos` and the
    tokenizer has one, as `meshkd.recipe.corpus.data` does; a sequence says it per document) are added with empty
    spans at the text's start and end.

    Raises:
        ValueError: `add_bos` for a tokenizer without a BOS token, or a tokenizer without offset mappings.
    """
    return encode_with_byte_spans_and_offsets(tokenizer, texts, add_bos=add_bos, add_eos=add_eos,
                                              byte_table=byte_table)[0]


def encode_with_byte_spans_and_offsets(
    tokenizer,
    texts: Sequence[str],
    *,
    add_bos: bool = False,
    add_eos: bool | Sequence[bool] = True,
    byte_table: Sequence[bytes | None] | None = None,
) -> tuple[list[TokenSpans], list[list[tuple[int, int]]]]:
    """`encode_with_byte_spans` and, per document, the tokenizer's own character offsets of its tokens (BOS and
    EOS left out): what an answer-only mask is read from (`meshkd.recipe.corpus.tokenizing.answer_tokens`), with one
    tokenization for both."""
    if add_bos and tokenizer.bos_token_id is None:
        raise ValueError(f"add_bos=True but the tokenizer {type(tokenizer).__name__} has no bos_token")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"{type(tokenizer).__name__} is not a fast tokenizer: byte spans need its offset mapping "
            f"(load it with use_fast=True)"
        )
    if not texts:  # (fast tokenizers fail on an empty batch)
        return [], []
    table = _LazyTable(tokenizer) if byte_table is None else byte_table
    encoded = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    documents = []
    closing = [add_eos] * len(texts) if isinstance(add_eos, bool) else list(add_eos)
    for text, ids, offsets, eos in zip(texts, encoded["input_ids"], encoded["offset_mapping"], closing):
        data = text.encode()
        char_to_byte = [0]
        for character in text:
            char_to_byte.append(char_to_byte[-1] + len(character.encode()))
        starts = [char_to_byte[start] for start, _ in offsets]
        ends = [char_to_byte[end] for _, end in offsets]
        _split_shared_characters(ids, starts, ends, table, data)
        _fill_gaps(starts, ends, len(data))
        ids = list(ids)
        if add_bos:
            ids, starts, ends = [tokenizer.bos_token_id, *ids], [0, *starts], [0, *ends]
        if eos and tokenizer.eos_token_id is not None:
            ids, starts, ends = [*ids, tokenizer.eos_token_id], [*starts, len(data)], [*ends, len(data)]
        documents.append(TokenSpans(tuple(ids), tuple(starts), tuple(ends), len(data)))
    return documents, list(encoded["offset_mapping"])


def decode_with_byte_spans(ids: Sequence[int], table: Sequence[bytes | None]) -> tuple[str, TokenSpans]:
    """The text token ids spell, and each token's byte span in that text's UTF-8 (`TokenSpans`).

    `table` is `token_bytes` of their tokenizer; special tokens (None), and ids past it (an output embedding
    padded past the tokenizer), spell nothing and get an empty span.
    What a model samples need not be UTF-8 (a lone continuation byte, a character cut short): each byte
    that is not part of a valid character becomes U+FFFD in the text, so another tokenizer can read it, and
    the spans are mapped into the text's bytes, so both sides still tile the same text."""
    spelled = [(table[i] if 0 <= i < len(table) else None) or b"" for i in ids]
    data = b"".join(spelled)
    where, pieces, position = [0] * (len(data) + 1), [], 0  # where[b]: byte b's offset in the text's UTF-8
    index = 0
    while index < len(data):
        width = _utf8_width(data, index)
        piece = data[index : index + width] if width else b"\xef\xbf\xbd"
        for k in range(max(width, 1)):
            where[index + k] = position + (k if width else 0)
        position += len(piece)
        pieces.append(piece)
        index += max(width, 1)
    where[len(data)] = position
    starts, ends, offset = [], [], 0
    for piece in spelled:
        size = len(piece)
        starts.append(where[offset])
        ends.append(where[offset + size])
        offset += size
    text = b"".join(pieces).decode()
    return text, TokenSpans(tuple(int(i) for i in ids), tuple(starts), tuple(ends), position)


_UTF8_LEADS = ((0x00, 0x80), (0xC2, 0xE0), (0xE0, 0xF0), (0xF0, 0xF5))  # lead bytes of 1- to 4-byte characters


def _utf8_width(data: bytes, index: int) -> int:
    """The length of the valid UTF-8 character at `index`, or 0 when its bytes are not one."""
    lead = data[index]
    width = next((size for size, (low, high) in enumerate(_UTF8_LEADS, start=1) if low <= lead < high), 0)
    if width == 0 or index + width > len(data):
        return 0
    try:
        data[index : index + width].decode()
    except UnicodeDecodeError:
        return 0
    return width


class _LazyTable:
    """`token_bytes(tokenizer)`, computed on first use: many batches never split a character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.table = tokenizer, None

    def __len__(self) -> int:
        return len(self._table())

    def __getitem__(self, index: int) -> bytes | None:
        return self._table()[index]

    def _table(self) -> list[bytes | None]:
        if self.table is None:
            self.table = token_bytes(self.tokenizer)
        return self.table


def _split_shared_characters(ids, starts: list[int], ends: list[int], table, data: bytes) -> None:
    """Give overlapping tokens (parts of one character) consecutive byte pieces when their bytes spell it.

    A run of tokens whose spans overlap (byte-level BPE reports every part of a character with the whole
    character's offsets, and a token holding " " plus the first bytes of an emoji with both) is split by
    the tokens' own bytes when they concatenate to exactly the run's text (leading space tokens that the text
    lacks, SentencePiece's dummy prefix, becoming empty, after which a lone token takes the whole text);
    otherwise it keeps its spans.
    """
    i = 0
    while i < len(ids):
        j, end = i + 1, ends[i]
        while j < len(ids) and starts[j] < end and starts[i] < ends[i]:
            end = max(end, ends[j])
            j += 1
        if j - i > 1:
            pieces = [table[ids[k]] if 0 <= ids[k] < len(table) else None for k in range(i, j)]
            text = data[starts[i] : end]
            # SentencePiece's dummy prefix: a leading U+2581 token shares the first character's offsets but
            # stands for no text; it becomes an empty-span token in front of it.
            skip = 0
            while (skip < len(pieces) - 1 and pieces[skip] is not None and pieces[skip].strip(b" ") == b""
                   and not text.startswith(b"".join(pieces[: skip + 1]))):
                skip += 1
            rest = pieces[skip:]
            if len(rest) == 1:  # one token left (an unknown one has no bytes): it takes the whole text
                lengths = [0] * skip + [len(text)]
            elif all(piece is not None for piece in rest) and b"".join(rest) == text:
                lengths = [0] * skip + [len(piece) for piece in rest]
            else:
                lengths = None
            if lengths is not None:
                position = starts[i]
                for k, length in zip(range(i, j), lengths):
                    starts[k], ends[k] = position, position + length
                    position += length
        i = j


def _fill_gaps(starts: list[int], ends: list[int], num_bytes: int) -> None:
    """Make a side tile its text: a gap goes to the token after it, trailing bytes to the last text token.

    Tokens the tokenizer reports with no text of their own stay empty, at the end of what precedes them.
    """
    covered = previous_start = 0
    last_text = None
    for k in range(len(starts)):
        if starts[k] < ends[k]:
            # Offsets out of order (rare normalizers) are widened into overlap, which keeps them in one group.
            starts[k] = max(min(starts[k], covered), previous_start)
            ends[k] = covered = max(covered, ends[k])
            previous_start = starts[k]
            last_text = k
        else:
            starts[k] = ends[k] = covered
            previous_start = covered
    if last_text is not None:
        ends[last_text] = num_bytes
        for k in range(last_text + 1, len(starts)):
            starts[k] = ends[k] = num_bytes

"""Tests for meshkd.recipe.corpus.data: reading, splitting, NEAT packing, data-parallel batching, resume and evaluation.

Pure tier: real files under tmp_path read as a run reads them (`build_run_datasets`, every build with a token store
of its own), and a small character-level fast tokenizer built offline, so a token id maps back to exactly one
character and packed rows can be read back as text.
"""

from __future__ import annotations

import json
import os
import random
import re
import string

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from meshkd.recipe.corpus.batches import (
    eval_batches,
    iterate_batches,
    split_micro_batches,
    steps_per_epoch,
    training_rows,
)
from meshkd.recipe.corpus.data import build_run_datasets, split_texts
from meshkd.recipe.corpus.documents import check_arguments
from meshkd.recipe.corpus.rows import BATCH_KEYS, IGNORE_INDEX, PackedDataset
from meshkd.recipe.settings.config import DatasetConfig

ALPHABET = string.ascii_letters + string.digits + ' .,:;!?-_(){}"\n'


def char_tokenizer(*, eos: bool = True, pad: bool = True) -> PreTrainedTokenizerFast:
    """One token per character; ids 0-2 are <unk>, <pad>, </s>."""
    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2}
    for char in ALPHABET:
        vocab[char] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    special = {"unk_token": "<unk>"}
    if eos:
        special["eos_token"] = "</s>"
    if pad:
        special["pad_token"] = "<pad>"
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


TOKENIZER = char_tokenizer()
EOS, PAD = TOKENIZER.eos_token_id, TOKENIZER.pad_token_id
CHARS = {index: char for char, index in TOKENIZER.get_vocab().items()}


def decode(ids) -> str:
    return "".join(CHARS[int(i)] if int(i) not in (EOS, PAD) else "" for i in ids)


def random_text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(length)).strip() or "x"


def write_corpus(root, texts: list[str]) -> str:
    """One text file per document, names sorting in document order; returns a glob matching them."""
    for i, text in enumerate(texts):
        (root / f"doc{i:04d}.txt").write_text(text)
    return str(root / "*.txt")


def pieces(rows: PackedDataset) -> list[tuple[int, int, list[int]]]:
    """(row, index in row, token ids) of every packed piece, read back from the mask."""
    batch, found = as_batch(rows), []
    for row in range(len(rows)):
        mask = batch["attention_mask"][row]
        for index in range(1, int(mask.max()) + 1):
            found.append((row, index, batch["input_ids"][row][mask == index].tolist()))
    return found


def reference_pack(documents: list[list[int]], sequence_length: int, pad: int) -> dict[str, torch.Tensor]:
    """Naive first-fit packing, the obvious way, to compare the real one against."""
    cut = [doc[i : i + sequence_length] for doc in documents for i in range(0, len(doc), sequence_length)]
    rows: list[list[list[int]]] = []
    for piece in cut:
        for row in rows:
            if sum(map(len, row)) + len(piece) <= sequence_length:
                row.append(piece)
                break
        else:
            rows.append([piece])
    out = {
        "input_ids": torch.full((len(rows), sequence_length), pad),
        "labels": torch.full((len(rows), sequence_length), IGNORE_INDEX),
        "position_ids": torch.zeros((len(rows), sequence_length), dtype=torch.int64),
        "attention_mask": torch.zeros((len(rows), sequence_length), dtype=torch.int64),
    }
    for r, row in enumerate(rows):
        offset = 0
        for index, piece in enumerate(row, start=1):
            for i, token in enumerate(piece):
                out["input_ids"][r, offset + i] = token
                out["position_ids"][r, offset + i] = i
                out["attention_mask"][r, offset + i] = index
                if i + 1 < len(piece):
                    out["labels"][r, offset + i] = piece[i + 1]
            offset += len(piece)
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b) == set(BATCH_KEYS)
    for key in BATCH_KEYS:
        assert torch.equal(a[key], b[key]), key


def as_batch(dataset: PackedDataset) -> dict[str, torch.Tensor]:
    return dataset[0 : len(dataset)]


@pytest.fixture
def build(tmp_path_factory):
    """A run's (train, validation) rows of `paths` (a pattern or a list) with these `dataset` settings (no
    validation share unless given), tokenized into a token store of its own each time."""
    def build(paths, *, tokenizer=TOKENIZER, sequence_length: int = 16, **settings) -> tuple:
        paths = [paths] if isinstance(paths, (str, os.PathLike)) else paths
        dataset = DatasetConfig(paths=[str(path) for path in paths], **{"val_fraction": 0.0, **settings},
                                token_store=str(tmp_path_factory.mktemp("store")))
        return build_run_datasets(tokenizer, dataset, sequence_length=sequence_length)
    return build


@pytest.fixture
def corpus(tmp_path):
    """60 documents of 1 to 50 characters (rows of 16 tokens: short, exact and multi-row documents)."""
    rng = random.Random(0)
    texts = [random_text(rng, rng.choice([1, 3, 8, 15, 16, 20, 33, 50])) for _ in range(60)]
    return texts, write_corpus(tmp_path, texts)


# ---------------------------------------------------------------------------------------------------------
# Reading


def test_text_jsonl_and_recursive_glob(build, tmp_path):
    (tmp_path / "a" / "deep" / "er").mkdir(parents=True)
    (tmp_path / "a" / "one.txt").write_text("first file")
    (tmp_path / "a" / "deep" / "er" / "two.txt").write_text("second file")
    (tmp_path / "a" / "skip.md").write_text("not matched")
    (tmp_path / "a" / "blank.txt").write_text("  \n\n")  # whitespace-only: skipped
    records = [{"text": "json one", "id": 1}, {"text": "json two"}, {"text": ""}]
    lines = [json.dumps(r) for r in records]
    (tmp_path / "b.jsonl").write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "other key"}) + "\n")

    train, val = build([str(tmp_path / "a" / "**" / "*.txt"), tmp_path / "b.jsonl"])
    assert len(val) == 0 and val.num_documents == 0
    assert train.num_documents == 4
    assert sorted(decode(ids) for _, _, ids in pieces(train)) == sorted(
        ["first file", "second file", "json one", "json two"]
    )

    train, _ = build([tmp_path / "c.jsonl"], text_key="body")
    assert [decode(ids) for _, _, ids in pieces(train)] == ["other key"]
    # Forced formats override the extension.
    (tmp_path / "records.txt").write_text(lines[0] + "\n")
    train, _ = build(str(tmp_path / "records.txt"), format="jsonl")
    assert [decode(ids) for _, _, ids in pieces(train)] == ["json one"]
    train, _ = build(str(tmp_path / "c.jsonl"), format="text", sequence_length=64)
    assert [decode(ids) for _, _, ids in pieces(train)] == [json.dumps({"body": "other key"}) + "\n"]


def test_deterministic_and_independent_of_pattern_order(build, corpus, tmp_path):
    _, pattern = corpus
    (tmp_path / "extra.jsonl").write_text(json.dumps({"text": "extra document"}) + "\n")
    first = build([pattern, str(tmp_path / "extra.jsonl")], val_fraction=0.2, seed=3)
    second = build([str(tmp_path / "extra.jsonl"), pattern, pattern], val_fraction=0.2, seed=3)
    for a, b in zip(first, second):
        assert_same(as_batch(a), as_batch(b))


def test_max_document_chars_and_max_documents(build, tmp_path):
    texts = [f"document number {i:02d} " + "z" * i for i in range(40)]
    pattern = write_corpus(tmp_path, texts)
    train, _ = build(pattern, max_document_chars=5, sequence_length=64)
    assert sorted(decode(ids) for _, _, ids in pieces(train)) == ["docum"] * 40

    def sample(seed):
        train, _ = build(pattern, max_documents=10, seed=seed, sequence_length=128)
        return sorted(decode(ids) for _, _, ids in pieces(train))

    assert len(sample(0)) == 10 and set(sample(0)) <= set(texts)
    assert sample(0) == sample(0)
    assert sample(0) != sample(1)  # a seeded shuffle of the files, not the first ten in sorted order
    assert sample(0) != sorted(texts[:10])


# ---------------------------------------------------------------------------------------------------------
# Packing


def test_packing_matches_reference_first_fit(build, corpus):
    texts, pattern = corpus
    train, _ = build(pattern)
    documents = [TOKENIZER(t, add_special_tokens=False)["input_ids"] + [EOS] for t in texts]
    assert_same(as_batch(train), reference_pack(documents, 16, PAD))
    assert train.num_documents == len(texts)
    assert train.num_tokens == sum(map(len, documents))
    assert train.sequence_length == 16


def test_packing_invariants(build, corpus):
    texts, pattern = corpus
    train, _ = build(pattern)
    ids, labels, positions, mask = (as_batch(train)[key] for key in BATCH_KEYS)
    assert all(t.dtype == torch.int64 and t.shape == (len(train), 16) for t in (ids, labels, positions, mask))
    # Every token of every document appears exactly once: the pieces' characters are the corpus' characters,
    # and each document contributes one EOS.
    found = [piece for _, _, piece in pieces(train)]
    assert sorted("".join(decode(p) for p in found)) == sorted("".join(texts))
    assert sum(piece.count(EOS) for piece in found) == len(texts)
    for row in range(len(train)):
        m = mask[row]
        used = int((m != 0).sum())
        # Documents are contiguous and numbered 1, 2, ... left to right; padding only at the end.
        assert (m[used:] == 0).all() and m[0] == 1
        assert (m[:used].diff() >= 0).all() and (m[:used].diff() <= 1).all()
        assert (ids[row, used:] == PAD).all() and (positions[row, used:] == 0).all()
        assert (labels[row, used:] == IGNORE_INDEX).all()
        for i in range(used):
            first = i == 0 or m[i - 1] != m[i]
            assert positions[row, i] == (0 if first else positions[row, i - 1] + 1)
            same_next = i + 1 < used and m[i + 1] == m[i]
            assert labels[row, i] == (ids[row, i + 1] if same_next else IGNORE_INDEX)
    # Whole documents end in EOS; only a full-row piece of a long document may lack it.
    assert all(p[-1] == EOS or len(p) == 16 for p in found)
    # Documents that fit in a row are never cut.
    assert {t for t in texts if len(t) + 1 <= 16} <= {decode(p) for p in found if p[-1] == EOS}
    # An int selects one row as a batch of one.
    assert_same(train[-1], {key: value[-1:] for key, value in as_batch(train).items()})


def test_unpacked_rows_hold_one_document_each(build, corpus):
    texts, pattern = corpus
    packed, _ = build(pattern)
    unpacked, _ = build(pattern, packing=False)
    mask = as_batch(unpacked)["attention_mask"]
    assert set(mask.unique().tolist()) <= {0, 1}  # an ordinary 0/1 padding mask
    assert len(unpacked) > len(packed) and unpacked.num_tokens == packed.num_tokens
    assert sorted(decode(p) for _, _, p in pieces(unpacked)) == sorted(decode(p) for _, _, p in pieces(packed))


def test_long_document_is_split_into_row_sized_pieces(build, tmp_path):
    text = "".join(ALPHABET[i % 26] for i in range(37))  # 37 chars + EOS = 38 tokens = 16 + 16 + 6
    (tmp_path / "long.txt").write_text(text)
    (tmp_path / "short.txt").write_text("abc")
    train, _ = build(str(tmp_path / "*.txt"))
    assert len(train) == 3
    found = pieces(train)
    assert [(row, index, len(p)) for row, index, p in found] == [(0, 1, 16), (1, 1, 16), (2, 1, 6), (2, 2, 4)]
    assert decode(found[0][2] + found[1][2] + found[2][2]) == text
    batch = as_batch(train)
    for row, length in ((0, 16), (1, 16), (2, 6)):
        assert batch["position_ids"][row, :length].tolist() == list(range(length))
        assert batch["labels"][row, length - 1] == IGNORE_INDEX
        assert batch["labels"][row, : length - 1].tolist() == batch["input_ids"][row, 1:length].tolist()
    assert batch["position_ids"][2, 6:10].tolist() == [0, 1, 2, 3]


def test_eos_and_pad_fallbacks(build, tmp_path):
    (tmp_path / "a.txt").write_text("abcd")
    no_pad, _ = build(str(tmp_path / "a.txt"), tokenizer=char_tokenizer(pad=False))
    ids = no_pad[0]["input_ids"][0]
    assert ids[:5].tolist()[-1] == EOS and (ids[5:] == EOS).all()
    bare, _ = build(str(tmp_path / "a.txt"), tokenizer=char_tokenizer(eos=False, pad=False))
    ids, labels = (bare[0][key][0] for key in ("input_ids", "labels"))
    assert bare.num_tokens == 4 and (ids[4:] == 0).all()
    assert labels[:4].tolist() == ids[1:4].tolist() + [IGNORE_INDEX]


# ---------------------------------------------------------------------------------------------------------
# Validation split


def test_val_split_is_disjoint_by_document_and_seeded(build, tmp_path):
    texts = [f"document {i:03d} " + "q" * (i % 23) for i in range(50)]  # distinct, each fits in a row
    pattern = write_corpus(tmp_path, texts)

    def split(seed):
        train, val = build(pattern, val_fraction=0.2, seed=seed, sequence_length=40)
        assert (train.num_documents, val.num_documents) == (40, 10)
        return train, val, *({decode(p) for _, _, p in pieces(d)} for d in (train, val))

    train, val, train_docs, val_docs = split(5)
    assert train_docs | val_docs == set(texts) and not train_docs & val_docs
    train2, val2, *_ = split(5)
    assert_same(as_batch(train), as_batch(train2))
    assert_same(as_batch(val), as_batch(val2))
    assert split(6)[3] != val_docs


def test_val_split_sizes(build, tmp_path):
    pattern = write_corpus(tmp_path, ["aa", "bb", "cc"])
    train, val = build(pattern, val_fraction=0.01)
    assert (train.num_documents, val.num_documents) == (2, 1)  # a positive fraction holds out at least one
    train, val = build(pattern, val_fraction=0.0)
    assert (train.num_documents, val.num_documents, len(val)) == (3, 0, 0)
    assert as_batch(val)["input_ids"].shape == (0, 16)
    assert list(eval_batches(val, batch_size=2, dp_rank=0, dp_size=2)) == []


# ---------------------------------------------------------------------------------------------------------
# Training batches


@pytest.fixture
def rows(build, tmp_path) -> PackedDataset:
    """A dataset of 23 rows whose first token tells them apart (row r starts with character r)."""
    texts = [ALPHABET[r] * 7 for r in range(23)]
    train, _ = build(write_corpus(tmp_path, texts), sequence_length=8)
    assert len(train) == 23
    return train


def row_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return [ALPHABET.index(CHARS[int(token)]) for token in batch["input_ids"][:, 0]]


def take(iterator, count: int) -> list:
    return [next(iterator) for _ in range(count)]


def test_global_batch_is_split_contiguously_and_independent_of_dp_size(rows):
    single = iterate_batches(rows, global_batch_size=4, dp_rank=0, dp_size=1, seed=7)
    global_batches = [row_ids(b) for b in take(single, 12)]
    for dp_size in (2, 4):
        per_rank = [
            take(iterate_batches(rows, global_batch_size=4, dp_rank=r, dp_size=dp_size, seed=7), 12)
            for r in range(dp_size)
        ]
        for step, expected in enumerate(global_batches):
            assert sum((row_ids(per_rank[r][step]) for r in range(dp_size)), []) == expected
            for r in range(dp_size):
                batch = per_rank[r][step]
                assert set(batch) == set(BATCH_KEYS)
                assert all(t.shape == (4 // dp_size, 8) and t.dtype == torch.int64 for t in batch.values())
                assert_same(batch, rows[torch.tensor(expected[r * 4 // dp_size : (r + 1) * 4 // dp_size])])


@pytest.mark.parametrize("num_steps", [1, 3, 5, 9, 200])
def test_training_rows_are_the_rows_the_steps_visit_in_order_of_first_visit(rows, num_steps):
    # Row r of this dataset is the one whose first token is character r, so row ids are dataset indices.
    visited = [row for batch in take(iterate_batches(rows, global_batch_size=4, dp_rank=0, dp_size=1, seed=7),
                                     num_steps) for row in row_ids(batch)]
    expected = list(dict.fromkeys(visited))
    assert training_rows(rows, global_batch_size=4, seed=7, num_steps=num_steps) == expected
    if num_steps == 200:  # epochs leave out other rows each time: in the end every row is visited
        assert sorted(expected) == list(range(23))
    with pytest.raises(ValueError, match="global_batch_size"):
        training_rows(rows, global_batch_size=24, seed=7, num_steps=1)


def test_epochs_permute_all_rows_with_seed_plus_epoch(rows):
    assert steps_per_epoch(rows, 4) == 5  # 23 rows: 5 steps of 4, 3 rows left out of each epoch

    def steps_of(seed, count):
        batches = iterate_batches(rows, global_batch_size=4, dp_rank=0, dp_size=1, seed=seed)
        return [row_ids(b) for b in take(batches, count)]

    steps = steps_of(7, 15)
    for epoch in range(3):
        visited = sum(steps[5 * epoch : 5 * epoch + 5], [])
        assert len(set(visited)) == 20  # no row twice within an epoch
        expected = torch.randperm(23, generator=torch.Generator().manual_seed(7 + epoch))[:20].tolist()
        assert visited == expected
    assert steps[:5] != steps[5:10]
    assert steps_of(8, 5) == steps[5:10]  # seed 8's first epoch is seed 7's second: epoch e uses seed + e


def test_resume_at_start_step_matches_skipping(rows):
    reference = take(iterate_batches(rows, global_batch_size=6, dp_rank=1, dp_size=3, seed=1), 14)
    for start_step in (0, 1, 3, 6, 11):
        resumed = iterate_batches(rows, global_batch_size=6, dp_rank=1, dp_size=3, seed=1, start_step=start_step)
        resumed = take(resumed, 3)
        for a, b in zip(resumed, reference[start_step:]):
            assert_same(a, b)


def test_split_micro_batches(rows):
    batch = next(iterate_batches(rows, global_batch_size=12, dp_rank=0, dp_size=2, seed=0))
    micro = split_micro_batches(batch, 3)
    assert [m["input_ids"].shape for m in micro] == [(2, 8)] * 3
    assert_same({key: torch.cat([m[key] for m in micro]) for key in BATCH_KEYS}, batch)
    with pytest.raises(ValueError, match="6 rows cannot be split into 4"):
        split_micro_batches(batch, 4)


def test_eval_batches_cover_once_and_pad_equally(rows):
    for dp_size, batch_size in ((1, 23), (1, 5), (2, 3), (4, 2), (3, 8)):
        per_rank = [
            list(eval_batches(rows, batch_size=batch_size, dp_rank=r, dp_size=dp_size)) for r in range(dp_size)
        ]
        steps = -(-23 // (batch_size * dp_size))
        assert [len(batches) for batches in per_rank] == [steps] * dp_size  # same collectives on every rank
        order, label_tokens = [], 0
        for step in range(steps):
            for r in range(dp_size):
                batch = per_rank[r][step]
                assert all(t.shape == (batch_size, 8) and t.dtype == torch.int64 for t in batch.values())
                real = batch["attention_mask"][:, 0] != 0
                order += row_ids({"input_ids": batch["input_ids"][real]})
                label_tokens += int((batch["labels"] != IGNORE_INDEX).sum())
                padding = {key: value[~real] for key, value in batch.items()}
                assert (padding["labels"] == IGNORE_INDEX).all() and (padding["attention_mask"] == 0).all()
                assert (padding["input_ids"] == PAD).all() and (padding["position_ids"] == 0).all()
        assert order == list(range(23))  # in order, nothing dropped, nothing twice
        assert label_tokens == int((as_batch(rows)["labels"] != IGNORE_INDEX).sum())
    labels = as_batch(rows)["labels"]
    next(eval_batches(rows, batch_size=2, dp_rank=0, dp_size=1))["labels"].fill_(0)  # a copy, not a view
    assert torch.equal(as_batch(rows)["labels"], labels)


def test_batching_errors(rows):
    def first(**kwargs):  # raises when called, before any batch is asked for
        return iterate_batches(rows, **{"dp_rank": 0, "dp_size": 2, "seed": 0, **kwargs})

    with pytest.raises(ValueError, match=r"global_batch_size \(5\) must be a positive multiple of dp_size \(2\)"):
        first(global_batch_size=5)
    with pytest.raises(ValueError, match=r"global_batch_size \(24\) exceeds the dataset's 23 packed rows"):
        first(global_batch_size=24)
    with pytest.raises(ValueError, match="dp_rank"):
        first(global_batch_size=4, dp_rank=2)
    with pytest.raises(ValueError, match="start_step"):
        first(global_batch_size=4, start_step=-1)
    with pytest.raises(ValueError, match="batch_size"):
        eval_batches(rows, batch_size=0, dp_rank=0, dp_size=1)


def test_determinism_end_to_end(build, corpus):
    _, pattern = corpus

    def run():
        train, val = build(pattern, val_fraction=0.25, seed=11)
        batches = take(iterate_batches(train, global_batch_size=4, dp_rank=1, dp_size=2, seed=11), 6)
        return batches + list(eval_batches(val, batch_size=3, dp_rank=0, dp_size=2))

    for a, b in zip(run(), run(), strict=True):
        assert_same(a, b)


# ---------------------------------------------------------------------------------------------------------
# Errors that name their cause


def test_reading_errors_name_the_pattern_file_line_and_key(build, tmp_path):
    (tmp_path / "ok.txt").write_text("fine")
    missing = str(tmp_path / "nothing" / "*.txt")
    with pytest.raises(FileNotFoundError, match="no file matches the data path " + re.escape(repr(missing))):
        build([str(tmp_path / "ok.txt"), missing])
    with pytest.raises(FileNotFoundError, match=r"a directory: use a pattern such as"):
        build(str(tmp_path))
    with pytest.raises(ValueError, match="paths is empty"):
        build([])

    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "blank" / "b.jsonl").write_text(json.dumps({"text": " \n"}) + "\n")
    with pytest.raises(ValueError, match=r"no non-empty document in the 2 file\(s\) matched by '.*blank/\*'"):
        build(str(tmp_path / "blank" / "*"))

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "one"}) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(bad))}:3: invalid JSON"):
        build(str(bad))
    bad.write_text(json.dumps({"text": "one"}) + "\n" + json.dumps(["a list"]) + "\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(bad))}:2: expected a JSON object per line, got list"):
        build(str(bad))
    bad.write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"content": "x", "id": 2}) + "\n")
    message = rf"{re.escape(str(bad))}:2: no text_key 'text' in the row \(its columns: 'content', 'id'\)"
    with pytest.raises(ValueError, match=message):
        build(str(bad))
    with pytest.raises(ValueError, match=rf"{re.escape(str(bad))}:1: no text_key 'content'"):
        build(str(bad), text_key="content")
    bad.write_text(json.dumps({"text": 3}) + "\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(bad))}:1: 'text' holds a int, not a string"):
        build(str(bad))
    bad.write_bytes(json.dumps({"text": "one"}).encode() + b"\n\xff\xfe\n")
    not_text = r"is not valid UTF-8 \(byte 0x[0-9a-f]{2} at offset \d+\): not a text file \(on_bad_file 'skip'"
    with pytest.raises(ValueError, match=rf"data file '{re.escape(str(bad))}' {not_text}"):
        build(str(bad))  # a run refuses a file that is not text, naming it
    with pytest.raises(ValueError, match=rf"{re.escape(str(bad))}:2: invalid JSON"):
        build(str(bad), on_bad_file="read")  # read anyway: what does not decode is replaced

    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9 au lait")
    with pytest.raises(ValueError, match=rf"data file '{re.escape(str(latin))}' {not_text}"):
        build(str(latin))
    train, _ = build(str(latin), on_bad_file="read")  # U+FFFD is <unk> here
    expected = TOKENIZER("caf", add_special_tokens=False)["input_ids"] + [TOKENIZER.unk_token_id]
    assert pieces(train)[0][2][:4] == expected


def test_split_texts_decodes_as_encoding_errors_says_naming_the_file_and_line(tmp_path):
    """`split_texts` (a corpus's documents as texts) decodes by any `bytes.decode` handler: 'strict' names the file
    (and line) it cannot decode."""
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(json.dumps({"text": "one"}).encode() + b"\n\xff\xfe\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(bad))}:2: line is not valid UTF-8"):
        split_texts(paths=[str(bad)], val_fraction=0.0, seed=0, encoding_errors="strict")
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9 au lait")
    message = rf"data file '{re.escape(str(latin))}' is not valid UTF-8.*encoding_errors='replace'"
    with pytest.raises(ValueError, match=message):
        split_texts(paths=[str(latin)], val_fraction=0.0, seed=0, encoding_errors="strict")
    assert split_texts(paths=[str(latin)], val_fraction=0.0, seed=0, encoding_errors="ignore") == (
        ["caf au lait"], [])
    assert split_texts(paths=[str(latin)], val_fraction=0.0, seed=0) == (["caf\ufffd au lait"], [])


def test_argument_errors(build, tmp_path):
    pattern = write_corpus(tmp_path, ["aa", "bb"])
    with pytest.raises(ValueError, match="sequence_length must be an integer >= 2, got 1"):
        build(pattern, sequence_length=1)
    for fraction in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=rf"val_fraction must be in \[0, 1\), got {fraction}"):
            build(pattern, val_fraction=fraction)
    with pytest.raises(ValueError, match="format must be one of"):
        build(pattern, format="csv")
    with pytest.raises(ValueError, match="max_documents must be >= 1"):
        build(pattern, max_documents=0)
    with pytest.raises(ValueError, match="max_document_chars must be >= 1"):
        build(pattern, max_document_chars=0)
    with pytest.raises(ValueError, match="unknown encoding_errors handler 'loose'"):
        check_arguments(16, 0.0, None, None, None, "loose")
    with pytest.raises(ValueError, match=r"val_fraction=0.8 of 2 document\(s\) leaves no document"):
        build(pattern, val_fraction=0.8)

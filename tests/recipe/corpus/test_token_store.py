"""The token store (every run's rows; `dataset.token_store`, else meshkd's cache directory): written once, read back
as each split's documents tokenized and cut into rows, rebuilt when a source or the tokenizer changes, refused
when damaged, written by one process of many."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from meshkd.recipe.corpus import data
from meshkd.recipe.corpus.documents import reading_arguments
from meshkd.recipe.corpus.rows import BATCH_KEYS
from meshkd.recipe.corpus.token_store import token_dtype
from meshkd.recipe.modeling.models import byte_tokenizer
from meshkd.recipe.records import prompt_reader
from meshkd.recipe.settings.config import DatasetConfig
from tests.recipe.corpus.test_chat_data import chat_rows, write_jsonl
from tests.tiny import write_corpus

TOKENIZER = byte_tokenizer()


def assert_same_rows(got, expected) -> None:
    """Two splits' rows are the same: every key of every row (indexed three ways), the counts and the padding."""
    assert (len(got), got.num_documents, got.num_tokens) == (len(expected), expected.num_documents,
                                                            expected.num_tokens)
    for index in (slice(0, len(expected)), torch.tensor([len(expected) - 1, 0, 1 % len(expected)]), 0):
        wanted, found = expected[index], got[index]
        assert set(found) == set(wanted)
        for key in wanted:  # the batch keys and the extra ones (a routed row's teacher)
            assert torch.equal(found[key], wanted[key]), key
    assert got.tokens_per_row() == expected.tokens_per_row()
    padding, wanted = got.padding(2), expected.padding(2)
    assert set(padding) == set(wanted) and all(torch.equal(padding[key], wanted[key]) for key in wanted)


def split_documents(tokenizer, arguments: dict) -> tuple[list[list[int]], list[list[int]]]:
    """Each split's documents (`reading_arguments`' reading of a `dataset` section) tokenized as a run tokenizes
    them, in corpus order: no special tokens, the EOS appended unless the document leaves it out."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return tuple([tokenizer(text, add_special_tokens=False)["input_ids"] + (eos if getattr(text, "eos", True) else [])
                  for text in texts] for texts in data.split_texts(**arguments))


def stored_pieces(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    """The tokens of every document (piece) of a batch of rows, row by row, left to right."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    return [ids[row][mask[row] == index].tolist()
            for row in range(len(ids)) for index in range(1, int(mask[row].max()) + 1)]


def row_pieces(documents: list[list[int]], length: int) -> list[list[int]]:
    """The documents cut into pieces of `length` tokens (the last of each shorter), in order."""
    return [document[start : start + length] for document in documents for start in range(0, len(document), length)]


def assert_rows_hold(splits, expected: tuple, length: int) -> None:
    """Each split's rows hold exactly its documents (`split_documents`) cut into row-sized pieces, each once."""
    for rows, documents in zip(splits, expected, strict=True):
        assert rows.num_documents == len(documents)
        assert sorted(stored_pieces(rows[:])) == sorted(row_pieces(documents, length))


def test_a_store_is_tokenized_once_and_packed_for_each_sequence_length(tmp_path, capfd):
    """Rows of one corpus at two sequence lengths: one store, tokenized once, packed twice; at each length each
    split's rows hold its documents, whole where they fit a row and cut into row-sized pieces where not."""
    dataset = DatasetConfig(paths=[write_corpus(tmp_path / "corpus")], val_fraction=0.2, seed=3,
                            token_store=str(tmp_path / "store"))
    expected = split_documents(TOKENIZER, reading_arguments(dataset))
    assert max(map(len, expected[0])) > 16  # some documents are cut at 16, none at 200
    for length in (16, 200):
        assert_rows_hold(data.build_run_datasets(TOKENIZER, dataset, sequence_length=length), expected, length)
    assert capfd.readouterr().err.count("tokenizing the corpus once") == 1
    (store,) = [path for path in (tmp_path / "store").iterdir() if path.is_dir()]
    assert len(list(store.glob("plan-*"))) == 2


@pytest.mark.parametrize("records", ["text", "chat"])
def test_worker_processes_tokenize_the_same_store(records, tmp_path):
    """Rows rendered and tokenized by two worker processes, in chunks: the rows of one process, in order."""
    if records == "text":
        dataset = DatasetConfig(paths=[write_corpus(tmp_path / "corpus")], val_fraction=0.2)
    else:
        rows = chat_rows(600)  # three chunks of 256 rows
        dataset = DatasetConfig(paths=[write_jsonl(tmp_path / "chat.jsonl", rows)], records="chat", val_fraction=0.1)
    one = dataclasses.replace(dataset, token_store=str(tmp_path / "one"))
    parallel = dataclasses.replace(dataset, token_store=str(tmp_path / "parallel"), tokenize_workers=2)
    for got, expected in zip(data.build_run_datasets(TOKENIZER, parallel, sequence_length=128),
                             data.build_run_datasets(TOKENIZER, one, sequence_length=128), strict=True):
        assert_same_rows(got, expected)


@pytest.mark.parametrize("workers", [1, 2])
def test_routed_rows_are_stored_with_their_teacher(workers, tmp_path):
    """Rows routed by `dataset.teacher_key`: each teacher's documents packed apart, each row marked with its
    teacher (ROUTE), the rows of the first teacher first; with tokenizing workers too; a name of no teacher
    refused naming the key."""
    from meshkd.core.teacher_ensemble import ROUTE
    from tests.recipe.teacher.test_teachers import routed_corpus

    corpus = routed_corpus(tmp_path / "routed")
    teachers = ["code", "prose"]
    dataset = DatasetConfig(paths=[corpus["both"]], teacher_key="teacher", val_fraction=0.2, seed=3)
    texts = data.split_texts(**reading_arguments(dataset, TOKENIZER, teachers))
    stored_dataset = dataclasses.replace(dataset, token_store=str(tmp_path / "store"), tokenize_workers=workers)
    for length in (16, 64):
        stored = data.build_run_datasets(TOKENIZER, stored_dataset, sequence_length=length, routes=teachers)
        for rows, documents in zip(stored, texts, strict=True):
            batch = rows[:]
            routes = batch[ROUTE][:, 0]
            assert routes.tolist() == sorted(routes.tolist()) and set(routes.tolist()) == {0, 1}  # code, then prose
            assert rows.padding(2)[ROUTE].tolist() == [[-1], [-1]]
            for index, teacher in enumerate(teachers):  # a teacher's rows hold its documents, and only those
                ids = [TOKENIZER(text, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id]
                       for text in documents if text.route == teacher]
                theirs = {key: value[routes == index] for key, value in batch.items()}
                assert sorted(stored_pieces(theirs)) == sorted(row_pieces(ids, length))
    with pytest.raises(ValueError, match=r"both\.jsonl:2: dataset\.teacher_key 'teacher' names the teacher 'prose', "
                                         r"which is none of the teachers \['code'\]"):
        data.build_run_datasets(TOKENIZER, dataclasses.replace(stored_dataset, token_store=str(tmp_path / "other")),
                                sequence_length=16, routes=["code"])


@pytest.mark.parametrize("records, workers", [("text", 1), ("chat", 1), ("chat", 2)])
def test_cross_tokenizer_rows_are_stored_with_both_sides_and_their_groups(records, workers, tmp_path, capfd):
    """`kd.cross_tokenizer` rows (the byte tokenizer beside a byte-level BPE with a template of its own): both
    tokenizations and the groups stored, the rows read back equal to those `AlignedPacking` makes of the split's
    documents (what preflight packs to measure the rows' fill), every key (each side's tokens and answer-only
    labels, the group columns), for both splits and two pairs of row lengths; a damaged group file refused
    naming it."""
    from meshkd.recipe.corpus.aligned_data import aligned_packing, row_fill
    from tests.recipe.corpus.test_cross_tokenizer_chat import MULTI_TURN, teacher_tokenizer

    teacher = teacher_tokenizer()
    if records == "text":
        dataset = DatasetConfig(paths=[write_corpus(tmp_path / "corpus")], val_fraction=0.2, seed=3)
    else:
        rows = [{"messages": MULTI_TURN}, *chat_rows(300 if workers > 1 else 30)]  # two chunks of 256 rows
        dataset = DatasetConfig(paths=[write_jsonl(tmp_path / "chat.jsonl", rows)], records="chat", val_fraction=0.1)
    rendering = None if records == "text" else teacher
    texts = data.split_texts(**reading_arguments(dataset, TOKENIZER, teacher_tokenizer=rendering))
    stored_dataset = dataclasses.replace(dataset, token_store=str(tmp_path / "store"), tokenize_workers=workers)
    for length, teacher_length in ((64, 24), (512, 256)):
        packing = aligned_packing(TOKENIZER, teacher, sequence_length=length, teacher_sequence_length=teacher_length,
                                  pack=True)
        stored = data.build_run_datasets(TOKENIZER, stored_dataset, sequence_length=length, pack_texts=packing)
        for got, expected in zip(stored, map(packing, texts), strict=True):
            assert type(got).__name__ == "StoredAlignedRows"
            assert_same_rows(got, expected)
            assert row_fill(got) == pytest.approx(row_fill(expected), rel=1e-12)
    assert capfd.readouterr().err.count("tokenizing the corpus once") == 1  # one store, packed twice
    (store,) = [path for path in (tmp_path / "store").iterdir() if path.is_dir()]
    groups = store / "groups.bin"
    damaged = bytearray(groups.read_bytes())
    damaged[8] ^= 0xFF
    groups.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=re.escape(str(groups)) + r": block 0 .* does not match its checksum"):
        data.build_run_datasets(TOKENIZER, stored_dataset, sequence_length=64,
                                pack_texts=dataclasses.replace(packing, sequence_length=64, teacher_sequence_length=32))


def test_with_no_data_key_the_store_is_kept_in_the_cache_directory_or_where_the_run_says(tmp_path, monkeypatch,
                                                                                           capfd):
    """No `dataset.token_store`: the rows are stored under $MESHKD_CACHE/token-stores and a second run reads them
    back; where that directory cannot be made, the run warns naming it and writes in this user's folder of the
    system's temporary directory instead."""
    dataset = DatasetConfig(paths=[write_corpus(tmp_path / "corpus")], val_fraction=0.2)
    monkeypatch.setenv("MESHKD_CACHE", str(tmp_path / "cache"))
    first = data.build_run_datasets(TOKENIZER, dataset, sequence_length=32)
    assert f"tokenizing the corpus once into {tmp_path / 'cache' / 'token-stores'}/" in capfd.readouterr().err
    assert_rows_hold(first, split_documents(TOKENIZER, reading_arguments(dataset)), 32)
    again = data.build_run_datasets(TOKENIZER, dataset, sequence_length=32)
    assert "tokenizing" not in capfd.readouterr().err
    for got, expected in zip(again, first, strict=True):
        assert type(got).__name__ == "StoredRows"
        assert_same_rows(got, expected)
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("MESHKD_CACHE", str(tmp_path / "a_file" / "cache"))  # under a file: not even root makes it
    fallback = Path(tempfile.gettempdir()) / f"meshkd-{os.getuid()}" / "token-stores"
    elsewhere = data.build_run_datasets(TOKENIZER, dataset, sequence_length=32)
    err = capfd.readouterr().err
    assert f"cannot write token stores under {tmp_path / 'a_file' / 'cache' / 'token-stores'} " in err
    assert f"writing them under {fallback} " in err
    assert elsewhere[0].store.directory.parent == fallback
    for got, expected in zip(elsewhere, again):
        assert_same_rows(got, expected)
    shutil.rmtree(elsewhere[0].store.directory)


def test_the_store_is_reused_and_rebuilt_when_a_source_or_the_tokenizer_changes(tmp_path, capfd):
    corpus = write_corpus(tmp_path / "corpus")
    dataset = DatasetConfig(paths=[corpus], val_fraction=0.2, token_store=str(tmp_path / "store"))

    def build(tokenizer=TOKENIZER):
        return data.build_run_datasets(tokenizer, dataset, sequence_length=32)

    first = build()
    assert "tokenizing the corpus once" in capfd.readouterr().err
    build()
    assert "tokenizing" not in capfd.readouterr().err  # read back, not tokenized again
    changed = tmp_path / "corpus" / "doc03.txt"
    changed.write_text(changed.read_text() + "# one more line\n")
    rebuilt = build()
    assert "(1 store(s) of other sources, tokenizer or settings there)" in capfd.readouterr().err
    assert sum(split.num_tokens for split in rebuilt) == sum(split.num_tokens for split in first) + 16
    assert_rows_hold(rebuilt, split_documents(TOKENIZER, reading_arguments(dataset)), 32)
    other = byte_tokenizer()
    other.add_tokens(["return"])
    build(other)
    assert "(2 store(s) of other sources" in capfd.readouterr().err


def test_damaged_and_half_written_stores_are_refused_naming_the_file(tmp_path):
    dataset = DatasetConfig(paths=[write_corpus(tmp_path / "corpus")], val_fraction=0.2,
                            token_store=str(tmp_path / "store"))
    data.build_run_datasets(TOKENIZER, dataset, sequence_length=32)
    (store,) = [path for path in (tmp_path / "store").iterdir() if path.is_dir()]
    tokens = store / "tokens.bin"
    original = tokens.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF
    tokens.write_bytes(bytes(damaged))
    train, _ = data.build_run_datasets(TOKENIZER, dataset, sequence_length=32)
    with pytest.raises(ValueError, match=re.escape(str(tokens)) + r": block 0 .* does not match its checksum"):
        train[0 : len(train)]
    tokens.write_bytes(original[:-10])
    with pytest.raises(ValueError, match=re.escape(str(tokens)) + r" holds \d+ bytes, its manifest says \d+"):
        data.build_run_datasets(TOKENIZER, dataset, sequence_length=32)
    # A store without its manifest (a writer killed before its rename leaves only a .tmp directory) is none:
    # it is written anew.
    (store / "manifest.json").unlink()
    os.rename(store, store.with_name(store.name + ".tmp-1"))
    train, _ = data.build_run_datasets(TOKENIZER, dataset, sequence_length=32)
    assert train.num_tokens > 0 and (store / "manifest.json").exists()


@pytest.mark.parametrize("name", ["lengths.npy", "row_starts.npy", "starts.npy", "offsets.npy"])
def test_a_damaged_packing_plan_file_is_refused_naming_it(name, tmp_path):
    """Each array of a split's packing plan (one flipped byte, a file gone, a file added) is refused naming it,
    never read silently; a plan written without checksums is computed again."""
    dataset = DatasetConfig(paths=[write_corpus(tmp_path / "corpus")], val_fraction=0.2,
                            token_store=str(tmp_path / "store"))
    expected, _ = data.build_run_datasets(TOKENIZER, dataset, sequence_length=32)
    expected = expected[0 : len(expected)]
    (plan,) = (tmp_path / "store").glob("*/plan-*")
    path = plan / "train" / name
    assert path.is_file(), sorted(p.name for p in path.parent.iterdir())
    original = path.read_bytes()
    damaged = bytearray(original)
    damaged[-1] ^= 0x01  # the last element's lowest byte
    path.write_bytes(bytes(damaged))
    refused = re.escape(str(path)) + r" does not match the plan's checksums .*remove .*plan-.* to rebuild it"
    with pytest.raises(ValueError, match=refused):
        data.build_run_datasets(TOKENIZER, dataset, sequence_length=32)
    path.unlink()
    with pytest.raises(ValueError, match=refused):
        data.build_run_datasets(TOKENIZER, dataset, sequence_length=32)
    path.write_bytes(original)
    (plan / "train" / "extra.npy").write_bytes(original)
    with pytest.raises(ValueError, match=re.escape(str(plan / "train" / "extra.npy"))):
        data.build_run_datasets(TOKENIZER, dataset, sequence_length=32)
    (plan / "train" / "extra.npy").unlink()
    (plan / "sha256.json").unlink()
    train, _ = data.build_run_datasets(TOKENIZER, dataset, sequence_length=32)
    got = train[0 : len(train)]
    assert (plan / "sha256.json").is_file() and all(torch.equal(got[key], expected[key]) for key in expected)


def test_the_smallest_token_type_that_holds_the_vocabulary():
    assert [token_dtype(size) for size in (256, 258, 65536, 65537, 2**32 + 1)] == [
        np.uint8, np.uint16, np.uint16, np.uint32, np.int64]


def _build_in_a_process(dataset: DatasetConfig, out: str) -> None:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        train, _ = data.build_run_datasets(byte_tokenizer(), dataset, sequence_length=32)
    torch.save({"rows": train[0 : len(train)], "log": err.getvalue()}, out)


def test_processes_starting_together_tokenize_once_and_read_the_same_rows(tmp_path):
    dataset = DatasetConfig(paths=[write_corpus(tmp_path / "corpus")], val_fraction=0.2,
                            token_store=str(tmp_path / "store"))
    context = multiprocessing.get_context("spawn")
    outs = [str(tmp_path / f"out{i}.pt") for i in range(3)]
    processes = [context.Process(target=_build_in_a_process, args=(dataset, out)) for out in outs]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    results = [torch.load(out) for out in outs]
    assert sum("tokenizing the corpus once" in result["log"] for result in results) == 1
    for result in results[1:]:
        for key in BATCH_KEYS:
            assert torch.equal(result["rows"][key], results[0]["rows"][key])
    assert not [path for path in Path(tmp_path / "store").iterdir() if ".tmp-" in path.name]


def _prompt_dataset(kind: str, tmp_path: Path) -> DatasetConfig:
    """Rows whose on-policy prompts are whole: text rows with a `prompt_key` column, chat rows, prompt /
    completion rows, and chat rows tokenized by two worker processes."""
    if kind == "text_prompt_key":
        lines = [{"prompt": f"def f{i}(x):\n    \"\"\"{'Return x. ' * (i % 4)}\"\"\"",
                  "text": f"def f{i}(x):\n    return x + {i}\n"} for i in range(30)]
        lines.insert(5, {"prompt": "   ", "text": "no prompt: skipped among the prompts"})
        return DatasetConfig(paths=[write_jsonl(tmp_path / "code.jsonl", lines)], prompt_key="prompt",
                             val_fraction=0.2, seed=3)
    if kind.startswith("chat"):
        from tests.recipe.corpus.test_cross_tokenizer_chat import MULTI_TURN
        from tests.recipe.corpus.test_cross_tokenizer_chat import chat_rows as short_chat_rows

        rows = [{"messages": MULTI_TURN}, *short_chat_rows(300 if kind == "chat_workers" else 30)]
        return DatasetConfig(paths=[write_jsonl(tmp_path / "chat.jsonl", rows)], records="chat", val_fraction=0.1,
                             tokenize_workers=2 if kind == "chat_workers" else 1)
    # A system message on every third row: the rendering of the prompt differs row by row.
    rows = [{"prompt": f"Q{i}: what is {i} + {i}?", "completion": f"{2 * i}", "system": "Be brief." * (i % 3 == 0)}
            for i in range(40)]
    return DatasetConfig(paths=[write_jsonl(tmp_path / "pairs.jsonl", rows)], records="prompt_completion",
                         system_key="system", val_fraction=0.1)


@pytest.mark.parametrize("kind", ["text_prompt_key", "chat", "chat_bpe", "chat_workers", "prompt_completion"])
def test_whole_prompts_are_stored_one_a_row_tokenized_from_their_own_text(kind, tmp_path, capfd):
    """Both splits' prompt sets hold each row's whole prompt, one a row in corpus order, tokenized from the
    prompt's own text: with a byte-level BPE and its own template too, whose prompt tokens need not be a prefix
    of the row's. The prompts are a store of their own beside the rows', and a prompt over the limit is
    refused."""
    from meshkd.recipe.student.on_policy import build_prompt_set
    from tests.recipe.corpus.test_cross_tokenizer_chat import teacher_tokenizer

    tokenizer = teacher_tokenizer() if kind == "chat_bpe" else TOKENIZER
    dataset = _prompt_dataset(kind, tmp_path)
    stored_dataset = dataclasses.replace(dataset, token_store=str(tmp_path / "store"))
    if dataset.records == "text":  # the prompts of text rows are the corpus of the prompt column
        arguments = reading_arguments(dataclasses.replace(dataset, text_key=dataset.prompt_key), tokenizer)
    else:  # those of chat rows, each row's text before its last answer
        arguments = reading_arguments(dataset, tokenizer)
        arguments["read_record"] = prompt_reader(arguments["read_record"])
    expected = split_documents(tokenizer, arguments)
    stored = build_prompt_set(tokenizer, stored_dataset, max_prompt_tokens=1024)
    what = "the corpus" if kind == "text_prompt_key" else "the on-policy prompts"
    assert capfd.readouterr().err.count(f"tokenizing {what} once") == 1
    for got, documents in zip(stored, expected, strict=True):
        assert type(got).__name__ == "StoredRows" and len(documents) > 0
        assert (len(got), got.num_documents) == (len(documents), len(documents))
        assert stored_pieces(got[:]) == documents
    # The rows' own store is another, and leaves the prompts' as they are.
    data.build_run_datasets(tokenizer, stored_dataset, sequence_length=256)
    stores = [path for path in (tmp_path / "store").iterdir() if path.is_dir()]
    assert sorted(json.loads((path / "manifest.json").read_text())["key"].get("prompts", False) for path in stores) == (
        [False, kind != "text_prompt_key"])
    for got, first in zip(build_prompt_set(tokenizer, stored_dataset, max_prompt_tokens=1024), stored, strict=True):
        assert_same_rows(got, first)
    assert capfd.readouterr().err.count("once into") == 1  # the rows' store; the prompts' read back
    longest = max(map(len, expected[0] + expected[1]))
    with pytest.raises(ValueError, match=r"prompt piece\(s\) beyond the limit of \d+ tokens"):
        build_prompt_set(tokenizer, stored_dataset, max_prompt_tokens=longest - 2)


def test_a_damaged_prompt_store_is_refused_naming_the_file(tmp_path):
    from meshkd.recipe.student.on_policy import build_prompt_set

    dataset = dataclasses.replace(_prompt_dataset("chat", tmp_path), token_store=str(tmp_path / "store"))
    build_prompt_set(TOKENIZER, dataset, max_prompt_tokens=1024)
    (store,) = [path for path in (tmp_path / "store").iterdir() if path.is_dir()]
    tokens = store / "tokens.bin"
    damaged = bytearray(tokens.read_bytes())
    damaged[len(damaged) // 3] ^= 0xFF
    tokens.write_bytes(bytes(damaged))
    train, val = build_prompt_set(TOKENIZER, dataset, max_prompt_tokens=1024)
    with pytest.raises(ValueError, match=re.escape(str(tokens)) + r": block 0 .* does not match its checksum"):
        train[0 : len(train)]
    offsets = store / "documents.bin"
    offsets.write_bytes(offsets.read_bytes()[:-8])
    with pytest.raises(ValueError, match=re.escape(str(offsets)) + r" holds \d+ bytes, its manifest says \d+"):
        build_prompt_set(TOKENIZER, dataset, max_prompt_tokens=1024)


def test_prepare_data_writes_the_stores_of_the_rows_and_of_the_on_policy_prompts(tmp_path, capsys):
    """`meshkd prepare-data` on an on-policy config of chat rows writes both stores; the run then tokenizes
    nothing (its rows and prompts are read back)."""
    import yaml

    from meshkd.commands import prepare_data_command
    from meshkd.recipe.settings.config_loading import config_from_dict
    from meshkd.recipe.student.step_data import run_datasets
    from tests.recipe.corpus.test_cross_tokenizer_chat import chat_rows as short_chat_rows
    from tests.tiny import base_config

    config = base_config(tmp_path)
    config["dataset"] = {"paths": [write_jsonl(tmp_path / "chat.jsonl", short_chat_rows(30))], "records": "chat",
                         "val_fraction": 0.1, "token_store": str(tmp_path / "store")}
    config["step_scheduler"]["sequence_length"] = 256
    config["kd"].update(mode="on_policy", generation={"max_new_tokens": 8})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert prepare_data_command(str(path), []) == 0
    captured = capsys.readouterr()
    assert re.search(r"store/\w+: on-policy prompts, training 27, validation 3\n", captured.out), captured.out
    assert captured.err.count("once into") == 2
    train, val, train_prompts, val_prompts = run_datasets(config_from_dict(config), TOKENIZER, None)
    assert (len(train_prompts), len(val_prompts)) == (27, 3) and "once into" not in capsys.readouterr().err

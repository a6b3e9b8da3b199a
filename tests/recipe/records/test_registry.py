"""The row-format registry (`meshkd.recipe.records`): what every registered format promises, and that a new one,
one class registered by name, reaches the config checks, the token store (rows and key) and the teacher cache's
key with no other change."""

import dataclasses
import json

import pytest

from meshkd.recipe.corpus import data
from meshkd.recipe.corpus.corpus_store import store_key
from meshkd.recipe.modeling.models import byte_tokenizer
from meshkd.recipe.records import FORMATS, Document, RowFormat, format_named, record_reader, register
from meshkd.recipe.records.base import RowReader
from meshkd.recipe.records.document import string_column
from meshkd.recipe.settings.config import ConfigError, DatasetConfig
from meshkd.recipe.settings.config_loading import config_from_dict
from meshkd.recipe.teacher.teacher_cache import cache_key
from tests.tiny import base_config, with_layout

TOKENIZER = byte_tokenizer()
ROWS = {"text": {"text": "plain words"},
        "chat": {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]},
        "prompt_completion": {"prompt": "Hi?", "completion": "Hello."}}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_reads_its_rows_and_names_real_keys(name):
    row_format = format_named(name)
    fields = {field.name for field in dataclasses.fields(DatasetConfig)}
    assert set(row_format.settings_keys) <= fields, row_format.settings_keys
    document = record_reader(DatasetConfig(records=name), TOKENIZER)(ROWS[name], "rows.jsonl:1")
    assert isinstance(document, Document) and document.strip()
    # A format that marks answers gives their spans and the prompt before them; one that does not, neither.
    assert (document.answers is not None and document.prompt_end is not None) == row_format.marks_answers
    if row_format.marks_answers:
        assert all(document[start:end].startswith("Hello.") for start, end in document.answers)


def test_unknown_formats_are_refused_naming_the_key(tmp_path):
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, None)
    with pytest.raises(ConfigError, match=r"dataset.records must be one of chat, prompt_completion, text, got 'csv'"):
        config_from_dict({**config, "dataset": {**config["dataset"], "records": "csv"}})
    with pytest.raises(ValueError, match="registered twice"):
        register(type("Again", (RowFormat,), {"name": "text"}))


def _cache_dataset_keys(config: dict) -> set[str]:
    config = config_from_dict(config)
    key = cache_key(config, config.teacher_named(), TOKENIZER, vocab_size=len(TOKENIZER))
    return {name for name in key if name.startswith(("dataset.", "model.tokenizer."))}


def test_the_teacher_caches_of_text_and_rendered_rows_keep_their_keys(tmp_path):
    """Caches written before the formats were a registry still match: the same keys come out."""
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, None)
    common = {f"dataset.{name}" for name in ("paths", "format", "text_key", "val_fraction", "seed", "max_documents",
                                             "max_document_chars", "packing")}
    assert _cache_dataset_keys(config) == common
    chat = {**config, "dataset": {**config["dataset"], "records": "chat"}}
    assert _cache_dataset_keys(chat) == common | {"model.tokenizer.chat_template"} | {
        f"dataset.{name}" for name in ("records", "train_on", "chat_template", "messages_key", "prompt_key",
                                       "completion_key", "system_key", "context_key")}


class CompletionsOnly(RowFormat):
    """A contributor's new format: rows whose completion column alone is the document, every token training."""

    name = "completions_only"
    settings_keys = ("completion_key",)

    def reader(self, dataset, tokenizer=None, tokenizer_key="model.tokenizer") -> RowReader:
        def read(record, where):
            text = string_column(record, dataset.completion_key, where, "completion_key")
            return Document.of(text) if text.strip() else None
        return read


@pytest.fixture
def completions_only():
    register(CompletionsOnly)
    yield FORMATS["completions_only"]
    del FORMATS["completions_only"]


def test_a_new_format_is_one_registered_class(tmp_path, completions_only):
    rows = [{"completion": f"answer number {index}", "reply": f"reply {index}"} for index in range(20)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, None)
    config["dataset"] = {"paths": [str(path)], "records": "completions_only", "val_fraction": 0.0}
    dataset = config_from_dict(config).dataset  # the config checks take the new value
    stored = dataclasses.replace(dataset, token_store=str(tmp_path / "store"))
    train, _ = data.build_run_datasets(TOKENIZER, stored, sequence_length=64, pack=False)
    texts = {TOKENIZER.decode(train[row]["input_ids"][0], skip_special_tokens=True) for row in range(len(train))}
    assert texts == {row["completion"] for row in rows}
    # Its key reaches the store's key and the teacher cache's: another column is another corpus.
    other = dataclasses.replace(stored, completion_key="reply")
    arguments = {"paths": stored.paths}
    assert store_key(TOKENIZER, stored, arguments) != store_key(TOKENIZER, other, arguments)
    assert "dataset.completion_key" in _cache_dataset_keys(config)
    reply, _ = data.build_run_datasets(TOKENIZER, other, sequence_length=64, pack=False)
    assert TOKENIZER.decode(reply[0]["input_ids"][0], skip_special_tokens=True).startswith("reply")
    with pytest.raises(ConfigError, match="must be one of chat, prompt_completion, text, completions_only"):
        config_from_dict({**config, "dataset": {**config["dataset"], "records": "completions_onl"}})

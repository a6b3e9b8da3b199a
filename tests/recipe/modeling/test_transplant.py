"""A student tokenizer of its own: a byte-level BPE trained on the text, embeddings transplanted as means."""

import pytest
import torch

from meshkd.recipe.corpus.data import build_run_datasets, split_texts
from meshkd.recipe.modeling.models import byte_tokenizer
from meshkd.recipe.modeling.transplant import train_byte_level_bpe, transplant_embeddings
from meshkd.recipe.settings.config import DatasetConfig
from tests.tiny import tiny_llama_model

TEXTS = ["def add(a, b):\n    return a + b\n", "the cat and the hat sat on the mat\n",
         "caf\u00e9 na\u00efve \u00fcber"] * 4


def test_a_trained_bpe_round_trips_text_and_merges_what_repeats():
    tokenizer = train_byte_level_bpe(TEXTS, 300)
    assert len(tokenizer) == 300 and tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token_id is not None
    ids = tokenizer(TEXTS[1], add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == TEXTS[1]
    assert len(ids) < len(TEXTS[1].encode())  # merges: fewer tokens than bytes
    assert train_byte_level_bpe(TEXTS, 300).get_vocab() == tokenizer.get_vocab()  # deterministic
    with pytest.raises(ValueError, match="at least 258"):
        train_byte_level_bpe(TEXTS, 100)


@pytest.mark.parametrize("tie", [True, False])
def test_each_new_row_is_the_mean_of_the_old_rows_of_its_bytes(tie):
    source = byte_tokenizer()  # one token per byte: a token's source ids are its bytes
    target = train_byte_level_bpe(TEXTS, 300)
    model = tiny_llama_model(vocab=len(source), tie=tie)
    old_input = model.get_input_embeddings().weight.detach().clone()
    old_output = model.get_output_embeddings().weight.detach().clone()
    sources = transplant_embeddings(model, source, target)
    new_input, new_output = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert new_input.shape == (300, old_input.shape[1]) and model.config.vocab_size == 300
    assert (new_output is new_input) == tie
    the = target.convert_tokens_to_ids("\u0120the")  # " the", a merged token
    assert sources[the] == list(b" the")
    torch.testing.assert_close(new_input[the], old_input[list(b" the")].mean(dim=0))
    torch.testing.assert_close(new_output[the], old_output[list(b" the")].mean(dim=0))
    # A token holding part of a character (the first byte of "\u00e9") reads that byte's row alone.
    partial = target.convert_tokens_to_ids("\u00c3")
    assert sources[partial] == [0xC3]
    # EOS with EOS; PAD with the source's PAD.
    assert sources[target.eos_token_id] == [source.eos_token_id]
    assert sources[target.pad_token_id] == [source.pad_token_id]
    assert model.config.eos_token_id == target.eos_token_id


def test_split_texts_returns_the_training_and_validation_documents_of_a_run(tmp_path):
    """What a tokenizer trained on the training split reads: the documents of a run's training rows, none of its
    validation rows'."""
    for i in range(10):
        (tmp_path / f"{i}.txt").write_text(f"document {i}\n")
    pattern = str(tmp_path / "*.txt")
    train, val = split_texts(paths=[pattern], val_fraction=0.2, seed=3)
    assert len(train) == 8 and len(val) == 2 and sorted(train + val) == sorted(f"document {i}\n" for i in range(10))
    assert split_texts(paths=[pattern], val_fraction=0.2, seed=3) == (train, val)
    tokenizer = byte_tokenizer()
    dataset = DatasetConfig(paths=[pattern], val_fraction=0.2, seed=3, packing=False,  # a document a row
                            token_store=str(tmp_path / "store"))
    for texts, rows in zip((train, val), build_run_datasets(tokenizer, dataset, sequence_length=64), strict=True):
        batch = rows[:]
        read = [tokenizer.decode(ids[mask > 0], skip_special_tokens=True)
                for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
        assert sorted(read) == sorted(texts)

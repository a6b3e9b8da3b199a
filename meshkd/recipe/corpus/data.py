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
  piece is a document of its own in its row. The tokens are kept on disk, once per corpus and tokenizer,
  and the rows read through memory maps (`build_run_datasets`, `meshkd.recipe.corpus.corpus_store`), so a
  rank's memory does not grow with the corpus.
- Labels are shifted when the rows are made, once: `labels[i]` is the target of position i, i.e. `input_ids[i + 1]` when
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

from meshkd.recipe.corpus.corpus_store import stored_datasets
from meshkd.recipe.corpus.documents import check_arguments, corpus_documents, validation_documents
from meshkd.recipe.corpus.rows import PackedDataset
from meshkd.recipe.records import Document

if TYPE_CHECKING:  # transformers costs seconds to import; only its type is needed here
    from transformers import PreTrainedTokenizerBase


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
    """A corpus's documents as (training texts, validation texts), split as a run splits them, before tokenizing:
    what a tokenizer trained on the training split alone reads (`documents.reading_arguments` gives a `dataset`
    section's arguments).

    Args:
        paths: file paths or glob patterns (`**` recurses). A `.jsonl` file holds one JSON object per line
            with the document under `text_key`; any other file is one plain-text document. Empty and
            whitespace-only documents are skipped.
        val_fraction: share of the documents held out for validation, in [0, 1). When positive, at least one
            document goes to each split.
        seed: seeds the validation split and, with `max_documents`, the file order.
        format: "text" or "jsonl" to read every file that way; None chooses by extension.
        max_documents: read at most this many documents, visiting the files in a seeded random order.
        max_document_chars: truncate every document to this many characters.
        encoding_errors: how bytes that are not UTF-8 are decoded (a `bytes.decode` handler); "strict" raises
            ValueError naming the file (and line).
        on_bad_file: a file that is not text (binary, or not valid UTF-8): "read" decodes it anyway (with
            `encoding_errors`), "error" raises ValueError naming it, "skip" leaves it out with a warning.
        route_key: JSONL field naming each document's teacher (`meshkd.recipe.records.Document.route`).
        read_record: turns each JSONL or `datasets` row into its document (`meshkd.recipe.records.record_reader`);
            None: `text_key` and `route_key`.
        hf_section: a `dataset.hf` section (`meshkd.recipe.corpus.hf_sources`) whose rows follow the files'.

    Raises:
        FileNotFoundError: a pattern matches no file.
        ValueError: an unreadable file or JSONL line (named with its line number), a JSONL object without
            `text_key`, a corpus with no non-empty document, or a split left with no document.
    """
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
    """A run's (train, validation) rows as a recipe's `dataset` section (`meshkd.recipe.settings.config.DatasetConfig`)
    says, packed as the module docstring describes; `text_key`
    and `pack` in place of the section's (on-policy prompts of text rows read another column, one per row);
    `prompts`: each chat or prompt / completion row's on-policy prompt in place of the row (`Document.prompt`);
    `routes`: the teachers' names rows routed by `dataset.teacher_key` give, packed teacher by teacher
    (`meshkd.recipe.corpus.routing`); `pack_texts` (`kd.cross_tokenizer`): chat and prompt / completion rows are
    rendered by its teacher tokenizer too, for the teacher's side of the rows.

    The rows are read from the corpus's token store (`meshkd.recipe.corpus.corpus_store`: under `dataset.token_store`,
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

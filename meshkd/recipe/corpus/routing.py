"""Rows routed to one of several teachers (`kd.combine: route`, `dataset.teacher_key`).

Each JSONL document names its teacher (`meshkd.recipe.records.Document.route`). A split's documents are
packed teacher by teacher, so a row holds one teacher's documents only, and every row carries its teacher's
index in `teachers` under `meshkd.core.teacher_ensemble.ROUTE` ([rows, 1]; -1 in padding rows). The teacher
ensemble then sends each teacher only its rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshkd.core.teacher_ensemble import ROUTE
from meshkd.recipe.corpus.rows import BATCH_KEYS, PackedDataset

PackTexts = Callable[[list[str]], PackedDataset]


def route_names(config) -> list[str] | None:
    """The names routed rows may give, in the teachers' order (a row's index in it is its `ROUTE`), or None
    when rows are not routed."""
    return [teacher.name for teacher in config.teachers] if config.dataset.teacher_key is not None else None


def routed_packing(pack_texts: PackTexts, names: list[str]) -> PackTexts:
    """`pack_texts` applied to each teacher's documents of a split apart, the rows put together in teacher order."""
    def pack(texts: list[str]) -> PackedDataset:
        groups: dict[str, list[str]] = {name: [] for name in names}
        for text in texts:
            if text.route not in groups:
                raise ValueError(f"dataset.teacher_key: a document names the teacher {text.route!r}, which is none "
                                 f"of the teachers {names}")
            groups[text.route].append(text)
        return concatenate([(index, pack_texts(group)) for index, group in enumerate(groups.values()) if group]
                           or [(-1, pack_texts([]))])
    return pack


def concatenate(parts: list[tuple[int, PackedDataset]]) -> PackedDataset:
    """The rows of every (teacher index, rows) part, in order, each marked with its teacher's index."""
    datasets = [dataset for _, dataset in parts]
    extra = {key: (torch.cat([dataset.extra[key][0] for dataset in datasets]), pad)
             for key, (_, pad) in datasets[0].extra.items()}
    extra[ROUTE] = (torch.cat([torch.full((len(dataset), 1), index, dtype=torch.int64) for index, dataset in parts]),
                    -1)
    return PackedDataset(**{key: torch.cat([getattr(dataset, key) for dataset in datasets]) for key in BATCH_KEYS},
                         pad_token_id=datasets[0].pad_token_id,
                         num_documents=sum(dataset.num_documents for dataset in datasets), extra=extra)

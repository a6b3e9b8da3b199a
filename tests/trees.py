"""Nested sample values with every leaf kind, and an exact equality check for them."""

import torch


def sample_batch(index: int) -> dict:
    """A nested batch with every leaf kind the transport carries; its values depend on `index`."""
    generator = torch.Generator().manual_seed(index)
    return {
        "input_ids": torch.randint(0, 100, (2, 5), generator=generator),
        "mask": torch.rand(2, 5, generator=generator) > 0.5,
        "bf16": torch.randn(3, generator=generator).to(torch.bfloat16),
        "f16": torch.randn(2, 2, generator=generator).half(),
        "f64": torch.randn(1, generator=generator).double(),
        "i32": torch.randint(-5, 5, (4,), generator=generator, dtype=torch.int32),
        "u8": torch.randint(0, 255, (3, 1), generator=generator, dtype=torch.uint8),
        "scalar": torch.tensor(3.5 + index),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(4, 6, generator=generator).t(),
        "nested": [(1, 2.5, "text", True, None), {"deep": torch.arange(index + 1), 7: "int key"}],
        "index": index,
    }


def assert_same_tree(actual, expected, path="value"):
    """Exact equality of nested values: container types, keys, tensor dtypes, shapes and values."""
    assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert torch.equal(actual.cpu(), expected.cpu()), f"{path}: values differ"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same_tree(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for position, (left, right) in enumerate(zip(actual, expected)):
            assert_same_tree(left, right, f"{path}[{position}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def packed(rows):
    """A split's rows read from the token store (`StoredRows`) as the tensors of a `PackedDataset`, to index by key."""
    from meshkd.recipe.corpus.rows import BATCH_KEYS, PackedDataset

    batch, padding = rows[:], rows.padding(1)
    extra = {key: (batch[key], int(padding[key].view(-1)[0])) for key in batch if key not in BATCH_KEYS}
    return PackedDataset(**{key: batch[key] for key in BATCH_KEYS}, pad_token_id=rows.pad_token_id,
                         num_documents=rows.num_documents, extra=extra)

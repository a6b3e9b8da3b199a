"""TeacherForward's encoding of one request, without a process group (the runner's logits given directly)."""

import torch

from meshkd.core.logits_codec import encode_teacher_rows
from meshkd.recipe.config import KDConfig
from meshkd.recipe.teacher_worker import TeacherForward
from tests.trees import assert_same_tree


def test_each_rows_tail_samples_are_seeded_by_that_rows_tokens():
    kd = KDConfig(logits_transport="topk", topk=4, topk_tail_samples=3, temperature=2.0)
    forward = TeacherForward(None, vocab_size=20, kd=kd, seed=7)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (3, 5), generator=generator)
    logits = torch.randn(3, 5, 20, generator=generator)
    encoded = forward.encode(logits, {"input_ids": ids}, "topk")
    seeds = [7 + int(row.sum()) for row in ids]
    assert_same_tree(encoded, encode_teacher_rows(logits, "topk", seeds=seeds, k=4, temperature=2.0, tail_samples=3))
    # A row's answer does not depend on the rows batched with it.
    alone = forward.encode(logits[1:2], {"input_ids": ids[1:2]}, "topk")
    assert_same_tree(alone, {key: value[1:2] if isinstance(value, torch.Tensor) else value
                             for key, value in encoded.items()})

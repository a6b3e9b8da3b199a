"""TeacherForward's encoding of one request, without a process group (the runner's logits given directly)."""

import torch

from meshkd.core.answers import LABEL_LOG_PROBS, label_log_probs
from meshkd.core.answers.topk import TopK
from meshkd.recipe.settings.config import KDConfig
from meshkd.recipe.teacher.teacher_worker import TeacherForward
from tests.trees import assert_same_tree


def test_each_rows_tail_samples_are_seeded_by_that_rows_tokens():
    kd = KDConfig(logits_transport="topk", topk=4, topk_tail_samples=3, temperature=2.0)
    forward = TeacherForward(None, vocab_size=20, kd=kd, seed=7)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (3, 5), generator=generator)
    logits = torch.randn(3, 5, 20, generator=generator)
    encoded = forward.encode(logits, {"input_ids": ids}, "topk")
    seeds = [7 + int(row.sum()) for row in ids]
    assert_same_tree(encoded, TopK.encode_rows(logits, seeds=seeds, k=4, temperature=2.0, tail_samples=3))
    # A row's answer does not depend on the rows batched with it.
    alone = forward.encode(logits[1:2], {"input_ids": ids[1:2]}, "topk")
    assert_same_tree(alone, {key: value[1:2] if isinstance(value, torch.Tensor) else value
                             for key, value in encoded.items()})


def test_an_evaluation_gets_the_encoding_and_the_labels_log_probabilities_in_one_answer():
    kd = KDConfig(logits_transport="topk", topk=4, topk_tail_samples=2, temperature=2.0)
    forward = TeacherForward(None, vocab_size=20, kd=kd, seed=7)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 20, (2, 5), generator=generator)
    labels = torch.randint(0, 20, (2, 5), generator=generator)
    labels[0, 4] = -100
    logits = torch.randn(2, 5, 20, generator=generator)
    batch = {"input_ids": ids, "labels": labels}
    for mode in ("full", "topk"):
        both = forward.encode(logits, batch, mode, with_label_log_probs=True)
        log_probs = both.pop(LABEL_LOG_PROBS)
        assert_same_tree(both, forward.encode(logits, batch, mode))
        # At temperature 1, whatever the encoding's: the teacher's loss on the labels.
        assert_same_tree(log_probs, label_log_probs(logits, labels)["log_probs"])

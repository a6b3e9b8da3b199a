"""A cross-tokenizer teacher's per-group answers (`meshkd.recipe.teacher.group_answers`) scored chunk by chunk
through the fused output layer equal the loss of whole logits and its gradients, whatever the chunks cut through
(groups across two, several or no chunk boundaries, one-token groups), for uld and gold (both directions), at a
temperature other than 1; and that the fused output layer scores them without a host sync, however many chunks it
cuts (`tests.device_syncs`), given the groups' layout read from the host rows."""

import pytest
import torch

from meshkd.core.answers import LossContext
from meshkd.core.fused_output import fused_output_loss
from meshkd.core.vocabulary_map import VocabularyMap
from meshkd.recipe.corpus.rows import GROUP_ENDS, TEACHER_POSITIONS, with_group_layout
from meshkd.recipe.settings.config import CrossTokenizerConfig, KDConfig
from meshkd.recipe.student.fused_head import FusedHead
from meshkd.recipe.teacher.group_answers import GROUPS, GroupDistributions, group_kd_loss

ROWS, LENGTH, WIDTH, VOCAB, TEACHER_VOCAB = 2, 13, 8, 11, 9


def grouped_batch(seed: int) -> dict:
    """Rows cut into consecutive groups of 1 to 5 student tokens (the last row's tail outside any group)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
    positions = torch.full((ROWS, LENGTH), -1)
    ends = torch.zeros((ROWS, LENGTH), dtype=torch.int64)
    for row in range(ROWS):
        column = 0
        while column < LENGTH - row * 2:  # the second row leaves its last columns out of KD
            size = int(torch.randint(1, 6, (1,), generator=generator))
            last = min(column + size, LENGTH - row * 2) - 1
            positions[row, column], ends[row, column] = column, last
            column = last + 1
    return {"input_ids": labels.roll(1, 1), "labels": labels, TEACHER_POSITIONS: positions, GROUP_ENDS: ends}


@pytest.mark.parametrize("loss, divergence", [("uld", "forward_kl"), ("gold", "forward_kl"), ("gold", "reverse_kl")])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
def test_the_groups_chunk_by_chunk_equal_whole_logits_in_value_and_gradients(loss, divergence, chunk_size):
    torch.manual_seed(chunk_size)
    batch = grouped_batch(seed=1)
    groups = int((batch[TEACHER_POSITIONS] >= 0).sum())
    teacher = torch.randn(groups, TEACHER_VOCAB).log_softmax(-1)
    kd = KDConfig(temperature=2.0, divergence=divergence, cross_tokenizer=CrossTokenizerConfig(loss=loss))
    pairs = VocabularyMap(VOCAB, TEACHER_VOCAB, torch.tensor([0, 1, 2, 5]), torch.tensor([3, 0, 1, 8]),
                          torch.tensor([0]), torch.tensor([3]), torch.tensor([1.0]), "test")
    context, norm = LossContext(kd, vocabulary_map=pairs), torch.tensor(17.0)
    hidden = torch.randn(ROWS, LENGTH, WIDTH, requires_grad=True)
    weight = torch.randn(VOCAB, WIDTH, requires_grad=True)

    whole = group_kd_loss(hidden @ weight.T, batch, teacher, kd, num_valid_tokens=norm, vocabulary_map=pairs)
    expected = torch.autograd.grad(whole, (hidden, weight))

    answer = GroupDistributions({"mode": GROUPS, "log_probs": teacher})
    with torch.no_grad():  # what the fused head's pass without gradients finds
        scaled = (hidden @ weight.T).reshape(-1, VOCAB) / kd.temperature
        labels = batch["labels"].reshape(-1)
        found = scaled.gather(-1, labels[:, None])[:, 0] - scaled.logsumexp(-1)
    answer.prepare_chunks(found, batch, context)
    fused = fused_output_loss(hidden, weight, lambda logits, tokens: answer.chunk_kd_loss(
        logits, tokens, batch, context, norm=norm)[0], chunk_size=chunk_size, reverse=True)
    assert float(fused.detach()) == pytest.approx(float(whole.detach()), rel=1e-5)
    for got, want in zip(torch.autograd.grad(fused, (hidden, weight)), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_group_whose_earlier_labels_are_no_tokens_is_refused():
    batch = grouped_batch(seed=1)
    first = int((batch[GROUP_ENDS][0] - torch.arange(LENGTH) >= 2).nonzero()[0])  # a group of 3 tokens or more
    batch["labels"][0, first + 1] = -100  # inside it, neither its first position (which KD counts) nor its last
    answer = GroupDistributions({"mode": GROUPS, "log_probs": torch.zeros(1, TEACHER_VOCAB)})
    kd = KDConfig(cross_tokenizer=CrossTokenizerConfig(loss="uld"))
    with pytest.raises(ValueError, match="a target inside a group .* is not a token id"):
        answer.prepare_chunks(torch.zeros(ROWS * LENGTH), batch, LossContext(kd))


def fused_loss_syncs(loss: str, chunk_size: int, *, host_rows: bool) -> int:
    """The syncs `FusedHead.loss` and its backward count on one micro-batch of `grouped_batch` (after one uncounted,
    which reads the vocabulary map), its `GroupLayout` given from the host rows (`with_group_layout`) or not."""
    from tests.device_syncs import DeviceSyncs

    torch.manual_seed(0)
    batch = grouped_batch(seed=1)
    groups = int((batch[TEACHER_POSITIONS] >= 0).sum())
    kd = KDConfig(temperature=2.0, chunk_size=chunk_size, cross_tokenizer=CrossTokenizerConfig(loss=loss))
    if host_rows:
        batch = with_group_layout(batch, {key: value.clone() for key, value in batch.items()},
                                  ignore_index=kd.ignore_index)
    pairs = VocabularyMap(VOCAB, TEACHER_VOCAB, torch.tensor([0, 1, 2, 5]), torch.tensor([3, 0, 1, 8]),
                          torch.tensor([0]), torch.tensor([3]), torch.tensor([1.0]), "test")
    context, norm = LossContext(kd, vocabulary_map=pairs), torch.tensor(17.0)
    head = FusedHead(torch.nn.Linear(WIDTH, VOCAB, bias=False), kd=kd, vocab_size=VOCAB)
    hidden = torch.randn(ROWS, LENGTH, WIDTH, requires_grad=True)
    answer = GroupDistributions({"mode": GROUPS, "log_probs": torch.randn(groups, TEACHER_VOCAB).log_softmax(-1)})
    head.loss(hidden, batch, answer, context, norm=norm)[0].backward()
    with DeviceSyncs() as counter:
        head.loss(hidden, batch, answer, context, norm=norm)[0].backward()
    return sum(counter.syncs().values())


@pytest.mark.parametrize("loss", ["uld", "gold"])
def test_the_fused_groups_make_no_host_sync_whatever_the_chunks(loss):
    # Chunks of 64, 7 and 1 tokens: one chunk, four, and one per position (26).
    assert [fused_loss_syncs(loss, chunk, host_rows=True) for chunk in (64, 7, 1)] == [0, 0, 0]
    # Without host rows (on-policy rows) the micro-batch is read back once, whatever the chunks.
    without = [fused_loss_syncs(loss, chunk, host_rows=False) for chunk in (64, 7, 1)]
    assert without[0] > 0 and without == [without[0]] * 3, without

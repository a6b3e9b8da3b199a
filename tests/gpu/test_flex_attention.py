"""Packed rows through FlexAttention block masks on cuda:0, against the 4D additive mask they replace.

`meshkd train` with `model.attn_implementation: flex_attention` (student and teacher) follows the curve of
the same run with sdpa and the additive mask, in fp32. One process, no process group, then measures what a
row's mask takes at S = 8192 on the device in both forms (docs/performance.md's figures), and checks a packed row
of that length through one forward and backward in both forms: the same loss, close gradients.
"""

import pytest
import torch

from meshkd.core.masks import layer_masks
from meshkd.core.packing import configure_packing
from tests.gpu import CUDA
from tests.gpu.test_train_nccl import losses, one_gpu, train
from tests.tiny import neat_layout, tiny_llama_model

pytestmark = CUDA

DEVICE = torch.device("cuda", 0)
LENGTH = 8192
DOCUMENTS = [[300, 1200, 57, 2048, 900, 3000, 600]]  # 8105 tokens, then padding


def test_a_flex_attention_run_follows_the_mask_paths_curve(tmp_path):
    runs = {}
    for name, attention in (("sdpa", "sdpa"), ("flex", "flex_attention")):
        config = one_gpu(tmp_path, name, dtype="float32")
        for section in (config["model"], config["teacher_model"]):
            # heads of 16: compiled FlexAttention on CUDA needs head_dim >= 16 (preflight refuses less)
            section.update(attn_implementation=attention, random_init={**section["random_init"], "head_dim": 16})
        runs[name] = train(config)
    assert len(runs["flex"]) == len(runs["sdpa"]) > 0
    torch.testing.assert_close(losses(runs["flex"]), losses(runs["sdpa"]), rtol=1e-3, atol=1e-4)


def mask_bytes(mask) -> int:
    """Bytes a mask holds on the device: an additive tensor's, or a BlockMask's tile tables."""
    if isinstance(mask, torch.Tensor):
        return mask.numel() * mask.element_size()
    return sum(t.numel() * t.element_size() for t in mask.as_tuple() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_mask_at_8192_tokens(dtype):
    documents, _ = neat_layout(DOCUMENTS, LENGTH)
    documents = documents.to(DEVICE)
    windows = {"full_attention": None}
    additive = layer_masks(documents, windows, dtype=dtype)
    layer_masks(documents, windows, dtype=dtype, block=True)  # the first build compiles the builder (63 MB seen)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    block = layer_masks(documents, windows, dtype=dtype, block=True)
    torch.cuda.synchronize()
    building = torch.cuda.max_memory_allocated() - base
    print(f"\nS={LENGTH} {dtype}: additive {mask_bytes(additive)} B, block mask {mask_bytes(block)} B "
          f"(peak while building {building} B), sparsity {block.sparsity():.1f}%")
    assert mask_bytes(additive) == LENGTH * LENGTH * dtype.itemsize
    assert mask_bytes(block) < mask_bytes(additive) / 1000
    assert building < mask_bytes(additive) / 10  # built tile by tile, never the dense mask


def test_a_packed_row_of_8192_tokens_trains_alike_in_both_forms():
    documents, positions = neat_layout(DOCUMENTS, LENGTH)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 262, documents.shape, generator=generator)
    batch = {"input_ids": input_ids, "attention_mask": documents, "position_ids": positions,
             "labels": torch.where(documents == 0, -100, input_ids)}
    batch = {key: value.to(DEVICE) for key, value in batch.items()}
    results = []
    for attention in ("sdpa", "flex_attention"):
        model = configure_packing(tiny_llama_model(vocab=262, layers=2, seed=1, attn=attention, head_dim=16,
                                                   max_positions=LENGTH).to(DEVICE).train())
        loss = model(**batch).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (masked_loss, masked_grads), (flex_loss, flex_grads) = results
    torch.testing.assert_close(flex_loss, masked_loss, rtol=1e-4, atol=1e-5)
    for flex_grad, masked_grad in zip(flex_grads, masked_grads, strict=True):
        torch.testing.assert_close(flex_grad, masked_grad, rtol=1e-3, atol=1e-5)

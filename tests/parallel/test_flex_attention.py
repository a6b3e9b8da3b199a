"""Models loaded with flex_attention take NEAT masks as FlexAttention BlockMasks, on one 2-rank gloo world.

FlexAttention runs forward only on the CPU (it has no backward there), so these checks run forward passes
against the same model with sdpa and the 4D additive mask: the packing hook of a one-process model, and
`TeacherRunner` under cp 2 (the block mask's tiles in the gathered key order), pp 2 and tp 2. The training
curve of a flex student against the mask path is a GPU-suite test (tests/gpu/test_flex_attention.py).
transformers compiles flex attention once per process and shape, which dominates this module's time, so
one small world serves every check.
"""

from __future__ import annotations

import copy

import torch

from meshkd.core.packing import configure_packing
from meshkd.parallel.teacher_runner import TeacherRunner
from tests.tiny import neat_layout, tiny_llama_model
from tests.world import layout_setups, world_test

WORLD = 2
VOCAB = 67
LOGITS_ATOL = 1e-4


def flex_and_sdpa_llamas(seed: int = 3) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model loaded with flex_attention, the same weights with sdpa)."""
    flex = tiny_llama_model(vocab=VOCAB, layers=2, seed=seed, attn="flex_attention")
    sdpa = tiny_llama_model(vocab=VOCAB, layers=2, seed=seed)
    sdpa.load_state_dict(flex.state_dict())
    return flex.eval(), sdpa.eval()


def packed_batch(document_lengths: list[list[int]], length: int, *, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    mask, positions = neat_layout(document_lengths, length)
    input_ids = torch.randint(0, VOCAB, mask.shape, generator=generator)
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions}


# 21 tokens: cp 2 pads to 24; both rows end in padding.
PACKED = packed_batch([[5, 4, 7], [9, 6, 1]], 21, seed=2)


def reference_logits(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    reference = configure_packing(copy.deepcopy(model))
    with torch.no_grad():
        return reference(**batch).logits


def attention_masks_seen(model: torch.nn.Module) -> list:
    """The attention_mask each decoder layer receives from now on, appended to the returned list."""
    seen: list = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("attention_mask")),
                                        with_kwargs=True)
    return seen


def check_packing_hook_hands_flex_a_block_mask():
    from torch.nn.attention.flex_attention import BlockMask

    flex, sdpa = flex_and_sdpa_llamas()
    configure_packing(flex)
    seen = attention_masks_seen(flex)
    with torch.no_grad():
        logits = flex(**PACKED).logits
    assert seen and all(isinstance(mask, BlockMask) for mask in seen), [type(mask) for mask in seen]
    torch.testing.assert_close(logits, reference_logits(sdpa, PACKED), atol=LOGITS_ATOL, rtol=0)


def run_teacher(section: dict) -> None:
    from torch.nn.attention.flex_attention import BlockMask

    setup = layout_setups({"distributed": section}, WORLD).student
    flex, sdpa = flex_and_sdpa_llamas()
    expected = reference_logits(sdpa, PACKED)
    runner = TeacherRunner(flex, setup, device="cpu")
    seen = attention_masks_seen(runner.model)
    logits = runner.logits(PACKED if runner.is_first else None)
    assert all(isinstance(mask, BlockMask) for mask in seen), [type(mask) for mask in seen]
    if runner.is_last:
        torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0)
    else:
        assert logits is None


def check_teacher_cp2():
    run_teacher({"cp_size": 2})


def check_teacher_pp2():
    run_teacher({"pp_size": 2})


def check_teacher_tp2():
    run_teacher({"tp_size": 2})


CHECKS = [check_packing_hook_hands_flex_a_block_mask, check_teacher_cp2, check_teacher_pp2, check_teacher_tp2]
# A rank waits in a collective while its peer compiles flex attention for a new shape.
test_flex_attention = world_test(WORLD, CHECKS, timeout_s=300.0, deadline_s=900.0)

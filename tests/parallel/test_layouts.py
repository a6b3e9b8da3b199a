"""Student and teacher layouts (meshkd.parallel) on one 4-rank gloo world, against a single-process reference.

Every check builds the parallel model and an identical reference (same seed) on every rank, runs both,
and compares: student logits, gradients and one optimizer step under TP + FSDP2, HSDP and DDP; the
exported full state dict; teacher logits under TP, CP (plain and NEAT-packed rows), PP (sequence length
changing between calls) and their combinations.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshkd.core.loss import cross_entropy_loss
from meshkd.core.packing import configure_packing
from meshkd.parallel.context_parallel import CP_ATTENTION
from meshkd.parallel.data_parallel import gather_full_state_dict, parallelize_student
from meshkd.parallel.stages import stage_layers
from meshkd.parallel.teacher_runner import TeacherRunner
from tests.tiny import neat_layout, tiny_llama_model
from tests.world import layout_setups, world_test

WORLD = 4
VOCAB = 67  # odd, so the vocab splits unevenly across tp ranks
LOGITS_ATOL = 1e-5
GRAD_ATOL = 1e-5


def tiny_llama(*, seed: int = 0, tie: bool = False) -> torch.nn.Module:
    return tiny_llama_model(vocab=VOCAB, layers=4, seed=seed, tie=tie)


def setup_for(section: dict):
    return layout_setups({"distributed": section}, WORLD).student


def plain_batch(rows: int, length: int, *, seed: int = 1) -> dict:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (rows, length), generator=generator)
    labels = torch.randint(0, VOCAB, (rows, length), generator=generator)
    labels[:, -2:] = -100
    return {"input_ids": input_ids, "labels": labels}


def packed_batch(document_lengths: list[list[int]], length: int, *, seed: int = 2) -> dict:
    """NEAT rows (`neat_layout`) of `plain_batch` tokens and labels."""
    batch = plain_batch(len(document_lengths), length, seed=seed)
    mask, positions = neat_layout(document_lengths, length)
    batch.update(attention_mask=mask, position_ids=positions)
    return batch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    if isinstance(actual, DTensor):
        actual = actual.full_tensor()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert error <= atol, f"{what}: max abs error {error:.3g} > {atol}"


# ---------------------------------------------------------------------------------------------------------
# Student


def run_student_step(section: dict, *, tie: bool = False) -> None:
    """One forward/backward/SGD step of the parallel student vs the reference on the global batch."""
    setup = setup_for(section)
    reference = tiny_llama(tie=tie)
    model = parallelize_student(tiny_llama(tie=tie), setup)
    batch = plain_batch(4, 10)
    num_valid = int((batch["labels"] != -100).sum())
    # Each dp rank takes its rows of the global batch; tp ranks of one dp rank share them.
    mesh = setup.device_mesh
    dp_rank = mesh.get_local_rank("dp_replicate") * setup.dp_shard_size + mesh.get_local_rank("dp_shard")
    dp_size = setup.dp_size
    rows = slice(dp_rank * 4 // dp_size, (dp_rank + 1) * 4 // dp_size)

    ref_logits = reference(input_ids=batch["input_ids"]).logits
    ref_loss = cross_entropy_loss(ref_logits, batch["labels"], num_valid_tokens=num_valid)
    ref_loss.backward()

    logits = model(input_ids=batch["input_ids"][rows]).logits
    if setup.tp_size > 1:
        assert isinstance(logits, DTensor) and logits.placements[0].is_shard(logits.ndim - 1)
    assert_close(logits, ref_logits[rows].detach(), LOGITS_ATOL, "student logits")
    # dp averages gradients, so each rank's share of the global sum is scaled by dp_size.
    loss = cross_entropy_loss(logits, batch["labels"][rows], num_valid_tokens=num_valid) * dp_size
    loss.backward()

    inner = model.module if hasattr(model, "module") else model
    ref_params = dict(reference.named_parameters())
    for name, param in inner.named_parameters():
        assert_close(param.grad, ref_params[name].grad, GRAD_ATOL, f"grad of {name}")

    for module in (reference, model):
        # SGD: an update linear in the gradient, so the step inherits the gradients' tolerance (Adam's
        # first step divides by |grad| and amplifies rounding on near-zero gradients).
        optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
        optimizer.step()
    for name, param in inner.named_parameters():
        assert_close(param.detach(), ref_params[name].detach(), GRAD_ATOL, f"{name} after one step")


def check_student_tp2_fsdp2():
    run_student_step({"tp_size": 2})


def check_student_tp2_fsdp2_tied_embeddings():
    run_student_step({"tp_size": 2}, tie=True)


def check_student_hsdp():
    run_student_step({"dp_size": 4, "dp_replicate_size": 2})


def check_student_tp2_hsdp():
    run_student_step({"dp_size": 2, "dp_replicate_size": 2, "tp_size": 2})


def check_student_ddp():
    run_student_step({"strategy": "ddp"})
    model = parallelize_student(tiny_llama(), setup_for({"strategy": "ddp"}))
    expected = tiny_llama().state_dict()
    state = gather_full_state_dict(model)  # HF names, without DDP's "module." prefix
    assert sorted(state) == sorted(expected)
    assert all(torch.equal(state[key], expected[key]) for key in expected)


def check_gather_full_state_dict():
    setup = setup_for({"tp_size": 2})
    model = parallelize_student(tiny_llama(), setup)
    expected = tiny_llama().state_dict()
    state = gather_full_state_dict(model)
    assert sorted(state) == sorted(expected)
    for key, value in state.items():
        assert not isinstance(value, DTensor) and value.device.type == "cpu"
        assert torch.equal(value, expected[key]), key
    state = gather_full_state_dict(model, rank0_only=True)
    assert (len(state) == len(expected)) if dist.get_rank() == 0 else not state


def check_rejects_unsupported_layouts():
    with pytest.raises(ValueError, match="cp_size"):
        parallelize_student(tiny_llama(), setup_for({"cp_size": 2}))
    # 2 kv heads cannot be split over 4 tp ranks; every rank raises before any collective.
    with pytest.raises(ValueError, match="num_key_value_heads"):
        TeacherRunner(tiny_llama(), setup_for({"tp_size": 4}), device="cpu")


# ---------------------------------------------------------------------------------------------------------
# Teacher


def reference_logits(batch: dict) -> torch.Tensor:
    reference = tiny_llama(seed=3).eval()
    if "attention_mask" in batch:
        configure_packing(reference)
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        return reference(**inputs).logits


def run_teacher(section: dict, batches: list[dict]) -> None:
    """Teacher logits for successive batches equal the reference's on the last stage, None elsewhere."""
    setup = setup_for(section)
    runner = TeacherRunner(tiny_llama(seed=3), setup, device="cpu")
    if setup.cp_size > 1:
        # The gathered-K/V attention is selected on this instance only.
        assert runner.model.config._attn_implementation == CP_ATTENTION
        assert tiny_llama().config._attn_implementation == "sdpa"
    for batch in batches:
        logits = runner.logits(batch if runner.is_first else None)
        if runner.is_last:
            assert_close(logits, reference_logits(batch), LOGITS_ATOL, f"teacher logits {section}")
        else:
            assert logits is None


PLAIN = plain_batch(2, 13)  # 13 tokens: not a multiple of 2 * cp, so CP pads
PACKED = packed_batch([[5, 4, 3], [7, 6]], 14)
PACKED_LONGER = packed_batch([[9, 2, 6], [3, 11, 2]], 19)


def check_teacher_tp2():
    run_teacher({"tp_size": 2}, [PLAIN, PACKED])


def check_teacher_cp2():
    run_teacher({"cp_size": 2}, [PLAIN, PACKED, PACKED_LONGER])


def check_teacher_cp2_tp2():
    run_teacher({"cp_size": 2, "tp_size": 2}, [PACKED, PLAIN])


def check_teacher_cp4():
    run_teacher({"cp_size": 4}, [PACKED_LONGER])


def check_teacher_pp2():
    run_teacher({"pp_size": 2}, [PACKED, PACKED_LONGER, PLAIN])


def check_teacher_pp2_tp2():
    run_teacher({"pp_size": 2, "tp_size": 2}, [PACKED_LONGER, PACKED])


def check_teacher_pp2_cp2():
    run_teacher({"pp_size": 2, "cp_size": 2}, [PACKED, PACKED_LONGER])


def check_teacher_pp4_tied_embeddings():
    # One layer per stage; the tied embedding/lm_head weight lives on the first and on the last stage.
    setup = setup_for({"pp_size": 4})
    model = tiny_llama(seed=3, tie=True)
    reference = configure_packing(copy.deepcopy(model).eval())
    runner = TeacherRunner(model, setup, device="cpu")
    for batch in (PACKED, PACKED_LONGER):
        logits = runner.logits(batch)
        if runner.is_last:
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
            with torch.no_grad():
                expected = reference(**inputs).logits
            assert_close(logits, expected, LOGITS_ATOL, "pp4 tied")


def check_teacher_tp2_tied_embeddings():
    setup = setup_for({"tp_size": 2})
    model = tiny_llama(seed=3, tie=True)
    reference = copy.deepcopy(model).eval()
    runner = TeacherRunner(model, setup, device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        expected = reference(input_ids=PLAIN["input_ids"]).logits
    assert_close(runner.logits(PLAIN), expected, LOGITS_ATOL, "tp2 tied")


def check_teacher_first_stage_error_reaches_later_stages():
    setup = setup_for({"pp_size": 2})
    runner = TeacherRunner(tiny_llama(seed=3), setup, device="cpu")
    with pytest.raises((ValueError, RuntimeError)):
        runner.logits(None)
    # The pipeline stays usable after a failed batch.
    logits = runner.logits(PACKED)
    if runner.is_last:
        assert_close(logits, reference_logits(PACKED), LOGITS_ATOL, "after error")


CHECKS = [
    check_student_tp2_fsdp2,
    check_student_tp2_fsdp2_tied_embeddings,
    check_student_hsdp,
    check_student_tp2_hsdp,
    check_student_ddp,
    check_gather_full_state_dict,
    check_rejects_unsupported_layouts,
    check_teacher_tp2,
    check_teacher_cp2,
    check_teacher_cp2_tp2,
    check_teacher_cp4,
    check_teacher_pp2,
    check_teacher_pp2_tp2,
    check_teacher_pp2_cp2,
    check_teacher_pp4_tied_embeddings,
    check_teacher_tp2_tied_embeddings,
    check_teacher_first_stage_error_reaches_later_stages,
]

test_parallel_world = world_test(WORLD, CHECKS, timeout_s=60.0, deadline_s=300.0)


# ---------------------------------------------------------------------------------------------------------
# Pure functions


def test_stage_layers_are_contiguous_and_cover_all_layers():
    for num_layers, pp_size in ((4, 2), (5, 2), (7, 3), (3, 3)):
        stages = [stage_layers(num_layers, pp_size, rank) for rank in range(pp_size)]
        assert [i for stage in stages for i in stage] == list(range(num_layers))
        assert max(map(len, stages)) - min(map(len, stages)) <= 1

"""Student context parallelism on one 4-rank gloo world, against a single-process reference.

Every check builds the context-parallel student and an identical packed reference (same seed) on every
rank, feeds the student its head-tail share of a NEAT-packed batch (several documents and padding, a
length that is not a multiple of 2 * cp) and compares: local logits with the matching positions of the
reference's, the KD + CE loss summed over cp and dp with the reference loss, every gradient, and the
parameters after one SGD step, then the exported state dict. Layouts: cp2 x dp_shard2, cp4 (tied
embeddings), cp2 x tp2, cp2 x HSDP, and cp2 on a student mesh beside a separate teacher mesh.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshkd.core.logits import cp_shard, cp_unshard
from meshkd.core.loss import cross_entropy_loss, kd_loss
from meshkd.core.packing import configure_packing
from meshkd.core.topology import create_kd_distributed_setups
from meshkd.parallel.context_parallel import (
    CP_ATTENTION,
    StudentShard,
    _shard_batch,
    flatten_student_cp_axes,
    shard_student_batch,
    shard_teacher_logits,
)
from meshkd.parallel.data_parallel import gather_full_state_dict, parallelize_student, student_loss_scale
from tests.tiny import full, packed_llama_batch, tiny_llama_model
from tests.world import layout_setups, world_test

WORLD = 4
VOCAB = 67  # odd, so the vocab splits unevenly across tp ranks
TEMPERATURE = 2.0
LOGITS_ATOL = 1e-5
LOSS_ATOL = 1e-5
GRAD_ATOL = 1e-5


def tiny_llama(*, seed: int = 0, tie: bool = False) -> torch.nn.Module:
    return tiny_llama_model(vocab=VOCAB, layers=2, seed=seed, tie=tie)


# 19 tokens: not a multiple of 2 * cp for cp 2 or 4, so the student pads; every row ends in padding.
BATCH = packed_llama_batch([[5, 4, 7], [9, 6], [3, 3, 3, 3, 3], [17]], 19, vocab=VOCAB, seed=2)
TEACHER_LOGITS = 3 * torch.randn(4, 19, VOCAB, generator=torch.Generator().manual_seed(5))
MODEL_INPUTS = ("input_ids", "position_ids", "attention_mask")


def setup_for(section: dict):
    return layout_setups({"distributed": section}, WORLD).student


def max_error(actual: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    actual = full(actual)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    return (actual - expected).abs().max().item() if actual.numel() else 0.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> float:
    error = max_error(actual, expected, what)
    assert error <= atol, f"{what}: max abs error {error:.3g} > {atol}"
    return error


def loss_of(logits: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, num_valid: int) -> torch.Tensor:
    kd = kd_loss(logits, teacher, labels, temperature=TEMPERATURE, num_valid_tokens=num_valid)
    return 0.5 * kd + 0.5 * cross_entropy_loss(logits, labels, num_valid_tokens=num_valid)


def run_student_cp(section: dict, *, tie: bool = False, setup=None) -> None:
    """Forward, loss, backward and one SGD step of the cp student vs the reference on the global batch."""
    setup = setup or setup_for(section)
    mesh = setup.device_mesh
    reference = configure_packing(tiny_llama(tie=tie))
    model = parallelize_student(configure_packing(tiny_llama(tie=tie)), setup)
    assert model.config._attn_implementation == CP_ATTENTION
    num_valid = int((BATCH["labels"] != -100).sum())

    ref_logits = reference(**{key: BATCH[key] for key in MODEL_INPUTS}).logits
    ref_loss = loss_of(ref_logits, TEACHER_LOGITS, BATCH["labels"], num_valid)
    ref_loss.backward()

    # Each dp rank takes its rows of the global batch; the cp (and tp) ranks of one dp rank share them.
    dp_rank = mesh.get_local_rank("dp_replicate") * setup.dp_shard_size + mesh.get_local_rank("dp_shard")
    rows = slice(dp_rank * 4 // setup.dp_size, (dp_rank + 1) * 4 // setup.dp_size)
    local, info = shard_student_batch({key: value[rows] for key, value in BATCH.items()}, setup)
    assert info.padded_length % (2 * setup.cp_size) == 0 and info.padded_length > info.sequence_length
    assert local["input_ids"].shape[1] == info.padded_length // setup.cp_size
    logits = model(**{key: local[key] for key in MODEL_INPUTS}).logits

    # (a) local logits are the reference's at this rank's global positions (padding positions excluded).
    positions = info.global_positions()
    keep = positions < info.sequence_length
    errors = {"logits": assert_close(full(logits)[:, keep], ref_logits[rows][:, positions[keep]].detach(),
                                     LOGITS_ATOL, "local logits")}  # fmt: skip
    assert torch.isfinite(full(logits)).all()

    # (b) the loss of this rank's tokens, summed over cp and dp, is the reference loss.
    loss = loss_of(logits, shard_teacher_logits(TEACHER_LOGITS[rows], setup), local["labels"], num_valid)
    total = loss.detach().clone()
    with torch.no_grad():
        for axis in ("dp", "cp"):
            dist.all_reduce(total, group=mesh.get_group(axis) if axis == "cp" else setup.dp_mesh.get_group())
    errors["loss"] = assert_close(total, ref_loss.detach(), LOSS_ATOL, "loss summed over cp and dp")

    # (c) FSDP2 averages over dp * cp ranks; the scale turns that into the sum the normalization asks for.
    assert student_loss_scale(setup) == setup.dp_size * setup.cp_size
    (loss * student_loss_scale(setup)).backward()
    ref_params = dict(reference.named_parameters())
    errors["grad"] = max(
        assert_close(param.grad, ref_params[name].grad, GRAD_ATOL, f"grad of {name}")
        for name, param in model.named_parameters()
    )

    # The recipe's gradient norm sees the dp_shard x cp sharded gradients as the reference's.
    from meshkd.parallel.data_parallel import clip_grad_norm

    ref_norm = torch.nn.utils.get_total_norm([param.grad for param in reference.parameters()])
    errors["grad norm"] = abs(float(clip_grad_norm(model.parameters(), None)) - float(ref_norm))
    assert errors["grad norm"] <= GRAD_ATOL, f"gradient norm differs by {errors['grad norm']:.3g}"

    # (d) SGD is linear in the gradient, so one step inherits the gradients' tolerance.
    for module in (reference, model):
        torch.optim.SGD(module.parameters(), lr=0.5).step()
    errors["step"] = max(
        assert_close(param.detach(), ref_params[name].detach(), GRAD_ATOL, f"{name} after one step")
        for name, param in model.named_parameters()
    )

    # A second forward after the step still matches (the mask hook and gathers are reusable).
    with torch.no_grad():
        logits = model(**{key: local[key] for key in MODEL_INPUTS}).logits
        ref_logits = reference(**{key: BATCH[key] for key in MODEL_INPUTS}).logits
    errors["no_grad logits"] = assert_close(
        full(logits)[:, keep], ref_logits[rows][:, positions[keep]], LOGITS_ATOL, "logits after the step"
    )
    # The exported state dict (gathered over tp and dp_shard x cp) is the reference's after the step.
    state = gather_full_state_dict(model)
    assert sorted(state) == sorted(reference.state_dict())
    for key, value in reference.state_dict().items():
        assert_close(state[key], value.detach(), GRAD_ATOL, f"exported {key}")
    if dist.get_rank() == 0:
        print(f"student cp {section}: max abs errors " + ", ".join(f"{k} {v:.2g}" for k, v in errors.items()))


def check_student_cp2_dp2():
    run_student_cp({"cp_size": 2})


def check_student_cp4_tied_embeddings():
    run_student_cp({"cp_size": 4}, tie=True)


def check_student_cp2_tp2():
    run_student_cp({"cp_size": 2, "tp_size": 2})


def check_student_cp2_hsdp():
    run_student_cp({"cp_size": 2, "dp_size": 2, "dp_replicate_size": 2})


def check_student_cp2_separate_meshes():
    # Student cp2 on ranks 0-1, teacher dp2 on ranks 2-3: the flattened axis needs every world rank.
    layout = {"separate_meshes": True, "distributed": {"dp_size": 1, "cp_size": 2},
              "teacher_distributed": {"dp_size": 2}}  # fmt: skip
    student = create_kd_distributed_setups(layout, WORLD).student
    if student.is_member:
        with pytest.raises(ValueError, match="flatten_student_cp_axes"):
            parallelize_student(configure_packing(tiny_llama()), student)
    flatten_student_cp_axes(student)
    flatten_student_cp_axes(student)  # again: no new groups on any rank
    if student.is_member:
        run_student_cp({"cp_size": 2, "separate": True}, setup=student)
    dist.barrier()


def check_student_cp_rejects_unsupported():
    setup = setup_for({"cp_size": 2})
    # The mask would be misread without the NEAT layout declared; every rank raises before any collective.
    with pytest.raises(ValueError, match="configure_packing"):
        parallelize_student(tiny_llama(), setup)
    with pytest.raises(ValueError, match="ddp"):
        parallelize_student(configure_packing(tiny_llama()), setup_for({"cp_size": 2, "strategy": "ddp"}))


def check_shard_functions_on_the_mesh():
    setup = setup_for({"cp_size": 4})
    cp_rank = setup.device_mesh.get_local_rank("cp")
    local, info = shard_student_batch(BATCH, setup)
    assert info == StudentShard(sequence_length=19, padded_length=24, cp_size=4, cp_rank=cp_rank)
    # The shards of all cp ranks put back together are the padded batch.
    for key, pad in (("input_ids", 0), ("labels", -100), ("position_ids", 0), ("attention_mask", 0)):
        shards = [torch.empty_like(local[key]) for _ in range(4)]
        dist.all_gather(shards, local[key], group=setup.device_mesh.get_group("cp"))
        restored = cp_unshard(shards, dim=1)
        assert torch.equal(restored[:, :19], BATCH[key]) and (restored[:, 19:] == pad).all(), key
    teacher = shard_teacher_logits(TEACHER_LOGITS, setup)
    keep = info.global_positions() < 19
    assert torch.equal(teacher[:, keep], TEACHER_LOGITS[:, info.global_positions()[keep]])
    # Without cp the batch and the logits are returned as they are.
    plain = setup_for({})
    unchanged, info = shard_student_batch(BATCH, plain)
    assert all(unchanged[key] is BATCH[key] for key in BATCH) and info.padded_length == 19
    assert shard_teacher_logits(TEACHER_LOGITS, plain) is TEACHER_LOGITS


CHECKS = [
    check_student_cp_rejects_unsupported,
    check_shard_functions_on_the_mesh,
    check_student_cp2_dp2,
    check_student_cp4_tied_embeddings,
    check_student_cp2_tp2,
    check_student_cp2_hsdp,
    check_student_cp2_separate_meshes,
]

test_student_cp_world = world_test(WORLD, CHECKS, timeout_s=60.0, deadline_s=240.0)


# ---------------------------------------------------------------------------------------------------------
# Pure functions


def test_shard_batch_pads_and_defaults():
    batch = {"input_ids": torch.arange(10).reshape(2, 5), "extra": "kept"}
    local, info = _shard_batch(batch, cp_size=2, cp_rank=1, ignore_index=-1)
    assert info == StudentShard(sequence_length=5, padded_length=8, cp_size=2, cp_rank=1)
    # Rank 1 of cp 2 holds chunks 1 and 2 of 4: global positions 2, 3, 4, 5 (5 is padding).
    assert info.global_positions().tolist() == [2, 3, 4, 5]
    assert local["input_ids"].tolist() == [[2, 3, 4, 0], [7, 8, 9, 0]]
    assert local["position_ids"].tolist() == [[2, 3, 4, 0]] * 2
    assert local["attention_mask"].tolist() == [[1, 1, 1, 0]] * 2
    assert "labels" not in local and local["extra"] == "kept"
    with pytest.raises(ValueError, match="labels"):
        _shard_batch({**batch, "labels": torch.zeros(2, 4)}, cp_size=2, cp_rank=0)


def test_shard_batch_matches_cp_shard_of_the_padded_batch():
    for cp_size in (2, 3):
        for cp_rank in range(cp_size):
            local, _ = _shard_batch(BATCH, cp_size=cp_size, cp_rank=cp_rank)
            padded_length = -(-19 // (2 * cp_size)) * 2 * cp_size  # 20 for cp 2, 24 for cp 3
            padded = torch.nn.functional.pad(BATCH["labels"], (0, padded_length - 19), value=-100)
            assert torch.equal(local["labels"], cp_shard(padded, cp_size=cp_size, cp_rank=cp_rank))

"""Student pipeline parallelism on one 4-rank gloo world, against a single-process reference.

Every check builds the pipeline student and an identical packed reference (same seed, 4 layers) on every
rank, runs 4 NEAT-packed micro-batches (several documents and padding) per data-parallel replica through
`StudentPipeline.step` with a CE + KD loss normalized over all micro-batches of all replicas, and
compares with the reference on all the data: every micro-batch loss, every gradient (by HF name, gathered
over tp and dp), the gradient norm summed over the pipeline, the parameters after one SGD step, the
evaluation logits, the exported state dict, and the gradients of a second step. Layouts: pp2 (gpipe and
1f1b, side by side on two 2-rank meshes), pp2 x dp2 (FSDP2), pp2 x HSDP, pp2 x tp2, pp4 (1f1b), and
pp2 x cp2 (losses, gradients and evaluation logits of each cp rank's share of the sequence).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshkd.core.loss import cross_entropy_loss, kd_loss
from meshkd.core.packing import configure_packing
from meshkd.core.topology import DistributedSetup, create_kd_distributed_setups
from meshkd.parallel.context_parallel import shard_student_batch, shard_teacher_logits
from meshkd.parallel.data_parallel import clip_grad_norm, student_loss_scale
from meshkd.parallel.student_pipeline import StudentPipeline
from tests.tiny import packed_llama_batch, tiny_llama_model
from tests.world import layout_setups, world_test

WORLD = 4
VOCAB = 67  # odd, so the vocab splits unevenly across tp ranks
LAYERS = 4
TEMPERATURE = 2.0
MICRO_BATCHES = 4
ATOL = 1e-5


def tiny_llama(*, seed: int = 0, tie: bool = False, layers: int = LAYERS) -> torch.nn.Module:
    return tiny_llama_model(vocab=VOCAB, layers=layers, seed=seed, tie=tie)


# Two data-parallel replicas x 4 micro-batches of 2 rows x 13 tokens; every row ends in padding.
DOCUMENTS = [[[5, 4], [9, 2]], [[3, 3, 3], [12]], [[6, 6], [1, 4, 4]], [[2, 2, 2, 2], [7, 5]]]
DATA = [[packed_llama_batch(DOCUMENTS[m], 13, vocab=VOCAB, seed=10 * replica + m) for m in range(MICRO_BATCHES)]
        for replica in range(2)]
TEACHER = [[3 * torch.randn(2, 13, VOCAB, generator=torch.Generator().manual_seed(100 + 10 * replica + m))
            for m in range(MICRO_BATCHES)] for replica in range(2)]  # fmt: skip
MODEL_INPUTS = ("input_ids", "position_ids", "attention_mask")


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = ATOL) -> float:
    actual = full(actual).detach()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert error <= atol, f"{what}: max abs error {error:.3g} > {atol}"
    return error


def loss_of(logits: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, num_valid: int) -> torch.Tensor:
    kd = kd_loss(logits, teacher, labels, temperature=TEMPERATURE, num_valid_tokens=num_valid)
    return 0.5 * kd + 0.5 * cross_entropy_loss(logits, labels, num_valid_tokens=num_valid)


class Reference:
    """The unparallelized student on all the data of `replicas` data-parallel replicas."""

    def __init__(self, replicas: int, *, tie: bool = False):
        self.model = configure_packing(tiny_llama(tie=tie))
        self.replicas = replicas
        self.num_valid = sum(int((mb["labels"] != -100).sum()) for data in DATA[:replicas] for mb in data)

    def logits(self, batch: dict) -> torch.Tensor:
        return self.model(**{key: batch[key] for key in MODEL_INPUTS}).logits

    def backward(self) -> list[list[float]]:
        """Losses [replica][micro-batch] of one full backward over all the data."""
        losses = []
        for data, teacher in zip(DATA[: self.replicas], TEACHER[: self.replicas]):
            row = []
            for batch, logits in zip(data, teacher):
                loss = loss_of(self.logits(batch), logits, batch["labels"], self.num_valid)
                loss.backward()
                row.append(loss.item())
            losses.append(row)
        return losses


def dp_rank_of(setup: DistributedSetup) -> int:
    mesh = setup.device_mesh
    return mesh.get_local_rank("dp_replicate") * setup.dp_shard_size + mesh.get_local_rank("dp_shard")


def pipeline_step(pipe: StudentPipeline, setup: DistributedSetup, reference: Reference) -> dict[int, float]:
    """One `step` on this replica's micro-batches; returns {index: loss} as loss_fn saw it (last stage)."""
    replica = dp_rank_of(setup)
    data, teacher = DATA[replica], TEACHER[replica]
    seen: dict[int, float] = {}

    def loss_fn(index: int, logits: torch.Tensor) -> torch.Tensor:
        assert pipe.is_last and index not in seen, (pipe.is_last, index, seen)
        assert tuple(logits.shape) == (2, 13, VOCAB) and isinstance(logits, DTensor) == (setup.tp_size > 1)
        loss = loss_of(logits, teacher[index], data[index]["labels"], reference.num_valid)
        seen[index] = loss.item()
        return loss * setup.dp_size  # student_loss_scale(setup): FSDP averages over dp

    pipe.step(data, loss_fn)
    assert sorted(seen) == (list(range(MICRO_BATCHES)) if pipe.is_last else []), seen
    return seen


def compare_gradients(pipe: StudentPipeline, reference: Reference, what: str) -> float:
    expected = dict(reference.model.named_parameters(remove_duplicate=False))  # a tied head under its own name
    errors = [assert_close(p.grad, expected[name].grad, f"{what}: grad of {name}")
              for name, p in pipe.stage_model.named_parameters()]  # fmt: skip
    return max(errors)


def run_pipeline(setup: DistributedSetup, schedule: str, *, tie: bool = False) -> None:
    """With `tie`, the first stage's embedding and the last stage's head are copies of one tied matrix."""
    torch.manual_seed(0)
    reference = Reference(setup.dp_size, tie=tie)
    pipe = StudentPipeline(tiny_llama(tie=tie), setup, device="cpu", schedule=schedule,
                           num_micro_batches=MICRO_BATCHES)
    all_parameters = dict(reference.model.named_parameters(remove_duplicate=False))
    assert (pipe.is_first, pipe.is_last) == (pipe.pp_rank == 0, pipe.pp_rank == setup.pp_size - 1)
    ref_losses = reference.backward()
    errors = {}

    # Parameter names are the HF names; the stages hold disjoint parts that together make the model.
    names = [name for name, _ in pipe.stage_model.named_parameters()]
    gathered: list = [None] * setup.pp_size
    dist.all_gather_object(gathered, names, group=pipe.pp_group)
    assert sum(len(part) for part in gathered) == len({n for part in gathered for n in part})
    assert {n for part in gathered for n in part} == set(all_parameters)

    # (a) losses: each micro-batch of this replica once, equal to the reference's.
    seen = pipeline_step(pipe, setup, reference)
    replica = dp_rank_of(setup)
    errors["loss"] = max((abs(seen[i] - ref_losses[replica][i]) for i in seen), default=0.0)
    assert errors["loss"] <= ATOL, f"losses {seen} vs {ref_losses[replica]}"

    # (b) every gradient, and the gradient norm once its squares are summed over the pipeline.
    errors["grad"] = compare_gradients(pipe, reference, "step 1")
    own_norm = clip_grad_norm(pipe.stage_model.parameters(), None, uncounted=pipe.tied_copies)
    squares = own_norm.square()  # float64 on the stage's device
    dist.all_reduce(squares, group=pipe.pp_group)
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.model.parameters()])
    errors["grad norm"] = assert_close(squares.sqrt(), ref_norm.double(), "grad norm")

    # (c) one SGD step on both.
    for module in (reference.model, pipe.stage_model):
        torch.optim.SGD(module.parameters(), lr=0.5).step()
    expected = all_parameters
    errors["step"] = max(assert_close(p, expected[name].detach(), f"{name} after one step")
                         for name, p in pipe.stage_model.named_parameters())  # fmt: skip

    # (d) evaluation: logits on the last stage only, for every micro-batch of this replica.
    with torch.no_grad():
        for batch in DATA[replica]:
            logits = pipe.forward(batch)
            if pipe.is_last:
                assert isinstance(logits, DTensor) == (setup.tp_size > 1)
                errors["eval logits"] = assert_close(logits, reference.logits(batch), "eval logits")
            else:
                assert logits is None

    # (e) the export: HF keys and values of the whole (stepped) model on every rank.
    state = pipe.full_state_dict()
    ref_state = reference.model.state_dict()
    assert list(state) == list(ref_state)
    errors["export"] = max(assert_close(state[key], value, f"exported {key}") for key, value in ref_state.items())
    fresh = tiny_llama(seed=1, tie=tie)
    fresh.load_state_dict(state)  # strict: loads into a fresh model
    # Gathered for the export's writer, tensor by tensor: the setup's first rank holds it all, the others nothing.
    first_only = pipe.full_state_dict(first_rank_only=True)
    assert list(first_only) == (list(state) if dist.get_rank() == setup.ranks[0] else [])
    assert all(torch.equal(first_only[key], state[key]) for key in first_only)

    # (f) a second step after evaluation, with the gradients of step 1 kept: they accumulate.
    reference.backward()
    pipeline_step(pipe, setup, reference)
    errors["grad 2"] = compare_gradients(pipe, reference, "step 2 (accumulated)")
    if pipe.is_last and replica == 0 and setup.device_mesh.get_local_rank("tp") == 0:  # one report per layout
        layout = f"pp{setup.pp_size} dp{setup.dp_size} (replicate {setup.dp_replicate_size}) tp{setup.tp_size}"
        layout += " tied" if tie else ""
        print(f"{layout} {schedule}: max abs errors " + ", ".join(f"{k} {v:.2g}" for k, v in errors.items()))


def setup_for(section: dict) -> DistributedSetup:
    return layout_setups({"distributed": section}, WORLD).student


def check_pp2_gpipe_and_1f1b():
    # Two 2-rank pipelines side by side: gpipe on ranks 0-1 (student mesh), 1f1b on ranks 2-3 (the other mesh).
    layout = {"separate_meshes": True, "distributed": {"dp_size": 1, "pp_size": 2},
              "teacher_distributed": {"dp_size": 1, "pp_size": 2}}  # fmt: skip
    setups = create_kd_distributed_setups(layout, WORLD)
    own = setups.local
    run_pipeline(own, "gpipe" if own is setups.student else "1f1b")
    dist.barrier()


def check_pp2_dp2_gpipe():
    run_pipeline(setup_for({"pp_size": 2}), "gpipe")


def check_pp2_dp2_tied_1f1b():
    run_pipeline(setup_for({"pp_size": 2}), "1f1b", tie=True)


def check_pp2_tp2_tied_gpipe():
    run_pipeline(setup_for({"pp_size": 2, "tp_size": 2}), "gpipe", tie=True)


def check_pp2_hsdp_1f1b():
    run_pipeline(setup_for({"pp_size": 2, "dp_size": 2, "dp_replicate_size": 2}), "1f1b")


def check_pp2_tp2_1f1b():
    run_pipeline(setup_for({"pp_size": 2, "tp_size": 2}), "1f1b")


def check_pp4_1f1b():
    run_pipeline(setup_for({"pp_size": 4}), "1f1b")


def check_pp2_cp2_1f1b():
    # Each cp rank holds the head-tail share of every micro-batch (13 tokens padded to 16, 8 per rank).
    setup = setup_for({"pp_size": 2, "cp_size": 2})
    torch.manual_seed(0)
    reference = Reference(1)
    ref_losses = reference.backward()[0]
    pipe = StudentPipeline(tiny_llama(), setup, device="cpu", schedule="1f1b", num_micro_batches=MICRO_BATCHES)
    shards = [shard_student_batch(batch, setup) for batch in DATA[0]]
    local = [batch for batch, _ in shards]
    seen: dict[int, float] = {}

    def loss_fn(index: int, logits: torch.Tensor) -> torch.Tensor:
        teacher = shard_teacher_logits(TEACHER[0][index], setup)
        loss = loss_of(logits, teacher, local[index]["labels"], reference.num_valid)
        seen[index] = loss.item()
        return loss * student_loss_scale(setup)

    pipe.step(local, loss_fn)
    # Each cp rank's loss covers its own tokens: summed over cp they are the reference's.
    losses = torch.tensor([seen.get(i, 0.0) for i in range(MICRO_BATCHES)], dtype=torch.float64)
    dist.all_reduce(losses, group=setup.device_mesh.get_group("cp"))
    if pipe.is_last:
        assert_close(losses, torch.tensor(ref_losses, dtype=torch.float64), "losses summed over cp")
    compare_gradients(pipe, reference, "pp2 x cp2")
    with torch.no_grad():
        for batch, (local_batch, shard) in zip(DATA[0], shards):
            logits = pipe.forward(local_batch)
            if not pipe.is_last:
                assert logits is None
                continue
            real = shard.global_positions() < shard.sequence_length  # padding positions are not compared
            expected = shard_teacher_logits(reference.logits(batch), setup)  # the reference cut the same way
            assert_close(logits[:, real], expected[:, real], "eval logits of this cp shard")


def check_step_rejects_bad_micro_batches():
    setup = setup_for({"pp_size": 4})
    pipe = StudentPipeline(tiny_llama(), setup, device="cpu", schedule="gpipe", num_micro_batches=2)
    # Raised on every rank before any communication (all ranks see the same micro-batches).
    with pytest.raises(ValueError, match="num_micro_batches"):
        pipe.step(DATA[0][:3], lambda index, logits: logits.sum())
    uneven = [DATA[0][0], {key: value[:1] for key, value in DATA[0][1].items()}]
    with pytest.raises(ValueError, match="shape"):
        pipe.step(uneven, lambda index, logits: logits.sum())
    dist.barrier()


def check_the_export_holds_one_tensor_beyond_the_shards_except_on_the_first_rank():
    # pp2 x dp2 (FSDP2), a 38 MiB float32 model of 19 MiB stages whose largest tensor is 4 MiB. Peak resident
    # memory of the gathering above what the rank held before: the first rank holds the model it writes,
    # the others a tensor or two at a time (measured 38.5 and 8.9-11.5 MiB; stages pickled whole to the first
    # stage's ranks took 153, 148 and 59-60 MiB).
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshkd.bench.measure import status_kib

    setup = setup_for({"pp_size": 2})
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024,
                                         num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, attn_implementation="sdpa"))
    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in model.state_dict().items()}
    pipe = StudentPipeline(model, setup, device="cpu", schedule="gpipe", num_micro_batches=2)
    stage = sum(sizes[name] for name, _ in pipe.stage_model.named_parameters())
    del model
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # peak resident memory := the current one
    before = status_kib("VmRSS") * 1024
    state = pipe.full_state_dict(first_rank_only=True)
    peak = status_kib("VmHWM") * 1024 - before
    if dist.get_rank() == 0:
        assert list(state) == list(sizes) and peak < sum(sizes.values()) + stage / 2, (peak, sizes)
    else:
        assert state == {} and peak < stage, (peak, stage)
    dist.barrier()


CHECKS = [
    check_step_rejects_bad_micro_batches,
    check_the_export_holds_one_tensor_beyond_the_shards_except_on_the_first_rank,
    check_pp2_gpipe_and_1f1b,
    check_pp2_dp2_gpipe,
    check_pp2_hsdp_1f1b,
    check_pp2_tp2_1f1b,
    check_pp4_1f1b,
    check_pp2_cp2_1f1b,
    check_pp2_dp2_tied_1f1b,
    check_pp2_tp2_tied_gpipe,
]

test_student_pipeline_world = world_test(WORLD, CHECKS, timeout_s=60.0, deadline_s=240.0)


# ---------------------------------------------------------------------------------------------------------
# Construction errors: raised from the config and the setup alone (an unbuilt setup, no process group).


def unbuilt(**sizes) -> DistributedSetup:
    sizes.setdefault("pp_size", 2)
    ranks = math.prod(sizes.get(key, 1) for key in ("pp_size", "dp_size", "tp_size", "cp_size"))
    return DistributedSetup(ranks=tuple(range(ranks)), **sizes)


@pytest.mark.parametrize(
    ("model_options", "setup", "options", "message"),
    [
        ({}, unbuilt(pp_size=5), {}, r"pp_size\(5\) exceeds the number of decoder layers \(4\)"),
        ({}, unbuilt(), {"schedule": "interleaved"}, r"'interleaved'.*\['1f1b', 'gpipe'\]"),
        ({}, unbuilt(pp_size=4), {"schedule": "1f1b", "num_micro_batches": 3},
         r"num_micro_batches\(3\) >= pp_size\(4\)"),
        ({}, unbuilt(), {"num_micro_batches": 0}, "num_micro_batches must be a positive integer"),
        ({}, unbuilt(dp_size=2, strategy="ddp"), {}, "strategy 'ddp'"),
        ({}, unbuilt(sequence_parallel=True, tp_size=2), {}, "sequence_parallel"),
        ({}, unbuilt(pp_size=1), {}, r"pp_size > 1.*parallelize_student"),
    ],
)
def test_construction_errors(model_options, setup, options, message):
    options = {"device": "cpu", "schedule": "gpipe", "num_micro_batches": 4, **options}
    with pytest.raises(ValueError, match=message):
        StudentPipeline(tiny_llama(**model_options), setup, **options)


def test_unsupported_attention_is_rejected():
    model = tiny_llama(layers=2)
    model.config._attn_implementation = "flash_attention_2"  # builds its own mask: ours would be ignored
    with pytest.raises(ValueError, match="sdpa"):
        StudentPipeline(model, unbuilt(), device="cpu", schedule="gpipe", num_micro_batches=2)


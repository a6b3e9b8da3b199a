"""One optimizer step of several micro-batches (meshkd.recipe.student.train_step), on a 2-rank gloo world.

What a user relies on: a step of several micro-batches on dp 2, with DDP or FSDP2, updates the weights
as one process does on the whole global batch, reports that batch's loss, and the ranks reduce their
gradients once per step, not once per micro-batch (the traffic does not grow with gradient accumulation).
With `model.activation_checkpointing` each decoder layer runs again in backward, and training follows
the same curve. A top-k teacher answer with a bad index, and a stop asked on one rank, are read with the
step's figures at its end: the bad index stops the step on every rank before the update, the stop is agreed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshkd.core.answers import encode_teacher_logits
from meshkd.core.loss import cross_entropy_loss
from meshkd.core.topology import create_kd_distributed_setups
from meshkd.parallel.data_parallel import gather_full_state_dict, parallelize_student
from meshkd.recipe.common.metrics import read_metrics
from meshkd.recipe.settings.config import ConfigError, KDConfig
from meshkd.recipe.settings.config_loading import config_from_dict
from meshkd.recipe.student.train_step import (
    Objective,
    Optimization,
    StepRanks,
    StudentParts,
    TrainStep,
    enable_activation_checkpointing,
    micro_batches,
    step_items,
)
from tests.tiny import base_config, tiny_llama_model, with_layout
from tests.world import run_world

WORLD = 2
VOCAB = 61
ROWS, LENGTH, LR = 8, 12, 0.5


def global_batch() -> dict:
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
    labels = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
    labels[::3, -4:] = -100  # the rows hold different numbers of valid tokens
    return {"input_ids": input_ids, "labels": labels, "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(LENGTH).expand(ROWS, LENGTH).clone()}


@contextlib.contextmanager
def counted_gradient_reductions(model: torch.nn.Module):
    """The list of data-parallel gradient reductions made while the block runs: DDP's bucket all-reduces
    (through its comm hook, registered once and kept), FSDP2's reduce-scatters."""
    calls: list[int] = []
    original = dist.reduce_scatter_single

    def reduce_scatter(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):
            model.meshkd_test_reductions.append(1)
            return allreduce_hook(state, bucket)

        if not hasattr(model, "meshkd_test_reductions"):
            model.meshkd_test_reductions = []
            model.register_comm_hook(None, hook)
        before = len(model.meshkd_test_reductions)
        yield calls
        calls.extend(model.meshkd_test_reductions[before:])
        return
    dist.reduce_scatter_single = reduce_scatter
    try:
        yield calls
    finally:
        dist.reduce_scatter_single = original


def a_step(model, setup, *, num_micro_batches: int, kd: KDConfig | None = None, stop_requested=None) -> TrainStep:
    """A `TrainStep` of `num_micro_batches` micro-batches, plain cross-entropy unless `kd`, SGD."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return TrainStep(StudentParts(model), Objective(kd or dataclasses.replace(KDConfig(), kd_ratio=0.0), VOCAB),
                     Optimization(optimizer, schedule, num_micro_batches), StepRanks(setup, torch.device("cpu")),
                     watch=lambda *_: contextlib.nullcontext(), stop_requested=stop_requested)


def one_step(model, setup, rows: dict, *, num_micro_batches: int, step: TrainStep | None = None,
             answers: list[dict] | None = None) -> dict:
    """One `TrainStep` (default: `a_step`'s) of this rank's `rows` in `num_micro_batches` micro-batches, each
    with its teacher answer of `answers` (None: no teacher)."""
    step = step or a_step(model, setup, num_micro_batches=num_micro_batches)
    size = rows["input_ids"].shape[0] // num_micro_batches
    items = step_items(micro_batches(rows, size=size, device=torch.device("cpu")), ignore_index=-100)
    return step(zip(items, answers or [None] * num_micro_batches), skipped_steps=0)


def check_micro_batched_steps_equal_one_process_and_reduce_once() -> None:
    batch = global_batch()
    reference = tiny_llama_model(vocab=VOCAB, seed=0)
    logits = reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = cross_entropy_loss(logits, batch["labels"], num_valid_tokens=None)
    loss.backward()
    expected_loss = float(loss.detach())
    torch.optim.SGD(reference.parameters(), lr=LR).step()
    rank = dist.get_rank()
    local = {key: value[rank * ROWS // WORLD : (rank + 1) * ROWS // WORLD] for key, value in batch.items()}
    for strategy in ("ddp", "fsdp2"):
        setup = create_kd_distributed_setups({"distributed": {"dp_size": WORLD, "strategy": strategy}}, WORLD).student
        model = parallelize_student(tiny_llama_model(vocab=VOCAB, seed=0), setup)
        with counted_gradient_reductions(model) as accumulated:
            metrics = one_step(model, setup, local, num_micro_batches=4)
        assert abs(metrics["loss"] - expected_loss) < 1e-5, (strategy, metrics["loss"], expected_loss)
        assert metrics["num_tokens"] == int((batch["labels"] != -100).sum())
        state = gather_full_state_dict(model)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0, msg=f"{strategy}: {name}")
        with counted_gradient_reductions(model) as single:
            one_step(model, setup, local, num_micro_batches=1)
        assert len(single) > 0 and len(accumulated) == len(single), (strategy, len(accumulated), len(single))


def check_activation_checkpointing_recomputes_each_layer_and_keeps_the_update() -> None:
    batch = global_batch()
    rank = dist.get_rank()
    local = {key: value[rank * ROWS // WORLD : (rank + 1) * ROWS // WORLD] for key, value in batch.items()}
    setup = create_kd_distributed_setups({"distributed": {"dp_size": WORLD}}, WORLD).student
    states, forwards = [], []
    for checkpointed in (False, True):
        model = tiny_llama_model(vocab=VOCAB, seed=0)
        if checkpointed:
            enable_activation_checkpointing(model)
        calls = []
        for layer in model.model.layers:  # the layer's attention: the recompute runs the layer's forward again
            layer.self_attn.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        model = parallelize_student(model, setup)
        one_step(model, setup, local, num_micro_batches=2)
        states.append(gather_full_state_dict(model))
        forwards.append(len(calls))
    assert forwards[1] == 2 * forwards[0] > 0, forwards
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, atol=1e-6, rtol=0, msg=name)


def check_a_bad_topk_index_and_a_stop_request_are_read_with_the_step_figures() -> None:
    """The top-k index check and the stop request travel in the step's one reduction: a bad index in one
    rank's answer stops the step on every rank with the codec's message, before any update; a stop asked on
    one rank is agreed on all."""
    batch = global_batch()
    rank = dist.get_rank()
    local = {key: value[rank * ROWS // WORLD : (rank + 1) * ROWS // WORLD] for key, value in batch.items()}
    setup = create_kd_distributed_setups({"distributed": {"dp_size": WORLD, "strategy": "ddp"}}, WORLD).student
    model = parallelize_student(tiny_llama_model(vocab=VOCAB, seed=0), setup)
    kd = dataclasses.replace(KDConfig(), kd_ratio=0.5, logits_transport="topk", topk=4)
    generator = torch.Generator().manual_seed(5 + rank)

    def answers(bad_rank: int | None) -> list[dict]:
        made = [encode_teacher_logits(torch.randn(2, LENGTH, VOCAB, generator=generator), "topk", k=kd.topk,
                                      temperature=kd.temperature) for _ in range(2)]
        if rank == bad_rank:
            made[1]["indices"][0, 3, 1] = VOCAB + 2  # past the vocabulary: the loss reads no entry there
        return made

    step = a_step(model, setup, num_micro_batches=2, kd=kd, stop_requested=lambda: rank == 1)
    metrics = one_step(model, setup, local, num_micro_batches=2, step=step, answers=answers(None))
    assert math.isfinite(metrics["kd_loss"]) and metrics["kd_loss"] > 0
    assert step.stop_agreed  # rank 1 asked; rank 0 agrees in the same reduction
    before = {name: value.clone() for name, value in model.module.state_dict().items()}
    with pytest.raises(ValueError, match=rf"step 2: a top-k teacher answer is malformed: encoded topk indices "
                                         rf"must be distinct per token and lie in \[0, {VOCAB}\)"):
        one_step(model, setup, local, num_micro_batches=2, step=step, answers=answers(bad_rank=0))
    for name, value in model.module.state_dict().items():
        assert torch.equal(value, before[name]), name
    quiet = a_step(model, setup, num_micro_batches=2)
    one_step(model, setup, local, num_micro_batches=2, step=quiet)
    assert not quiet.stop_agreed


def check_the_optimizer_groups_what_one_multi_tensor_kernel_can_step() -> None:
    """FSDP2 shards, a DTensor of another mesh and plain tensors (hidden-state projections) train in one
    optimizer: each group holds one kind, so torch's multi-tensor AdamW (fused on CUDA; foreach, which refuses
    the same mixes, here) steps them all, where one group of all of them is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from meshkd.recipe.student.train_step import build_optimizer, parameter_groups

    setup = create_kd_distributed_setups({"distributed": {"dp_size": WORLD, "strategy": "fsdp2"}}, WORLD).student
    model = parallelize_student(tiny_llama_model(vocab=VOCAB, seed=0), setup)
    projection = torch.nn.Linear(8, 8)
    other_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("experts",))
    expert = torch.nn.Parameter(distribute_tensor(torch.ones(4, 8), other_mesh, [Replicate()]))
    extra = [projection.weight, expert, projection.bias]
    config = config_from_dict(with_layout(base_config(Path(tempfile.mkdtemp())), {"dp_size": WORLD}, None))
    optimizer, _ = build_optimizer(model, config, extra)
    groups = [group["params"] for group in optimizer.param_groups]
    kinds = [{p.device_mesh if isinstance(p, DTensor) else None for p in group} for group in groups]
    assert [len(kind) for kind in kinds] == [1, 1, 1], kinds
    assert [None in kind for kind in kinds] == [False, True, False]
    everything = list(model.parameters()) + extra
    assert sorted(map(id, (p for group in groups for p in group))) == sorted(map(id, everything))
    for parameter in everything:
        parameter.grad = torch.ones_like(parameter)
    torch.optim.AdamW(parameter_groups(everything), lr=1e-3, foreach=True).step()
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        torch.optim.AdamW(everything, lr=1e-3, foreach=True).step()


class Train:
    """A check that trains `config` with the recipe; rank 0 writes whether its decoder layers checkpoint."""

    def __init__(self, name: str, config: dict) -> None:
        self.__name__, self.config = name, config

    def __call__(self) -> None:
        from meshkd.recipe.lifecycle.run import KDRecipe

        recipe = KDRecipe(config_from_dict(self.config))
        try:
            recipe.setup()
            recipe.train()
            layers = recipe.role.model.model.layers
        finally:
            recipe.cleanup()
        if dist.get_rank() == 0:
            Path(self.config["logging"]["run_dir"], "layers.json").write_text(
                json.dumps([layer.gradient_checkpointing for layer in layers]))


@pytest.fixture(scope="module")
def train_step_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_step")
    runs = []
    for name, checkpointed in (("kept", False), ("recomputed", True)):
        config = with_layout(base_config(root), {"dp_size": WORLD}, None)
        config["model"]["activation_checkpointing"] = checkpointed
        config["logging"]["run_dir"] = str(root / name)
        runs.append(Train(name, config))
    checks = [check_micro_batched_steps_equal_one_process_and_reduce_once,
              check_activation_checkpointing_recomputes_each_layer_and_keeps_the_update,
              check_a_bad_topk_index_and_a_stop_request_are_read_with_the_step_figures,
              check_the_optimizer_groups_what_one_multi_tensor_kernel_can_step, *runs]
    return root, run_world(WORLD, checks, timeout_s=60, deadline_s=300)


@pytest.mark.world
@pytest.mark.parametrize("check", ["check_micro_batched_steps_equal_one_process_and_reduce_once",
                                   "check_activation_checkpointing_recomputes_each_layer_and_keeps_the_update",
                                   "check_a_bad_topk_index_and_a_stop_request_are_read_with_the_step_figures",
                                   "check_the_optimizer_groups_what_one_multi_tensor_kernel_can_step"])
def test_train_step(check, train_step_world):
    train_step_world[1].check(check)


@pytest.mark.world
def test_model_activation_checkpointing_trains_the_same_curve(train_step_world):
    root, results = train_step_world
    for name in ("kept", "recomputed"):
        results.check(name)
    assert json.loads((root / "kept" / "layers.json").read_text()) == [False, False]
    assert json.loads((root / "recomputed" / "layers.json").read_text()) == [True, True]
    curves = [[(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(root / name) if r["kind"] == "train"]
              for name in ("kept", "recomputed")]
    assert len(curves[0]) == len(curves[1]) > 0
    for kept, recomputed in zip(*curves):
        assert kept[0] == recomputed[0] and abs(kept[1] - recomputed[1]) < 1e-6 and abs(kept[2] - recomputed[2]) < 1e-6


def test_the_teacher_has_no_activations_to_checkpoint(tmp_path):
    config = base_config(tmp_path)
    config["teacher_model"]["activation_checkpointing"] = True
    with pytest.raises(ConfigError, match=r"teacher_model.activation_checkpointing: the teacher runs forward only"):
        config_from_dict(config)


def test_the_students_training_and_evaluation_forward_builds_no_kv_cache():
    from meshkd.recipe.student.train_step import student_logits

    model = tiny_llama_model(vocab=VOCAB, seed=0).train()
    outputs = []  # the decoder's outputs that are set (a KV cache would be one: past_key_values, or cache)
    model.model.register_forward_hook(lambda module, args, output: outputs.append(sorted(output.keys())))
    logits = student_logits(model, None, global_batch())
    assert logits.shape == (ROWS, LENGTH, VOCAB) and outputs == [["last_hidden_state"]]

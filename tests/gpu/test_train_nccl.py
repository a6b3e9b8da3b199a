"""`meshkd train` on one GPU under NCCL, as a user runs it: one rank, student and teacher on shared meshes.

A bf16 student (and teacher) trains through a checkpoint, is stopped, resumed and exported; the resumed
steps follow the uninterrupted run. In fp32 the GPU's curve matches the CPU's for the same config. Each run
is a real `meshkd train` (torch's launcher, one worker, NCCL on cuda:0). A last run holds its steady training
steps to one host sync each, the step's read of its reduced figures: torch.cuda's sync debug mode raises at any
other (`CountedStep`), and the first step's syncs are counted and printed by source line (`-s` shows them).
"""

import contextlib
import functools
import json
import math
import subprocess
import sys
import threading
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from meshkd.core.local_world import spawn_world
from meshkd.recipe.common.metrics import read_metrics
from meshkd.recipe.settings.config_loading import config_from_dict
from tests.gpu import CUDA
from tests.tiny import base_config

pytestmark = [*CUDA, pytest.mark.world]


def train(config: dict, *extra: str) -> list[dict]:
    """Run `meshkd train` on `config` (written next to its run directory); its train records."""
    path = Path(config["logging"]["run_dir"]).with_suffix(".yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "meshkd", "train", str(path), *extra], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return [record for record in read_metrics(config["logging"]["run_dir"]) if record["kind"] == "train"]


def one_gpu(tmp_path: Path, name: str, *, dtype: str, device: str = "cuda") -> dict:
    config = base_config(tmp_path)
    config.update(device=device, distributed={"dp_size": 1})  # shared meshes: both models on the one rank
    config["model"]["dtype"] = config["teacher_model"]["dtype"] = dtype
    config["logging"]["run_dir"] = str(tmp_path / name)
    config["lr_scheduler"]["total_steps"] = 6  # the same schedule for the stopped and the whole run
    return config


def losses(records: list[dict]) -> list[float]:
    return [record["loss"] for record in records]


def test_a_bf16_student_checkpoints_resumes_and_exports_on_one_gpu(tmp_path):
    config = one_gpu(tmp_path, "stopped", dtype="bfloat16")
    config["checkpoint"] = {"enabled": True, "save_hf": True}
    config["step_scheduler"].update(max_steps=4, ckpt_every_steps=2)
    first = train(config)
    assert [record["step"] for record in first] == [1, 2, 3, 4]
    assert all(math.isfinite(value) for value in losses(first))
    run_dir = Path(config["logging"]["run_dir"])
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir())[-1].endswith("4")
    resumed = train(config, "--resume", "--set", "step_scheduler.max_steps=6")
    assert [record["step"] for record in resumed] == [1, 2, 3, 4, 5, 6]

    whole = one_gpu(tmp_path, "whole", dtype="bfloat16")
    whole["step_scheduler"]["max_steps"] = 6
    # bf16 on a GPU: kernels may reduce in another order from run to run (atomics), so close, not equal.
    torch.testing.assert_close(losses(resumed), losses(train(whole)), rtol=2e-2, atol=1e-3)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf_student").to("cuda")
    with torch.no_grad():
        logits = model(torch.arange(10, device="cuda")[None]).logits
    assert logits.shape == (1, 10, 262) and torch.isfinite(logits).all()


def test_the_fp32_curve_on_the_gpu_is_the_cpus(tmp_path):
    on_gpu = train(one_gpu(tmp_path, "gpu", dtype="float32"))
    on_cpu = train(one_gpu(tmp_path, "cpu", dtype="float32", device="cpu"))
    assert len(on_gpu) == len(on_cpu) > 0
    torch.testing.assert_close(losses(on_gpu), losses(on_cpu), rtol=5e-3, atol=1e-4)


# The Tensor methods that copy a value to the host: on a GPU each waits for the device (a host sync).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
TORCH_DIR = str(Path(torch.__file__).parent)


@contextlib.contextmanager
def counted_host_reads(counts: Counter):
    """Count each call of a `HOST_READS` method by its caller's file:line while the block runs: the CPU's
    stand-in for torch.cuda's sync debug mode, where every tensor is a host tensor. A call made inside another
    (tolist's own item, say) counts once. Two kinds of call are counted under a tag of their own, since they
    do not hold up training on a GPU: one on another thread (" [its name]": the teacher prefetcher's, on its
    own CUDA stream) and one from torch's own code (" (torch)": the reads of what torch keeps in host memory,
    the per-tensor AdamW's step counts on the CPU, say); `training_syncs` leaves them out."""
    step_thread, inside = threading.get_ident(), threading.local()

    def counted(method):
        @functools.wraps(method)
        def call(tensor, *args, **kwargs):
            if getattr(inside, "depth", 0):
                return method(tensor, *args, **kwargs)
            caller = sys._getframe(1)
            where = f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
            if caller.f_code.co_filename.startswith(TORCH_DIR):
                where += " (torch)"
            if threading.get_ident() != step_thread:
                where += f" [{threading.current_thread().name}]"
            counts[where] += 1
            inside.depth = 1
            try:
                return method(tensor, *args, **kwargs)
            finally:
                inside.depth = 0
        return call

    originals = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}
    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            if original is None:
                delattr(torch.Tensor, name)  # it was TensorBase's, found through the class
            else:
                setattr(torch.Tensor, name, original)


def training_syncs(counts: dict[str, int]) -> int:
    """The host syncs that hold up the training thread, of `counted_host_reads`' counts."""
    return sum(count for where, count in counts.items() if not where.endswith((")", "]")))


class CountedStep:
    """The recipe's training step with each call's host syncs counted by source line: torch.cuda's sync debug
    mode on a GPU, `counted_host_reads` on the CPU.

    On a GPU the first step warms up (its syncs counted from the mode's warnings); every later one runs in the
    mode's "error" setting, where any host sync raises where it is made, save the step's one read of its reduced
    figures (`TrainStep._finish`'s `.tolist()`), which is let through and counted under "the step's read".
    It stands in for the `TrainStep` in `recipe.role.step` and hands every other attribute to it: the loop
    reads the step's layout (`pipeline`, `num_micro_batches`, `scheduler`) as well as calling it.
    """

    STEP_READ = "the step's read"

    def __init__(self, step, per_step: list[Counter]) -> None:
        self.step, self.per_step = step, per_step

    def __getattr__(self, name: str):
        return getattr(self.step, name)

    def __call__(self, feed, **kwargs) -> dict[str, float]:
        counts = Counter()
        if not torch.cuda.is_available():
            try:
                with counted_host_reads(counts):
                    return self.step(feed, **kwargs)
            finally:
                self.per_step.append(counts)
        if self.per_step:  # a steady step
            try:
                with _the_step_read_allowed(counts, self.STEP_READ):
                    torch.cuda.set_sync_debug_mode("error")
                    return self.step(feed, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                self.per_step.append(counts)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                return self.step(feed, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            self.per_step.append(Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                         if "synchronizing" in str(w.message)))


@contextlib.contextmanager
def _the_step_read_allowed(counts: Counter, key: str):
    """While it lasts, a `.tolist()` called by `TrainStep._finish` (the step's one read of its figures) runs with
    the sync debug mode off and is counted under `key`; any other runs as it would."""
    original = torch.Tensor.__dict__.get("tolist")
    tolist = torch.Tensor.tolist

    def read(tensor, *args, **kwargs):
        caller = sys._getframe(1).f_code
        if caller.co_name != "_finish" or not caller.co_filename.endswith("train_step.py"):
            return tolist(tensor, *args, **kwargs)
        counts[key] += 1
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return tolist(tensor, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    torch.Tensor.tolist = read
    try:
        yield
    finally:
        if original is None:
            del torch.Tensor.tolist  # it was TensorBase's, found through the class
        else:
            torch.Tensor.tolist = original


def count_host_syncs(rank: int, config: dict, out: str) -> None:
    """Train `config` on this world, counting each training step's host syncs by source line on every student
    rank; the first student rank writes its counts to `out`."""
    from meshkd.recipe.lifecycle.run import KDRecipe
    from meshkd.recipe.lifecycle.student_trainer import StudentTrainer

    recipe, per_step = KDRecipe(config_from_dict(config)), []
    try:
        recipe.setup()
        is_student = isinstance(recipe.role, StudentTrainer)
        if is_student:
            recipe.role.step = CountedStep(recipe.role.step, per_step)
        recipe.train()
    finally:
        recipe.cleanup()
    if is_student and rank == recipe.setups.student.ranks[0]:
        Path(out).write_text(json.dumps([dict(counts) for counts in per_step]))


def test_a_steady_training_step_syncs_the_host_once(tmp_path):
    """The default answer and output layer (top-k, fused) on one GPU (both models on its one rank: NCCL takes one
    rank per device), 5 steps of 4 micro-batches: from the second on, a host sync other than the step's read of
    its figures raises in the student's process (`CountedStep`), and the world fails naming it."""
    config = one_gpu(tmp_path, "syncs", dtype="bfloat16")
    config["kd"].update(logits_transport="topk", topk=8)
    out = tmp_path / "syncs.json"
    assert spawn_world(1, count_host_syncs, (config, str(out)), backend="nccl", timeout_s=120, deadline_s=600) is None
    per_step = [Counter(counts) for counts in json.loads(out.read_text())]
    assert len(per_step) == config["step_scheduler"]["max_steps"]
    print(f"host syncs of the first training step, by source: {per_step[0].most_common(12)}")
    assert all(counts == Counter({CountedStep.STEP_READ: 1}) for counts in per_step[1:]), per_step[1:]


def fused_step_of_shards_and_projections(rank: int, root: str) -> None:
    """FSDP2 shards (DTensors on the one-rank mesh) and plain hidden-state projections in one optimizer, as
    `build_optimizer` makes it on CUDA: fused AdamW steps every group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshkd.recipe.student.train_step import build_optimizer
    from tests.tiny import tiny_llama_model

    torch.cuda.set_device(0)
    model = tiny_llama_model(vocab=262, seed=0).cuda()
    fully_shard(model, mesh=init_device_mesh("cuda", (1,)))
    projection = torch.nn.Linear(32, 48).cuda()
    config = config_from_dict(base_config(Path(root)))
    optimizer, _ = build_optimizer(model, config, list(projection.parameters()))
    assert optimizer.defaults["fused"] and len(optimizer.param_groups) == 2
    before = projection.weight.detach().clone()
    ids = torch.randint(0, 262, (2, 16), device="cuda")
    (model(input_ids=ids, labels=ids).loss + projection(torch.ones(32, device="cuda")).sum()).backward()
    optimizer.step()
    assert not torch.equal(before, projection.weight)


def test_fused_adamw_steps_sharded_weights_beside_plain_projections(tmp_path):
    assert spawn_world(1, fused_step_of_shards_and_projections, (str(tmp_path),), backend="nccl", timeout_s=120,
                       deadline_s=300) is None

"""NCCL failure handling, as far as it can be shown without NCCL (`meshkd.recipe.lifecycle.world`,
`meshkd.recipe.common.faults`).

- Blocking wait only on the groups meshkd waits on itself: TORCH_NCCL_BLOCKING_WAIT=1 is set while a CUDA
  rank creates its world group, the patient group and the bridges' groups (unless the user chose), never
  while the DeviceMesh groups are created, and is gone afterwards; a CPU rank leaves the environment alone.
  Shown on gloo with `meshkd.core.groups` told the backend is NCCL, recording the environment each group
  is created in.
- A run that fails on an NCCL world aborts every process group instead of destroying it; a clean finish,
  and a gloo world whatever happens, destroy it. Shown on a one-rank gloo world whose backend name alone
  reads "nccl": the abort and destroy are torch's own, spied on.
- FaultWatch turns the errors ProcessGroupNCCL raises for a timeout, an aborted communicator or a lost peer
  into PeerLostError naming the role and its ranks, as it does gloo's.

The same behaviour on GPUs, with a teacher process killed mid-run, is in `tests/gpu/test_multi_gpu.py`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshkd.core import groups as meshkd_groups
from meshkd.core.local_world import spawn_world
from meshkd.core.topology import KDDistributedSetups
from meshkd.core.wire import SenderError
from meshkd.recipe.common.faults import FaultWatch, PeerLostError
from meshkd.recipe.lifecycle import world
from meshkd.recipe.lifecycle.run import KDRecipe
from meshkd.recipe.settings.config_loading import config_from_dict
from tests.tiny import base_config, with_layout

BLOCKING_WAIT = meshkd_groups.BLOCKING_WAIT_ENV


# ---- the environment an NCCL group is created in ----------------------------------------------------


@pytest.fixture
def clean_nccl_env(monkeypatch):
    """No blocking-wait variable set; whatever a test sets is undone after it."""
    for name in BLOCKING_WAIT:
        monkeypatch.setenv(name, "unset by the test")  # recorded first, so that the undo restores the original
        monkeypatch.delenv(name)


@pytest.mark.parametrize("user", [{}, {"TORCH_NCCL_BLOCKING_WAIT": "0"}, {"NCCL_BLOCKING_WAIT": "0"}])
def test_blocking_wait_is_set_only_while_groups_are_created_unless_the_user_chose(user, monkeypatch,
                                                                                 clean_nccl_env):
    for name, value in user.items():
        monkeypatch.setenv(name, value)
    with meshkd_groups.blocking_wait("nccl"):
        inside = {name: os.environ.get(name) for name in BLOCKING_WAIT}
    after = {name: os.environ.get(name) for name in BLOCKING_WAIT}
    chosen = {name: user.get(name) for name in BLOCKING_WAIT}
    assert inside == (chosen if user else {"TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_BLOCKING_WAIT": None})
    assert after == chosen
    with meshkd_groups.blocking_wait("gloo"):
        assert {name: os.environ.get(name) for name in BLOCKING_WAIT} == chosen


@pytest.mark.parametrize("cuda", [True, False])
def test_init_world_sets_blocking_wait_before_creating_an_nccl_group_only(cuda, tmp_path, monkeypatch,
                                                                          clean_nccl_env):
    created = []

    def init_process_group(backend, *, timeout):  # NCCL cannot run here: record what it would be given
        created.append((backend, timeout.total_seconds(), os.environ.get("TORCH_NCCL_BLOCKING_WAIT")))

    monkeypatch.setattr(world, "uses_cuda", lambda config: cuda)
    monkeypatch.setattr(world, "check_gpu_count", lambda config, local_processes: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    config = config_from_dict(base_config(tmp_path))
    device, owned = world.init_world(config)
    assert owned and device.type == ("cuda" if cuda else "cpu")
    timeout = config.collective_timeout_s
    assert created == ([("nccl", timeout, "1")] if cuda else [("gloo", timeout, None)])
    assert all(name not in os.environ for name in BLOCKING_WAIT)  # the model's groups are made without it


def record_group_creation(rank: int, config: dict, out: str) -> None:
    """Set a recipe up on this gloo world with `meshkd.core.groups` told the backend is NCCL; write, for every
    group created, its ranks, description, timeout and the blocking-wait variable at that moment."""
    c10d = dist.distributed_c10d
    created, helper = [], c10d._new_process_group_helper

    def recording(group_size, group_rank, global_ranks_in_group, *args, timeout=None, group_desc=None, **kwargs):
        created.append({"ranks": list(global_ranks_in_group), "desc": group_desc,
                        "timeout_s": None if timeout is None else timeout.total_seconds(),
                        "blocking": os.environ.get("TORCH_NCCL_BLOCKING_WAIT")})
        return helper(group_size, group_rank, global_ranks_in_group, *args, timeout=timeout, group_desc=group_desc,
                      **kwargs)

    meshkd_groups._uses_nccl = lambda backend: True  # the environment NCCL would read; gloo ignores it
    c10d._new_process_group_helper = recording
    recipe = KDRecipe(config_from_dict(config))
    try:
        recipe.setup()
        from meshkd.parallel.data_parallel import student_fsdp_mesh

        student = recipe.setups.student
        fsdp_group = student_fsdp_mesh(student, student.device_mesh).get_group() if rank in student.ranks else None
        Path(out, f"rank{rank}.json").write_text(json.dumps({
            "created": created, "left_set": os.environ.get("TORCH_NCCL_BLOCKING_WAIT"),
            "fsdp_group_is_world": fsdp_group is dist.group.WORLD,
            "fsdp_timeout_s": None if fsdp_group is None
            else fsdp_group._get_backend(torch.device("cpu")).options._timeout.total_seconds()}))
    finally:
        c10d._new_process_group_helper = helper
        recipe.cleanup()


@pytest.mark.world
def test_blocking_wait_only_on_the_groups_meshkd_waits_on_and_the_mesh_groups_take_the_timeout(tmp_path):
    # A student of 2 ranks (FSDP2 over both, cp 2 flattened with them) and a teacher on a rank of its own.
    config = with_layout(base_config(tmp_path), {"dp_size": 1, "cp_size": 2}, {"dp_size": 1})
    config.update(collective_timeout_s=41, setup_timeout_s=333)
    assert spawn_world(3, record_group_creation, (config, str(tmp_path)), timeout_s=60, deadline_s=300) is None
    for rank in range(3):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["left_set"] is None
        mesh = [group for group in report["created"] if (group["desc"] or "").startswith("mesh_")]
        own = [group for group in report["created"] if group not in mesh]
        # Every axis of both meshes (5 each), their dp views and the student's dp_shard x cp view.
        assert {group["desc"] for group in mesh} >= {"mesh_pp", "mesh_dp_replicate", "mesh_dp_shard", "mesh_cp",
                                                     "mesh_tp", "mesh_dp", "mesh_dp_shard_cp"}
        assert all(group["blocking"] is None and group["timeout_s"] == 41 for group in mesh), mesh
        # The patient group, then the bridge's control, student, teacher and route groups.
        assert own[0]["timeout_s"] == 333 and own[0]["ranks"] == [0, 1, 2]
        assert {tuple(group["ranks"]) for group in own[1:]} >= {(0, 1, 2), (0, 1), (2,), (0, 2)}
        assert all(group["blocking"] == "1" for group in own), own
        if rank < 2:
            assert not report["fsdp_group_is_world"] and report["fsdp_timeout_s"] == 41


# ---- the way out: abort after a failure on NCCL, destroy otherwise -----------------------------------


class GroupSpy:
    """Records torch's aborts (per process group) and destroys while a recipe ends."""

    def __init__(self, monkeypatch) -> None:
        self.aborted: list[dist.ProcessGroup] = []
        self.destroyed = 0
        abort, destroy = dist.ProcessGroup.abort, dist.destroy_process_group

        def spied_abort(group):
            self.aborted.append(group)
            return abort(group)

        def spied_destroy(group=None):
            self.destroyed += 1
            return destroy(group)

        monkeypatch.setattr(dist.ProcessGroup, "abort", spied_abort)
        monkeypatch.setattr(dist, "destroy_process_group", spied_destroy)


def end_a_recipe(tmp_path, monkeypatch, *, backend: str, error: BaseException | None) -> tuple[GroupSpy, list]:
    """Run a KDRecipe whose setup creates a one-rank gloo world and two more groups (as the meshes and the bridge
    do) and whose training raises `error` (None: finishes); `backend` is what the world's backend name reads.
    Returns the spy and the groups the setup created."""
    spy, groups = GroupSpy(monkeypatch), []

    def setup(recipe) -> None:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        recipe._owns_process_group = True
        groups.extend([dist.group.WORLD, dist.new_group([0]), dist.new_group([0])])

    def train(recipe) -> None:
        if error is not None:
            raise error

    if backend == "nccl":
        monkeypatch.setattr(dist, "get_backend", lambda group=None: dist.Backend.NCCL)
    monkeypatch.setattr(KDRecipe, "setup", setup)
    monkeypatch.setattr(KDRecipe, "train", train)
    recipe = KDRecipe(config_from_dict(base_config(tmp_path)))
    try:
        if error is None:
            recipe.run()
        else:
            with pytest.raises(type(error)):
                recipe.run()
        assert not dist.is_initialized(), "the recipe left its process group"
    finally:
        if dist.is_initialized():
            dist.distributed_c10d._abort_process_group()
    return spy, groups


@pytest.mark.parametrize("error", [PeerLostError("lost the teacher (rank 1) during send_batch: timed out"),
                                   KeyboardInterrupt()], ids=["lost_peer", "interrupt"])
def test_a_failed_run_on_nccl_aborts_every_group_and_destroys_none(error, tmp_path, monkeypatch):
    spy, groups = end_a_recipe(tmp_path, monkeypatch, backend="nccl", error=error)
    assert {id(group) for group in spy.aborted} == {id(group) for group in groups} and len(spy.aborted) == 3
    assert spy.destroyed == 0


def test_a_clean_finish_on_nccl_destroys_the_world(tmp_path, monkeypatch):
    spy, _ = end_a_recipe(tmp_path, monkeypatch, backend="nccl", error=None)
    assert spy.destroyed == 1 and spy.aborted == []


@pytest.mark.parametrize("error", [None, PeerLostError("lost the teacher (rank 1) during send_batch: closed")],
                         ids=["clean", "lost_peer"])
def test_a_gloo_world_is_destroyed_whether_or_not_the_run_failed(error, tmp_path, monkeypatch):
    spy, _ = end_a_recipe(tmp_path, monkeypatch, backend="gloo", error=error)
    assert spy.destroyed == 1 and spy.aborted == []


# ---- FaultWatch and NCCL's errors ---------------------------------------------------------------------

# As ProcessGroupNCCL words them (the log prefix, then the first line; later lines are its source location).
NCCL_ERRORS = {
    "watchdog_timeout": "[PG ID 2 PG GUID 5(bridge) Rank 0] Watchdog caught collective operation timeout: "
                        "WorkNCCL(SeqNum=7, OpType=BROADCAST, NumelIn=4, NumelOut=4, Timeout(ms)=15000) ran for "
                        "15012 milliseconds before timing out.\nException raised from checkTimeout at ...",
    "blocking_wait": "[PG ID 2 PG GUID 5(bridge) Rank 0] Work WorkNCCL(SeqNum=7, OpType=BROADCAST, NumelIn=4, "
                     "NumelOut=4, Timeout(ms)=15000) timed out in blocking wait.",
    "aborted": "NCCL communicator was aborted on rank 0.  Original reason for failure was: [PG ID 0 PG GUID 0"
               "(default_pg) Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, ...)",
    "remote_error": "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, remote process exited "
                    "or there was a network error, NCCL version 2.27.5\nncclRemoteError: A call failed possibly "
                    "due to a network error or a remote process exiting prematurely.",
    "system_error": "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3390, unhandled "
                    "system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.5",
}
# What the one line keeps of each: the log prefix and the source location are gone.
NCCL_BRIEF = {
    "watchdog_timeout": r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=7, OpType=BROADCAST, "
                        r"NumelIn=4, NumelOut=4, Timeout\(ms\)=15000\) ran for 15012 milliseconds before timing out\.$",
    "blocking_wait": r"Work WorkNCCL\(SeqNum=7, .*\) timed out in blocking wait\.$",
    "aborted": r"NCCL communicator was aborted on rank 0\.  Original reason for failure was: \[PG ID 0",
    "remote_error": r"NCCL error: remote process exited or there was a network error, NCCL version 2\.27\.5$",
    "system_error": r"NCCL error: unhandled system error \(run with NCCL_DEBUG=INFO for details\)",
}


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", [RuntimeError, dist.DistBackendError], ids=["RuntimeError", "DistBackendError"])
@pytest.mark.parametrize("case", list(NCCL_ERRORS))
def test_nccl_failures_become_peer_lost_naming_the_role_and_ranks(case, kind, tmp_path, one_rank_world):
    setups = KDDistributedSetups(student=None, teacher=None, student_ranks=(0,), teacher_ranks=(1, 2),
                                 separate=True)
    faults = FaultWatch(setups, tmp_path, torch.device("cpu"))
    with pytest.raises(PeerLostError) as raised:
        with faults.watch("send_batch", "teacher"):
            raise kind(NCCL_ERRORS[case])
    message = str(raised.value)
    assert message.startswith("lost the teacher (ranks 1-2) during send_batch: "), message
    assert "\n" not in message and re.search(NCCL_BRIEF[case], message), message


def test_other_cuda_errors_are_not_taken_for_a_lost_peer(tmp_path, one_rank_world):
    setups = KDDistributedSetups(student=None, teacher=None, student_ranks=(0,), teacher_ranks=(1,), separate=True)
    faults = FaultWatch(setups, tmp_path, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="CUDA out of memory") as raised:
        with faults.watch("send_batch", "teacher"):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)")
    assert not isinstance(raised.value, PeerLostError)


# ---- a peer's exit, which NCCL does not notice ---------------------------------------------------------


def test_abort_communicators_aborts_every_group_and_keeps_the_registry(monkeypatch, one_rank_world):
    spy = GroupSpy(monkeypatch)
    groups = [dist.group.WORLD, dist.new_group([0]), dist.new_group([0])]
    world.abort_communicators()
    assert {id(group) for group in spy.aborted} == {id(group) for group in groups} and len(spy.aborted) == 3
    assert dist.is_initialized() and spy.destroyed == 0  # close_world ends the world later


@pytest.fixture
def teacher_process(tmp_path):
    """A process standing for teacher rank 1 of this host, its pid file written as a rank's would be."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pids = tmp_path / "pids"
    pids.mkdir()
    (pids / "rank1.pid").write_text(f"{process.pid} {socket.gethostname()}\n")
    yield process
    process.kill()
    process.wait()


def watching(tmp_path) -> tuple[FaultWatch, threading.Event]:
    """Rank 0 (the student) of a student 1 + teacher 1 run, watching its peer's exit; the event is its abort."""
    setups = KDDistributedSetups(student=None, teacher=None, student_ranks=(0,), teacher_ranks=(1,), separate=True)
    faults = FaultWatch(setups, tmp_path, torch.device("cpu"))
    faults.write_pid_file()
    aborted = threading.Event()
    faults.watch_exits(aborted.set)
    return faults, aborted


def test_a_peer_that_exits_unfinished_aborts_the_communicators_and_is_named(tmp_path, teacher_process,
                                                                          one_rank_world):
    faults, aborted = watching(tmp_path)
    try:
        assert not aborted.wait(1.0), "aborted while the peer was alive"
        teacher_process.kill()
        teacher_process.wait()
        killed_at = time.monotonic()
        assert aborted.wait(5.0), "the peer's exit was not noticed"
        assert time.monotonic() - killed_at < 2.0
        assert faults.aborted_for == [1]
        # What fails next in a watched block, whatever it is, is reported as the lost peer.
        with pytest.raises(PeerLostError, match=r"^lost the teacher \(rank 1; rank 1 exited\) during send_batch: "
                                                r"the header announces -1 rows$"):
            with faults.watch("send_batch", "teacher"):
                raise ValueError("the header announces -1 rows")
        # The peer's own error, sent before it exited, is reported as it is.
        with pytest.raises(SenderError, match="teacher rank 1 failed on this batch"):
            with faults.watch("send_batch", "teacher"):
                raise SenderError("teacher rank 1 failed on this batch: out of memory")
    finally:
        faults.stop_watching_exits()


def test_a_peer_that_finished_is_no_loss(tmp_path, teacher_process, one_rank_world):
    faults, aborted = watching(tmp_path)
    try:
        (tmp_path / "pids" / "rank1.done").touch()  # as the teacher's mark_done writes it before it exits
        teacher_process.kill()
        teacher_process.wait()
        assert not aborted.wait(2.0), "a peer that finished was taken for a lost one"
        with pytest.raises(ValueError, match="a rank-local error"):
            with faults.watch("the HF export", "student"):
                raise ValueError("a rank-local error")
    finally:
        faults.stop_watching_exits()


def test_mark_done_stops_the_watch_and_writes_the_mark(tmp_path, one_rank_world):
    faults, _ = watching(tmp_path)
    faults.mark_done()
    assert (tmp_path / "pids" / "rank0.done").exists() and not faults._exits_thread.is_alive()
    faults.write_pid_file()  # a new run in the same directory starts unfinished
    assert not (tmp_path / "pids" / "rank0.done").exists()

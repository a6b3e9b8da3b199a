"""The KD recipe: one `KDRecipe.run()` on every rank of the world, each rank in its role.

Student ranks run a `StudentTrainer` (on shared meshes it also holds the teacher and asks it locally);
teacher-only ranks (separate meshes) run a `TeacherWorker`, which serves the student's requests through
`meshkd.core.teacher_protocol` until STOP_TEACHER. Setup is the same sequence of phases on every rank,
so that the collectives between them line up across roles:

1. load (rank-local: this role's model, data), agreed over the world;
2. the common vocabulary (an all-reduce of both models' sizes) and, on separate meshes, the bridge (the
   student's packing hook and the teacher's `TeacherRunner` build their masks from the same NEAT document
   indices, so the roles need no packing handshake);
3. lay out (pipeline split, tensor / context / data parallel, this rank's share of the weights), agreed;
4. resume (the student's checkpoint, metrics, run directory), agreed.

Failures (`meshkd.recipe.faults`). `meshkd.recipe.preflight` checks what needs no process group (data
files, tokenizers, model configs against the layout) the same way on every rank, so a bad input raises
everywhere without a collective; `meshkd train` runs it before starting any process. What one role finds
out in a phase is agreed over the world before the next collective, so every rank raises it (`SetupError`
on the others). In training, a collective that fails because a peer died or stopped answering becomes
`PeerLostError`, naming the role and ranks lost. A stop request (SIGINT, SIGTERM, or the stop file `meshkd
train` names in MESHKD_STOP_FILE) is agreed among the student ranks at a step boundary: they save a
checkpoint of that step, send STOP_TEACHER and return. On the way out after any failure, an NCCL world
aborts its communicators rather than destroying them (`meshkd.recipe.world.close_world`): a collective the
failure left queued would hold the destroy forever.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from meshkd.core.bridge import KDMeshBridge
from meshkd.core.topology import create_kd_distributed_setups
from meshkd.parallel.context_parallel import flatten_student_cp_axes
from meshkd.recipe import models
from meshkd.recipe.config import KDRecipeConfig
from meshkd.recipe.faults import FaultWatch, StopRequest
from meshkd.recipe.preflight import about, preflight
from meshkd.recipe.student_trainer import StudentTrainer
from meshkd.recipe.teacher_worker import TeacherWorker
from meshkd.recipe.world import abort_communicators, close_world, init_world


class KDRecipe:
    """Distill `config.teacher_model` into `config.model`; `run()` does setup, train and cleanup."""

    def __init__(self, config: KDRecipeConfig, *, resume: bool = False) -> None:
        self.config = config
        self.resume = resume
        self.run_dir = Path(config.logging.run_dir)
        self.role: StudentTrainer | TeacherWorker | None = None
        self.faults: FaultWatch | None = None
        self.summary: dict = {}
        self._owns_process_group = False
        self._stop = StopRequest()

    def setup(self) -> None:
        config = self.config
        # Same files, same answer on every rank: a bad input raises everywhere before any collective.
        checked = preflight(config)
        self.device, self._owns_process_group = init_world(config)
        self.setups = setups = create_kd_distributed_setups(config, dist.get_world_size())
        self.faults = faults = FaultWatch(setups, self.run_dir, self.device, setup_timeout_s=config.setup_timeout_s)
        flatten_student_cp_axes(setups.student)  # collective over the world: teacher ranks take part
        is_student = dist.get_rank() in setups.student_ranks
        if is_student:
            self.role = StudentTrainer(config, setups, faults, self.device, self._stop)
        else:
            self.role = TeacherWorker(config, setups.teacher, faults, self.device)
        role = self.role
        with faults.watch("setup", "teacher" if is_student else "student"):
            with faults.on_every_rank("while loading models and data", patient=True):
                faults.write_pid_file()
                torch.manual_seed(config.seed)
                role.load(checked)
            # Every rank has written its pid file now. gloo notices a peer's exit itself; NCCL waits for the
            # peer until the collective timeout unless its communicators are aborted.
            if dist.get_backend() == dist.Backend.NCCL:
                faults.watch_exits(abort_communicators)
            vocab_size = self._common_vocab_size(checked, role.vocab_rows())
            bridge = None
            if setups.separate:
                bridge = KDMeshBridge(setups, self.device,
                                      timeout=datetime.timedelta(seconds=config.collective_timeout_s))
            with faults.on_every_rank("while laying out the models"):
                role.lay_out(vocab_size, bridge)
            with faults.on_every_rank("while resuming and opening the run directory"):
                role.resume(self.resume)

    def _common_vocab_size(self, checked, rows: tuple[int, int]) -> int:
        """The vocabulary both models share; every rank learns both embedding sizes, so checks raise everywhere."""
        # On the role's device: a group made by init_process_group("nccl") takes CUDA tensors only.
        sizes = torch.tensor(rows, dtype=torch.int64, device=self.device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
        student_rows, teacher_rows = sizes.tolist()
        with about("model.tokenizer / teacher_model.tokenizer"):
            vocab_size = models.common_vocab_size(checked.tokenizer, checked.teacher_tokenizer,
                                                  student_vocab_size=student_rows, teacher_vocab_size=teacher_rows,
                                                  cross_tokenizer=self.config.kd.cross_tokenizer is not None)
        if self.setups.student.tp_size > 1 and student_rows != vocab_size:
            raise ValueError(
                f"model: vocabulary {student_rows} differs from the common vocabulary {vocab_size}: not supported "
                "with distributed.tp_size > 1"
            )
        return vocab_size

    def train(self) -> None:
        """Student ranks train (and stop the teacher when done); teacher-only ranks serve until then."""
        self.summary = self.role.run()

    def cleanup(self, *, failed: bool = False) -> None:
        """Close the role and the process group this recipe created; `failed`: the run is ending on an error."""
        if self.role is not None:
            self.role.close()
        if self.faults is not None and failed:
            self.faults.stop_watching_exits()
        elif self.faults is not None:
            self.faults.mark_done()  # stops the exit watch and tells the peers' that this exit is no loss
        if self._owns_process_group and dist.is_initialized():
            close_world(failed=failed)

    def run(self) -> dict:
        """setup, train (or serve), cleanup; returns the summary (validation losses, HF directory) on student ranks.

        SIGINT and SIGTERM are handled while it runs (main thread only): the run stops at the next step
        boundary with a checkpoint of that step, and `summary["stopped_at_step"]` says where.
        """
        self._stop.install()
        try:
            self.setup()
            self.train()
        except BaseException:
            self.cleanup(failed=True)
            raise
        else:
            self.cleanup()
        finally:
            self._stop.restore()
        return self.summary

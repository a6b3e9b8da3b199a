"""The KD recipe: one `KDRecipe.run()` on every rank of the world, each rank in its role.

Student ranks run a `StudentTrainer` (on shared meshes it also holds the teacher and asks it locally);
teacher-only ranks (separate meshes) run a `TeacherWorker`, which serves the student's requests through
`meshkd.core.teacher_protocol` until STOP_TEACHER. With several teachers (`teachers`) each is either on the
student's ranks or on ranks of its own, with a bridge of its own to the student (`meshkd.core.teacher_ensemble`
asks them all at once); a teacher's worker runs that teacher (of `KDRecipeConfig.teacher_list`) with the
run's shared settings. Setup is the same sequence of phases on every rank,
so that the collectives between them line up across roles:

1. load (rank-local: this role's model, data), agreed over the world (phases 1, 3 and 4 read files: the
   ranks done first wait for the others up to `setup_timeout_s`, not the collective timeout);
2. the common vocabulary (an all-reduce of every model's size) and, on separate meshes, the bridges (the
   student's packing hook and the teacher's `TeacherRunner` build their masks from the same NEAT document
   indices, so the roles need no packing handshake);
3. lay out (pipeline split, tensor / context / data parallel, this rank's share of the weights), agreed;
4. resume (the student's checkpoint, metrics, run directory), agreed.

Failures (`meshkd.recipe.common.faults`). `meshkd.recipe.lifecycle.preflight` checks what needs no process group (data
files, tokenizers, model configs against the layout) the same way on every rank, so a bad input raises
everywhere without a collective; `meshkd train` runs it before starting any process. What one role finds
out in a phase is agreed over the world before the next collective, so every rank raises it (`SetupError`
on the others). In training, a collective that fails because a peer died or stopped answering becomes
`PeerLostError`, naming the role and ranks lost: after `collective_timeout_s`, except that a teacher waits
for the student's next command up to `setup_timeout_s`, since between requests the student may be saving a
checkpoint or exporting (a student that exits still ends that wait at once). A stop request (SIGINT,
SIGTERM, or the stop file `meshkd train` names in MESHKD_STOP_FILE) is agreed among the student ranks at a
step boundary: they save a checkpoint of that step, send STOP_TEACHER and return. On the way out after any
failure, an NCCL world aborts its communicators rather than destroying them
(`meshkd.recipe.lifecycle.world.close_world`): a collective the failure left queued would hold the destroy forever.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from meshkd.core.bridge import KDMeshBridge
from meshkd.core.topology import TeacherSetups, create_teacher_setups
from meshkd.parallel.context_parallel import flatten_student_cp_axes
from meshkd.recipe.common.faults import FaultWatch, StopRequest, about
from meshkd.recipe.lifecycle.preflight import Preflight, preflight_teachers
from meshkd.recipe.lifecycle.student_trainer import StudentTrainer
from meshkd.recipe.lifecycle.world import abort_communicators, close_world, init_world
from meshkd.recipe.modeling import models
from meshkd.recipe.settings.config import KDRecipeConfig
from meshkd.recipe.teacher.teacher_worker import TeacherWorker


def run_setups(config: KDRecipeConfig, world_size: int) -> TeacherSetups:
    """The student's and each teacher's layouts (every rank builds them all: collective over the world); their
    mesh groups time out after `collective_timeout_s`."""
    timeout = datetime.timedelta(seconds=config.collective_timeout_s)
    return create_teacher_setups(config.distributed, config.teacher_layouts(), world_size, timeout=timeout)


class KDRecipe:
    """Distill the teachers (`KDRecipeConfig.teacher_list`) into `config.model`; `run()` does setup, train and
    cleanup."""

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
        checked = preflight_teachers(config)
        self.device, self._owns_process_group = init_world(config)
        self.setups = setups = run_setups(config, dist.get_world_size())
        self.faults = faults = FaultWatch(setups, self.run_dir, self.device, setup_timeout_s=config.setup_timeout_s)
        flatten_student_cp_axes(setups.student)  # collective over the world: teacher ranks take part
        name, local = setups.local
        is_student = name is None
        if is_student:
            self.role = StudentTrainer(config, setups, faults, self.device, self._stop)
        else:
            self.role = TeacherWorker(config, config.teacher_named(name), local, faults, self.device)
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
            # Every rank builds every bridge (their groups are made collectively), in the teachers' order. A
            # teacher waits for the next command as long as set-up may take: the student may be saving or
            # exporting meanwhile (a student that is gone still ends the wait: `KDMeshBridge`).
            timeout = datetime.timedelta(seconds=config.collective_timeout_s)
            patience = datetime.timedelta(seconds=config.setup_timeout_s)
            bridges = {name: KDMeshBridge(setups.pair(name), self.device, timeout=timeout, command_timeout=patience)
                       for name in setups.teachers if setups.separate(name)}
            # Both read weights (the models' shares, the checkpoint): the ranks done first wait patiently.
            with faults.on_every_rank("while laying out the models", patient=True):
                role.lay_out(vocab_size, bridges)
            with faults.on_every_rank("while resuming and opening the run directory", patient=True):
                role.resume(self.resume)

    def _common_vocab_size(self, checked: dict[str, Preflight], rows: dict[str, int]) -> int:
        """The vocabulary the student and every teacher share; every rank learns every embedding size (`rows`:
        model -> rows, of the models this rank holds), so checks raise everywhere."""
        teachers = [teacher.name for teacher in self.config.teacher_list()]
        names = ["student", *teachers]
        # On the role's device: a group made by init_process_group("nccl") takes CUDA tensors only.
        sizes = torch.tensor([rows.get(name, -1) for name in names], dtype=torch.int64, device=self.device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
        student_rows, *teacher_rows = sizes.tolist()
        vocab_size = student_rows
        for name, teacher in zip(teachers, teacher_rows):
            label = "teacher_model" if self.config.teachers is None else f"teachers.{name}.model"
            with about(f"model.tokenizer / {label}.tokenizer"):
                vocab_size = min(vocab_size, models.common_vocab_size(
                    checked[name].tokenizer, checked[name].teacher_tokenizer, student_vocab_size=student_rows,
                    teacher_vocab_size=teacher, cross_tokenizer=self.config.kd.cross_tokenizer is not None))
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

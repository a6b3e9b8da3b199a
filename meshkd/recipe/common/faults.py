"""Failures and stop requests during a run: what every rank of a KD run agrees on when something goes wrong.

- A setup step that fails on some ranks only (their weights, their data, a checkpoint) is agreed over the
  world before the next collective (`FaultWatch.on_every_rank`): the failing rank raises its own error,
  every other rank `SetupError` with its message.
- A collective that fails because a peer died or stopped answering becomes `PeerLostError`
  (`FaultWatch.watch`), naming the role and ranks lost. Every rank writes RUN_DIR/pids/rank{r}.pid
  ("PID HOST") at setup, so a survivor on the same host can tell which peer process exited; a rank that
  fails because it lost a peer first marks itself (rank{r}.lost), so later survivors name the role
  that failed first rather than a casualty. On NCCL a failed collective of a group meshkd waits on itself
  (the world, the patient group, the bridges) raises where a rank waits on it (blocking wait on those groups
  only: `meshkd.core.groups`), after the group's timeout, as DistBackendError; one of the model's own
  groups (FSDP2, tp, cp, pp) that times out is ended by torch's watchdog instead. NCCL does
  not notice a peer process that exits, so `FaultWatch.watch_exits` polls the pid files: when a peer of
  this host exits without having finished (RUN_DIR/pids/rank{r}.done), it aborts this rank's communicators,
  and the collective that waits on the peer fails at once instead of after the timeout.
- `StopRequest`: SIGINT, SIGTERM or the stop file named by MESHKD_STOP_FILE, recorded by the handler and
  acted on at the next step boundary by the recipe.
- `about`: the errors a user can cause, prefixed with the config key they concern.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from meshkd.core.agreement import first_failure
from meshkd.core.groups import waiting_group
from meshkd.core.topology import KDDistributedSetups, TeacherSetups
from meshkd.core.wire import SenderError

STOP_FILE_ENV = "MESHKD_STOP_FILE"
"""Environment variable naming a file whose appearance asks the run to stop (set by `meshkd train`)."""

# How long a rank that saw a collective fail looks for the peer process that exited (same host only).
_DEAD_PEER_WAIT_S = 1.0
# How often `FaultWatch.watch_exits` looks at the peers' processes: a lost peer is noticed within this.
_EXIT_POLL_S = 0.5
# RuntimeErrors of collectives that mean a peer is gone or silent (gloo, NCCL, the c10d store). NCCL's, as
# ProcessGroupNCCL words them: a wait past the group's timeout ("Watchdog caught collective operation
# timeout: WorkNCCL(...) ran for N milliseconds before timing out"; "Work ... timed out in blocking wait"),
# a communicator aborted after such a failure ("NCCL communicator was aborted on rank N. Original reason for
# failure was: ..."), and NCCL's own errors ("NCCL error in: FILE:LINE, remote process exited or there was a
# network error, NCCL version ..."). Most arrive as DistBackendError, which counts whatever its text.
_PEER_FAILURE = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|[Tt]imed out|[Tt]imeout|ECONNRESET|EPIPE|"
    r"NCCL (error|communicator)|communicator was aborted|Socket Timeout"
)


class PeerLostError(RuntimeError):
    """A collective failed because a peer rank died or stopped answering; the message names its role and ranks."""


class SetupError(RuntimeError):
    """Another rank failed during setup; raised on every rank that did not (the failing rank raises its own error).

    `origin_rank` is the lowest rank that failed; the message carries its error.
    """

    def __init__(self, message: str, *, origin_rank: int) -> None:
        super().__init__(message)
        self.origin_rank = origin_rank


def _ranks(ranks) -> str:
    """'rank 0', 'ranks 1-3' (consecutive), 'ranks 0, 2'."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(str(rank) for rank in ranks)


def brief(error: BaseException) -> str:
    """One ASCII line of a backend error: gloo's and NCCL's source locations and gloo's advice are dropped."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(" This is typically")[0]
    text = re.sub(r"^NCCL error in: \S+:\d+, ", "NCCL error: ", text)
    return text.encode("ascii", "ignore").decode()[:300]


def _is_peer_failure(error: BaseException) -> bool:
    if isinstance(error, (PeerLostError, SetupError)):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    return isinstance(error, RuntimeError) and _PEER_FAILURE.search(str(error)) is not None


def _process_gone(pid: int) -> bool:
    """True when `pid` exited (a zombie counts: it only waits for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def _pid_file(run_dir: Path, rank: int) -> Path:
    return run_dir / "pids" / f"rank{rank}.pid"


def _done_file(run_dir: Path, rank: int) -> Path:
    """Written by a rank whose run ended normally, before it exits: its exit is no loss to its peers."""
    return run_dir / "pids" / f"rank{rank}.done"


def _lost_file(run_dir: Path, rank: int) -> Path:
    """Written by a rank that is about to fail because it lost a peer: it exits as a casualty, not a cause."""
    return run_dir / "pids" / f"rank{rank}.lost"


class StopRequest:
    """SIGINT / SIGTERM, or the stop file named by MESHKD_STOP_FILE: stop at the next step boundary.

    The handlers only record the signal (a collective cannot be left half-way); the student ranks agree
    on stopping at step boundaries. Teacher-only ranks record it too and keep serving until the students
    send STOP_TEACHER, so a signal sent to every process (torchrun, a batch scheduler) ends the run cleanly.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self.file = os.environ.get(STOP_FILE_ENV) or None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; the stop file still works
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        self.signal = signum

    def requested(self) -> bool:
        return self.signal is not None or (self.file is not None and os.path.exists(self.file))

    def reason(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else "a stop request"

    def agreed(self, group: dist.ProcessGroup | None, *, device: torch.device) -> bool:
        """Whether any rank of `group` (None: the world) was asked to stop: one all-reduce, so that all stop
        at the same point."""
        flag = torch.tensor([int(self.requested())], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())


class FaultWatch:
    """Agreement on setup failures and naming of lost peers for one rank of a run (see the module docstring).

    Args:
        setups: the run's resolved roles (which ranks are the student's, which each teacher's).
        run_dir: the run directory (pid files live in RUN_DIR/pids).
        device: where the agreement collectives put their tensors.
    """

    def __init__(self, setups: KDDistributedSetups | TeacherSetups, run_dir: Path, device: torch.device, *,
                 setup_timeout_s: float | None = None) -> None:
        self.roles = setups.roles
        self.run_dir = Path(run_dir)
        self.device = device
        # Agreement after loading waits as long as loading may take, not the peer timeout (collective over
        # the world, like the FaultWatch every rank builds at the same point of setup).
        self._patient = None if setup_timeout_s is None else waiting_group(
            timeout=datetime.timedelta(seconds=setup_timeout_s))
        self._ranks = sorted({rank for ranks in self.roles.values() for rank in ranks})
        self._exits_stop = threading.Event()
        self._exits_thread: threading.Thread | None = None
        self.aborted_for: list[int] = []  # the peers whose exit made `watch_exits` abort the communicators

    def write_pid_file(self) -> None:
        """RUN_DIR/pids/rank{r}.pid: "PID HOST", so that operators and peers can tell which process is which."""
        path = _pid_file(self.run_dir, dist.get_rank())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{os.getpid()} {socket.gethostname()}\n")
        _lost_file(self.run_dir, dist.get_rank()).unlink(missing_ok=True)
        _done_file(self.run_dir, dist.get_rank()).unlink(missing_ok=True)

    def mark_done(self) -> None:
        """RUN_DIR/pids/rank{r}.done: this rank's run ended normally, so peers that outlive it go on."""
        self.stop_watching_exits()
        with contextlib.suppress(OSError):
            _done_file(self.run_dir, dist.get_rank()).touch()

    def watch_exits(self, abort: Callable[[], None]) -> None:
        """Call `abort` once, from a background thread, when a peer process of this host exits unfinished.

        For backends that do not notice a peer's exit (NCCL waits for it until the timeout): `abort` (aborting
        the communicators) ends the waits on it, and `watch` then reports whatever fails in its block as the
        lost peer. Start it once every rank has written its pid file; `stop_watching_exits` ends it.
        """
        if self._exits_thread is not None:
            return
        peers = self._same_host_peers()

        def poll() -> None:
            while not self._exits_stop.wait(_EXIT_POLL_S):
                exited = [rank for rank, pid in peers.items()
                          if _process_gone(pid) and not _done_file(self.run_dir, rank).exists()]
                if exited:
                    self.aborted_for = exited
                    with contextlib.suppress(RuntimeError):  # an abort that fails leaves the waits to the timeout
                        abort()
                    return

        self._exits_thread = threading.Thread(target=poll, name="meshkd-peer-exits", daemon=True)
        self._exits_thread.start()

    def stop_watching_exits(self) -> None:
        self._exits_stop.set()
        if self._exits_thread is not None and self._exits_thread is not threading.current_thread():
            # A polling thread ends within one interval; one inside an abort that hangs is left to the exit.
            self._exits_thread.join(timeout=2 * _EXIT_POLL_S)

    @contextlib.contextmanager
    def on_every_rank(self, stage: str, *, patient: bool = False):
        """Run a rank-local part of setup, then agree over the world: if it failed anywhere, raise everywhere.

        The failing rank raises its own error; the others raise SetupError with the lowest failing rank's
        message. Costs one all-reduce when nothing failed. `patient`: the ranks done first wait for the
        others up to `setup_timeout_s` instead of the collective timeout (loading data and models).
        """
        try:
            yield
        except Exception as error:
            self.agree(error, stage, patient=patient)
            raise
        self.agree(None, stage, patient=patient)

    def agree(self, error: BaseException | None, stage: str, *, patient: bool = False) -> None:
        """Raise SetupError on every rank but the failing ones when `error` is set on any (see `on_every_rank`)."""
        text = None
        if error is not None:
            text = str(error) if isinstance(error, (ValueError, OSError)) else f"{type(error).__name__}: {error}"
            text = text or type(error).__name__
        failure = first_failure(text, self._patient if patient else None, device=self.device)
        if failure is not None and error is None:
            origin, message = failure
            raise SetupError(f"rank {origin} ({self.role_of(origin)}) failed {stage}: {message}", origin_rank=origin)

    def role_of(self, rank: int) -> str:
        return next(role for role, ranks in self.roles.items() if rank in ranks)

    @contextlib.contextmanager
    def watch(self, operation: str, role: str):
        """Turn a collective that failed because a peer died or went silent into PeerLostError.

        `role` ("student", "teacher", or a teacher's role name among several, `TeacherSetups.role`) is whose
        ranks the operation waits on; where the pid files show which peer process exited (same host), the
        message names that one's role instead.
        """
        try:
            yield
        except Exception as error:
            # Once a peer's exit aborted the communicators, whatever failed here (a collective on an aborted
            # communicator, or work on what it left half-received) is that loss; a peer's own error, sent
            # before it exited, says more.
            aborted = self.aborted_for and not isinstance(error, (PeerLostError, SetupError, SenderError))
            if not (aborted or isinstance(error, RuntimeError) and _is_peer_failure(error)):
                raise
            raise PeerLostError(self.lost(operation, role, error)) from error

    def lost(self, operation: str, role: str, error: BaseException) -> str:
        """The PeerLostError message; also marks this rank as a casualty for the peers that outlive it."""
        with contextlib.suppress(OSError):  # no pid directory yet: nobody can read the mark anyway
            _lost_file(self.run_dir, dist.get_rank()).touch()
        dead = self.dead_ranks()
        if len(self.roles) == 1:
            exited = f"; {_ranks(dead)} exited" if dead else ""
            return f"lost a peer ({_ranks(self._ranks)}{exited}) during {operation}: {brief(error)}"
        # Ranks that exited because they lost a peer themselves do not tell which role failed first: the
        # message names those that failed first (how many casualties are gone by now is a matter of timing).
        causes = [rank for rank in dead if not _lost_file(self.run_dir, rank).exists()] or dead
        exited = f"; {_ranks(causes)} exited" if causes else ""
        roles = {self.role_of(rank) for rank in causes}
        if len(roles) == 1:  # the pid files know better than the operation which role is gone
            role = roles.pop()
        # "student" / "teacher" stand for the one role whose name starts so ("student and teacher 'a'", say).
        matches = [name for name in self.roles if name.startswith(role)]
        role = matches[0] if role not in self.roles and len(matches) == 1 else role
        role_ranks = self.roles.get(role) or [rank for name in matches for rank in self.roles[name]]
        return f"lost the {role} ({_ranks(role_ranks)}{exited}) during {operation}: {brief(error)}"

    def _same_host_peers(self) -> dict[int, int]:
        """rank -> pid of the other ranks of the run on this host, from their pid files."""
        host, me = socket.gethostname(), dist.get_rank()
        pids = {}
        for rank in self._ranks:
            try:
                pid, pid_host = _pid_file(self.run_dir, rank).read_text().split()
            except (OSError, ValueError):
                continue
            if rank != me and pid_host == host:
                pids[rank] = int(pid)
        return pids

    def dead_ranks(self) -> list[int]:
        """Ranks of this host whose process exited, from the pid files (waits a moment for a dying peer)."""
        pids = self._same_host_peers()
        deadline = time.monotonic() + _DEAD_PEER_WAIT_S
        while True:
            dead = [rank for rank, pid in sorted(pids.items()) if _process_gone(pid)]
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)


@contextlib.contextmanager
def about(key: str):
    """Prefix the errors a user can cause (ValueError, OSError) with the config key they concern."""
    try:
        yield
    except (ValueError, OSError) as error:
        if str(error).startswith(key):
            raise
        message = f"{key}: {error}"
        try:
            renamed = type(error)(message)
        except Exception:  # an exception type whose constructor wants more than a message
            renamed = ValueError(message)
        raise renamed from error

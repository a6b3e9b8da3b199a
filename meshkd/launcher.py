"""The launcher: `meshkd train` starts its local worker processes through torch's own launcher.

`launch` starts `python -m meshkd ARGS` on `nproc` local processes under torch.distributed.run (gloo on
CPU, NCCL on CUDA), each with OMP_NUM_THREADS from `threads_per_process`. The launcher runs in its own
session, dies with `meshkd train` (PR_SET_PDEATHSIG), and reports each failed worker in one line
(`torchrun`). A worker runs its command through `run_here`, which turns a user error or a lost peer into
one line and exit status 1.

Stopping. The first SIGINT or SIGTERM to `meshkd train` creates the stop file the workers poll at step
boundaries (they save a checkpoint of that step and exit 0; `meshkd train` then exits 128 + the signal); a
second one is forwarded to torchrun, which signals the workers and kills them after `SHUTDOWN_GRACE_S`
(5 s; torchrun's own is 30 s). torch's process context (`PContext.close`) is patched in the launcher
process only, so that the same grace ends the workers left when one failed: a peer frozen
mid-collective is gone within the collective timeout and that grace.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

# Seconds the launcher waits for workers to exit after SIGTERM before it kills them (torchrun's own: 30 s).
SHUTDOWN_GRACE_S = 5


def _report(line: str) -> None:
    """Write one line to stderr in one system call: workers and the launcher share it, whole lines stay whole."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (line + "\n").encode(errors="replace"))


def inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE", "LOCAL_RANK"} <= set(os.environ)


# The launcher process: torch.distributed.run, with its failure report cut to one line per failed worker.
_LAUNCHER = "import sys; from meshkd.launcher import torchrun; sys.exit(torchrun(sys.argv[1:]))"


def torchrun(argv: list[str]) -> int:
    """Run torch.distributed.run with `argv`; a worker failure or a signal gives an exit status, not a traceback."""
    from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    # When a worker fails, torchrun signals the others and waits 30 s before it kills them; that wait is
    # fixed where it first sees the failure (`--shutdown-timeout` only covers its final shutdown). A worker
    # frozen mid-collective never answers the signal, so every close of the workers gets our grace.
    close = PContext.close
    # torchrun's own warnings and errors about its workers (SIGTERM sent, exit codes) would repeat, in its log
    # format, what the workers and this function say in one line each.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    PContext.close = lambda self, death_sig=None, timeout=30: close(self, death_sig, min(timeout, SHUTDOWN_GRACE_S))
    try:
        main(argv)
    except ChildFailedError as error:
        for rank, failure in sorted(error.failures.items()):
            code = failure.exitcode
            how = f"exit code {code}"
            if code < 0:  # ended by a signal
                how = f"signal {signal.Signals(-code).name if -code in signal.valid_signals() else -code}"
            _report(f"meshkd: worker rank {rank} (pid {failure.pid}) ended with {how}")
        return 1
    except SignalException as error:
        return 128 + int(error.sigval)
    return 0


def _end_with_parent() -> None:
    """In the launcher before exec: get SIGTERM if `meshkd train` dies, so no launcher or worker outlives it."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def threads_per_process(nproc: int) -> str:
    """OMP_NUM_THREADS for each of `nproc` local processes: the user's, else the cores shared among them.

    torchrun's default is one thread each, which leaves a single process computing on one core of many.
    """
    return os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))


STOPPING = {"serve-teacher": "draining: queued requests are answered, new ones refused",
            "cache-teacher": "stopping after the current round of shards (a rerun continues)"}
"""What a command's workers do on the first SIGINT / SIGTERM; `meshkd train`'s (and any other's) is the default."""


def launch(nproc: int, args: list[str]) -> int:
    """Run `python -m meshkd ARGS` on `nproc` local processes under torch.distributed.run.

    The launcher runs in its own session, so a Ctrl-C at the terminal reaches this process only. The first
    SIGINT / SIGTERM creates the stop file the workers poll at step boundaries (see
    `meshkd.recipe.common.faults.STOP_FILE_ENV`); a later one is forwarded to the launcher. Returns the launcher's exit
    status, or 128 + the first signal's number when every process exited cleanly after it.
    """
    from meshkd.recipe.common.faults import STOP_FILE_ENV
    from meshkd.recipe.common.metrics import WARNED_ENV, warned

    with tempfile.TemporaryDirectory(prefix="meshkd-") as scratch:
        stop_file = Path(scratch, "stop")
        command = [sys.executable, "-c", _LAUNCHER, "--standalone", f"--nproc-per-node={nproc}", "-m", "meshkd", *args]
        env = dict(os.environ, OMP_NUM_THREADS=threads_per_process(nproc))
        env[STOP_FILE_ENV] = str(stop_file)
        env[WARNED_ENV] = json.dumps(warned)  # the preflight's warnings, said once here
        launcher = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_end_with_parent)
        received: list[int] = []
        stopping = STOPPING.get(args[0] if args else "", "stopping at the next step boundary")

        def forward(signum: int, frame) -> None:
            received.append(signum)
            if len(received) == 1:
                stop_file.touch()
                # os.write, not print: a print interrupted by this handler would be re-entered.
                os.write(2, f"meshkd: got {signal.Signals(signum).name}: {stopping} "
                            "(send it again to stop at once)\n".encode())
            else:
                launcher.send_signal(signum)

        previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = launcher.wait()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    return 128 + received[0] if received and code == 0 else code


def run_here(work: Callable[[], object]) -> int:
    """Run `work` as one rank of the current world; a user error or a lost peer prints one line and returns 1.

    Other exceptions (bugs) keep their traceback.
    """
    from meshkd.core.wire import SenderError  # a peer's own error, forwarded in place of its data
    from meshkd.recipe.common.faults import PeerLostError, SetupError

    # The recipe handles SIGINT / SIGTERM while it runs; before and after, a worker on its way out ignores
    # them (torchrun signals every worker once one fails), so that it ends with its own exit status.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    try:
        work()
    except (ValueError, OSError, PeerLostError, SetupError, SenderError) as error:
        _report(f"meshkd: error: rank {os.environ.get('RANK', '?')}: {error}")
        return 1
    return 0

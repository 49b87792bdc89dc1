"""kimi.server.WorkerProcess: the ranks torchrun started are killed by stop() even when torchrun itself is gone.

A stand-in "torchrun" (a real Python process) starts one "rank" in a session of its own, as torchrun's
subprocess handler does, so signals to torchrun's group do not reach it."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from kimi.server import WorkerProcess


def _alive(pid: int, start: int) -> bool:
    """Whether process pid (started at `start` clock ticks) still runs (a zombie does not)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[19]) == start and fields[0] != b"Z"


_FAKE_TORCHRUN = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
    "time.sleep(120)\n"
)


def test_stop_kills_the_ranks_of_a_torchrun_that_was_killed():
    w = WorkerProcess([sys.executable, "-c", _FAKE_TORCHRUN], nproc=1)
    try:
        deadline = time.monotonic() + 20
        while not w._ranks and time.monotonic() < deadline:  # the rank appears a moment after the launch
            assert w.check() is None
            time.sleep(0.05)
        assert w._ranks, "the rank was never seen under the fake torchrun"
        ((rank, start),) = w._ranks.items()
        os.kill(w.proc.pid, signal.SIGKILL)  # torchrun dies; its rank lives on, orphaned
        w.proc.wait(10)
        assert "exited with code -9" in (w.check() or "")
        assert _alive(rank, start), "the rank should outlive the fake torchrun"
        w.stop(grace_s=0.1)
        deadline = time.monotonic() + 10
        while _alive(rank, start) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(rank, start), f"rank {rank} outlived stop()"
    finally:
        for pid in [w.proc.pid, *w._ranks]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

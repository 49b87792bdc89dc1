"""kimi.worker.launch (torchrun as `kimi serve` starts it) under kimi.server.WorkerProcess, with real torchrun
processes: the rank that failed first is named with its exit code or signal in the controller's error (it said
"worker process exited with code 1" for any rank: a newcomer's report), torchrun's exit is one line, and the
report file is gone after `stop`."""

from __future__ import annotations

import os
import sys
import time

import pytest

from kimi.server import WorkerProcess

SCRIPT = """
import os, signal, sys, time
if int(os.environ["RANK"]) == 1:
    time.sleep(0.5)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(7)
time.sleep(60)
"""


@pytest.mark.parametrize("how,want", [("exit", "it exited with code 7"), ("kill", "it was killed by SIGKILL")])
def test_the_first_failed_rank_is_named(tmp_path, capfd, how, want):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    w = WorkerProcess(
        [sys.executable, "-m", "kimi.worker.launch", "--standalone", "--nproc-per-node", "2", str(script), how], nproc=2
    )
    try:
        deadline = time.monotonic() + 60
        while (msg := w.check()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        w.stop(1.0)
    assert msg == f"worker rank 1 died: {want} (torchrun then stopped the other ranks and exited with code 1)", msg
    assert not os.path.exists(w._report)
    err = capfd.readouterr().err
    code = 7 if how == "exit" else -9
    assert f"kimi.worker.launch: worker rank 1 exited with code {code}" in err and "Traceback" not in err, err
    assert "failed (exitcode" not in err, err  # torchrun's own report of it is silenced

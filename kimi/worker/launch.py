"""`python -m kimi.worker.launch <torchrun arguments>`: torchrun (torch.distributed.run), as `kimi serve` starts
its workers, with a one-line report when a rank fails.

torchrun's own entry point re-raises a failed rank as ChildFailedError, a ~30-line traceback plus a table, after
the rank has printed its error and the controller has logged it (`start-up failed: ...` or the step error). Here
the same failure prints one line to stderr, `kimi.worker.launch: worker rank R exited with code C`, and the
process exits 1, as torchrun does. With $KIMI_LAUNCH_REPORT set (kimi serve sets it to a file of its own), the
failed rank and its exit code are also written there as JSON, `{"rank": R, "exitcode": C}` (C negative: killed by
signal -C), so the controller's error for the requests a rank death ends names the rank.

A SIGTERM / SIGINT / SIGHUP to torchrun (kimi's stop of ranks still loading) ends the ranks as torchrun does, then
prints `kimi.worker.launch: stopped by SIGTERM` instead of the agent's SignalException traceback, and exits 128 +
the signal number. torchrun's own log lines about the same events (its agent's and process handler's warnings and
errors) are silenced. Everything else (arguments, rendezvous, signal handling, exit 0 when every rank exits 0) is
torch.distributed.run's `run`. Operators who start ranks themselves (`kimi serve --attach`, docs/multinode.md) use
plain torchrun.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from kimi import envs

# the loggers of torchrun's agent and process handler: their lines repeat what this module reports in one line
_QUIET = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")


_PARENT = os.getppid()  # kimi serve, which reads and removes the report file


def _report(rank: int, exitcode: int) -> None:
    path = envs.KIMI_LAUNCH_REPORT.get()
    if not path:
        return
    try:
        if os.getppid() != _PARENT:  # kimi serve is gone (killed): nobody will read or remove the file
            os.unlink(path)
            return
        with open(path, "w") as f:
            json.dump({"rank": rank, "exitcode": exitcode}, f)
    except OSError as e:
        print(f"kimi.worker.launch: cannot write $KIMI_LAUNCH_REPORT {path}: {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv` (default sys.argv[1:]); 0 when every rank exits 0, 1 when one fails, 128 + N
    after signal N."""
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        _report(int(rank), int(failure.exitcode))
        print(f"kimi.worker.launch: worker rank {rank} exited with code {failure.exitcode}", file=sys.stderr)
        return 1
    except SignalException as e:  # the agent has already stopped the ranks (torch.distributed.elastic)
        print(f"kimi.worker.launch: stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        # The agent has stopped every rank by now. A stop signal from kimi serve that lands while this process
        # exits would hit torchrun's handler (a SignalException traceback during interpreter shutdown): ignore them.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
    return 0


if __name__ == "__main__":
    sys.exit(main())

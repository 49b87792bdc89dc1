"""The controller's checks that its workers are alive: pings, heartbeats, the local torchrun, the step timeout.

The engine pings every rank every `heartbeat_s` seconds (also while a step runs: on every wait for results that
times out, and before a plan is sent); each rank's heartbeat thread answers with `Pong` (kimi.ipc). A rank not heard
from for `heartbeat_timeout_s` seconds after start-up (dead, SIGSTOPped, wedged), a failed extra check (`checks`: the
local torchrun's exit, kimi.server.WorkerProcess.check), or a step that takes longer than `step_timeout_s` raises
WorkerFailedError, which makes the engine fail every in-flight request and stop. The checks run at least every
LIVENESS_PERIOD_S: on a wait that times out, and after a step once that long has passed (steps shorter than a wait's
timeout would otherwise never trigger them under load).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from kimi import protocol
from kimi.errors import WorkerFailedError

# seconds between the controller's pings to the worker ranks: a heartbeat timeout must span more than one of them
# (kimi.server refuses --heartbeat-timeout below 2 x this, except 0 = off)
HEARTBEAT_S = 1.0
# the liveness checks run at least this often, s (module docstring)
LIVENESS_PERIOD_S = 0.5
# the longest single wait for a step's results before the checks run, s
RESULT_POLL_S = 0.5


class Liveness:
    """Pings and liveness checks of the worker ranks behind `transport` (a kimi.ipc.ControllerTransport; one without
    `silent_ranks` gets no heartbeat check).

    heartbeat_s: seconds between pings; heartbeat_timeout_s: silence after which a rank is dead (None: no heartbeat
    check); step_timeout_s: the longest a step may take; checks: callables returning an error message or None.
    The heartbeat clock starts at `start(world_size)` (every rank ready).
    """

    def __init__(self, transport: Any, heartbeat_s: float = HEARTBEAT_S, step_timeout_s: float = 600.0) -> None:
        self.transport = transport
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s: float | None = 10.0
        self.step_timeout_s = step_timeout_s
        self.checks: list[Callable[[], str | None]] = []
        self.world_size = 0
        self._alive_since: float | None = None  # set by start(): every rank ready
        self._last_ping = 0.0
        self._last_check = time.monotonic()
        self._ping_seq = itertools.count(1 << 20)

    def start(self, world_size: int) -> None:
        """Every rank is ready: heartbeats are checked from now on."""
        self.world_size = world_size
        self._alive_since = time.monotonic()

    def run_checks(self) -> None:
        """Raise WorkerFailedError with the first failing extra check's message."""
        for check in self.checks:
            err = check()
            if err:
                raise WorkerFailedError(err)

    def check(self, step: int) -> None:
        """Raise WorkerFailedError when an extra check or the heartbeat reports a dead worker (`step`: the engine's
        current step, named in the message)."""
        self._last_check = time.monotonic()
        self.run_checks()
        self._check_heartbeats(step)

    def due(self) -> bool:
        """Whether LIVENESS_PERIOD_S has passed since the last `check`."""
        return time.monotonic() - self._last_check >= LIVENESS_PERIOD_S

    async def tick(self, step: int) -> None:
        """A wait timed out: `check(step)`, then ping if one is due."""
        self.check(step)
        await self.maybe_ping()

    def _check_heartbeats(self, step: int) -> None:
        """Raise WorkerFailedError naming every rank not heard from for heartbeat_timeout_s (after start-up)."""
        since = self._alive_since
        t = self.transport
        if self.heartbeat_timeout_s is None or since is None or not hasattr(t, "silent_ranks"):
            return
        t.drain_nowait()  # never called while a recv is in progress
        silent = t.silent_ranks(self.world_size, self.heartbeat_timeout_s, since)
        if silent:
            steps = ", ".join(f"rank {r}: step {t.last_step.get(r, 0)}" for r in silent)
            raise WorkerFailedError(
                f"worker rank(s) {silent} stopped answering: no heartbeat for {self.heartbeat_timeout_s:g} s "
                f"(last step reported: {steps}; current step {step})",
                ranks=tuple(silent),
                step=step,
            )

    async def maybe_ping(self) -> None:
        """Ping every rank when heartbeat_s has passed since the last ping (the ranks' heartbeat threads answer with
        Pong; their absence is what the heartbeat check catches)."""
        now = time.monotonic()
        if now - self._last_ping >= self.heartbeat_s:
            self._last_ping = now
            await self.transport.send(protocol.Ping(next(self._ping_seq)))

    def result_wait(self, step: int, started: float, answered: set[int]) -> float:
        """Seconds to wait for the next result of `step` (sent at monotonic `started`; `answered`: the ranks whose
        result came), at most RESULT_POLL_S. Raises WorkerFailedError naming the missing ranks once the step has taken
        step_timeout_s."""
        left = started + self.step_timeout_s - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(self.world_size)) - answered)
            raise WorkerFailedError(
                f"step {step}: no result from rank(s) {missing} within {self.step_timeout_s:.0f} s",
                ranks=tuple(missing),
                step=step,
            )
        return min(left, RESULT_POLL_S)

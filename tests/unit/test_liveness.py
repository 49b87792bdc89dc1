"""kimi.controller.liveness over real loopback ZeroMQ sockets (kimi.ipc) and a real worker heartbeat thread: a rank
that answers pings passes, one that stops is named; extra checks and the step timeout raise with their reasons."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq.asyncio

from kimi.controller.liveness import RESULT_POLL_S, Liveness
from kimi.ipc import ControllerTransport, Heartbeat


def test_heartbeats_pass_then_a_silent_rank_is_named():
    async def body() -> None:
        ctx = zmq.asyncio.Context()
        t = ControllerTransport("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", ctx)
        hb = Heartbeat(t.plan_addr, t.result_addr, rank=0, controller_timeout_s=60.0).start()
        try:
            live = Liveness(t, heartbeat_s=0.05)
            live.heartbeat_timeout_s = 1.0
            live.start(1)
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:  # answered pings keep the rank alive for several timeouts
                await live.tick(step=5)
                await asyncio.sleep(0.05)
            assert 0 in t.last_seen
            hb.stop()
            with pytest.raises(RuntimeError, match=r"worker rank\(s\) \[0\] stopped answering.*current step 7"):
                deadline = time.monotonic() + 30.0
                while time.monotonic() < deadline:
                    await live.tick(step=7)
                    await asyncio.sleep(0.05)
        finally:
            hb.stop()
            t.close()
            ctx.term()

    asyncio.run(body())


def test_checks_and_step_timeout():
    live = Liveness(transport=None, step_timeout_s=2.0)
    live.run_checks()  # none
    live.checks.append(lambda: None)
    live.checks.append(lambda: "worker process exited with code 1")
    with pytest.raises(RuntimeError, match="worker process exited with code 1"):
        live.check(step=1)  # no heartbeat check before start(): the extra checks only
    live.start(3)
    now = time.monotonic()
    assert 0 < live.result_wait(4, now, {0}) <= RESULT_POLL_S
    with pytest.raises(RuntimeError, match=r"step 4: no result from rank\(s\) \[1, 2\] within 2 s"):
        live.result_wait(4, now - 2.5, {0})

"""ZeroMQ sockets between the controller and the workers, for both sides (kimi.controller and kimi.worker).

The controller binds a PUB socket (step plans, pings, shutdown: every rank receives every message) and a
PULL socket (ready, step results, errors from all ranks). Workers connect a SUB and a PUSH socket.
Messages are msgspec/msgpack (kimi.protocol). A PUB socket drops messages for subscribers that have not
connected yet, so the controller keeps pinging until every rank has answered `Ready`.

Heartbeats: the controller pings about once a second, also while a step runs; each rank's `Heartbeat`
thread has its own SUB socket subscribed only to `Ping` (a ZeroMQ prefix filter on the msgpack header, so
step plans never reach it) and answers `Pong(rank, seq, step)` on its own PUSH socket, whatever the rank's
main thread is doing (a long forward, a collective waiting for a peer). `ControllerTransport` records when
each rank was last heard from (any message) and swallows the pongs; `silent_ranks` names the ranks that
have gone quiet. A SIGSTOPped or dead rank answers nothing and is caught within the heartbeat timeout.
The heartbeat thread also ends its process (`os._exit`) when the controller's pings stop for longer than
the controller timeout, which frees a rank whose main thread is stuck in a collective.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import socket
import threading
import time
from typing import TypeAlias, TypeGuard

import msgspec
import zmq
import zmq.asyncio

from kimi import protocol

log = logging.getLogger(__name__)

# A Ping is a msgpack array [tag, seq]: its first two bytes (array header, tag) identify it on the wire.
PING_PREFIX = protocol.encode(protocol.Ping(0))[:2]
assert all(protocol.encode(protocol.Ping(s))[:2] == PING_PREFIX for s in (-1, 1, 1 << 40))


_PORT_RANGE = (20000, 32768)  # below Linux's default ephemeral range, 32768-60999
_ports_given: set[int] = set()


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago, for a socket that some process binds later.

    Chosen at random in [20000, 32768), below the kernel's default ephemeral range: sockets bound to port 0 (ZeroMQ's
    `tcp://HOST:*`, torchrun's store) and outgoing connections take ephemeral ports, so they cannot take this one
    between now and its use (a port-0 probe could be handed out again that way). Not the same port twice in a
    process. Falls back to a port-0 probe when 200 tries find nothing free.
    """
    for _ in range(200):
        port = random.randrange(*_PORT_RANGE)
        if port in _ports_given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _ports_given.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


WorkerReply: TypeAlias = protocol.Ready | protocol.StepResult | protocol.WorkerError
"""What a worker rank sends the controller, other than a `Pong`."""


class ControllerTransport:
    """Controller side: `send` broadcasts to all ranks, `recv` yields the next message from any rank.

    plan_addr / result_addr: ZeroMQ bind addresses; `tcp://HOST:*` binds a free port, and the attributes of
    the same names then hold the bound endpoints. Raises zmq.ZMQError if an address cannot be bound.
    `recv` never returns a `Pong`: pongs only refresh `last_seen` (monotonic seconds per rank, updated by
    every message that names a rank) and `last_step`. `drain_nowait` reads what is queued without waiting
    (for the idle loop, where nobody calls recv); `silent_ranks` lists ranks not heard from lately.
    """

    def __init__(self, plan_addr: str, result_addr: str, ctx: zmq.asyncio.Context | None = None) -> None:
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.bind(plan_addr)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(result_addr)
        # the bound endpoints (a `tcp://HOST:*` address binds a free port; workers need the real one)
        self.plan_addr = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.result_addr = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self.last_seen: dict[int, float] = {}
        self.last_step: dict[int, int] = {}
        self._pending: collections.deque[WorkerReply] = collections.deque()
        self._pull_sync: zmq.Socket[bytes] = zmq.Socket.shadow(
            self.pull.underlying
        )  # non-blocking reads outside a coroutine

    async def send(self, msg: msgspec.Struct) -> None:
        """Broadcast a Ping / StepPlan / Shutdown to every connected rank."""
        await self.pub.send(protocol.encode(msg))

    def _note(self, msg: WorkerReply | protocol.Pong) -> TypeGuard[WorkerReply]:
        """Record liveness; True if msg is for the caller (not a Pong)."""
        rank = getattr(msg, "rank", None)
        if rank is not None:
            self.last_seen[rank] = time.monotonic()
        if isinstance(msg, protocol.Pong):
            self.last_step[msg.rank] = msg.step
            return False
        return True

    async def recv(self) -> WorkerReply:
        """The next non-Pong message from any rank (waits; cancel-safe). Raises msgspec.DecodeError on garbage."""
        if self._pending:
            return self._pending.popleft()
        while True:
            msg = protocol.decode_from_worker(await self.pull.recv())
            if self._note(msg):
                return msg

    def drain_nowait(self) -> None:
        """Read every message already queued, without waiting: pongs are recorded, others kept for `recv`.
        Call only when no `recv` is in progress."""
        while True:
            try:
                data = self._pull_sync.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = protocol.decode_from_worker(data)
            if self._note(msg):
                self._pending.append(msg)

    def silent_ranks(self, world_size: int, timeout_s: float, since: float) -> list[int]:
        """Ranks in [0, world_size) not heard from within `timeout_s` seconds, counting from `since`
        (monotonic) for a rank never heard from."""
        now = time.monotonic()
        return [r for r in range(world_size) if now - max(self.last_seen.get(r, since), since) > timeout_s]

    def close(self) -> None:
        """Close both sockets (pending messages are dropped)."""
        self.pub.close(0)
        self.pull.close(0)


class WorkerTransport:
    """Worker side (blocking sockets: a worker does one thing at a time)."""

    def __init__(self, plan_addr: str, result_addr: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(plan_addr)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 2000)
        self.push.connect(result_addr)

    def recv(self, timeout_s: float) -> protocol.StepPlan | protocol.Ping | protocol.Shutdown | None:
        """The next controller message, or None if nothing came within timeout_s."""
        if not self.sub.poll(int(timeout_s * 1000)):
            return None
        return protocol.decode_to_worker(self.sub.recv())

    def send(self, msg: msgspec.Struct) -> None:
        self.push.send(protocol.encode(msg))

    def close(self) -> None:
        self.sub.close(0)
        self.push.close()
        self.ctx.term()


class Heartbeat:
    """A worker's heartbeat thread: answers every controller `Ping` with `Pong(rank, seq, step)` on sockets of
    its own, so the answer comes even while the main thread is busy or blocked.

    `step` is read from `self.step` (the main thread sets it after each step). When no Ping arrives for
    `controller_timeout_s`, the controller is gone: the thread logs and ends the process with `os._exit(1)`
    (the main thread may be stuck in a collective and cannot notice). `stop()` ends the thread.
    """

    def __init__(self, plan_addr: str, result_addr: str, rank: int, controller_timeout_s: float) -> None:
        self.rank = rank
        self.step = 0
        self.controller_timeout_s = controller_timeout_s
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, PING_PREFIX)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(plan_addr)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(result_addr)
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-rank{rank}", daemon=True)

    def start(self) -> Heartbeat:
        """Start answering pings; returns self."""
        self._thread.start()
        return self

    def _run(self) -> None:
        last = time.monotonic()
        try:
            while not self._stop.is_set():
                if self._sub.poll(200):
                    msg = protocol.decode_to_worker(self._sub.recv())
                    last = time.monotonic()
                    if isinstance(msg, protocol.Ping):
                        self._push.send(protocol.encode(protocol.Pong(self.rank, msg.seq, self.step)))
                elif time.monotonic() - last > self.controller_timeout_s:
                    log.error(
                        "rank %d: no ping from the controller for %.0f s; exiting", self.rank, self.controller_timeout_s
                    )
                    os._exit(1)
        finally:
            self._sub.close(0)
            self._push.close(0)

    def stop(self) -> None:
        """Stop the thread (waits up to a second) and free its sockets."""
        self._stop.set()
        self._thread.join(1.0)
        if not self._thread.is_alive():
            self._ctx.term()

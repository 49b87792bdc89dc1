"""ZeroMQ sockets between the controller and the workers.

The controller binds a PUB socket (step plans, pings, shutdown: every rank receives every message) and a
PULL socket (ready, step results, errors from all ranks). Workers connect a SUB and a PUSH socket.
Messages are msgspec/msgpack (kimi.protocol). A PUB socket drops messages for subscribers that have not
connected yet, so the controller keeps pinging until every rank has answered `Ready`.
"""

from __future__ import annotations

import socket

import msgspec
import zmq
import zmq.asyncio

from kimi import protocol


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ControllerTransport:
    """Controller side: `send` broadcasts to all ranks, `recv` yields the next message from any rank."""

    def __init__(self, plan_addr: str, result_addr: str, ctx: zmq.asyncio.Context | None = None) -> None:
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.bind(plan_addr)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(result_addr)
        self.plan_addr = plan_addr
        self.result_addr = result_addr

    async def send(self, msg: msgspec.Struct) -> None:
        await self.pub.send(protocol.encode(msg))

    async def recv(self) -> protocol.Ready | protocol.StepResult | protocol.WorkerError:
        return protocol.decode_from_worker(await self.pull.recv())

    def close(self) -> None:
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

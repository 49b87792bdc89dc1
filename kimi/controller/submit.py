"""The ZeroMQ programmatic submit API, controller side (ROUTER socket; see kimi.client for the other end).

A client sends `SubmitRequest` / `AbortRequest` (msgspec, kimi.protocol) and receives a stream of
`RequestOutput` deltas per request id, the last with `finished=True` (a finish_reason or an error).
Invalid submissions are answered with a finished output carrying the error; nothing else changes.
Request ids are scoped per client connection.
"""

from __future__ import annotations

import asyncio
import logging
import math

import msgspec
import zmq
import zmq.asyncio

from kimi import protocol
from kimi.controller.engine import AdmissionError, Engine, EngineDead
from kimi.controller.request import StopParams
from kimi.protocol import RequestOutput, SamplingParams
from kimi.tokenizer import KimiTokenizer

log = logging.getLogger("kimi.submit")


class SubmitServer:
    def __init__(self, engine: Engine, tokenizer: KimiTokenizer, addr: str, vocab_size: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr)
        self.addr = addr
        self._tasks: set[asyncio.Task] = set()

    def _key(self, ident: bytes, request_id: str) -> str:
        return f"zmq-{ident.hex()}-{request_id}"

    async def _reply(self, ident: bytes, out: RequestOutput) -> None:
        await self.sock.send_multipart([ident, protocol.encode(out)])

    def _error(self, request_id: str, msg: str) -> RequestOutput:
        return RequestOutput(request_id=request_id, token_ids=[], text="", finished=True, error=msg)

    def _validate(self, r: protocol.SubmitRequest) -> tuple[list[int], SamplingParams, StopParams]:
        if (r.prompt is None) == (r.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        if r.prompt is not None:
            if not r.prompt:
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer.encode(r.prompt)
        else:
            ids = list(r.prompt_token_ids)
        if not (math.isfinite(r.temperature) and 0.0 <= r.temperature <= 2.0):
            raise ValueError(f"temperature must be in [0, 2], got {r.temperature}")
        if not (math.isfinite(r.top_p) and 0.0 < r.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {r.top_p}")
        if not 0 <= r.top_k < 2**63:
            raise ValueError(f"top_k must be in [0, 2**63), got {r.top_k}")
        if r.seed is not None and not -(2**63) <= r.seed < 2**63:
            raise ValueError(f"seed must be a signed 64-bit integer, got {r.seed}")
        bad = [t for t in r.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids holds {bad[0]}, outside the vocabulary")
        if r.logprobs is not None and not 0 <= r.logprobs <= 20:
            raise ValueError("logprobs must be in [0, 20]")
        sp = SamplingParams(
            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=r.seed,
            num_logprobs=-1 if r.logprobs is None else r.logprobs,
        )
        st = StopParams(max_tokens=r.max_tokens, stop_token_ids=frozenset(r.stop_token_ids), ignore_eos=r.ignore_eos)
        return ids, sp, st

    async def _run_one(self, ident: bytes, r: protocol.SubmitRequest) -> None:
        try:
            ids, sp, st = self._validate(r)
            stream = await self.engine.generate(self._key(ident, r.request_id), ids, sp, st, r.skip_special_tokens)
        except (ValueError, AdmissionError, EngineDead) as e:
            await self._reply(ident, self._error(r.request_id, str(e)))
            return
        async for out in stream:
            await self._reply(ident, msgspec.structs.replace(out, request_id=r.request_id))

    async def serve(self) -> None:
        """Receive submissions until cancelled."""
        while True:
            frames = await self.sock.recv_multipart()
            ident = frames[0]
            if len(frames) != 2:  # a DEALER sends one frame per message; anything else is malformed
                await self._reply(ident, self._error("", f"malformed message: {len(frames) - 1} frames, expected 1"))
                continue
            data = frames[1]
            try:
                msg = protocol.decode_to_controller(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                await self._reply(ident, self._error("", f"malformed message: {e}"))
                continue
            if isinstance(msg, protocol.AbortRequest):
                self.engine.abort(self._key(ident, msg.request_id))
                continue
            t = asyncio.create_task(self._run_one(ident, msg))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.sock.close(0)

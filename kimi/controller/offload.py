"""Tokenization of large inputs off the controller's event loop.

The controller is one asyncio process: while the loop runs a request's tokenization nothing else moves (health
checks, other requests' streams, the engine's steps). With the Kimi vocabulary a 30 MB prompt took 2.4 s to encode
on the development machine (before kimi.tokenizer's long-run cut search moved into one regex: now ~40 ns per
character, 0.51 s for 12 MB), and a /health call sent meanwhile waited 1.8 s. tiktoken releases the GIL while it
encodes (the loop thread stayed responsive within 37 ms during that 2.4 s encode in a worker thread), so inputs from
OFFLOAD_CHARS characters on are tokenized in a worker thread and awaited; smaller ones inline (a thread hop costs
about what encoding them does). tests/e2e/test_api_edges.py checks /health latency during a 24 MB prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

OFFLOAD_CHARS = 1 << 16  # 64 Ki characters (bytes for a whole request body): a few ms of encoding


async def run_sized(size: int, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), run in a worker thread (asyncio.to_thread) when `size` (the input's length in characters, or a
    request body's in bytes) is at least OFFLOAD_CHARS, else inline. fn's exceptions propagate unchanged."""
    if size >= OFFLOAD_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)

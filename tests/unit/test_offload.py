"""kimi.controller.offload.run_sized: inline below OFFLOAD_CHARS, in a worker thread from it on; results and
exceptions come back unchanged."""

import asyncio
import threading

import pytest

from kimi.controller.offload import OFFLOAD_CHARS, run_sized


def _where(x):
    return threading.get_ident(), x * 2


def _boom(msg):
    raise ValueError(msg)


def test_small_inputs_run_inline_and_large_ones_in_a_thread():
    async def main():
        me = threading.get_ident()
        small = await run_sized(OFFLOAD_CHARS - 1, _where, 3)
        large = await run_sized(OFFLOAD_CHARS, _where, 4)
        return me, small, large

    me, (t_small, v_small), (t_large, v_large) = asyncio.run(main())
    assert (v_small, v_large) == (6, 8)
    assert t_small == me and t_large != me


@pytest.mark.parametrize("size", [1, OFFLOAD_CHARS * 4])
def test_exceptions_propagate(size):
    with pytest.raises(ValueError, match="bad prompt"):
        asyncio.run(run_sized(size, _boom, "bad prompt"))

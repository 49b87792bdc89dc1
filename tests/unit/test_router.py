"""DPRouter placement: by request count, then KV in use, with the prefix-affinity hook."""

from __future__ import annotations

from kimi.config import SchedulerConfig
from kimi.controller.block_pool import BlockPool
from kimi.controller.router import DPRouter
from kimi.controller.scheduler import Scheduler


class _Req:
    def __init__(self) -> None:
        self.dp_rank = -1
        self.status = None


def test_router_balances_then_follows_kv_and_affinity():
    scheds = [Scheduler(SchedulerConfig(), BlockPool(11, 16), dp_rank=r) for r in range(3)]
    router = DPRouter(scheds, affinity_tokens_per_request=256)
    placed = []
    for _ in range(6):
        r = router.choose()
        scheds[r].add(_Req())
        placed.append(r)
    assert placed == [0, 1, 2, 0, 1, 2]  # equal load: round robin through the tie-break
    scheds[0].block_pool.allocate(5)  # rank 0 holds more KV at the same request count
    assert router.choose() == 1
    # 512 cached prompt tokens on rank 2 outweigh one extra queued request there
    scheds[2].add(_Req())
    assert router.choose(lambda r: 512 if r == 2 else 0) == 2
    assert router.choose(lambda r: 100 if r == 2 else 0) == 1

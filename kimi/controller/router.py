"""DP router: which data-parallel rank a new request runs on.

Placement by load: fewest running + waiting requests, then fewest KV blocks in use, then lowest rank.
`affinity` is the hook for prefix-cache affinity (a rank that already holds the request's prefix): when
given, it maps a rank to a bonus in tokens that lowers that rank's load score.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kimi.controller.scheduler import Scheduler


class DPRouter:
    def __init__(self, schedulers: Sequence[Scheduler]) -> None:
        self.schedulers = list(schedulers)

    def choose(self, affinity: Callable[[int], int] | None = None) -> int:
        """The DP rank for a new request."""

        def load(i: int) -> tuple[float, int, int]:
            s = self.schedulers[i]
            n = len(s.running) + len(s.waiting)
            bonus = affinity(i) / max(s.block_pool.block_size, 1) if affinity else 0
            return (n - bonus * 1e-3, s.block_pool.num_used_blocks, i)

        return min(range(len(self.schedulers)), key=load)

"""DP router: which data-parallel rank a new request runs on.

Each DP rank has its own scheduler (waiting queue, running list) and BlockPool (its own KV cache), so a
request is placed once, at admission, and stays on its rank (preemption re-queues it on the same rank).

Score of rank i (lowest wins, ties to the lowest rank):

    requests(i) + kv_used_fraction(i) - affinity(i) / affinity_tokens_per_request

- requests: running + waiting requests (every request costs a decode slot and a share of the step);
- kv_used_fraction: KV blocks in use / usable blocks, in [0, 1]: between ranks with as many requests, the
  one with more free KV wins (and a rank that is nearly full loses up to one request's worth);
- affinity (the prefix-cache hook): tokens of the request's prompt that rank i already holds in its prefix
  cache; `affinity_tokens_per_request` cached tokens are worth one queued request (default 256), so a long
  shared prefix pulls a request to the rank that holds it unless that rank is clearly busier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kimi.controller.scheduler import Scheduler


class DPRouter:
    """Places requests on DP ranks by load (see the module docstring). `schedulers[i]` is rank i's."""

    def __init__(self, schedulers: Sequence[Scheduler], affinity_tokens_per_request: int = 256) -> None:
        self.schedulers = list(schedulers)
        self.affinity_tokens_per_request = affinity_tokens_per_request

    def score(self, i: int, affinity_tokens: int = 0) -> float:
        """Rank i's load score for a request of which rank i caches `affinity_tokens` prompt tokens."""
        s = self.schedulers[i]
        pool = s.block_pool
        used = pool.num_used_blocks / max(pool.num_usable_blocks, 1)
        return len(s.running) + len(s.waiting) + used - affinity_tokens / self.affinity_tokens_per_request

    def choose(self, affinity: Callable[[int], int] | None = None) -> int:
        """The DP rank for a new request. `affinity(rank)` -> cached prompt tokens on that rank (optional)."""
        return min(range(len(self.schedulers)), key=lambda i: (self.score(i, affinity(i) if affinity else 0), i))

"""Prometheus metrics for `GET /metrics` (prometheus-client, one CollectorRegistry per server).

Names follow vLLM's where one exists, under the `kimi:` prefix (vLLM uses `vllm:`):

- gauges, read from the engine at scrape time: `kimi:num_requests_running`, `kimi:num_requests_waiting`,
  `kimi:kv_cache_used_blocks`, `kimi:kv_cache_total_blocks`;
- counters, read from the engine at scrape time: `kimi:prompt_tokens_total` (prompt tokens of admitted
  requests), `kimi:generation_tokens_total` (tokens sampled), `kimi:prefix_cache_queries_total` /
  `kimi:prefix_cache_hits_total` (prompt tokens looked up in / found in the prefix cache; 0 when the
  engine has no prefix cache), `kimi:num_preemptions_total` (requests preempted because KV blocks ran out,
  summed over DP ranks), `kimi:request_success_total{finished_reason}` (requests that ended, by
  finish reason: stop, length, abort, error; each reason exported from the start, at 0);
- speculative decoding counters (only with `--speculative-config`), vLLM's names: `kimi:spec_decode_num_drafts_total`
  (verify steps of a request), `kimi:spec_decode_num_draft_tokens_total` (draft tokens verified),
  `kimi:spec_decode_num_accepted_tokens_total` (accepted), `kimi:spec_decode_num_accepted_tokens_per_pos_total
  {position}` (accepted at draft position i, 0-based); mean accepted length = 1 + accepted / drafts;
- histograms, observed by the engine's hooks (`Engine.observer`), in seconds:
  `kimi:time_to_first_token_seconds` (arrival to the first sampled token),
  `kimi:inter_token_latency_seconds` (between consecutive sampled tokens of one request),
  `kimi:e2e_request_latency_seconds` (arrival to the end, any reason).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import metrics as _prom_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

FINISH_REASONS = ("stop", "length", "abort", "error")  # the finished_reason values of kimi:request_success_total
ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/responses",
)  # the endpoint values of kimi:http_requests_total

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class LatencyHistogram(Collector):
    """A Prometheus histogram whose `observe` is one bisect and two additions.

    prometheus_client's Histogram takes a lock for the sum, and for the bucket, on every observation; the
    engine observes the inter-token latency of every running request on every step (1024 per step at 1024
    streams), all on the event loop's thread, so no lock is needed. The exposition is the same as
    prometheus_client.Histogram's: `_bucket{le}` (cumulative), `_count`, `_sum` and, unless created series are
    disabled in prometheus_client, `_created`.
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = [float(b) for b in buckets] + [float("inf")]
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative; a value v lands in the first b >= v
        self.sum = 0.0
        self.created = time.time()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def collect(self) -> Iterator[Any]:
        fam = HistogramMetricFamily(self.name, self.documentation)
        acc = 0
        buckets = []
        for bound, n in zip(self.bounds, self.counts):
            acc += n
            buckets.append((floatToGoString(bound), float(acc)))
        fam.add_metric([], buckets, float(self.sum))
        if getattr(_prom_metrics, "_use_created", True):
            fam.add_sample(self.name + "_created", {}, self.created)
        yield fam


class _EngineCollector(Collector):
    """Reads gauges and counters from the engine on every scrape (no state of its own)."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Any]:
        e = self.m.engine
        ready = bool(getattr(e, "ready", False))
        yield GaugeMetricFamily(
            "kimi:num_requests_running",
            "Requests scheduled on the workers (prefill or decode).",
            value=e.num_running if ready else 0,
        )
        yield GaugeMetricFamily(
            "kimi:num_requests_waiting", "Requests waiting to be scheduled.", value=e.num_waiting if ready else 0
        )
        yield GaugeMetricFamily(
            "kimi:kv_cache_used_blocks",
            "KV-cache blocks in use by requests, summed over DP ranks.",
            value=e.num_used_blocks if ready else 0,
        )
        total = sum(s.block_pool.num_usable_blocks for s in e.schedulers) if ready else 0
        yield GaugeMetricFamily(
            "kimi:kv_cache_total_blocks", "Usable KV-cache blocks, summed over DP ranks.", value=total
        )
        yield CounterMetricFamily(
            "kimi:prompt_tokens", "Prompt tokens of admitted requests.", value=e.stats.prompt_tokens
        )
        yield CounterMetricFamily("kimi:generation_tokens", "Tokens sampled.", value=e.stats.generation_tokens)
        pc = getattr(e, "prefix_cache_stats", None) if ready else None
        queries = int(pc.get("queries", 0)) if isinstance(pc, dict) else 0
        hits = int(pc.get("hits", 0)) if isinstance(pc, dict) else 0
        yield CounterMetricFamily(
            "kimi:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", value=queries
        )
        yield CounterMetricFamily("kimi:prefix_cache_hits", "Prompt tokens found in the prefix cache.", value=hits)
        preempted = int(pc.get("preemptions", 0)) if isinstance(pc, dict) else 0
        yield CounterMetricFamily(
            "kimi:num_preemptions", "Requests preempted (KV blocks ran out; recomputed later).", value=preempted
        )
        done = CounterMetricFamily(
            "kimi:request_success", "Requests that ended, by finish reason.", labels=["finished_reason"]
        )
        for reason, n in sorted({**dict.fromkeys(FINISH_REASONS, 0), **self.m.finished}.items()):
            done.add_metric([reason], n)  # every reason from the start (0), so rates exist before the first one
        yield done
        admitted = CounterMetricFamily(
            "kimi:http_requests", "Generation requests admitted, by HTTP endpoint.", labels=["endpoint"]
        )
        for endpoint, n in sorted({**dict.fromkeys(ENDPOINTS, 0), **self.m.requests}.items()):
            admitted.add_metric([endpoint], n)
        yield admitted
        yield from _spec_decode_metrics(e)


def _spec_decode_metrics(e: Any) -> Iterator[Any]:
    """vLLM's speculative-decoding counters under kimi's prefix, summed over DP ranks (kimi.controller.scheduler.
    SpecDecodeStats); none when speculative decoding is off (num_speculative_tokens 0)."""
    stats = [s.spec for s in getattr(e, "schedulers", ()) if getattr(s, "spec", None) is not None]
    k = max((len(st.accepted_per_pos) for st in stats), default=0)
    if k == 0:
        return
    yield CounterMetricFamily(
        "kimi:spec_decode_num_drafts",
        "Verify steps of a request (one draft each).",
        value=sum(st.num_drafts for st in stats),
    )
    yield CounterMetricFamily(
        "kimi:spec_decode_num_draft_tokens",
        "Draft tokens verified.",
        value=sum(st.num_draft_tokens for st in stats),
    )
    yield CounterMetricFamily(
        "kimi:spec_decode_num_accepted_tokens",
        "Draft tokens accepted.",
        value=sum(st.num_accepted_tokens for st in stats),
    )
    per_pos = CounterMetricFamily(
        "kimi:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0-based).",
        labels=["position"],
    )
    for i in range(k):
        per_pos.add_metric([str(i)], sum(st.accepted_per_pos[i] for st in stats if i < len(st.accepted_per_pos)))
    yield per_pos


class Metrics:
    """The server's metrics: a private registry, the engine collector and the latency histograms.

    Attach with `engine.observer = metrics`; the engine then calls `on_token` before each sampled token is
    applied and `on_finish` when a request ends. `render()` returns the Prometheus text exposition.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=False)
        self.finished: dict[str, int] = {}
        self.requests: dict[str, int] = {}  # endpoint -> generation requests admitted through it
        self._last_token: dict[int, float] = {}
        self.registry.register(_EngineCollector(self))
        self.ttft = LatencyHistogram(
            "kimi:time_to_first_token_seconds", "Arrival to first sampled token (s).", _LATENCY_BUCKETS, self.registry
        )
        self.itl = LatencyHistogram(
            "kimi:inter_token_latency_seconds",
            "Time between consecutive sampled tokens (s).",
            _LATENCY_BUCKETS,
            self.registry,
        )
        self.e2e = LatencyHistogram(
            "kimi:e2e_request_latency_seconds",
            "Arrival to end of request, any reason (s).",
            _LATENCY_BUCKETS,
            self.registry,
        )

    def on_token(self, req: Any, now: float) -> None:
        """One sampled token of `req` at monotonic time `now` (s): TTFT for the first, ITL after that."""
        rid = req.rid
        last_token = self._last_token
        last = last_token.get(rid)
        if last is None:
            if req.first_token_time is None:
                self.ttft.observe(max(0.0, now - req.arrival_time))
        else:
            itl = self.itl  # inlined LatencyHistogram.observe: this runs for every token
            v = now - last if now > last else 0.0
            itl.counts[bisect_left(itl.bounds, v)] += 1
            itl.sum += v
        last_token[rid] = now

    def on_request(self, endpoint: str) -> None:
        """A generation request was admitted through the HTTP route `endpoint` (e.g. "/v1/messages")."""
        self.requests[endpoint] = self.requests.get(endpoint, 0) + 1

    def on_finish(self, req: Any, now: float) -> None:
        """`req` ended (finish_reason set, or None for an error) at monotonic time `now` (s)."""
        self._last_token.pop(req.rid, None)
        reason = req.finish_reason or "error"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.e2e.observe(max(0.0, now - req.arrival_time))

    def render(self) -> bytes:
        """The Prometheus text format (version 0.0.4) of every metric."""
        return generate_latest(self.registry)

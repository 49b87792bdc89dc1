"""kimi.benchmarks.startup's log readers on a server log of the real format (the controller's and a rank's
logging.basicConfig formats, kimi/server.py and kimi/worker/main.py)."""

from __future__ import annotations

import time

from kimi.benchmarks.startup import parse_log, timeline

LOG = """\
2026-12-04 04:20:00,500 kimi.server INFO HTTP on http://127.0.0.1:8000 (/health says "loading" until ...)
[W1204 04:20:01 torchrun] a line without a timestamp
2026-12-04 04:20:03,000 rank0 INFO rank 0 of 1: all-to-all backend local
2026-12-04 04:20:13,250 rank0 INFO rank 0: weights loaded in 10.2 s
2026-12-04 04:20:15,400 rank0 INFO captured 7 decode CUDA graphs (buckets [1, 2, 4, 8, 16, 24, 32]) in 2.1 s
2026-12-04 04:20:20,600 rank0 INFO warm-up in 5.2 s: kernel variants 0.3 s (0 steps), guided compile 0.2 s (1 steps), \
prefill 4.7 s (37 steps)
2026-12-04 04:20:20,700 kimi.controller.engine INFO rank 0 ready: 900 KV blocks of 64 tokens (block 0 is ...) on cuda:0
2026-12-04 04:20:21,000 kimi.server INFO ready: model 'kimi-k2.6' on http://127.0.0.1:8000, ZeroMQ submit API on ...
"""


def test_timeline_gives_seconds_from_launch_to_each_event():
    launched = time.mktime(time.strptime("2026-12-04 04:19:58", "%Y-%m-%d %H:%M:%S"))
    t = timeline(LOG, launched)
    assert t == {
        "controller logging": 2.5,
        "workers launched": 2.5,
        "rank 0 logging": 5.0,
        "rank 0 distributed init": 5.0,
        "rank 0 weights loaded": 15.2,
        "rank 0 graphs captured": 17.4,
        "rank 0 warm-up done": 22.6,
        "every rank ready": 22.7,
        "ready": 23.0,
    }
    assert list(t) == sorted(t, key=t.__getitem__)  # in start-up order
    assert timeline("no timestamps here\n", launched) == {}


def test_parse_log_reads_the_logged_parts():
    p = parse_log(LOG)
    assert p["weights_s"] == 10.2 and p["graphs_s"] == 2.1 and p["graph_buckets"] == [1, 2, 4, 8, 16, 24, 32]
    assert p["warmup_s"] == 5.2 and p["warmup_phases"] == {
        "kernel variants": (0.3, 0),
        "guided compile": (0.2, 1),
        "prefill": (4.7, 37),
    }

"""GPU timing pieces shared by the benchmarks and tuners in tools/.

`require_gpu` / `import_gpu_module`: a GPU benchmark imports its GPU packages guardedly, so that its --help works on a
CPU-only install, and refuses a run there with one line. `event_times`: CUDA-event times of back-to-back calls.
`copy_bandwidth`: the device-to-device copy bandwidth that every floor divides by. `GraphTimer`: one CUDA-graph replay
of a list of calls per sample (kernel benchmarks: no host launch cost, weights cycled past the L2). `sync_points`: where
a call makes the host wait for the device.
"""

from __future__ import annotations

import importlib
import statistics
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

# a weight pool at least this large (copies of W cycled call by call) is read from HBM, not from the 50 MB L2
MIN_POOL_BYTES = 512 << 20


def import_gpu_module(name: str) -> tuple[ModuleType | None, ImportError | None]:
    """(the top-level package, having imported `name` with it, e.g. "triton.testing" -> triton; None) or (None, the
    ImportError). GPU tools import their GPU packages through it (or a try block of their own) so that their --help
    works on a CPU-only install; main() then passes the error to require_gpu."""
    try:
        importlib.import_module(name)
    except ImportError as e:
        return None, e
    return importlib.import_module(name.partition(".")[0]), None


def require_gpu(prog: str, missing: BaseException | None = None) -> None:
    """Exit with one line when a GPU tool cannot run here: a GPU package failed to import (`missing`, caught at the
    tool's import so that its --help still works), or torch sees no CUDA device."""
    if missing is not None:
        raise SystemExit(f"{prog}: needs the GPU packages ({type(missing).__name__}: {missing})")
    if not torch.cuda.is_available():
        raise SystemExit(f"{prog}: needs a CUDA GPU (torch sees none)")


def event_times(fn: Callable[[], Any], iters: int, warmup: int = 3) -> list[float]:
    """fn's GPU time in ms, `iters` samples: CUDA events recorded around each call on the current stream, each call
    after the previous one has ended (the host waits on the end event), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return ts


def sync_points(fn: Callable[[], Any], frames: int = 6) -> list[dict]:
    """The device synchronisations one call of fn makes, found by torch.cuda.set_sync_debug_mode("warn") (each
    synchronising CUDA call warns): per distinct call site, how many times it synchronised and the innermost `frames`
    stack entries ("file:line function", the innermost last) in kimi's and the tools' files, most frequent first.
    An eager step that synchronises per layer leaves the GPU idle while the host launches the next layer."""
    import traceback
    import warnings

    sites: dict[tuple[str, ...], int] = {}

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        stack = [
            f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()[:-1]
            if "/kimi/" in f.filename or "/tools/" in f.filename
        ]
        key = tuple(stack[-frames:]) or (f"{filename}:{lineno}",)
        sites[key] = sites.get(key, 0) + 1

    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()
    return [{"count": n, "stack": list(k)} for k, n in sorted(sites.items(), key=lambda kv: -kv[1])]


def copy_bandwidth(nbytes: int, device: Any = "cuda", iters: int = 20, warmup: int = 3) -> dict:
    """HBM copy bandwidth: a device-to-device copy of `nbytes`, event-timed, median of `iters` copies.

    Returns {"bytes_per_copy", "median_ms", "GBps_read_plus_write"} (bytes read + written per second / 1e9,
    the usual way a copy's bandwidth is quoted).
    """
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)

    def copy(a: torch.Tensor = a, b: torch.Tensor = b) -> None:
        b.copy_(a)

    ms = statistics.median(event_times(copy, iters, warmup))
    del a, b, copy
    torch.cuda.empty_cache()
    return {"bytes_per_copy": nbytes, "median_ms": ms, "GBps_read_plus_write": 2 * nbytes / ms / 1e6}


def pick_shapes(spec: str, shapes: dict) -> list[str]:
    """The shape names of a comma-separated list, in order; SystemExit naming the first unknown one."""
    names = [s for s in spec.split(",") if s]
    for n in names:
        if n not in shapes:
            raise SystemExit(f"unknown shape {n!r}; known: {', '.join(shapes)}")
    return names


class GraphTimer:
    """Median microseconds per call of a list of calls replayed as one CUDA graph.

    One sample = one replay of the graph of all the calls, CUDA-event timed and divided by the number of calls; a
    torch.cuda._sleep before each sample lets the host queue the events and the replay before the GPU reaches them.
    Graphs are how the decode step runs, and they keep the host's launch cost (Triton's Python launcher takes tens
    of us) out of the measurement. The sleep is calibrated once (GPU cycles per us) at construction."""

    def __init__(self, samples: int):
        self.samples = samples
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        s.record()
        torch.cuda._sleep(2_000_000)
        e.record()
        e.synchronize()
        self.cycles_per_us = 2_000_000 / (s.elapsed_time(e) * 1e3)

    def sleep_us(self, us: float) -> None:
        torch.cuda._sleep(int(us * self.cycles_per_us))

    def time_calls(self, calls: list[Callable[[], Any]]) -> float:
        """Median microseconds per call of the list `calls` (each a no-arg callable), replayed as one graph."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for c in calls:
                c()
        g.replay()
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.samples)]
        for s, e in ev:
            self.sleep_us(60)
            s.record()
            g.replay()
            e.record()
        torch.cuda.synchronize()
        t = statistics.median(s.elapsed_time(e) for s, e in ev) * 1e3 / len(calls)
        del g
        return t


# The dense weights of one K2 decode step, name: (N, K) of y = x @ W.T: attention q_a + kv_a (merged), q_b, o_proj;
# the shared expert's gate_up and down; layer 0's dense MLP gate_up and down; lm_head
DENSE_SHAPES = {
    "qkv_a": (2112, 7168),
    "q_b": (12288, 1536),
    "o_proj": (7168, 8192),
    "shared_gate_up": (4096, 7168),
    "shared_down": (7168, 2048),
    "dense_gate_up": (36864, 7168),
    "dense_down": (7168, 18432),
    "lm_head": (163840, 7168),
}

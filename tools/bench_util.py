"""Shared pieces of the GPU benchmarks in tools/ (imported as a sibling module: the tools run as scripts)."""

from __future__ import annotations

import datetime
import os
import statistics
import time

import torch


def import_gpu_module(name: str):
    """(the top-level package, having imported `name` with it, e.g. "triton.testing" -> triton; None) or (None, the
    ImportError). GPU tools import their GPU packages through it (or a try block of their own) so that their --help
    works on a CPU-only install; main() then passes the error to require_gpu."""
    import importlib

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


def run_header(what: str, args) -> dict:
    """The common head of a benchmark's JSON: what, its arguments, GPU name, the versions of torch / FlashInfer /
    humming / Triton (None where not importable) and the date."""
    res: dict = {"what": what, "args": vars(args), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    for mod in ("flashinfer", "humming", "triton"):
        try:
            res[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing or broken package: recorded as None
            res[mod] = None
    return res


def copy_bandwidth(nbytes: int, device="cuda", iters: int = 20, warmup: int = 3) -> dict:
    """HBM copy bandwidth: a device-to-device copy of `nbytes`, event-timed, median of `iters` copies.

    Returns {"bytes_per_copy", "median_ms", "GBps_read_plus_write"} (bytes read + written per second / 1e9,
    the usual way a copy's bandwidth is quoted).
    """
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    for _ in range(warmup):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    ms = statistics.median(ts)
    del a, b
    torch.cuda.empty_cache()
    return {"bytes_per_copy": nbytes, "median_ms": ms, "GBps_read_plus_write": 2 * nbytes / ms / 1e6}


def out_paths(out: str | None, table_out: str | None, stem: str, table_name: str) -> tuple[str, str]:
    """(JSON path, table path) of a sweep: the given ones, else {stem}_{date}.json and table_name under $OUT if set,
    else under the repository's bench/."""
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")
    date = datetime.date.today().isoformat()
    return out or os.path.join(out_dir, f"{stem}_{date}.json"), table_out or os.path.join(out_dir, table_name)


def pick_shapes(spec: str, shapes: dict) -> list[str]:
    """The shape names of a comma-separated list, in order; SystemExit naming the first unknown one."""
    names = [s for s in spec.split(",") if s]
    for n in names:
        if n not in shapes:
            raise SystemExit(f"unknown shape {n!r}; known: {', '.join(shapes)}")
    return names

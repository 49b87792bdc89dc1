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
    res: dict = {
        "what": what,
        "args": vars(args),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for mod in ("flashinfer", "humming", "triton"):
        try:
            res[mod] = __import__(mod).__version__
        except Exception:
            res[mod] = None
    return res


def event_times(fn, iters: int, warmup: int = 3) -> list[float]:
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


def copy_bandwidth(nbytes: int, device="cuda", iters: int = 20, warmup: int = 3) -> dict:
    """HBM copy bandwidth: a device-to-device copy of `nbytes`, event-timed, median of `iters` copies.

    Returns {"bytes_per_copy", "median_ms", "GBps_read_plus_write"} (bytes read + written per second / 1e9,
    the usual way a copy's bandwidth is quoted).
    """
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    ms = statistics.median(event_times(lambda a=a, b=b: b.copy_(a), iters, warmup))
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


# bit 0x4 of nvidia-smi's clocks_throttle_reasons.active: the software power cap (the board at its power limit)
SW_POWER_CAP = 0x4


def parse_smi_sample(line: str) -> dict | None:
    """One line of GpuSampler's nvidia-smi query ("timestamp, clocks.sm, power.draw, power.limit, throttle reasons",
    csv, noheader, nounits) -> {"t": seconds since the epoch (local time, as time.time()), "sm_MHz", "power_W",
    "limit_W", "reasons": int}; None for a line that is not a sample ([N/A] fields, a header, an error)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 5:
        return None
    try:
        t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return {
            "t": t,
            "sm_MHz": float(parts[1]),
            "power_W": float(parts[2]),
            "limit_W": float(parts[3]),
            "reasons": int(parts[4], 16),
        }
    except ValueError:
        return None


def summarize_samples(samples: list[dict]) -> dict | None:
    """GpuSampler samples -> {"samples", "sm_clock_MHz": {median, p10, p90, min}, "power_W_median", "limit_W",
    "power_capped_fraction" (share of samples with SW_POWER_CAP set)}; None for no samples."""
    if not samples:
        return None
    clk = sorted(s["sm_MHz"] for s in samples)
    n = len(clk)
    return {
        "samples": n,
        "sm_clock_MHz": {
            "median": statistics.median(clk),
            "p10": clk[n // 10],
            "p90": clk[(9 * n) // 10],
            "min": clk[0],
        },
        "power_W_median": statistics.median(s["power_W"] for s in samples),
        "limit_W": samples[0]["limit_W"],
        "power_capped_fraction": round(sum(bool(s["reasons"] & SW_POWER_CAP) for s in samples) / n, 3),
    }


class GpuSampler:
    """The GPU's SM clock, power draw and clock throttle reasons, sampled by `nvidia-smi -lms interval_ms` in a
    background process from start() to stop(); `windows(spans)` summarizes the samples taken inside spans of
    time.time() stamps. Why: an H200 running the decode step sits at its 700 W power cap, where
    the SM clock moves between ~1.3 and 2.0 GHz and its median differs by machine (bench/power_2026-11-30_s14.json),
    so a step time means more next to the clock it ran at. Without nvidia-smi (or when it fails) there are no
    samples and windows() returns None; nothing raises."""

    QUERY = "timestamp,clocks.sm,power.draw,power.limit,clocks_throttle_reasons.active"

    def __init__(self, device=None, interval_ms: int = 50):
        self.device, self.interval_ms = device, interval_ms
        self.samples: list[dict] = []
        self._proc = self._reader = None

    def _gpu_id(self) -> str:
        props = torch.cuda.get_device_properties(
            self.device if self.device is not None else torch.cuda.current_device()
        )
        uuid = getattr(props, "uuid", None)
        return f"GPU-{uuid}" if uuid is not None else str(torch.cuda.current_device())

    def start(self) -> GpuSampler:
        import shutil
        import subprocess
        import threading

        if shutil.which("nvidia-smi") is None:
            return self
        self._proc = subprocess.Popen(
            [
                "nvidia-smi",
                "-i",
                self._gpu_id(),
                f"--query-gpu={self.QUERY}",
                "--format=csv,noheader,nounits",
                "-lms",
                str(self.interval_ms),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

        def read(proc=self._proc):
            for line in proc.stdout:
                s = parse_smi_sample(line)
                if s is not None:
                    self.samples.append(s)

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except Exception:
                self._proc.kill()
            self._reader.join(timeout=10)
            self._proc = None

    def windows(self, spans: list[tuple[float, float]]) -> dict | None:
        """summarize_samples of the samples taken inside any of the (t0, t1) time.time() spans."""
        return summarize_samples([s for s in list(self.samples) if any(t0 <= s["t"] <= t1 for t0, t1 in spans)])

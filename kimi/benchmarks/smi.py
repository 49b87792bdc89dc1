"""nvidia-smi's view of the GPU during a benchmark: the SM clock, power draw and clock throttle reasons.

Why: an H200 running the decode step sits at its 700 W power cap, where the SM clock moves between ~1.3 and 2.0 GHz
and settles at a median that differs from machine to machine; a step time means more next to the clock it ran at.
`GpuSampler` samples in a background `nvidia-smi -lms` process from start() to stop() and `windows(spans)`
summarizes the samples taken inside the benchmark's timings. Without nvidia-smi (or when it fails) there are no
samples and windows() returns None; nothing raises. The parsing and the summary are plain functions (CPU-tested).
"""

from __future__ import annotations

import datetime
import shutil
import statistics
import subprocess
import threading
from typing import Any

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


def query_gpu(fields: str = "name,driver_version,clocks.sm,power.limit") -> dict[str, str] | None:
    """nvidia-smi's values of `fields` for the first GPU ({field: text}), None without nvidia-smi or on an error."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    if not out:
        return None
    vals = [v.strip() for v in out[0].split(",")]
    names = fields.split(",")
    return dict(zip(names, vals)) if len(vals) == len(names) else None


class GpuSampler:
    """The GPU's SM clock, power draw and clock throttle reasons, sampled by `nvidia-smi -lms interval_ms` in a
    background process from start() to stop(); `windows(spans)` summarizes the samples taken inside spans of
    time.time() stamps (module docstring)."""

    QUERY = "timestamp,clocks.sm,power.draw,power.limit,clocks_throttle_reasons.active"

    def __init__(self, device: Any = None, interval_ms: int = 50):
        self.device, self.interval_ms = device, interval_ms
        self.samples: list[dict] = []
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def _gpu_id(self) -> str:
        import torch

        dev = self.device if self.device is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(dev), "uuid", None)
        return f"GPU-{uuid}" if uuid is not None else str(torch.cuda.current_device())

    def start(self) -> GpuSampler:
        if shutil.which("nvidia-smi") is None:
            return self
        cmd = ["nvidia-smi", "-i", self._gpu_id(), f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits"]
        proc = subprocess.Popen(
            [*cmd, "-lms", str(self.interval_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self._proc = proc

        def read(proc: subprocess.Popen = proc) -> None:
            assert proc.stdout is not None
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
            if self._reader is not None:
                self._reader.join(timeout=10)
            self._proc = None

    def windows(self, spans: list[tuple[float, float]]) -> dict | None:
        """summarize_samples of the samples taken inside any of the (t0, t1) time.time() spans."""
        return summarize_samples([s for s in list(self.samples) if any(t0 <= s["t"] <= t1 for t0, t1 in spans)])

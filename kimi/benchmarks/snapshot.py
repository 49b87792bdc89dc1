"""Benchmark snapshots: benchmarks/snapshots/<device>/<name>.json, one current file per benchmark and configuration.

Every maintained benchmark writes its snapshot through `write` when run with `--snapshot [ROOT]` (`add_arguments`;
ROOT defaults to the checkout's benchmarks/snapshots). A newer run of the same benchmark and configuration
overwrites the file, so `git log` of a file is its history. Every file has the same top-level shape:

    {"benchmark": "decode", "config": "int4-ep8", "command": "python tools/bench_decode.py ...",
     "conditions": {"date", "commit", "gpu", "driver", "torch", "cuda", ..., "sm_clock_MHz" where sampled},
     "summary": {"columns": [...], "rows": [[...], ...], "notes": [...]},
     "results": {the benchmark's full output}}

<device> is `h200` for an NVIDIA H200 (`device_key`), `cpu` for a benchmark that uses no GPU. `summary` is the
table docs/performance.md shows for the snapshot (kimi.benchmarks.performance renders it); `results` keeps
everything the run measured. This module imports neither torch nor a GPU package.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from kimi import envs
from kimi.benchmarks.smi import query_gpu

REPO = Path(__file__).resolve().parents[2]
DEFAULT_ROOT = REPO / "benchmarks" / "snapshots"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_PACKAGES = {"torch": "torch", "triton": "triton", "flashinfer": "flashinfer-python", "humming": "humming-kernels"}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The benchmarks' --help: the module docstring as written, every flag with its default."""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """`--snapshot [ROOT]` on a benchmark's parser (see the module docstring)."""
    ap.add_argument(
        "--snapshot",
        nargs="?",
        const=str(DEFAULT_ROOT),
        default=None,
        metavar="ROOT",
        help="write this run's snapshot to ROOT/<device>/<name>.json (ROOT given alone: the checkout's "
        "benchmarks/snapshots); without the flag no snapshot is written",
    )


def device_key(gpu_name: str | None) -> str:
    """The snapshot folder of a device: `cpu` for None, else the GPU's name without its vendor, lower case, runs of
    other characters as one '-' ("NVIDIA H200" -> "h200")."""
    if not gpu_name:
        return "cpu"
    name = re.sub(r"^(nvidia|amd)\s+", "", gpu_name.strip(), flags=re.IGNORECASE).lower()
    return re.sub(r"[^a-z0-9.]+", "-", name).strip("-") or "gpu"


def snapshot_name(benchmark: str, config: str = "") -> str:
    """The file stem of a snapshot: `benchmark` or `benchmark_config`. Raises ValueError for other characters than
    letters, digits, '.', '_' and '-'."""
    name = f"{benchmark}_{config}" if config else benchmark
    if not _NAME.match(name):
        raise ValueError(f"snapshot name {name!r}: letters, digits, '.', '_' and '-' only")
    return name


def command_line(argv: list[str] | None = None) -> str:
    """The command that reproduces this run: `python <script relative to the checkout> <args>`, with a --snapshot
    ROOT reduced to --snapshot (where a snapshot goes is not part of what was measured) and an --api-key's value
    replaced by `***`."""
    argv = list(sys.argv if argv is None else argv)
    script = os.path.abspath(argv[0]) if argv else "?"
    if script.startswith(str(REPO) + os.sep):
        script = os.path.relpath(script, REPO)
    args: list[str] = []
    rest = argv[1:]
    while rest:
        a = rest.pop(0)
        if a == "--snapshot":
            if rest and not rest[0].startswith("-"):
                rest.pop(0)
            args.append(a)
        elif a.startswith("--snapshot="):
            args.append("--snapshot")
        elif a == "--api-key":
            if rest:
                rest.pop(0)
            args += [a, "***"]
        elif a.startswith("--api-key="):
            args.append("--api-key=***")
        else:
            args.append(a)
    return " ".join(["python", shlex.quote(script), *(shlex.quote(a) for a in args)])


def git_commit() -> str | None:
    """$KIMI_GIT_COMMIT when set (a copy of the tree without .git, e.g. a device machine), else `git rev-parse HEAD`
    of the checkout with "-dirty" when tracked files differ from it; None when neither is known."""
    env = envs.KIMI_GIT_COMMIT.get()
    if env:
        return env
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        if not head:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _version(module: str, dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:  # e.g. a package carried onto PYTHONPATH without its metadata
        mod = sys.modules.get(module)
        return getattr(mod, "__version__", None) if mod is not None else None


def conditions(gpu: bool = True, **extra: Any) -> dict:
    """What a snapshot records about its run: date (UTC), commit, Python, the host (machine, CPUs, system), the
    versions of torch / Triton / FlashInfer / humming (None where not installed), and with gpu=True the
    GPU's name, driver, torch's CUDA version and nvidia-smi's SM clock and power limit when the snapshot is written;
    `extra` (e.g. sm_clock_MHz sampled during the timings, a load average) is added as given."""
    out: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
        "python": platform.python_version(),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
    }
    out.update({module: _version(module, dist) for module, dist in _PACKAGES.items()})
    if gpu:
        torch = sys.modules.get("torch")
        name = None
        if torch is not None and torch.cuda.is_available():
            name = torch.cuda.get_device_name()
        smi = query_gpu() or {}
        out["gpu"] = name or smi.get("name")
        out["driver"] = smi.get("driver_version")
        out["cuda"] = getattr(getattr(torch, "version", None), "cuda", None) if torch is not None else None
        out["power_limit_W"] = _num(smi.get("power.limit"))
    out.update(extra)
    return out


def _num(v: str | None) -> float | None:
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None


def check_summary(summary: dict) -> None:
    """Raise ValueError unless summary is {"columns": [str, ...], "rows": [[value per column], ...]} (plus an
    optional "notes": [str, ...]): what docs/performance.md renders."""
    cols, rows = summary.get("columns"), summary.get("rows")
    if not isinstance(cols, list) or not all(isinstance(c, str) for c in cols):
        raise ValueError("summary.columns must be a list of column names")
    if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == len(cols) for r in rows):
        raise ValueError("summary.rows must be lists of one value per column")
    if not all(isinstance(n, str) for n in summary.get("notes", [])):
        raise ValueError("summary.notes must be strings")
    if set(summary) - {"columns", "rows", "notes"}:
        raise ValueError(f"summary: unknown keys {sorted(set(summary) - {'columns', 'rows', 'notes'})}")


def write(
    root: str | os.PathLike[str],
    *,
    benchmark: str,
    config: str,
    summary: dict,
    results: Any,
    conds: dict,
    device: str | None = None,
    command: str | None = None,
) -> Path:
    """Write (overwrite) root/<device>/<benchmark>_<config>.json and return its path. device defaults to
    device_key(conds["gpu"]); command to command_line(). Raises ValueError for a malformed summary or name."""
    check_summary(summary)
    dev = device or device_key(conds.get("gpu"))
    path = Path(root) / dev / f"{snapshot_name(benchmark, config)}.json"
    doc = {
        "benchmark": benchmark,
        "config": config,
        "command": command or command_line(),
        "conditions": conds,
        "summary": summary,
        "results": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    print(f"snapshot: {path}", file=sys.stderr, flush=True)
    return path


def load_all(root: str | os.PathLike[str] = DEFAULT_ROOT) -> dict[str, dict]:
    """{"<device>/<name>": the snapshot} of every root/<device>/<name>.json."""
    out = {}
    for p in sorted(Path(root).glob("*/*.json")):
        out[f"{p.parent.name}/{p.stem}"] = json.loads(p.read_text())
    return out

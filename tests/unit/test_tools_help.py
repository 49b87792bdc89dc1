"""Every script in tools/ answers --help (exit 0, argparse usage) on a CPU-only install without Triton, humming or
FlashInfer: the GPU tools import those packages guardedly and refuse a run with one line (bench_util.require_gpu),
not a traceback at import; on a machine without CUDA, running one of those GPU tools (with no arguments) exits 1 with
one line naming the script. The scripts run one after another in one fresh interpreter (_RUNNER)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[2] / "tools"


# Runs each script as `python script args` would (runpy as __main__, sys.argv set), one after another in ONE fresh
# interpreter, so torch is imported once (a process per script spent ~2 s of imports each: 86 s of the suite on 2
# cores): exit code as the interpreter would give it (SystemExit's code; a str code is printed to stderr, exit 1; an
# uncaught exception prints its traceback, exit 1), stdout and stderr captured per script.
_RUNNER = r"""
import contextlib, io, json, runpy, sys, traceback
args, scripts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
res = {}
for path in scripts:
    out, err, rc = io.StringIO(), io.StringIO(), 0
    sys.argv = [path, *args]
    sys.path[0] = path.rsplit("/", 1)[0]  # as `python path` sets it: the script's folder
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
                rc = 1
            else:
                rc = e.code or 0
        except BaseException:
            traceback.print_exc()
            rc = 1
    res[path.rsplit("/", 1)[-1]] = [rc, out.getvalue(), err.getvalue()]
sys.stdout.write(json.dumps(res))
"""


def _run_all(scripts, args) -> dict[str, tuple[int, str, str]]:
    """{script name: (exit code, stdout, stderr)} of every script run with args (see _RUNNER)."""
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, json.dumps(list(args)), json.dumps([str(p) for p in scripts])],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: tuple(v) for name, v in json.loads(proc.stdout).items()}


def test_every_tool_prints_help_without_gpu_packages():
    scripts = sorted(p for p in TOOLS.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())
    assert len(scripts) >= 15
    bad = [
        f"{name}: rc {rc}, stderr {err.strip()[-300:]!r}"
        for name, (rc, out, err) in _run_all(scripts, ["--help"]).items()
        if rc != 0 or "usage:" not in out or "Traceback" in err
    ]
    assert not bad, "\n".join(bad)


def test_gpu_tools_refuse_a_cpu_run_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the GPU tools would run for real")
    scripts = sorted(p for p in TOOLS.glob("*.py") if "require_gpu(ap.prog" in p.read_text())
    assert len(scripts) >= 17
    bad = []
    for name, (rc, _, err) in _run_all(scripts, []).items():
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        if rc != 1 or "Traceback" in err or not lines or not lines[-1].startswith(f"{name}: needs "):
            bad.append(f"{name}: rc {rc}, stderr {err.strip()[-300:]!r}")
    assert not bad, "\n".join(bad)


def test_bench_util_paths_and_shapes(tmp_path, monkeypatch):
    sys.path.insert(0, str(TOOLS))
    import bench_util

    monkeypatch.setenv("OUT", str(tmp_path))
    out, table = bench_util.out_paths(None, None, "fp8_linear", "linear_fp8_table.json")
    assert out.startswith(str(tmp_path)) and out.endswith(".json") and "fp8_linear_" in out
    assert table == str(tmp_path / "linear_fp8_table.json")
    assert bench_util.out_paths("a.json", "t.json", "x", "y") == ("a.json", "t.json")
    assert bench_util.pick_shapes("q_b,,o_proj", {"o_proj": 1, "q_b": 2}) == ["q_b", "o_proj"]
    with pytest.raises(SystemExit, match="unknown shape 'x'"):
        bench_util.pick_shapes("q_b,x", {"q_b": 2})


def test_decode_runs_by_clock_reads_headlines_and_splits_by_clock(tmp_path):
    """tools/decode_runs_by_clock.py: headline rows (not A/B variants) with their SM clock, filtered by sequences and
    context; cases without a clock are left out; the summary splits the runs at the given clock."""
    sys.path.insert(0, str(TOOLS))
    import decode_runs_by_clock as d

    def case(seqs, ctx, x, clock, pip=None):
        c = {
            "local_seqs": seqs,
            "ctx": ctx,
            "graph_over_floor": x,
            "graph": {"median_ms": 20 * x, "gpu_clock": {"sm_clock_MHz": {"median": clock}}},
            "graph_control0": {"median_ms": 1.0, "gpu_clock": {"sm_clock_MHz": {"median": 999}}},
        }
        if pip is not None:
            c["graph_pipelined_over_floor"] = pip
        return c

    (tmp_path / "decode_a.json").write_text(
        json.dumps({"cases": [case(8, 2048, 1.2, 1900), case(32, 2048, 1.33, 1640, 1.32), case(32, 8192, 1.24, 1725)]})
    )
    (tmp_path / "decode_b.json").write_text(
        json.dumps(
            {
                "cases": [
                    case(32, 2048, 1.25, 1800),
                    {"local_seqs": 32, "ctx": 2048, "graph_over_floor": 1.5, "graph": {"median_ms": 30.0}},
                ]
            }
        )
    )
    paths = sorted(str(p) for p in tmp_path.glob("decode_*.json"))
    rows = d.read_runs(paths, {32}, 2048)
    assert [(r["file"], r["graph_x"], r["sm_clock_MHz"], r["pipelined_x"]) for r in rows] == [
        ("decode_a.json", 1.33, 1640, 1.32),
        ("decode_b.json", 1.25, 1800, None),
    ]
    assert len(d.read_runs(paths)) == 4  # no filters: every case with a clock
    s = d.summarize(rows, 1700.0)
    assert s[32]["below"] == {"runs": 1, "min": 1.33, "median": 1.33, "max": 1.33}
    assert s[32]["at_or_above"]["runs"] == 1 and s[32]["at_or_above"]["max"] == 1.25
    assert d.summarize(rows, 1000.0)[32]["below"] == {"runs": 0}

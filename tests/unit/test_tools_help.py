"""Every script in tools/ answers --help (exit 0, argparse usage, every flag's default shown) on a CPU-only install
without Triton, humming or FlashInfer: the GPU tools import those packages guardedly and refuse a run with one line
(kimi.benchmarks.gpu.require_gpu), not a traceback at import; on a machine without CUDA, running one of those GPU
tools (with no arguments) exits 1 with one line naming the script. The scripts run one after another in one fresh
interpreter (_RUNNER)."""

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
        if rc != 0 or "usage:" not in out or "Traceback" in err or "(default:" not in out
    ]
    assert not bad, "\n".join(bad)


def test_gpu_tools_refuse_a_cpu_run_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the GPU tools would run for real")
    scripts = sorted(p for p in TOOLS.glob("*.py") if "require_gpu(ap.prog" in p.read_text())
    assert len(scripts) >= 12
    bad = []
    for name, (rc, _, err) in _run_all(scripts, []).items():
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        if rc != 1 or "Traceback" in err or not lines or not lines[-1].startswith(f"{name}: needs "):
            bad.append(f"{name}: rc {rc}, stderr {err.strip()[-300:]!r}")
    assert not bad, "\n".join(bad)


def test_pick_shapes_keeps_the_order_and_names_an_unknown_shape():
    from kimi.benchmarks.gpu import pick_shapes

    assert pick_shapes("q_b,,o_proj", {"o_proj": 1, "q_b": 2}) == ["q_b", "o_proj"]
    with pytest.raises(SystemExit, match="unknown shape 'x'"):
        pick_shapes("q_b,x", {"q_b": 2})

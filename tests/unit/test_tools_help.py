"""Every script in tools/ answers --help (exit 0, argparse usage) on a CPU-only install without Triton, humming or
FlashInfer: the GPU tools import those packages guardedly and refuse a run with one line (bench_util.require_gpu),
not a traceback at import. The runs are started together and waited for (about 2 s of imports each)."""

import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def test_every_tool_prints_help_without_gpu_packages():
    scripts = sorted(p for p in TOOLS.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())
    assert len(scripts) >= 15
    procs = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for p in scripts}
    bad = []
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0 or "usage:" not in out or "Traceback" in err:
            bad.append(f"{name}: rc {proc.returncode}, stderr {err.strip()[-300:]!r}")
    assert not bad, "\n".join(bad)

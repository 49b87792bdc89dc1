"""Running Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1) from the CPU test suite.

The interpreter needs Triton and a numpy it works with (Triton 3.6: numpy < 2.3). The project's test venv has
neither (its numpy is newer), so `make test` builds a small side venv (torch CPU + triton + numpy < 2.3,
Makefile target `triton-venv`) and names its python in $KIMI_TRITON_PYTHON. Kernel tests run their script in a
subprocess of that python (else of this one, if it qualifies) with the repository on PYTHONPATH; they skip, with
the reason, only when no such python exists.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimi import envs

REPO = Path(__file__).resolve().parents[2]
_PROBE = (
    "import warnings, numpy, triton\n"
    "with warnings.catch_warnings():\n"
    "    warnings.simplefilter('ignore')\n"
    "    int(numpy.array([1]))  # Triton 3.6's interpreter needs this; numpy >= 2.3 refuses it\n"
)


@functools.lru_cache(maxsize=1)
def interpreter_python() -> tuple[str | None, str]:
    """(python executable able to run the interpreter, or None; the reason when None)."""
    reasons = []
    for exe in [envs.KIMI_TRITON_PYTHON.get(), sys.executable]:
        if not exe:
            continue
        try:
            r = subprocess.run([exe, "-c", _PROBE], capture_output=True, text=True, timeout=120)
        except OSError as e:
            reasons.append(f"{exe}: {e}")
            continue
        if r.returncode == 0:
            return exe, ""
        reasons.append(f"{exe}: {(r.stderr.strip().splitlines() or ['failed'])[-1]}")
    return None, "no python with Triton and a numpy its interpreter accepts (make triton-venv): " + "; ".join(reasons)


def run_interpreted(script: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run `script` under TRITON_INTERPRET=1 with the repository importable; pytest.skip when no python can."""
    exe, why = interpreter_python()
    if exe is None:
        pytest.skip(why)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([exe, "-c", script], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)

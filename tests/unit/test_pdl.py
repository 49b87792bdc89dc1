"""kimi.kernels.triton.pdl on the CPU: never enabled off CUDA or under the interpreter, launch_kwargs gives the kernels
only
PDL=False there (the interpreter takes no launch_pdl), KIMI_PDL=0 turns the switch off at import. The GPU side
(a PDL kernel chain in a CUDA graph equal, bit for bit, to the chain without PDL) is
tests/gpu/test_linear_small_m.py::test_pdl_chain_in_graph_equals_eager_without_pdl."""

import os
import subprocess
import sys

import pytest
import torch

pdl = pytest.importorskip("kimi.kernels.triton.pdl")


def test_off_on_cpu():
    assert pdl.enabled(torch.device("cpu")) is False
    assert pdl.launch_kwargs(torch.device("cpu")) == {"PDL": False}


def test_switch_off_wins(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_kwargs(torch.device("cuda", 0)) == {"PDL": False}  # no CUDA call made when off


@pytest.mark.parametrize("value,expected", [("0", False), ("1", True), (None, True)])
def test_env(value, expected):
    env = {k: v for k, v in os.environ.items() if k != "KIMI_PDL"}
    if value is not None:
        env["KIMI_PDL"] = value
    r = subprocess.run(
        [sys.executable, "-c", "from kimi.kernels.triton import pdl; print(pdl.ENABLED)"],
        env=env,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(expected)

"""kimi.kernels.triton.pdl on the CPU: never enabled off CUDA or under the interpreter, launch_kwargs gives the kernels
only PDL=False there (the interpreter takes no launch_pdl), set_enabled(False) turns the switch off and returns the
previous setting. The GPU side (a PDL kernel chain in a CUDA graph equal, bit for bit, to the chain without PDL) is
tests/gpu/test_linear_small_m.py::test_pdl_chain_in_graph_equals_eager_without_pdl."""

import pytest
import torch

pdl = pytest.importorskip("kimi.kernels.triton.pdl")


def test_off_on_cpu():
    assert pdl.enabled(torch.device("cpu")) is False
    assert pdl.launch_kwargs(torch.device("cpu")) == {"PDL": False}


def test_switch_off_wins():
    assert pdl.ENABLED is True  # the default
    previous = pdl.set_enabled(False)
    try:
        assert previous is True and pdl.ENABLED is False
        assert pdl.launch_kwargs(torch.device("cuda", 0)) == {"PDL": False}  # no CUDA call made when off
    finally:
        assert pdl.set_enabled(previous) is False
    assert pdl.ENABLED is True

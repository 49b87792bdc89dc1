"""CPU tests of kimi's CUDA MLA decode's host side (kimi.ops.mla_decode_cuda): split choice, shape support, refusal
of CPU tensors, and csrc/mla_decode.cu compiling for sm_90a without register spills (nvcc; skipped with the reason
where nvcc is absent). The kernel itself runs in tests/gpu/test_mla_decode_cuda.py."""

import shutil
import subprocess

import pytest
import torch

from kimi.ops import mla_decode_cuda as mdc
from kimi.ops.cuda_ext import CSRC


def test_choose_num_splits_fills_one_wave():
    assert mdc.choose_num_splits(32, 132) == 4  # 128 CTAs
    assert mdc.choose_num_splits(8, 132) == 16
    assert mdc.choose_num_splits(1, 132) == mdc.MAX_SPLITS
    assert mdc.choose_num_splits(200, 132) == 1
    assert mdc.choose_num_splits(1, 132, max_ctx=300) == 3  # at least 2 tiles of 64 per split
    assert mdc.choose_num_splits(8, 132, max_ctx=1) == 1
    for B in range(1, 300):
        s = mdc.choose_num_splits(B, 132)
        assert 1 <= s <= mdc.MAX_SPLITS and (s == 1 or B * s <= 132)
    with pytest.raises(ValueError):
        mdc.choose_num_splits(0, 132)


def test_supports_only_the_compiled_shapes():
    assert mdc.supports(64, 512, 64, 64, torch.bfloat16)
    assert mdc.supports(64, 512, 64, 128, torch.bfloat16)
    assert not mdc.supports(64, 512, 64, 32, torch.bfloat16)  # 64-token tiles within one block
    assert not mdc.supports(16, 512, 64, 64, torch.bfloat16)  # tiny-mla heads
    assert not mdc.supports(64, 512, 64, 16, torch.bfloat16)
    assert not mdc.supports(64, 512, 64, 64, torch.float16)
    assert not mdc.supports(64, 256, 64, 64, torch.bfloat16)


def test_workspace_numel():
    assert mdc.workspace_numel(32, 4) == 32 * 4 * 64 * 513
    assert mdc.workspace_numel(32, 1) == 0


def test_refuses_cpu_tensors():
    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        mdc.mla_decode(q[..., :512], q[..., 512:], kv, torch.zeros(2, 1, dtype=torch.int32),
                       torch.ones(2, dtype=torch.int32), 0.1)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_kernel_compiles_for_sm90a_without_spills(tmp_path):
    r = subprocess.run(["nvcc", "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-c",
                        str(CSRC / "mla_decode.cu"), "-o", str(tmp_path / "mla_decode.o"), "-Xptxas", "-v"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    spills = [ln for ln in r.stderr.splitlines() if "spill stores" in ln]
    assert len(spills) == 1, r.stderr[-3000:]  # one kernel (the splits merge in it)
    assert all(ln.strip().startswith("0 bytes stack frame, 0 bytes spill stores") for ln in spills), spills

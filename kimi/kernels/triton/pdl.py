"""Programmatic dependent launch (PDL) for kimi's Triton kernels on Hopper.

What: a kernel launched with PDL may be scheduled before the kernel ahead of it in the stream has finished, once
every program of that kernel has executed `griddepcontrol.launch_dependents` (or exited). Its programs then wait
in `griddepcontrol.wait` until the kernel ahead has completed and its memory writes are visible (CUDA
Programming Guide, "Programmatic Dependent Launch and Synchronization"; PTX ISA, griddepcontrol). The launch
latency and the ramp-up of the next kernel overlap the tail of the current one; the decode step is a chain of
~20 short, dependent kernels per layer, so each boundary counts. CUDA graphs keep the programmatic edges.

Contract of every kernel that takes `PDL: tl.constexpr` (see `wait_and_release`):
- before `griddepcontrol.wait` it reads only data no kernel of the step writes (weights, the L2 prefetch of
  kimi.kernels.triton.linear_small_m) and writes nothing;
- right after the wait it executes `launch_dependents`, so at most one kernel waits ahead of a running one. Kernels we
do not own (FlashInfer, humming, cuBLAS, torch) never trigger early: a PDL kernel after them starts at their completion,
as without PDL. One exception to the first rule, in kimi's CUDA expert GEMM (kimi/kernels/cuda/csrc/moe_w4a16.cu,
`early_weights`): the down GEMM reads the align's outputs (num_padded, block_expert) before its wait. That align is two
kernels back, and the kernels in between (the gate_up GEMM, silu_mul_rows) wait before they trigger, so it has completed
before the down GEMM can launch; the reads go through L2 (ld.global.cg), where its writes are. Any kernel placed between
the align and the down GEMM must keep that order: wait, then trigger.

Switch: `ENABLED` (on; `set_enabled` turns it off for later launches: tests and benchmarks compare the two).
Off under Triton's CPU interpreter (no griddepcontrol there) and on GPUs before sm_90.
"""

from __future__ import annotations

import functools

import torch

from kimi.kernels.triton.common import INTERPRET, tl, triton

__all__ = ["ENABLED", "enabled", "launch_kwargs", "set_enabled"]

ENABLED = True


def set_enabled(flag: bool) -> bool:
    """Turn PDL on or off for later launches (CUDA graphs keep the setting of their capture); returns the previous
    setting."""
    global ENABLED
    previous, ENABLED = ENABLED, bool(flag)
    return previous


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL now: ENABLED, an NVIDIA (not ROCm) device of compute capability
    >= 9.0, not under the interpreter."""
    if not ENABLED or INTERPRET or triton is None or device.type != "cuda" or torch.version.hip is not None:
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


def launch_kwargs(device: torch.device) -> dict:
    """Keyword arguments for a PDL-aware kernel launch on `device`: {"PDL": True, "launch_pdl": True} when
    `enabled`, else {"PDL": False} (the interpreter does not take launch_pdl)."""
    if enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


if triton is not None:

    @triton.jit
    def wait_and_release(PDL: tl.constexpr):
        """With PDL: wait for the kernel ahead to complete (its writes visible), then let the next kernel launch."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

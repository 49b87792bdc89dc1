"""The Triton set-up every kernel module shares.

`triton` / `tl`: the Triton modules, or None on installs without Triton (CPU-only); `HAS_TRITON`: whether they
imported; `INTERPRET`: Triton's CPU interpreter is on (environment TRITON_INTERPRET=1, read at import): kernels then
run on CPU tensors (the CPU test suite) and PDL is off.
"""

from __future__ import annotations

from kimi import envs

try:  # Triton is absent on CPU-only installs; the kernel modules still import and their launchers say so.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAS_TRITON = False

INTERPRET = envs.TRITON_INTERPRET.get()

__all__ = ["HAS_TRITON", "INTERPRET", "tl", "triton"]

"""Build and import kimi's CUDA extensions (kimi/kernels/cuda/csrc/, shipped as package data) with torch's extension
loader, once per process and source set.

`load(name, sources)`: compiled for sm_90a at first use, cached under $KIMI_CSRC_CACHE (default
~/.cache/kimi/csrc) per torch / CUDA / Python version. Raises what torch's loader raises when it cannot build here
(OSError without a CUDA toolkit, RuntimeError on a compile error or without ninja); a failed build is not retried
in the process (later calls raise the same error at once: a model's layers each ask for the extension).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

from kimi import envs

CSRC = Path(__file__).resolve().parent / "csrc"  # package data: installed with kimi (editable or not)
_built: dict[str, ModuleType] = {}
_failed: dict[str, BaseException] = {}
_lock = threading.Lock()


def load(name: str, sources: list[str]) -> ModuleType:
    """The extension `name` built from csrc/`sources` (file names), imported; built on the first call."""
    with _lock:
        if name in _failed:
            raise _failed[name]
        if name not in _built:
            from torch.utils.cpp_extension import load as torch_load

            tag = f"torch{torch.__version__}-cu{torch.version.cuda}-py{sys.version_info[0]}{sys.version_info[1]}"
            root = envs.csrc_cache_dir()
            build = root / f"{name}-{tag.replace('+', '_')}"
            build.mkdir(parents=True, exist_ok=True)
            try:
                _built[name] = torch_load(
                    name=f"kimi_{name}",
                    sources=[str(CSRC / s) for s in sources],
                    extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-lineinfo"],
                    extra_cflags=["-O3", "-std=c++17"],
                    build_directory=str(build),
                    verbose=False,
                )
            except Exception as e:
                _failed[name] = e
                raise
    return _built[name]

"""The one folder of compiled kernels (`kimi serve --cache-dir`, default ~/.cache/kimi): kimi's CUDA extensions,
FlashInfer's JIT modules, humming's kernels and Triton's compiled kernels, so a second start on the same machine (or an
image built with `kimi warmup`) compiles nothing.

Layout under the folder, one subfolder per library (`SUBDIRS`), each given to its library through the variable that
library reads (`LIBRARY_VARIABLES`); a variable already set in the environment is left as it is (the library's own
override wins, as in vLLM and SGLang):

    csrc/        KIMI_CSRC_CACHE             kimi.kernels.cuda.loader (kimi's CUDA extensions)
    flashinfer/  FLASHINFER_WORKSPACE_BASE   FlashInfer puts its JIT modules under <base>/.cache/flashinfer
    humming/     HUMMING_CACHE_DIR           humming-kernels' compiled GEMMs
    triton/      TRITON_CACHE_DIR            Triton's compiled kernels

`configure` must run before those libraries are imported (the worker's first step, kimi.worker.main); `count_files`
counts what each library has stored, so start-up can log what it compiled and tests can check that serving compiles
nothing more.
"""

from __future__ import annotations

import os
from pathlib import Path

from kimi import envs

__all__ = ["LIBRARY_VARIABLES", "SUBDIRS", "configure", "count_files", "default_dir", "files", "library_dirs"]

# library -> (subfolder of the cache dir, the environment variable the library reads)
LIBRARY_VARIABLES: dict[str, tuple[str, envs.EnvVar[str | None]]] = {
    "kimi": ("csrc", envs.KIMI_CSRC_CACHE),
    "flashinfer": ("flashinfer", envs.FLASHINFER_WORKSPACE_BASE),
    "humming": ("humming", envs.HUMMING_CACHE_DIR),
    "triton": ("triton", envs.TRITON_CACHE_DIR),
}
SUBDIRS = tuple(sub for sub, _ in LIBRARY_VARIABLES.values())


def default_dir() -> str:
    """$KIMI_CACHE_DIR, else ~/.cache/kimi (expanded)."""
    return os.path.expanduser(envs.KIMI_CACHE_DIR.get() or "~/.cache/kimi")


def library_dirs(cache_dir: str) -> dict[str, Path]:
    """library -> the folder it caches into: the folder its variable names when set, else its subfolder of
    cache_dir. FlashInfer's folder is its base (it writes under <base>/.cache/flashinfer)."""
    root = Path(os.path.expanduser(cache_dir))
    return {lib: Path(var.get() or root / sub) for lib, (sub, var) in LIBRARY_VARIABLES.items()}


def configure(cache_dir: str) -> dict[str, Path]:
    """Point every library at its folder under cache_dir (creating them) by setting the variables that are not set
    yet, in this process's environment (children inherit it). Returns library_dirs(cache_dir). Raises OSError when
    a folder cannot be created."""
    dirs = library_dirs(cache_dir)
    for lib, (_, var) in LIBRARY_VARIABLES.items():
        dirs[lib].mkdir(parents=True, exist_ok=True)
        if not var.is_set():
            os.environ[var.name] = str(dirs[lib])
    return dirs


def files(folder: Path) -> set[str]:
    """The paths of the files under folder (empty for a folder that does not exist)."""
    return {os.path.join(root, f) for root, _, names in os.walk(folder) for f in names}


def count_files(dirs: dict[str, Path]) -> dict[str, int]:
    """library -> the number of files under its folder (0 for a folder that does not exist)."""
    return {lib: len(files(d)) for lib, d in dirs.items()}

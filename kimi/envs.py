"""Every environment variable kimi reads: name, type, default and meaning, declared once.

A declaration reads nothing when it is made: `VAR.get()` reads the environment at each call, so a test or a
subprocess that sets a variable sees it. Product modules read a variable only through its declaration here
(tests/unit/test_envs.py checks). `VARIABLES` lists them all in declaration order (docs/cli.md describes them).

    from kimi import envs
    if envs.KIMI_TOKENIZER_DIR.get(): ...

A value the parser refuses raises ConfigError (a ValueError) naming the variable and what it wants.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from kimi.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable: `name`, the value when it is unset (`default`), `parse` (the raw string -> the
    value; raises ValueError on a bad string), what the variable means (`doc`), who reads it (`reader`) and, for
    errors, the form a value takes (`want`)."""

    name: str
    default: T
    parse: Callable[[str], T]
    doc: str
    reader: str
    want: str = ""

    def get(self) -> T:
        """The variable's value now: `default` when unset, else `parse(raw)`. Raises ConfigError on a bad value."""
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            want = f": want {self.want}" if self.want else f": {e}"
            raise ConfigError(f"{self.name}={raw!r}{want}") from e

    def require(self) -> T:
        """`get()` for a variable that must be set: raises ConfigError naming it when it is unset."""
        if self.name not in os.environ:
            raise ConfigError(f"${self.name} is not set: {self.doc}")
        return self.get()

    def is_set(self) -> bool:
        """Whether the variable is in the environment (with any value, "" included)."""
        return self.name in os.environ


def _str_or_none(raw: str) -> str | None:
    """The string; "" counts as unset (None)."""
    return raw or None


def _on_if_1(raw: str) -> bool:
    """An off-by-default switch: "1" turns it on, any other value leaves it off."""
    return raw == "1"


def _float_or_0(raw: str) -> float:
    """A number; "" is 0."""
    return float(raw or 0)


VARIABLES: list[EnvVar[Any]] = []


def _declare(var: EnvVar[T]) -> EnvVar[T]:
    VARIABLES.append(var)
    return var


# ---------------------------------------------------------------------------------------------- server and CLI
KIMI_API_KEY = _declare(
    EnvVar("KIMI_API_KEY", None, _str_or_none, 'default of `kimi serve --api-key` ("": none)', "kimi serve")
)
KIMI_TOKENIZER_DIR = _declare(
    EnvVar(
        "KIMI_TOKENIZER_DIR",
        None,
        _str_or_none,
        'folder with the real Kimi vocabulary (tiktoken.model); "": look beside the checkout',
        "tiny checkpoints, `preset:` models, tests",
    )
)
KIMI_LAUNCH_REPORT = _declare(
    EnvVar(
        "KIMI_LAUNCH_REPORT",
        None,
        _str_or_none,
        "file where kimi.worker.launch writes the first failed rank and its exit code (set by kimi serve)",
        "kimi.worker.launch",
    )
)

# ---------------------------------------------------------------------------------------------- set by torchrun
RANK = _declare(EnvVar("RANK", 0, int, "this process's global rank", "workers (torchrun sets it)", "an int"))
WORLD_SIZE = _declare(EnvVar("WORLD_SIZE", 1, int, "number of ranks", "workers (torchrun sets it)", "an int"))
LOCAL_RANK = _declare(
    EnvVar("LOCAL_RANK", 0, int, "this process's rank on its host (its GPU)", "workers (torchrun sets it)", "an int")
)

KIMI_CACHE_DIR = _declare(
    EnvVar(
        "KIMI_CACHE_DIR",
        None,
        _str_or_none,
        "default of `kimi serve --cache-dir`: the one folder of compiled kernels shared by kimi, FlashInfer, humming "
        "and Triton (unset: ~/.cache/kimi; kimi.cache_dir)",
        "kimi serve, kimi warmup",
    )
)

# Libraries' own cache folders: kimi sets each to its subfolder of --cache-dir unless it is set (kimi.cache_dir)
FLASHINFER_WORKSPACE_BASE = _declare(
    EnvVar(
        "FLASHINFER_WORKSPACE_BASE",
        None,
        _str_or_none,
        "FlashInfer's JIT cache base (it writes under <base>/.cache/flashinfer; unset: <--cache-dir>/flashinfer)",
        "FlashInfer, in the GPU workers",
    )
)
HUMMING_CACHE_DIR = _declare(
    EnvVar(
        "HUMMING_CACHE_DIR",
        None,
        _str_or_none,
        "humming-kernels' compiled kernels (unset: <--cache-dir>/humming)",
        "humming-kernels, in the GPU workers",
    )
)
TRITON_CACHE_DIR = _declare(
    EnvVar(
        "TRITON_CACHE_DIR",
        None,
        _str_or_none,
        "Triton's compiled kernels (unset: <--cache-dir>/triton)",
        "Triton, in the GPU workers",
    )
)

# ---------------------------------------------------------------------------------------------- GPU workers
KIMI_CSRC_CACHE = _declare(
    EnvVar(
        "KIMI_CSRC_CACHE",
        None,
        _str_or_none,
        "folder where kimi's CUDA extensions (`kimi/kernels/cuda/csrc/`) are built and cached "
        "(unset: <--cache-dir>/csrc)",
        "GPU workers",
    )
)
KIMI_HUMMING_TABLE = _declare(
    EnvVar(
        "KIMI_HUMMING_TABLE",
        None,
        str,
        'another humming schedule table (a path), or "off" / "" for humming\'s heuristic only (unset: the shipped '
        "kimi/kernels/tuning/humming.json)",
        "GPU workers",
    )
)
KIMI_LINEAR_SMALL_M_TABLE = _declare(
    EnvVar(
        "KIMI_LINEAR_SMALL_M_TABLE",
        None,
        str,
        'another tuning table of the small-M bf16 GEMM, or "off" / "" for none (unset: the shipped one in '
        "kimi/kernels/tuning/)",
        "GPU workers",
    )
)
KIMI_BMM_SMALL_M_TABLE = _declare(
    EnvVar(
        "KIMI_BMM_SMALL_M_TABLE",
        None,
        str,
        'another tuning table of the per-head MLA GEMM, or "off" / "" for none (unset: the shipped one in '
        "kimi/kernels/tuning/)",
        "GPU workers",
    )
)
KIMI_LINEAR_FP8_TABLE = _declare(
    EnvVar(
        "KIMI_LINEAR_FP8_TABLE",
        None,
        str,
        'another tuning table of the FP8 dense GEMM, or "off" / "" for none (unset: the shipped one in '
        "kimi/kernels/tuning/)",
        "GPU workers",
    )
)
TRITON_INTERPRET = _declare(
    EnvVar(
        "TRITON_INTERPRET",
        False,
        _on_if_1,
        "Triton's own switch: 1 runs kernels in its interpreter; kimi then skips what the interpreter lacks",
        "kernels (import)",
    )
)

# ---------------------------------------------------------------------------------------------- fake workers
KIMI_FAKE_STEP_MS = _declare(
    EnvVar("KIMI_FAKE_STEP_MS", 0.0, _float_or_0, "simulated time of a step (ms)", "fake workers", "number")
)
KIMI_FAKE_TOKEN_US = _declare(
    EnvVar("KIMI_FAKE_TOKEN_US", 0.0, _float_or_0, "simulated time per scheduled token (us)", "fake workers", "number")
)
KIMI_FAKE_STATS = _declare(
    EnvVar(
        "KIMI_FAKE_STATS",
        None,
        _str_or_none,
        "file where rank 0 of the fake workers writes each step's start and end at exit (controller benchmarks)",
        "fake workers",
    )
)

# ---------------------------------------------------------------------------------------------- benchmarks
KIMI_GIT_COMMIT = _declare(
    EnvVar(
        "KIMI_GIT_COMMIT",
        None,
        _str_or_none,
        "the commit a benchmark snapshot records (a tree without .git); unset: `git rev-parse HEAD`",
        "benchmarks",
    )
)
OPENAI_API_KEY = _declare(
    EnvVar(
        "OPENAI_API_KEY",
        None,
        _str_or_none,
        "API key of the serving benchmark's client, as the OpenAI client reads it",
        "kimi.benchmarks.serving",
    )
)
KIMI_SMALL_KERNELS_TABLE_ALT = _declare(
    EnvVar(
        "KIMI_SMALL_KERNELS_TABLE_ALT",
        None,
        _str_or_none,
        "small_kernels launch table (tools/sweep_small_kernels.py --table-out) of tools/bench_decode.py's "
        "`small_tuned` A/B",
        "tools/bench_decode.py",
    )
)
KIMI_HUMMING_TABLE_ALT = _declare(
    EnvVar(
        "KIMI_HUMMING_TABLE_ALT",
        None,
        _str_or_none,
        "humming table of tools/bench_decode.py's `humming_table_alt` A/B",
        "tools/bench_decode.py",
    )
)

# ---------------------------------------------------------------------------------------------- test suite
KIMI_TEST_DEVICE = _declare(
    EnvVar("KIMI_TEST_DEVICE", None, _str_or_none, "cuda: the e2e tests serve with --device cuda", "tests/e2e")
)
KIMI_TEST_A2A = _declare(
    EnvVar("KIMI_TEST_A2A", None, _str_or_none, "the --a2a-backend of the e2e tests' served workers", "tests/e2e")
)
KIMI_TRITON_PYTHON = _declare(
    EnvVar(
        "KIMI_TRITON_PYTHON",
        None,
        _str_or_none,
        "the Python with Triton that runs the kernel tests under the interpreter",
        "tests/unit",
    )
)
KIMI_GPU_REPORT = _declare(
    EnvVar("KIMI_GPU_REPORT", None, _str_or_none, "JSON-lines file the GPU tests append their measures to", "tests/gpu")
)
KIMI_LONG_CTX = _declare(
    EnvVar("KIMI_LONG_CTX", 33000, int, "prompt tokens of the long-context GPU test", "tests/gpu", "an int")
)


def by_name(name: str) -> EnvVar[Any]:
    """The declaration of variable `name`. Raises KeyError for a name not declared here."""
    for v in VARIABLES:
        if v.name == name:
            return v
    raise KeyError(name)


def csrc_cache_dir() -> Path:
    """Where kimi's csrc/ extensions are built: $KIMI_CSRC_CACHE, else ~/.cache/kimi/csrc."""
    return Path(KIMI_CSRC_CACHE.get() or Path.home() / ".cache" / "kimi" / "csrc")

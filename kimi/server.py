"""`kimi serve`: the controller process.

Checks every flag (numeric ranges at parse time; `--num-hidden-layers` and `--max-model-len` against the
config once it is read; `--device cuda` against the machine before launching local workers), binds every
socket (the ZeroMQ transport to the workers, HTTP, the ZeroMQ submit API), and only then spawns the workers
under torchrun (unless `--attach`); HTTP serves at once (`/health` says "loading" until every rank is ready).
After the workers' handshake it runs the engine loop, the HTTP server and the ZeroMQ submit API in one
asyncio event loop.

Exit status: 0 after SIGINT / SIGTERM; 1 when a worker dies or fails (every in-flight request is failed
with the error first) or start-up fails (an address that cannot be bound is one error line, and nothing is
launched); 2 for a flag no server can run with. Worker processes are never left behind: they are sent
`Shutdown`, then terminated as a process group; workers also exit by themselves when the controller goes
silent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from pathlib import Path

import uvicorn
import zmq

from kimi import cache_dir, envs
from kimi.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, WorkerConfig, worker_flag
from kimi.controller.engine import Engine
from kimi.controller.http import OpenAIServer
from kimi.controller.liveness import HEARTBEAT_S
from kimi.controller.parsers import THINK_END_ID, THINK_START_ID
from kimi.controller.security import (
    SecurityConfig,
    header_timeout_protocol,
    origins_and_hosts_summary,
    secure_app,
    split_list,
)
from kimi.controller.submit import SubmitServer
from kimi.errors import ConfigError
from kimi.ipc import ControllerTransport
from kimi.tokenizer import KimiTokenizer

log = logging.getLogger(__name__)


@dataclass
class ServeArgs:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    zmq_submit_addr: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    nproc: int = 1
    block_size: int = 64
    num_blocks: int | None = None
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 256
    token_budget: int = 2048
    num_hidden_layers: int | None = None
    attach: bool = False
    plan_addr: str | None = None
    result_addr: str | None = None
    worker_timeout: float = 600.0
    startup_timeout: float = 3600.0
    log_level: str = "info"
    no_prefix_cache: bool = False
    max_waiting: int = 1024
    scheduling_policy: str = "fcfs"
    fake_workers: bool = False
    api_key: str | None = None
    max_body_bytes: int = 32 << 20
    request_body_timeout: float = 30.0
    request_header_timeout: float = 10.0
    allowed_hosts: str = ""
    allowed_origins: str = ""
    reasoning: str = "auto"
    a2a_backend: str | None = None
    a2a_static_decode: bool = False
    heartbeat_timeout: float = 10.0
    moe_backend: str = "auto"
    load_format: str = "auto"
    enforce_eager: bool = False
    no_prefill_graphs: bool = False
    fp8_dense: str = "off"
    emulate_ep_size: int = 1
    no_async_scheduling: bool = False
    skip_warmup: bool = False
    cache_dir: str | None = None
    speculative_config: str | None = None
    warmup_only: bool = False  # `kimi warmup`: start, warm up (filling the cache dir), stop


# Every numeric `kimi serve` flag: (type, lowest, highest, inclusive lowest). Checked by argparse (`kimi serve`
# exits 2 naming the flag) and again by `check_serve_args` for programmatic callers of `serve`.
NUMERIC_LIMITS: dict[str, tuple[type, float, float | None, bool]] = {
    "port": (int, 1, 65535, True),
    "nproc": (int, 1, None, True),
    "block_size": (int, 1, None, True),  # any size >= 1: the KV cache, BlockPool and the kernels index by p // bs
    "num_blocks": (int, 2, None, True),  # block 0 is the null block (BlockPool)
    "kv_cache_memory_gib": (float, 0, None, False),
    "gpu_memory_utilization": (float, 0, 1, False),
    "max_model_len": (int, 1, None, True),
    "max_num_seqs": (int, 1, None, True),
    "token_budget": (int, 1, None, True),
    "num_hidden_layers": (int, 1, None, True),  # at most the config's: checked once the config is read
    "worker_timeout": (float, 0, None, False),
    "startup_timeout": (float, 0, None, False),
    "max_waiting": (int, 1, None, True),
    "max_body_bytes": (int, 1, None, True),
    "request_body_timeout": (float, 0, None, False),
    "request_header_timeout": (float, 0, None, False),
    "heartbeat_timeout": (float, 0, None, True),
    "emulate_ep_size": (int, 1, None, True),  # 0 = off; else at least HEARTBEAT_MIN_S (_limit_error)
}
# a heartbeat timeout must span two of the controller's pings, or a healthy rank is declared dead
HEARTBEAT_MIN_S = 2 * HEARTBEAT_S


def _limit_error(name: str, v: float) -> str | None:
    """Why `v` is not a valid value of the numeric flag `name` (None when it is)."""
    kind, lo, hi, lo_incl = NUMERIC_LIMITS[name]
    if kind is float and not math.isfinite(v):
        return f"must be a finite number, got {v}"
    if (v < lo if lo_incl else v <= lo) or (hi is not None and v > hi):
        if hi is not None:
            return f"must be in {'[' if lo_incl else '('}{lo}, {hi}], got {v}"
        return f"must be {'>=' if lo_incl else '>'} {lo}, got {v}"
    if name == "heartbeat_timeout" and 0 < v < HEARTBEAT_MIN_S:
        return (
            f"must be 0 (off) or at least {HEARTBEAT_MIN_S:g} s (the controller pings the workers every "
            f"{HEARTBEAT_S:g} s), got {v}"
        )
    return None


def _numeric(name: str) -> Callable[[str], float]:
    """An argparse `type` for the flag `name`: parses, then checks NUMERIC_LIMITS (ArgumentTypeError names why)."""
    kind = NUMERIC_LIMITS[name][0]

    def parse(text: str) -> float:
        try:
            v: float = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        err = _limit_error(name, v)
        if err is not None:
            raise argparse.ArgumentTypeError(err)
        return v

    parse.__name__ = kind.__name__
    return parse


def cuda_only_flags_set(a: ServeArgs) -> list[str]:
    """The flags of `a` that only `--device cuda` uses and that differ from their defaults, when the device is not
    cuda (`serve` warns that they are ignored)."""
    if a.device == "cuda":
        return []
    d = ServeArgs(model=a.model)
    return [
        f"--{name.replace('_', '-')}"
        for name in ("moe_backend", "load_format", "enforce_eager", "no_prefill_graphs", "fp8_dense", "emulate_ep_size")
        if getattr(a, name) != getattr(d, name)
    ]


def check_serve_args(a: ServeArgs) -> str | None:
    """The first problem with `a` that no server could run with, naming the flag (None when there is none).

    The per-flag ranges of NUMERIC_LIMITS, an empty `--served-model-name`, plus the checks that involve two
    flags. (`--num-hidden-layers` and `--max-model-len` against the config, and `--device cuda` against the
    machine, are checked by `serve`, once the config is read.)
    """
    for name in NUMERIC_LIMITS:
        v = getattr(a, name)
        if v is None:
            continue
        err = _limit_error(name, v)
        if err is not None:
            return f"--{name.replace('_', '-')}: {err}"
    if a.zmq_submit_addr is None and a.port >= 65535:
        return (
            f"--port {a.port} leaves no port for the ZeroMQ submit API (default tcp://HOST:PORT+1); "
            "give --zmq-submit-addr"
        )
    if not a.host:
        return "--host must not be empty"
    if a.served_model_name is not None and not a.served_model_name.strip():
        return "--served-model-name must not be empty"
    if a.scheduling_policy not in ("fcfs", "priority"):
        return f"--scheduling-policy must be fcfs or priority, got {a.scheduling_policy!r}"
    if a.emulate_ep_size > 1 and a.device == "cuda" and (a.nproc != 1 or a.load_format != "dummy"):
        return "--emulate-ep-size: benchmarks only, with --nproc 1 and --load-format dummy"
    if a.speculative_config is not None:
        try:
            SpeculativeConfig.from_json(a.speculative_config)
        except ConfigError as e:
            return str(e)
        if a.device != "cpu":
            return "--speculative-config: speculative decoding runs on --device cpu (the reference path) only for now"
    return None


def speculative_config(a: ServeArgs, cfg: ModelConfig) -> SpeculativeConfig | None:
    """The server's SpeculativeConfig, its draft's config.json checked against the target `cfg` (kimi.model.eagle3);
    None without --speculative-config. Raises ConfigError naming the field (the tensors are checked by the workers,
    which load them)."""
    if a.speculative_config is None:
        return None
    from kimi.model.eagle3 import read_draft_config

    spec = SpeculativeConfig.from_json(a.speculative_config)
    read_draft_config(spec.model).check_target(cfg)
    return spec


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with each flag's default appended, `(default: X)`, unless the help text already states it
    or the default is None / False (a flag that is off, or a value derived at start-up)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or action.required:
            return text
        return f"{text} (default: %(default)s)"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Declare every `kimi serve` flag on p (docs/cli.md has the long form of each)."""
    _add_model_and_cache_flags(p)
    _add_worker_and_queue_flags(p)
    _add_http_and_backend_flags(p)


def _add_model_and_cache_flags(p: argparse.ArgumentParser) -> None:
    """The model, HTTP / ZeroMQ addresses, device, ranks, KV cache and batching flags."""
    p.add_argument("--model", **worker_flag("model"))
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    p.add_argument("--port", type=_numeric("port"), default=8000, help="HTTP port")
    p.add_argument("--served-model-name", default=None, help="the `model` name clients send (default: the folder name)")
    p.add_argument("--zmq-submit-addr", default=None, help="ZeroMQ submit API address (default tcp://HOST:PORT+1)")
    p.add_argument("--device", **worker_flag("device"))
    p.add_argument("--dtype", **worker_flag("dtype"))
    p.add_argument(
        "--nproc",
        type=_numeric("nproc"),
        default=1,
        help="worker ranks on this node (DP attention x EP MoE); must divide the routed experts",
    )
    p.add_argument("--block-size", **worker_flag("block_size", type=_numeric("block_size")))
    p.add_argument("--num-blocks", **worker_flag("num_blocks", type=_numeric("num_blocks")))
    p.add_argument("--kv-cache-memory-gib", **worker_flag("kv_cache_memory_gib", type=_numeric("kv_cache_memory_gib")))
    p.add_argument(
        "--gpu-memory-utilization", **worker_flag("gpu_memory_utilization", type=_numeric("gpu_memory_utilization"))
    )
    for name in ("max_model_len", "max_num_seqs", "token_budget"):
        p.add_argument("--" + name.replace("_", "-"), **worker_flag(name, type=_numeric(name)))
    p.add_argument("--num-hidden-layers", **worker_flag("num_hidden_layers", type=_numeric("num_hidden_layers")))
    p.add_argument("--speculative-config", **worker_flag("speculative_config"))


def _add_worker_and_queue_flags(p: argparse.ArgumentParser) -> None:
    """Attached workers, timeouts, logging, prefix cache, the waiting queue and fake workers."""
    p.add_argument("--attach", action="store_true", help="do not spawn workers; wait for external torchrun ranks")
    p.add_argument(
        "--plan-addr",
        default=None,
        help="with --attach: ZeroMQ address the workers read step plans from (default: a free port)",
    )
    p.add_argument(
        "--result-addr",
        default=None,
        help="with --attach: ZeroMQ address the workers send results to (default: a free port)",
    )
    p.add_argument(
        "--worker-timeout",
        type=_numeric("worker_timeout"),
        default=600.0,
        help="seconds one step may take before the server declares the workers dead",
    )
    p.add_argument(
        "--startup-timeout",
        type=_numeric("startup_timeout"),
        default=3600.0,
        help="seconds the workers may take to load the model and report ready",
    )
    p.add_argument("--log-level", **worker_flag("log_level"))
    p.add_argument("--skip-warmup", **worker_flag("skip_warmup"))
    p.add_argument("--cache-dir", **worker_flag("cache_dir"))
    p.add_argument("--no-prefix-cache", action="store_true", help="turn the automatic prefix cache off")
    p.add_argument(
        "--max-waiting",
        type=_numeric("max_waiting"),
        default=1024,
        help="waiting requests beyond which new ones get HTTP 503 with Retry-After",
    )
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="the order waiting requests start in: fcfs (arrival) or priority (the request's `priority`, lower "
        "first, then arrival)",
    )
    p.add_argument(
        "--fake-workers",
        action="store_true",
        help="workers load no weights and return pseudo-random tokens (controller benchmarks, kimi.worker.fake)",
    )


def _add_http_and_backend_flags(p: argparse.ArgumentParser) -> None:
    """HTTP security and limits, reasoning, heartbeats and the `--device cuda` backends."""
    p.add_argument(
        "--api-key",
        default=envs.KIMI_API_KEY.get(),
        help="require 'Authorization: Bearer KEY' on every HTTP route but /health (default: $KIMI_API_KEY); "
        "the ZeroMQ submit API is then kept on loopback (docs/api.md)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_numeric("max_body_bytes"),
        default=32 << 20,
        help="larger HTTP request bodies get 413 (default: 32 MiB)",
    )
    p.add_argument(
        "--request-body-timeout",
        type=_numeric("request_body_timeout"),
        default=30.0,
        help="seconds to receive a request body after its headers, else HTTP 408",
    )
    p.add_argument(
        "--request-header-timeout",
        type=_numeric("request_header_timeout"),
        default=10.0,
        help="seconds for a connection to send a request's headers (from its opening, or from the previous "
        "response when kept alive), else it is closed",
    )
    p.add_argument(
        "--allowed-hosts",
        default="",
        help="comma-separated Host names served besides the bound address (name: any port; name:port; *: any); "
        "bound to 0.0.0.0 / :: without it, any Host is served (DNS-rebinding protection needs it then)",
    )
    p.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated browser origins (scheme://host[:port]; *: any) allowed cross-origin requests, with "
        "CORS; a request with any other Origin header gets 403 (default: none)",
    )
    p.add_argument(
        "--reasoning",
        default="auto",
        choices=["auto", "on", "off"],
        help="split chat output into reasoning_content (<think>...</think>); auto: on when the "
        "tokenizer has a <think> token",
    )
    p.add_argument("--a2a-backend", **worker_flag("a2a_backend"))
    p.add_argument("--a2a-static-decode", **worker_flag("a2a_static_decode"))
    p.add_argument(
        "--heartbeat-timeout",
        type=_numeric("heartbeat_timeout"),
        default=10.0,
        help=f"fail when a worker rank answers no ping for this many seconds (0 = off, else at least "
        f"{HEARTBEAT_MIN_S:g})",
    )
    p.add_argument("--moe-backend", **worker_flag("moe_backend"))
    p.add_argument("--load-format", **worker_flag("load_format"))
    p.add_argument(
        "--enforce-eager", action="store_true", help="--device cuda only: no CUDA graphs (every step runs eagerly)"
    )
    p.add_argument(
        "--no-prefill-graphs",
        action="store_true",
        help="--device cuda only: prefill and mixed steps run eagerly (default with --nproc 1: they replay CUDA "
        "graphs per token bucket; with more ranks they always run eagerly)",
    )
    p.add_argument("--fp8-dense", **worker_flag("fp8_dense"))
    p.add_argument("--emulate-ep-size", **worker_flag("emulate_ep_size", type=_numeric("emulate_ep_size")))
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="plan each step only after the last one's results are applied (default: the next step is "
        "planned and sent while one runs, so workers never wait for the controller)",
    )


# the largest prefill / mixed-step CUDA graph `kimi serve` asks for (--nproc 1): a step of more tokens is bound by its
# kernels, not by their launches, so a graph gains little there (a step of 2048 already: docs/performance.md) and
# would hold its activations in the graph pool for the server's life
PREFILL_GRAPH_TOKENS = 2048


def worker_config(a: ServeArgs, plan_addr: str, result_addr: str) -> WorkerConfig:
    """The settings of this server's worker ranks (the `--device cuda` only flags at their defaults on the cpu)."""
    cuda = a.device == "cuda"
    d = WorkerConfig(model=a.model, plan_addr=plan_addr, result_addr=result_addr)
    return replace(
        d,
        device=a.device,
        dtype=a.dtype,
        block_size=a.block_size,
        num_blocks=a.num_blocks,
        kv_cache_memory_gib=a.kv_cache_memory_gib,
        gpu_memory_utilization=a.gpu_memory_utilization,
        num_hidden_layers=a.num_hidden_layers,
        log_level=a.log_level,
        a2a_backend=a.a2a_backend,
        a2a_static_decode=a.a2a_static_decode,
        fake=a.fake_workers,
        moe_backend=a.moe_backend if cuda else d.moe_backend,
        load_format=a.load_format if cuda else d.load_format,
        fp8_dense=a.fp8_dense if cuda else d.fp8_dense,
        emulate_ep_size=a.emulate_ep_size if cuda else d.emulate_ep_size,
        cuda_graph_max_bs=(0 if a.enforce_eager else a.max_num_seqs) if cuda else d.cuda_graph_max_bs,
        prefill_graph_max_tokens=(
            0 if a.enforce_eager or a.no_prefill_graphs or a.nproc != 1 else min(a.token_budget, PREFILL_GRAPH_TOKENS)
        )
        if cuda
        else d.prefill_graph_max_tokens,
        max_num_seqs=a.max_num_seqs,
        token_budget=a.token_budget,
        max_model_len=a.max_model_len,
        skip_warmup=a.skip_warmup,
        cache_dir=a.cache_dir or cache_dir.default_dir(),
        speculative_config=a.speculative_config,
    )


def worker_command(a: ServeArgs, plan_addr: str, result_addr: str) -> list[str]:
    """The torchrun command line that starts this server's workers."""
    return [
        # torchrun (kimi.worker.launch: one line instead of a traceback when a rank fails); --standalone: one node,
        # rendezvous on a port the store picks itself (no free-port race)
        sys.executable,
        "-m",
        "kimi.worker.launch",
        "--standalone",
        "--nproc-per-node",
        str(a.nproc),
        "-m",
        "kimi.worker.main",
        *worker_config(a, plan_addr, result_addr).to_argv(),
    ]


class _Server(uvicorn.Server):
    """uvicorn without its own signal capture (it re-raises the signal on exit, which would kill the
    controller before it stops its workers); `serve` installs handlers that set `should_exit`."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a Linux process from /proc/<pid>/stat; None if it is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()  # after "pid (comm) ": state, ppid, ... (comm may hold spaces)
    return int(fields[1]), int(fields[19])


def _descendants(pid: int) -> dict[int, int]:
    """{pid: start time} of every live descendant of `pid` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for e in entries:
        if e.isdigit():
            st = _proc_stat(int(e))
            if st is not None:
                children.setdefault(st[0], []).append(int(e))
                starts[int(e)] = st[1]
    out: dict[int, int] = {}
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop()
        if p not in out:
            out[p] = starts[p]
            todo += children.get(p, [])
    return out


class WorkerProcess:
    """The torchrun child, its process group, and the worker processes under it."""

    def __init__(self, cmd: list[str], nproc: int = 1) -> None:
        # kimi.worker.launch writes the first failed rank and its exit code here (read by `check`)
        fd, self._report = tempfile.mkstemp(prefix="kimi-launch-", suffix=".json")
        os.close(fd)
        self.proc = subprocess.Popen(
            cmd, start_new_session=True, env={**os.environ, envs.KIMI_LAUNCH_REPORT.name: self._report}
        )
        self.nproc = nproc
        self._ranks: dict[int, int] = {}  # the processes seen under torchrun (pid -> start time)
        self._ranks_at = 0.0

    def check(self) -> str | None:
        rc = self.proc.poll()
        if rc is None:
            now = time.monotonic()
            # remember the ranks while torchrun lives (`stop` kills them if it dies): at every check until all nproc
            # are seen (torchrun starts them after a moment), then every 5 s
            if len(self._ranks) < self.nproc or now - self._ranks_at >= 5.0:
                self._ranks_at = now
                self._ranks.update(_descendants(self.proc.pid))
            return None
        failed = self._failed_rank()
        if failed is None:
            return f"worker process exited with code {rc} (torchrun: a worker rank died or failed)"
        rank, code = failed
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        return f"worker rank {rank} died: it {how} (torchrun then stopped the other ranks and exited with code {rc})"

    def _failed_rank(self) -> tuple[int, int] | None:
        """(rank, exit code) that kimi.worker.launch reported for the first failed rank, or None."""
        try:
            with open(self._report) as f:
                rep = json.load(f)
            return int(rep["rank"]), int(rep["exitcode"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def stop(self, grace_s: float = 5.0) -> None:
        """Let torchrun end within grace_s, then SIGTERM / SIGKILL its group; then SIGKILL any worker that outlived
        it. torchrun starts each rank in a session of its own (torch.distributed.elastic's subprocess handler), so
        signals to torchrun's group do not reach the ranks: torchrun forwards its SIGTERM, which a rank that cannot
        run (SIGSTOPped, wedged in the kernel) does not act on before torchrun itself is killed."""
        ranks = {**self._ranks, **_descendants(self.proc.pid)}  # the remembered ranks too: torchrun may be gone
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        ranks.update(_descendants(self.proc.pid))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(3)
                # torchrun's children share its group; make sure none outlives it
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        for pid, start in ranks.items():
            st = _proc_stat(pid)
            if st is None or st[1] != start:  # gone (or the pid now belongs to another process)
                continue
            for kill in (os.killpg, os.kill):  # a rank leads its own group: take its children with it
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:  # last: torchrun (gone now) may have written it while stopping
            os.unlink(self._report)
        except OSError:
            pass


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _cuda_unavailable() -> str | None:
    """Why the local workers could not run with `--device cuda` (None when CUDA is usable here).

    Imports torch, which the controller otherwise does not, so it is called only with `--device cuda`.
    """
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    return None


def load_model_meta(a: ServeArgs) -> tuple[ModelConfig, KimiTokenizer]:
    """The controller's view of the model: its config and tokenizer (no tensors).

    `--model preset:NAME` (with `--load-format dummy`: random weights of a real config, for benchmarks) takes
    the config from kimi/presets and the Kimi tokenizer files from `default_tokenizer_source()` (the real
    vocabulary) or, without it, the built-in byte-level one. Raises ValueError on a preset without dummy
    weights or an unknown preset.
    """
    if not a.model.startswith("preset:"):
        return ModelConfig.from_dir(a.model), KimiTokenizer.from_dir(a.model)
    from kimi.presets import load_preset
    from kimi.tokenizer import default_tokenizer_source, write_tokenizer_files

    if a.load_format != "dummy":
        raise ValueError(f"--model {a.model} has no weights: add --load-format dummy")
    try:
        cfg = ModelConfig.from_dict(load_preset(a.model[len("preset:") :]))
    except KeyError as e:
        raise ValueError(str(e.args[0])) from None
    with tempfile.TemporaryDirectory() as d:
        write_tokenizer_files(d, default_tokenizer_source())
        return cfg, KimiTokenizer.from_dir(d)


def eos_token_ids(cfg: ModelConfig, tokenizer: KimiTokenizer) -> frozenset[int]:
    """The ids that end a request: the checkpoint's EOS ids (`cfg.eos_token_ids`) and the tokenizer's `<|im_end|>`
    (the end of a chat turn) when its vocabulary has one."""
    ids = set(cfg.eos_token_ids)
    if tokenizer.im_end_id is not None:
        ids.add(tokenizer.im_end_id)
    return frozenset(ids)


def bind_http_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening TCP sockets for `host`:`port`, bound the way asyncio's `create_server(host=, port=)` (what
    uvicorn does itself) binds them: every address `host` resolves to, SO_REUSEADDR, IPv6 sockets v6-only.

    Raises OSError naming the address that could not be resolved or bound (nothing is left open then).
    """
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve --host {host!r}: {e.strerror or e}") from None
    socks: list[socket.socket] = []
    try:
        for family, type_, proto, _, sockaddr in dict.fromkeys(infos):
            sock = socket.socket(family, type_, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(sockaddr)
            except OSError as e:
                ip = str(sockaddr[0])  # a str for AF_INET / AF_INET6, the families a TCP getaddrinfo gives
                raise OSError(
                    f"cannot bind HTTP on {ip}:{port} (--host {host} --port {port}): {e.strerror or e}"
                ) from None
            sock.listen(2048)  # uvicorn's default backlog
            sock.setblocking(False)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def _check_flags(a: ServeArgs) -> int | None:
    """Log and return the exit status (2) for flags no server can run with; warn of ignored ones. None: go on."""
    err = check_serve_args(a)
    if err is not None:
        log.error("%s", err)
        return 2
    ignored = cuda_only_flags_set(a)
    if ignored:
        log.warning("%s: used with --device cuda only; ignored on --device %s", ", ".join(ignored), a.device)
    if (
        a.api_key
        and a.zmq_submit_addr
        and not a.zmq_submit_addr.startswith(("tcp://127.0.0.1:", "tcp://localhost:", "tcp://[::1]:", "ipc://"))
    ):
        log.error(
            "--api-key is set but --zmq-submit-addr %s is not loopback; the ZeroMQ API is unauthenticated",
            a.zmq_submit_addr,
        )
        return 2
    if not a.attach:  # the local workers' kernel cache: a folder that cannot be made fails here, not in a rank
        try:
            for d in cache_dir.library_dirs(a.cache_dir or cache_dir.default_dir()).values():
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.error("--cache-dir %s: cannot create %s", a.cache_dir or cache_dir.default_dir(), e)
            return 2
    return None


def _check_model(a: ServeArgs, cfg: ModelConfig, tokenizer: KimiTokenizer) -> ModelConfig | None:
    """Check the flags that depend on the model's config and this machine (logging why and returning None when one
    cannot work); returns the config with `--num-hidden-layers` applied."""
    if a.reasoning == "on" and tokenizer.decode([THINK_START_ID]) != "<think>":
        log.warning(
            "--reasoning on: this vocabulary has no <think> token (id %d is %r); chat output is still split "
            "at ids %d / %d, so a model that never emits them answers entirely in reasoning_content "
            "(--reasoning auto or off for such a model)",
            THINK_START_ID,
            tokenizer.decode([THINK_START_ID]),
            THINK_START_ID,
            THINK_END_ID,
        )
    if a.num_hidden_layers is not None:
        if a.num_hidden_layers > cfg.num_hidden_layers:
            log.error(
                "--num-hidden-layers %d: the model has only %d layers (give 1..%d)",
                a.num_hidden_layers,
                cfg.num_hidden_layers,
                cfg.num_hidden_layers,
            )
            return None
        cfg = cfg.with_overrides(num_hidden_layers=a.num_hidden_layers)
    if a.max_model_len is not None and a.max_model_len > cfg.max_position_embeddings:
        log.error(
            "--max-model-len %d: the model allows at most %d positions (max_position_embeddings; give 1..%d)",
            a.max_model_len,
            cfg.max_position_embeddings,
            cfg.max_position_embeddings,
        )
        return None
    if cfg.n_routed_experts % a.emulate_ep_size:
        log.error(
            "--emulate-ep-size %d: the model's %d routed experts do not split evenly over %d ranks",
            a.emulate_ep_size,
            cfg.n_routed_experts,
            a.emulate_ep_size,
        )
        return None
    if not a.fake_workers and cfg.n_routed_experts % a.nproc:  # --attach too: --nproc is then the world size
        log.error(
            "--nproc %d: the model's %d routed experts do not split evenly over %d ranks (expert parallelism "
            "gives every rank as many; use a divisor of %d)",
            a.nproc,
            cfg.n_routed_experts,
            a.nproc,
            cfg.n_routed_experts,
        )
        return None
    if a.device == "cuda" and not a.attach:
        err = _cuda_unavailable()
        if err is not None:
            log.error("--device cuda: %s", err)
            return None
    if a.a2a_backend is not None and not a.attach:
        from kimi.backends.all_to_all import check_backend

        try:
            check_backend(a.a2a_backend, a.nproc, a.device, cfg.n_routed_experts, a.a2a_static_decode)
        except ValueError as e:
            log.error("%s", e)
            return None
    return cfg


def _bind(
    a: ServeArgs,
    cfg: ModelConfig,
    tokenizer: KimiTokenizer,
    eos: frozenset[int],
    max_model_len: int,
    submit_addr: str,
) -> tuple[ControllerTransport, list[socket.socket], Engine, SubmitServer] | None:
    """Bind the worker sockets, HTTP and the ZeroMQ submit API, and build the engine; None (logged, everything
    bound so far closed) when an address cannot be bound."""
    # Bind everything before anything is launched.
    spec = SpeculativeConfig.from_json(a.speculative_config) if a.speculative_config else None
    transport = None
    http_socks: list[socket.socket] = []
    try:
        # no address given: ZeroMQ picks a free port at bind time (no window for another process to take it)
        what = (
            f"the worker plan / result sockets ({a.plan_addr or 'tcp://127.0.0.1:*'}, "
            f"{a.result_addr or 'tcp://127.0.0.1:*'})"
        )
        transport = ControllerTransport(a.plan_addr or "tcp://127.0.0.1:*", a.result_addr or "tcp://127.0.0.1:*")
        what = "HTTP"
        http_socks = bind_http_sockets(a.host, a.port)
        engine = Engine(
            tokenizer,
            eos,
            SchedulerConfig(
                max_num_seqs=a.max_num_seqs,
                token_budget=a.token_budget,
                max_model_len=max_model_len,
                policy=a.scheduling_policy,
                num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            ),
            CacheConfig(block_size=a.block_size, num_blocks=a.num_blocks, kv_cache_memory_gib=a.kv_cache_memory_gib),
            transport,
            vocab_size=cfg.vocab_size,
            step_timeout_s=a.worker_timeout,
            enable_prefix_caching=not a.no_prefix_cache,
            max_waiting=a.max_waiting,
            async_scheduling=not a.no_async_scheduling,
        )
        what = f"the ZeroMQ submit API on {submit_addr}"
        submit = SubmitServer(engine, tokenizer, submit_addr, cfg.vocab_size)
    except (OSError, zmq.ZMQError) as e:
        msg = str(e) if what == "HTTP" else f"cannot bind {what}: {e}"
        log.error("start-up failed: %s", msg)
        for sock in http_socks:
            sock.close()
        if transport is not None:
            transport.close()
        return None
    engine.liveness.heartbeat_timeout_s = a.heartbeat_timeout if a.heartbeat_timeout > 0 else None
    return transport, http_socks, engine, submit


def _http_server(a: ServeArgs, cfg: ModelConfig, tokenizer: KimiTokenizer, engine: Engine, name: str) -> _Server:
    """The OpenAI-compatible app behind the Host / Origin checks, in a uvicorn server (not started)."""
    if a.reasoning == "auto":
        thinking_model = tokenizer.decode([THINK_START_ID]) == "<think>"
    else:
        thinking_model = a.reasoning == "on"
    api = OpenAIServer(
        engine,
        tokenizer,
        name,
        cfg.vocab_size,
        api_key=a.api_key,
        max_body_bytes=a.max_body_bytes,
        body_timeout_s=a.request_body_timeout,
        thinking_model=thinking_model,
        chat_max_tokens=cfg.max_new_tokens,
        model_root=a.model,
    )
    security = SecurityConfig(
        bind_host=a.host,
        port=a.port,
        allowed_hosts=split_list(a.allowed_hosts),
        allowed_origins=split_list(a.allowed_origins),
    )
    for line in origins_and_hosts_summary(security):
        log.info("%s", line)
    http = _Server(
        uvicorn.Config(
            secure_app(api.app, security),
            host=a.host,
            port=a.port,
            log_level=a.log_level,
            lifespan="off",
            http=header_timeout_protocol(a.request_header_timeout),
        )
    )
    return http


async def serve(a: ServeArgs) -> int:
    """Run the server until a signal (returns 0) or a worker failure (returns 1); 2 for bad flags.

    Start-up order: flags and the model's config are checked, then every socket is bound (the workers'
    plan / result sockets, HTTP, the ZeroMQ submit API), and only then are the workers launched, so a flag
    or an address that cannot work fails with one line (2 for flags, 1 for an address) and nothing to stop.
    """
    rc = _check_flags(a)
    if rc is not None:
        return rc
    try:
        cfg, tokenizer = load_model_meta(a)
    except (ValueError, OSError) as e:  # e.g. a model folder without its tokenizer files: one line, not a traceback
        log.error("%s", e)
        return 2
    checked = _check_model(a, cfg, tokenizer)
    if checked is None:
        return 2
    cfg = checked
    try:
        speculative_config(a, cfg)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    eos = eos_token_ids(cfg, tokenizer)
    max_model_len = a.max_model_len or cfg.max_position_embeddings
    name = a.served_model_name or os.path.basename(os.path.normpath(a.model.removeprefix("preset:")))
    submit_addr = _submit_addr(a)
    bound = _bind(a, cfg, tokenizer, eos, max_model_len, submit_addr)
    if bound is None:
        return 1
    transport, http_socks, engine, submit = bound
    http = _http_server(a, cfg, tokenizer, engine, name)
    _handle_signals(http, engine)
    workers = None
    http_task = submit_task = engine_task = None
    rc = 0
    try:
        workers = _start_workers(a, engine, transport.plan_addr, transport.result_addr)
        log.info('HTTP on http://%s:%d (/health says "loading" until the workers are ready)', a.host, a.port)
        http_task = asyncio.create_task(http.serve(sockets=http_socks))
        submit_task = asyncio.create_task(submit.serve())
        start = asyncio.create_task(engine.start(a.nproc, timeout_s=a.startup_timeout, warm_up=not a.skip_warmup))
        await asyncio.wait({start, http_task}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():  # HTTP stopped (a signal) while loading, or failed
            start.cancel()
            if a.warmup_only:
                log.error("kimi warmup: stopped before every rank was warmed up; the kernel cache is not complete")
                return 1
            return _http_end(http_task, http)
        try:
            start.result()
        except Exception as e:
            log.error("start-up failed: %s", e)
            engine.fail_all(str(e))
            return 1
        if a.warmup_only:
            log.info("warm-up done on every rank (kernel cache: %s)", a.cache_dir or cache_dir.default_dir())
            return 0
        log.info("ready: model %r on http://%s:%d, ZeroMQ submit API on %s", name, a.host, a.port, submit_addr)
        # Everything allocated so far lives for the whole run: keep it out of the cyclic collector's scans,
        # and collect young objects less often (each step churns a few objects per running request).
        gc.freeze()
        gc.set_threshold(50_000, 20, 20)
        engine_task = asyncio.create_task(engine.run())
        done, _ = await asyncio.wait({engine_task, http_task}, return_when=asyncio.FIRST_COMPLETED)
        if engine.fatal_error is not None:
            rc = 1
            await asyncio.sleep(0.2)  # let streaming responses deliver their error chunks
        elif http_task in done:
            rc = _http_end(http_task, http)
    finally:
        http.should_exit = True
        try:
            await engine.shutdown()
        finally:
            if engine_task is not None and not engine_task.done():
                engine_task.cancel()
            if submit_task is not None:
                submit_task.cancel()
            submit.close()
            await _stop_http(http_task, http_socks)
            await _stop_workers(workers, engine, rc)
            transport.close()
    return rc


def _submit_addr(a: ServeArgs) -> str:
    """The ZeroMQ submit API's address: --zmq-submit-addr, else the HTTP host at port + 1 (loopback with an API
    key, since the submit API has no authentication)."""
    # an IPv6 literal host goes in brackets: tcp://[::1]:port
    submit_addr = a.zmq_submit_addr or f"tcp://{f'[{a.host}]' if ':' in a.host else a.host}:{a.port + 1}"
    if a.api_key and a.zmq_submit_addr is None:
        # The ZeroMQ submit API has no authentication: with an API key it stays on loopback.
        submit_addr = f"tcp://127.0.0.1:{a.port + 1}"
    return submit_addr


async def _stop_workers(workers: WorkerProcess | None, engine: Engine, rc: int) -> None:
    """Stop the worker processes (if launched): 5 s for a clean stop after a normal run, 1 s otherwise."""
    if workers is not None:
        # after a failure the surviving ranks may sit in a collective with a dead / stopped peer and
        # never see Shutdown; ranks still loading do not read it either: give them 1 s instead of 5
        # before the process group is terminated
        quick = engine.fatal_error is not None or rc or not engine.ready
        await asyncio.to_thread(workers.stop, 1.0 if quick else 5.0)


def _handle_signals(http: _Server, engine: Engine) -> None:
    """SIGINT, SIGTERM and SIGHUP (unless ignored, `nohup kimi serve`) stop HTTP and end every in-flight request."""
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        # Stop accepting connections and end every in-flight request now (an error chunk / 503), so that
        # open streams close and the server exits promptly instead of waiting for long generations.
        http.should_exit = True
        if engine.ready:
            engine.drain("the server is shutting down")

    # SIGHUP: the terminal / ssh session closed; left alone when ignored (`nohup kimi serve`)
    hup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)
    for sig in (signal.SIGINT, signal.SIGTERM, *hup):
        loop.add_signal_handler(sig, on_signal)


def _start_workers(a: ServeArgs, engine: Engine, plan_addr: str, result_addr: str) -> WorkerProcess | None:
    """Launch the local workers under torchrun (their exit becomes one of the engine's liveness checks), or with
    `--attach` log how to start external ones; returns the WorkerProcess (None with --attach)."""
    if a.attach:
        log.info(
            "waiting for %d external worker rank(s): run on every node `torchrun --nnodes M --node-rank I "
            "--nproc-per-node G --master-addr HOST0 --master-port P -m kimi.worker.main --model %s "
            "--plan-addr %s --result-addr %s --device %s ...` with the controller's reachable address "
            "(docs/multinode.md)",
            a.nproc,
            a.model,
            plan_addr,
            result_addr,
            a.device,
        )
        return None
    workers = WorkerProcess(worker_command(a, plan_addr, result_addr), a.nproc)
    engine.liveness.checks.append(workers.check)
    return workers


async def _stop_http(http_task: asyncio.Task[None] | None, http_socks: list[socket.socket]) -> None:
    """Wait up to 5 s for the HTTP server to end (it was told to), or close its sockets if it never started."""
    if http_task is not None:
        try:
            await asyncio.wait_for(http_task, 5)
        except (asyncio.TimeoutError, asyncio.CancelledError, Exception, SystemExit):
            pass
    else:
        for sock in http_socks:
            sock.close()


def _http_end(http_task: asyncio.Task[None], http: uvicorn.Server) -> int:
    """The exit status once the HTTP server has stopped: 0 after a signal, 1 when it stopped by itself."""
    if http.should_exit:
        return 0
    try:
        exc = http_task.exception()
    except asyncio.CancelledError:
        exc = None
    log.error("start-up failed: the HTTP server stopped%s", f": {exc!r}" if exc is not None else "")
    return 1


def run(a: ServeArgs) -> int:
    logging.basicConfig(
        level="DEBUG" if a.log_level == "trace" else a.log_level.upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    return asyncio.run(serve(a))

"""A real kimi server (controller + torchrun worker) on a free loopback port, on a tiny K2.6 checkpoint."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
from kimi import envs  # noqa: E402
from kimi.ipc import free_tcp_port  # noqa: E402
from kimi.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    zmq_addr: str
    model: str
    model_dir: str
    log_path: str

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")[-4000:]


def worker_pids(model_dir: str) -> list[int]:
    """PIDs of live kimi worker / torchrun processes serving model_dir (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{d}/stat").read_text().split()[2]
        except OSError:
            continue
        if (
            model_dir in cmd
            and ("kimi.worker.main" in cmd or "kimi.worker.launch" in cmd or "torch.distributed.run" in cmd)
            and state != "Z"
        ):
            out.append(int(d))
    return out


def default_sighup() -> None:
    """A child's SIGHUP back at its default (subprocess preexec_fn): under `nohup pytest` every child inherits SIGHUP
    ignored, and `kimi serve` keeps an inherited ignore on purpose (`nohup kimi serve`), so a test of what SIGHUP does
    gives its server the default first."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def start_server(
    model_dir: str, log_path: str, *extra: str, timeout_s: float = 120.0, sighup_default: bool = False
) -> Server:
    """`kimi serve` of model_dir on free ports, logging to log_path, once /health says ok (RuntimeError if it exits
    or is not healthy in timeout_s). sighup_default: the server starts with SIGHUP at its default (`default_sighup`)."""
    port = free_tcp_port()
    zport = free_tcp_port()
    cmd = [
        sys.executable,
        "-m",
        "kimi",
        "serve",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--zmq-submit-addr",
        f"tcp://127.0.0.1:{zport}",
        "--served-model-name",
        "tiny",
        *extra,
    ]
    if envs.KIMI_TEST_DEVICE.get() == "cuda":  # run the e2e suite on the GPU path (kimi/model/gpu_forward.py)
        cmd += ["--device", "cuda"]
    if a2a := envs.KIMI_TEST_A2A.get():  # e.g. KIMI_TEST_A2A=nccl: the all-to-all backend of the served worker
        cmd += ["--a2a-backend", a2a]
    logf = open(log_path, "w")
    proc = subprocess.Popen(
        cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=default_sighup if sighup_default else None
    )
    srv = Server(proc, f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{zport}", "tiny", model_dir, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{srv.log()}")
        try:
            r = httpx.get(f"{srv.base_url}/health", timeout=1)
            if r.status_code == 200 and r.json()["status"] == "ok":
                return srv
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop_server(srv)
    raise RuntimeError(f"server not healthy after {timeout_s} s:\n{srv.log()}")


@contextlib.contextmanager
def raw_dealer(addr: str):
    """A bare ZeroMQ DEALER socket connected to a server's submit API (no kimi.client), closed on exit."""
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    try:
        yield s
    finally:
        s.close(0)
        ctx.term()


def stop_server(srv: Server, sig: int = signal.SIGTERM) -> int:
    if srv.proc.poll() is None:
        srv.proc.send_signal(sig)
    try:
        return srv.proc.wait(30)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        raise


@pytest.fixture(scope="session")
def tiny_k26(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("ckpt") / "tiny-k2.6"
    make_tiny_checkpoint(str(d), layout="k2.6", seed=0)
    return str(d)


@pytest.fixture(scope="module")
def server(tiny_k26, tmp_path_factory):
    """Small blocks and a small token budget so that prompts span blocks and prefills are chunked."""
    log = str(tmp_path_factory.mktemp("log") / "server.log")
    srv = start_server(
        tiny_k26,
        log,
        "--block-size",
        "16",
        "--token-budget",
        "48",
        "--max-model-len",
        "512",
        "--num-blocks",
        "400",
        "--request-body-timeout",
        "2",
    )
    yield srv
    rc = stop_server(srv)
    assert rc == 0, srv.log()
    deadline = time.monotonic() + 10
    while worker_pids(tiny_k26) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert worker_pids(tiny_k26) == [], "worker processes outlived the server"


@pytest.fixture(scope="module")
def fake_srv(tiny_k26, tmp_path_factory):
    """`kimi serve --fake-workers` (pseudo-random tokens through the real ZeroMQ / torchrun path, no weights): 2000
    blocks of 16 tokens, up to 64 running requests."""
    log = str(tmp_path_factory.mktemp("log") / "fake_workers.log")
    srv = start_server(
        tiny_k26, log, "--fake-workers", "--block-size", "16", "--num-blocks", "2000", "--max-num-seqs", "64"
    )
    yield srv
    assert stop_server(srv) == 0, srv.log()


def offline_client_env(home: Path) -> dict[str, str]:
    """Environment for a client program run as a subprocess (guidellm, lm-eval) against a loopback server.

    Hugging Face libraries are offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE, TRANSFORMERS_OFFLINE) with their caches
    under `home`, the OpenAI key is a dummy, and every proxy variable points at the discard port of 127.0.0.1 with
    only loopback exempt (NO_PROXY), so an HTTP request to any other host fails at once instead of leaving the
    machine.
    """
    env = dict(os.environ)
    dead = "http://127.0.0.1:9"
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(home / "hf"),
        OPENAI_API_KEY="dummy",
        HTTP_PROXY=dead,
        HTTPS_PROXY=dead,
        ALL_PROXY=dead,
        http_proxy=dead,
        https_proxy=dead,
        all_proxy=dead,
        NO_PROXY="127.0.0.1,localhost,::1",
        no_proxy="127.0.0.1,localhost,::1",
    )
    return env

"""Start-up failures of a real `kimi serve`: an address that cannot be bound, a layer count the model does
not have, a KV cache no worker can allocate. Each must exit non-zero with one clear error line, no Python
traceback, and leave no process behind: neither in kimi's own process group (it is started in a session of
its own) nor any torchrun / kimi.worker.main process serving this test's uniquely named checkpoint."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch
from conftest import REPO, default_sighup, start_server, stop_server, worker_pids

from kimi.ipc import free_tcp_port


@pytest.fixture
def model(tiny_k26, tmp_path) -> str:
    """The tiny checkpoint under a unique name: every process of this test carries it in its command line."""
    link = tmp_path / f"ckpt-{uuid.uuid4().hex}"
    link.symlink_to(tiny_k26)
    return str(link)


def _serve(model: str, *args: str, timeout_s: float = 60) -> tuple[int, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kimi", "serve", "--model", model, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        raise
    # right after exit: nothing of kimi's process group, and no worker / torchrun of this checkpoint
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
    assert worker_pids(model) == [], f"processes outlived the server:\n{out}"
    return proc.returncode, out


def _error_lines(out: str) -> list[str]:
    assert "Traceback" not in out and "never retrieved" not in out, out
    return [line for line in out.splitlines() if " ERROR " in line]


def test_http_port_in_use(model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, out = _serve(model, "--port", str(port), "--zmq-submit-addr", f"tcp://127.0.0.1:{free_tcp_port()}")
    assert rc == 1, out
    errors = _error_lines(out)
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "Address already in use" in errors[0], out
    assert "kimi.worker.launch" not in out and "rank0" not in out, "workers were launched"


def test_zmq_submit_port_in_use(model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        zport = s.getsockname()[1]
        rc, out = _serve(model, "--port", str(free_tcp_port()), "--zmq-submit-addr", f"tcp://127.0.0.1:{zport}")
    assert rc == 1, out
    errors = _error_lines(out)
    assert len(errors) == 1 and f"tcp://127.0.0.1:{zport}" in errors[0] and "Address already in use" in errors[0], out


def test_host_that_cannot_be_bound(model):
    rc, out = _serve(model, "--host", "10.255.255.1", "--port", str(free_tcp_port()))
    assert rc == 1, out
    errors = _error_lines(out)
    assert len(errors) == 1 and "10.255.255.1" in errors[0] and "cannot bind HTTP" in errors[0], out


_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.mark.parametrize(
    "flags,expect",
    [
        (("--num-hidden-layers", "999"), ["--num-hidden-layers 999"]),
        (("--max-model-len", "1000000"), ["--max-model-len 1000000", "262144"]),
        pytest.param(("--device", "cuda"), ["--device cuda: CUDA is not available"], marks=_NO_CUDA),
        # the tiny checkpoint's 16 routed experts do not split over 3 ranks (each rank raised it after launch)
        (("--nproc", "3"), ["--nproc 3", "16 routed experts", "divisor of 16"]),
    ],
    ids=["num-hidden-layers", "max-model-len", "device-cuda", "nproc-experts"],
)
def test_config_or_machine_check_exits_2_before_launching(model, flags, expect):
    """Flags checked once the config is read (or against the machine): one error line naming the flag, exit 2,
    no worker launched, no traceback."""
    rc, out = _serve(
        model, *flags, "--port", str(free_tcp_port()), "--zmq-submit-addr", f"tcp://127.0.0.1:{free_tcp_port()}"
    )
    assert rc == 2, out
    errors = _error_lines(out)
    assert len(errors) == 1 and all(e in errors[0] for e in expect), out
    assert "kimi.worker.launch" not in out and "rank0" not in out and "Traceback" not in out, out


def test_bad_flag_exits_2_at_once(model):
    rc, out = _serve(model, "--port", "99999")
    assert rc == 2 and "argument --port" in out, out
    rc, out = _serve(model, "--log-level", "loud")  # was a ValueError traceback from logging.basicConfig
    assert rc == 2 and "argument --log-level" in out and "Traceback" not in out, out


def _start_ready(model: str, *args: str, wait_s: float = 90) -> tuple[subprocess.Popen, int]:
    """`kimi serve --fake-workers` (no model load) with args on free ports, polled until /health answers 200; the
    process is killed and the test fails if it exits or is not ready within wait_s."""
    import httpx

    port = free_tcp_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kimi",
            "serve",
            "--model",
            model,
            "--fake-workers",
            *args,
            "--port",
            str(port),
            "--zmq-submit-addr",
            f"tcp://127.0.0.1:{free_tcp_port()}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline, ready = time.monotonic() + wait_s, False
    while time.monotonic() < deadline and proc.poll() is None and not ready:
        try:
            ready = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # (trace logs every poll: few polls keep the unread output pipe from filling)
    if not ready or proc.poll() is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the server never became ready:\n{proc.communicate(timeout=30)[0]}")
    return proc, port


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group: it must exit 0 without a traceback."""
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in out, out


def test_log_level_trace_is_accepted(model):
    """uvicorn's `trace` (and any case) starts the server; kimi logs at debug."""
    proc, _ = _start_ready(model, "--log-level", "TRACE")
    _stop(proc)


@pytest.mark.parametrize("level,quiet", [("warning", True), ("info", False)])
def test_log_level_reaches_the_worker_ranks(model, tmp_path, level, quiet):
    """--log-level is the ranks' level too: at warning the served output (controller, uvicorn, the rank, a request
    served, the shutdown) has no INFO line and no checkpoint-loading bar; at info (the default) the rank's lines and
    the bar are there."""
    import httpx

    srv = start_server(model, str(tmp_path / "serve.log"), "--log-level", level)
    try:
        r = httpx.post(
            f"{srv.base_url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200, r.text
    finally:
        assert stop_server(srv) == 0
    out = open(srv.log_path).read()
    rank_info = [line for line in out.splitlines() if " rank0 INFO " in line]
    if quiet:
        assert not [line for line in out.splitlines() if " INFO " in line or "INFO:" in line], out
        assert "Loading checkpoint" not in out, out
    else:
        assert rank_info and "Loading checkpoint" in out, out


def test_worker_start_up_failure_stops_every_worker(model):
    """Workers launched, then start-up fails (a KV cache too small for one block): the whole torchrun process
    group is gone when kimi exits."""
    rc, out = _serve(
        model,
        "--port",
        str(free_tcp_port()),
        "--zmq-submit-addr",
        f"tcp://127.0.0.1:{free_tcp_port()}",
        "--kv-cache-memory-gib",
        "1e-9",
        "--startup-timeout",
        "60",
        timeout_s=120,
    )
    assert rc == 1, out
    errors = _error_lines(out)  # no traceback: neither the worker's nor torchrun's
    assert len(errors) == 1 and "start-up failed" in errors[0] and "--kv-cache-memory-gib" in errors[0], out
    # torchrun's last word depends on which comes first, the failed rank's own exit or the server's stop of
    # torchrun one second after the error: either is a clean end (no process is left: _serve checks that)
    launch = [line for line in out.splitlines() if line.startswith("kimi.worker.launch:")]
    assert launch in (
        ["kimi.worker.launch: worker rank 0 exited with code 1"],
        ["kimi.worker.launch: stopped by SIGTERM"],
    ), out


def test_kv_cache_larger_than_memory_fails_before_the_weights_load(model):
    """--num-blocks far beyond the machine's memory: the worker refuses it before loading any weight (for a real
    checkpoint, minutes), with one error line naming the flag and the sizes, and exits; no traceback."""
    rc, out = _serve(
        model,
        "--port",
        str(free_tcp_port()),
        "--zmq-submit-addr",
        f"tcp://127.0.0.1:{free_tcp_port()}",
        "--num-blocks",
        str(10**12),
        "--startup-timeout",
        "60",
        timeout_s=120,
    )
    assert rc == 1, out
    errors = _error_lines(out)
    assert len(errors) == 1 and "--num-blocks: the KV cache of 1000000000000 blocks needs" in errors[0], out
    assert "GiB free on cpu before the weights load" in errors[0], out
    assert "weights loaded" not in out and "Loading checkpoint" not in out, out


def test_model_folder_without_its_tokenizer(tiny_k26, tmp_path):
    """A checkpoint folder whose tiktoken.model is missing (e.g. a half-written copy): one error line naming the
    file, exit 2, no traceback, no workers launched."""
    import shutil

    broken = tmp_path / f"ckpt-{uuid.uuid4().hex}"
    shutil.copytree(tiny_k26, broken)
    (broken / "tiktoken.model").unlink()
    rc, out = _serve(
        str(broken), "--port", str(free_tcp_port()), "--zmq-submit-addr", f"tcp://127.0.0.1:{free_tcp_port()}"
    )
    assert rc == 2, out
    errors = _error_lines(out)
    assert len(errors) == 1 and "tiktoken.model" in errors[0], out
    assert "kimi.worker.launch" not in out and "rank0" not in out, "workers were launched"


# `kimi serve` (kimi.cli.main on the command line), paused at the start of reading the model's config and tokenizer
# until the FIFO argv[1] can be read: a fixed point of the start-up before the server's own signal handlers exist
_PAUSED_SERVE = """
import sys
import kimi.server
load, fifo = kimi.server.load_model_meta, sys.argv[1]
def paused(a):
    with open(fifo) as f:
        f.read()
    return load(a)
kimi.server.load_model_meta = paused
sys.argv = ["kimi"] + sys.argv[2:]
from kimi.cli import main
sys.exit(main())
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_stop_signal_during_start_up_exits_0_with_one_line(model, tmp_path, sig):
    """A stop signal before the server's own handlers are installed (here while start-up waits to read the model's
    config; the test holds a FIFO open and never writes it): exit 0 with the one line `kimi serve: stopped by SIG...
    during start-up`, as a stop signal later gives, not a KeyboardInterrupt traceback or death by the signal (exit
    128 + N, as before: a newcomer's report); nothing was launched."""
    import errno

    fifo = tmp_path / "pause"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _PAUSED_SERVE,
            str(fifo),
            "serve",
            "--model",
            model,
            "--port",
            str(free_tcp_port()),
            "--zmq-submit-addr",
            f"tcp://127.0.0.1:{free_tcp_port()}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=default_sighup,  # under `nohup pytest` it would inherit SIGHUP ignored, and keep it so
    )
    fd, deadline = None, time.monotonic() + 60
    try:
        while fd is None:  # a non-blocking open for writing succeeds once the server has the FIFO open to read
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                assert e.errno == errno.ENXIO, e
                assert proc.poll() is None, f"the server exited before its pause:\n{proc.communicate()[0]}"
                assert time.monotonic() < deadline, "the server never reached its pause"
                time.sleep(0.05)
        time.sleep(0.2)  # let it block in the read
        os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        if fd is not None:
            os.close(fd)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    assert "Traceback" not in out and f"kimi serve: stopped by {sig.name} during start-up" in out, out
    assert "kimi.worker.launch" not in out and "rank0" not in out, "workers were launched"
    assert worker_pids(model) == []


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_ipv6_host_serves_http_and_zeromq(model):
    """--host ::1: HTTP on [::1] and the ZeroMQ submit API on tcp://[::1]:port+1 (its default address used to lack
    the brackets, and the sockets IPv6: start-up failed with 'No such device'; found by an operator-side tester).
    --fake-workers: no model load."""
    import httpx

    from kimi.client import KimiClient

    port = free_tcp_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kimi",
            "serve",
            "--model",
            model,
            "--host",
            "::1",
            "--port",
            str(port),
            "--fake-workers",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://[::1]:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0]
        r = httpx.post(f"http://[::1]:{port}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        with KimiClient(f"tcp://[::1]:{port + 1}", timeout_s=30) as c:
            outs = list(c.generate([1, 2, 3], max_tokens=3))
        assert outs[-1].finished and outs[-1].error is None and sum(len(o.token_ids) for o in outs) == 3, outs
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in out, out


def test_start_up_is_bounded_by_startup_timeout_not_worker_timeout(model):
    """--worker-timeout bounds one step only: a server with a 0.5 s step bound still starts (its workers take
    seconds to launch) and answers; --startup-timeout bounds the start-up: at 0.5 s it exits 1 with one error line
    naming the flag, and no worker is left."""
    import httpx

    proc, port = _start_ready(model, "--worker-timeout", "0.5")
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    finally:
        _stop(proc)

    rc, out = _serve(
        model,
        "--fake-workers",
        "--startup-timeout",
        "0.5",
        "--port",
        str(free_tcp_port()),
        "--zmq-submit-addr",
        f"tcp://127.0.0.1:{free_tcp_port()}",
        timeout_s=90,
    )
    assert rc == 1, out
    errors = _error_lines(out)
    assert len(errors) == 1 and "workers not ready after 0.5 s" in errors[0] and "--startup-timeout" in errors[0], out

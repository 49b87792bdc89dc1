"""Faults with many ranks: a worker rank killed mid-stream, and a rank frozen with SIGSTOP.

Every in-flight client must get an error (streaming: an error event, which the openai client raises as
APIError; non-streaming: a 5xx with an OpenAI error body), the server must exit non-zero within seconds,
and no worker or torchrun process may be left behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import start_server, stop_server, worker_pids

ARGS = ("--block-size", "16", "--max-model-len", "256", "--num-blocks", "200", "--nproc", "2")


def _rank_pid(model_dir: str, rank: int) -> int:
    """The kimi.worker.main process of torchrun rank `rank` (found by its RANK environment variable)."""
    for pid in worker_pids(model_dir):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kimi.worker.main" in cmd and b"kimi.worker.launch" not in cmd and f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no worker process for rank {rank}")


def _agent_pid(model_dir: str) -> int:
    """The torchrun agent (kimi.worker.launch, i.e. torch.distributed.run) serving model_dir."""
    for pid in worker_pids(model_dir):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"kimi.worker.launch" in cmd:
            return pid
    raise AssertionError("no torchrun process")


async def _stream(
    ac: openai.AsyncOpenAI, prompt: list[int], started: asyncio.Event, chunks: list
) -> BaseException | None:
    try:
        stream = await ac.completions.create(
            model="tiny", prompt=prompt, max_tokens=240, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        async for ch in stream:
            chunks.append(ch)
            started.set()
    except BaseException as e:
        return e
    return None


async def _plain(base_url: str, prompt: list[int]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as c:
        return await c.post(
            f"{base_url}/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 240, "temperature": 0, "ignore_eos": True},
        )


def _fault_run(
    model_dir: str, log_path: str, sig: int, *extra: str, agent: bool = False
) -> tuple[list, list, float, float, int]:
    """Start a 2-rank server, run 4 streaming + 2 non-streaming requests, send `sig` to rank 1 (agent: to the
    torchrun agent instead) once every stream has produced a chunk. Returns (stream results, plain responses,
    seconds from the signal until every client had its error, seconds from the signal to the server's exit, server
    exit code)."""
    srv = start_server(model_dir, log_path, *ARGS, *extra)
    victim = _agent_pid(model_dir) if agent else _rank_pid(model_dir, 1)
    sent_at = 0.0
    try:

        async def go():
            nonlocal sent_at
            ac = openai.AsyncOpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
            try:
                events = [asyncio.Event() for _ in range(4)]
                chunks: list[list] = [[] for _ in range(4)]
                streams = [
                    asyncio.create_task(_stream(ac, [10 + i, 20, 30 + i], events[i], chunks[i])) for i in range(4)
                ]
                plains = [asyncio.create_task(_plain(srv.base_url, [40 + i, 50])) for i in range(2)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
                assert all(not t.done() for t in streams + plains), "requests ended before the fault"
                os.kill(victim, sig)
                sent_at = time.monotonic()
                out = await asyncio.gather(*streams), await asyncio.gather(*plains), chunks
                return (*out, time.monotonic() - sent_at)
            finally:
                await ac.close()

        streams, plains, chunks, detected = asyncio.run(go())
        rc = srv.proc.wait(30)
        took = time.monotonic() - sent_at
    finally:
        if srv.proc.poll() is None:  # the run itself failed: release the victim so the cleanup below works
            srv.proc.kill()
            try:
                os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:
                pass
    # a SIGSTOPped victim is NOT continued here: the server's exit must not leave it behind (it cannot act on
    # torchrun's SIGTERM)
    deadline = time.monotonic() + 15
    while worker_pids(model_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = worker_pids(model_dir)
    for pid in left:  # do not leak into later tests, but still fail this one
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes left behind: {left}\n{srv.log()}"
    assert all(len(c) >= 1 for c in chunks)
    return streams, plains, detected, took, rc


def _check_errors(streams: list, plains: list[httpx.Response], log: str) -> None:
    for e in streams:
        assert isinstance(e, openai.APIError), (e, log)
        assert "rank" in str(e.message) and ("died" in e.message or "failed" in e.message or "stopped" in e.message), (
            e.message
        )
    for r in plains:
        assert r.status_code >= 500, (r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"], err


def test_killed_rank_fails_every_request_and_exits(tiny_k26, tmp_path):
    log_path = str(tmp_path / "server.log")
    streams, plains, detected, took, rc = _fault_run(tiny_k26, log_path, signal.SIGKILL)
    log = Path(log_path).read_text(errors="replace")
    _check_errors(streams, plains, log[-3000:])
    assert rc != 0, log[-3000:]
    assert detected < 10 and took < 20, (detected, took)  # lenient: the CI box may be busy


def test_killed_torchrun_agent_is_noticed_under_load(tiny_k26, tmp_path):
    """SIGKILL of the torchrun agent while requests run (its ranks live on, orphaned, and keep answering): the
    controller notices within its liveness period although no wait times out under load, fails every request, exits
    non-zero, and takes the orphaned ranks down (found by an operator-side tester: the server kept serving until idle
    and the ranks lingered until their silence timeout)."""
    log_path = str(tmp_path / "server.log")
    streams, plains, detected, took, rc = _fault_run(tiny_k26, log_path, signal.SIGKILL, agent=True)
    log = Path(log_path).read_text(errors="replace")
    for e in streams:
        assert isinstance(e, openai.APIError) and "worker process exited" in str(e.message), (e, log[-3000:])
    for r in plains:
        assert r.status_code >= 500 and "worker process exited" in r.json()["error"]["message"], r.text
    assert rc != 0, log[-3000:]
    assert detected < 10 and took < 20, (detected, took)


def test_stopped_rank_is_detected_by_heartbeat(tiny_k26, tmp_path):
    log_path = str(tmp_path / "server.log")
    streams, plains, detected, took, rc = _fault_run(tiny_k26, log_path, signal.SIGSTOP, "--heartbeat-timeout", "3")
    log = Path(log_path).read_text(errors="replace")
    _check_errors(streams, plains, log[-3000:])
    assert "worker rank(s) [1] stopped answering" in log, log[-3000:]
    assert rc != 0, log[-3000:]
    # 3 s heartbeat timeout (+ up to 1 s ping spacing); exit: + 1 s grace + 3 s for torchrun to obey SIGTERM
    assert detected < 10 and took < 20, (detected, took)


def test_workers_exit_when_the_controller_is_killed(tiny_k26, tmp_path):
    """SIGKILL leaves the controller no chance to clean up: the workers notice the silence and exit, and torchrun
    (kimi.worker.launch) removes the controller's report file instead of writing the ranks' exit into it."""
    srv = start_server(tiny_k26, str(tmp_path / "server.log"), "--block-size", "16", "--num-blocks", "64")
    assert worker_pids(tiny_k26), "no worker processes found"
    env = Path(f"/proc/{_agent_pid(tiny_k26)}/environ").read_bytes().split(b"\0")
    report = next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"KIMI_LAUNCH_REPORT="))
    assert os.path.exists(report)
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait(10)
    deadline = time.monotonic() + 45  # the workers' --controller-timeout is 15 s (+5 s for the heartbeat thread)
    while worker_pids(tiny_k26) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert worker_pids(tiny_k26) == [], "workers outlived a killed controller"
    assert not os.path.exists(report), "the launch report file was left behind"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_ends_open_streams_with_an_error_and_exits_0(tiny_k26, tmp_path, sig):
    """Shutdown does not wait for long generations: open streams get an error event, the server exits 0. SIGHUP (a
    closed terminal or ssh session) stops it the same way (it killed the controller at once, leaving the ranks
    until their silence timeout: found by an operator-side tester)."""
    srv = start_server(
        tiny_k26, str(tmp_path / "server.log"), "--block-size", "16", "--num-blocks", "256", sighup_default=True
    )
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0, timeout=60)
        stream = client.completions.create(
            model="tiny", prompt=[1, 2, 3], max_tokens=3000, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        got, err = 0, None
        t_sig = None
        try:
            for _ in stream:
                got += 1
                if got == 3:
                    srv.proc.send_signal(sig)
                    t_sig = time.monotonic()
        except openai.APIError as e:
            err = e
        assert t_sig is not None and err is not None and "shutting down" in str(err.message), (got, err)
    except BaseException:
        if srv.proc.poll() is None:  # the signal did not stop it: the later checks would leave it running
            stop_server(srv)
        raise
    assert time.monotonic() - t_sig < 10
    assert srv.proc.wait(30) == 0, Path(srv.log_path).read_text()[-2000:]
    deadline = time.monotonic() + 10
    while worker_pids(tiny_k26) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert worker_pids(tiny_k26) == []

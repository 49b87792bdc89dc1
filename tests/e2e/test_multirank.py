"""Many ranks end to end: DP attention x EP MoE over gloo under torchrun, driven by the official openai client.

The tiny checkpoint has 16 experts, so 2 ranks own 8 each and 4 ranks own 4 each. 16 concurrent requests (greedy,
and every other one seeded at temperature 1) must produce exactly the 1-rank server's text, and the requests must
be spread over the ranks: each worker logs at exit how many requests it ran and how many tokens it sampled (its own
counters, not the router's intent), and those lines are read back from the server log. Then one request alone
(the other ranks idle) must match too. Each rank count runs with the variable splits and with the static decode
layout (`--a2a-static-decode`), whose steps each rank counts at exit.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import time

import openai
import pytest
from conftest import REPO, start_server, stop_server, worker_pids

from kimi.ipc import free_tcp_port

ARGS = ("--block-size", "16", "--token-budget", "64", "--max-model-len", "256", "--num-blocks", "200")
N_REQ = 16
MAX_TOKENS = [3 + (i % 4) for i in range(N_REQ)]  # 3..6 tokens: short, CPU time matters with 4 ranks on 2 cores
ALONE = ([7, 70, 700, 7000], 8)  # the request sent alone (prompt, max_tokens): every other rank idle


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(0, 160000) for _ in range(rng.randrange(1, 40))] for _ in range(N_REQ)]


def _sampling(i: int) -> dict:
    """Request i's sampling: greedy for even i, seeded at temperature 1 for odd i."""
    return dict(temperature=0) if i % 2 == 0 else dict(temperature=1.0, seed=1000 + i)


def _run_concurrent(base_url: str, prompts: list[list[int]], max_tokens: list[int]) -> list[tuple[str, int]]:
    async def go():
        ac = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            rs = await asyncio.gather(
                *[
                    ac.completions.create(
                        model="tiny", prompt=p, max_tokens=m, extra_body={"ignore_eos": True}, **_sampling(i)
                    )
                    for i, (p, m) in enumerate(zip(prompts, max_tokens))
                ]
            )
        finally:
            await ac.close()
        return [(r.choices[0].text, r.usage.completion_tokens) for r in rs]

    return asyncio.run(go())


def _stop_and_check(srv, model_dir: str) -> str:
    rc = stop_server(srv)
    log = open(srv.log_path, errors="replace").read()
    assert rc == 0, log[-4000:]
    deadline = time.monotonic() + 10
    while worker_pids(model_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert worker_pids(model_dir) == [], "worker processes outlived the server"
    return log


def _served(log: str) -> dict[int, tuple[int, int]]:
    """rank -> (requests run, tokens sampled), from the workers' exit lines."""
    return {
        int(m[0]): (int(m[1]), int(m[2]))
        for m in re.findall(r"rank (\d+) served (\d+) requests, sampled (\d+) tokens", log)
    }


@pytest.fixture(scope="module")
def reference(tiny_k26, tmp_path_factory) -> list[tuple[str, int]]:
    """The 1-rank server's answers (same weights, local all-to-all): the N_REQ concurrent requests, then ALONE."""
    srv = start_server(tiny_k26, str(tmp_path_factory.mktemp("log") / "ref.log"), *ARGS)
    try:
        out = _run_concurrent(srv.base_url, _prompts(), MAX_TOKENS)
        out += _run_concurrent(srv.base_url, [ALONE[0]], [ALONE[1]])
    finally:
        log = _stop_and_check(srv, tiny_k26)
    assert _served(log) == {0: (N_REQ + 1, sum(MAX_TOKENS) + ALONE[1])}
    return out


def _static_steps(log: str) -> dict[int, tuple[int, int]]:
    """rank -> (static-layout steps, variable-split steps), from the workers' exit lines."""
    return {
        int(m[0]): (int(m[1]), int(m[2]))
        for m in re.findall(r"rank (\d+): all-to-all layout: (\d+) static steps, (\d+) variable-split steps", log)
    }


@pytest.mark.parametrize("static", [False, True], ids=["variable", "static"])
@pytest.mark.parametrize("nproc", [2, 4])
def test_many_ranks_match_one_rank_and_spread(tiny_k26, tmp_path, reference, nproc, static):
    extra = ("--a2a-static-decode",) if static else ()
    srv = start_server(
        tiny_k26,
        str(tmp_path / "server.log"),
        *ARGS,
        "--nproc",
        str(nproc),
        "--a2a-backend",
        "gloo",
        *extra,
        timeout_s=180,
    )
    try:
        got = _run_concurrent(srv.base_url, _prompts(), MAX_TOKENS)
        alone = _run_concurrent(srv.base_url, [ALONE[0]], [ALONE[1]])  # one request: the other ranks idle
    finally:
        log = _stop_and_check(srv, tiny_k26)
    assert [n for _, n in got] == MAX_TOKENS
    assert got + alone == reference
    assert f"rank {nproc - 1} of {nproc}: all-to-all backend gloo" in log
    served = _served(log)
    assert sorted(served) == list(range(nproc)), log[-3000:]
    assert sum(r for r, _ in served.values()) == N_REQ + 1
    assert sum(t for _, t in served.values()) == sum(MAX_TOKENS) + ALONE[1]
    assert all(r >= N_REQ // nproc - 1 for r, _ in served.values()), served  # spread by load, not piled on one rank
    steps = _static_steps(log)
    if static:  # every rank ran decode steps in the static layout and the prefills in variable splits
        assert sorted(steps) == list(range(nproc)), log[-3000:]
        assert all(s > 0 and v > 0 for s, v in steps.values()), steps
        assert len(set(steps.values())) == 1, steps  # the same layout on every rank, step by step
    else:
        assert steps == {}


def test_attach_two_nodes(tiny_k26, tmp_path, reference):
    """`kimi serve --attach` + two torchrun "nodes" (static rendezvous, one rank each) launched by hand."""
    plan, result, master = free_tcp_port(), free_tcp_port(), free_tcp_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = []
    for node_rank in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node_rank),
            "--nproc-per-node",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(master),
            "-m",
            "kimi.worker.main",
            "--model",
            tiny_k26,
            "--plan-addr",
            f"tcp://127.0.0.1:{plan}",
            "--result-addr",
            f"tcp://127.0.0.1:{result}",
            "--block-size",
            "16",
            "--num-blocks",
            "200",
            "--no-progress",
        ]
        logf = open(tmp_path / f"node{node_rank}.log", "w")
        nodes.append(
            subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        )
    try:
        srv = start_server(
            tiny_k26,
            str(tmp_path / "server.log"),
            *ARGS,
            "--attach",
            "--nproc",
            "2",
            "--plan-addr",
            f"tcp://0.0.0.0:{plan}",
            "--result-addr",
            f"tcp://0.0.0.0:{result}",
            timeout_s=120,
        )
        try:
            got = _run_concurrent(srv.base_url, _prompts()[:6], MAX_TOKENS[:6])
        finally:
            assert stop_server(srv) == 0, srv.log()
        assert got == reference[:6]
        for p in nodes:  # the controller's Shutdown ends the external workers too
            assert p.wait(30) == 0
        logs = [(tmp_path / f"node{i}.log").read_text() for i in range(2)]
        served = _served("".join(logs))
        assert sorted(served) == [0, 1] and sum(r for r, _ in served.values()) == 6, logs
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)

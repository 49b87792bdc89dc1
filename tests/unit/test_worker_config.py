"""WorkerConfig: each worker flag declared once; `to_argv` / `from_argv` round-trip it, and `kimi serve` takes the
flags it shares with the worker from the same fields."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kimi.config import WorkerConfig
from kimi.server import PREFILL_GRAPH_TOKENS, ServeArgs, add_serve_args, worker_command, worker_config

BASE = dict(model="/ckpt/kimi", plan_addr="tcp://127.0.0.1:5555", result_addr="tcp://127.0.0.1:5556")

# one value per field that differs from its default (and, for a field with choices, is one of them)
OTHER = dict(
    device="cuda",
    dtype="bfloat16",
    block_size=16,
    num_blocks=200,
    kv_cache_memory_gib=1.5,
    gpu_memory_utilization=0.85,
    num_hidden_layers=3,
    controller_timeout=7.5,
    no_progress=True,
    log_level="trace",
    a2a_backend="gloo",
    a2a_static_decode=True,
    dist_timeout=30.0,
    ll_max_tokens=64,
    fake=True,
    moe_backend="triton",
    load_format="dummy",
    cuda_graph_max_bs=256,
    prefill_graph_max_tokens=2048,
    fp8_dense="humming",
    emulate_ep_size=8,
    max_num_seqs=32,
    token_budget=512,
    max_model_len=4096,
    speculative_config='{"method": "eagle3", "model": "/d", "num_speculative_tokens": 2}',
    skip_warmup=True,
    cache_dir="/var/cache/kimi",
)


def test_every_field_has_a_non_default_case():
    names = {f.name for f in dataclasses.fields(WorkerConfig)}
    assert names == set(BASE) | set(OTHER)
    d = WorkerConfig(**BASE)
    assert all(getattr(d, k) != v for k, v in OTHER.items())


@pytest.mark.parametrize("name", [None, *OTHER])
def test_round_trip_one_field(name):
    """Defaults alone, and each field changed alone, come back equal; a default is left off the command line."""
    c = WorkerConfig(**BASE, **({name: OTHER[name]} if name else {}))
    argv = c.to_argv()
    assert WorkerConfig.from_argv(argv) == c
    assert argv[:6] == [
        "--model",
        BASE["model"],
        "--plan-addr",
        BASE["plan_addr"],
        "--result-addr",
        BASE["result_addr"],
    ]
    assert len(argv) == 6 + (0 if name is None else 1 if isinstance(OTHER[name], bool) else 2)


def test_round_trip_all_fields():
    c = WorkerConfig(**BASE, **OTHER)
    assert WorkerConfig.from_argv(c.to_argv()) == c


def test_bad_value_is_refused():
    with pytest.raises(SystemExit):
        WorkerConfig.from_argv([*WorkerConfig(**BASE).to_argv(), "--fp8-dense", "on"])
    with pytest.raises(SystemExit):
        WorkerConfig.from_argv(["--plan-addr", "tcp://a", "--result-addr", "tcp://b"])  # --model is required


def test_serve_shares_the_worker_declaration():
    """A flag both parsers have has one default and one set of choices."""
    p = argparse.ArgumentParser()
    add_serve_args(p)
    serve = {a.dest: a for a in p._actions}
    worker = {a.dest: a for a in WorkerConfig.arg_parser()._actions}
    shared = set(serve) & set(worker) - {"help", "plan_addr", "result_addr"}
    assert {"model", "device", "dtype", "block_size", "log_level", "moe_backend", "fp8_dense"} <= shared
    for name in shared:
        assert serve[name].default == worker[name].default, name
        assert serve[name].choices == worker[name].choices, name
        assert serve[name].help == worker[name].help, name


@pytest.mark.parametrize(
    "serve",
    [
        ServeArgs(model="/x"),
        ServeArgs(model="/x", fake_workers=True, num_blocks=64, log_level="warning", dtype="float32"),
        ServeArgs(model="/x", device="cuda", max_num_seqs=32, moe_backend="cuda", fp8_dense="triton"),
        ServeArgs(model="/x", device="cuda", enforce_eager=True, load_format="dummy", a2a_backend="nccl"),
        ServeArgs(model="/x", device="cuda", no_prefill_graphs=True, token_budget=1024),
        ServeArgs(model="/x", device="cuda", nproc=2, token_budget=1024),
        ServeArgs(model="/x", device="cuda", token_budget=8192),
        ServeArgs(model="/x", nproc=2, a2a_backend="gloo", a2a_static_decode=True),
        ServeArgs(model="/x", moe_backend="ref", enforce_eager=True),  # cuda-only flags: not passed on the cpu
    ],
)
def test_serve_to_worker(serve):
    """kimi serve's worker command line parses back to the WorkerConfig it was made from."""
    cmd = worker_command(serve, "tcp://a", "tcp://b")
    c = worker_config(serve, "tcp://a", "tcp://b")
    assert WorkerConfig.from_argv(cmd[cmd.index("kimi.worker.main") + 1 :]) == c
    assert (c.model, c.device, c.fake, c.num_blocks, c.log_level, c.a2a_static_decode) == (
        serve.model,
        serve.device,
        serve.fake_workers,
        serve.num_blocks,
        serve.log_level,
        serve.a2a_static_decode,
    )
    if serve.device == "cuda":
        assert c.cuda_graph_max_bs == (0 if serve.enforce_eager else serve.max_num_seqs)
        # prefill graphs: one rank, up to the token budget (at most PREFILL_GRAPH_TOKENS), unless turned off
        off = serve.enforce_eager or serve.no_prefill_graphs or serve.nproc != 1
        assert c.prefill_graph_max_tokens == (0 if off else min(serve.token_budget, PREFILL_GRAPH_TOKENS))
        assert (c.moe_backend, c.fp8_dense, c.load_format) == (serve.moe_backend, serve.fp8_dense, serve.load_format)
    else:
        assert (c.cuda_graph_max_bs, c.prefill_graph_max_tokens, c.moe_backend) == (0, 0, "auto")

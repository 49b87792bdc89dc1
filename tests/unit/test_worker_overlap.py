"""The worker's pipelined steps (ModelRunner.launch with the previous, unfinished step) give exactly the tokens,
logprobs and prompt logprobs of one step at a time (ModelRunner.execute).

CPU, the tiny K2.6 checkpoint, float32; `overlap_cpu` makes the runner take the overlapped path on the CPU (the
path is the same code as on CUDA: the previous step's sampled ids are gathered into this step's inputs on the
device, the previous step is finished after this step's forward is queued and before its sampling). The plans
are made the way async scheduling makes them: each step is planned before the previous one's tokens are known
(continuing requests carry no token ids), with chunked prefills, new requests arriving mid-stream, requests
dropped after their last token, and sampling settings that read the token history (penalties, min_tokens,
seeded draws at a position) and prompt logprobs (read back after the previous step is finished).
"""

from __future__ import annotations

import random

import pytest
import torch

from kimi import protocol
from kimi.config import CacheConfig, ModelConfig
from kimi.tiny_checkpoint import make_tiny_checkpoint
from kimi.worker.runner import ModelRunner

BS = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "k2.6", "k2.6", seed=0, tokenizer_source=None)


def _sampling(i: int, vocab: int) -> protocol.SamplingParams:
    kinds = [
        protocol.SamplingParams(temperature=0.0),
        protocol.SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=100 + i, num_logprobs=2),
        protocol.SamplingParams(
            temperature=0.7, seed=7 * i, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2
        ),
        protocol.SamplingParams(temperature=0.0, min_tokens=3, min_tokens_block_ids=[1, 2, 3], num_logprobs=0),
        protocol.SamplingParams(
            temperature=1.0, seed=i, min_p=0.05, logit_bias_ids=[5, 9], logit_bias_values=[3.0, -2.0]
        ),
        protocol.SamplingParams(temperature=0.0, prompt_logprobs=1),
    ]
    return kinds[i % len(kinds)]


def _plans(vocab: int, seed: int = 0, budget: int = 24) -> list[protocol.StepPlan]:
    """Plans made without knowing any sampled token, as the controller's async scheduling makes them."""
    rng = random.Random(seed)
    arrivals = {s: [] for s in range(60)}
    for i in range(14):
        arrivals[rng.randrange(0, 25)].append(i)
    reqs: dict[int, dict] = {}
    next_block = 1
    plans = []
    drops: list[int] = []
    for step in range(1, 61):
        for i in arrivals.get(step - 1, []):
            n = rng.randrange(3, 40)
            max_tokens = rng.randrange(1, 12)
            nb = -(-(n + max_tokens) // BS)
            reqs[i] = dict(
                prompt=[rng.randrange(1, vocab) for _ in range(n)],
                computed=0,
                known=n,
                left=max_tokens,
                blocks=list(range(next_block, next_block + nb)),
                sent=False,
                sampling=_sampling(i, vocab),
            )
            next_block += nb
        new, cont, left = [], [], budget
        for i, r in sorted(reqs.items(), key=lambda kv: kv[1]["known"] - kv[1]["computed"] != 1):
            todo = r["known"] - r["computed"]
            if todo <= 0 or left <= 0:
                continue
            n = min(todo, left)
            left -= n
            if not r["sent"]:
                new.append(
                    protocol.NewRequest(
                        i, 0, list(r["prompt"]), 0, n, list(r["blocks"]), r["sampling"], len(r["prompt"])
                    )
                )
                r["sent"] = True
            else:
                cont.append(protocol.ContinueRequest(i, n, []))
            r["computed"] += n
            if r["computed"] == r["known"]:  # this step samples its next token
                r["left"] -= 1
                if r["left"] > 0:
                    r["known"] += 1
        plans.append(protocol.StepPlan(step, new, cont, drops))
        drops = [i for i, r in reqs.items() if r["left"] == 0 and r["computed"] == r["known"]]
        for i in drops:
            del reqs[i]
    assert not reqs, "the plan generator left requests unfinished"
    return plans


def _runner(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    return ModelRunner(
        ckpt, cfg, CacheConfig(block_size=BS, num_blocks=400), device="cpu", dtype=torch.float32, progress=False
    )


def test_pipelined_steps_equal_one_at_a_time(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    plans = _plans(cfg.vocab_size)
    ref_runner = _runner(ckpt)
    ref = {p.step: ref_runner.execute(p) for p in plans}
    assert sum(len(v) for v in ref.values()) > 50

    runner = _runner(ckpt)
    runner.overlap_cpu = True
    got: dict[int, list] = {}
    order: list[int] = []

    def on_prev(h):
        order.append(h.step)
        got[h.step] = runner.finish(h)

    pending = None
    for p in plans:
        pending = runner.launch(p, pending, on_prev=on_prev)
    on_prev(pending)
    assert order == [p.step for p in plans], "results must go out in step order, each once"
    assert runner.num_overlapped >= 15, runner.num_overlapped  # of 60 steps, some empty or not after a sampling one
    for p in plans:
        assert got[p.step] == ref[p.step], f"step {p.step}"
    # prompt logprobs came back
    assert any(t.prompt_logprobs is not None for outs in got.values() for t in outs)


def test_overlap_off_on_cpu_by_default(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    plans = _plans(cfg.vocab_size, seed=1)
    runner = _runner(ckpt)
    pending = None
    for p in plans:
        pending = runner.launch(p, pending)
    runner.finish(pending)
    assert runner.num_overlapped == 0


def test_position_seed_keeps_every_int64_seed_distinct():
    from kimi.worker.runner import position_seed

    edge = [-(1 << 63), -1, 0, 1, (1 << 63) - 1, 12345, 12345 - (1 << 63)]
    for pos in (0, 1, 17, 4095):
        vals = [position_seed(s, pos) for s in edge]
        assert len(set(vals)) == len(vals)  # -1 and 2^63 - 1 (equal mod 2^63) no longer collide
        for v in vals:
            assert 0 <= v < (1 << 64)
            torch.Generator().manual_seed(v)  # within manual_seed's range
    assert position_seed(7, 3) == position_seed(7, 3) != position_seed(7, 4)


def test_position_seed_streams_differ_on_the_cpu_for_seeds_2_pow_32_apart():
    """torch's CPU generator takes only the low 32 bits of its seed: seeds that differ by a multiple of 2^32 (5,
    5 + 2^32, 5 + 2^33; -1 and 2^63 - 1; 0 and -2^63) drew the same tokens on the CPU (a newcomer's report). Their
    streams now differ at every position tried."""
    from kimi.worker.runner import position_seed

    groups = [[5, 5 + (1 << 32), 5 + (1 << 33)], [-1, (1 << 63) - 1], [0, -(1 << 63)], [7, 7 + (1 << 40)]]
    for pos in (0, 1, 4095):
        for seeds in groups:
            draws = [
                tuple(torch.rand(4, generator=torch.Generator().manual_seed(position_seed(s, pos))).tolist())
                for s in seeds
            ]
            assert len(set(draws)) == len(draws), (pos, seeds)
    # and the low 32 bits of consecutive seeds / positions are all distinct over a small sweep
    lows = {position_seed(s, p) & 0xFFFFFFFF for s in range(-64, 64) for p in range(16)}
    assert len(lows) == 128 * 16

"""Speculative steps on a rank (kimi.worker.speculative) on the tiny K2.6 checkpoint and its tiny EAGLE3 drafts (Llama
attention and MLA), CPU:
greedy outputs equal those without speculation token for token (verify steps of q_len k + 1 through the paged cache),
with the real draft's proposals and with proposals forced to the known continuation (all accepted) or to it with
a wrong token (accepted up to there, the rejected positions' KV then overwritten)."""

from __future__ import annotations

import pytest

from kimi import protocol
from kimi.config import CacheConfig, ModelConfig, SpeculativeConfig
from kimi.tiny_checkpoint import make_tiny_checkpoint, make_tiny_eagle3_draft
from kimi.worker.runner import ModelRunner

BS = 8
K = 3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    ckpt = make_tiny_checkpoint(root / "k2.6", "k2.6", seed=0, tokenizer_source=None)
    mla = make_tiny_eagle3_draft(root / "mla", "k2.6", seed=0, attention="mla")
    return ckpt, make_tiny_eagle3_draft(root / "draft", "k2.6", seed=0), mla


def _runner(ckpt: str, draft: str | None) -> ModelRunner:
    cfg = ModelConfig.from_dir(ckpt)
    spec = SpeculativeConfig("eagle3", draft, K) if draft else None
    return ModelRunner(ckpt, cfg, CacheConfig(block_size=BS, num_blocks=64), progress=False, speculative=spec)


PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [500, 7, 900, 7, 500], [3000 + i for i in range(17)]]
GREEDY = protocol.SamplingParams(temperature=0.0, num_logprobs=1)


def _generate(
    runner: ModelRunner, max_tokens: int, force=None, sp: protocol.SamplingParams = GREEDY
) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy generation of PROMPTS together, the controller's way (one step per plan, drafts verified when the
    rank holds a proposal); force(rid, n_out) -> a proposal to put in place of the draft's (None: the draft's)."""
    outs: list[list[int]] = [[] for _ in PROMPTS]
    lps: list[list[float]] = [[] for _ in PROMPTS]
    blocks = 6
    new = [
        protocol.NewRequest(rid, 0, p, 0, len(p), list(range(1 + rid * blocks, 1 + (rid + 1) * blocks)), sp)
        for rid, p in enumerate(PROMPTS)
    ]
    step = 1
    res = runner.execute(protocol.StepPlan(step, new, [], []))
    while True:
        for t in res:
            toks = [t.token_id, *(t.next_token_ids or [])]
            outs[t.rid].extend(toks)
            lps[t.rid].extend([t.logprob, *(t.next_logprobs or [])])
        live = [rid for rid in range(len(PROMPTS)) if len(outs[rid]) < max_tokens]
        if not live:
            return [o[:max_tokens] for o in outs], [lp[:max_tokens] for lp in lps]
        cont = []
        for rid in live:
            wr = runner.requests.get(rid)
            nv = 0
            if wr is not None and runner.draft is not None:
                if force is not None:
                    wr.draft_ids = force(rid, len(outs[rid]))
                nv = min(len(wr.draft_ids), max_tokens - len(outs[rid]) - 1)
            cont.append(protocol.ContinueRequest(rid, 1 + nv, [], nv))
        step += 1
        res = runner.execute(protocol.StepPlan(step, [], cont, []))


@pytest.mark.parametrize("attention", ["llama", "mla"])
def test_greedy_equal_with_and_without_speculation(dirs, attention: str) -> None:
    ckpt, llama, mla = dirs
    draft = llama if attention == "llama" else mla
    ref, ref_lp = _generate(_runner(ckpt, None), 12)
    spec_runner = _runner(ckpt, draft)
    got, got_lp = _generate(spec_runner, 12)
    assert got == ref
    for a, b in zip(got_lp, ref_lp):
        assert a == pytest.approx(b, abs=1e-4)
    assert spec_runner.num_draft_tokens > 0

    # proposals forced to the known continuation: every draft accepted, k + 1 tokens per step
    forced = _runner(ckpt, draft)
    got, _ = _generate(forced, 12, force=lambda rid, n: ref[rid][n : n + K])
    assert got == ref
    assert forced.num_accepted_tokens == forced.num_draft_tokens > 0
    steps_all = forced.num_draft_tokens

    # the continuation with its second token wrong: one accepted per step, the rejected KV overwritten later
    def wrong(rid: int, n: int) -> list[int]:
        p = list(ref[rid][n : n + K])
        if len(p) > 1:
            p[1] = (p[1] + 1) % 1000
        return p

    partial = _runner(ckpt, draft)
    got, _ = _generate(partial, 12, force=wrong)
    assert got == ref
    assert 0 < partial.num_accepted_tokens < partial.num_draft_tokens
    assert steps_all > 0


def test_seeded_sampling_with_speculation_reproduces(dirs) -> None:
    """A seeded sampled request verifies by rejection sampling with its generator reseeded per drawn position: two
    runs give the same tokens (the distribution itself: tests/unit/test_rejection_sampler.py)."""
    ckpt, draft, _ = dirs
    sp = protocol.SamplingParams(temperature=0.9, top_k=50, seed=1234, num_logprobs=0)
    a, _ = _generate(_runner(ckpt, draft), 10, sp=sp)
    b, _ = _generate(_runner(ckpt, draft), 10, sp=sp)
    assert a == b
    assert len({t for o in a for t in o}) > 5  # sampled, not one repeated token


def test_launched_ahead_every_result_is_handed_back_in_order(dirs) -> None:
    """The worker's loop launches a plan that arrives before the last step's result went out with that step as
    `prev`: a speculative step comes back already finished, and it must still be handed to on_prev (once, in step
    order), else its result is never sent and the controller waits for ever."""
    ckpt, draft, _ = dirs
    runner = _runner(ckpt, draft)
    new = [protocol.NewRequest(0, 0, PROMPTS[0], 0, len(PROMPTS[0]), list(range(1, 7)), GREEDY)]
    plans = [protocol.StepPlan(1, new, [], [])]
    plans += [protocol.StepPlan(s, [], [protocol.ContinueRequest(0, 1, [], 0)], []) for s in range(2, 5)]
    sent: list[int] = []
    pending = None
    for p in plans:
        pending = runner.launch(p, pending, on_prev=lambda h: sent.append(h.step))
        assert pending.done()
    assert sent == [1, 2, 3]
    assert len(runner.finish(pending)) == 1

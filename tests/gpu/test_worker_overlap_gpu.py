"""The worker's pipelined steps on CUDA (ModelRunner.launch with the previous step unfinished: its sampled ids
gathered into this step's inputs on the device, through the CUDA-graph decode path and the eager path) against one
step at a time (ModelRunner.execute), on the tiny-mla checkpoint (Kimi's real attention widths: FlashInfer MLA and
the INT4 MoE kernels run) with decode CUDA graphs up to 16 sequences.

Plans: tests/unit/test_worker_overlap.py's generator (made before any token is known, as async scheduling makes
them; chunked prefills, arrivals, drops, penalties, seeded draws, logprobs, prompt logprobs). The reference runs
twice: when its two runs agree bit for bit (the kernels are deterministic for these shapes), the pipelined run
must equal them exactly; otherwise it must agree with the first at least as well as the second does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
sys.path.insert(0, str(REPO / "tests" / "gpu"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from test_gpu_model import make_ckpt

    return make_ckpt(tmp_path_factory.mktemp("ckpts"), "tiny-mla")


def _runner(path):
    from kimi.config import CacheConfig, ModelConfig
    from kimi.worker.runner import ModelRunner

    cfg = ModelConfig.from_dir(path)
    return ModelRunner(
        path,
        cfg,
        CacheConfig(block_size=16, num_blocks=400),
        device="cuda",
        dtype=torch.bfloat16,
        progress=False,
        gpu_options=dict(moe_backend="humming", cuda_graph_max_bs=16),
    )


def _tokens(outs: dict) -> list:
    return [(s, t.rid, t.token_id) for s in sorted(outs) for t in outs[s]]


def test_pipelined_steps_equal_one_at_a_time_on_cuda(ckpt):
    from test_worker_overlap import BS, _plans

    from kimi.config import ModelConfig

    assert BS == 16
    plans = _plans(ModelConfig.from_dir(ckpt).vocab_size, seed=3)
    refs = []
    for _ in range(2):
        r = _runner(ckpt)
        assert r.model.graphs is not None
        refs.append({p.step: r.execute(p) for p in plans})
        replays = r.model.graphs.num_replays
        del r
        torch.cuda.empty_cache()
    assert replays > 0, "no decode step replayed a CUDA graph"
    runner = _runner(ckpt)
    got: dict[int, list] = {}

    def on_prev(h):
        got[h.step] = runner.finish(h)

    pending = None
    for p in plans:
        pending = runner.launch(p, pending, on_prev=on_prev)
    on_prev(pending)
    print(f"overlapped {runner.num_overlapped} of {len(plans)} steps; graph replays {runner.model.graphs.num_replays}")
    assert runner.num_overlapped >= 15
    assert runner.model.graphs.num_replays > 0
    if refs[0] == refs[1]:
        for p in plans:
            assert got[p.step] == refs[0][p.step], f"step {p.step}"
    else:
        a, b, g = _tokens(refs[0]), _tokens(refs[1]), _tokens(got)
        same_ref = sum(x == y for x, y in zip(a, b))
        same_got = sum(x == y for x, y in zip(a, g))
        print(f"reference runs differ: {same_ref}/{len(a)} tokens equal; pipelined {same_got}/{len(a)}")
        assert len(g) == len(a) and same_got >= same_ref - 1

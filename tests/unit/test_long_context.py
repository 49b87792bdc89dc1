"""Long context: paged decode at positions past 8192 matches a differently chunked prefill of the same tokens.

Path under test (what the server does): chunked prefill (2048-token chunks) of 8200 tokens into a shuffled,
non-contiguous block table, then 32 single-token decode steps (the absorbed MLA decode path) at positions 8200..8231.
Reference: the same 8232 tokens prefilled in 4100-token chunks into a contiguous block table (the naive MLA prefill
path, a different chunking and a different kernel), reading the logits of the last 32 positions. Tiny K2.6 model cut to
2 layers (one dense, one MoE; YaRN factor 64 over 4096 original positions, so these positions use the scaled rope),
fp32; log-probabilities must agree within 1e-3 and the argmax must be the same.
"""

from __future__ import annotations

import random

import torch

from kimi.config import ModelConfig
from kimi.model.attention import build_attention_metadata
from kimi.model.model import KimiForCausalLM
from kimi.tiny_checkpoint import generate_tiny_weights, tiny_config
from kimi.worker.kv_cache import allocate_kv_caches

BS = 64
PREFILL = 8200
DECODE = 32
N = PREFILL + DECODE


@torch.inference_mode()
def _run(model, caches, table, ids, chunks):
    """Feed `ids` in the given (start, end) chunks; returns log-probs [end - start, V] of the last chunk."""
    out = None
    for s, e in chunks:
        md = build_attention_metadata([e - s], [e], [table], BS, "cpu")
        hidden = model(ids[s:e], torch.arange(s, e), md, caches)  # [e - s, hidden]
        out = (s, e, hidden)
    s, e, hidden = out
    return torch.log_softmax(model.compute_logits(hidden), dim=-1)  # [e - s, V] f32


def test_decode_past_8k_positions_matches_chunked_prefill():
    cfg_json, gen = tiny_config("k2.6")
    cfg = ModelConfig.from_dict(cfg_json, gen).with_overrides(num_hidden_layers=2)  # 1 dense + 1 MoE layer
    assert cfg.max_position_embeddings >= 131072
    _, truth = generate_tiny_weights("k2.6", seed=0)
    model = KimiForCausalLM(cfg, dtype=torch.float32)
    model.load_weights({k: v for k, v in truth.items() if not k.startswith("model.layers.2.")})
    model.eval()
    rng = random.Random(0)
    ids = torch.tensor([rng.randrange(0, 160000) for _ in range(N)], dtype=torch.long)
    nblk = -(-N // BS)

    # under test: shuffled blocks, 2048-token prefill chunks, then one token per step
    perm = list(range(1, nblk + 1))
    rng.shuffle(perm)
    caches = allocate_kv_caches(cfg, nblk + 1, BS, torch.float32, "cpu")
    _run(model, caches, perm, ids, [(s, min(s + 2048, PREFILL)) for s in range(0, PREFILL, 2048)])
    got = torch.cat([_run(model, caches, perm, ids, [(p, p + 1)]) for p in range(PREFILL, N)])  # [DECODE, V]

    # reference: contiguous blocks, 1031-token chunks, the last DECODE positions as one prefill chunk
    caches2 = allocate_kv_caches(cfg, nblk + 1, BS, torch.float32, "cpu")
    chunks = [(0, 4100), (4100, PREFILL), (PREFILL, N)]
    want = _run(model, caches2, list(range(1, nblk + 1)), ids, chunks)  # [DECODE, V]

    assert got.shape == want.shape == (DECODE, cfg.vocab_size)
    # the teacher-forced next-token log-probs at positions 8201..8231
    nxt = ids[PREFILL + 1 :]
    lp_got = got[:-1].gather(1, nxt[:, None]).squeeze(1)
    lp_want = want[:-1].gather(1, nxt[:, None]).squeeze(1)
    assert torch.allclose(lp_got, lp_want, atol=1e-3), (lp_got - lp_want).abs().max()
    assert (got - want).abs().max() < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))

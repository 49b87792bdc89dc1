"""Acceptance test: kimi's KimiForCausalLM against transformers' DeepseekV3ForCausalLM on the tiny checkpoints.

For each layout of kimi/tiny_checkpoint.py (K2.6 nested INT4, K2-Thinking flat INT4, K2-Instruct FP8):
kimi loads through kimi.checkpoint.load_checkpoint (dequantised, fp32); HF is filled from the safetensors
files read and dequantised here, independently of kimi (INT4 through compressed-tensors' `unpack_from_int32`
times the group scale, FP8 by a direct block-scale multiply). Teacher-forced log-probabilities must agree
within 1e-3 through (a) whole-prompt prefill, (b) the paged decode path token by token, (c) chunked
prefill, (d) mixed batches; a 32-token greedy continuation must be identical.
"""

from __future__ import annotations

import json
import os
import random
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
ct_helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")

from safetensors import safe_open  # noqa: E402
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from kimi.checkpoint import load_checkpoint  # noqa: E402
from kimi.config import ModelConfig  # noqa: E402
from kimi.model.attention import build_attention_metadata  # noqa: E402
from kimi.model.model import KimiForCausalLM  # noqa: E402
from kimi.model.rope import rope_inv_freq  # noqa: E402
from kimi.tiny_checkpoint import LAYOUTS, make_tiny_checkpoint  # noqa: E402
from kimi.worker.kv_cache import allocate_kv_caches  # noqa: E402

TOL = 1e-3
BLOCK_SIZE = 4
MAX_POS = 256
PROMPT_LENS = (33, 40, 47)
GREEDY_TOKENS = 32
REAL_TEXT = (
    "Kimi is an inference engine test. The quick brown fox jumps over the lazy dog, and then the model "
    "has to predict every one of these tokens; 1+1=2, naïve café, 你好，世界！"
)


# ---- independent HF reference ---------------------------------------------------------------------------


def read_dequantised_independently(ckpt: str) -> dict[str, torch.Tensor]:
    """Every text-model tensor of the checkpoint as float32, canonical names, without kimi's loader/quant code."""
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    prefix = "language_model." if "text_config" in cfg else ""
    qc = text.get("quantization_config") or cfg.get("quantization_config") or {}
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    raw: dict[str, torch.Tensor] = {}
    for fn in files:
        with safe_open(os.path.join(ckpt, fn), "pt") as f:
            for k in f.keys():  # noqa: SIM118  # a safetensors handle: keys() is its API, `in` is not
                if k.startswith(prefix) and not k.startswith(("vision_tower.", "mm_projector.")):
                    raw[k[len(prefix) :]] = f.get_tensor(k)
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith((".weight_scale", ".weight_shape", ".weight_scale_inv")):
            continue
        if name.endswith(".weight_packed"):  # compressed-tensors pack-quantized INT4
            base = name[: -len(".weight_packed")]
            group = next(iter(qc["config_groups"].values()))["weights"]["group_size"]
            shape = torch.Size(raw[base + ".weight_shape"].tolist())
            q = ct_helpers.unpack_from_int32(t, 4, shape, packed_dim=1)  # int8 [N, K] in [-8, 7]
            scale = raw[base + ".weight_scale"].float().repeat_interleave(group, dim=1)[:, : shape[1]]
            out[base + ".weight"] = q.float() * scale
        elif name.endswith(".weight") and name[: -len(".weight")] + ".weight_scale_inv" in raw:  # FP8 blocks
            assert t.dtype == torch.float8_e4m3fn
            scale_inv = raw[name[: -len(".weight")] + ".weight_scale_inv"].float()  # [ceil(N/b0), ceil(K/b1)]
            b0, b1 = qc["weight_block_size"]
            n, k = t.shape
            s = scale_inv.repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)[:n, :k]  # [N, K]
            out[name] = t.float() * s
        else:
            out[name] = t.float()
    return out


def build_hf(ckpt: str, weights: dict[str, torch.Tensor]) -> DeepseekV3ForCausalLM:
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    t = cfg.get("text_config", cfg)
    rs = t["rope_scaling"]
    hf_cfg = DeepseekV3Config(
        vocab_size=t["vocab_size"],
        hidden_size=t["hidden_size"],
        intermediate_size=t["intermediate_size"],
        moe_intermediate_size=t["moe_intermediate_size"],
        num_hidden_layers=t["num_hidden_layers"],
        num_attention_heads=t["num_attention_heads"],
        num_key_value_heads=t["num_attention_heads"],
        n_shared_experts=t["n_shared_experts"],
        n_routed_experts=t["n_routed_experts"],
        routed_scaling_factor=t["routed_scaling_factor"],
        kv_lora_rank=t["kv_lora_rank"],
        q_lora_rank=t["q_lora_rank"],
        qk_rope_head_dim=t["qk_rope_head_dim"],
        v_head_dim=t["v_head_dim"],
        qk_nope_head_dim=t["qk_nope_head_dim"],
        n_group=t["n_group"],
        topk_group=t["topk_group"],
        num_experts_per_tok=t["num_experts_per_tok"],
        first_k_dense_replace=t["first_k_dense_replace"],
        norm_topk_prob=t["norm_topk_prob"],
        max_position_embeddings=t["max_position_embeddings"],
        rms_norm_eps=t["rms_norm_eps"],
        tie_word_embeddings=False,
        attention_bias=False,
        rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": t["rope_theta"],
            "factor": rs["factor"],
            "original_max_position_embeddings": rs["original_max_position_embeddings"],
            "beta_fast": rs["beta_fast"],
            "beta_slow": rs["beta_slow"],
            "mscale": rs["mscale"],
            "mscale_all_dim": rs["mscale_all_dim"],
        },
        attn_implementation="eager",
    )
    model = DeepseekV3ForCausalLM(hf_cfg).float().eval()
    sd: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, int, str], torch.Tensor] = {}
    for name, w in weights.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m:
            experts[(int(m[1]), int(m[2]), m[3])] = w
        else:
            sd[name] = w
    E = t["n_routed_experts"]
    for layer in range(t["first_k_dense_replace"], t["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        sd[p + "gate_up_proj"] = torch.stack(
            [torch.cat([experts[(layer, e, "gate")], experts[(layer, e, "up")]]) for e in range(E)]
        )  # [E, 2I, H]
        sd[p + "down_proj"] = torch.stack([experts[(layer, e, "down")] for e in range(E)])  # [E, H, I]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    for layer in model.model.layers:
        # HF builds these with its default 1e-6; the reference fixes them at 1e-6 whatever rms_norm_eps is
        assert layer.self_attn.q_a_layernorm.variance_epsilon == 1e-6
        assert layer.self_attn.kv_a_layernorm.variance_epsilon == 1e-6
        assert layer.input_layernorm.variance_epsilon == t["rms_norm_eps"]
        if hasattr(layer.mlp, "gate"):
            assert layer.mlp.gate.weight.dtype == torch.float32
    return model


@torch.inference_mode()
def hf_logprobs(model: DeepseekV3ForCausalLM, prompt: torch.Tensor) -> torch.Tensor:
    """[n - 1] log p(prompt[i + 1] | prompt[: i + 1])."""
    logits = model(input_ids=prompt[None], use_cache=False).logits[0].float()  # [n, V]
    return torch.log_softmax(logits[:-1], -1).gather(1, prompt[1:, None])[:, 0]


@torch.inference_mode()
def hf_greedy(model: DeepseekV3ForCausalLM, prompt: torch.Tensor, n: int) -> list[int]:
    ids = prompt.clone()
    out = []
    for _ in range(n):
        logits = model(input_ids=ids[None], use_cache=False, logits_to_keep=1).logits[0, -1]
        nxt = int(logits.argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([nxt])])
    return out


# ---- kimi runner ----------------------------------------------------------------------------------------


class KimiRunner:
    """Drives KimiForCausalLM like the scheduler would: paged cache, non-contiguous block ids per sequence."""

    def __init__(self, model: KimiForCausalLM, max_lens: list[int], seed: int = 0):
        self.model = model
        need = [-(-n // BLOCK_SIZE) for n in max_lens]
        num_blocks = 1 + sum(need) + 5
        ids = list(range(1, num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(ids)
        self.tables = []
        for n in need:
            self.tables.append(ids[:n])
            ids = ids[n:]
        assert any(t != sorted(t) or t[-1] - t[0] != len(t) - 1 for t in self.tables)  # really scattered
        self.caches = allocate_kv_caches(model.cfg, num_blocks, BLOCK_SIZE, torch.float32, "cpu")

    @torch.inference_mode()
    def step(self, chunks: list[tuple[int, torch.Tensor, int]]) -> list[torch.Tensor]:
        """chunks: (seq, token ids [q], start position); one forward; returns each chunk's logits [q, V]."""
        ids = torch.cat([c[1] for c in chunks])
        pos = torch.cat([torch.arange(s, s + len(t)) for _, t, s in chunks])
        md = build_attention_metadata(
            [len(t) for _, t, _ in chunks],
            [s + len(t) for _, t, s in chunks],
            [self.tables[b] for b, _, _ in chunks],
            BLOCK_SIZE,
        )
        logits = self.model.compute_logits(self.model(ids, pos, md, self.caches))  # [T, V] f32
        assert logits.dtype == torch.float32
        qsl = md.query_start_loc.tolist()
        return [logits[qsl[j] : qsl[j + 1]] for j in range(len(chunks))]


def kimi_logprobs(model: KimiForCausalLM, prompts: list[torch.Tensor], plan) -> tuple[list[torch.Tensor], int]:
    """Teacher-forced log-probs of every prompt under a schedule `plan(step, seq, done, n) -> query_len`.

    Returns ([n - 1] log-probs per prompt, number of forwards that mixed decode and prefill rows).
    """
    runner = KimiRunner(model, [len(p) for p in prompts])
    done = [0] * len(prompts)
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    step = mixed = 0
    while any(d < len(p) for d, p in zip(done, prompts)):
        order = range(len(prompts)) if step % 2 == 0 else reversed(range(len(prompts)))
        chunks = []
        for b in order:
            q = min(plan(step, b, done[b], len(prompts[b])), len(prompts[b]) - done[b])
            if q > 0:
                chunks.append((b, prompts[b][done[b] : done[b] + q], done[b]))
        qlens = [len(c[1]) for c in chunks]
        mixed += 1 in qlens and any(q > 1 for q in qlens)
        for (b, t, _s), lg in zip(chunks, runner.step(chunks)):
            rows[b].append(lg)
            done[b] += len(t)
        step += 1
    out = []
    for p, r in zip(prompts, rows):
        logits = torch.cat(r)  # [n, V]
        out.append(torch.log_softmax(logits[:-1], -1).gather(1, p[1:, None])[:, 0])
    return out, mixed


# ---- fixtures -------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(layout: str) -> str:
        if layout not in cache:
            cache[layout] = make_tiny_checkpoint(tmp_path_factory.mktemp(layout.replace(".", "_")), layout=layout)
        return cache[layout]

    return get


@pytest.fixture(scope="module", params=LAYOUTS)
def setup(request, tiny_ckpts):
    layout = request.param
    ckpt = tiny_ckpts(layout)
    cfg = ModelConfig.from_dir(ckpt)
    kimi = KimiForCausalLM(cfg, max_positions=MAX_POS)
    kimi.load_weights(load_checkpoint(ckpt, cfg, dequantize=True, dtype=torch.float32, progress=False))
    kimi.eval()
    hf = build_hf(ckpt, read_dequantised_independently(ckpt))
    # the two YaRN implementations agree (HF keeps evens/odds de-interleaved but the same frequencies)
    torch.testing.assert_close(
        hf.model.rotary_emb.inv_freq.float(), rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    )
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(cfg.softmax_scale, rel=1e-12)

    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in PROMPT_LENS]
    try:
        from kimi.tokenizer import KimiTokenizer

        text_ids = KimiTokenizer.from_dir(ckpt).encode(REAL_TEXT)
        assert len(text_ids) >= 16 and max(text_ids) < cfg.vocab_size
        prompts.append(torch.tensor(text_ids, dtype=torch.int64))
    except ImportError:
        pass
    ref = [hf_logprobs(hf, p) for p in prompts]
    stats: dict[str, float] = {}
    yield dict(layout=layout, kimi=kimi, hf=hf, prompts=prompts, ref=ref, stats=stats)
    print(
        f"\n[{layout}] max |kimi - HF| teacher-forced logprob: " + ", ".join(f"{k} {v:.2e}" for k, v in stats.items())
    )


def compare(setup, got: list[torch.Tensor], mode: str, capsys) -> None:
    diff = max(float((a - b).abs().max()) for a, b in zip(got, setup["ref"]))
    setup["stats"][mode] = diff
    with capsys.disabled():
        print(
            f"\n[{setup['layout']}] {mode}: max |kimi - HF logprob| = {diff:.3e} over "
            f"{sum(len(r) for r in setup['ref'])} tokens"
        )
    assert diff < TOL, f"{setup['layout']} {mode}: {diff}"


# ---- tests ----------------------------------------------------------------------------------------------


def test_prefill(setup, capsys):
    got = [kimi_logprobs(setup["kimi"], [p], lambda s, b, d, n: n)[0][0] for p in setup["prompts"]]
    compare(setup, got, "prefill", capsys)
    # sanity: the reference is informative (a test that compares two constant outputs cannot fail)
    assert float(torch.cat(setup["ref"]).std()) > 0.1


def test_decode_path(setup, capsys):
    # first token as a 1-token prefill, then every next token as a decode row, all sequences batched
    got, _ = kimi_logprobs(setup["kimi"], setup["prompts"], lambda s, b, d, n: 1)
    compare(setup, got, "decode", capsys)


def test_chunked_prefill(setup, capsys):
    got, _ = kimi_logprobs(setup["kimi"], setup["prompts"], lambda s, b, d, n: 7)
    compare(setup, got, "chunked7", capsys)


def test_mixed_batches(setup, capsys):
    # every prompt whole in one forward (different query lengths)
    got, _ = kimi_logprobs(setup["kimi"], setup["prompts"], lambda s, b, d, n: n if s == 0 else 0)
    compare(setup, got, "one-forward", capsys)
    # decode rows and prefill chunks of other sequences in the same forwards
    pattern = [1, 6, 1, 1, 11, 3, 1, 9]
    got, mixed = kimi_logprobs(setup["kimi"], setup["prompts"], lambda s, b, d, n: pattern[(s + 3 * b) % 8])
    assert mixed >= 3
    compare(setup, got, "mixed", capsys)


def test_greedy_continuation(setup, capsys):
    kimi, prompt = setup["kimi"], setup["prompts"][0]
    runner = KimiRunner(kimi, [len(prompt) + GREEDY_TOKENS])
    logits = runner.step([(0, prompt, 0)])[0]
    toks = [int(logits[-1].argmax())]
    for i in range(GREEDY_TOKENS - 1):
        logits = runner.step([(0, torch.tensor([toks[-1]]), len(prompt) + i)])[0]  # decode path
        toks.append(int(logits[-1].argmax()))
    want = hf_greedy(setup["hf"], prompt, GREEDY_TOKENS)
    with capsys.disabled():
        print(f"\n[{setup['layout']}] greedy {GREEDY_TOKENS} tokens identical: {toks == want}")
    assert toks == want
    assert len(set(toks)) > 1

"""CPU tests of kimi.kernels.triton.linear_fp8 (FP8 block weights kept FP8): the reference and dispatch off the GPU, the
layer merge (Fp8Linear.cat), which dense weights load_gpu_model keeps FP8 (fp8_dense_names) and how the merged
layers come out of the model's preparation, the table file, and the Triton kernel itself under TRITON_INTERPRET=1
in a subprocess (fp16: the interpreter's bf16 arithmetic is not faithful)."""

import json
import textwrap

import pytest
import torch
import torch.nn.functional as F

from kimi.config import ModelConfig
from kimi.kernels.triton import linear_fp8 as lf
from kimi.model.quant import dequant_fp8_block, quant_fp8_block
from kimi.tiny_checkpoint import TINY_DIMS, tiny_config
from tests.unit.triton_interp import run_interpreted


def _fp8(n, k, seed=0, block=(128, 128)):
    g = torch.Generator().manual_seed(seed)
    return quant_fp8_block(torch.randn(n, k, generator=g) / k**0.5, block)


def test_reference_is_dequantised_linear_by_hand():
    q, s = _fp8(200, 300)  # ragged last tiles in both dims
    x = torch.randn(5, 300, dtype=torch.float64).float()
    w = q.float().clone()
    for i in range(200):  # the block layout written out: W[i, j] = float(q[i, j]) * s[i // 128, j // 128]
        for jb in range(3):
            w[i, jb * 128 : (jb + 1) * 128] *= s[i // 128, jb]
    torch.testing.assert_close(lf.fp8_linear_ref(x, q, s), x @ w.T, rtol=1e-5, atol=1e-5)
    # the CPU dispatch is the reference, leading dims kept
    y = lf.fp8_linear(x.view(5, 1, 300), q, s)
    assert y.shape == (5, 1, 200)
    torch.testing.assert_close(y.view(5, 200), x @ w.T, rtol=1e-5, atol=1e-5)
    assert lf.fp8_linear(torch.zeros(0, 300), q, s).shape == (0, 200)


def test_dequant_by_row_chunks_matches_the_reference():
    q, s = _fp8(1000, 300, 5)  # ragged last row tile and K tile
    x = torch.randn(4, 3, 300)
    ref = lf.fp8_linear_ref(x, q, s)
    for chunk in (1, 128 * 300 * 8, 700 * 300 * 8, None):  # one tile per chunk, 128 rows, 640 rows, one chunk
        torch.testing.assert_close(lf.fp8_linear_dequant(x, q, s, chunk_bytes=chunk), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="scale_inv"):
        lf.fp8_linear_dequant(x, q, s[:2], chunk_bytes=1)


def test_bad_arguments():
    q, s = _fp8(256, 256)
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="scale_inv"):
        lf.fp8_linear(x, q, s[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        lf.fp8_linear(x, q.float(), s)
    with pytest.raises(ValueError, match="columns"):
        lf.fp8_linear(torch.randn(2, 255), q, s)
    with pytest.raises(ValueError):
        lf.Fp8Linear(q, s[:, :1])


def test_cat_is_concatenated_outputs():
    a, b = lf.Fp8Linear(*_fp8(256, 300, 1)), lf.Fp8Linear(*_fp8(80, 300, 2))
    m = lf.Fp8Linear.cat([a, b])
    assert m.shape == (336, 300) and m.weight_scale_inv.shape == (3, 3) and m.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(3, 300)
    torch.testing.assert_close(m(x), torch.cat([a(x), b(x)], -1), rtol=0, atol=0)
    torch.testing.assert_close(
        m.dequantized(torch.float32), torch.cat([a.dequantized(torch.float32), b.dequantized(torch.float32)])
    )
    with pytest.raises(ValueError, match="multiple"):
        lf.Fp8Linear.cat([b, a])  # a ragged part that is not last would straddle a scale row
    p = lf.Fp8Linear.cat([a, b], pad_rows_to=128)  # zero rows to whole tiles, no new scale rows
    assert p.shape == (384, 300) and p.weight_scale_inv.shape == (3, 3)
    torch.testing.assert_close(p(x), torch.cat([m(x), torch.zeros(3, 48)], -1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="divide"):
        lf.Fp8Linear.cat([a, b], pad_rows_to=96)
    assert not m.to_humming()  # CPU tensors: humming cannot take them; the layer stays as it was
    assert m.hl is None and m.weight is not None
    with pytest.raises(ValueError):
        lf.Fp8Linear.cat([a, lf.Fp8Linear(*_fp8(128, 256))])


def test_split_k_choice():
    c = lf.Fp8Config()  # automatic: about two programs per SM, at most n_kb / k_unroll, none when slabs fill the GPU
    assert lf._splits(c, n_tiles=34, n_kb=56, num_sms=132) == 8
    assert lf._splits(c, n_tiles=576, n_kb=56, num_sms=132) == 1
    assert lf._splits(c, n_tiles=2, n_kb=3, num_sms=132) == 1
    assert lf._splits(lf.Fp8Config(split_k=3), n_tiles=34, n_kb=56, num_sms=132) == 3
    assert lf._splits(lf.Fp8Config(split_k=99, k_unroll=1), n_tiles=1, n_kb=5, num_sms=132) == 5


def test_table_file(tmp_path):
    assert lf.load_table(tmp_path / "missing.json") == {"gpu": None, "entries": {}}
    p = tmp_path / "t.json"
    p.write_text(
        json.dumps(
            {
                "gpu": "NVIDIA H200",
                "date": "2026-01-01",
                "tuner": "test",
                "entries": [
                    {
                        "m": 32,
                        "n": 2112,
                        "k": 7168,
                        "config": {"block_n": 16, "num_warps": 4, "num_stages": 8, "k_unroll": 4, "split_k": 2},
                    }
                ],
            }
        )
    )
    assert lf.load_table(p) == {"gpu": "NVIDIA H200", "entries": {(32, 2112, 7168): lf.Fp8Config(16, 4, 8, 4, 2)}}
    p.write_text(json.dumps({"gpu": "x", "date": "", "tuner": "t", "entries": [{"n": 2112, "k": 1, "config": {}}]}))
    with pytest.raises(ValueError):
        lf.load_table(p)  # no M bucket
    p.write_text(
        json.dumps(
            {"gpu": "x", "date": "", "tuner": "t", "entries": [{"m": 8, "n": 1, "k": 2, "config": {"block_m": 3}}]}
        )
    )
    with pytest.raises(ValueError):
        lf.load_table(p)
    shipped = lf.load_table()  # the file in the repository parses
    assert all(isinstance(c, lf.Fp8Config) for c in shipped["entries"].values())


def _tiny_cfg(**over) -> ModelConfig:
    saved = dict(TINY_DIMS)
    try:
        TINY_DIMS.update(over)
        cfg_json, gen = tiny_config("k2-instruct")
    finally:
        TINY_DIMS.clear()
        TINY_DIMS.update(saved)
    return ModelConfig.from_dict(cfg_json, gen)


@pytest.mark.parametrize("q_lora,moe_inter", [(96, 64), (128, 128)])
def test_fp8_dense_names_and_merge(q_lora, moe_inter):
    """Which dense weights stay FP8 (only merges whose non-last part is whole scale tiles), and the prepared model's
    merged layers compute what the separate dequantised weights compute."""
    from kimi.backends.linear import fp8_dense_names, install_fp8
    from kimi.model.weights import _finish, build_gpu_model

    cfg = _tiny_cfg(q_lora_rank=q_lora, moe_intermediate_size=moe_inter)
    model = build_gpu_model(cfg, dtype=torch.float32, device="cpu")
    targets = model._weight_targets()
    names = fp8_dense_names(model, (128, 128), lambda n: n in targets)
    L = cfg.num_hidden_layers
    for i in range(L):
        a = f"model.layers.{i}.self_attn."
        assert {a + "q_b_proj.weight", a + "o_proj.weight"} <= names
        assert (a + "q_a_proj.weight" in names) == (q_lora % 128 == 0) == (a + "kv_a_proj_with_mqa.weight" in names)
        assert a + "kv_b_proj.weight" not in names
    shared_gate = "model.layers.1.mlp.shared_experts.gate_proj.weight"
    assert (shared_gate in names) == (moe_inter % 128 == 0)  # 1 shared expert of I = moe_intermediate_size
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.down_proj.weight" in names
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in names
    assert not any(
        (".experts." in n and "shared" not in n) or "lm_head" in n or "embed" in n or "mlp.gate.weight" in n
        for n in names
    )
    assert fp8_dense_names(model, (128, 128), lambda n: False) == set()
    from kimi.backends.linear import check_fp8_dense
    from kimi.model.weights import load_gpu_model

    for ok in ("off", "triton", "humming"):
        check_fp8_dense(ok)
    with pytest.raises(ValueError, match="fp8_dense"):
        load_gpu_model("", cfg, device="cpu", load_format="dummy", fp8_dense="on")

    dense = {}
    for j, n in enumerate(sorted(names)):
        q, s = _fp8(*targets[n].shape, seed=j)
        dense[n] = dequant_fp8_block(q, s)
        install_fp8(model, n, q, s, (128, 128))
    with pytest.raises(ValueError, match="want"):
        install_fp8(model, "model.layers.0.self_attn.o_proj.weight", *_fp8(8, 8), (128, 128))
    for layer in model.layers:  # what _finish needs of the rest
        for p in layer.self_attn.parameters(recurse=False):
            p.data.normal_()
    _finish(model)
    x = torch.randn(3, cfg.hidden_size)
    at0 = model.layers[0].self_attn
    if q_lora % 128 == 0:
        assert isinstance(at0.w_qkv_a, lf.Fp8Linear) and at0.q_a_proj is None and at0.kv_a_proj_with_mqa is None
        want = torch.cat(
            [
                F.linear(x, dense["model.layers.0.self_attn.q_a_proj.weight"]),
                F.linear(x, dense["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]),
            ],
            -1,
        )
        got = at0.w_qkv_a(x)  # zero columns pad the merge to whole 128-row tiles
        assert got.shape[-1] == -(-want.shape[-1] // 128) * 128
        torch.testing.assert_close(got[:, : want.shape[-1]], want, rtol=1e-5, atol=1e-5)
        assert not got[:, want.shape[-1] :].any()
    else:
        assert not isinstance(getattr(at0, "w_qkv_a", None), lf.Fp8Linear)
    assert isinstance(at0.o_proj, lf.Fp8Linear) and isinstance(at0.q_b_proj, lf.Fp8Linear)
    mlp0 = model.layers[0].mlp
    assert isinstance(mlp0.w13, lf.Fp8Linear) and mlp0.gate_proj is None
    want = torch.cat(
        [
            F.linear(x, dense["model.layers.0.mlp.gate_proj.weight"]),
            F.linear(x, dense["model.layers.0.mlp.up_proj.weight"]),
        ],
        -1,
    )
    torch.testing.assert_close(mlp0.w13(x), want, rtol=1e-5, atol=1e-5)
    sh = model.layers[1].mlp.shared_experts
    assert isinstance(sh.down_proj, lf.Fp8Linear)
    assert isinstance(getattr(sh, "w13", None), lf.Fp8Linear) == (moe_inter % 128 == 0)
    # the FP8 bytes are what a parameter count sees (the benchmark's floor counts parameters)
    counted = {n for n, _ in model.named_parameters()}
    assert "layers.0.self_attn.o_proj.weight" in counted and "layers.0.self_attn.o_proj.weight_scale_inv" in counted
    assert "layers.0.self_attn.o_proj" not in counted


_INTERP_SCRIPT = textwrap.dedent("""
    import torch
    from kimi.kernels.triton.linear_fp8 import Fp8Config, fp8_linear_small_m, fp8_linear_ref
    from kimi.model.quant import quant_fp8_block
    torch.manual_seed(0)
    cases = [(1, 64, 128, (128, 128), Fp8Config(16, 4, 2, 1, 1)), (3, 200, 300, (128, 128), Fp8Config(16, 4, 3, 2, 0)),
             (16, 256, 640, (128, 128), Fp8Config(64, 4, 3, 2, 2)),
             (33, 130, 128, (128, 128), Fp8Config(32, 2, 2, 1, 1)),
             (64, 96, 500, (64, 64), Fp8Config(32, 4, 2, 3, 3)), (8, 300, 1000, (128, 128), Fp8Config(16, 4, 2, 4, 2))]
    for M, N, K, block, cfg in cases:
        q, s = quant_fp8_block(torch.randn(N, K) / K ** 0.5, block)
        x = torch.randn(M, K).half()
        out = torch.full((M, N), float('nan'), dtype=torch.float16)
        y = fp8_linear_small_m(x, q, s, block, out=out, config=cfg)
        assert y is out
        y2 = fp8_linear_small_m(x, q, s, block, config=cfg)  # split-K counters were reset: same result again
        assert torch.equal(y, y2), (M, N, K, cfg)
        ref = fp8_linear_ref(x.float(), q, s, block)
        err = (y.float() - ref).abs().max().item()
        tol = 2e-3 * ref.abs().max().item()
        assert err <= tol, (M, N, K, block, err, tol)
        print(M, N, K, "ok", err)
""")


def test_kernel_interpreted():
    r = run_interpreted(_INTERP_SCRIPT, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok") == 6


def test_fp8_dense_without_fp8_weights_warns(caplog):
    """fp8_dense asked for where nothing can stay FP8 (a bf16 / INT4 checkpoint, or not CUDA): said, not silent."""
    from kimi.model.weights import _finish, build_gpu_model

    model = build_gpu_model(_tiny_cfg(), dtype=torch.float32, device="cpu")
    with caplog.at_level("WARNING", logger="kimi"):
        _finish(model, "triton")
    assert "no dense weight was kept FP8" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kimi"):
        _finish(build_gpu_model(_tiny_cfg(), dtype=torch.float32, device="cpu"), "off")
    assert "kept FP8" not in caplog.text

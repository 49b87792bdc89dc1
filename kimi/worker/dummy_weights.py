"""`--load-format dummy`: random weights of the real shapes, generated directly on the GPU (no checkpoint).

Used for benchmarks of the real model (e.g. the K2.6 preset, kimi/presets/kimi-k2.6.json) on one GPU:
- norms: 1 + N(0, 0.02); e_score_correction_bias: N(0, 0.01) float32; other floating weights
  N(0, 1/in_features) in the model dtype (so activations stay O(1) over 61 layers);
- INT4 routed experts (humming / triton backends): random int32 words (uniform bytes, i.e. uniform nibbles)
  and bf16 scales 1 / (4.6 * sqrt(in_features)) * U(0.5, 1.5), stacked per layer over the local experts,
  exactly as the packed checkpoint tensors; the ref backend gets bf16 w13 / w2 instead;
- FP8 routed experts (configs with FP8 quantisation, K2-Instruct; every backend): float8_e4m3fn
  N(0, 1) weights (clamped to +-448) and float32 tile scales (1 / sqrt(in_features)) * U(0.5, 1.5) per 128 x 128 tile,
  as the checkpoint tensors; humming keeps them FP8, the others dequantise them (kimi.backends.experts.make_experts);
  with fp8_dense "triton" / "humming", the dense weights a checkpoint load keeps FP8 (kimi.worker.gpu_model.
  fp8_dense_names, on CUDA) are the random bf16 ones above quantised to FP8 128 x 128 tiles (quant_fp8_block).
Deterministic for a given seed on a given device.
"""

from __future__ import annotations

import torch

from kimi.config import ModelConfig
from kimi.ops.moe import MoELayer


def random_packed_experts(E: int, N: int, K: int, gen: torch.Generator, device, scale_dtype=torch.bfloat16):
    """(weight_packed int32 [E, N, K/8] with uniform random nibbles, weight_scale [E, N, K/32] scale_dtype)."""
    packed = torch.empty((E, N, K // 8), dtype=torch.int32, device=device)
    packed.view(torch.uint8).random_(0, 256, generator=gen)
    scale = (torch.rand((E, N, K // 32), generator=gen, device=device) + 0.5) / (4.6 * K**0.5)
    return packed, scale.to(scale_dtype)


def random_fp8_experts(E: int, N: int, K: int, gen: torch.Generator, device, block: tuple[int, int] = (128, 128)):
    """(weight float8_e4m3fn [E, N, K], weight_scale_inv float32 [E, ceil(N / bn), ceil(K / bk)]): N(0, 1) values
    clamped to the e4m3 range, tile scales (1 / sqrt(K)) * U(0.5, 1.5). Generated one expert at a time."""
    bn, bk = block
    w = torch.empty((E, N, K), dtype=torch.float8_e4m3fn, device=device)
    for e in range(E):
        w[e] = torch.randn((N, K), generator=gen, device=device).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    s = (torch.rand((E, -(-N // bn), -(-K // bk)), generator=gen, device=device) + 0.5) * K**-0.5
    return w, s


@torch.no_grad()
def fill_dummy(
    model, cfg: ModelConfig, *, moe_backend: str, dtype: torch.dtype, seed: int = 0, fp8_dense: str = "off"
) -> None:
    """Fill every parameter of a build_gpu_model() model and set each MoE layer's experts_impl (through
    kimi.worker.gpu_model.make_experts_or_ref: shapes a kernel rejects fall back to the dequantised reference, with a
    warning, as when loading a checkpoint)."""
    from kimi.backends.experts import make_experts_or_ref

    dev = model.embed_tokens.device
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    for name, p in model.named_parameters():
        if p.is_meta:
            continue
        if name.endswith("e_score_correction_bias"):
            p.copy_(torch.randn(p.shape, generator=gen, device=dev) * 0.01)
        elif p.dim() == 1:
            p.copy_(1 + 0.02 * torch.randn(p.shape, generator=gen, device=dev))
        elif name.endswith("embed_tokens"):
            p.copy_(torch.randn(p.shape, generator=gen, device=dev, dtype=torch.float32).to(p.dtype))
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    fp8_block = cfg.quant.block if cfg.quant is not None and cfg.quant.method == "fp8" else None
    if (
        fp8_block is not None and fp8_dense != "off" and dev.type == "cuda"
    ):  # the dense weights a checkpoint load keeps FP8
        from kimi.backends.linear import fp8_dense_names, install_fp8
        from kimi.ops.quant import quant_fp8_block

        targets = model._weight_targets()
        names = fp8_dense_names(model, fp8_block, lambda n: n in targets)
        for n in sorted(names):
            q, s = quant_fp8_block(targets.pop(n).detach(), fp8_block)  # pop: the bf16 tensor is freed
            install_fp8(model, n, q, s, fp8_block)
            del q, s
    inter, D = cfg.moe_intermediate_size, cfg.hidden_size
    for layer in model.layers:
        mlp = layer.mlp
        if not isinstance(mlp, MoELayer):
            continue
        E = mlp.num_local_experts
        if (
            fp8_block is not None
        ):  # humming keeps them FP8; the other backends dequantise them (make_experts), as from a checkpoint
            w13, s13 = random_fp8_experts(E, 2 * inter, D, gen, dev, fp8_block)
            w2, s2 = random_fp8_experts(E, D, inter, gen, dev, fp8_block)
            parts = {"w13_fp8": w13, "w13_scale_inv": s13, "w2_fp8": w2, "w2_scale_inv": s2}
        elif moe_backend == "ref":
            parts = {
                "w13": torch.randn((E, 2 * inter, D), generator=gen, device=dev, dtype=dtype) * D**-0.5,
                "w2": torch.randn((E, D, inter), generator=gen, device=dev, dtype=dtype) * inter**-0.5,
            }
        else:
            p13, s13 = random_packed_experts(E, 2 * inter, D, gen, dev)
            p2, s2 = random_packed_experts(E, D, inter, gen, dev)
            parts = {"w13_packed": p13, "w13_scale": s13, "w2_packed": p2, "w2_scale": s2}
        block = fp8_block if fp8_block is not None else (128, 128)
        mlp.experts_impl = make_experts_or_ref(
            moe_backend, parts, mlp.expert_offset, cfg.n_routed_experts, dtype, fp8_block=block
        )
        del parts

"""The one module that installs a model's weights. `load_reference_model`: the CPU reference model (float32, the
checkpoint dequantised, KimiForCausalLM.load_weights). `load_gpu_model` builds a fused KimiForCausalLM
(kimi.model.model, `fused=True`: its GPU forward is kimi.model.gpu_forward) on the `meta` device, fills it from a
checkpoint (load_format "auto") or with random weights (load_format "dummy"), sets each MoE layer's experts backend
(kimi.backends.experts) and the FP8 dense layers (kimi.backends.linear), then merges what the fused kernels read
(`_finish`).

`--load-format dummy` (`fill_dummy`): random weights of the real shapes, generated directly on the GPU (no
checkpoint). Used for benchmarks of the real model (e.g. the K2.6 preset, kimi/presets/kimi-k2.6.json) on one GPU:
- norms: 1 + N(0, 0.02); e_score_correction_bias: N(0, 0.01) float32; other floating weights
  N(0, 1/in_features) in the model dtype (so activations stay O(1) over 61 layers);
- INT4 routed experts (humming / triton backends): random int32 words (uniform bytes, i.e. uniform nibbles)
  and bf16 scales 1 / (4.6 * sqrt(in_features)) * U(0.5, 1.5), stacked per layer over the local experts,
  exactly as the packed checkpoint tensors; the ref backend gets bf16 w13 / w2 instead;
- FP8 routed experts (configs with FP8 quantisation, K2-Instruct; every backend): float8_e4m3fn
  N(0, 1) weights (clamped to +-448) and float32 tile scales (1 / sqrt(in_features)) * U(0.5, 1.5) per 128 x 128 tile,
  as the checkpoint tensors; humming keeps them FP8, the others dequantise them (kimi.backends.experts.make_experts);
  with fp8_dense "triton" / "humming", the dense weights a checkpoint load keeps FP8 (kimi.backends.linear.
  fp8_dense_names, on CUDA) are the random bf16 ones above quantised to FP8 128 x 128 tiles (quant_fp8_block).
Deterministic for a given seed on a given device.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kimi.backends.experts import make_experts_or_ref
from kimi.backends.linear import check_fp8_dense, fp8_dense_names, install_fp8
from kimi.checkpoint import load_checkpoint
from kimi.config import ModelConfig
from kimi.kernels.triton.linear_fp8 import Fp8Linear
from kimi.model.gpu_forward import prepare_attention
from kimi.model.model import KimiForCausalLM
from kimi.model.moe import DenseMLP, MoELayer
from kimi.model.rope import RotaryEmbedding

log = logging.getLogger(__name__)


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
    kimi.backends.experts.make_experts_or_ref: shapes a kernel rejects fall back to the dequantised reference, with a
    warning, as when loading a checkpoint)."""
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
        from kimi.model.quant import quant_fp8_block

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


def _is_expert_param(module: nn.Module, name: str) -> bool:
    return isinstance(module, MoELayer) and name in ("w13", "w2")


def build_gpu_model(
    cfg: ModelConfig,
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    a2a=None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda",
    max_positions: int | None = None,
) -> KimiForCausalLM:
    """An unloaded fused KimiForCausalLM (`fused=True`): every parameter allocated (uninitialised) on `device` except
    the stacked bf16 expert parameters, which stay on `meta`."""
    model = KimiForCausalLM(
        cfg,
        ep_rank=ep_rank,
        ep_size=ep_size,
        dtype=dtype,
        device="meta",
        a2a=a2a,
        max_positions=max_positions,
        fused=True,
    )
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or _is_expert_param(module, name):
                continue
            module._parameters[name] = nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=False
            )
    model.rope = RotaryEmbedding(cfg, max_positions, device)
    return model


def _merge_gate_up(m: DenseMLP) -> None:
    """One [2I, D] gate/up weight `m.w13`; gate_proj / up_proj become views of it (no extra memory). FP8 (an
    Fp8Linear pair): `m.w13` is their concatenation and gate_proj / up_proj are dropped."""
    if isinstance(m.gate_proj, Fp8Linear):
        m.w13 = Fp8Linear.cat([m.gate_proj, m.up_proj])
        m.gate_proj = m.up_proj = None
        return
    if not m.gate_proj.is_cuda:
        return
    inter = m.gate_proj.shape[0]
    w = torch.cat([m.gate_proj.detach(), m.up_proj.detach()], 0)
    m.gate_proj = nn.Parameter(w[:inter], requires_grad=False)
    m.up_proj = nn.Parameter(w[inter:], requires_grad=False)
    m.w13 = w


def _finish(model: KimiForCausalLM, fp8_dense: str = "off") -> KimiForCausalLM:
    """After the weights are in: what the fused kernels read (prepare_attention, merged gate/up weights), FP8 dense
    layers onto humming (fp8_dense "humming"); the model in eval mode."""
    for layer in model.layers:
        prepare_attention(layer.self_attn)
        mlp = layer.mlp
        if isinstance(mlp, DenseMLP):
            _merge_gate_up(mlp)
        elif isinstance(mlp, MoELayer) and mlp.shared_experts is not None:
            _merge_gate_up(mlp.shared_experts)
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    # humming after the merges (its layout cannot be concatenated)
    taken = sum(m.to_humming(model.embed_tokens.dtype) for m in fp8) if fp8_dense == "humming" else 0
    if fp8:
        log.info("FP8 dense layers kept FP8: %d on humming, %d on kimi's Triton kernel", taken, len(fp8) - taken)
    elif fp8_dense != "off":
        log.warning(
            "fp8_dense %s: no dense weight was kept FP8 (the checkpoint has no FP8 dense weights, or the "
            "device is not CUDA); they run as bf16",
            fp8_dense,
        )
    model.eval()
    return model


@torch.no_grad()
def load_reference_model(
    model_dir: str,
    cfg: ModelConfig,
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    a2a=None,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> KimiForCausalLM:
    """The reference KimiForCausalLM of one EP rank on the CPU, its weights from the checkpoint in model_dir
    dequantised to `dtype` (kimi.checkpoint.load_checkpoint), in eval mode. Raises CheckpointError on a missing or
    malformed checkpoint, ValueError when its tensors do not match cfg (load_weights)."""
    weights = load_checkpoint(
        model_dir,
        cfg,
        ep_rank=ep_rank,
        ep_size=ep_size,
        dequantize=True,
        dtype=dtype,
        device="cpu",
        progress=progress,
    )
    model = KimiForCausalLM(cfg, ep_rank=ep_rank, ep_size=ep_size, dtype=dtype, device="cpu", a2a=a2a)
    model.load_weights(weights)
    del weights
    return model.eval()


def load_gpu_model(
    model_dir: str,
    cfg: ModelConfig,
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    a2a=None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda",
    moe_backend: str = "auto",
    load_format: str = "auto",
    progress: bool = True,
    max_positions: int | None = None,
    seed: int = 0,
    fp8_dense: str = "off",
) -> KimiForCausalLM:
    """Build the GPU model (a fused KimiForCausalLM) and fill it from the checkpoint in model_dir (load_format
    "auto") or with random weights of the real shapes (load_format "dummy"; model_dir unused). fp8_dense:
    FP8_DENSE_CHOICES.

    Raises ValueError naming missing / misshapen tensors or a bad fp8_dense, CheckpointError from the loader.
    """
    check_fp8_dense(fp8_dense)
    from kimi.checkpoint import load_checkpoint
    from kimi.model.quant import dequant_fp8_block

    model = build_gpu_model(
        cfg, ep_rank=ep_rank, ep_size=ep_size, a2a=a2a, dtype=dtype, device=device, max_positions=max_positions
    )
    if load_format == "dummy":
        fill_dummy(model, cfg, moe_backend=moe_backend, dtype=dtype, seed=seed, fp8_dense=fp8_dense)
        return _finish(model, fp8_dense)
    if load_format != "auto":
        raise ValueError(f"unknown load format {load_format!r} (auto, dummy)")
    ws = load_checkpoint(
        model_dir, cfg, ep_rank=ep_rank, ep_size=ep_size, dequantize=False, dtype=dtype, device="cpu", progress=progress
    )
    block = cfg.quant.block if cfg.quant is not None else (128, 128)

    def dense(name: str) -> torch.Tensor:
        """A floating tensor by canonical `.weight` name, FP8 dequantised; raises KeyError if absent."""
        t = ws[name]
        if t.dtype == torch.float8_e4m3fn:
            return dequant_fp8_block(t.to(device), ws[name + "_scale_inv"].to(device), block, torch.float32)
        return t

    targets = model._weight_targets()
    keep_fp8 = set()
    if fp8_dense != "off" and torch.device(device).type == "cuda":
        keep_fp8 = fp8_dense_names(model, block, lambda n: n in ws and ws[n].dtype == torch.float8_e4m3fn)
    missing = []
    for name in list(targets):
        dst = targets.pop(name)  # (a bf16 parameter replaced by an Fp8Linear is freed once dst moves on)
        if ".mlp.experts." in name:
            continue
        if name not in ws:
            missing.append(name)
            continue
        if name in keep_fp8:
            install_fp8(model, name, ws[name], ws[name + "_scale_inv"], block)
            continue
        src = dense(name)
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"load_gpu_model: {name}: got {tuple(src.shape)}, want {tuple(dst.shape)}")
        dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
    if missing:
        raise ValueError(f"load_gpu_model: {len(missing)} missing: {', '.join(missing[:8])}")
    _load_experts(model, ws, cfg, dense, moe_backend=moe_backend, dtype=dtype, device=device, block=block)
    ws.clear()  # the loaded tensors are freed here, before the model is returned
    return _finish(model, fp8_dense)


def _load_experts(
    model: KimiForCausalLM,
    ws: dict[str, torch.Tensor],
    cfg: ModelConfig,
    dense,
    *,
    moe_backend: str,
    dtype: torch.dtype,
    device: torch.device | str,
    block: tuple[int, int],
) -> None:
    """Each MoE layer's local experts from the loaded tensors `ws` (consumed: each layer's are deleted once its backend
    holds them) into its experts backend (make_experts_or_ref): packed INT4 as they are, FP8 kept FP8 where humming
    takes them (I a multiple of the tile), else dequantised through dense(name) -> floating tensor."""
    for i, layer in enumerate(model.layers):
        mlp = layer.mlp
        if not isinstance(mlp, MoELayer):
            continue
        names = [f"model.layers.{i}.mlp.experts.{mlp.expert_offset + j}." for j in range(mlp.num_local_experts)]

        def stack(proj_parts, suffix, names=names):
            """The local experts' tensors `proj + suffix`, projections concatenated along N, stacked: [E, N, ...]."""
            return torch.stack([torch.cat([ws[n + p + suffix] for p in proj_parts], 0) for n in names]).to(device)

        if names[0] + "gate_proj.weight_packed" in ws:
            parts = {
                "w13_packed": stack(("gate_proj", "up_proj"), ".weight_packed"),
                "w13_scale": stack(("gate_proj", "up_proj"), ".weight_scale"),
                "w2_packed": stack(("down_proj",), ".weight_packed"),
                "w2_scale": stack(("down_proj",), ".weight_scale"),
            }
        elif (
            moe_backend in ("humming", "auto")
            and ws[names[0] + "gate_proj.weight"].dtype == torch.float8_e4m3fn
            and cfg.moe_intermediate_size % block[0] == 0
        ):
            # FP8 experts stay FP8 (HummingFp8Experts); gate and up tiles stack along N (I a multiple of the tile)
            parts = {
                "w13_fp8": stack(("gate_proj", "up_proj"), ".weight"),
                "w13_scale_inv": stack(("gate_proj", "up_proj"), ".weight_scale_inv"),
                "w2_fp8": stack(("down_proj",), ".weight"),
                "w2_scale_inv": stack(("down_proj",), ".weight_scale_inv"),
            }
        else:
            parts = {
                "w13": torch.stack(
                    [
                        torch.cat([dense(n + "gate_proj.weight"), dense(n + "up_proj.weight")], 0).to(device, dtype)
                        for n in names
                    ]
                ),
                "w2": torch.stack([dense(n + "down_proj.weight").to(device, dtype) for n in names]),
            }
        for n in names:
            for k in [k for k in ws if k.startswith(n)]:
                del ws[k]
        mlp.experts_impl = make_experts_or_ref(
            moe_backend, parts, mlp.expert_offset, cfg.n_routed_experts, dtype, fp8_block=block
        )
        del parts

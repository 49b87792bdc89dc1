"""The dense-GEMM policy of the GPU path: which kernel runs x @ W^T for a dense weight.

- bf16 weight tensors: kimi.kernels.triton.linear_small_m.linear (Triton for small M where its tuning table measured it
  faster than cuBLAS, else cuBLAS); `prologue_config_for` says when the q_a RMSNorm or SiLU * up fuse into the GEMM.
- FP8 weights (K2-Instruct's dense projections with `fp8_dense` "triton" / "humming"): kimi.kernels.triton.linear_fp8.
  Fp8Linear layers, installed by `install_fp8` for the names `fp8_dense_names` picks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kimi.kernels.triton.linear_fp8 import Fp8Linear
from kimi.kernels.triton.linear_small_m import linear as _bf16_linear
from kimi.kernels.triton.linear_small_m import prologue_config
from kimi.model.moe import MoELayer

if TYPE_CHECKING:
    from kimi.model.model import KimiForCausalLM

__all__ = [
    "FP8_DENSE_CHOICES",
    "check_fp8_dense",
    "dense_linear",
    "fp8_dense_names",
    "install_fp8",
    "prologue_config_for",
]


def dense_linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [T, K] @ W^T -> [T, N]: kimi.kernels.triton.linear_small_m.linear for a bf16 weight tensor [N, K], the FP8
    kernel
    (kimi.kernels.triton.linear_fp8) for an Fp8Linear (K2-Instruct's dense weights, kept FP8 by load_gpu_model)."""
    if isinstance(w, Fp8Linear):
        return w(x)
    return _bf16_linear(x, w)


def prologue_config_for(x: torch.Tensor, w, silu_mul: bool = False, fuse: bool = False):
    """The config to run the GEMM x @ w^T with its prologue (the q_a RMSNorm, or SiLU * up with silu_mul) fused into
    its loads (kimi.kernels.triton.linear_small_m.prologue_config), or None: run the prologue kernel, then the GEMM.
    None unless `fuse` (off by default: in the K2.6 decode step on an H200 the fused q_b / shared-down GEMMs cost more
    than the norm and SiLU kernels they replace, 4.92 -> 5.96 ms of eager GEMM time per step at 8 local sequences;
    docs/performance.md, Tried and not kept) and always for an Fp8Linear."""
    if not fuse or isinstance(w, Fp8Linear):
        return None
    return prologue_config(x, w, silu_mul=silu_mul)


FP8_DENSE_CHOICES = ("off", "triton", "humming")
"""`load_gpu_model(fp8_dense=...)` / `kimi serve --fp8-dense`: what happens to K2-Instruct's FP8 dense projections
on CUDA. "off" (default): dequantised to the model dtype on load (the fastest decode measured: bf16 GEMMs with the
q_a norm and SiLU*up fused in). "triton": kept FP8 (half their memory, ~8.7 GB less per rank at K2-Instruct's
shapes) and run by kimi's Triton FP8 kernel (kimi.kernels.triton.linear_fp8), deterministic. "humming": kept FP8 and
run by humming-kernels' dense W8A16 GEMM where N and K are whole scale tiles (faster prefill GEMMs, slower small decode
GEMMs; Stream-K off, so deterministic), else by kimi's kernel. Measured: docs/performance.md."""


def fp8_dense_names(model: KimiForCausalLM, block: tuple[int, int], is_fp8) -> set[str]:
    """The canonical names of the dense FP8 weights that can stay FP8 (Fp8Linear), given is_fp8(name) -> bool
    (whether the checkpoint holds that tensor in FP8): q_b_proj, o_proj, every down_proj; q_a_proj with
    kv_a_proj_with_mqa (merged into one layer) when both are FP8 and q_lora_rank is a multiple of the block's rows;
    gate_proj with up_proj (merged) when both are FP8 and the intermediate size is a multiple of the block's rows.
    kv_b_proj (absorbed into per-head bf16 matrices), the router, embeddings and lm_head are never FP8 here."""
    bn = block[0]
    ql = model.cfg.q_lora_rank
    keep: set[str] = set()
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        keep.update(n for n in (a + "q_b_proj.weight", a + "o_proj.weight") if is_fp8(n))
        qa, kva = a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight"
        if ql is not None and ql % bn == 0 and is_fp8(qa) and is_fp8(kva):
            keep.update((qa, kva))
        mlp = layer.mlp
        m, pre = (mlp.shared_experts, p + "mlp.shared_experts.") if isinstance(mlp, MoELayer) else (mlp, p + "mlp.")
        if m is None:
            continue
        g, u, d = (pre + f"{n}_proj.weight" for n in ("gate", "up", "down"))
        if m.gate_proj.shape[0] % bn == 0 and is_fp8(g) and is_fp8(u):
            keep.update((g, u))
        if is_fp8(d):
            keep.add(d)
    return keep


def check_fp8_dense(fp8_dense: str) -> None:
    """ValueError unless fp8_dense is one of FP8_DENSE_CHOICES."""
    if fp8_dense not in FP8_DENSE_CHOICES:
        raise ValueError(f"fp8_dense {fp8_dense!r}: want one of {', '.join(FP8_DENSE_CHOICES)}")


def install_fp8(
    model: KimiForCausalLM, name: str, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> None:
    """Replace the bf16 parameter of canonical `name` (e.g. model.layers.3.self_attn.o_proj.weight) by an Fp8Linear
    of w [N, K] float8_e4m3fn and scale_inv (on the parameter's device); the bf16 parameter is freed. Raises
    ValueError when the shape differs from the parameter's."""
    owner_path, attr, _ = name.removeprefix("model.").rsplit(".", 2)
    owner = model.get_submodule(owner_path)
    old = getattr(owner, attr)
    if tuple(w.shape) != tuple(old.shape):
        raise ValueError(f"{name}: got {tuple(w.shape)}, want {tuple(old.shape)}")
    dev = old.device
    delattr(owner, attr)
    setattr(owner, attr, Fp8Linear(w.to(dev), scale_inv.to(dev), block))

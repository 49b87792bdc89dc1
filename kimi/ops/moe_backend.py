"""Routed-expert backends for the GPU path: the same function as `kimi.ops.moe.fused_experts_ref`, over the
experts this rank owns, with the INT4 weights kept PACKED (and FP8 weights kept in FP8) on the device.

- `HummingInt4Experts` (`humming`, and `auto`, the default on CUDA): humming-kernels' indexed W4A16 MoE GEMM
  (humming 0.1.20, API read from its wheel: `humming.layer.HummingLayer` loaded from compressed-tensors
  `weight_packed` / `weight_scale` / `weight_shape`, `transform()`ed once into humming's layout, then called with
  moe_align's sorted pair ids).
  Steps: align (kimi.kernels.triton.moe_w4a16.moe_align, pure torch, graph-capturable) -> gate_up GEMM per (token, slot)
  pair -> silu(gate) * up (on CUDA: kimi.kernels.triton.fused.silu_mul_rows over the local pairs' rows only; align:
  kimi.kernels.triton.fused.moe_align_fused) -> down GEMM -> our Triton combine (routing weights applied once).
  With `cuda_decode` (backend `auto`), steps of up to AUTO_CUDA_MAX_PAIRS expected local pairs run kimi's CUDA
  GEMM instead (kimi/kernels/cuda/csrc/moe_w4a16.cu, which reads humming's layout: one copy of the experts serves
  both), larger steps
  (prefill) humming's: the faster of the two at each size (docs/performance.md). The gate_up rows are
  stored interleaved (kimi.kernels.cuda.moe_w4a16.glu_interleave), so kimi's gate_up GEMM writes silu(gate) * up from
  its epilogue and silu_mul_rows reads humming's output in that order.
- `HummingFp8Experts` (humming backend, FP8 checkpoints: K2-Instruct): the same steps over humming's W8A16 indexed
  GEMMs, the float8_e4m3fn weights with their 128 x 128 tile scales loaded through humming's fp8 schema.
- `CudaInt4Experts` (`cuda`): kimi's CUDA W4A16 indexed GEMM at every size (kimi/kernels/cuda/csrc/moe_w4a16.cu via
  kimi.kernels.cuda.moe_w4a16; weights repacked once at load by kimi.kernels.cuda.moe_w4a16.repack, no humming needed),
  in
  the same steps as humming's (align in 16-row blocks). Faster than humming at decode sizes, about 2x slower at
  prefill sizes (it streams an expert's weights once per 16-row block; docs/performance.md). bf16 models only.
- `TritonInt4Experts`: kimi's Triton W4A16 fused MoE (`fused_experts_int4`).
- `RefExperts`: dequantised weights (bf16) and `fused_experts_ref` (not capturable in a CUDA graph: it reads
  expert counts on the host). Used for `--moe-backend ref`, and for FP8 experts under the backends without an FP8
  kernel (triton, cuda) or shapes humming's FP8 path does not take (dequantised to bf16 on load).

Every backend: `forward(x [T, D] bf16, topk_weights [T, k] f32, topk_ids [T, k] int64 global ids) -> [T, D]`;
pairs whose expert is not in [expert_offset, expert_offset + E_local) contribute nothing; rows with no local
pair are 0. `graph_safe` says whether a CUDA graph may capture it.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kimi.config import MOE_BACKENDS as BACKENDS
from kimi.kernels import tuning
from kimi.ops.moe import fused_experts_ref

log = logging.getLogger("kimi.worker")

# Backend "auto": the largest step, in expected local pairs (T * top_k * E_local / E_total), that runs kimi's CUDA
# GEMM; larger ones run humming's (the crossover of the two: docs/performance.md).
AUTO_CUDA_MAX_PAIRS = 512


def expected_local_pairs(T: int, k: int, E: int, num_experts_total: int) -> int:
    """The (token, expert) pairs a step of T tokens at top-k routes to E local experts of num_experts_total, in
    expectation under uniform routing (at least 1): what the expert GEMMs' schedules are picked by."""
    return max(1, T * k * E // max(num_experts_total, E))


# Measured schedules for humming's two expert GEMMs, replacing its heuristic choice where a sweep found a faster one:
# kimi.kernels.tuning's "humming" table (kimi/kernels/tuning/humming.json, or the file $KIMI_HUMMING_TABLE names; ""
# or "off": none), read once and used only on the GPU it was measured on. For a GEMM [N, K] at m expected local
# pairs, the first entry with m_min <= m <= m_max applies; none: humming's heuristic. An entry's "weight" ("int4",
# the default, or "fp8") names the layers it was measured on, "e_local" (when set) the number of local experts it
# applies to (the same m spreads over fewer experts under a larger EP).
_humming_table: dict | None = None


def load_humming_table(path: str | os.PathLike | None = None) -> dict:
    """{"gpu": name or None, "entries": {(n, k): [(m_min, m_max, config, over_heuristic), ...]}, "scope": {(n, k):
    [(weight, e_local or None), ...]}} (scope: parallel to entries). An entry with "over_heuristic": true holds only
    the fields it replaces in humming's heuristic schedule (what was measured); others are whole schedules. A missing
    file (or $KIMI_HUMMING_TABLE "" / "off") gives no entries; a malformed file raises ValueError."""
    table = tuning.load("humming", path)
    if table.gpu is None:
        return {"gpu": None, "entries": {}, "scope": {}}
    entries: dict[tuple[int, int], list[tuple[int, int, dict, bool]]] = {}
    scope: dict[tuple[int, int], list[tuple[str, int | None]]] = {}
    for e in table.entries:
        if e.m_max is None:
            raise ValueError(f"bad humming table: entry [{e.n}, {e.k}] has no m_max")
        entries.setdefault((e.n, e.k), []).append((e.m_min or 1, e.m_max, dict(e.config), e.over_heuristic))
        scope.setdefault((e.n, e.k), []).append((e.weight, e.e_local))
    return {"gpu": table.gpu, "entries": entries, "scope": scope}


def humming_table_config(
    n: int,
    k: int,
    m_local: int,
    gpu: str,
    heuristic: dict | None = None,
    weight: str = "int4",
    e_local: int | None = None,
) -> dict | None:
    """The measured config for a humming GEMM [n, k] of `weight` layers ("int4" / "fp8") at m_local expected pairs
    over e_local local experts on GPU `gpu`, or None (no entry). An over-heuristic entry is its fields over a copy of
    `heuristic` (humming's own schedule for the GEMM; raises ValueError when it is not given)."""
    global _humming_table
    if _humming_table is None:
        _humming_table = load_humming_table()
    t = _humming_table
    if t["gpu"] != gpu:
        return None
    key = (n, k)
    scope = t.get("scope", {}).get(key) or [("int4", None)] * len(t["entries"].get(key, []))
    for (lo, hi, cfg, over), (w, el) in zip(t["entries"].get(key, []), scope):
        if w != weight or (el is not None and el != e_local):
            continue
        if lo <= m_local <= hi:
            if not over:
                return copy.deepcopy(cfg)
            if heuristic is None:
                raise ValueError(
                    f"humming table entry [{n}, {k}] m {lo}-{hi} replaces fields of the heuristic schedule; none given"
                )
            return copy.deepcopy(heuristic) | copy.deepcopy(cfg)
    return None


__all__ = [
    "BACKENDS",
    "CudaInt4Experts",
    "HummingExperts",
    "HummingFp8Experts",
    "HummingInt4Experts",
    "RefExperts",
    "TritonInt4Experts",
    "dequant_fp8_parts",
    "humming_table_config",
    "load_humming_table",
    "make_experts",
]


class RefExperts(nn.Module):
    """Dequantised experts: w13 [E, 2I, D], w2 [E, D, I] (model dtype) -> `fused_experts_ref`."""

    graph_safe = False

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, expert_offset: int):
        super().__init__()
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        self.expert_offset = expert_offset

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts_ref(x, self.w13, self.w2, topk_weights, topk_ids, self.expert_offset)


class TritonInt4Experts(nn.Module):
    """Packed INT4 experts run by `kimi.kernels.triton.moe_w4a16.fused_experts_int4`.

    w13_packed int32 [E, 2I, D/8] (gate rows then up rows), w13_scale [E, 2I, D/32], w2_packed [E, D, I/8],
    w2_scale [E, D, I/32]; num_experts_total: the model's routed experts (tile heuristic).
    """

    graph_safe = True
    w13_packed: torch.Tensor  # the buffers `__init__` registers
    w13_scale: torch.Tensor
    w2_packed: torch.Tensor
    w2_scale: torch.Tensor

    def __init__(self, w13_packed, w13_scale, w2_packed, w2_scale, expert_offset: int, num_experts_total: int):
        super().__init__()
        self.register_buffer("w13_packed", w13_packed)
        self.register_buffer("w13_scale", w13_scale)
        self.register_buffer("w2_packed", w2_packed)
        self.register_buffer("w2_scale", w2_scale)
        self.expert_offset = expert_offset
        self.num_experts_total = num_experts_total

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        from kimi.kernels.triton.moe_w4a16 import fused_experts_int4

        return fused_experts_int4(
            x,
            self.w13_packed,
            self.w13_scale,
            self.w2_packed,
            self.w2_scale,
            topk_weights,
            topk_ids,
            self.expert_offset,
            num_experts_total=self.num_experts_total,
        )


class HummingExperts(nn.Module):
    """Routed experts run by humming-kernels' indexed MoE GEMMs (layout transformed once at load): the steps and
    schedule choice shared by HummingInt4Experts and HummingFp8Experts, which load their weight format (`_setup`).
    `weight_kind` picks the tuning/humming.json entries that apply."""

    graph_safe = True
    expert_major_ok = True  # forward(..., expert_major=True): see kimi.ops.moe.run_experts
    weight_kind = "int4"  # which tuning/humming.json entries apply (HummingFp8Experts: "fp8")
    glu_group = 0  # > 0: the gate_up rows are in kimi.kernels.cuda.moe_w4a16.glu_interleave's order with this group

    def _setup(
        self,
        wcfg: dict,
        dtype,
        t13: dict,
        t2: dict,
        E: int,
        D: int,
        inter: int,
        dev,
        expert_offset: int,
        num_experts_total: int,
    ) -> None:
        """The two HummingLayers (gate_up [2I, D], down [D, I] per expert) from the checkpoint-format tensors t13 / t2
        under humming weight config wcfg, transformed into humming's layout."""
        from humming.layer import HummingLayer

        with torch.cuda.device(dev):
            self.l1 = HummingLayer(
                shape_n=2 * inter, shape_k=D, weight_config=dict(wcfg), num_experts=E, torch_dtype=dtype
            )
            self.l2 = HummingLayer(shape_n=D, shape_k=inter, weight_config=dict(wcfg), num_experts=E, torch_dtype=dtype)
            self.l1.to(dev)
            self.l2.to(dev)
            self.l1.load_from_tensors(t13)
            self.l2.load_from_tensors(t2)
            self.l1.transform()
            self.l2.transform()
        self.E, self.D, self.inter = E, D, inter
        self.device = dev
        self.expert_offset = expert_offset
        self.num_experts_total = num_experts_total
        self._tuning: dict[int, tuple[dict, dict]] = {}

    def _m_local(self, T: int, k: int) -> int:
        """The expected local pairs of a step of T tokens, top-k (`expected_local_pairs`)."""
        return expected_local_pairs(T, k, self.E, self.num_experts_total)

    def _configs(self, m_local: int) -> tuple[dict, dict]:
        """The two GEMMs' humming schedules for a step of m_local expected local pairs (cached)."""
        key = m_local
        if key not in self._tuning:
            from humming.tune import get_heuristics_config

            gpu = torch.cuda.get_device_name(self.device)
            cs = []
            for layer, n, kk in ((self.l1, 2 * self.inter, self.D), (self.l2, self.D, self.inter)):
                h = get_heuristics_config(layer.humming_config, shape_m=m_local, gemm_type="indexed")
                cs.append(humming_table_config(n, kk, m_local, gpu, h, self.weight_kind, self.E) or h)
            self._tuning[key] = (cs[0], cs[1])
        return self._tuning[key]

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_major: bool = False,
        max_pairs: int | None = None,
        expected_pairs: int | None = None,
    ) -> torch.Tensor:
        """x [T, D], topk_weights [T, k] f32, topk_ids [T, k] global ids -> [T, D], the routing-weighted sum of
        each row's local experts (0 for rows without one). expert_major / max_pairs / expected_pairs: as
        kimi.ops.moe.DispatchResult (expert_major: k == 1, the weights are not applied and rows without a local
        expert are left unset; the down GEMM's output is returned as it is)."""
        from kimi.kernels.triton.moe_w4a16 import combine_into, moe_align

        T, k = topk_ids.shape
        if T == 0 or max_pairs == 0:  # no local pair: nothing to compute (unset rows / zeros, as below)
            return torch.empty_like(x) if T == 0 or (expert_major and k == 1) else torch.zeros_like(x)
        c1, c2 = self._configs(expected_pairs or self._m_local(T, k))
        bm1, bm2 = c1["block_shape"][0], c2["block_shape"][0]
        act_rows: Callable[..., torch.Tensor] | None = None  # SiLU * up of the local pairs' rows only (CUDA)
        if x.is_cuda:  # two Triton kernels instead of ~15 torch ops (kimi/kernels/triton/fused.py), sized by max_pairs
            from kimi.kernels.triton.fused import moe_align_fused, silu_mul_rows

            act_rows = silu_mul_rows
            align = lambda bm: moe_align_fused(topk_ids, self.E, self.expert_offset, bm, max_pairs)  # noqa: E731
        else:
            align = lambda bm: moe_align(topk_ids, self.E, self.expert_offset, bm)  # noqa: E731
        a1 = align(bm1)
        a2 = a1 if bm2 == bm1 else align(bm2)
        cc = {"gemm_type": "indexed"}
        y1 = self.l1(
            x.contiguous(),
            sorted_ids=a1[0],
            expert_ids=a1[1],
            num_tokens_padded=a1[2].view(()),
            top_k=k,
            compute_config=cc,
            tuning_config=c1,
        )  # [T*k, 2I] rows = pair ids (local pairs written)
        if act_rows is not None:  # only the rows of local pairs (the ones l1 wrote; the rest stay unset)
            act = act_rows(y1, a1[0], a1[2], self.inter, interleave=self.glu_group)  # [T*k, I]
        else:
            from kimi.kernels.triton.fused import glu_split

            gate, up = glu_split(y1, self.inter, self.glu_group)
            act = F.silu(gate) * up  # [T*k, I]
        y2 = self.l2(
            act,
            sorted_ids=a2[0],
            expert_ids=a2[1],
            num_tokens_padded=a2[2].view(()),
            top_k=1,
            compute_config=cc,
            tuning_config=c2,
        )  # [T*k, D]
        if expert_major and k == 1:  # rows = pairs, weights applied by the combine, unset rows never read
            return y2
        out = torch.empty_like(x)  # [T, D]; combine writes every element
        combine_into(y2, topk_weights, topk_ids, self.expert_offset, self.E, out)
        return out


class HummingInt4Experts(HummingExperts):
    """Packed INT4 experts run by humming-kernels' indexed MoE GEMMs (layout transformed once at load).

    Same arguments as TritonInt4Experts, plus cuda_decode (backend `auto`): steps of up to cuda_max_pairs
    (AUTO_CUDA_MAX_PAIRS) expected local pairs run kimi's CUDA GEMM over humming's transformed tensors, where
    `_cuda_unavailable` finds nothing against it at load (else cuda_max_pairs is 0 and a warning says why). The
    gate_up rows are stored in `kimi.kernels.cuda.moe_w4a16.glu_interleave`'s order (when I is a multiple of its group),
    so kimi's GEMM writes SiLU(gate) * up itself (`cuda_glu`; False: its plain outputs and the silu_mul_rows kernel,
    for A/B runs) and humming's outputs go through silu_mul_rows with the same interleave. The tensors passed in
    are consumed (humming keeps its own transformed copies; the caller should drop its references). Raises
    ImportError when humming is not installed.
    """

    def __init__(
        self,
        w13_packed,
        w13_scale,
        w2_packed,
        w2_scale,
        expert_offset: int,
        num_experts_total: int,
        cuda_decode: bool = False,
    ):
        super().__init__()
        from kimi.kernels.cuda import moe_w4a16 as mc

        E, two_i, d8 = w13_packed.shape
        D = d8 * 8
        if (two_i // 2) % mc.GLU_GROUP == 0:
            w13_packed, w13_scale = mc.glu_interleave(w13_packed, w13_scale)
            self.glu_group = mc.GLU_GROUP
        self.cuda_glu = True
        wcfg = dict(
            quant_method="compressed-tensors",
            format="pack-quantized",
            type="int",
            num_bits=4,
            strategy="group",
            group_size=32,
            symmetric=True,
        )
        dtype = torch.bfloat16 if w13_scale.dtype != torch.float16 else torch.float16
        shp13 = torch.tensor([[two_i, D]] * E, dtype=torch.int64)
        shp2 = torch.tensor([[D, two_i // 2]] * E, dtype=torch.int64)
        # kimi's layout of expert 0's first 64 inputs of each GEMM, to check humming's transform against at the end
        probes = None
        if cuda_decode and w13_packed.is_cuda and D % 64 == 0 and two_i % 128 == 0:
            probes = [
                mc.repack(p[:1, :, :8].contiguous(), sc[:1, :, :2].contiguous())
                for p, sc in ((w13_packed, w13_scale), (w2_packed, w2_scale))
            ]
        self._setup(
            wcfg,
            dtype,
            {"weight_packed": w13_packed, "weight_scale": w13_scale.to(dtype), "weight_shape": shp13},
            {"weight_packed": w2_packed, "weight_scale": w2_scale.to(dtype), "weight_shape": shp2},
            E,
            D,
            two_i // 2,
            w13_packed.device,
            expert_offset,
            num_experts_total,
        )
        # kimi's CUDA GEMM over humming's tensors for steps of up to cuda_max_pairs expected local pairs (0: never);
        # its launch configurations: kimi.kernels.cuda.moe_w4a16.config_for's per step size, or these where set
        self.cuda_max_pairs = 0
        self.cuda_config13: tuple[int, int, int] | None = None
        self.cuda_config2: tuple[int, int, int] | None = None
        if cuda_decode:
            why = self._cuda_unavailable(dtype, probes)
            if why:
                log.warning("MoE backend auto: kimi's CUDA GEMM is not used (%s); humming's runs every step", why)
            else:
                self.cuda_max_pairs = AUTO_CUDA_MAX_PAIRS

    def _cuda_unavailable(self, dtype, probes) -> str | None:
        """Why kimi's CUDA GEMM cannot run over this layer's humming tensors (None when it can): it needs a bf16
        model on an sm_90 GPU, shapes it has a configuration for, humming's layout for 16-bit inputs with the
        checkpoint's offset-binary codes (humming re-encodes a tensor without any code 0, i.e. no -8, as
        sign-magnitude, which the kernel does not read; checked, with the layout itself, on expert 0's first 64
        inputs against `probes`, kimi's repack of them), and its extension built."""
        from humming import dtypes as hd

        from kimi.kernels.cuda import moe_w4a16 as mc

        if dtype != torch.bfloat16:
            return f"the model dtype is {dtype}, not bf16"
        if torch.cuda.get_device_capability(self.device)[0] != 9:
            return "the GPU is not sm_90 (Hopper)"
        try:  # a configuration runs both shapes (the one used is picked per step size)
            mc.config_for(2 * self.inter, self.D), mc.config_for(self.D, self.inter)
        except ValueError as e:
            return str(e)
        for layer, n, k in ((self.l1, 2 * self.inter, self.D), (self.l2, self.D, self.inter)):
            w, sc = getattr(layer, "weight", None), getattr(layer, "weight_scale", None)
            if layer.humming_config.b_dtype != hd.uint4:
                return f"humming stores the [{n}, {k}] weights as {layer.humming_config.b_dtype!r}, not uint4 codes"
            E = self.E
            if (
                w is None
                or sc is None
                or tuple(w.shape) != (E, k // 16, 2 * n)
                or tuple(sc.shape) != (E, k // 32, n)
                or w.dtype != torch.int32
                or sc.dtype != torch.bfloat16
                or not (w.is_contiguous() and sc.is_contiguous())
            ):
                return f"humming's [{n}, {k}] tensors are not in the layout the kernel reads"
        if probes is None:
            return "the experts are not on a CUDA device or their shapes are not multiples of 64"
        for layer, (pw, ps), name in ((self.l1, probes[0], "gate_up"), (self.l2, probes[1], "down")):
            if not (torch.equal(layer.weight[:1, :4], pw) and torch.equal(layer.weight_scale[:1, :2], ps)):
                import humming

                return (
                    f"humming {getattr(humming, '__version__', '?')}'s {name} tensors differ from kimi's layout "
                    "(checked: humming-kernels 0.1.20)"
                )
        try:
            mc.load_extension()  # built (or loaded from its cache) at model load, not in the first step
        except Exception as e:
            return f"its extension did not build ({type(e).__name__}: {e})"
        return None

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_major: bool = False,
        max_pairs: int | None = None,
        expected_pairs: int | None = None,
    ) -> torch.Tensor:
        """As HummingExperts.forward; steps of up to cuda_max_pairs expected local pairs run kimi's CUDA GEMM."""
        T, k = topk_ids.shape
        m_local = expected_pairs or self._m_local(T, k)
        if T and m_local <= self.cuda_max_pairs:  # cuda_max_pairs 0: never (m_local >= 1)
            return cuda_experts_forward(
                x,
                topk_weights,
                topk_ids,
                self.E,
                self.expert_offset,
                self.inter,
                self.l1.weight,
                self.l1.weight_scale,
                self.l2.weight,
                self.l2.weight_scale,
                m_local,
                self.cuda_config13,
                self.cuda_config2,
                self.glu_group,
                self.cuda_glu,
                expert_major=expert_major,
                max_pairs=max_pairs,
            )
        return super().forward(x, topk_weights, topk_ids, expert_major, max_pairs, m_local)


class HummingFp8Experts(HummingExperts):
    """FP8 block-quantised experts (K2-Instruct: float8_e4m3fn weights, one float32 `weight_scale_inv` per
    block_n x block_k tile, DeepSeek-V3's format) kept in FP8 on the device and run by humming-kernels' indexed
    MoE GEMMs (W8A16: bf16 activations, fp32 accumulation), in the same steps as HummingInt4Experts.

    humming's fp8 schema turns the tile scales into per-row group scales along K (group block_k) in the model
    dtype, so W[n, k] = float(w[n, k]) * bf16(scale_inv[n // block_n, k // block_k]): the scale is rounded to bf16
    (relative 2^-9) where `kimi.ops.quant.dequant_fp8_block` keeps it in float32. The GPU tests bound the output's
    distance from the dequantised reference (RefExperts) by 2e-2 of its max |ref| (measured <= 1.01e-2). Half the bytes
    of bf16 experts (dequantised on load, the `ref` path), and CUDA-graph capturable. Schedules: tuning/humming.json's
    "fp8" entries, else humming's heuristic.

    Args: w13 [E, 2I, D] float8_e4m3fn (gate rows then up rows), w13_scale_inv [E, 2I / block_n, D / block_k]
    float32, w2 [E, D, I] float8_e4m3fn, w2_scale_inv [E, D / block_n, I / block_k] float32, all on the device;
    block (block_n, block_k); dtype: the model dtype (bf16 / fp16). Raises ValueError when 2I, D or I is not a
    multiple of the block edges (the gate / up tiles must not straddle); ImportError without humming.
    """

    weight_kind = "fp8"

    def __init__(
        self,
        w13,
        w13_scale_inv,
        w2,
        w2_scale_inv,
        expert_offset: int,
        num_experts_total: int,
        block: tuple[int, int] = (128, 128),
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        E, two_i, D = w13.shape
        inter = two_i // 2
        bn, bk = block
        if inter % bn or D % bn or D % bk or inter % bk:
            raise ValueError(f"FP8 experts: I {inter} and D {D} must be multiples of the {bn} x {bk} scale tiles")
        for name, t, want in (
            ("w13", w13, (E, 2 * inter, D)),
            ("w2", w2, (E, D, inter)),
            ("w13_scale_inv", w13_scale_inv, (E, 2 * inter // bn, D // bk)),
            ("w2_scale_inv", w2_scale_inv, (E, D // bn, inter // bk)),
        ):
            if tuple(t.shape) != want:
                raise ValueError(f"FP8 experts: {name} is {tuple(t.shape)}, want {want}")
        wcfg = dict(quant_method="fp8", weight_block_size=[bn, bk])
        self._setup(
            wcfg,
            dtype,
            {"weight": w13, "weight_scale_inv": w13_scale_inv.float()},
            {"weight": w2, "weight_scale_inv": w2_scale_inv.float()},
            E,
            D,
            inter,
            w13.device,
            expert_offset,
            num_experts_total,
        )


class CudaInt4Experts(nn.Module):
    """Packed INT4 experts run by kimi's CUDA indexed GEMM (kimi.kernels.cuda.moe_w4a16), weights repacked at load.

    Same arguments as TritonInt4Experts (the packed tensors are consumed). Steps per call: align in 16-row blocks
    (kimi.kernels.triton.fused.moe_align_fused) -> gate_up GEMM over the local pairs' rows, its epilogue writing
    silu(gate) *
    up (gate_up rows stored in `kimi.kernels.cuda.moe_w4a16.glu_interleave`'s order; `glu` False: the plain GEMM and the
    silu_mul_rows kernel, for A/B runs) -> down GEMM -> the Triton combine (routing weights applied once). bf16
    activations only. Raises ValueError for shapes the kernel cannot take (N % 64, K % 64), RuntimeError on a GPU
    that is not sm_90 (Hopper: the kernel is built for sm_90a), and what `kimi.kernels.cuda.moe_w4a16.load_extension`
    raises when it cannot be built; all of them here, at model load (so kimi.worker.gpu_model.make_experts_or_ref can
    fall back to the reference).
    """

    graph_safe = True
    expert_major_ok = True  # forward(..., expert_major=True): see kimi.ops.moe.run_experts
    w13: torch.Tensor  # the buffers `__init__` registers
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    def __init__(self, w13_packed, w13_scale, w2_packed, w2_scale, expert_offset: int, num_experts_total: int):
        super().__init__()
        from kimi.kernels.cuda import moe_w4a16 as mc

        E, two_i, d8 = w13_packed.shape
        self.E, self.D, self.inter = E, d8 * 8, two_i // 2
        dev = w13_packed.device
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9:
            raise RuntimeError(f"MoE backend cuda needs an sm_90 (Hopper) GPU; got {dev}")
        mc.config_for(two_i, self.D), mc.config_for(self.D, self.inter)  # ValueError when no configuration runs one
        # launch configurations: config_for's per step size, or these where set (benchmarks)
        self.config13: tuple[int, int, int] | None = None
        self.config2: tuple[int, int, int] | None = None
        self.glu = True
        self.glu_group = mc.GLU_GROUP  # w13's rows in glu_interleave's order (config_for above: I % 32 == 0)
        w13, s13 = mc.repack(*mc.glu_interleave(w13_packed, w13_scale))
        w2, s2 = mc.repack(w2_packed, w2_scale)
        self.register_buffer("w13", w13)
        self.register_buffer("w13_scale", s13)
        self.register_buffer("w2", w2)
        self.register_buffer("w2_scale", s2)
        self.expert_offset = expert_offset
        self.num_experts_total = num_experts_total
        mc.load_extension()  # built (or loaded from its cache) at model load, not in the first step

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_major: bool = False,
        max_pairs: int | None = None,
        expected_pairs: int | None = None,
    ) -> torch.Tensor:
        """x [T, D], topk_weights [T, k], topk_ids [T, k] -> [T, D] (`cuda_experts_forward`; the keywords as
        kimi.ops.moe.DispatchResult)."""
        T, k = topk_ids.shape
        m_local = expected_pairs or expected_local_pairs(T, k, self.E, self.num_experts_total)
        return cuda_experts_forward(
            x,
            topk_weights,
            topk_ids,
            self.E,
            self.expert_offset,
            self.inter,
            self.w13,
            self.w13_scale,
            self.w2,
            self.w2_scale,
            m_local,
            self.config13,
            self.config2,
            self.glu_group,
            self.glu,
            expert_major=expert_major,
            max_pairs=max_pairs,
        )


def cuda_experts_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    E: int,
    expert_offset: int,
    inter: int,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    m_local: int,
    config13: tuple[int, int, int] | None = None,
    config2: tuple[int, int, int] | None = None,
    glu_group: int = 0,
    fuse_glu: bool = True,
    expert_major: bool = False,
    max_pairs: int | None = None,
) -> torch.Tensor:
    """The routed experts through kimi's CUDA GEMM (kimi.kernels.cuda.moe_w4a16.indexed_gemm): align in 16-row blocks
    (kimi.kernels.triton.fused.moe_align_fused) -> gate_up over the local pairs' rows -> silu(gate) * up on those rows
    -> down
    -> the Triton combine. x [T, D] bf16, topk_weights [T, k], topk_ids [T, k] global ids; w13 / s13 ([E, D/16, 4I]
    int32, [E, D/32, 2I] bf16) and w2 / s2 ([E, I/16, 2D], [E, I/32, D]) in the kernel's layout; m_local: the step's
    expected local pairs, which picks the launch configurations (kimi.kernels.cuda.moe_w4a16.config_for) unless config13
    / config2 are given. glu_group: 0, or the group of `kimi.kernels.cuda.moe_w4a16.glu_interleave` that w13's rows are
    stored in; with GLU_GROUP and fuse_glu the gate_up GEMM's epilogue writes SiLU(gate) * up (no SiLU kernel).
    Returns [T, D] (rows without a local pair are 0). expert_major / max_pairs: as kimi.ops.moe.DispatchResult
    (with expert_major and k == 1 the down GEMM's output is returned: weights not applied, rows without a local
    expert unset; max_pairs bounds the local pairs, sizing the align and the GEMM grids)."""
    from kimi.kernels.cuda import moe_w4a16 as mc
    from kimi.kernels.triton.fused import moe_align_fused, silu_mul_rows
    from kimi.kernels.triton.moe_w4a16 import combine_into

    T, k = topk_ids.shape
    D = x.shape[-1]
    if T == 0 or max_pairs == 0:  # no local pair: nothing to compute (unset rows / zeros, as below)
        return torch.empty_like(x) if T == 0 or (expert_major and k == 1) else torch.zeros_like(x)
    sorted_ids, block_expert, num_padded, _ = moe_align_fused(topk_ids, E, expert_offset, 16, max_pairs)
    P = T * k
    config13 = config13 or mc.config_for(2 * inter, D, m_local)
    config2 = config2 or mc.config_for(D, inter, m_local)
    if fuse_glu and glu_group == mc.GLU_GROUP:  # SiLU(gate) * up from the gate_up GEMM's epilogue
        act = torch.empty((P, inter), dtype=x.dtype, device=x.device)  # rows = pair ids (local ones written)
        mc.indexed_gemm(
            x.contiguous(), w13, s13, sorted_ids, block_expert, num_padded, k, act, config=config13, glu=True
        )
    else:
        y1 = torch.empty((P, 2 * inter), dtype=x.dtype, device=x.device)  # rows = pair ids (local ones written)
        mc.indexed_gemm(x.contiguous(), w13, s13, sorted_ids, block_expert, num_padded, k, y1, config=config13)
        act = silu_mul_rows(y1, sorted_ids, num_padded, inter, interleave=glu_group)  # [P, I], listed rows only
    y2 = torch.empty((P, D), dtype=x.dtype, device=x.device)
    # the align is two kernels back (gate_up, or gate_up + silu_mul_rows, each waiting before it releases): the down
    # GEMM may start loading its weights before it waits
    mc.indexed_gemm(
        act, w2, s2, sorted_ids, block_expert, num_padded, 1, y2, config=config2, early_weights=mc.EARLY_WEIGHTS_DOWN
    )
    if expert_major and k == 1:  # rows = pairs, weights applied by the combine, unset rows never read
        return y2
    out = torch.empty_like(x)  # [T, D]; combine writes every element
    combine_into(y2, topk_weights, topk_ids, expert_offset, E, out)
    return out


def dequant_fp8_parts(parts: dict, block: tuple[int, int], dtype: torch.dtype) -> dict:
    """FP8 parts (`w13_fp8`, `w13_scale_inv`, `w2_fp8`, `w2_scale_inv`) -> dequantised {`w13`, `w2`} in dtype, one
    expert at a time (kimi.ops.quant.dequant_fp8_block)."""
    from kimi.ops.quant import dequant_fp8_block

    def deq(w, s):
        return torch.stack([dequant_fp8_block(w[e], s[e], block, torch.float32).to(dtype) for e in range(w.shape[0])])

    return {"w13": deq(parts["w13_fp8"], parts["w13_scale_inv"]), "w2": deq(parts["w2_fp8"], parts["w2_scale_inv"])}


def make_experts(
    backend: str,
    parts: dict[str, torch.Tensor],
    expert_offset: int,
    num_experts_total: int,
    dtype: torch.dtype,
    fp8_block: tuple[int, int] = (128, 128),
) -> nn.Module:
    """Build one MoE layer's local experts.

    parts (stacked over the local experts, on the device), one of:
    - packed INT4 (`w13_packed`, `w13_scale`, `w2_packed`, `w2_scale`): the named backend; "ref" dequantises (dtype);
    - FP8 blocks (`w13_fp8` [E, 2I, D], `w13_scale_inv`, `w2_fp8` [E, D, I], `w2_scale_inv`; K2-Instruct, tiles of
      fp8_block): HummingFp8Experts for "humming" and "auto"; every other backend has no FP8 kernel and gets them
      dequantised (dtype) into RefExperts;
    - dequantised (`w13` [E, 2I, D], `w2` [E, D, I]): always RefExperts (no quantised kernel applies).
    "auto" on INT4: HummingInt4Experts with cuda_decode (kimi's CUDA GEMM at decode sizes where it can run, see
    HummingInt4Experts._cuda_unavailable); without humming-kernels, CudaInt4Experts at every size (with a warning).
    Raises ValueError for an unknown backend, or backend "cuda" with a dtype other than bf16; the backends' own
    errors (CudaInt4Experts, HummingInt4Experts, HummingFp8Experts) pass through.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if "w13_fp8" in parts:
        if backend in ("humming", "auto"):
            return HummingFp8Experts(
                parts["w13_fp8"],
                parts["w13_scale_inv"],
                parts["w2_fp8"],
                parts["w2_scale_inv"],
                expert_offset,
                num_experts_total,
                fp8_block,
                dtype,
            )
        parts = dequant_fp8_parts(parts, fp8_block, dtype)
    if "w13" in parts:
        return RefExperts(parts["w13"].to(dtype), parts["w2"].to(dtype), expert_offset)
    if backend == "ref":
        from kimi.ops.quant import dequant_int4

        def deq(p, s):
            return torch.stack([dequant_int4(p[e], s[e], 32, dtype) for e in range(p.shape[0])])

        return RefExperts(
            deq(parts["w13_packed"], parts["w13_scale"]), deq(parts["w2_packed"], parts["w2_scale"]), expert_offset
        )
    args = (
        parts["w13_packed"],
        parts["w13_scale"],
        parts["w2_packed"],
        parts["w2_scale"],
        expert_offset,
        num_experts_total,
    )
    if backend == "auto":
        try:
            return HummingInt4Experts(*args, cuda_decode=True)
        except ImportError as e:
            if dtype != torch.bfloat16:
                raise ValueError(
                    f"MoE backend auto without humming-kernels ({e}) needs kimi's CUDA GEMM, which runs "
                    f"bf16 models only, not {dtype}"
                ) from e
            log.warning(
                "MoE backend auto: humming-kernels is not installed (%s); kimi's CUDA GEMM runs every step "
                "(about 2x slower prefill than humming's)",
                e,
            )
            backend = "cuda"
    if backend == "cuda" and dtype != torch.bfloat16:
        raise ValueError(f"MoE backend cuda runs bf16 models only, not {dtype}")
    cls = {"humming": HummingInt4Experts, "cuda": CudaInt4Experts}.get(backend, TritonInt4Experts)
    return cls(
        parts["w13_packed"], parts["w13_scale"], parts["w2_packed"], parts["w2_scale"], expert_offset, num_experts_total
    )

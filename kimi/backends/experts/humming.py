"""The `humming` experts backend: humming-kernels' indexed W4A16 MoE GEMMs over packed INT4 experts, with the
measured schedules of kimi.kernels.tuning's "humming" table; with `cuda_decode` (the `auto` backend) kimi's CUDA
GEMM runs decode-sized steps over the same weights."""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kimi.backends.experts.cuda_w4a16 import AUTO_CUDA_MAX_PAIRS, cuda_experts_forward, expected_local_pairs
from kimi.kernels import tuning

log = logging.getLogger(__name__)


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


def use_humming_table(table: dict | None) -> dict | None:
    """Make `table` (load_humming_table's form; None: read the configured file at the next lookup) the one
    humming_table_config looks up; returns the one it replaces (benchmarks A/B tables in one process). Experts
    cache their schedules: drop their `_tuning` for the change to reach them."""
    global _humming_table
    previous, _humming_table = _humming_table, table
    return previous


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


class HummingExperts(nn.Module):
    """Routed experts run by humming-kernels' indexed MoE GEMMs (layout transformed once at load): the steps and
    schedule choice shared by HummingInt4Experts and HummingFp8Experts, which load their weight format (`_setup`).
    `weight_kind` picks the tuning/humming.json entries that apply."""

    graph_safe = True
    expert_major_ok = True  # forward(..., expert_major=True): see kimi.model.moe.run_experts
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

        # under torch.device(dev) humming allocates its parameters on the GPU (not on the host, then copied)
        with torch.cuda.device(dev), torch.device(dev):
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
        self._gpu_name = torch.cuda.get_device_name(dev)  # the tuning table's key (once: kernel_variants asks per m)

    def _m_local(self, T: int, k: int) -> int:
        """The expected local pairs of a step of T tokens, top-k (`expected_local_pairs`)."""
        return expected_local_pairs(T, k, self.E, self.num_experts_total)

    def _configs(self, m_local: int) -> tuple[dict, dict]:
        """The two GEMMs' humming schedules for a step of m_local expected local pairs (cached)."""
        key = m_local
        if key not in self._tuning:
            from humming.tune import get_heuristics_config

            gpu = self._gpu_name
            cs = []
            for layer, n, kk in ((self.l1, 2 * self.inter, self.D), (self.l2, self.D, self.inter)):
                h = get_heuristics_config(layer.humming_config, shape_m=m_local, gemm_type="indexed")
                cs.append(humming_table_config(n, kk, m_local, gpu, h, self.weight_kind, self.E) or h)
            self._tuning[key] = (cs[0], cs[1])
        return self._tuning[key]

    def kernel_variants(self, max_tokens: int, top_k: int) -> list[int]:
        """Step sizes T in [1, max_tokens], the smallest T of each distinct pair of GEMM schedules `forward` picks for
        steps of 1..max_tokens tokens of top_k pairs each (humming JIT-compiles one kernel per schedule): a warm-up
        step of each size compiles every kernel those steps launch. Host work only (humming's heuristic and the
        table, each m once)."""
        first: dict[str, int] = {}
        for t in range(1, max_tokens + 1):
            key = json.dumps(self._configs(self._m_local(t, top_k)), sort_keys=True, default=str)
            first.setdefault(key, t)
        return sorted(first.values())

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
        kimi.model.moe.DispatchResult (expert_major: k == 1, the weights are not applied and rows without a local
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
    `_cuda_unavailable` finds nothing against it at load (else cuda_max_pairs is 0 and a warning says why). The gate_up
    rows are stored in `kimi.kernels.cuda.moe_w4a16.glu_interleave`'s order (when I is a multiple of its group), so
    kimi's GEMM writes SiLU(gate) * up itself (`cuda_glu`; False: its plain outputs and the silu_mul_rows kernel, for
    A/B runs) and humming's outputs go through silu_mul_rows with the same interleave. The tensors passed in are
    consumed (humming keeps its own transformed copies; the caller should drop its references). Raises ImportError when
    humming is not installed.
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
        # kimi's GEMMs' launch variants (cuda_experts_forward; the measured-faster defaults, benchmarks A/B the others)
        self.cuda_pdl_mode, self.cuda_early_weights, self.cuda_zero_pads = "early", True, True
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
                pdl_mode=self.cuda_pdl_mode,
                early_weights=self.cuda_early_weights,
                zero_pads=self.cuda_zero_pads,
            )
        return super().forward(x, topk_weights, topk_ids, expert_major, max_pairs, m_local)

"""kimi's CUDA W4A16 indexed expert GEMM (kimi/kernels/cuda/csrc/moe_w4a16.cu): the routed experts' GEMMs at decode
sizes.

What: y[r] = W_e @ x[r // top_k] for every row r that a MoE align lists (r = a (token, slot) pair id; e the expert
of the 16-row block holding r), with W_e the expert's INT4 group-32 weights, W = (nibble - 8) * scale (bf16 scales,
as Kimi's checkpoints store them; other scale dtypes are rounded to bf16 first). Per group of 32 inputs the
products (nibble - 8) * x are summed in fp32 on the tensor cores (mma.sync m16n8k16, exact products), the group's
scale multiplies that sum in fp32, and the result is rounded once to bf16. So the weights are never rounded:
`kimi.model.quant.dequant_int4` rounds (nibble - 8) * scale to bf16, and the two differ by that rounding (relative
at most 2^-9 per weight). Rows not listed are not written.

Why: decode streams every touched expert's weights once per step (a few rows per expert), so this GEMM is a read of the
packed weights, and the decode step runs at the H200's 700 W power cap (SM clocks 1.3-2.0 GHz in the step;
docs/performance.md), where each instruction issued per weight costs clock. Per weight the kernel issues little beyond
the conversion: each warp loads 16 bytes per lane per tile (one coalesced 512-byte read per warp) into shared memory,
several chunks in flight, and a LOP3 (plus a shift for three of every four) turns two nibbles into the bf16 pair (128 +
nibble); the MMA multiplies those raw values, an MMA with the constant -136 adds -136 * (the group's input sum) once per
chunk for all tiles, and one FFMA per accumulator applies the scale per group.

Layout (`repack`, once at load): the layout humming-kernels' W4A16 GEMM uses for 16-bit inputs, so that with
`--moe-backend auto` one copy of the experts serves humming's GEMM at prefill sizes and this kernel at decode sizes
(kimi.backends.experts.HummingInt4Experts). The tables below are this project's description of it, written from the
PTX ISA's mma.m16n8k16 fragment tables; the GPU tests check that `repack` builds what humming's `transform()` builds.
- weights [E, K/16, 2N] int32 = [E, K/16 k16 steps, N/64 blocks, 32 lanes, 4 words]: in k16 step s and n64 block nb,
  lane L (g = L // 4, t = L % 4) holds word c for the 16 rows 64 nb + 16 c .. + 15 (the MMA's A operand: the weight
  rows are its M, the tokens its N). A word's 8 nibbles are the 8 A-fragment values of that lane: nibble p (bits
  4p..4p+3) = stored nibble (value + 8) of W[64 nb + 16 c + g + 8 ((p >> 1) & 1), 16 s + 2 t + 8 (p & 1) + (p >> 2)].
  So (word >> 4i) & 0x000F000F holds two values of one fragment register (i = 0, 2, 1, 3 for registers 0..3) at the
  low nibble of each 16-bit half, and OR-ing 0x43004300 makes them the bf16 numbers 128 + nibble (exact).
- scales [E, K/32, N] bf16: group-major, and each run of 64 rows stored as (g, i) -> row 8 i + g, so lane group g
  reads the scales of its rows g + 8 i of a block and group in one 16-byte load.
A chunk of k64 inputs covers 4 k16 steps and 2 scale groups (steps 0, 1 are group 2c, steps 2, 3 group 2c + 1).
Requires N % 64 == 0 and K % 64 == 0 (Kimi's experts: N 4096 and 7168, K 7168 and 2048).

Work split: a CTA of KW warps owns one 16-row block of the align (one expert; up to 16 pairs, one or two n8 halves of
the MMA) and NT 16-row tiles of N; its warps split K, each streaming its chunks through a ring of S shared-memory slots
filled by cp.async (S - 1 chunks of weights, scales and activation fragments in flight), and sum their partials in
shared memory at the end. With `glu` (the gate_up weights' rows in `glu_interleave`'s order: each n64 block holds 32
gate rows, then the 32 matching up rows) that final sum writes SiLU(gate) * up, the down GEMM's input, instead of the
GEMM's own outputs (no SiLU kernel between the two GEMMs). (Measured and not kept, docs/performance.md, Tried and not
kept: split-K over CTAs; persistent CTAs that stream unit after unit without a break, also with equal shares of work per
CTA; the down GEMM chained to gate_up per align block; a 200-register build for 5 CTAs per SM; a warp-specialised
stream-K kernel, a producer warp filling a ring of k64 stages for 7-8 computing warps; two CTAs per block, one per n8
half (fewer registers, more warps).) Launched with programmatic dependent launch when `kimi.kernels.triton.pdl.enabled`
(it waits for the kernel ahead before it reads anything, then lets the next kernel launch). With `early_weights` (the
down GEMM of `cuda_experts_forward`, whose align is two kernels back) a CTA reads its block's expert and issues its
first S - 1 chunks of weights before that wait.

The extension is built with torch's extension loader at first use (sources kimi/kernels/cuda/csrc/moe_w4a16.cu and
kimi/kernels/cuda/csrc/moe_w4a16_binding.cpp, sm_90a) and cached under $KIMI_CSRC_CACHE (default ~/.cache/kimi/csrc).
"""

from __future__ import annotations

import torch

from kimi.kernels import tuning
from kimi.model.quant import pack_nibbles, unpack_int4

__all__ = [
    "CONFIGS",
    "GLU_GROUP",
    "TABLE",
    "config_for",
    "config_valid",
    "glu_interleave",
    "indexed_gemm",
    "load_extension",
    "repack",
    "unrepack",
]

# glu_interleave's group: the gate_up weights' rows are stored as [gate 32 j .. + 31, up 32 j .. + 31] per n64 block,
# so a CTA of the GEMM holds both halves of its outputs and its epilogue writes SiLU(gate) * up (indexed_gemm's glu).
GLU_GROUP = 32

# (NT, KW, S) launch configurations compiled into the extension: NT 16-row N tiles per CTA, KW warps splitting K,
# S k64 chunks per warp in its shared-memory ring (S - 1 in flight).
CONFIGS = (
    (4, 4, 4),
    (4, 2, 4),
    (8, 1, 4),
    (8, 2, 4),
    (4, 4, 3),
    (4, 2, 3),
    (8, 2, 3),
    (8, 4, 3),
    (8, 1, 3),
    (4, 4, 2),
    (8, 2, 2),
)
# config_for's fallback for a GEMM shape with no pick in TABLE: a constant (the first of CONFIGS), not a measurement.
DEFAULT_CONFIG = (4, 4, 4)


# Measured picks, GEMM [N, K] -> ((m_max, config), ...): the first entry whose m_max (None: no bound) is at least the
# step's expected local pairs. From kimi/kernels/tuning/moe_w4a16_cuda.json (its tuner and measurements there), read
# once at import and applied on every GPU the kernel runs on.
def _load_table() -> dict[tuple[int, int], tuple[tuple[int | None, tuple[int, int, int]], ...]]:
    picks: dict[tuple[int, int], list[tuple[int | None, tuple[int, int, int]]]] = {}
    for e in tuning.load("moe_w4a16_cuda").entries:
        c = e.config
        picks.setdefault((e.n, e.k), []).append((e.m_max, (int(c["nt"]), int(c["kw"]), int(c["s"]))))
    return {key: tuple(v) for key, v in picks.items()}


TABLE = _load_table()


def config_valid(cfg: tuple[int, ...], n: int, k: int) -> bool:
    """Whether configuration cfg = (NT, KW, S) can run a GEMM [n, k]: n % 64 == k % 64 == 0, NT divides n / 16 and
    KW divides k / 64."""
    return cfg in CONFIGS and n % 64 == 0 and k % 64 == 0 and (n // 16) % cfg[0] == 0 and (k // 64) % cfg[1] == 0


def config_for(n: int, k: int, m: int | None = None) -> tuple[int, int, int]:
    """The launch configuration for a GEMM [n, k] at m expected local pairs (None: the smallest steps): TABLE's pick,
    else DEFAULT_CONFIG, else the first of CONFIGS that can run the shape (`config_valid`). Raises ValueError when
    none can."""
    picks = TABLE.get((n, k), ())
    pick = next((c for m_max, c in picks if m is None or m_max is None or m <= m_max), None)
    for cfg in [pick, DEFAULT_CONFIG, *CONFIGS]:
        if cfg is not None and config_valid(cfg, n, k):
            return cfg
    raise ValueError(
        f"no configuration of kimi's CUDA W4A16 GEMM runs [{n}, {k}]: it needs N % 64 == 0, K % 64 == 0 "
        f"and a config of {CONFIGS} whose NT divides N / 16 and KW divides K / 64"
    )


def _pos_index(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row [4, 32, 8], k [1, 32, 8]): the weight row (in an n64 block) and input k (in a k16 step) of nibble p of
    lane L's word c (see the module docstring)."""
    c = torch.arange(4, device=device).view(4, 1, 1)
    lane = torch.arange(32, device=device).view(1, 32, 1)
    p = torch.arange(8, device=device).view(1, 1, 8)
    g, t = lane // 4, lane % 4
    row = 16 * c + g + 8 * ((p >> 1) & 1)
    k = 2 * t + 8 * (p & 1) + (p >> 2)
    return row, k


def _check_packed(packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int, int]:
    if packed.dim() != 3 or packed.dtype != torch.int32:
        raise ValueError(f"repack: packed must be [E, N, K/8] int32, got {tuple(packed.shape)} {packed.dtype}")
    E, N, k8 = packed.shape
    K = k8 * 8
    if N % 64 or K % 64:
        raise ValueError(f"repack: need N % 64 == 0 and K % 64 == 0, got N={N}, K={K}")
    if tuple(scale.shape) != (E, N, K // 32):
        raise ValueError(f"repack: scale {tuple(scale.shape)} does not match [E, N, K/32] = {(E, N, K // 32)}")
    return E, N, K


def repack(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors INT4 -> this kernel's layout (module docstring; humming-kernels' layout for 16-bit inputs).

    packed: [E, N, K/8] int32 (nibble j of word w is input 8w + j; value = nibble - 8); scale: [E, N, K/32].
    Returns (weights [E, K/16, 2N] int32, scales [E, K/32, N] bf16), on packed's device.
    Raises ValueError for other shapes or N % 64, K % 64 != 0.
    """
    E, N, K = _check_packed(packed, scale)
    dev = packed.device
    out_w = torch.empty((E, K // 16, N // 64, 32, 4), dtype=torch.int32, device=dev)
    row, k = _pos_index(dev)  # [4, 32, 8], [1, 32, 8]
    for e in range(E):  # one expert at a time: the unpacked values of all experts would be 2x the packed bytes
        q = unpack_int4(packed[e]).reshape(N // 64, 64, K // 16, 16).permute(2, 0, 1, 3)  # [ks, nb, 64 rows, 16 k]
        sel = q[:, :, row, k]  # [ks, nb, 4 words, 32 lanes, 8 nibbles] values in [-8, 7]
        words = pack_nibbles(sel.reshape(-1, 8)).view(K // 16, N // 64, 4, 32)  # nibble p at bits 4p
        out_w[e] = words.transpose(2, 3)  # [ks, nb, 32 lanes, 4 words]
    s = scale.to(torch.bfloat16).transpose(1, 2).reshape(E, K // 32, N // 64, 8, 8)  # [E, grp, nb, i, g]
    out_s = s.transpose(3, 4).reshape(E, K // 32, N).contiguous()  # position 8 g + i = row 8 i + g
    return out_w.view(E, K // 16, 2 * N), out_s


def unrepack(weights: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The dequantised [E, N, K] float32 matrix (each weight rounded to bf16, as `dequant_int4`) that a (weights,
    scales) pair from `repack` encodes, read back through the layout (the inverse of `repack`, for tests)."""
    E, G, N = scales.shape
    K = G * 32
    dev = weights.device
    w = weights.view(E, K // 16, N // 64, 32, 4).transpose(3, 4)  # [E, ks, nb, 4 words, 32 lanes]
    nib = ((w.unsqueeze(-1) >> (4 * torch.arange(8, device=dev, dtype=torch.int32))) & 0xF).float() - 8
    row, k = _pos_index(dev)  # [4, 32, 8], [1, 32, 8]
    vals = torch.empty((E, K // 16, N // 64, 64, 16), dtype=torch.float32, device=dev)
    vals[:, :, :, row, k] = nib
    q = vals.permute(0, 2, 3, 1, 4).reshape(E, N, K)
    s = scales.float().view(E, G, N // 64, 8, 8).transpose(3, 4).reshape(E, G, N).transpose(1, 2)  # [E, N, G]
    return (q * s.repeat_interleave(32, dim=2)).to(torch.bfloat16).float()


def glu_interleave(
    packed: torch.Tensor, scale: torch.Tensor, group: int = GLU_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder the rows of a gate_up weight [E, 2I, ...] (rows [0, I) gate, [I, 2I) up, as the checkpoints store
    them) to [gate 0 .. group-1, up 0 .. group-1, gate group .. 2 group-1, up group .. , ...]: packed [E, 2I, K/8] int32
    and scale [E, 2I, K/32] -> the same shapes, new tensors. The GEMM's outputs then come in the same order:
    `kimi.kernels.triton.fused.silu_mul_rows(..., interleave=group)` reads them, and with group = GLU_GROUP (32, half an
    n64 block) kimi's kernel computes SiLU(gate) * up in its epilogue (`indexed_gemm(..., glu=True)`).
    Raises ValueError when 2I is not a multiple of 2 group or the shapes disagree."""
    if packed.dim() != 3 or scale.dim() != 3 or packed.shape[:2] != scale.shape[:2]:
        raise ValueError(
            f"glu_interleave: packed {tuple(packed.shape)} / scale {tuple(scale.shape)} (want [E, 2I, ...])"
        )
    two_i = packed.shape[1]
    if group <= 0 or two_i % (2 * group):
        raise ValueError(f"glu_interleave: {two_i} rows are not whole pairs of {group}-row gate / up groups")
    rows = glu_rows(two_i // 2, group, packed.device)
    return packed.index_select(1, rows), scale.index_select(1, rows)


def glu_rows(inter: int, group: int, device=None) -> torch.Tensor:
    """[2 inter] int64: the checkpoint row (gate r < inter, up inter + r) at each position of `glu_interleave`'s
    order: position 2 group j + i is gate row group j + i, position 2 group j + group + i is up row group j + i."""
    j = torch.arange(inter // group, device=device).view(-1, 1, 1) * group
    half = torch.tensor([0, inter], device=device).view(1, 2, 1)
    return (j + half + torch.arange(group, device=device).view(1, 1, -1)).reshape(-1)


def load_extension():
    """Build (first use) and import the extension (kimi.kernels.cuda.loader.load: sources
    kimi/kernels/cuda/csrc/moe_w4a16_binding.cpp and kimi/kernels/cuda/csrc/moe_w4a16.cu, cached per torch / CUDA /
    Python version). Raises what torch's extension loader raises when it
    cannot build here (OSError without a CUDA toolkit, RuntimeError on a compile error or without ninja)."""
    from kimi.kernels.cuda.loader import load

    return load("moe_w4a16", ["moe_w4a16_binding.cpp", "moe_w4a16.cu"])


def indexed_gemm(
    x: torch.Tensor,
    weights: torch.Tensor,
    scales: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    top_k: int,
    out: torch.Tensor,
    config: tuple[int, int, int] | None = None,
    pdl: str | None = None,
    glu: bool = False,
    early_weights: bool = False,
    zero_pads: bool = True,
    pdl_mode: str = "early",
) -> torch.Tensor:
    """out[r] = W_{block_expert[r's block]} @ x[r // top_k] for every listed row r (module docstring).

    x: [R, K] bf16, unit last-dim stride; weights / scales: from `repack` ([E, K/16, 2N] int32, [E, K/32, N] bf16,
    contiguous; humming-kernels' transformed INT4 tensors have this layout); sorted_ids: [cap] int32 pair ids grouped
    in blocks of 16 rows of one expert (`kimi.kernels.triton.fused.moe_align_fused(..., 16)`; ids >= out.shape[0] are
    pads); block_expert: [cap / 16] int32; num_padded: [1] int32 (blocks past num_padded / 16 do nothing); out:
    [P, N] bf16 (rows not listed are left as they are). glu: the weights' rows are in `glu_interleave`'s order (group
    GLU_GROUP) and out is [P, N/2]: out[r, 32 j + i] = silu(y[64 j + i]) * y[64 j + 32 + i] of the GEMM's y = W x (y
    and the SiLU rounded to bf16 first, as `kimi.kernels.triton.fused.silu_mul_rows` rounds). config: (NT, KW, S) of
    CONFIGS (default: `config_for(N, K)`, TABLE's pick for the smallest steps).
    pdl: "early" (the next kernel may launch right after this one's wait), "late" (after its main loop) or "off";
    default: pdl_mode where kimi.kernels.triton.pdl.enabled, else "off". early_weights: the caller guarantees that the
    align which wrote sorted_ids / block_expert / num_padded is not the kernel directly ahead on the stream and that
    every kernel between the two waits for its own predecessor before letting the next one launch
    (kimi.kernels.triton.pdl's contract; the gate_up GEMM, silu_mul_rows), so the align is complete when this kernel
    starts. Each CTA then reads its block's expert and issues its first S - 1 chunks of weights and scales before its
    griddepcontrol.wait, and an empty block exits without waiting; the outputs are the same. zero_pads: the pad rows'
    inputs are zeros (cp.async's zero fill, no read) instead of token 0's row; the outputs are the same (zero operands
    toggle fewer bits in the tensor cores of a step at the power cap). No host synchronisation: graph-capturable.
    Raises ValueError for mismatched shapes / dtypes, a config that cannot run the shape, more than 65535 blocks;
    RuntimeError (from the extension) for tensors on another device.
    """
    if scales.dim() != 3 or weights.dim() != 3:
        raise ValueError(
            f"indexed_gemm: weights {tuple(weights.shape)} / scales {tuple(scales.shape)} (want "
            "[E, K/16, 2N] and [E, K/32, N])"
        )
    E, G, N = scales.shape
    K = G * 32
    if tuple(weights.shape) != (E, K // 16, 2 * N) or weights.dtype != torch.int32 or scales.dtype != torch.bfloat16:
        raise ValueError(
            f"indexed_gemm: weights {tuple(weights.shape)} {weights.dtype}, scales {tuple(scales.shape)} "
            f"{scales.dtype} (want [E, K/16, 2N] int32 and [E, K/32, N] bf16)"
        )
    if x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or x.shape[-1] != K or x.stride(-1) != 1:
        raise ValueError(f"indexed_gemm: x {tuple(x.shape)} {x.dtype} (want [R, {K}] bf16, unit stride)")
    if x.data_ptr() % 16 or x.stride(0) % 8:
        raise ValueError("indexed_gemm: x rows must start at 16-byte boundaries (16-byte async copies)")
    n_out = N // 2 if glu else N
    if out.shape[-1] != n_out or out.stride(-1) != 1 or out.stride(0) % 2 or out.data_ptr() % 4:
        raise ValueError(f"indexed_gemm: out {tuple(out.shape)} (want [P, {n_out}] bf16, unit stride)")
    if sorted_ids.dtype != torch.int32 or block_expert.dtype != torch.int32 or num_padded.dtype != torch.int32:
        raise ValueError("indexed_gemm: sorted_ids, block_expert and num_padded must be int32")
    if sorted_ids.numel() != 16 * block_expert.numel():
        raise ValueError(f"indexed_gemm: {sorted_ids.numel()} sorted ids for {block_expert.numel()} blocks of 16")
    cfg = tuple(config) if config is not None else config_for(N, K)
    if not config_valid(cfg, N, K):
        raise ValueError(
            f"indexed_gemm: config {cfg} cannot run [{N}, {K}] (CONFIGS: {CONFIGS}; NT must divide "
            f"{N // 16}, KW must divide {K // 64})"
        )
    if block_expert.numel() > 65535:
        raise ValueError(f"indexed_gemm: {block_expert.numel()} align blocks; the grid takes at most 65535")
    if pdl is None:
        from kimi.kernels.triton.pdl import enabled

        pdl = pdl_mode if enabled(x.device) else "off"
    modes = {"off": 0, "early": 1, "late": 2}
    if pdl not in modes:
        raise ValueError(f"indexed_gemm: pdl {pdl!r} not one of {', '.join(modes)}")
    load_extension().indexed_gemm(
        x,
        weights,
        scales,
        sorted_ids,
        block_expert,
        num_padded,
        out,
        int(top_k),
        int(cfg[0]),
        int(cfg[1]),
        int(cfg[2]),
        modes[pdl],
        bool(glu),
        bool(early_weights),
        bool(zero_pads),
    )
    return out

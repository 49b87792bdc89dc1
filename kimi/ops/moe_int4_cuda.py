"""kimi's CUDA W4A16 indexed expert GEMM (csrc/moe_w4a16.cu): the routed experts' GEMMs at decode sizes.

What: y[r] = W_e @ x[r // top_k] for every row r that a MoE align lists (r = a (token, slot) pair id; e the expert
of the 16-row block holding r), with W_e the expert's INT4 group-32 weights, W = (nibble - 8) * scale (bf16 scales,
as Kimi's checkpoints store them; other scale dtypes are rounded to bf16 first). Per group of 32 inputs the
products (nibble - 8) * x are summed in fp32 on the tensor cores (mma.sync m16n8k16, exact products), the group's
scale multiplies that sum in fp32, and the result is rounded once to bf16. So the weights are never rounded:
`kimi.ops.quant.dequant_int4` rounds (nibble - 8) * scale to bf16, and the two differ by that rounding (relative
at most 2^-9 per weight). Rows not listed are not written.

Why: decode streams every touched expert's weights once per step (a few rows per expert), so this GEMM is a read
of the packed weights, and the decode step runs at the H200's 700 W power cap (bench/power_2026-11-30_s14.json:
SM clocks 1.3-2.0 GHz in the step), where each instruction issued per weight costs clock. Per weight the kernel
issues little beyond the conversion: each warp loads 16 bytes per lane per tile (one coalesced 512-byte read per
warp) into shared memory, several chunks in flight, and a LOP3 (plus a shift for three of every four) turns two
nibbles into the bf16 pair (128 + nibble); the MMA multiplies those raw values, an MMA with the constant -136 adds
-136 * (the group's input sum) once per chunk for all tiles, and one FFMA per accumulator applies the scale per
group.

Layout (`repack`, once at load; the design is this project's, from the PTX ISA's mma.m16n8k16 fragment tables):
- inputs are permuted inside each k16 step (a dot product does not depend on the order of its terms): MMA k16
  step j of a k64 chunk, fragment column c = 2 t' + 8 q + e (PTX numbering, t' = the lane's t) reads input
  k0 + 16 j + 4 t + 2 q + e, so steps 0, 1 lie in scale group 2c and steps 2, 3 in group 2c + 1 (the scale can
  multiply a step's MMA result), and a lane's B fragment of step j is 4 consecutive inputs (one 8-byte load);
- weights [E, K/64, N/16, 32, 4] int32 (chunk-major: the N/16 tiles of k64 chunk c are contiguous, so a CTA's
  tiles of a chunk are one contiguous read and its next chunk one pointer step away): for a 16 x 64 tile (16 output
  rows n, 64 inputs k) lane L (g = L // 4, t = L % 4) holds 4 words, word j for k16 step j. A word's 8 nibbles are
  the 8 A-fragment values that lane needs: nibble p (bits 4p..4p+3) = stored nibble of
  W[n0 + g + 8 (p & 1), k0 + 16 j + 4 t + 2 ((p >> 1) & 1) + (p >> 2)]. So (word >> 4i) & 0x000F000F holds
  fragment register i's two values at the low nibble of each 16-bit half, and OR-ing 0x43004300 makes them the
  bf16 numbers 128 + nibble (exact).
- scales [E, K/64, N/16, 8, 4] bf16: for lane group g, (group 2c row g, group 2c row g + 8, group 2c+1 row g,
  group 2c+1 row g + 8) of k64 chunk c: one 8-byte load per lane per chunk.
Requires N % 16 == 0 and K % 64 == 0 (Kimi's experts: 7168 and 2048).

Work split: a CTA of KW warps owns one 16-row block of the align (one expert; up to 16 pairs, one or two n8
halves of the MMA) and NT 16-row tiles of N; its warps split K, each streaming its chunks through a ring of S
shared-memory slots filled by cp.async (S - 1 chunks of weights, scales and activation fragments in flight), and
sum their partials in shared memory at the end. (Measured and not kept: split-K over CTAs, and persistent CTAs that
stream unit after unit without a break: bench/moe_cuda_2026-11-30.json's notes.)
Launched with programmatic dependent launch when `kimi.ops.pdl.enabled` (it waits for the kernel ahead before it
reads anything, then lets the next kernel launch).

The extension is built with torch's extension loader at first use (sources csrc/moe_w4a16.cu and
csrc/moe_w4a16_binding.cpp, sm_90a) and cached under $KIMI_CSRC_CACHE (default ~/.cache/kimi/csrc).
"""

from __future__ import annotations

import os

import torch

from kimi.ops.quant import pack_nibbles, unpack_int4

__all__ = ["repack", "unrepack", "indexed_gemm", "config_for", "config_valid", "CONFIGS", "TABLE", "load_extension"]

# (NT, KW, S) launch configurations compiled into the extension: NT 16-row N tiles per CTA, KW warps splitting K,
# S k64 chunks per warp in its shared-memory ring (S - 1 in flight).
CONFIGS = ((4, 4, 4), (4, 2, 4), (8, 1, 4), (8, 2, 4), (4, 4, 3), (4, 2, 3), (8, 2, 3), (8, 4, 3), (8, 1, 3), (4, 4, 2), (8, 2, 2))
DEFAULT_CONFIG = (4, 4, 4)
# Programmatic dependent launch of the GEMM when kimi.ops.pdl.enabled: "early" lets the next kernel launch right
# after this one's wait, "late" after its main loop, "off" never (tools/bench_decode.py A/Bs them).
PDL_MODE = os.environ.get("KIMI_MOE_CUDA_PDL", "early")
# Measured picks (tools/bench_moe_cuda.py): GEMM [N, K] -> config, at every batch size. From two sweeps
# (bench/moe_cuda_2026-11-30.json, at 64 and 256 MoE tokens, and the sweep before it, in its notes): the
# configurations within a few % of the best in both, at both sizes. (An (8, 1, 3) pick for gate_up above 64 pairs
# was best in one sweep and 24% slower in the other.)
TABLE: dict[tuple[int, int], tuple[int, int, int]] = {
    (4096, 7168): (4, 4, 4),  # gate_up
    (7168, 2048): (8, 2, 2),  # down
}


def config_valid(cfg: tuple[int, int, int], n: int, k: int) -> bool:
    """Whether configuration cfg = (NT, KW, S) can run a GEMM [n, k]: NT divides n / 16 and KW divides k / 64."""
    return cfg in CONFIGS and (n // 16) % cfg[0] == 0 and (k // 64) % cfg[1] == 0


def config_for(n: int, k: int) -> tuple[int, int, int]:
    """The launch configuration for a GEMM [n, k]: TABLE's pick, else DEFAULT_CONFIG, else the first of CONFIGS that
    can run the shape (`config_valid`). Raises ValueError when none can."""
    for cfg in [TABLE.get((n, k)), DEFAULT_CONFIG, *CONFIGS]:
        if cfg is not None and n % 16 == 0 and k % 64 == 0 and config_valid(cfg, n, k):
            return cfg
    raise ValueError(f"no configuration of kimi's CUDA W4A16 GEMM runs [{n}, {k}]: it needs N % 16 == 0, K % 64 == 0 "
                     f"and a config of {CONFIGS} whose NT divides N / 16 and KW divides K / 64")


def _pos_index(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row [1, 32, 8], k [4, 32, 8]): the weight row (in a 16-row tile) and input k (in a k64 chunk) of nibble p of
    lane L's word j (see the module docstring)."""
    lane = torch.arange(32, device=device).view(1, 32, 1)
    p = torch.arange(8, device=device).view(1, 1, 8)
    j = torch.arange(4, device=device).view(4, 1, 1)
    g, t = lane // 4, lane % 4
    row = g + 8 * (p & 1)
    k = 16 * j + 4 * t + 2 * ((p >> 1) & 1) + (p >> 2)
    return row, k


def repack(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors INT4 -> this kernel's layout (module docstring).

    packed: [E, N, K/8] int32 (nibble j of word w is input 8w + j; value = nibble - 8); scale: [E, N, K/32].
    Returns (weights [E, K/64, N/16, 32, 4] int32, scales [E, K/64, N/16, 8, 4] bf16), on packed's device.
    Raises ValueError for other shapes or N % 16, K % 64 != 0.
    """
    if packed.dim() != 3 or packed.dtype != torch.int32:
        raise ValueError(f"repack: packed must be [E, N, K/8] int32, got {tuple(packed.shape)} {packed.dtype}")
    E, N, k8 = packed.shape
    K = k8 * 8
    if N % 16 or K % 64:
        raise ValueError(f"repack: need N % 16 == 0 and K % 64 == 0, got N={N}, K={K}")
    if tuple(scale.shape) != (E, N, K // 32):
        raise ValueError(f"repack: scale {tuple(scale.shape)} does not match [E, N, K/32] = {(E, N, K // 32)}")
    dev = packed.device
    out_w = torch.empty((E, K // 64, N // 16, 32, 4), dtype=torch.int32, device=dev)
    row, k = _pos_index(dev)  # [1, 32, 8], [4, 32, 8]
    row = row.expand(4, 32, 8)
    for e in range(E):  # one expert at a time: the unpacked values of all experts would be 2x the packed bytes
        q = unpack_int4(packed[e]).reshape(N // 16, 16, K // 64, 64).permute(0, 2, 1, 3)  # [nt, kc, 16 rows, 64 k]
        sel = q[:, :, row, k]  # [nt, kc, 4 words, 32 lanes, 8 nibbles] values in [-8, 7]
        words = pack_nibbles(sel.reshape(-1, 8)).view(N // 16, K // 64, 4, 32)  # nibble p at bits 4p
        out_w[e] = words.permute(1, 0, 3, 2)  # [kc, nt, 32 lanes, 4 words]
    s = scale.to(torch.bfloat16).reshape(E, N // 16, 2, 8, K // 64, 2)  # [E, nt, half, g, kc, grp]
    out_s = s.permute(0, 4, 1, 3, 5, 2).reshape(E, K // 64, N // 16, 8, 4).contiguous()  # (grp, half) order
    return out_w.contiguous(), out_s


def unrepack(weights: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The dequantised [E, N, K] float32 matrix a (weights, scales) pair from `repack` encodes, read back through
    the fragment layout the kernel uses (the inverse of `repack`, for tests)."""
    E, kc, nt = weights.shape[:3]
    N, K = nt * 16, kc * 64
    dev = weights.device
    weights, scales = weights.transpose(1, 2), scales.transpose(1, 2)  # [E, nt, kc, ...]
    row, k = _pos_index(dev)
    row = row.expand(4, 32, 8)
    w = weights.transpose(3, 4)  # [E, nt, kc, 4 words, 32 lanes]
    nib = ((w.unsqueeze(-1) >> (4 * torch.arange(8, device=dev, dtype=torch.int32))) & 0xF).float() - 8
    s6 = scales.float().reshape(E, nt, kc, 8, 2, 2)  # [E, nt, kc, g, grp, half]
    g = row % 8  # [4, 32, 8] lane group of the row
    sv = s6[:, :, :, g, k // 32, row // 8]  # [E, nt, kc, 4, 32, 8]
    out = torch.empty((E, nt, kc, 16, 64), dtype=torch.float32, device=dev)
    out[:, :, :, row, k] = (nib * sv).to(torch.bfloat16).float()
    return out.permute(0, 1, 3, 2, 4).reshape(E, N, K)


def load_extension():
    """Build (first use) and import the extension (kimi.ops.cuda_ext.load: sources csrc/moe_w4a16_binding.cpp and
    csrc/moe_w4a16.cu, cached per torch / CUDA / Python version). Raises what torch's extension loader raises when it
    cannot build here (OSError without a CUDA toolkit, RuntimeError on a compile error or without ninja)."""
    from kimi.ops.cuda_ext import load

    return load("moe_w4a16", ["moe_w4a16_binding.cpp", "moe_w4a16.cu"])


def indexed_gemm(x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, sorted_ids: torch.Tensor,
                 block_expert: torch.Tensor, num_padded: torch.Tensor, top_k: int, out: torch.Tensor,
                 config: tuple[int, int, int] | None = None, pdl: str | None = None) -> torch.Tensor:
    """out[r] = W_{block_expert[r's block]} @ x[r // top_k] for every listed row r (module docstring).

    x: [R, K] bf16, unit last-dim stride; weights / scales: from `repack` ([E, K/64, N/16, 32, 4] int32,
    [E, K/64, N/16, 8, 4] bf16); sorted_ids: [cap] int32 pair ids grouped in blocks of 16 rows of one expert
    (`kimi.ops.fused.moe_align_fused(..., 16)`; ids >= out.shape[0] are pads); block_expert: [cap / 16] int32;
    num_padded: [1] int32 (blocks past num_padded / 16 do nothing); out: [P, N] bf16 (rows not listed are left as
    they are). config: (NT, KW, S) of CONFIGS (default: `config_for(N, K)`). pdl: "early",
    "late" or "off" (default PDL_MODE where kimi.ops.pdl.enabled, else "off"). No host synchronisation: graph-capturable.
    Raises ValueError for mismatched shapes / dtypes, a config that cannot run the shape, more than 65535 blocks;
    RuntimeError (from the extension) for tensors on another device.
    """
    E, kc, nt = weights.shape[:3]
    N, K = nt * 16, kc * 64
    if x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or x.shape[-1] != K or x.stride(-1) != 1:
        raise ValueError(f"indexed_gemm: x {tuple(x.shape)} {x.dtype} (want [R, {K}] bf16, unit stride)")
    if x.data_ptr() % 16 or x.stride(0) % 8:
        raise ValueError("indexed_gemm: x rows must start at 16-byte boundaries (16-byte async copies)")
    if out.shape[-1] != N or out.stride(-1) != 1 or out.stride(0) % 2 or out.data_ptr() % 4:
        raise ValueError(f"indexed_gemm: out {tuple(out.shape)} (want [P, {N}] bf16, unit stride)")
    if sorted_ids.dtype != torch.int32 or block_expert.dtype != torch.int32 or num_padded.dtype != torch.int32:
        raise ValueError("indexed_gemm: sorted_ids, block_expert and num_padded must be int32")
    if sorted_ids.numel() != 16 * block_expert.numel():
        raise ValueError(f"indexed_gemm: {sorted_ids.numel()} sorted ids for {block_expert.numel()} blocks of 16")
    cfg = tuple(config) if config is not None else config_for(N, K)
    if not config_valid(cfg, N, K):
        raise ValueError(f"indexed_gemm: config {cfg} cannot run [{N}, {K}] (CONFIGS: {CONFIGS}; NT must divide "
                         f"{N // 16}, KW must divide {K // 64})")
    if block_expert.numel() > 65535:
        raise ValueError(f"indexed_gemm: {block_expert.numel()} align blocks; the grid takes at most 65535")
    if pdl is None:
        from kimi.ops.pdl import enabled

        pdl = PDL_MODE if enabled(x.device) else "off"
    modes = {"off": 0, "early": 1, "late": 2}
    if pdl not in modes:
        raise ValueError(f"indexed_gemm: pdl {pdl!r} not one of {', '.join(modes)}")
    load_extension().indexed_gemm(x, weights, scales, sorted_ids, block_expert, num_padded, out, int(top_k),
                                  int(cfg[0]), int(cfg[1]), int(cfg[2]), modes[pdl])
    return out

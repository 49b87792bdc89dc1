"""L2 prefetch of weights while the decode attention runs (Triton, Hopper bulk prefetches).

Why: FlashInfer's MLA decode kernel reads its KV at a fraction of HBM bandwidth (at 32 sequences x 2k context
on an H200, ~75 MB in ~50 us: ~1.5 of ~4.2 TB/s; session 19's timeline). The two GEMMs right after it in the
layer, o = o_lat @ W_UV^T per head (8.4 MB of bf16 weights) and o_proj (117 MB), are streams over their weights.
Their first bytes can come from HBM while the attention leaves it idle: one small kernel just before the
attention asks the L2 to fetch W_UV and the first part of every o_proj row, and the GEMMs then read that part
from L2 instead of HBM.

How: `prefetch_before_attention(w_uv, o_proj)` launches `_l2_prefetch_kernel` over two regions, each a set of
byte ranges ("rows"): W_UV whole, as CHUNK_BYTES rows; o_proj's first O_PROJ_FRACTION of each of its rows (its
K range; every program of o_proj's GEMM streams all of K for a slab of rows, so each program then starts on L2
hits, and the GEMM's slowest program gains as much as its fastest). Each range is one
`cp.async.bulk.prefetch.L2.global` (PTX ISA 8.0, sm_90): the copy engine fetches it into L2, with no completion
to wait for and no register or shared-memory use, so the kernel's programs only issue and exit.
With EVICT_LAST the prefetches carry an L2::evict_last cache policy (`createpolicy.fractional`), so the
attention's stream of KV lines (evict_normal) evicts other lines first; otherwise they are plain prefetches.

Order: the kernel is launched with PDL (kimi.ops.pdl) after the W_UK absorption GEMM; it issues its prefetches
before `griddepcontrol.wait` (weights only, which no kernel of a step writes), then waits for the kernel ahead and
releases the next one. FlashInfer's attention is launched without PDL, so it starts once this kernel (and thus
the GEMM ahead) has completed. No data changes: the outputs are bit-equal with and without the prefetch.

Switch: `ATTN_PREFETCH` (module attribute, read at each call, so set it before CUDA-graph capture): None for
off, else (O_PROJ_FRACTION, EVICT_LAST). Off under Triton's CPU interpreter (no bulk prefetch there), on CPU
tensors and before sm_90.
"""

from __future__ import annotations

import torch

from kimi.ops import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None
    tl = None

__all__ = ["ATTN_PREFETCH", "CHUNK_BYTES", "prefetch_before_attention", "prefetch_regions", "region_rows"]

# None: off; else (fraction of each o_proj row's bytes, evict_last): see the module docstring
ATTN_PREFETCH: tuple[float, bool] | None = None
CHUNK_BYTES = 8192  # bytes per prefetch of a contiguous tensor (W_UV): spread over many programs' copy engines
ROWS_PER_PROGRAM = 64  # prefetches issued per program (one per thread of its two warps)

if triton is not None:
    from kimi.ops.pdl import wait_and_release

    @triton.jit
    def _issue(base, rows, pitch, nbytes, EVICT_LAST: tl.constexpr):
        """One bulk L2 prefetch of nbytes at base + row * pitch (bytes) for each row of `rows` [R] (int64)."""
        p = base.to(tl.pointer_type(tl.int8)) + rows * pitch  # [R] byte pointers
        size = tl.full(rows.shape, 0, tl.int32) + nbytes
        if EVICT_LAST:
            tl.inline_asm_elementwise(
                "{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
                "=r,l,r", [p, size], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
                "=r,l,r", [p, size], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _l2_prefetch_kernel(a_ptr, a_rows, a_pitch, a_bytes, b_ptr, b_rows, b_pitch, b_bytes, a_programs,
                            ROWS: tl.constexpr, EVICT_LAST: tl.constexpr, PDL: tl.constexpr = False):
        """Programs [0, a_programs) prefetch rows of region a, the rest rows of region b (ROWS each; rows past a
        region's last are clamped to it: a repeated prefetch is harmless). Pitches and sizes are in bytes."""
        pid = tl.program_id(0)
        r = tl.arange(0, ROWS)
        if pid < a_programs:
            rows = tl.minimum(pid * ROWS + r, a_rows - 1).to(tl.int64)
            _issue(a_ptr, rows, a_pitch, a_bytes, EVICT_LAST)
        else:
            rows = tl.minimum((pid - a_programs) * ROWS + r, b_rows - 1).to(tl.int64)
            _issue(b_ptr, rows, b_pitch, b_bytes, EVICT_LAST)
        wait_and_release(PDL)


def region_rows(t: torch.Tensor, fraction: float | None = None) -> tuple[int, int, int]:
    """The byte ranges of one prefetch region as (rows, pitch bytes, bytes per row).

    fraction None: all of the contiguous tensor t, in CHUNK_BYTES rows when its size is a multiple of them, else as
    one row. fraction f in (0, 1]: the first
    f of each row of the 2-D tensor t (unit last stride), rounded down to 16 bytes (at least 16).
    Raises ValueError for a layout this cannot describe (non-contiguous whole tensor, 3-D+ with a fraction,
    a row pitch or base address not a multiple of 16 bytes, a fraction outside (0, 1])."""
    es = t.element_size()
    if t.data_ptr() % 16:
        raise ValueError("l2_prefetch: the tensor's address is not 16-byte aligned")
    if fraction is None:
        if not t.is_contiguous():
            raise ValueError("l2_prefetch: a whole-tensor region must be contiguous")
        n = t.numel() * es
        if n % 16:
            raise ValueError(f"l2_prefetch: {n} bytes is not a multiple of 16")
        if n % CHUNK_BYTES == 0:
            return n // CHUNK_BYTES, CHUNK_BYTES, CHUNK_BYTES
        return 1, n, n
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"l2_prefetch: fraction must be in (0, 1], got {fraction}")
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"l2_prefetch: a row region needs a 2-D tensor with unit last stride, got "
                         f"{tuple(t.shape)} strides {t.stride()}")
    pitch = t.stride(0) * es
    if pitch % 16:
        raise ValueError(f"l2_prefetch: row pitch {pitch} bytes is not a multiple of 16")
    nbytes = max(16, int(t.shape[1] * es * fraction) // 16 * 16)
    return t.shape[0], pitch, nbytes


def prefetch_regions(a: torch.Tensor, a_rows: tuple[int, int, int], b: torch.Tensor, b_rows: tuple[int, int, int],
                     evict_last: bool) -> None:
    """Launch the prefetch of two regions (tensors and their `region_rows`) on the current stream. CUDA tensors on
    an sm_90+ device only; raises ValueError otherwise."""
    if triton is None or not a.is_cuda or not b.is_cuda or a.device != b.device:
        raise ValueError("l2_prefetch: both tensors must be CUDA tensors on one device (and Triton installed)")
    if torch.cuda.get_device_capability(a.device)[0] < 9:
        raise ValueError("l2_prefetch: bulk L2 prefetches need sm_90 or newer")
    R = ROWS_PER_PROGRAM
    a_prog = -(-a_rows[0] // R)
    grid = (a_prog + -(-b_rows[0] // R),)
    kw = pdl.launch_kwargs(a.device)
    _l2_prefetch_kernel[grid](
        a, a_rows[0], a_rows[1], a_rows[2], b, b_rows[0], b_rows[1], b_rows[2], a_prog,
        ROWS=R, EVICT_LAST=evict_last, num_warps=2, **kw)


def prefetch_before_attention(w_uv: torch.Tensor, o_proj) -> bool:
    """With ATTN_PREFETCH set: prefetch W_UV (whole) and the first ATTN_PREFETCH[0] of each o_proj row into L2
    (see the module docstring). w_uv: [H, V, L] bf16 contiguous; o_proj: the [D, H * V] bf16 weight (anything
    else, e.g. an FP8 layer, and the call does nothing). Returns whether a kernel was launched."""
    cfg = ATTN_PREFETCH
    if (cfg is None or triton is None or not w_uv.is_cuda or not isinstance(o_proj, torch.Tensor)
            or o_proj.dim() != 2 or not pdl.enabled(w_uv.device)):
        return False
    fraction, evict_last = cfg
    prefetch_regions(w_uv, region_rows(w_uv), o_proj, region_rows(o_proj, fraction), evict_last)
    return True

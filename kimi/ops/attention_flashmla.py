"""Absorbed-MLA decode through FlashMLA's dense paged kernel, as shipped compiled in the `sglang-kernel` wheel.

kimi does not build FlashMLA: it loads the `flashmla_ops.abi3.so` of an installed `sglang-kernel` package (the
library file only: the package's `__init__`, which loads all of its other kernels, is not imported) and calls the
two operators it registers, `torch.ops.sgl_kernel.get_mla_decoding_metadata` (the tile schedule: a small device
kernel over the context lengths) and `torch.ops.sgl_kernel.fwd_kvcache_mla` (split-KV attention plus the merge of
the splits). The wheel's build must match the torch in use: sglang-kernel 0.4.6 is built for torch 2.11 and CUDA 13
(SGLANG_KERNEL_VERSION, what `make wheelhouse` downloads); `available()` says whether the library loaded.

Math (the same as kimi.ops.attention.mla_decode_ref): per request b and head h, over the cached tokens j <
seq_lens[b] of kimi's latent cache row c_j = [ckv_j (L) | k_pe_j (R)],
    s_j = scale * (q_lat[b, h] . ckv_j + q_pe[b, h] . k_pe_j),   o_lat[b, h] = sum_j softmax(s)_j ckv_j,
with the softmax in fp32 and the output in bf16. FlashMLA reads the query as one [L + R] row per head, so the
callers build q_lat and q_pe in one buffer (`GPUMLAAttention`: the absorption GEMM writes its first L columns, the
rope kernel its last R) and the cache is passed as it is, [num_blocks, 64, L + R].

Limits of FlashMLA's dense decode kernel (checked here): bf16 query and cache, 64-token pages, L + R = 576 with
L = 512, int32 lengths and block tables, Hopper (sm90).
"""

from __future__ import annotations

import importlib.util
import os
import threading

import torch

__all__ = ["SGLANG_KERNEL_VERSION", "available", "load_error", "FlashMLADecode", "flashmla_decode_ok"]

# the sglang-kernel release whose flashmla_ops library kimi was measured with (built for torch 2.11 / CUDA 13)
SGLANG_KERNEL_VERSION = "0.4.6"
PAGE_SIZE = 64  # FlashMLA's only page size
HEAD_DIM_QK = 576  # L + R
HEAD_DIM_V = 512  # L

_lock = threading.Lock()
_state: dict = {}


def _library_path() -> str:
    """Path of sglang-kernel's flashmla_ops library ($KIMI_FLASHMLA_LIB overrides). Raises ImportError when
    sglang-kernel is not installed or has no such file."""
    path = os.environ.get("KIMI_FLASHMLA_LIB")
    if path:
        return path
    spec = importlib.util.find_spec("sgl_kernel")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"FlashMLA: the sglang-kernel package is not installed (pip install "
                          f"sglang-kernel=={SGLANG_KERNEL_VERSION})")
    for d in spec.submodule_search_locations:
        p = os.path.join(d, "flashmla_ops.abi3.so")
        if os.path.exists(p):
            return p
    raise ImportError(f"FlashMLA: no flashmla_ops.abi3.so in sgl_kernel at {list(spec.submodule_search_locations)}")


def _load() -> None:
    """Load the library once (thread-safe); later calls return at once. Raises ImportError (with the cause) when
    it cannot be loaded."""
    with _lock:
        if "ok" in _state:
            if not _state["ok"]:
                raise ImportError(_state["error"])
            return
        try:
            path = _library_path()
            if not torch.cuda.is_available():
                raise ImportError("FlashMLA needs CUDA")
            torch.ops.load_library(path)
            torch.ops.sgl_kernel.fwd_kvcache_mla  # noqa: B018 - the operator is registered
            torch.ops.sgl_kernel.get_mla_decoding_metadata  # noqa: B018
        except Exception as e:  # noqa: BLE001 - OSError (ABI / missing symbols), RuntimeError, AttributeError
            _state.update(ok=False, error=f"FlashMLA unavailable: {type(e).__name__}: {e}")
            raise ImportError(_state["error"]) from e
        _state.update(ok=True, path=path)


def available() -> bool:
    """True when sglang-kernel's FlashMLA library is installed and loads in this process (CUDA present)."""
    try:
        _load()
    except ImportError:
        return False
    return True


def load_error() -> str | None:
    """Why the library did not load (None when it did or was not tried)."""
    return _state.get("error")


def flashmla_decode_ok(num_heads: int, kv_lora_rank: int, rope_dim: int, block_size: int, dtype, device) -> bool:
    """Whether FlashMLA's dense decode kernel covers this model and cache: bf16, 64-token pages, a 512 + 64
    latent, 1-128 query heads, an sm90 (Hopper) device, and the library loads."""
    if dtype != torch.bfloat16 or block_size != PAGE_SIZE or kv_lora_rank != HEAD_DIM_V:
        return False
    if kv_lora_rank + rope_dim != HEAD_DIM_QK or not 1 <= num_heads <= 128:
        return False
    dev = torch.device(device)
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev) != (9, 0):
        return False
    return available()


class FlashMLADecode:
    """One decode step of a batch through FlashMLA: `begin_step()` computes the step's tile schedule on the device
    (one small kernel, shared by every layer of the step; inside a CUDA graph it is captured and replayed), then
    `run_joint` per layer.

    seq_lens: [B] int32 device tensor, context lengths including the new token (>= 1); block_tables: [B, W] int32
    device tensor of page ids, W >= ceil(max length / 64), unit last-dim stride; scale: softmax scale; num_heads:
    query heads H. The tensors are read by the kernels when they run (the CUDA-graph runner's static buffers, or an
    eager step's own). Same interface as FlashInferMLA where GPUMLAAttention uses it: `num_rows`, plus
    `joint_q` (the query comes as one [B, H, L + R] buffer) and `run_joint`.

    Raises ImportError when the library cannot be loaded, ValueError on wrong dtypes.
    """

    joint_q = True

    def __init__(self, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, num_heads: int):
        _load()
        if seq_lens.dtype != torch.int32 or block_tables.dtype != torch.int32:
            raise ValueError(f"FlashMLA wants int32 lengths and block tables, got {seq_lens.dtype} / "
                             f"{block_tables.dtype}")
        if block_tables.dim() != 2 or block_tables.shape[0] != seq_lens.shape[0] or block_tables.stride(1) != 1:
            raise ValueError(f"block_tables {tuple(block_tables.shape)} (stride {block_tables.stride()}) for "
                             f"{seq_lens.shape[0]} lengths")
        self.seq_lens = seq_lens
        self.block_tables = block_tables
        self.scale = float(scale)
        self.num_heads = int(num_heads)
        self.num_rows = seq_lens.shape[0]
        self._sched: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin_step(self) -> None:
        """Compute the tile schedule (tile_scheduler_metadata [parts, 8] int32, num_splits [B + 1] int32) from the
        current lengths, on the device. Call once per step before the first layer's run_joint (in a captured
        graph: inside the capture, so every replay recomputes it)."""
        # num_q_tokens_per_head_k = 1 query token x H heads / 1 KV head; h_q (sparse only), fp8, topk: unused
        meta, splits = torch.ops.sgl_kernel.get_mla_decoding_metadata.default(
            self.seq_lens, self.num_heads, 1, None, False, None)
        self._sched = (meta, splits)

    def run_joint(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, L + R] bf16 (q_lat then q_pe per head, contiguous), kv_cache [num_blocks, 64, L + R] bf16
        contiguous -> o_lat [B, H, L] bf16 (a new tensor, or written into `out` when given). Raises RuntimeError
        before begin_step, ValueError on mismatched shapes."""
        if self._sched is None:
            raise RuntimeError("FlashMLADecode.run_joint before begin_step")
        B, H, D = q.shape
        if B != self.num_rows or H != self.num_heads or D != HEAD_DIM_QK or not q.is_contiguous():
            raise ValueError(f"q {tuple(q.shape)} (contiguous {q.is_contiguous()}): want [{self.num_rows}, "
                             f"{self.num_heads}, {HEAD_DIM_QK}] contiguous")
        if kv_cache.dim() != 3 or kv_cache.shape[1:] != (PAGE_SIZE, HEAD_DIM_QK) or not kv_cache.is_contiguous():
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)}: want [num_blocks, {PAGE_SIZE}, {HEAD_DIM_QK}] "
                             f"contiguous")
        meta, splits = self._sched
        o, _lse = torch.ops.sgl_kernel.fwd_kvcache_mla.default(
            q.view(B, 1, H, D), kv_cache.view(kv_cache.shape[0], PAGE_SIZE, 1, D), HEAD_DIM_V, self.seq_lens,
            self.block_tables, self.scale, False, meta, splits, False, None, None, None, None, None, None)
        o = o.view(B, H, HEAD_DIM_V)  # [B, 1, H, L] -> [B, H, L]
        if out is not None:
            out.copy_(o)
            return out
        return o

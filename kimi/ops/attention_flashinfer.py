"""Absorbed MLA decode on the GPU through FlashInfer's `BatchMLAPagedAttentionWrapper` (FA3 backend on Hopper).

Same function as `kimi.ops.attention.mla_decode_ref`: MQA of H query heads over the 576-wide latent cache,
``score[b,h,s] = (q_lat . ckv_s + q_pe . kpe_s) * scale`` over s < seq_lens[b], ``o_lat = softmax(score) @ ckv``.

Cache layout (docs/DESIGN.md "KV cache"): ONE buffer per layer ``kv_cache [num_blocks, block_size, 576]``
(bf16): ``[..., :512]`` is rmsnorm(ckv), ``[..., 512:]`` the roped k_pe. FlashInfer's MLA kernels take
ckv and kpe as separate tensors but read their page / token strides (``ckv_cache.stride(0)``,
``stride(1)`` in csrc/batch_mla_sm90_run.cu of flashinfer 0.6.4), so the two strided *views* of the one
buffer are passed without a copy (tested against the reference in tests/gpu/test_gpu_kernels.py).

Paging: FlashInfer's page = kimi's block (page_size = block_size); per request the pages are
``block_tables[b, :ceil(seq_len / block_size)]``, concatenated into `kv_indices` with `kv_indptr` offsets;
``kv_len_arr = seq_lens``. Decode only: one query row per request (``qo_indptr = arange(B+1)``).

Usage: ``plan(...)`` once per step OUTSIDE CUDA graphs (it reads lengths on the host), then ``run(...)``
(capturable when the wrapper was built with ``use_cuda_graph=True`` and a fixed batch size).
"""

from __future__ import annotations

import torch

__all__ = ["FlashInferMLADecode"]


class FlashInferMLADecode:
    """Paged MLA decode over kimi's [num_blocks, block_size, L+R] latent cache.

    Args:
        num_heads: query heads per rank (64 for Kimi).
        sm_scale: softmax scale (cfg.softmax_scale, qk_head_dim 192-based, see KIMI.md section 3).
        device: CUDA device.
        kv_lora_rank: L (512); rope_dim: R (64).
        backend: FlashInfer MLA backend ("fa3" on Hopper, "fa2", or "auto").
        workspace_bytes: float workspace for split-KV partial results (128 MiB as FlashInfer recommends).
        use_cuda_graph / max_batch / max_pages: fixed buffers for graph capture (then plan() copies into them).
        dtype: q / kv dtype (bf16).
    """

    def __init__(
        self,
        num_heads: int,
        sm_scale: float,
        device: torch.device | str = "cuda",
        kv_lora_rank: int = 512,
        rope_dim: int = 64,
        backend: str = "fa3",
        workspace_bytes: int = 128 * 1024 * 1024,
        use_cuda_graph: bool = False,
        max_batch: int = 0,
        max_pages: int = 0,
        dtype: torch.dtype = torch.bfloat16,
    ):
        import flashinfer.mla  # deferred: optional GPU dependency

        self.num_heads = num_heads
        self.sm_scale = float(sm_scale)
        self.device = torch.device(device)
        self.L = kv_lora_rank
        self.R = rope_dim
        self.dtype = dtype
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        kwargs = {}
        if use_cuda_graph:
            if max_batch <= 0 or max_pages <= 0:
                raise ValueError("use_cuda_graph needs max_batch and max_pages")
            kwargs = dict(
                qo_indptr=torch.empty(max_batch + 1, dtype=torch.int32, device=self.device),
                kv_indptr=torch.empty(max_batch + 1, dtype=torch.int32, device=self.device),
                kv_indices=torch.empty(max_pages, dtype=torch.int32, device=self.device),
                kv_len_arr=torch.empty(max_batch, dtype=torch.int32, device=self.device),
            )
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            self.workspace, use_cuda_graph=use_cuda_graph, backend=backend, **kwargs
        )
        self.block_size = None
        self.batch = None

    def plan(self, seq_lens_cpu: list[int], block_tables: torch.Tensor, block_size: int) -> None:
        """Plan one decode step (host work; call outside CUDA graphs).

        seq_lens_cpu: [B] context lengths including the new token (>= 1).
        block_tables: [B, max_blocks] int (device or host), padded with the null block 0.
        block_size: tokens per block (= FlashInfer page size).
        """
        B = len(seq_lens_cpu)
        if B == 0:
            raise ValueError("plan: empty batch")
        if min(seq_lens_cpu) < 1:
            raise ValueError("plan: seq_lens must be >= 1")
        nblk = [(s + block_size - 1) // block_size for s in seq_lens_cpu]
        if max(nblk) > block_tables.shape[1]:
            raise ValueError("plan: block_tables too narrow for seq_lens")
        dev = self.device
        bt = block_tables.to(dev)
        nblk_t = torch.tensor(nblk, dtype=torch.int64, device=dev)
        mask = torch.arange(bt.shape[1], device=dev)[None, :] < nblk_t[:, None]  # [B, max_blocks]
        kv_indices = bt[mask].to(torch.int32)  # [sum nblk] row-major = per request in order
        kv_indptr = torch.zeros(B + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(torch.tensor(nblk, dtype=torch.int32), 0)
        qo_indptr = torch.arange(B + 1, dtype=torch.int32)
        kv_len = torch.tensor(seq_lens_cpu, dtype=torch.int32)
        self.wrapper.plan(
            qo_indptr.to(dev), kv_indptr.to(dev), kv_indices, kv_len.to(dev),
            self.num_heads, self.L, self.R, block_size, False, self.sm_scale, self.dtype, self.dtype,
        )
        self.block_size = block_size
        self.batch = B

    def plan_from_metadata(self, attn) -> None:
        """Plan from a kimi.ops.attention.AttentionMetadata of a pure decode batch (every query_len == 1)."""
        if any(q != 1 for q in attn.query_lens_cpu):
            raise ValueError("FlashInferMLADecode handles decode only (query_len 1 per sequence)")
        self.plan(list(attn.seq_lens_cpu), attn.block_tables, attn.block_size)

    def run(self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None = None):
        """q_lat [B, H, L], q_pe [B, H, R] (dtype of the plan), kv_cache [num_blocks, block_size, L+R]
        -> o_lat [B, H, L] (q dtype). The cache is passed as two strided views (no copy)."""
        if self.batch is None:
            raise RuntimeError("run before plan")
        if kv_cache.shape[1] != self.block_size or kv_cache.shape[2] != self.L + self.R:
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not match block_size {self.block_size}")
        ckv = kv_cache[..., : self.L]  # [num_blocks, bs, L] view, row stride L+R
        kpe = kv_cache[..., self.L :]  # [num_blocks, bs, R] view
        return self.wrapper.run(q_lat, q_pe, ckv, kpe, out=out)

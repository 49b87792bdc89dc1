// kimi: torch binding of moe_w4a16.cu beside it (kimi_w4a16_indexed_gemm). Built by kimi/kernels/cuda/moe_w4a16.py
// with torch's extension loader; the Python wrapper there documents the arguments.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <cstdio>

extern "C" cudaError_t kimi_w4a16_indexed_gemm(const void* x, int64_t x_stride, const void* wq, const void* wsc,
                                               const int* sorted_ids, const int* block_expert, const int* num_padded,
                                               void* out, int64_t out_stride, int num_rows_out, int top_k, int n, int k,
                                               int num_blocks, int nt, int kw, int stages, int pdl, int glu,
                                               int early_weights, int zero_pads, cudaStream_t stream);

static void indexed_gemm(const torch::Tensor& x, const torch::Tensor& wq, const torch::Tensor& wsc,
                         const torch::Tensor& sorted_ids, const torch::Tensor& block_expert,
                         const torch::Tensor& num_padded, torch::Tensor& out, int64_t top_k, int64_t nt, int64_t kw,
                         int64_t stages, int64_t pdl, bool glu, bool early_weights, bool zero_pads) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "x: [R, K] bf16 CUDA tensor with unit last stride");
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == torch::kBFloat16 && out.dim() == 2 && out.stride(1) == 1,
              "out: [P, N] bf16 CUDA tensor with unit last stride");
  TORCH_CHECK(wsc.scalar_type() == torch::kBFloat16 && wsc.dim() == 3 && wsc.is_contiguous(),
              "wsc: [E, K/32, N] bf16, contiguous");
  TORCH_CHECK(wq.scalar_type() == torch::kInt32 && wq.dim() == 3 && wq.is_contiguous() && wq.size(0) == wsc.size(0) &&
                  wq.size(1) == 2 * wsc.size(1) && wq.size(2) == 2 * wsc.size(2),
              "wq: [E, K/16, 2N] int32, contiguous, matching wsc [E, K/32, N]");
  TORCH_CHECK(sorted_ids.scalar_type() == torch::kInt32 && block_expert.scalar_type() == torch::kInt32 &&
                  num_padded.scalar_type() == torch::kInt32 && sorted_ids.is_contiguous() &&
                  block_expert.is_contiguous(),
              "sorted_ids, block_expert, num_padded: contiguous int32");
  for (const torch::Tensor* t :
       std::initializer_list<const torch::Tensor*>{&wq, &wsc, &sorted_ids, &block_expert, &num_padded, &out})
    TORCH_CHECK(t->is_cuda() && t->device() == x.device(), "every tensor must be on x's device (", x.device(), ")");
  TORCH_CHECK(num_padded.numel() >= 1, "num_padded: [1] int32");
  TORCH_CHECK(top_k >= 1 && out.size(0) <= x.size(0) * top_k,
              "out has more rows than x rows x top_k (ids >= out.size(0) are the pads)");
  const int64_t n = wsc.size(2), k = wsc.size(1) * 32;
  TORCH_CHECK(x.size(1) == k && out.size(1) == (glu ? n / 2 : n),
              "x / out widths do not match the weights (out: N columns, N / 2 with glu)");
  TORCH_CHECK(sorted_ids.numel() == 16 * block_expert.numel(), "sorted_ids must hold 16 ids per block");
  const int num_blocks = static_cast<int>(block_expert.numel());
  if (num_blocks == 0 || out.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t err = kimi_w4a16_indexed_gemm(
      x.data_ptr(), x.stride(0), wq.data_ptr(), wsc.data_ptr(), sorted_ids.data_ptr<int>(),
      block_expert.data_ptr<int>(), num_padded.data_ptr<int>(), out.data_ptr(), out.stride(0),
      static_cast<int>(out.size(0)), static_cast<int>(top_k), static_cast<int>(n), static_cast<int>(k), num_blocks,
      static_cast<int>(nt), static_cast<int>(kw), static_cast<int>(stages), static_cast<int>(pdl), glu ? 1 : 0,
      early_weights ? 1 : 0, zero_pads ? 1 : 0, at::cuda::getCurrentCUDAStream());
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it: a later, unrelated launch check must not see it
    // formatted here: int64 values streamed into TORCH_CHECK's message crash in std::ostream::_M_insert<long> inside
    // a torch extension built this way, so the message is built with snprintf
    char msg[256];
    snprintf(msg, sizeof(msg), "kimi_w4a16_indexed_gemm: %s (nt=%d, kw=%d, stages=%d, n=%d, k=%d)",
             cudaGetErrorString(err), (int)nt, (int)kw, (int)stages, (int)n, (int)k);
    TORCH_CHECK(false, msg);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("indexed_gemm", &indexed_gemm, "kimi W4A16 indexed expert GEMM (kimi/kernels/cuda/csrc/moe_w4a16.cu)");
}

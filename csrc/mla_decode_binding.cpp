// kimi: torch binding of csrc/mla_decode.cu (kimi_mla_decode). Built by kimi/ops/mla_decode_cuda.py with torch's
// extension loader; the Python wrapper there checks and documents the arguments.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

extern "C" cudaError_t kimi_mla_decode(const void* q_lat, int64_t q_lat_sb, int64_t q_lat_sh, const void* q_pe,
                                       int64_t q_pe_sb, int64_t q_pe_sh, const void* kv, int64_t num_blocks,
                                       int64_t kv_sblk, int64_t kv_stok, int page, const int* block_tables,
                                       int64_t bt_sb, const int* seq_lens, void* out, int64_t out_sb,
                                       int64_t out_sh, float* o_part, float* lse, int* done, int batch,
                                       int num_splits, float scale, int pdl, cudaStream_t stream);

static void mla_decode(const torch::Tensor& q_lat, const torch::Tensor& q_pe, const torch::Tensor& kv,
                       const torch::Tensor& block_tables, const torch::Tensor& seq_lens, torch::Tensor& out,
                       const torch::Tensor& workspace, const torch::Tensor& done, int64_t num_splits, double scale,
                       int64_t pdl) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&q_lat, &q_pe, &kv, &out})
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kBFloat16 && t->stride(-1) == 1,
                "q_lat, q_pe, kv, out: bf16 CUDA tensors with unit last stride");
  for (const torch::Tensor* t :
       std::initializer_list<const torch::Tensor*>{&q_pe, &kv, &block_tables, &seq_lens, &out, &workspace, &done})
    TORCH_CHECK(t->is_cuda() && t->device() == q_lat.device(), "every tensor must be on q_lat's device");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  seq_lens.is_contiguous() && block_tables.stride(1) == 1,
              "block_tables [B, W] / seq_lens [B]: int32, unit last stride");
  TORCH_CHECK(workspace.scalar_type() == torch::kFloat32 && workspace.is_contiguous(), "workspace: contiguous fp32");
  const int64_t B = q_lat.size(0), H = q_lat.size(1);
  TORCH_CHECK(workspace.numel() >= (num_splits > 1 ? B * num_splits * H * (q_lat.size(2) + 1) : 0),
              "workspace too small");
  TORCH_CHECK(done.scalar_type() == torch::kInt32 && done.is_contiguous() && (num_splits == 1 || done.numel() >= B),
              "done: contiguous int32 with >= B elements");
  if (B == 0) return;
  const c10::cuda::CUDAGuard guard(q_lat.device());
  float* ws = workspace.numel() ? workspace.data_ptr<float>() : nullptr;
  float* o_part = num_splits > 1 ? ws : nullptr;
  float* lse = num_splits > 1 ? ws + B * num_splits * H * q_lat.size(2) : nullptr;
  const cudaError_t err = kimi_mla_decode(
      q_lat.data_ptr(), q_lat.stride(0), q_lat.stride(1), q_pe.data_ptr(), q_pe.stride(0), q_pe.stride(1),
      kv.data_ptr(), kv.size(0), kv.stride(0), kv.stride(1), static_cast<int>(kv.size(1)),
      block_tables.data_ptr<int>(), block_tables.stride(0), seq_lens.data_ptr<int>(), out.data_ptr(), out.stride(0),
      out.stride(1), o_part, lse, done.data_ptr<int>(), static_cast<int>(B), static_cast<int>(num_splits),
      static_cast<float>(scale), static_cast<int>(pdl), at::cuda::getCurrentCUDAStream());
  if (err != cudaSuccess) cudaGetLastError();  // clear it: a later, unrelated launch check must not see it
  TORCH_CHECK(err == cudaSuccess, "kimi_mla_decode: ", cudaGetErrorString(err), " (B=", B, ", num_splits=",
              num_splits, ")");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mla_decode", &mla_decode, "kimi split-KV MLA decode (csrc/mla_decode.cu)");
}

// kimi: W4A16 indexed expert GEMM for decode-sized batches (Hopper, sm_90a).
//
// out[r, :] = W_e @ x[r / top_k, :] for every pair row r listed by a MoE align (16-row blocks, one expert each),
// W_e = (nibble - 8) * scale (group 32). mma.sync m16n8k16 multiplies the bf16 values 128 + nibble (exact) with the
// inputs in fp32; an MMA of the constant -136 starts each group's sum, so it is that of (nibble - 8) * input; and
// the group's scale multiplies the sum in fp32 (the weights are never rounded to bf16).
// The weight layout is built by kimi/ops/moe_int4_cuda.py:repack (its docstring describes it); the fragment
// positions follow the PTX ISA's tables for mma.m16n8k16 with .bf16 inputs (A row-major, B column-major).
//
// Work split: CTA (blockIdx.x = group of NT 16-row tiles of N, blockIdx.y = align block b) has KW warps; warp w
// takes k64 chunks [w*C/KW, (w+1)*C/KW) of the C = K/64 chunks, for all NT tiles, through a ring of S shared-memory
// slots filled by cp.async (per chunk: NT x 512 contiguous bytes of weights, NT x 64 of scales, the lanes'
// activation fragments), S - 1 chunks in flight. The weights are chunk-major (all tiles of a chunk together), so a
// warp's loads of a chunk are constant offsets from one pointer that steps once per chunk, and the chunk loop is
// unrolled by S so the slot addresses are constants too: the instructions per weight are the dequantisation and
// the MMAs, little else (the decode step runs at the H200's power cap, where issued instructions cost clock).
// Partials are summed across warps in shared memory (the rings' space, after the loop) and written as bf16.
//
// C entry point: kimi_w4a16_indexed_gemm (host launcher; returns a cudaError_t).

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>
#include <type_traits>

namespace {

constexpr int kBlockRows = 16;  // rows (pairs) per align block

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// (w & 0x000F000F) | 0x43004300: two nibbles -> the bf16 pair (128 + lo, 128 + hi), exact.
__device__ __forceinline__ uint32_t nibbles_to_bf16x2(uint32_t w) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "r"(0x000F000Fu), "r"(0x43004300u));
  return r;
}

// D = A B + C: mma.sync m16n8k16, bf16 inputs, fp32 accumulation (C and D may be the same registers).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                               const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// bf16 halves of a 32-bit word as floats (exact)
__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

// Activations are read by every CTA of their block: keep them in L1 (.ca).
__device__ __forceinline__ void cp_async8_l1(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// One warp's ring slot: NT tiles x 32 lanes x 16 bytes of weights, NT x 8 x 8 bytes of scales, the lanes' B
// fragments (x[h][p][lane]: half h, steps 2p and 2p + 1: the lane's inputs 16 j + 4 t .. + 3 of step j, 8 bytes
// each, of its row; 16-byte reads at a 16-byte lane stride, free of bank conflicts).
template <int NT>
struct alignas(16) Slot {
  uint4 w[NT][32];
  uint2 s[NT][8];
  uint4 x[2][2][32];
};

template <int NT, int KW, int S>
__global__ void __launch_bounds__(32 * KW, 1) w4a16_indexed_kernel(
    const __nv_bfloat16* __restrict__ x, int64_t x_stride, const uint4* __restrict__ wq,
    const uint2* __restrict__ wsc, const int* __restrict__ sorted_ids, const int* __restrict__ block_expert,
    const int* __restrict__ num_padded, __nv_bfloat16* __restrict__ out, int64_t out_stride, int num_rows_out,
    int top_k, int n_tiles, int k_chunks, int trigger_late) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int b = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  Slot<NT>* ring = reinterpret_cast<Slot<NT>*>(smem_raw) + warp * S;
  // partial sums reuse the rings after the loop: [KW][NT * 16][17] floats
  float* partial = reinterpret_cast<float*>(smem_raw);

  grid_dependency_wait();  // x, the align's ids and the output rows come from kernels ahead
  if (!trigger_late) launch_dependents();  // else after the main loop (the next kernel then waits less long)
  if (b * kBlockRows >= num_padded[0]) {
    if (trigger_late) launch_dependents();
    return;
  }
  const int e = block_expert[b];
  const int id0 = sorted_ids[b * kBlockRows + g];
  const int id1 = sorted_ids[b * kBlockRows + 8 + g];
  const bool half1 = __any_sync(0xffffffffu, id1 < num_rows_out);  // rows 8..15 hold pairs: second n8 MMA
  // The lane's inputs of row (token) g: 16 j + 4 t .. + 3 of each k16 step j of a chunk. A pad row reads token 0
  // instead: its MMA column is never stored, so what it holds does not matter, and the loop needs no per-row branch.
  const int n_chunks = k_chunks / KW;  // this warp's k64 chunks: [warp * n_chunks, (warp + 1) * n_chunks)
  const int c_begin = warp * n_chunks;
  const __nv_bfloat16* xr[2];  // per half
  xr[0] = x + (int64_t)(id0 < num_rows_out ? id0 / top_k : 0) * x_stride + 4 * t + (int64_t)c_begin * 64;
  xr[1] = x + (int64_t)(id1 < num_rows_out ? id1 / top_k : 0) * x_stride + 4 * t + (int64_t)c_begin * 64;

  // Chunk-major layout: chunk c of expert e holds all N/16 tiles, so this CTA's NT tiles of a chunk are
  // NT x 512 contiguous bytes of weights (tile i at + i * 512) and NT x 64 of scales; each chunk is one
  // pointer step further (n_tiles * 512 and n_tiles * 64 bytes).
  const int tile0 = blockIdx.x * NT;
  const size_t first = ((size_t)e * k_chunks + c_begin) * n_tiles + tile0;  // tile index of (c_begin, tile0)
  const uint4* wp = wq + first * 32 + lane;
  const uint4* sp = reinterpret_cast<const uint4*>(wsc) + first * 4 + lane;  // lanes < 4 NT: 16 of the NT x 64 bytes
  const size_t w_step = (size_t)n_tiles * 32, s_step = (size_t)n_tiles * 4;  // uint4 per chunk

  // h1: std::true_type when rows 8..15 hold pairs (the second n8 half is loaded and multiplied), else false_type
  auto issue = [&](Slot<NT>& sl, auto h1) {  // the next chunk of this warp into slot sl; advances the pointers
#pragma unroll
    for (int i = 0; i < NT; ++i) cp_async16(&sl.w[i][lane], wp + i * 32);
    if (lane < 4 * NT) cp_async16(reinterpret_cast<uint4*>(&sl.s[0][0]) + lane, sp);
    // the lane's inputs 16 j + 4 t .. + 3 of k16 step j (8 bytes each; see Slot), of each half in use
#pragma unroll
    for (int h = 0; h < (decltype(h1)::value ? 2 : 1); ++h)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        cp_async8_l1(reinterpret_cast<uint2*>(&sl.x[h][j >> 1][lane]) + (j & 1), xr[h] + 16 * j);
    wp += w_step;
    sp += s_step;
    xr[0] += 64;
    xr[1] += 64;
  };

  float acc[NT][2][4];
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][h][r] = 0.0f;

  // A fragments of the constant -136 (bf16, exact): an MMA with them adds -136 * (sum of the step's inputs) per
  // token, which turns the products with the raw bf16 values 128 + nibble into products with nibble - 8
  const uint32_t m136[4] = {0xC308C308u, 0xC308C308u, 0xC308C308u, 0xC308C308u};
  const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  auto compute = [&](const Slot<NT>& sl, auto h1) {
    constexpr int NH = decltype(h1)::value ? 2 : 1;  // n8 halves in use
    // B fragments of half h: step j, register q = inputs 16 j + 4 t + 2 q (+1) = word 2 j + q of the lane's 32 bytes
    uint32_t b[2][8];
#pragma unroll
    for (int h = 0; h < NH; ++h) {
      const uint4 lo = sl.x[h][0][lane], hi = sl.x[h][1][lane];
      b[h][0] = lo.x; b[h][1] = lo.y; b[h][2] = lo.z; b[h][3] = lo.w;
      b[h][4] = hi.x; b[h][5] = hi.y; b[h][6] = hi.z; b[h][7] = hi.w;
    }
    // off[grp][h]: -136 * (sum of group grp's 32 inputs) of each token column, in the C fragment's layout; every
    // tile's group sum starts from it (steps 0, 1 are group 2c, steps 2, 3 group 2c + 1)
    float off[2][2][4];
#pragma unroll
    for (int grp = 0; grp < 2; ++grp)
#pragma unroll
      for (int h = 0; h < NH; ++h) {
        mma_bf16_16816(off[grp][h], m136, b[h][4 * grp], b[h][4 * grp + 1], zero);
        mma_bf16_16816(off[grp][h], m136, b[h][4 * grp + 2], b[h][4 * grp + 3], off[grp][h]);
      }
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const uint4 wv = sl.w[i][lane];
      const uint2 sc = sl.s[i][g];  // bf16 (group 2c row g, row g + 8, group 2c+1 row g, row g + 8)
      const float sg[2] = {bf16_lo(sc.x), bf16_lo(sc.y)}, sg8[2] = {bf16_hi(sc.x), bf16_hi(sc.y)};
      const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
      for (int grp = 0; grp < 2; ++grp) {
        float part[2][4];  // sum over the group of (nibble - 8) * input, exact in fp32 up to the MMA's rounding
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const uint32_t w = words[2 * grp + jj];
          uint32_t a[4];
          a[0] = nibbles_to_bf16x2(w);        // row g,     fragment columns 2t, 2t+1: 128 + nibble
          a[1] = nibbles_to_bf16x2(w >> 4);   // row g + 8, columns 2t, 2t+1
          a[2] = nibbles_to_bf16x2(w >> 8);   // row g,     columns 2t+8, 2t+9
          a[3] = nibbles_to_bf16x2(w >> 12);  // row g + 8, columns 2t+8, 2t+9
          const int j = 2 * grp + jj;
#pragma unroll
          for (int h = 0; h < NH; ++h)
            mma_bf16_16816(part[h], a, b[h][2 * j], b[h][2 * j + 1], jj == 0 ? off[grp][h] : part[h]);
        }
        // the group's scale, in fp32: C fragment registers 0, 1 are row g, 2, 3 row g + 8
#pragma unroll
        for (int h = 0; h < NH; ++h) {
          acc[i][h][0] = fmaf(sg[grp], part[h][0], acc[i][h][0]);
          acc[i][h][1] = fmaf(sg[grp], part[h][1], acc[i][h][1]);
          acc[i][h][2] = fmaf(sg8[grp], part[h][2], acc[i][h][2]);
          acc[i][h][3] = fmaf(sg8[grp], part[h][3], acc[i][h][3]);
        }
      }
    }
  };

  // S - 1 chunks in flight; the loop is unrolled by S so every slot index is a constant. Compiled twice, with and
  // without the second half: predicated-off MMAs would still take issue slots.
  auto main_loop = [&](auto h1) {
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
      if (s < n_chunks) issue(ring[s], h1);
      cp_async_commit();
    }
    for (int c0 = 0; c0 < n_chunks; c0 += S) {
#pragma unroll
      for (int s = 0; s < S; ++s) {
        if (c0 + s < n_chunks) {
          cp_async_wait<S - 2>();  // chunk c0 + s has landed (this lane's copies)
          __syncwarp();            // ... and every lane's; every lane is done with the slot read last
          if (c0 + s + S - 1 < n_chunks) issue(ring[(s + S - 1) % S], h1);
          cp_async_commit();
          compute(ring[s], h1);
        }
      }
    }
  };
  if (half1)
    main_loop(std::true_type{});
  else
    main_loop(std::false_type{});
  cp_async_wait<0>();
  if (trigger_late) launch_dependents();
  __syncthreads();  // every warp is done with its ring: reuse it for the partial sums

  // C fragment: c0, c1 = (n g, rows 2t, 2t+1), c2, c3 = (n g + 8, rows 2t, 2t+1); half h adds 8 to the row
  constexpr int kP = kBlockRows + 1;
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* p = partial + ((size_t)warp * NT * 16 + i * 16) * kP;
      p[g * kP + h * 8 + 2 * t] = acc[i][h][0];
      p[g * kP + h * 8 + 2 * t + 1] = acc[i][h][1];
      p[(g + 8) * kP + h * 8 + 2 * t] = acc[i][h][2];
      p[(g + 8) * kP + h * 8 + 2 * t + 1] = acc[i][h][3];
    }
  __syncthreads();
  // sum over warps; thread -> (row r of the block, pair of n columns): bf16x2 stores along n
  constexpr int kPairs = NT * 8;
  for (int idx = threadIdx.x; idx < kBlockRows * kPairs; idx += 32 * KW) {
    const int r = idx / kPairs, np = idx % kPairs;
    const int id = sorted_ids[b * kBlockRows + r];
    if (id >= num_rows_out) continue;
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int w = 0; w < KW; ++w) {
      s0 += partial[((size_t)w * NT * 16 + 2 * np) * kP + r];
      s1 += partial[((size_t)w * NT * 16 + 2 * np + 1) * kP + r];
    }
    *reinterpret_cast<__nv_bfloat162*>(out + (int64_t)id * out_stride + (int64_t)tile0 * 16 + 2 * np) =
        __floats2bfloat162_rn(s0, s1);
  }
}

template <int NT, int KW, int S>
constexpr size_t smem_bytes() {
  constexpr size_t ring = sizeof(Slot<NT>) * KW * S;
  constexpr size_t part = sizeof(float) * KW * NT * 16 * (kBlockRows + 1);
  return ring > part ? ring : part;
}

template <int NT, int KW, int S>
cudaError_t launch(const void* x, int64_t x_stride, const void* wq, const void* wsc, const int* sorted_ids,
                   const int* block_expert, const int* num_padded, void* out, int64_t out_stride, int num_rows_out,
                   int top_k, int n, int k, int num_blocks, int pdl, cudaStream_t stream) {
  const int n_tiles = n / 16, k_chunks = k / 64;
  constexpr size_t smem = smem_bytes<NT, KW, S>();
  // the opt-in above 48 KB of shared memory: a function attribute of each device, set once per device (devices
  // 0..63) and configuration
  static std::atomic<uint64_t> attr_set{0};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const uint64_t bit = dev < 64 ? (uint64_t{1} << dev) : 0;
  if (bit == 0 || !(attr_set.load() & bit)) {
    err = cudaFuncSetAttribute(w4a16_indexed_kernel<NT, KW, S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)smem);
    if (err != cudaSuccess) return err;
    attr_set.fetch_or(bit);
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(n_tiles / NT, num_blocks, 1);
  cfg.blockDim = dim3(32 * KW, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;  // pdl: 0 off, 1 on (trigger the next kernel at the start), 2 on (trigger late)
  return cudaLaunchKernelEx(&cfg, w4a16_indexed_kernel<NT, KW, S>, static_cast<const __nv_bfloat16*>(x), x_stride,
                            static_cast<const uint4*>(wq), static_cast<const uint2*>(wsc), sorted_ids, block_expert,
                            num_padded, static_cast<__nv_bfloat16*>(out), out_stride, num_rows_out, top_k,
                            n_tiles, k_chunks, pdl == 2 ? 1 : 0);
}

}  // namespace

// Host launcher. x: [R, k] bf16 (row stride x_stride elements, rows 16-byte aligned); wq / wsc: repacked weights and
// scales; sorted_ids: [num_blocks * 16] int32; block_expert: [num_blocks] int32; num_padded: [1] int32 (device);
// out: [num_rows_out, n] bf16 (row stride out_stride; listed rows written). (nt, kw, stages) must be an instantiated
// configuration with nt dividing n / 16; n % 16 == 0, k % 64 == 0, kw dividing k / 64; num_blocks <= 65535 (the
// grid's y dimension). pdl: 0 off, 1 on, 2 on with
// the next kernel released after the main loop. Returns cudaErrorInvalidValue for anything else.
extern "C" cudaError_t kimi_w4a16_indexed_gemm(const void* x, int64_t x_stride, const void* wq, const void* wsc,
                                               const int* sorted_ids, const int* block_expert, const int* num_padded,
                                               void* out, int64_t out_stride, int num_rows_out, int top_k, int n,
                                               int k, int num_blocks, int nt, int kw, int stages, int pdl,
                                               cudaStream_t stream) {
  if (n % 16 != 0 || k % 64 != 0 || num_blocks <= 0 || num_blocks > 65535 || top_k <= 0 || nt <= 0 || kw <= 0 ||
      (n / 16) % nt != 0 || (k / 64) % kw != 0 || pdl < 0 || pdl > 2)
    return cudaErrorInvalidValue;
#define KIMI_W4A16_CASE(NT_, KW_, S_)                                                                         \
  if (nt == NT_ && kw == KW_ && stages == S_)                                                                  \
    return launch<NT_, KW_, S_>(x, x_stride, wq, wsc, sorted_ids, block_expert, num_padded, out, out_stride, \
                                num_rows_out, top_k, n, k, num_blocks, pdl, stream);
  KIMI_W4A16_CASE(4, 4, 4)
  KIMI_W4A16_CASE(4, 2, 4)
  KIMI_W4A16_CASE(8, 1, 4)
  KIMI_W4A16_CASE(8, 2, 4)
  KIMI_W4A16_CASE(4, 4, 3)
  KIMI_W4A16_CASE(4, 2, 3)
  KIMI_W4A16_CASE(8, 2, 3)
  KIMI_W4A16_CASE(8, 4, 3)
  KIMI_W4A16_CASE(8, 1, 3)
  KIMI_W4A16_CASE(4, 4, 2)
  KIMI_W4A16_CASE(8, 2, 2)
#undef KIMI_W4A16_CASE
  return cudaErrorInvalidValue;
}

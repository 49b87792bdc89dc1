// kimi: absorbed-MLA decode over the paged latent cache, split-KV, mma.sync (Hopper, sm_90a).
//
// For request b (one query row, H = 64 heads) over its seq_lens[b] cached tokens, token s at
// kv[block_tables[b, s / page], s % page] = [ckv (512) | k_pe (64)]:
//   score[h, s] = (q_lat[b, h] . ckv_s + q_pe[b, h] . kpe_s) * scale,   o_lat[b, h] = softmax_s(score[h]) @ ckv
// with fp32 scores, softmax and accumulation; p rounded to bf16 for the P @ V tensor-core product (as
// FlashAttention does). Same function as kimi.ops.attention.mla_decode_ref. Written for this project from the
// split-KV ("flash-decoding") scheme: FlashAttention's online softmax over KV tiles, the KV range split across CTAs,
// partials merged through their log-sum-exp by a second kernel.
//
// CTA (split, b), 256 threads (8 warps), one query row's 64 heads: walks KV tiles of 32 tokens
// [split * per, min((split + 1) * per, n_tiles)), n_tiles = cdiv(seq_len, 32), per = cdiv(n_tiles, num_splits),
// through a ring of STAGES shared-memory tiles filled by cp.async (tokens past seq_len zero-filled). The query
// [64 x 576] stays in shared memory. Per tile:
//   1. scores: warp w = (head half w & 1, k quarter w >> 1) computes S[32 heads x 32 tokens] over its 144 of the 576
//      dims (mma.m16n8k16, A = q from ldmatrix, B = kv rows from ldmatrix) and stores the fp32 partial;
//   2. softmax: warp w owns heads 8w .. 8w+7, lane j token j: sums the 4 partials, masks tokens >= seq_len, updates
//      the running max / sum (base 2: scale * log2(e) folded in), writes p (bf16) and the rescale factor;
//   3. P @ V: warp w owns output dims 64w .. 64w+63 of all 64 heads (128 fp32 accumulators per lane), rescales them
//      and adds P [64 x 32] @ ckv [32 x 64] (ldmatrix.trans for the value rows).
// Shared-memory rows are padded by 16 bytes so that every ldmatrix phase hits 32 distinct banks.
// num_splits == 1: the CTA writes o_lat (bf16) itself. Else each non-empty split writes o / l (fp32) and
// lse = m + log2(l) to a workspace, and the combine kernel (grid (H / 8, B)) merges the non-empty splits of each
// request with weights 2^(lse_s - max lse). A request with seq_len 0 gets o_lat = 0.
// Both kernels use programmatic dependent launch when asked (wait before the first read, release the next kernel
// after the main loop).
//
// C entry point: kimi_mla_decode (host launcher; returns a cudaError_t).

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include <atomic>

namespace {

constexpr int kH = 64;               // query heads (one CTA holds them all)
constexpr int kL = 512;              // kv_lora_rank: the value width
constexpr int kR = 64;               // rope dims
constexpr int kD = kL + kR;          // 576: the score width
constexpr int kTN = 32;              // tokens per KV tile
constexpr int kRS = kD + 8;          // q / kv row stride in shared memory (elements): 1168 bytes
constexpr int kSPS = kTN + 4;        // score-partial row stride (floats): 144 bytes
constexpr int kPS = kTN + 8;         // p row stride (elements): 80 bytes
constexpr int kKQ = 4;               // k quarters of the score product
constexpr int kThreads = 256;
constexpr int kChunksPerRow = kD / 8;  // 16-byte chunks per 576-wide row
constexpr size_t kQBytes = size_t(kH) * kRS * 2;
constexpr size_t kTileBytes = size_t(kTN) * kRS * 2;
constexpr size_t kSpBytes = size_t(kKQ) * kH * kSPS * 4;
constexpr size_t kPBytes = size_t(kH) * kPS * 2;
constexpr size_t kStatBytes = 3 * kH * 4;

template <int STAGES>
constexpr size_t smem_bytes() {
  return kQBytes + STAGES * kTileBytes + kSpBytes + kPBytes + kStatBytes;
}

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

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes 0 fills the destination with zeros (tokens past the context).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct Args {
  const __nv_bfloat16* q_lat;
  int64_t q_lat_sb, q_lat_sh;
  const __nv_bfloat16* q_pe;
  int64_t q_pe_sb, q_pe_sh;
  const __nv_bfloat16* kv;
  int64_t kv_sblk, kv_stok;
  int page;
  const int* block_tables;
  int64_t bt_sb;
  const int* seq_lens;
  __nv_bfloat16* out;
  int64_t out_sb, out_sh;
  float* o_part;  // [B, S, H, L] fp32 (num_splits > 1)
  float* lse;     // [B, S, H] fp32 (num_splits > 1)
  int num_splits;
  float scale_log2;  // softmax scale * log2(e)
  int pdl;
};

template <int STAGES>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* kv_s = reinterpret_cast<__nv_bfloat16*>(smem + kQBytes);
  float* sp_s = reinterpret_cast<float*>(smem + kQBytes + STAGES * kTileBytes);
  __nv_bfloat16* p_s = reinterpret_cast<__nv_bfloat16*>(smem + kQBytes + STAGES * kTileBytes + kSpBytes);
  float* alpha_s = reinterpret_cast<float*>(smem + kQBytes + STAGES * kTileBytes + kSpBytes + kPBytes);
  float* l_s = alpha_s + kH;
  float* m_s = l_s + kH;

  const int split = blockIdx.x, b = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (a.pdl) grid_dependency_wait();
  const int seq_len = a.seq_lens[b];
  const int n_tiles = seq_len > 0 ? (seq_len + kTN - 1) / kTN : 0;
  const int per = (n_tiles + a.num_splits - 1) / a.num_splits;
  const int t_begin = split * per;
  const int t_end = min(n_tiles, t_begin + per);
  const bool direct = a.num_splits == 1;
  if (t_begin >= t_end) {  // empty split: nothing to merge (the combine counts the non-empty ones)
    if (direct) {          // seq_len 0 without a combine: o_lat = 0
      __nv_bfloat16* o = a.out + b * a.out_sb;
      for (int c = tid; c < kH * kL / 8; c += kThreads)
        *reinterpret_cast<uint4*>(o + (c / (kL / 8)) * a.out_sh + (c % (kL / 8)) * 8) = make_uint4(0, 0, 0, 0);
    }
    if (a.pdl) launch_dependents();
    return;
  }

  // the query row: q_lat | q_pe -> q_s [64][576]
  for (int c = tid; c < kH * kChunksPerRow; c += kThreads) {
    const int h = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    const __nv_bfloat16* src = col < kL ? a.q_lat + b * a.q_lat_sb + h * a.q_lat_sh + col
                                        : a.q_pe + b * a.q_pe_sb + h * a.q_pe_sh + (col - kL);
    cp_async16(q_s + h * kRS + col, src, 16);
  }
  auto load_tile = [&](int tile, int stage) {
    const int tok0 = tile * kTN;
    const int blk = a.block_tables[b * a.bt_sb + tok0 / a.page];
    const __nv_bfloat16* src0 = a.kv + (int64_t)blk * a.kv_sblk + (int64_t)(tok0 % a.page) * a.kv_stok;
    __nv_bfloat16* dst0 = kv_s + stage * kTN * kRS;
    const int valid = seq_len - tok0;
#pragma unroll
    for (int i = 0; i < kTN * kChunksPerRow / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int tok = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      const bool ok = tok < valid;
      cp_async16(dst0 + tok * kRS + col, ok ? src0 + (int64_t)tok * a.kv_stok + col : src0, ok ? 16 : 0);
    }
  };
  load_tile(t_begin, 0);
  cp_async_commit();
#pragma unroll
  for (int s = 1; s < STAGES - 1; ++s) {
    if (t_begin + s < t_end) load_tile(t_begin + s, s);
    cp_async_commit();
  }

  float o[4][8][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mi][ni][e] = 0.f;
  float m_run = -INFINITY, l_run = 0.f;  // softmax state (base 2) of head 8 * warp + lane / 4
  const int hg = warp & 1, kq = warp >> 1;

  for (int tile = t_begin, it = 0; tile < t_end; ++tile, ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile `it` landed for all threads; every warp is done with the previous tile's buffers
    {
      const int nt = tile + STAGES - 1;
      if (nt < t_end) load_tile(nt, (it + STAGES - 1) % STAGES);
      cp_async_commit();
    }
    const __nv_bfloat16* kt = kv_s + (it % STAGES) * kTN * kRS;

    // 1. score partial of this warp: heads hg*32 .. +31, tokens 0..31, dims kq*144 .. +143
    {
      float acc[2][4][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < 9; ++ks) {
        const int k0 = kq * 144 + ks * 16;
        uint32_t qa[2][4], kb[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
          ldmatrix_x4(qa[mi], q_s + (hg * 32 + mi * 16 + (lane & 15)) * kRS + k0 + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < 2; ++np)
          ldmatrix_x4(kb[np], kt + (np * 16 + (lane & 7) + (lane >> 4) * 8) * kRS + k0 + ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
          for (int ni = 0; ni < 4; ++ni)
            mma_bf16_16816(acc[mi][ni], qa[mi], kb[ni >> 1][(ni & 1) * 2], kb[ni >> 1][(ni & 1) * 2 + 1]);
      }
      float* sp = sp_s + kq * kH * kSPS;
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const int row = hg * 32 + mi * 16 + (lane >> 2), col = ni * 8 + (lane & 3) * 2;
          *reinterpret_cast<float2*>(sp + row * kSPS + col) = make_float2(acc[mi][ni][0], acc[mi][ni][1]);
          *reinterpret_cast<float2*>(sp + (row + 8) * kSPS + col) = make_float2(acc[mi][ni][2], acc[mi][ni][3]);
        }
    }
    __syncthreads();

    // 2. online softmax: lane -> head 8 * warp + lane / 4, tokens 8 * (lane % 4) .. + 7
    {
      const int h = warp * 8 + (lane >> 2), t0 = (lane & 3) * 8;
      float s[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] = 0.f;
#pragma unroll
      for (int q = 0; q < kKQ; ++q) {
        const float4 x = *reinterpret_cast<const float4*>(sp_s + (q * kH + h) * kSPS + t0);
        const float4 y = *reinterpret_cast<const float4*>(sp_s + (q * kH + h) * kSPS + t0 + 4);
        s[0] += x.x, s[1] += x.y, s[2] += x.z, s[3] += x.w, s[4] += y.x, s[5] += y.y, s[6] += y.z, s[7] += y.w;
      }
      const int valid = seq_len - tile * kTN - t0;  // tokens t0 + i < valid are in the context
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        s[i] = i < valid ? s[i] * a.scale_log2 : -INFINITY;
        mx = fmaxf(mx, s[i]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run, mx);  // finite: every tile holds a valid token
      float sum = 0.f;
      uint32_t pk[4];
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        const float p0 = exp2f(s[i] - m_new), p1 = exp2f(s[i + 1] - m_new);
        sum += p0 + p1;
        __nv_bfloat162 v = __floats2bfloat162_rn(p0, p1);
        pk[i / 2] = *reinterpret_cast<uint32_t*>(&v);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float alpha = exp2f(m_run - m_new);  // 0 on the first tile (m_run = -inf)
      l_run = l_run * alpha + sum;
      m_run = m_new;
      *reinterpret_cast<uint4*>(p_s + h * kPS + t0) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
      if ((lane & 3) == 0) alpha_s[h] = alpha;
    }
    __syncthreads();

    // 3. o[heads, dims 64 * warp ..] = alpha * o + P @ V
    {
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        const float a0 = alpha_s[mi * 16 + (lane >> 2)], a1 = alpha_s[mi * 16 + (lane >> 2) + 8];
#pragma unroll
        for (int ni = 0; ni < 8; ++ni) {
          o[mi][ni][0] *= a0;
          o[mi][ni][1] *= a0;
          o[mi][ni][2] *= a1;
          o[mi][ni][3] *= a1;
        }
      }
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        uint32_t pa[4][4];
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
          ldmatrix_x4(pa[mi], p_s + (mi * 16 + (lane & 15)) * kPS + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t vb[4];
          ldmatrix_x4_trans(vb, kt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kRS + warp * 64 + np * 16 +
                                    (lane >> 4) * 8);
#pragma unroll
          for (int mi = 0; mi < 4; ++mi) {
            mma_bf16_16816(o[mi][2 * np], pa[mi], vb[0], vb[1]);
            mma_bf16_16816(o[mi][2 * np + 1], pa[mi], vb[2], vb[3]);
          }
        }
      }
    }
  }
  if (a.pdl) launch_dependents();

  if ((lane & 3) == 0) {
    l_s[warp * 8 + (lane >> 2)] = l_run;
    m_s[warp * 8 + (lane >> 2)] = m_run;
  }
  __syncthreads();
  if (direct) {
    __nv_bfloat16* ob = a.out + b * a.out_sb;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      const int r0 = mi * 16 + (lane >> 2), r1 = r0 + 8;
      const float i0 = 1.f / l_s[r0], i1 = 1.f / l_s[r1];
#pragma unroll
      for (int ni = 0; ni < 8; ++ni) {
        const int col = warp * 64 + ni * 8 + (lane & 3) * 2;
        *reinterpret_cast<__nv_bfloat162*>(ob + r0 * a.out_sh + col) =
            __floats2bfloat162_rn(o[mi][ni][0] * i0, o[mi][ni][1] * i0);
        *reinterpret_cast<__nv_bfloat162*>(ob + r1 * a.out_sh + col) =
            __floats2bfloat162_rn(o[mi][ni][2] * i1, o[mi][ni][3] * i1);
      }
    }
  } else {
    float* op = a.o_part + ((int64_t)b * a.num_splits + split) * kH * kL;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      const int r0 = mi * 16 + (lane >> 2), r1 = r0 + 8;
      const float i0 = 1.f / l_s[r0], i1 = 1.f / l_s[r1];
#pragma unroll
      for (int ni = 0; ni < 8; ++ni) {
        const int col = warp * 64 + ni * 8 + (lane & 3) * 2;
        *reinterpret_cast<float2*>(op + r0 * kL + col) = make_float2(o[mi][ni][0] * i0, o[mi][ni][1] * i0);
        *reinterpret_cast<float2*>(op + r1 * kL + col) = make_float2(o[mi][ni][2] * i1, o[mi][ni][3] * i1);
      }
    }
    if (tid < kH) a.lse[((int64_t)b * a.num_splits + split) * kH + tid] = m_s[tid] + log2f(l_s[tid]);
  }
}

// grid (H / 8, B), 256 threads: warp w merges head 8 * blockIdx.x + w, lane the dims 16 * lane .. + 15.
__global__ void __launch_bounds__(256) mla_decode_combine_kernel(const Args a) {
  const int b = blockIdx.y, h = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (a.pdl) grid_dependency_wait();
  const int seq_len = a.seq_lens[b];
  const int n_tiles = seq_len > 0 ? (seq_len + kTN - 1) / kTN : 0;
  const int per = (n_tiles + a.num_splits - 1) / a.num_splits;
  const int used = n_tiles > 0 ? (n_tiles + per - 1) / per : 0;
  const float* lse = a.lse + (int64_t)b * a.num_splits * kH + h;
  float acc[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i] = 0.f;
  float mx = -INFINITY;  // the largest lse of the request's non-empty splits
  for (int s = lane; s < used; s += 32) mx = fmaxf(mx, lse[s * kH]);
  mx = warp_max(mx);
  float wsum = 0.f;
  for (int s0 = 0; s0 < used; s0 += 32) {  // 32 splits at a time: lane s holds split s0 + s's weight
    const int n = min(32, used - s0);
    const float w = lane < n ? exp2f(lse[(s0 + lane) * kH] - mx) : 0.f;
    wsum += warp_sum(w);
    const float* part = a.o_part + (((int64_t)b * a.num_splits + s0) * kH + h) * kL + lane * 16;
#pragma unroll 4
    for (int s = 0; s < n; ++s) {
      const float ws = __shfl_sync(0xffffffffu, w, s);
      const float4* p = reinterpret_cast<const float4*>(part + (int64_t)s * kH * kL);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 v = p[i];
        acc[4 * i] += ws * v.x;
        acc[4 * i + 1] += ws * v.y;
        acc[4 * i + 2] += ws * v.z;
        acc[4 * i + 3] += ws * v.w;
      }
    }
  }
  if (a.pdl) launch_dependents();
  const float inv = used > 0 ? 1.f / wsum : 0.f;
  uint32_t packed[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    __nv_bfloat162 v = __floats2bfloat162_rn(acc[2 * i] * inv, acc[2 * i + 1] * inv);
    packed[i] = *reinterpret_cast<uint32_t*>(&v);
  }
  uint4* dst = reinterpret_cast<uint4*>(a.out + b * a.out_sb + h * a.out_sh + lane * 16);
  dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

cudaError_t launch_ex(const void* fn, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int pdl,
                      const Args& a) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  void* args[] = {const_cast<Args*>(&a)};
  return cudaLaunchKernelExC(&cfg, fn, args);
}

template <int STAGES>
cudaError_t launch(const Args& a, int batch, cudaStream_t stream) {
  constexpr size_t smem = smem_bytes<STAGES>();
  // the opt-in above 48 KB of shared memory: a function attribute of each device, set once per device (0..63)
  static std::atomic<uint64_t> attr_set{0};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const uint64_t bit = dev < 64 ? (uint64_t{1} << dev) : 0;
  if (bit == 0 || !(attr_set.load() & bit)) {
    err = cudaFuncSetAttribute(mla_decode_kernel<STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess) return err;
    attr_set.fetch_or(bit);
  }
  err = launch_ex(reinterpret_cast<const void*>(mla_decode_kernel<STAGES>), dim3(a.num_splits, batch, 1),
                  dim3(kThreads, 1, 1), smem, stream, a.pdl, a);
  if (err != cudaSuccess || a.num_splits == 1) return err;
  return launch_ex(reinterpret_cast<const void*>(mla_decode_combine_kernel), dim3(kH / 8, batch, 1), dim3(256, 1, 1),
                   0, stream, a.pdl, a);
}

}  // namespace

// Host launcher. Shapes: H = 64 heads, L = 512, R = 64 (the only ones compiled). q_lat [B, 64, 512] and q_pe
// [B, 64, 64] bf16 with unit last stride and 16-byte aligned rows (strides in elements); kv [num_blocks, page, 576]
// bf16, unit last stride, page a multiple of 32, 16-byte aligned rows; block_tables [B, >= cdiv(max seq, page)]
// int32 (row stride bt_sb); seq_lens [B] int32; out [B, 64, 512] bf16, unit last stride, 16-byte aligned rows;
// o_part [B, num_splits, 64, 512] fp32 and lse [B, num_splits, 64] fp32 (contiguous; unused when num_splits == 1).
// stages: 2 or 3. pdl: 0 off, 1 on. Returns cudaErrorInvalidValue for anything else.
extern "C" cudaError_t kimi_mla_decode(const void* q_lat, int64_t q_lat_sb, int64_t q_lat_sh, const void* q_pe,
                                       int64_t q_pe_sb, int64_t q_pe_sh, const void* kv, int64_t kv_sblk,
                                       int64_t kv_stok, int page, const int* block_tables, int64_t bt_sb,
                                       const int* seq_lens, void* out, int64_t out_sb, int64_t out_sh, float* o_part,
                                       float* lse, int batch, int num_splits, float scale, int stages, int pdl,
                                       cudaStream_t stream) {
  if (batch <= 0 || batch > 65535 || num_splits <= 0 || num_splits > 65535 || page <= 0 || page % kTN != 0 ||
      pdl < 0 || pdl > 1 || (num_splits > 1 && (o_part == nullptr || lse == nullptr)))
    return cudaErrorInvalidValue;
  Args a;
  a.q_lat = static_cast<const __nv_bfloat16*>(q_lat);
  a.q_lat_sb = q_lat_sb;
  a.q_lat_sh = q_lat_sh;
  a.q_pe = static_cast<const __nv_bfloat16*>(q_pe);
  a.q_pe_sb = q_pe_sb;
  a.q_pe_sh = q_pe_sh;
  a.kv = static_cast<const __nv_bfloat16*>(kv);
  a.kv_sblk = kv_sblk;
  a.kv_stok = kv_stok;
  a.page = page;
  a.block_tables = block_tables;
  a.bt_sb = bt_sb;
  a.seq_lens = seq_lens;
  a.out = static_cast<__nv_bfloat16*>(out);
  a.out_sb = out_sb;
  a.out_sh = out_sh;
  a.o_part = o_part;
  a.lse = lse;
  a.num_splits = num_splits;
  a.scale_log2 = scale * 1.4426950408889634f;
  a.pdl = pdl;
  if (stages == 2) return launch<2>(a, batch, stream);
  if (stages == 3) return launch<3>(a, batch, stream);
  return cudaErrorInvalidValue;
}

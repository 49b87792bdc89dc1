// kimi: W4A16 indexed expert GEMM, warp-specialised and stream-K (Hopper, sm_90a). Same operation, weight layout and
// per-chunk arithmetic as csrc/moe_w4a16.cu (see its header and kimi/ops/moe_int4_cuda.py); another work split.
//
// Why: in csrc/moe_w4a16.cu each warp loads its own 512-byte runs by cp.async, and a CTA owns one (align block, N
// group) for the whole K; at Kimi's down shape (K = 2048) the CTAs are short (5 waves of them at 256 MoE tokens) and
// the GEMM streams at ~80% of the HBM read ceiling (docs/benchmarks.md, session 21). Here a CTA of CW consumer warps
// and one producer warp takes an item = (align block, n-range of NR = CW * NT / 4 n64 blocks); in the weight layout
// [E, K/16, N/64, 32, 4] an item's k16 step is one contiguous run of NR * 512 bytes, so the producer fills a ring of S
// shared-memory stages with a few TMA bulk copies per k64 chunk (4 weight runs, 2 scale runs, the block's input rows)
// that complete on the stage's mbarrier. The grid is persistent (as many CTAs as fit at once) and stream-K: the
// (item, chunk) iterations are split into equal contiguous shares, one per CTA, so every CTA streams the same bytes
// without a break between items. An item split between CTAs is summed by the CTA holding its first chunk (its
// "head"): the others store their fp32 partials in a workspace slot of their own and raise a flag; the head waits for
// the flags of the CTAs after it, adds their partials in CTA order (deterministic), and writes the output (bf16, or
// SiLU(gate) * up with glu, rounded as csrc/moe_w4a16.cu rounds).
//
// C entry point: kimi_w4a16_streamk_gemm (host launcher; returns a cudaError_t).

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>
#include <type_traits>

namespace {

constexpr int kRows = 16;  // rows (pairs) per align block
constexpr int kXStride = 144;  // bytes per input row in a stage: 128 + 16, so ldmatrix's 8 rows hit distinct banks

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

__device__ __forceinline__ uint32_t nibbles_to_bf16x2(uint32_t w) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "r"(0x000F000Fu), "r"(0x43004300u));
  return r;
}

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                               const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
// an arrival on bar once this thread's earlier cp.async copies have landed (counted in bar's expected arrivals)
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// global -> shared bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned), completing on bar
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                         uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}
__device__ __forceinline__ uint64_t policy_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// One stage of the ring: an item's k64 chunk. w[j][nb][lane]: k16 step j of the item's n64 block nb (lane L's 16
// bytes: its A fragments of the block's 4 tiles, as in device memory); s[grp][nb][i]: the scales of group grp, lane
// group i; x: the block's 16 input rows' 64 inputs, row r at byte kXStride * r.
template <int NR>
struct alignas(16) Stage {
  uint4 w[4][NR][32];
  uint4 s[2][NR][8];
  unsigned char x[kRows * kXStride];
};

// The first iteration of CTA c's share of T iterations over G CTAs.
__device__ __forceinline__ int64_t share_begin(int64_t T, int c, int G) { return T * c / G; }

// Registers per thread: the SM allocates warps in groups of 4, so a CTA of 9 warps (8 consumers + the producer) is
// charged for 12: at most 168 registers each.
template <int NT, int CW, int S>
__global__ void __launch_bounds__(32 * (CW + 1), 1) w4a16_streamk_kernel(
    const __nv_bfloat16* __restrict__ x, int64_t x_stride, const uint4* __restrict__ wq,
    const uint4* __restrict__ wsc, const int* __restrict__ sorted_ids, const int* __restrict__ block_expert,
    const int* __restrict__ num_padded, __nv_bfloat16* __restrict__ out, int64_t out_stride, int num_rows_out,
    int top_k, int n, int k_chunks, int trigger_late, int glu, int early_weights, float4* __restrict__ ws,
    int* __restrict__ flags) {
  static_assert(NT % 4 == 0, "NT counts 16-row tiles in whole n64 blocks");
  constexpr int NB = NT / 4;    // n64 blocks per consumer warp
  constexpr int NR = CW * NB;   // n64 blocks per item
  constexpr bool kBulk = false;  // weights by TMA bulk copies (true) or by the producer lanes' cp.async
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Stage<NR>* ring = reinterpret_cast<Stage<NR>*>(smem_raw);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem_raw + sizeof(Stage<NR>) * S);  // full[S], empty[S]
  const uint32_t full0 = smem_addr(bars), empty0 = smem_addr(bars + S);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = blockIdx.x, G = gridDim.x;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full0 + 8 * s, kBulk ? 33 : 32);  // (lane 0's arming +) each producer lane's cp.async arrival
      mbar_init(empty0 + 8 * s, CW);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const int n64 = n >> 6;
  const int n_ranges = n64 / NR;
  if (!early_weights) grid_dependency_wait();  // the align's outputs and x come from kernels ahead
  const int nblk = (early_weights ? __ldcg(num_padded) : num_padded[0]) / kRows;
  const int64_t T = (int64_t)nblk * n_ranges * k_chunks;  // (item, chunk) iterations
  const int64_t it0 = share_begin(T, c, G), it1 = share_begin(T, c + 1, G);

  if (warp == CW) {
    // ---- producer: one warp. Per stage, lane 0 arms the full barrier with the weight bytes and lanes 0-3 copy the
    // 4 weight runs by TMA (one instruction each: the TMA unit's cost is per copy, so the small pieces go by cp.async);
    // every lane copies its share of the scales and input rows by cp.async and arrives (noinc) when they land.
    const uint64_t pol_w = policy_evict_first();
    const uint32_t w_bytes = NR * 512;
    const size_t w_row = (size_t)n64 * 32;  // uint4 per k16 step
    const size_t s_row = (size_t)n >> 3;    // uint4 per scale group
    constexpr int kSPer = NR / 2;           // scale uint4 per lane: 2 groups x NR blocks x 8
    int64_t cur_item = -1;
    int e = 0, half1 = 0;
    const __nv_bfloat16* xrow[4];  // rows (lane / 8) + 4 m of the item's block
    auto item_info = [&](int64_t item) {
      const int b = (int)(item / n_ranges);
      e = early_weights ? __ldcg(block_expert + b) : block_expert[b];
      int valid_hi = 0;
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int r = (lane >> 3) + 4 * m;
        const int id = early_weights ? __ldcg(sorted_ids + b * kRows + r) : sorted_ids[b * kRows + r];
        xrow[m] = x + (int64_t)(id < num_rows_out ? id / top_k : 0) * x_stride;
        valid_hi |= (r >= 8 && id < num_rows_out);
      }
      half1 = __any_sync(0xffffffffu, valid_hi);
    };
    auto issue_w = [&](int64_t it, int st) {  // lane 0 arms the stage; weights by TMA, scales by cp.async
      const int64_t item = it / k_chunks;
      const int kc = (int)(it % k_chunks);
      const int jr = (int)(item % n_ranges);
      const uint32_t bar = full0 + 8 * st;
      if (kBulk) {
        if (lane == 0) mbar_expect_tx(bar, 4 * w_bytes);
        __syncwarp();
        if (lane < 4) {
          const uint4* src = wq + ((size_t)e * k_chunks * 4 + (size_t)kc * 4 + lane) * w_row + (size_t)jr * NR * 32;
          bulk_g2s(smem_addr(&ring[st].w[lane][0][0]), src, w_bytes, bar, pol_w);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint4* src = wq + ((size_t)e * k_chunks * 4 + (size_t)kc * 4 + j) * w_row + (size_t)jr * NR * 32;
#pragma unroll
          for (int m = 0; m < NR; ++m) cp_async16(&ring[st].w[j][0][0] + lane + 32 * m, src + lane + 32 * m);
        }
      }
#pragma unroll
      for (int m = 0; m < kSPer; ++m) {
        const int q = lane + 32 * m, grp = q / (NR * 8), rem = q % (NR * 8);
        cp_async16(&ring[st].s[grp][0][0] + rem,
                   wsc + ((size_t)e * k_chunks * 2 + (size_t)kc * 2 + grp) * s_row + (size_t)jr * NR * 8 + rem);
      }
    };
    auto issue_x = [&](int64_t it, int st) {  // input rows by cp.async, then this lane's arrival on the stage
      const int kc = (int)(it % k_chunks);
#pragma unroll
      for (int m = 0; m < 4; ++m)
        if (m < 2 || half1)
          cp_async16(&ring[st].x[((lane >> 3) + 4 * m) * kXStride + (lane & 7) * 16],
                     xrow[m] + (int64_t)kc * 64 + (lane & 7) * 8);
      cp_async_arrive_noinc(full0 + 8 * st);
    };
    int64_t it = it0;
    int li = 0;
    if (early_weights) {
      // the first S iterations' weights and scales before the wait (their stages are free), their inputs after it
      for (; it < it1 && li < S; ++it, ++li) {
        const int64_t item = it / k_chunks;
        if (item != cur_item) item_info(item), cur_item = item;
        issue_w(it, li);
      }
      grid_dependency_wait();
      if (!trigger_late) launch_dependents();
      cur_item = -1;
      for (int64_t it2 = it0; it2 < it; ++it2) {
        const int64_t item = it2 / k_chunks;
        if (item != cur_item) item_info(item), cur_item = item;
        issue_x(it2, (int)(it2 - it0));
      }
    } else if (!trigger_late) {
      launch_dependents();
    }
    for (; it < it1; ++it, ++li) {
      const int st = li % S;
      mbar_wait(empty0 + 8 * st, ((li / S) & 1) ^ 1);
      const int64_t item = it / k_chunks;
      if (item != cur_item) item_info(item), cur_item = item;
      issue_w(it, st);
      issue_x(it, st);
    }
    if (trigger_late) launch_dependents();
    return;
  }

  // ---- consumers: warp w computes n64 blocks [w NB, (w + 1) NB) of each item's n-range
  if (early_weights) grid_dependency_wait();
  if (!trigger_late) launch_dependents();
  const int g = lane >> 2, t = lane & 3;
  const uint32_t x_lo = (uint32_t)((lane & 7) * kXStride + ((lane >> 3) << 4));  // row L % 8, piece L / 8
  const uint32_t x_hi = x_lo + 64;                                                 // pieces + 4
  const uint32_t m136[4] = {0xC308C308u, 0xC308C308u, 0xC308C308u, 0xC308C308u};
  const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float acc[NT][2][4];

  auto compute = [&](const Stage<NR>& sl, auto nh) {
    constexpr int NH = decltype(nh)::value;
    uint32_t b[2][8];
    const uint32_t xs = smem_addr(&sl.x[0]);
#pragma unroll
    for (int h = 0; h < NH; ++h) {
      uint32_t r0[4], r1[4];
      ldmatrix_x4(r0, xs + h * 8 * kXStride + x_lo);
      ldmatrix_x4(r1, xs + h * 8 * kXStride + x_hi);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        b[h][m] = r0[m];
        b[h][4 + m] = r1[m];
      }
    }
    float off[2][2][4];
#pragma unroll
    for (int grp = 0; grp < 2; ++grp)
#pragma unroll
      for (int h = 0; h < NH; ++h) {
        mma_bf16_16816(off[grp][h], m136, b[h][4 * grp], b[h][4 * grp + 1], zero);
        mma_bf16_16816(off[grp][h], m136, b[h][4 * grp + 2], b[h][4 * grp + 3], off[grp][h]);
      }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const int nbi = warp * NB + nb;
      const uint4 wv[4] = {sl.w[0][nbi][lane], sl.w[1][nbi][lane], sl.w[2][nbi][lane], sl.w[3][nbi][lane]};
      const uint4 sv[2] = {sl.s[0][nbi][g], sl.s[1][nbi][g]};
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) {
        const int i = 4 * nb + cc;
        const uint32_t words[4] = {(&wv[0].x)[cc], (&wv[1].x)[cc], (&wv[2].x)[cc], (&wv[3].x)[cc]};
#pragma unroll
        for (int grp = 0; grp < 2; ++grp) {
          const uint32_t sw = (&sv[grp].x)[cc];
          const float sg = bf16_lo(sw), sg8 = bf16_hi(sw);
          float part[2][4];
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            const int j = 2 * grp + jj;
            const uint32_t w = words[j];
            uint32_t a[4];
            a[0] = nibbles_to_bf16x2(w);
            a[1] = nibbles_to_bf16x2(w >> 8);
            a[2] = nibbles_to_bf16x2(w >> 4);
            a[3] = nibbles_to_bf16x2(w >> 12);
#pragma unroll
            for (int h = 0; h < NH; ++h)
              mma_bf16_16816(part[h], a, b[h][2 * j], b[h][2 * j + 1], jj == 0 ? off[grp][h] : part[h]);
          }
#pragma unroll
          for (int h = 0; h < NH; ++h) {
            acc[i][h][0] = fmaf(sg, part[h][0], acc[i][h][0]);
            acc[i][h][1] = fmaf(sg, part[h][1], acc[i][h][1]);
            acc[i][h][2] = fmaf(sg8, part[h][2], acc[i][h][2]);
            acc[i][h][3] = fmaf(sg8, part[h][3], acc[i][h][3]);
          }
        }
      }
    }
  };

  // workspace slot of CTA cc, this warp: [NT][2][32 lanes] float4 (the C fragments as they lie in registers)
  auto ws_at = [&](int cc, int i, int h) { return ws + (((size_t)cc * CW + warp) * NT * 2 + i * 2 + h) * 32 + lane; };
  int* const my_flag = flags + (size_t)c * CW + warp;

  // one item's output: the block's pair ids of this lane's columns (token 8 h + 2 t + q)
  auto store = [&](int b, int jr, int nh) {
    int ids[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int q = 0; q < 2; ++q) ids[h][q] = sorted_ids[b * kRows + 8 * h + 2 * t + q];
    const bool even = (g & 1) == 0;
    // column pairs: a lane of even g stores (col g, g + 1) of its tokens, odd g (col g + 7, g + 8), from a shuffle with
    // lane ^ 4 (g ^ 1)
    auto put = [&](float (&v)[4], int col0, int h) {  // v: this lane's (col g: tok 2t, 2t+1; col g+8: same)
      const float s0 = even ? v[2] : v[0], s1 = even ? v[3] : v[1];
      const float r0 = __shfl_xor_sync(0xffffffffu, s0, 4), r1 = __shfl_xor_sync(0xffffffffu, s1, 4);
      const int col = col0 + (even ? g : g + 7);
      const float p00 = even ? v[0] : r0, p01 = even ? r0 : v[2];  // token 2t
      const float p10 = even ? v[1] : r1, p11 = even ? r1 : v[3];  // token 2t + 1
      if (h < nh) {
        if (ids[h][0] < num_rows_out)
          *reinterpret_cast<__nv_bfloat162*>(out + (int64_t)ids[h][0] * out_stride + col) =
              __floats2bfloat162_rn(p00, p01);
        if (ids[h][1] < num_rows_out)
          *reinterpret_cast<__nv_bfloat162*>(out + (int64_t)ids[h][1] * out_stride + col) =
              __floats2bfloat162_rn(p10, p11);
      }
    };
    const int nb_base = jr * NR + warp * NB;  // global n64 block of this warp's first block
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (glu & 1) {
          // tiles 0, 1 of the block are gate rows 0..31, tiles 2, 3 the matching up rows: output columns
          // 32 (block) + 16 cc + (g, g + 8)
#pragma unroll
          for (int cc = 0; cc < 2; ++cc) {
            float v[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const float gt = __bfloat162float(__float2bfloat16_rn(acc[4 * nb + cc][h][r]));
              const float up = __bfloat162float(__float2bfloat16_rn(acc[4 * nb + cc + 2][h][r]));
              v[r] = __bfloat162float(__float2bfloat16_rn(gt / (1.0f + __expf(-gt)))) * up;
            }
            put(v, (nb_base + nb) * 32 + 16 * cc, h);
          }
        } else {
#pragma unroll
          for (int cc = 0; cc < 4; ++cc) put(acc[4 * nb + cc][h], (nb_base + nb) * 64 + 16 * cc, h);
        }
      }
  };

  int64_t seg_start = it0;
  int nh = 2;
  int li = 0;
  for (int64_t it = it0; it < it1; ++it, ++li) {
    const int64_t item = it / k_chunks;
    const int kc = (int)(it % k_chunks);
    const int b = (int)(item / n_ranges);
    if (it == seg_start) {
      nh = __any_sync(0xffffffffu, sorted_ids[b * kRows + 8 + g] < num_rows_out) ? 2 : 1;
#pragma unroll
      for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[i][h][r] = 0.0f;
    }
    const int st = li % S;
    mbar_wait(full0 + 8 * st, (li / S) & 1);
    if (glu & 2) {
      // loads-only probe: the stage is released without arithmetic
    } else if (nh == 2)
      compute(ring[st], std::integral_constant<int, 2>{});
    else
      compute(ring[st], std::integral_constant<int, 1>{});
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8 * st);
    if (kc == k_chunks - 1 || it == it1 - 1) {  // the segment of this item ends here
      const int k0 = (int)(seg_start % k_chunks);
      if (k0 > 0) {
        // not the item's head: hand the partial sums to it
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (h < nh) __stcg(ws_at(c, i, h), make_float4(acc[i][h][0], acc[i][h][1], acc[i][h][2], acc[i][h][3]));
        __threadfence();
        __syncwarp();
        if (lane == 0) st_release(my_flag, 1);
      } else {
        if (kc != k_chunks - 1) {
          // the head of an item that continues in the next CTAs: add their partials in CTA order
          const int64_t end = (item + 1) * k_chunks;
          for (int c2 = c + 1; c2 < G; ++c2) {
            const int64_t b2 = share_begin(T, c2, G);
            if (b2 >= end) break;
            if (share_begin(T, c2 + 1, G) == b2) continue;  // an empty share
            int* f = flags + (size_t)c2 * CW + warp;
            while (ld_acquire(f) == 0) __nanosleep(64);
#pragma unroll
            for (int i = 0; i < NT; ++i)
#pragma unroll
              for (int h = 0; h < 2; ++h)
                if (h < nh) {
                  const float4 p = __ldcg(ws_at(c2, i, h));
                  acc[i][h][0] += p.x;
                  acc[i][h][1] += p.y;
                  acc[i][h][2] += p.z;
                  acc[i][h][3] += p.w;
                }
            __syncwarp();
            if (lane == 0) *f = 0;  // read once; the next launch starts from 0
          }
        }
        store(b, (int)(item % n_ranges), nh);
      }
      seg_start = it + 1;
    }
  }
  if (trigger_late) launch_dependents();
}

template <int NT, int CW, int S>
constexpr size_t smem_bytes() {
  return sizeof(Stage<CW * NT / 4>) * S + 16 * S;
}

// CTAs of configuration (NT, CW, S) resident at once on device dev (cached): the persistent grid.
template <int NT, int CW, int S>
cudaError_t grid_size(int dev, int* grid) {
  static std::atomic<int> cached[64];
  if (dev < 64 && cached[dev].load() > 0) {
    *grid = cached[dev].load();
    return cudaSuccess;
  }
  cudaError_t err = cudaFuncSetAttribute(w4a16_streamk_kernel<NT, CW, S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem_bytes<NT, CW, S>());
  if (err != cudaSuccess) return err;
  int sms = 0, per_sm = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, w4a16_streamk_kernel<NT, CW, S>, 32 * (CW + 1),
                                                      smem_bytes<NT, CW, S>());
  if (err != cudaSuccess) return err;
  if (per_sm <= 0) return cudaErrorInvalidConfiguration;
  *grid = sms * per_sm;
  if (dev < 64) cached[dev].store(*grid);
  return cudaSuccess;
}

template <int NT, int CW, int S>
cudaError_t launch(const void* x, int64_t x_stride, const void* wq, const void* wsc, const int* sorted_ids,
                   const int* block_expert, const int* num_padded, void* out, int64_t out_stride, int num_rows_out,
                   int top_k, int n, int k, int pdl, int glu, int early_weights, void* ws, int* flags,
                   int64_t ws_ctas, cudaStream_t stream) {
  if ((n / 64) % (CW * NT / 4) != 0) return cudaErrorInvalidValue;
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  int grid = 0;
  err = grid_size<NT, CW, S>(dev, &grid);
  if (err != cudaSuccess) return err;
  // the workspace holds ws_ctas CTAs' slots of [CW][8 tiles][2][32] float4 (and flags [ws_ctas][CW])
  if (grid > ws_ctas) return cudaErrorInvalidValue;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid, 1, 1);
  cfg.blockDim = dim3(32 * (CW + 1), 1, 1);
  cfg.dynamicSmemBytes = smem_bytes<NT, CW, S>();
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, w4a16_streamk_kernel<NT, CW, S>, static_cast<const __nv_bfloat16*>(x), x_stride,
                            static_cast<const uint4*>(wq), static_cast<const uint4*>(wsc), sorted_ids, block_expert,
                            num_padded, static_cast<__nv_bfloat16*>(out), out_stride, num_rows_out, top_k, n, k / 64,
                            pdl == 2 ? 1 : 0, glu, early_weights, static_cast<float4*>(ws), flags);
}

}  // namespace

// Host launcher. Arguments as kimi_w4a16_indexed_gemm's (csrc/moe_w4a16.cu), plus: (nt, cw, stages) a compiled
// configuration (nt 16-row tiles per consumer warp, cw consumer warps, a ring of `stages` k64 chunks), with
// cw * nt / 4 dividing n / 64; ws: a float32 workspace of ws_ctas * cw * 8 * 2 * 32 * 4 floats and flags: ws_ctas * cw
// int32, zero before the first launch and left zero by every completed launch (one stream at a time may use them).
// The grid is as many CTAs as fit on the device at once (cudaErrorInvalidValue when that exceeds ws_ctas).
extern "C" cudaError_t kimi_w4a16_streamk_gemm(const void* x, int64_t x_stride, const void* wq, const void* wsc,
                                               const int* sorted_ids, const int* block_expert, const int* num_padded,
                                               void* out, int64_t out_stride, int num_rows_out, int top_k, int n,
                                               int k, int nt, int cw, int stages, int pdl, int glu,
                                               int early_weights, void* ws, int* flags, int64_t ws_ctas,
                                               cudaStream_t stream) {
  if (n % 64 != 0 || k % 64 != 0 || top_k <= 0 || pdl < 0 || pdl > 2 || glu < 0 || glu > 3 || early_weights < 0 ||
      early_weights > 1 || ws == nullptr || flags == nullptr)
    return cudaErrorInvalidValue;
#define KIMI_SK_CASE(NT_, CW_, S_)                                                                                  \
  if (nt == NT_ && cw == CW_ && stages == S_)                                                                       \
    return launch<NT_, CW_, S_>(x, x_stride, wq, wsc, sorted_ids, block_expert, num_padded, out, out_stride,       \
                                num_rows_out, top_k, n, k, pdl, glu, early_weights, ws, flags, ws_ctas, stream);
  KIMI_SK_CASE(8, 8, 5)
  KIMI_SK_CASE(8, 8, 4)
  KIMI_SK_CASE(4, 8, 8)
  KIMI_SK_CASE(4, 8, 6)
  KIMI_SK_CASE(8, 7, 5)
  KIMI_SK_CASE(8, 7, 4)
  KIMI_SK_CASE(8, 4, 5)
  KIMI_SK_CASE(4, 4, 8)
#undef KIMI_SK_CASE
  return cudaErrorInvalidValue;
}

// kimi: W4A16 indexed expert GEMM for decode-sized batches (Hopper, sm_90a).
//
// out[r, :] = W_e @ x[r / top_k, :] for every pair row r listed by a MoE align (16-row blocks, one expert each),
// W_e = (nibble - 8) * scale (group 32). mma.sync m16n8k16 multiplies the bf16 values 128 + nibble (exact) with the
// inputs in fp32; an MMA of the constant -136 starts each group's sum, so it is that of (nibble - 8) * input; and
// the group's scale multiplies the sum in fp32 (the weights are never rounded to bf16).
// The weight layout is built by kimi/kernels/cuda/moe_w4a16.py:repack (its docstring describes it): the layout of
// humming-kernels' W4A16 GEMM for 16-bit inputs, so one copy of the experts in device memory serves both (humming at
// prefill sizes, this kernel at decode sizes); its fragment positions follow the PTX ISA's tables for mma.m16n8k16
// with .bf16 inputs (A row-major, B column-major), the weights being the A operand (16 rows of N) and the tokens B.
//
// Work split: CTA (blockIdx.x = group of NT 16-row tiles of N, NT / 4 n64 blocks; blockIdx.y = align block b) has
// KW warps; warp w takes k64 chunks [w*C/KW, (w+1)*C/KW) of the C = K/64 chunks, for all NT tiles, through a ring of
// S shared-memory slots filled by cp.async (per chunk: per n64 block 4 x 512 contiguous bytes of weights and 2 x 128
// of scales; the block's 16 input rows, 128 bytes each), S - 1 chunks in flight. A warp's loads of a chunk are
// offsets from pointers that step once per chunk, and the chunk loop is unrolled by S so the slot addresses are
// constants: the instructions per weight are the dequantisation and the MMAs, little else (the decode step runs at
// the H200's power cap, where issued instructions cost clock). The inputs' B fragments come from shared memory by
// ldmatrix. Partials are summed across warps in shared memory (the rings' space, after the loop) and written as bf16;
// with glu the epilogue writes SiLU(gate) * up instead (weights with gate / up rows interleaved per n64 block by
// kimi/kernels/cuda/moe_w4a16.py:glu_interleave), so the gate_up GEMM hands the down GEMM its input directly.
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

// Activations are read by every CTA of their block (N / (16 NT) of them): keep them in L1 (.ca). src_bytes 16 copies
// the 16 bytes at src; 0 reads nothing and writes 16 zero bytes (the PTX ISA's cp.async src-size operand).
__device__ __forceinline__ void cp_async16_l1(void* dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// ldmatrix.x4: four 8 x 8 bf16 matrices; lane L supplies the shared address of row L % 8 of matrix L / 8 and gets
// (row L / 4, columns 2 (L % 4), +1) of each matrix: for rows = tokens and columns = inputs, the mma B fragment.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// One warp's ring slot for a k64 chunk: the weights of its NT / 4 n64 blocks (4 k16 steps x 32 lanes x 16 bytes
// each), their scales (2 groups x 8 lane groups x 16 bytes: rows g + 8 i, i = 0..7), and the 16 token rows' 64
// inputs (16-byte piece q of row r stored at q ^ (r & 7): ldmatrix reads 8 rows' pieces from 8 distinct bank groups).
template <int NT>
struct alignas(16) Slot {
  uint4 w[NT / 4][4][32];
  uint4 s[NT / 4][2][8];
  uint4 x[16][8];
};

template <int NT, int KW, int S>
__global__ void __launch_bounds__(32 * KW, 1)
    w4a16_indexed_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, const uint4* __restrict__ wq,
                         const uint4* __restrict__ wsc, const int* __restrict__ sorted_ids,
                         const int* __restrict__ block_expert, const int* __restrict__ num_padded,
                         __nv_bfloat16* __restrict__ out, int64_t out_stride, int num_rows_out, int top_k, int n,
                         int k_chunks, int trigger_late, int glu, int early_weights, int zero_pads) {
  static_assert(NT % 4 == 0, "NT counts 16-row tiles in whole n64 blocks");
  constexpr int NB = NT / 4;  // n64 blocks per CTA
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int b = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  Slot<NT>* ring = reinterpret_cast<Slot<NT>*>(smem_raw) + warp * S;
  // partial sums reuse the rings after the loop: [KW][NT * 16][17] floats
  float* partial = reinterpret_cast<float*>(smem_raw);

  // early_weights: the align's outputs (num_padded, block_expert) were complete before this kernel could launch (see
  // kimi_w4a16_indexed_gemm), so they are read before griddepcontrol.wait, through L2 (ld.global.cg: no L1 line of an
  // earlier step can serve them; this relies on a completed kernel's writes being in L2, which PTX promises only to
  // the grid that waited for it, here the kernel ahead), and the first S - 1 chunks' weights and scales are in flight
  // before the wait. An empty block then exits without waiting.
  int e;
  if (early_weights) {
    if (b * kBlockRows >= __ldcg(num_padded)) return;
    e = __ldcg(block_expert + b);
  } else {
    grid_dependency_wait();                  // x, the align's ids and the output rows come from kernels ahead
    if (!trigger_late) launch_dependents();  // else after the main loop (the next kernel then waits less long)
    if (b * kBlockRows >= num_padded[0]) {
      if (trigger_late) launch_dependents();
      return;
    }
    e = block_expert[b];
  }
  const int n_chunks = k_chunks / KW;  // this warp's k64 chunks: [warp * n_chunks, (warp + 1) * n_chunks)
  const int c_begin = warp * n_chunks;

  // Layout (kimi/kernels/cuda/moe_w4a16.py: repack): weights [E, K/16, N/64, 32 lanes, 4 words] (word c of n64 block
  // nb, k16 step s: the lane's A fragment of rows 64 nb + 16 c .. + 15), scales [E, K/32, N] bf16 with each run of
  // 64 rows stored as (g, i) -> row 8 i + g. A chunk of this CTA: per n64 block and k16 step 512 contiguous bytes
  // of weights; per block and group 128 contiguous bytes of scales.
  const int nb0 = blockIdx.x * NB;
  const int n64 = n >> 6;
  const size_t w_row = (size_t)n64 * 32;  // uint4 per k16 step
  // lane L copies the 16-byte pieces 8 q + L % 8 (q = 0..3) of k16 step L / 8 of each block: every copy
  // instruction reads 4 x 128 contiguous bytes, at immediate offsets from one pointer per lane
  const int wj = lane >> 3, wl = lane & 7;
  const uint4* wp = wq + ((size_t)e * k_chunks * 4 + (size_t)c_begin * 4 + wj) * w_row + (size_t)nb0 * 32 + wl;
  // scales: lane < 16 NB copies 16 bytes: block L / 16, group (L / 8) & 1, lane group L & 7
  const size_t s_row = (size_t)n >> 3;  // uint4 per group
  const uint4* sp = wsc + ((size_t)e * k_chunks * 2 + (size_t)c_begin * 2 + ((lane >> 3) & 1)) * s_row +
                    (size_t)(nb0 + (lane >> 4)) * 8 + (lane & 7);

  auto issue_w = [&](Slot<NT>& sl) {  // the weights and scales of this warp's next chunk into slot sl
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int q = 0; q < 4; ++q) cp_async16(&sl.w[nb][wj][8 * q + wl], wp + nb * 32 + 8 * q);
    if (lane < 16 * NB) cp_async16(&sl.s[lane >> 4][(lane >> 3) & 1][lane & 7], sp);
    wp += 4 * w_row;
    sp += 2 * s_row;
  };
  if (early_weights) {  // one cp.async group per chunk, as in the main loop
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
      if (s < n_chunks) issue_w(ring[s]);
      cp_async_commit();
    }
    grid_dependency_wait();  // x comes from the kernel ahead
    if (!trigger_late) launch_dependents();
  }
  const bool half1 =
      __any_sync(0xffffffffu, sorted_ids[b * kBlockRows + 8 + g] < num_rows_out);  // rows 8..15 hold pairs

  // Input rows. With both halves in use lane L copies pieces 4 (L & 1) .. + 3 of block row L / 2; with one, pieces
  // 2 (L & 3), + 1 of row L / 4. A pad row's MMA column is never stored, so what it holds does not matter and the
  // loop needs no per-row branch: with zero_pads its copies read nothing and fill zeros (operands of zeros toggle
  // fewer bits in the tensor cores, and the step runs at the power cap); else they read token 0.
  const __nv_bfloat16* xr[2];
  int xrow[2], xq[2];
  uint32_t xbytes[2];
#pragma unroll
  for (int h1 = 0; h1 < 2; ++h1) {
    xrow[h1] = h1 ? lane >> 1 : lane >> 2;
    xq[h1] = h1 ? 4 * (lane & 1) : 2 * (lane & 3);
    const int id = sorted_ids[b * kBlockRows + xrow[h1]];
    xr[h1] = x + (int64_t)(id < num_rows_out ? id / top_k : 0) * x_stride + 8 * xq[h1] + (int64_t)c_begin * 64;
    xbytes[h1] = (id < num_rows_out || !zero_pads) ? 16u : 0u;
  }
  // ldmatrix addresses (bytes in a slot's x) of this lane for half h, k16 steps 0, 1: row 8 h + L % 8, piece
  // (L / 8) ^ (L % 8); steps 2, 3 are pieces 4 higher, i.e. the address ^ 64
  const uint32_t x_off = (uint32_t)((lane & 7) * 128 + (((lane >> 3) ^ (lane & 7)) << 4));
  const uint32_t x_off_hi = x_off ^ 64u;

  // h1: std::true_type when rows 8..15 hold pairs (the second n8 half is loaded and multiplied), else false_type
  auto issue_x = [&](Slot<NT>& sl, auto h1) {  // the inputs of this warp's next chunk into slot sl
    constexpr int H = decltype(h1)::value ? 1 : 0;
#pragma unroll
    for (int q = 0; q < (H ? 4 : 2); ++q) {
      const int r = xrow[H], piece = xq[H] + q;
      cp_async16_l1(&sl.x[r][piece ^ (r & 7)], xr[H] + 8 * q, xbytes[H]);
    }
    xr[0] += 64;
    xr[1] += 64;
  };
  auto issue = [&](Slot<NT>& sl, auto h1) {  // the next chunk of this warp into slot sl; advances the pointers
    issue_w(sl);
    issue_x(sl, h1);
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
    // B fragments of half h: b[h][2 j], b[h][2 j + 1] = step j's registers 0, 1 (inputs 16 j + 2 t (+1), + 8)
    uint32_t b[2][8];
    const uint32_t xs = smem_addr(&sl.x[0][0]);
#pragma unroll
    for (int h = 0; h < NH; ++h) {
      uint32_t r0[4], r1[4];
      ldmatrix_x4(r0, xs + h * 1024 + x_off);
      ldmatrix_x4(r1, xs + h * 1024 + x_off_hi);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        b[h][m] = r0[m];
        b[h][4 + m] = r1[m];
      }
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
    for (int nb = 0; nb < NB; ++nb) {
      const uint4 wv[4] = {sl.w[nb][0][lane], sl.w[nb][1][lane], sl.w[nb][2][lane], sl.w[nb][3][lane]};
      const uint4 sv[2] = {sl.s[nb][0][g], sl.s[nb][1][g]};  // word c: (row 16 c + g, row 16 c + 8 + g)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int i = 4 * nb + c;  // the CTA's tile
        const uint32_t words[4] = {(&wv[0].x)[c], (&wv[1].x)[c], (&wv[2].x)[c], (&wv[3].x)[c]};
#pragma unroll
        for (int grp = 0; grp < 2; ++grp) {
          const uint32_t sw = (&sv[grp].x)[c];
          const float sg = bf16_lo(sw), sg8 = bf16_hi(sw);
          float part[2][4];  // sum over the group of (nibble - 8) * input, exact in fp32 up to the MMA's rounding
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            const int j = 2 * grp + jj;
            const uint32_t w = words[j];
            uint32_t a[4];
            a[0] = nibbles_to_bf16x2(w);        // row g,     fragment columns 2t, 2t+1: 128 + nibble
            a[1] = nibbles_to_bf16x2(w >> 8);   // row g + 8, columns 2t, 2t+1
            a[2] = nibbles_to_bf16x2(w >> 4);   // row g,     columns 2t+8, 2t+9
            a[3] = nibbles_to_bf16x2(w >> 12);  // row g + 8, columns 2t+8, 2t+9
#pragma unroll
            for (int h = 0; h < NH; ++h)
              mma_bf16_16816(part[h], a, b[h][2 * j], b[h][2 * j + 1], jj == 0 ? off[grp][h] : part[h]);
          }
          // the group's scale, in fp32: C fragment registers 0, 1 are row g, 2, 3 row g + 8
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

  // S - 1 chunks in flight; the loop is unrolled by S so every slot index is a constant. Compiled twice, with and
  // without the second half: predicated-off MMAs would still take issue slots.
  // With early_weights the first S - 1 chunks' inputs follow as S - 1 more groups: at chunk j < S - 1 the wait below
  // (at most S - 2 groups pending) has completed weight group j and input group j.
  auto main_loop = [&](auto h1) {
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
      if (s < n_chunks) {
        if (early_weights)
          issue_x(ring[s], h1);
        else
          issue(ring[s], h1);
      }
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
  const int col0 = nb0 * 64;
  if (glu) {
    // SiLU(gate) * up (kimi.kernels.cuda.moe_w4a16.glu_interleave): rows 0..31 of each n64 block are the gate rows of
    // outputs 32 nb .. 32 nb + 31 and rows 32..63 the matching up rows. Rounded as the unfused path rounds: the
    // GEMM's bf16 outputs, SiLU rounded to bf16 (kimi.kernels.triton.fused.silu_mul_rows), then the product.
    constexpr int kOut = NT * 4;  // output column pairs of this CTA: 16 per n64 block
    for (int idx = threadIdx.x; idx < kBlockRows * kOut; idx += 32 * KW) {
      const int r = idx / kOut, op = idx % kOut;
      const int id = sorted_ids[b * kBlockRows + r];
      if (id >= num_rows_out) continue;
      const int cg = (op >> 4) * 64 + 2 * (op & 15);  // the CTA's column of the gate pair; up: + 32
      float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};          // gate, gate + 1, up, up + 1
#pragma unroll
      for (int w = 0; w < KW; ++w) {
        const float* pw = partial + (size_t)w * NT * 16 * kP + r;
        v[0] += pw[(size_t)cg * kP];
        v[1] += pw[(size_t)(cg + 1) * kP];
        v[2] += pw[(size_t)(cg + 32) * kP];
        v[3] += pw[(size_t)(cg + 33) * kP];
      }
      float a[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float gt = __bfloat162float(__float2bfloat16_rn(v[j]));
        const float up = __bfloat162float(__float2bfloat16_rn(v[2 + j]));
        a[j] = __bfloat162float(__float2bfloat16_rn(gt / (1.0f + __expf(-gt)))) * up;
      }
      *reinterpret_cast<__nv_bfloat162*>(out + (int64_t)id * out_stride + nb0 * 32 + (op >> 4) * 32 + 2 * (op & 15)) =
          __floats2bfloat162_rn(a[0], a[1]);
    }
    return;
  }
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
    *reinterpret_cast<__nv_bfloat162*>(out + (int64_t)id * out_stride + col0 + 2 * np) = __floats2bfloat162_rn(s0, s1);
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
                   int top_k, int n, int k, int num_blocks, int pdl, int glu, int early_weights, int zero_pads,
                   cudaStream_t stream) {
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
    err = cudaFuncSetAttribute(w4a16_indexed_kernel<NT, KW, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
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
                            static_cast<const uint4*>(wq), static_cast<const uint4*>(wsc), sorted_ids, block_expert,
                            num_padded, static_cast<__nv_bfloat16*>(out), out_stride, num_rows_out, top_k, n, k_chunks,
                            pdl == 2 ? 1 : 0, glu, early_weights, zero_pads);
}

}  // namespace

// Host launcher. x: [R, k] bf16 (row stride x_stride elements, rows 16-byte aligned); wq / wsc: weights
// [E, k/16, n/64, 32, 4] int32 and scales [E, k/32, n] bf16 in the layout of kimi/kernels/cuda/moe_w4a16.py:repack;
// sorted_ids: [num_blocks * 16] int32; block_expert: [num_blocks] int32; num_padded: [1] int32 (device);
// out: [num_rows_out, n] bf16 (row stride out_stride; listed rows written; with glu = 1: [num_rows_out, n / 2], SiLU of
// rows 0..31 of each n64 block times rows 32..63, see the epilogue). (nt, kw, stages) must be an instantiated
// configuration with nt dividing n / 16; n % 64 == 0, k % 64 == 0, kw dividing k / 64; num_blocks <= 65535 (the
// grid's y dimension). pdl: 0 off, 1 on, 2 on with the next kernel released after the main loop. early_weights: 1
// when num_padded and block_expert were complete before this kernel could start, i.e. the align that writes them is
// not the kernel directly ahead, and every kernel between them waited (griddepcontrol.wait, or an ordinary launch)
// before letting its dependents launch: then each CTA reads them and issues its first S - 1 chunks of weights before
// its griddepcontrol.wait (the down GEMM behind the gate_up GEMM). zero_pads: 1 fills the pad rows' inputs with zeros
// (no read), 0 reads token 0's row for them; the outputs are the same. Returns cudaErrorInvalidValue for anything else.
extern "C" cudaError_t kimi_w4a16_indexed_gemm(const void* x, int64_t x_stride, const void* wq, const void* wsc,
                                               const int* sorted_ids, const int* block_expert, const int* num_padded,
                                               void* out, int64_t out_stride, int num_rows_out, int top_k, int n, int k,
                                               int num_blocks, int nt, int kw, int stages, int pdl, int glu,
                                               int early_weights, int zero_pads, cudaStream_t stream) {
  if (n % 64 != 0 || k % 64 != 0 || num_blocks <= 0 || num_blocks > 65535 || top_k <= 0 || nt <= 0 || kw <= 0 ||
      (n / 16) % nt != 0 || (k / 64) % kw != 0 || pdl < 0 || pdl > 2 || glu < 0 || glu > 1 || early_weights < 0 ||
      early_weights > 1 || zero_pads < 0 || zero_pads > 1)
    return cudaErrorInvalidValue;
#define KIMI_W4A16_CASE(NT_, KW_, S_)                                                                        \
  if (nt == NT_ && kw == KW_ && stages == S_)                                                                \
    return launch<NT_, KW_, S_>(x, x_stride, wq, wsc, sorted_ids, block_expert, num_padded, out, out_stride, \
                                num_rows_out, top_k, n, k, num_blocks, pdl, glu, early_weights, zero_pads, stream);
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

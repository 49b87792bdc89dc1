// kimi: absorbed-MLA decode over the paged latent cache, split-KV, wgmma + TMA (Hopper, sm_90a).
//
// For request b (one query row, H = 64 heads) over its seq_lens[b] cached tokens, token s at
// kv[block_tables[b, s / page], s % page] = [ckv (512) | k_pe (64)]:
//   score[h, s] = (q_lat[b, h] . ckv_s + q_pe[b, h] . kpe_s) * scale,   o_lat[b, h] = softmax_s(score[h]) @ ckv
// with fp32 scores, softmax and accumulation; p rounded to bf16 for the P @ V tensor-core product (as
// FlashAttention does). Same function as kimi.ops.attention.mla_decode_ref. Written for this project from the
// split-KV ("flash-decoding") scheme (FlashAttention's online softmax over KV tiles, the KV range split across CTAs,
// partials merged through their log-sum-exp) and the PTX ISA's wgmma / cp.async.bulk.tensor / mbarrier sections.
//
// CTA (split, b): 384 threads = two consumer warpgroups (WG0, WG1: 232 registers each) + a producer warpgroup (40).
// The CTA walks KV tiles of 64 tokens [split * per, min((split + 1) * per, n_tiles)), n_tiles = cdiv(seq_len, 64),
// per = cdiv(n_tiles, num_splits). Shared memory holds the query [64 x 576] and a 2-deep ring of KV tiles [64 x 576], each as 9 panels
// of [64 rows x 64 columns] (128-byte rows, 128-byte swizzle: the layout TMA writes and wgmma reads).
//   producer (one lane): per tile, waits for the ring slot to be free, then 9 TMA loads (3-D tensor map over the
//     cache [num_blocks, page, 576]: box 64 columns x 64 tokens x 1 block) that complete on the slot's mbarrier.
//   consumer WG w, per tile:
//     1. S_w [64 heads x 32 tokens] = Q [64 x 576] . K[tokens 32w .. 32w+31]^T: 36 wgmma m64n32k16 (K-major A, B);
//     2. tokens >= seq_len masked; row maxima exchanged between the WGs through shared memory (named barrier), so
//        both hold the same running max m (base 2: scale * log2(e) folded in); p = 2^(s - m), rescale 2^(m_old - m)
//        applied to the WG's O half and row-sum partial;
//     3. p (bf16) written into a shared [64 x 64] tile (K-major, swizzled); on the tile with the last tokens the
//        value rows past seq_len are zeroed (the cache there holds whatever was last written: NaN would survive
//        0 * NaN);
//     4. O_w [64 heads x 256 dims: 256w .. 256w+255] += P [64 x 64] . V [64 tokens x those dims]: 4 wgmma
//        m64n256k16 with V as the MN-major B operand (the cache's own layout), then the slot is released.
// num_splits == 1: the CTA writes o_lat (bf16) itself. Else each split writes o / l (fp32) and lse = m + log2(l)
// (-inf for an empty split) to a workspace and counts itself done on its request's counter; the request's last split
// to finish resets the counter and merges the splits that had tiles with weights 2^(lse_s - max lse) (no second
// kernel). A request with seq_len 0 gets o_lat = 0.
//
// Programmatic dependent launch (pdl = 1): the producer loads the KV tiles that cannot hold the step's new token
// before `griddepcontrol.wait` (the cache's older tokens, the lengths and the tables were written before the
// preceding kernel started: every kimi kernel waits before it releases its dependents); the tile holding token
// seq_len - 1 and the query are read after it. The kernel releases its dependents after the main loop.
//
// C entry point: kimi_mla_decode (host launcher; returns a cudaError_t).

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include <atomic>

namespace {

constexpr int kH = 64;                    // query heads (one CTA holds them all)
constexpr int kL = 512;                   // kv_lora_rank: the value width
constexpr int kR = 64;                    // rope dims
constexpr int kD = kL + kR;               // 576: the score width
constexpr int kTN = 64;                   // tokens per KV tile
constexpr int kHalf = kTN / 2;            // tokens per consumer warpgroup in the score product
constexpr int kPanels = kD / 64;          // 9 panels of 64 columns (128-byte rows)
constexpr int kPanelBytes = 64 * 128;     // a panel: [64 rows x 128 bytes]
constexpr int kTileBytes = kPanels * kPanelBytes;  // 73728: the query, or one KV tile
constexpr int kStages = 2;                // KV ring depth
constexpr int kMaxSplits = 32;            // KV splits per request (the merge's weights fill the P tile)
constexpr int kConsumers = 256;           // two warpgroups
constexpr int kThreads = kConsumers + 128;  // + the producer warpgroup (one lane issues the loads)

struct Smem {
  alignas(1024) uint8_t q[kTileBytes];
  alignas(1024) uint8_t kv[kStages][kTileBytes];
  alignas(1024) uint8_t p[kPanelBytes];  // P [64 heads x 64 tokens] bf16, one 128-byte swizzled panel
  float red[2][kH];                      // per-WG row maxima of a tile; the row sums at the end
  int last;                              // this CTA is its request's last split to finish: it merges
  uint64_t full[kStages];                // TMA bytes arrived
  uint64_t empty[kStages];               // the 8 consumer warps are done with the slot
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;  // + alignment of the dynamic shared memory base

struct Params {
  CUtensorMap kv_map;  // 3-D [num_blocks][page][576] bf16, box {64, 64, 1}, 128-byte swizzle
  const __nv_bfloat16* q_lat;
  int64_t q_lat_sb, q_lat_sh;
  const __nv_bfloat16* q_pe;
  int64_t q_pe_sb, q_pe_sh;
  int page;
  const int* block_tables;
  int64_t bt_sb;
  const int* seq_lens;
  __nv_bfloat16* out;
  int64_t out_sb, out_sh;
  float* o_part;  // [B, S, H, L] fp32 (num_splits > 1): each split's o / l
  float* lse;     // [B, S, H] fp32 (num_splits > 1): each split's m + log2(l), -inf when empty
  int* done;      // [B] int32 (num_splits > 1): splits of the request finished; all zero between calls
  int num_splits;
  float scale_log2;  // softmax scale * log2(e)
  int pdl;
};

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

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Blocks until the phase of `bar` with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_addr(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

// 3-D TMA tile load into shared memory, completing `bytes` on `bar`.
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void named_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// Generic-proxy writes to shared memory become visible to the async proxy (wgmma operands).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving register reads / writes of a wgmma accumulator across the asynchronous region.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle (PTX ISA "Matrix Descriptor Format"): start address,
// leading / stride byte offsets (all >> 4), layout type 1 in bits 62-63. Base offset 0: every operand starts in a
// 1024-byte aligned swizzle pattern (panels are 1024-aligned; k offsets inside a row advance the address only).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// S[64 x 32] (+)= A[64 x 16] B[16 x 32]: A and B K-major in shared memory (128-byte swizzle descriptors).
__device__ __forceinline__ void wgmma_qk(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
      "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// O[64 x 256] (+)= A[64 x 16] B[16 x 256]: A K-major, B MN-major (transposed) in shared memory.
__device__ __forceinline__ void wgmma_pv(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

static_assert(kH * (kD / 8) % kConsumers == 0, "query chunks per consumer thread");
static_assert(kMaxSplits * kH * 4 <= kPanelBytes, "the merge weights fit in the P tile");
static_assert((kH * kL / 4) % (4 * kConsumers) == 0, "merge groups per thread");

// Per consumer warpgroup state of the online softmax over the KV tiles.
struct Softmax {
  float m0 = -INFINITY, m1 = -INFINITY;  // running row max of rows r0 / r1 (scaled, base 2)
  float l0 = 0.f, l1 = 0.f;              // this thread's partial row sums
};

// Steps 2-3 of a tile (see the header): mask, row maxima across both WGs, p into the shared P tile, O rescaled.
__device__ __forceinline__ void softmax_tile(Smem& sm, uint8_t* tile, float (&sc)[16], float (&o)[128], Softmax& st,
                                             int valid, int tile_valid, float scale_log2, int wg, int wtid, int lane,
                                             int r0, int r1, int cq) {
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool in = 8 * j + cq + e < valid;
      sc[4 * j + e] = in ? sc[4 * j + e] * scale_log2 : -INFINITY;
      sc[4 * j + 2 + e] = in ? sc[4 * j + 2 + e] * scale_log2 : -INFINITY;
      mx0 = fmaxf(mx0, sc[4 * j + e]);
      mx1 = fmaxf(mx1, sc[4 * j + 2 + e]);
    }
  }
  mx0 = quad_max(mx0);
  mx1 = quad_max(mx1);
  if ((lane & 3) == 0) {
    sm.red[wg][r0] = mx0;
    sm.red[wg][r1] = mx1;
  }
  named_bar_sync(2, kConsumers);
  const float n0 = fmaxf(st.m0, fmaxf(sm.red[0][r0], sm.red[1][r0]));
  const float n1 = fmaxf(st.m1, fmaxf(sm.red[0][r1], sm.red[1][r1]));
  const float al0 = exp2f(st.m0 - n0), al1 = exp2f(st.m1 - n1);  // m = -inf before the first tile: 0
  st.m0 = n0;
  st.m1 = n1;
  float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float p00 = exp2f(sc[4 * j] - n0), p01 = exp2f(sc[4 * j + 1] - n0);
    const float p10 = exp2f(sc[4 * j + 2] - n1), p11 = exp2f(sc[4 * j + 3] - n1);
    ps0 += p00 + p01;
    ps1 += p10 + p11;
    // p into the shared P tile: column 32 wg + 8 j + cq, i.e. 16-byte chunk 4 wg + j of the 128-byte row
    const int chunk = 4 * wg + j;
    *reinterpret_cast<__nv_bfloat162*>(sm.p + r0 * 128 + ((chunk ^ (r0 & 7)) << 4) + cq * 2) =
        __floats2bfloat162_rn(p00, p01);
    *reinterpret_cast<__nv_bfloat162*>(sm.p + r1 * 128 + ((chunk ^ (r1 & 7)) << 4) + cq * 2) =
        __floats2bfloat162_rn(p10, p11);
  }
  st.l0 = st.l0 * al0 + ps0;
  st.l1 = st.l1 * al1 + ps1;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    o[4 * j] *= al0;
    o[4 * j + 1] *= al0;
    o[4 * j + 2] *= al1;
    o[4 * j + 3] *= al1;
  }
  if (tile_valid < kTN) {  // value rows past the context: zero this WG's 4 value panels there
    const uint4 z = make_uint4(0, 0, 0, 0);
    for (int c = wtid; c < (kTN - tile_valid) * 4 * 8; c += 128) {
      const int row = tile_valid + c / 32, pn = 4 * wg + ((c >> 3) & 3);
      *reinterpret_cast<uint4*>(tile + pn * kPanelBytes + row * 128 + ((c & 7) << 4)) = z;
    }
  }
  fence_proxy_async();
  named_bar_sync(3, kConsumers);
}

// Step 1: S = Q . K^T over this WG's 32 tokens of the tile (issued, not waited for).
__device__ __forceinline__ void issue_qk(float (&sc)[16], uint32_t q_base, uint32_t kv_base, int wg) {
#pragma unroll
  for (int j = 0; j < 16; ++j) sc[j] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < kD / 16; ++k) {
    const uint32_t off = (k >> 2) * kPanelBytes + (k & 3) * 32;
    wgmma_qk(sc, smem_desc(q_base + off, 16, 1024), smem_desc(kv_base + off + wg * kHalf * 128, 16, 1024), k > 0);
  }
  wgmma_commit();
}

// Step 4: O_w += P . V_w (V: tokens x dims, dims contiguous -> the MN-major B operand: leading byte offset = the
// next 64-dim panel, stride byte offset = the next 8 tokens). Issued, not waited for.
__device__ __forceinline__ void issue_pv(float (&o)[128], uint32_t p_base, uint32_t kv_base, int wg) {
  fence_regs(o);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < kTN / 16; ++k)
    wgmma_pv(o, smem_desc(p_base + k * 32, 16, 1024),
             smem_desc(kv_base + 4 * wg * kPanelBytes + k * 16 * 128, kPanelBytes, 1024), 1);
  wgmma_commit();
}

// The merge of request b's splits by its last CTA's 256 consumer threads (1 < num_splits <= kMaxSplits): thread h < 64
// turns head h's lse over the splits that had tiles into weights 2^(lse_s - max) / sum in shared memory (the P tile,
// free now); then every thread sums 32 of the [64 x 512] output's float4 groups over the splits, 4 groups at a time
// (4 x used loads in flight), from L2 (__ldcg: written by other CTAs during this kernel).
__device__ __forceinline__ void merge_splits(Smem& sm, const Params& a, int b, int seq_len, int tid) {
  const int n_tiles = seq_len > 0 ? (seq_len + kTN - 1) / kTN : 0;
  const int per = (n_tiles + a.num_splits - 1) / a.num_splits;
  const int used = n_tiles > 0 ? (n_tiles + per - 1) / per : 0;  // splits with at least one tile
  float* w = reinterpret_cast<float*>(sm.p);                      // [used][64]
  if (tid < kH) {
    const float* lse = a.lse + (int64_t)b * a.num_splits * kH + tid;
    float mx = -INFINITY;
    for (int s = 0; s < used; ++s) mx = fmaxf(mx, __ldcg(lse + s * kH));
    float sum = 0.f;
    for (int s = 0; s < used; ++s) {
      const float e = exp2f(__ldcg(lse + s * kH) - mx);
      w[s * kH + tid] = e;
      sum += e;
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int s = 0; s < used; ++s) w[s * kH + tid] *= inv;
  }
  named_bar_sync(5, kConsumers);
  const float4* part = reinterpret_cast<const float4*>(a.o_part + (int64_t)b * a.num_splits * kH * kL);
  constexpr int kGroups = kH * kL / 4;  // float4 groups of one split's [64 x 512]
  for (int g0 = tid; g0 < kGroups; g0 += 4 * kConsumers) {
    float4 acc[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) acc[u] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < used; ++s) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int g = g0 + u * kConsumers;
        const float ws = w[s * kH + g / (kL / 4)];
        const float4 v = __ldcg(part + (int64_t)s * kGroups + g);
        acc[u].x += ws * v.x;
        acc[u].y += ws * v.y;
        acc[u].z += ws * v.z;
        acc[u].w += ws * v.w;
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int g = g0 + u * kConsumers, h = g / (kL / 4), c = (g % (kL / 4)) * 4;
      const __nv_bfloat162 lo = __floats2bfloat162_rn(acc[u].x, acc[u].y), hi = __floats2bfloat162_rn(acc[u].z, acc[u].w);
      *reinterpret_cast<uint2*>(a.out + b * a.out_sb + h * a.out_sh + c) =
          make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) mla_decode_kernel(const __grid_constant__ Params a) {
  extern __shared__ uint8_t smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const int split = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  // lengths / tables were copied in before the preceding kernel started (see the header): read before the wait
  const int seq_len = a.seq_lens[b];
  const int n_tiles = seq_len > 0 ? (seq_len + kTN - 1) / kTN : 0;
  const int per = (n_tiles + a.num_splits - 1) / a.num_splits;
  const int t_begin = min(split * per, n_tiles), t_end = min(t_begin + per, n_tiles);
  const int nt = t_end - t_begin;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&sm.full[s], 1);
      mbar_init(&sm.empty[s], kConsumers / 32);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (tid >= kConsumers) {  // the producer warpgroup: one lane issues every load
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid == kConsumers) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&a.kv_map)) : "memory");
      bool waited = !a.pdl;
      for (int i = 0; i < nt; ++i) {
        const int t = t_begin + i, s = i % kStages;
        if (!waited && (t + 1) * kTN >= seq_len) {  // this tile holds the step's new token: written upstream
          grid_dependency_wait();
          waited = true;
        }
        mbar_wait(&sm.empty[s], ((i / kStages) & 1) ^ 1);
        mbar_expect_tx(&sm.full[s], kTileBytes);
        const int tok = t * kTN;
        const int blk = a.block_tables[b * a.bt_sb + tok / a.page];
#pragma unroll
        for (int p = 0; p < kPanels; ++p)
          tma_load_3d(sm.kv[s] + p * kPanelBytes, &a.kv_map, p * 64, tok % a.page, blk, &sm.full[s]);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");  // 256 x 232 + 128 x 40 <= 64 K registers
  const int wg = tid >> 7, wtid = tid & 127, lane = tid & 31;
  const int r0 = ((wtid >> 5) << 4) + (lane >> 2), r1 = r0 + 8;  // the two rows (heads) this thread holds
  const int cq = (lane & 3) * 2;                                  // its column pair inside each 8-column block

  if (a.pdl) grid_dependency_wait();
  // the query row [64 x 576] into 9 swizzled panels: 16-byte chunk c of row h -> panel c / 8, slot (c % 8) ^ (h % 8);
  // all 18 copies of a thread in flight at once (cp.async), then waited for
#pragma unroll
  for (int it = 0; it < kH * (kD / 8) / kConsumers; ++it) {
    const int c = tid + it * kConsumers, h = c / (kD / 8), ch = c % (kD / 8);
    const __nv_bfloat16* src = ch < kL / 8 ? a.q_lat + b * a.q_lat_sb + h * a.q_lat_sh + ch * 8
                                           : a.q_pe + b * a.q_pe_sb + h * a.q_pe_sh + (ch - kL / 8) * 8;
    cp_async16(sm.q + (ch >> 3) * kPanelBytes + h * 128 + (((ch & 7) ^ (h & 7)) << 4), src);
  }
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
  fence_proxy_async();
  named_bar_sync(1, kConsumers);

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  Softmax st;
  float sc[16];
  const uint32_t q_base = smem_addr(sm.q), p_base = smem_addr(sm.p);

  for (int i = 0; i < nt; ++i) {
    const int s = i % kStages;
    const uint32_t kv_base = smem_addr(sm.kv[s]);
    mbar_wait(&sm.full[s], (i / kStages) & 1);
    issue_qk(sc, q_base, kv_base, wg);
    wgmma_wait<0>();
    fence_regs(sc);
    const int tile_tok = (t_begin + i) * kTN;
    softmax_tile(sm, sm.kv[s], sc, o, st, seq_len - tile_tok - wg * kHalf, seq_len - tile_tok, a.scale_log2, wg,
                 wtid, lane, r0, r1, cq);
    issue_pv(o, p_base, kv_base, wg);
    wgmma_wait<0>();
    fence_regs(o);
    __syncwarp();
    if (lane == 0) mbar_arrive(&sm.empty[s]);  // the slot is free for the tile after next
  }
  if (a.pdl) launch_dependents();

  // row sums of both WGs (the last tile's reads of red are behind barrier 3)
  const float l0 = quad_sum(st.l0), l1 = quad_sum(st.l1);
  if ((lane & 3) == 0) {
    sm.red[wg][r0] = l0;
    sm.red[wg][r1] = l1;
  }
  named_bar_sync(4, kConsumers);
  const float s0 = sm.red[0][r0] + sm.red[1][r0], s1 = sm.red[0][r1] + sm.red[1][r1];
  const int col0 = wg * 256 + cq;
  if (a.num_splits == 1) {  // o_lat itself
    const float i0 = s0 > 0.f ? 1.f / s0 : 0.f, i1 = s1 > 0.f ? 1.f / s1 : 0.f;
    __nv_bfloat16* out0 = a.out + b * a.out_sb + r0 * a.out_sh + col0;
    __nv_bfloat16* out1 = a.out + b * a.out_sb + r1 * a.out_sh + col0;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      *reinterpret_cast<__nv_bfloat162*>(out0 + 8 * j) = __floats2bfloat162_rn(o[4 * j] * i0, o[4 * j + 1] * i0);
      *reinterpret_cast<__nv_bfloat162*>(out1 + 8 * j) =
          __floats2bfloat162_rn(o[4 * j + 2] * i1, o[4 * j + 3] * i1);
    }
  } else {  // this split's o / l and lse into the workspace; the request's last split to finish merges them
    const float i0 = s0 > 0.f ? 1.f / s0 : 0.f, i1 = s1 > 0.f ? 1.f / s1 : 0.f;
    float* op = a.o_part + ((int64_t)b * a.num_splits + split) * kH * kL;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      *reinterpret_cast<float2*>(op + r0 * kL + col0 + 8 * j) = make_float2(o[4 * j] * i0, o[4 * j + 1] * i0);
      *reinterpret_cast<float2*>(op + r1 * kL + col0 + 8 * j) = make_float2(o[4 * j + 2] * i1, o[4 * j + 3] * i1);
    }
    if (wg == 0 && (lane & 3) == 0) {
      float* lse = a.lse + ((int64_t)b * a.num_splits + split) * kH;
      lse[r0] = s0 > 0.f ? st.m0 + log2f(s0) : -INFINITY;
      lse[r1] = s1 > 0.f ? st.m1 + log2f(s1) : -INFINITY;
    }
    __threadfence();  // this split's partial is visible device-wide before it counts itself done
    named_bar_sync(5, kConsumers);
    if (tid == 0) {
      const int prev = atomicAdd(a.done + b, 1);
      sm.last = prev == a.num_splits - 1;
      if (sm.last) a.done[b] = 0;  // reset for the next call (every split of this call has counted)
    }
    named_bar_sync(5, kConsumers);
    if (sm.last) {
      __threadfence();  // acquire: the other splits' partials
      merge_splits(sm, a, b, seq_len, tid);
    }
  }
}

cudaError_t launch_ex(const void* fn, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int pdl,
                      const Params& a) {
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
  void* args[] = {const_cast<Params*>(&a)};
  return cudaLaunchKernelExC(&cfg, fn, args);
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static std::atomic<void*> fn{nullptr};
  void* p = fn.load();
  if (p == nullptr) {
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return nullptr;
    fn.store(p);
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
}

// The opt-in above 48 KB of shared memory: a function attribute of each device, set once per device (0..63).
cudaError_t allow_smem() {
  static std::atomic<uint64_t> attr_set{0};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const uint64_t bit = dev < 64 ? (uint64_t{1} << dev) : 0;
  if (bit == 0 || !(attr_set.load() & bit)) {
    err = cudaFuncSetAttribute(mla_decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmemBytes);
    if (err != cudaSuccess) return err;
    attr_set.fetch_or(bit);
  }
  return cudaSuccess;
}

}  // namespace

// Host launcher. Shapes: H = 64 heads, L = 512, R = 64 (the only ones compiled). q_lat [B, 64, 512] and q_pe
// [B, 64, 64] bf16 with unit last stride and 16-byte aligned rows (strides in elements); kv [num_blocks, page, 576]
// bf16, unit last stride, 16-byte aligned base and strides, page a multiple of 64; block_tables [B, >= cdiv(max
// seq, page)] int32 (row stride bt_sb); seq_lens [B] int32; out [B, 64, 512] bf16, unit last stride, 16-byte
// aligned rows; with num_splits > 1: o_part [B, num_splits, 64, 512] and lse [B, num_splits, 64] fp32
// (contiguous) and done [B] int32, all zero before the call (the kernel leaves them zero). pdl: 0 off, 1 on.
// Returns cudaErrorInvalidValue for anything else (cudaErrorNotSupported without the driver's tensor-map entry
// point).
extern "C" cudaError_t kimi_mla_decode(const void* q_lat, int64_t q_lat_sb, int64_t q_lat_sh, const void* q_pe,
                                       int64_t q_pe_sb, int64_t q_pe_sh, const void* kv, int64_t num_blocks,
                                       int64_t kv_sblk, int64_t kv_stok, int page, const int* block_tables,
                                       int64_t bt_sb, const int* seq_lens, void* out, int64_t out_sb,
                                       int64_t out_sh, float* o_part, float* lse, int* done, int batch,
                                       int num_splits, float scale, int pdl, cudaStream_t stream) {
  if (batch <= 0 || batch > 65535 || num_splits <= 0 || num_splits > kMaxSplits || page <= 0 || page % kTN != 0 ||
      num_blocks <= 0 || pdl < 0 || pdl > 1 ||
      (num_splits > 1 && (o_part == nullptr || lse == nullptr || done == nullptr)) ||
      reinterpret_cast<uintptr_t>(kv) % 16 != 0 || kv_stok % 8 != 0 || kv_sblk % 8 != 0)
    return cudaErrorInvalidValue;
  Params a;
  PFN_cuTensorMapEncodeTiled_v12000 encode = encode_fn();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(kD), static_cast<cuuint64_t>(page),
                              static_cast<cuuint64_t>(num_blocks)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(kv_stok) * 2, static_cast<cuuint64_t>(kv_sblk) * 2};
  const cuuint32_t box[3] = {64, kTN, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  if (encode(&a.kv_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(kv), dims, strides, box,
             elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return cudaErrorInvalidValue;
  a.q_lat = static_cast<const __nv_bfloat16*>(q_lat);
  a.q_lat_sb = q_lat_sb;
  a.q_lat_sh = q_lat_sh;
  a.q_pe = static_cast<const __nv_bfloat16*>(q_pe);
  a.q_pe_sb = q_pe_sb;
  a.q_pe_sh = q_pe_sh;
  a.page = page;
  a.block_tables = block_tables;
  a.bt_sb = bt_sb;
  a.seq_lens = seq_lens;
  a.out = static_cast<__nv_bfloat16*>(out);
  a.out_sb = out_sb;
  a.out_sh = out_sh;
  a.o_part = o_part;
  a.lse = lse;
  a.done = done;
  a.num_splits = num_splits;
  a.scale_log2 = scale * 1.4426950408889634f;
  a.pdl = pdl;
  const cudaError_t err = allow_smem();
  if (err != cudaSuccess) return err;
  return launch_ex(reinterpret_cast<const void*>(mla_decode_kernel), dim3(num_splits, batch, 1), dim3(kThreads, 1, 1),
                   kSmemBytes, stream, pdl, a);
}

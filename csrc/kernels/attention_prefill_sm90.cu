// Causal GQA attention of a prefill chunk on Hopper's warpgroup MMA (wgmma), head_dim 128: the
// FlashAttention-3 arithmetic without its warp specialization; a short chunk deep in a context splits its
// keys over more blocks (flash-decoding's split and merge) where its own blocks would leave SMs idle. Two
// consumer warpgroups per block, each owning 64 packed (query token, head) rows of ONE kv head (p = m * G + g, as
// attention_prefill.cu packs them), share every 128-key K/V tile in shared memory. S = Q K^T reads Q and K from shared
// memory (wgmma SS); P stays in registers as the A operand of O += P V (wgmma RS, V transposed by the
// descriptor); the online softmax runs in the accumulators' registers and overlaps P V. K/V tiles land
// through a 3-stage cp.async ring in the 128-byte-swizzled layout wgmma reads.
// Why, the layout arithmetic and the measurements: docs/design/attention_prefill.md.
//
// Contract of attention_prefill_wgmma_kernel, grid (ceil(M * G / 128), Hkv, splits) x 256 threads,
// kWgSmem bytes of dynamic shared memory, built for sm_90a only:
//  Inputs   q bf16 [M, H, 128] (rotated), caches bf16 [capacity, Hkv, 128] holding rows [0, *pos + M)
//           (the chunk's own rows appended already), *pos in device memory. Query m (position *pos + m)
//           attends to rows [0, *pos + m]. Rows at or past *pos + M are never read (the loader
//           zero-fills them), so their contents do not matter.
//  Before its PDL wait nothing: q, *pos and the chunk's cache rows come from the kernel before.
//  Triggers its dependents (the o GEMM, or the merge) after its key loop.
//  Writes   one split: out bf16 [M, H, 128], every element once. splits > 1: block z takes the z-th of
//           `splits` equal runs of the key tiles its rows see and writes, for each of its packed rows p of
//           kv head h, the unnormalized O (fp32 [128]) and (max in log2 units, sum) to the scratch at
//           ((h * M * G + p) * splits + z) (O first, then the pairs); a run past its keys writes (max, 0).
//           attention_prefill_merge_kernel (after it, PDL) then writes out from them. Nothing is kept in
//           the scratch between calls.
#include <cstdint>

#include "atomflow/kernels.h"
#include "atomflow/pdl.cuh"
#include "attention_prefill_block.cuh"
#include "attention_prefill_sm90.h"

namespace atomflow::kernels {

namespace {

constexpr int kWgD = 128;     // head_dim: two 64-column swizzle atoms per row
constexpr int kWgRows = 64;   // packed rows per warpgroup: the wgmma M
constexpr int kWgGroups = 2;  // warpgroups per block
constexpr int kWgThreads = 128 * kWgGroups;
constexpr int kWgKeys = 128;                // keys per K/V tile: S's N, and 8 k-steps of P V
constexpr int kWgTileRows = 128;            // rows of every shared tile (Q: kWgGroups x kWgRows; K, V: kWgKeys)
constexpr int kWgHalf = kWgTileRows * 128;  // one 64-column half of a tile: 128 rows of 128 bytes
constexpr int kWgTile = 2 * kWgHalf;        // a 128 x 128 bf16 tile, 32 KB
constexpr int kWgStages = 3;                // K/V stages: tile kt + 2 loads while tiles kt (V) and kt + 1 (K) are read
static_assert(kWgGroups * kWgRows == kWgTileRows && kWgKeys == kWgTileRows, "Q, K and V tiles share one layout");

// Byte offset of 16-byte chunk ch (0..15) of row r in a tile: columns 64 a .. 64 a + 63 (a = ch / 8)
// form a half of 128-byte rows, and the chunk index within the row is XORed with r % 8 (the 128-byte
// swizzle, which wgmma applies to address bits 4-6 from bits 7-9: halves are 1024-byte aligned).
__device__ __forceinline__ uint32_t wg_offset(int r, int ch) {
  return (ch / 8) * kWgHalf + r * 128 + (((ch % 8) ^ (r % 8)) << 4);
}

// A shared-memory matrix descriptor with the 128-byte swizzle. lbo, sbo in bytes:
//  K-major operand (Q, K: 64-column halves of 128-byte rows): sbo = 1024 between groups of 8 rows,
//    lbo unused (1); a k-step of 16 columns advances the start by 32 bytes within the half.
//  MN-major operand (V, read transposed: N = head_dim contiguous): lbo = the 64-column halves' stride,
//    sbo = 1024 between groups of 8 keys; a k-step of 16 keys advances the start by 2048 bytes.
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | static_cast<uint64_t>(lbo >> 4) << 16 |
         static_cast<uint64_t>(sbo >> 4) << 32 | 1ull << 62;
}

#define AF_WG_D64                                                                    \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define AF_WG_D64_OPS                                                                                         \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),  \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), \
      "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), \
      "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
      "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d (64 x 128 fp32) = (accumulate ? d : 0) + A (64 x 16, shared, K-major) * B (16 x 128, shared, K-major).
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" AF_WG_D64 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : AF_WG_D64_OPS
      : "l"(a), "l"(b), "r"(accumulate));
}
// d += A (64 x 16, registers) * B (16 x 128, shared, MN-major: the descriptor transposes it).
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" AF_WG_D64
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : AF_WG_D64_OPS
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
#undef AF_WG_D64
#undef AF_WG_D64_OPS

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// The accumulators are written asynchronously: no read of them may move above the wait.
__device__ __forceinline__ void wg_fence_regs(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// P's registers are wgmma's A operand until the wait: they must not be reused before it.
__device__ __forceinline__ void wg_fence_regs(uint32_t (&a)[kWgKeys / 16][4]) {
#pragma unroll
  for (int i = 0; i < kWgKeys / 16; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}

// One tile's online softmax on S (64 fp32 accumulators of a thread, layout below), the raw scores Q K^T;
// q_scale takes them to log2 units. The causal mask only where the tile crosses a row's limit of the warp.
// Updates the running max (log2 units), rescales the running sum, returns the factor O must be rescaled
// by, and leaves the probabilities exp2(s q_scale - max) in s: one FFMA and one MUFU.EX2 each (the max
// is taken on the raw scores: rounding is monotonic, so max(s) q_scale is the max of the products).
// wg_pack_tile rounds them to bf16 as the A fragments of the tile's 8 k-steps of 16 keys (n8 tiles 2 kk
// and 2 kk + 1 of S) and adds the rounded values to the sum.
struct WgRows {
  int lim0, lim1, warp_lo;   // the last key rows g and g + 8 see; the lowest limit of the warp
  float m_run[2], l_run[2];  // l: this lane's columns only
};
__device__ __forceinline__ void wg_softmax(float (&s)[64], int kb, float q_scale, int c, WgRows& r, float (&corr)[2]) {
  if (kb + kWgKeys - 1 > r.warp_lo) {
#pragma unroll
    for (int j = 0; j < kWgKeys / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (kb + 8 * j + 2 * c + (e & 1) > (e < 2 ? r.lim0 : r.lim1)) s[4 * j + e] = -INFINITY;
  }
  float mx[2] = {s[0], s[2]};
#pragma unroll
  for (int j = 0; j < kWgKeys / 8; ++j) {
    mx[0] = fmaxf(mx[0], fmaxf(s[4 * j], s[4 * j + 1]));
    mx[1] = fmaxf(mx[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // the 4 lanes of a quad share a row
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    const float m_new = fmaxf(r.m_run[i], mx[i] * q_scale);  // finite: m_run starts at kPfNegInit
    corr[i] = pf_exp2(r.m_run[i] - m_new);                   // in (0, 1]
    r.m_run[i] = m_new;
    r.l_run[i] *= corr[i];
  }
  const float neg_m[2] = {-r.m_run[0], -r.m_run[1]};
#pragma unroll
  for (int j = 0; j < kWgKeys / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[4 * j + e] = pf_exp2(fmaf(s[4 * j + e], q_scale, neg_m[e / 2]));
}
__device__ __forceinline__ void wg_pack_tile(const float (&s)[64], WgRows& r, uint32_t (&p)[kWgKeys / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kWgKeys / 16; ++kk) {
    const float* t = s + 8 * kk;
    p[kk][0] = pf_pack_p(t[0], t[1], r.l_run[0]);
    p[kk][1] = pf_pack_p(t[2], t[3], r.l_run[1]);
    p[kk][2] = pf_pack_p(t[4], t[5], r.l_run[0]);
    p[kk][3] = pf_pack_p(t[6], t[7], r.l_run[1]);
  }
}

__device__ __forceinline__ void wg_rescale(float (&o)[64], const float (&corr)[2]) {
#pragma unroll
  for (int j = 0; j < kWgD / 8; ++j) {
    o[4 * j] *= corr[0];
    o[4 * j + 1] *= corr[0];
    o[4 * j + 2] *= corr[1];
    o[4 * j + 3] *= corr[1];
  }
}

// Accumulator layout (m64nNk16, fp32): thread 32 w + 4 g + c of the warpgroup holds rows 16 w + g
// (d[4 j], d[4 j + 1]) and 16 w + g + 8 (d[4 j + 2], d[4 j + 3]) at columns 8 j + 2 c, 8 j + 2 c + 1.
// The A register fragment of a 16-key k-step is the same rows: {row g, keys 2c..}, {row g + 8, 2c..},
// {row g, 2c + 8..}, {row g + 8, 2c + 8..}, so P goes from S's registers to A's without a shuffle.
//
// FlashAttention-3's intra-warpgroup pipeline: step kt issues S(kt + 1) = Q K(kt + 1)^T, then
// O += P(kt) V(kt), waits for S only and runs tile kt + 1's softmax (the exponentials, in S's
// registers) while P V is on the tensor cores; then it waits for P V, rescales O and packs P(kt + 1)
// into the registers P(kt) held.
__global__ void __launch_bounds__(kWgThreads, 1)
    attention_prefill_wgmma_kernel(const bf16* q, const bf16* k_cache, const bf16* v_cache, const int32_t* pos_ptr,
                                   int M, int H, int Hkv, int capacity, float q_scale, bf16* out, float* part) {
  constexpr int CH = kWgD / 8;  // 16-byte chunks per row
  constexpr int kLoads = kWgTileRows * CH / kWgThreads;
  constexpr int KP = kWgKeys / 16;  // k-steps of P V
  extern __shared__ uint8_t wg_smem[];
  // wgmma's swizzle is a function of the address: every half starts on a 1024-byte boundary.
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem));
  const uint32_t sQ = (raw + 1023) & ~1023u;
  auto sK = [&](int kt) { return sQ + kWgTile * (1 + 2 * (kt % kWgStages)); };  // tile kt's stage
  auto sV = [&](int kt) { return sQ + kWgTile * (2 + 2 * (kt % kWgStages)); };

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wg = warp / 4, wq = warp % 4, g = lane / 4, c = lane % 4;
  const PrefillBlock b = prefill_block<kWgTileRows>(pos_ptr, M, H, Hkv, capacity);  // after the PDL wait
  const int G = b.G, rows = b.rows, p0 = b.p0, h = b.h, pos = b.pos, n_keys = b.n_keys;
  const int n_kt = CEIL_DIV(n_keys, kWgKeys);
  // This block's key tiles [kt0, kt1): split blockIdx.z of the n_kt its rows see (all of them unsplit).
  const int splits = gridDim.z, z = blockIdx.z, per = CEIL_DIV(n_kt, splits);
  const int kt0 = min(n_kt, z * per), kt1 = min(n_kt, kt0 + per);
  const int r0 = wg * kWgRows + wq * 16 + g;  // this lane's first row (and r0 + 8)
  // A split's partial of packed row p: O (unnormalized, fp32 [128]) at part_o(p), (max in log2 units, sum) at
  // part_ml(p); the merge kernel's layout.
  const size_t part_rows = static_cast<size_t>(Hkv) * rows * splits;
  auto part_o = [&](int p) { return part + ((static_cast<size_t>(h) * rows + p) * splits + z) * kWgD; };
  auto part_ml = [&](int p) {
    return part + part_rows * kWgD + ((static_cast<size_t>(h) * rows + p) * splits + z) * 2;
  };
  if (kt0 >= kt1) {  // a split past the keys of this block's rows: an empty partial
    for (int i = 0; i < 2; ++i) {
      const int p = p0 + r0 + 8 * i;
      if (c == 0 && p < rows) *reinterpret_cast<float2*>(part_ml(p)) = make_float2(kPfNegInit, 0.f);
    }
    pdl_launch_dependents();
    return;
  }

  // Q tile: packed row p = m * G + gh is q row (m, head h * G + gh); rows past M * G are zeros.
#pragma unroll
  for (int n = 0; n < kLoads; ++n) {
    const int i = tid + n * kWgThreads, r = i / CH, ch = i % CH, p = p0 + r;
    const bool ok = p < rows;
    const int m = ok ? p / G : 0, gh = ok ? p % G : 0;
    pf_cp_async16(sQ + wg_offset(r, ch), q + (static_cast<size_t>(m) * H + h * G + gh) * kWgD + ch * 8, ok);
  }
  asm volatile("cp.async.commit_group;");

  const size_t key_stride = static_cast<size_t>(Hkv) * kWgD;
  auto load_kv = [&](int kt) {
#pragma unroll
    for (int n = 0; n < kLoads; ++n) {
      const int i = tid + n * kWgThreads, r = i / CH, ch = i % CH, key = kt * kWgKeys + r;
      const bool ok = key < n_keys;  // past the block's keys: zeros, never the (unwritten) cache row
      const size_t off = (ok ? key : 0) * key_stride + static_cast<size_t>(h) * kWgD + ch * 8;
      const uint32_t o = wg_offset(r, ch);
      pf_cp_async16(sK(kt) + o, k_cache + off, ok);
      pf_cp_async16(sV(kt) + o, v_cache + off, ok);
    }
    asm volatile("cp.async.commit_group;");
  };
  // Every thread's chunks of the tiles in flight have landed (all but the newest `pending` groups),
  // and wgmma (the async proxy) sees them once the block has synchronized.
  auto landed = [&](bool pending) {
    if (pending)
      asm volatile("cp.async.wait_group 1;" ::: "memory");
    else
      asm volatile("cp.async.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
  };
  auto issue_s = [&](float (&s)[64], int kt) {
#pragma unroll
    for (int ks = 0; ks < kWgD / 16; ++ks) {
      const uint32_t col = (ks / 4) * kWgHalf + (ks % 4) * 32;
      wgmma_ss(s, wg_desc(sQ + col + wg * kWgRows * 128, 16, 1024), wg_desc(sK(kt) + col, 16, 1024), ks > 0);
    }
    wgmma_commit();
  };
  auto issue_pv = [&](float (&o)[64], const uint32_t (&p)[KP][4], int kt) {
#pragma unroll
    for (int kk = 0; kk < KP; ++kk) wgmma_rs(o, p[kk], wg_desc(sV(kt) + kk * 16 * 128, kWgHalf, 1024));
    wgmma_commit();
  };

  // Causal limits (the last key each row sees): this lane's rows, its warp's lowest, and its
  // warpgroup's highest. Rows past M * G take the last row's limit: finite scores, never written.
  auto limit = [&](int r) { return pos + min(p0 + r, rows - 1) / G; };
  WgRows st{limit(r0), limit(r0 + 8), limit(wg * kWgRows + wq * 16), {kPfNegInit, kPfNegInit}, {0.f, 0.f}};
  const int wg_tiles = min(kt1, limit(wg * kWgRows + kWgRows - 1) / kWgKeys + 1);  // this warpgroup's end

  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float s[64], corr[2];

  uint32_t p[KP][4];
  load_kv(kt0);
  if (kt0 + 1 < kt1) load_kv(kt0 + 1);
  landed(kt0 + 1 < kt1);  // tile kt0 (and Q)
  if (kt0 < wg_tiles) {   // unsplit, every row sees key 0: every warpgroup has tile 0
    wgmma_fence();
    issue_s(s, kt0);
    wgmma_wait<0>();
    wg_fence_regs(s);
    wg_softmax(s, kt0 * kWgKeys, q_scale, c, st, corr);  // O is 0: no rescale
    wg_pack_tile(s, st, p);
  }
  for (int kt = kt0; kt < kt1; ++kt) {
    landed(false);  // tile kt + 1; and every warpgroup is past step kt - 1, so tile kt - 1's stage is free
    if (kt + 2 < kt1) load_kv(kt + 2);
    if (kt + 1 < wg_tiles) {  // P(kt) in p: issue S(kt + 1), then P(kt) V(kt)
      wgmma_fence();
      issue_s(s, kt + 1);
      issue_pv(o, p, kt);
      wgmma_wait<1>();  // S(kt + 1) only: P V may still run under the softmax
      wg_fence_regs(s);
      wg_softmax(s, (kt + 1) * kWgKeys, q_scale, c, st, corr);
      wgmma_wait<0>();
      wg_fence_regs(o);
      wg_fence_regs(p);
      wg_rescale(o, corr);
      wg_pack_tile(s, st, p);
    } else if (kt + 1 == wg_tiles) {  // this warpgroup's last tile
      wgmma_fence();
      issue_pv(o, p, kt);
      wgmma_wait<0>();
      wg_fence_regs(o);
      wg_fence_regs(p);
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");  // only empty groups can be pending
  pdl_launch_dependents();

  // Out: row (m, head h * G + gh) of packed row p = m * G + gh; l > 0 (key 0 is seen by every row). Split:
  // the partial (a row that sees none of the split's keys has l = 0 and O = 0).
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float l = st.l_run[i];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int p = p0 + r0 + 8 * i;
    if (p >= rows) continue;
    if (splits > 1) {
      float* const dst = part_o(p) + 2 * c;
#pragma unroll
      for (int j = 0; j < kWgD / 8; ++j)
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[4 * j + 2 * i], o[4 * j + 2 * i + 1]);
      if (c == 0) *reinterpret_cast<float2*>(part_ml(p)) = make_float2(st.m_run[i], l);
      continue;
    }
    const int m = p / G, gh = p % G;
    bf16* const dst = out + (static_cast<size_t>(m) * H + h * G + gh) * kWgD + 2 * c;
    const float inv_l = 1.f / l;
#pragma unroll
    for (int j = 0; j < kWgD / 8; ++j)
      *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) =
          __floats2bfloat162_rn(o[4 * j + 2 * i] * inv_l, o[4 * j + 2 * i + 1] * inv_l);
  }
}

// The splits' partials of each packed row into its output row: one warp per (kv head, packed row), lane s
// reads split s's (max, sum), lane t sums columns 4 t .. 4 t + 3 of O over the splits weighted by
// 2^(max_s - max); splits whose sum is 0 (no key of the row) are skipped. Grid ceil(Hkv * rows / 8) x 256.
__global__ void __launch_bounds__(256)
    attention_prefill_merge_kernel(const float* part, int rows, int H, int Hkv, int splits, bf16* out) {
  pdl_wait();  // the partials are the previous kernel's
  pdl_launch_dependents();
  const int warp = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= Hkv * rows) return;
  const int h = warp / rows, p = warp % rows, G = H / Hkv;
  const float* const o = part + static_cast<size_t>(warp) * splits * kWgD + 4 * lane;
  const float2 ml = lane < splits
                        ? __ldcg(reinterpret_cast<const float2*>(
                              part + static_cast<size_t>(Hkv) * rows * splits * kWgD + (warp * splits + lane) * 2))
                        : make_float2(kPfNegInit, 0.f);
  float mx = ml.y > 0.f ? ml.x : kPfNegInit;
#pragma unroll
  for (int d = 16; d > 0; d /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
  const float w = ml.y > 0.f ? pf_exp2(ml.x - mx) : 0.f;
  float l = w * ml.y;
#pragma unroll
  for (int d = 16; d > 0; d /= 2) l += __shfl_xor_sync(0xffffffffu, l, d);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s = 0; s < splits; ++s) {
    const float ws = __shfl_sync(0xffffffffu, w, s);
    if (ws == 0.f) continue;
    const float4 v = __ldcg(reinterpret_cast<const float4*>(o + static_cast<size_t>(s) * kWgD));
    acc.x = fmaf(ws, v.x, acc.x);
    acc.y = fmaf(ws, v.y, acc.y);
    acc.z = fmaf(ws, v.z, acc.z);
    acc.w = fmaf(ws, v.w, acc.w);
  }
  const float inv_l = 1.f / l;  // split 0 holds key 0, which every row sees: l > 0
  const int m = p / G, gh = p % G;
  __nv_bfloat162* const dst =
      reinterpret_cast<__nv_bfloat162*>(out + (static_cast<size_t>(m) * H + h * G + gh) * kWgD + 4 * lane);
  dst[0] = __floats2bfloat162_rn(acc.x * inv_l, acc.y * inv_l);
  dst[1] = __floats2bfloat162_rn(acc.z * inv_l, acc.w * inv_l);
}

constexpr size_t kWgSmem = static_cast<size_t>(kWgTile) * (1 + 2 * kWgStages) + 1024;  // + the alignment

}  // namespace

// ---- launcher ----

int attention_prefill_wgmma_head_dim() { return kWgD; }
int attention_prefill_wgmma_rows() { return kWgTileRows; }
int attention_prefill_wgmma_threads() { return kWgThreads; }
size_t attention_prefill_wgmma_smem() { return kWgSmem; }

size_t attention_prefill_wgmma_scratch(int M, int H, int splits) {
  return splits > 1 ? static_cast<size_t>(M) * H * splits * (kWgD + 2) * sizeof(float) : 0;
}

void attention_prefill_wgmma(int tiles, int splits, const bf16* q, const bf16* k_cache, const bf16* v_cache,
                             const int32_t* pos, int M, int H, int Hkv, int max_context, float q_scale, bf16* out,
                             float* scratch, cudaStream_t stream) {
  static const bool configured = [] {
    AF_CUDA_CHECK(cudaFuncSetAttribute(attention_prefill_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kWgSmem)));
    return true;
  }();
  (void)configured;
  // The merge reads one split a lane: at most a warp's.
  AF_CHECK(splits >= 1 && splits <= kPrefillAttnMaxSplits && kPrefillAttnMaxSplits <= 32,
           "attention_prefill_wgmma: splits must be in 1..kPrefillAttnMaxSplits");
  af_launch(attention_prefill_wgmma_kernel, dim3(tiles, Hkv, splits), dim3(kWgThreads), kWgSmem, stream, q, k_cache,
            v_cache, pos, M, H, Hkv, max_context, q_scale, out, scratch);
  if (splits > 1) {
    const int rows = M * (H / Hkv);
    af_launch(attention_prefill_merge_kernel, dim3(CEIL_DIV(Hkv * rows, 8)), dim3(256), 0, stream,
              static_cast<const float*>(scratch), rows, H, Hkv, splits, out);
  }
}

}  // namespace atomflow::kernels

// W8A16 GEMV for small M (2..64 rows of x: short prompts, a chunked prompt's tail, speculative
// verification, batched decode): y[m, n] = sum_k x[m, k] * fp8[n, k] * scale[n, k / 128], each weight
// byte read once for all M rows, with the Store / AddResidual / SwiGLU / RopeKV epilogues and optionally
// RMSNorm fused into the prologue. Row m of the result is bit-identical to gemv_w8a16 (M = 1) on x[m].
// Why it is shaped this way, the byte and FLOP counts and the prediction: docs/design/gemv_w8a16_m.md.
//
// Contract of gemv_w8a16_m_kernel<NT, NC>(P), grid plan.blocks x 256 threads:
//  Inputs   W fp8 e4m3 [N, K] row-major (16-byte aligned), scales fp32 [N, ceil(K / 128)] (a last
//           group of 64 columns when K % 128 == 64); x per P.in: bf16 or fp16 [M, K], or for NORM the
//           fp32 residual stream [M, K] and the bf16 norm weight [K] (row m normalized with rmsnorm.cu's
//           arithmetic and reduction tree). K % 64 == 0, 1 <= M <= 8 NT (NT in {1, 2, 4, 8}).
//  Work     Tensor-core products with the WEIGHT rows on the 16-row side: one m16n8k16 chain of 4
//           computes 16 weight rows x 8 tokens over one 64-column group G of K. A tile is 16 rows
//           (SwiGLU: 8 gate rows and their 8 up rows); 8 / NC warps share a tile, warp i of them taking
//           the column classes G mod 8 in [i NC, i NC + NC). Lane 4 g + q loads 16 bytes (chunk 4 G + q)
//           of tile rows g and g + 8, as the decode GEMV's lane group g does of its row at G, so every
//           product's k order, and every class's fp32 chain over G, is the decode GEMV's (below).
//           A block is NC tiles (8 warps); blocks are persistent over the block tiles. RopeKV pairs
//           tile rows g and g + 8 as rows i and i + D / 2 of one q or k head (8 rotation pairs a tile,
//           D % 16 == 0), then the v rows 16 at a time.
//  x        staged into shared memory as fp16 [M][slab columns] (row stride = 2 slab + 16 bytes, so the
//           8 lanes of a 128-bit read phase hit distinct banks), once per block when slab >= K
//           (resident), else slab by slab for every block tile, between two barriers. With plan.keep
//           (resident) the factor scan below leaves x's raw rows in shared memory (bf16: in the staging
//           area itself; NORM: fp32 rows and the norm weight beside it) and the staging reads them there.
//  Before its PDL wait (pdl.cuh) it reads only immutable data: every warp loads its first two iterations'
//           weights and scales into registers. It triggers its dependents at entry.
//  After the wait it reads x (NORM and BF16 scan each row once for the per-row factor first), for
//           AddResidual out (the first block tile's right away, the others' in the epilogue), for RopeKV
//           *rope.pos.
//  Writes   Store: out fp32 [M, N]; AddResidual: out[m, n] += y; SwiGLU: out [M, N / 2] bf16, or fp16
//           given f16_overflow (set to 1 when a value passes kF16Max); RopeKV (N = (H + 2 Hkv) D): token
//           m at position *rope.pos + m, rope_kv_append's arithmetic on the row Store would write (the
//           bias added, rope.cuh's rotation): q bf16 [M, H, D], and the K / V cache rows of the positions
//           inside the cache. Every element exactly once.
//  Leaves   nothing behind.
//  Invariants (the decode GEMV's order, which makes row m bit-identical to gemv_w8a16 on x[m]):
//           the partial of (row, G) is the 4-product chain from zero with the same k slots; it is
//           added as fmaf(partial, scale[row, G / 2], acc_c) to the accumulator of class c = G mod 8
//           in ascending G; the classes meet as ((a0 + a1) + (a4 + a5)) + ((a2 + a3) + (a6 + a7)) (the
//           decode GEMV's butterfly, whose other lanes hold zeros); bf16 x is scaled into fp16 by the
//           power of two of its row's maximum and the sum scaled back. Blocks of 256 threads.
#include <algorithm>
#include <cfloat>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_fp16.h>

#include "atomflow/act16.cuh"
#include "atomflow/kernels.h"
#include "atomflow/loads.cuh"
#include "atomflow/pdl.cuh"
#include "atomflow/rmsnorm.cuh"
#include "atomflow/rope.cuh"
#include "gemv_w8a16_plan.h"

namespace atomflow::kernels {

namespace {

constexpr int kMThreads = 256, kMWarps = kMThreads / 32;
constexpr int kMMaxRows = 64;
// Rows of x whose per-row factors (RMSNorm's 1 / rms, bf16's power of two) are reduced at once.
constexpr int kFactorRows = 4;
// Shared memory one block may use (sm_90: 227 KB opt-in).
constexpr size_t kMSmemMax = 227 * 1024;

// Groups of 64 columns a warp loads per iteration, per tile row pair. Two iterations are in flight
// (ping-pong), so a lane keeps 8 to 16 loads of 16 bytes in flight, never none, as the decode GEMV's
// 16; 2 with 8 token tiles (their 64 accumulators leave no room).
__host__ __device__ constexpr int m_groups(int nt) { return nt == 8 ? 2 : 4; }
// Columns of K one iteration of a warp spans (its classes in each of groups / nc 512-column stripes).
__host__ __device__ constexpr int m_iter_cols(int nt, int nc) { return m_groups(nt) / nc * 512; }
// Values per output a warp hands to its tile's leader: pair sums of its classes, or its one class.
__host__ __device__ constexpr int m_pair_vals(int nc) { return nc >= 2 ? nc / 2 : 1; }
// Floats of the cross-warp exchange (a tile's classes always span 8 / nc >= 2 warps).
__host__ __device__ constexpr int m_comb_floats(int nt, int nc) { return kMWarps * m_pair_vals(nc) * nt * 128; }
__host__ __device__ constexpr size_t m_x_bytes(int M, int slab) {
  return CEIL_DIV(static_cast<size_t>(M) * (2 * slab + 16), 16) * 16;
}
// x, the exchange, the per-row factors (2 x 64) and the reductions' scratch (8 warps x 64 rows).
__host__ __device__ constexpr size_t m_smem_bytes(int M, int nt, int nc, int slab) {
  return m_x_bytes(M, slab) + sizeof(float) * (m_comb_floats(nt, nc) + 2 * kMMaxRows + kMWarps * kMMaxRows);
}
// What keeping x takes beyond that: NORM's fp32 rows and its weight (bf16 x stays in x's own area).
__host__ __device__ constexpr size_t m_keep_bytes(GemvIn in, int M, int K) {
  return in == GemvIn::NORM ? sizeof(float) * static_cast<size_t>(M) * K + 2 * static_cast<size_t>(K) : 0;
}

// The decode GEMV's instructions (gemv_w8a16_body.cuh), the same PTX, so the products round alike.
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t four, uint32_t& lo, uint32_t& hi) {
  asm("{.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;}"
      : "=r"(lo), "=r"(hi)
      : "r"(four));
}
__device__ __forceinline__ uint4 ld_shared16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

struct MProduct {
  const uint8_t* w;
  const float* scales;
  const void* x;
  const bf16* norm_w;  // GemvIn::NORM
  float eps;
  int M, N, K;
  int slab;   // columns of x staged at once (a multiple of the iteration's columns)
  bool keep;  // x resident: the factor scan leaves the raw rows (and NORM's weight) in shared memory
  Epilogue ep;
  GemvIn in;
  void* out;
  int* f16_overflow;  // SwiGLU: fp16 output, flagged past kF16Max; null: bf16
  RopeKVArgs rope;    // RopeKV: where the rotated q and the K / V rows go (out unused)
};

// Tiles of a product: SwiGLU 8 gate rows and their 8 up rows; RopeKV 8 rotation pairs of a q / k head,
// then the v rows; else 16 rows.
__host__ __device__ inline int m_tiles(Epilogue ep, int N) {
  return ep == Epilogue::SwiGLU ? CEIL_DIV(N / 2, 8) : CEIL_DIV(N, 16);
}
// RopeKV: the tiles of rotation pairs (the q and k heads' D / 2 pairs, 8 a tile).
__device__ __forceinline__ int m_rot_tiles(const RopeKVArgs& r) { return (r.H + r.Hkv) * (r.D / 16); }

// The shared memory of a block (m_smem_bytes).
struct MSmem {
  char* x;
  float* comb;
  float* up;       // per row: the factor x is staged with (bf16: 2^s; NORM: rsqrt(mean(x^2) + eps))
  float* xscale;   // per row: the factor the sums are multiplied by (bf16: 2^-s; else 1)
  float* red;      // [warp][row]: the warps' sums of squares (NORM) or maxima (bf16) per row
  float* raw;      // keep, NORM: x's rows fp32 [M][K], then the norm weight bf16 [K] (m_keep_bytes)
  const bf16* nw;  // the norm weight there
  __device__ MSmem(uint4* smem, int M, int nt, int nc, int slab, int K) {
    x = reinterpret_cast<char*>(smem);
    raw = reinterpret_cast<float*>(x + m_smem_bytes(M, nt, nc, slab));
    nw = reinterpret_cast<const bf16*>(raw + static_cast<size_t>(M) * K);
    comb = reinterpret_cast<float*>(x + m_x_bytes(M, slab));
    up = comb + m_comb_floats(nt, nc);
    xscale = up + kMMaxRows;
    red = xscale + kMMaxRows;
  }
};

// After the PDL wait: the per-row factors. bf16: the power of two that puts the row's largest
// magnitude in [2^14, 2^15) (stage_x of the decode GEMV); NORM: block_inv_rms of each row, the
// rmsnorm kernel's tree (its float4 path, as on the decode GEMV's shared copy). keep (plan.keep, x
// resident): the scan also leaves the raw rows in shared memory (bf16: in the staging area, converted there
// in place; NORM: fp32 rows and the norm weight in sm.raw / sm.nw), so stage_slab does not read x from L2
// a second time.
static __device__ void row_factors(const MProduct& P, const MSmem& sm, bool keep) {
  const int M = P.M, K = P.K, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Rows go kFactorRows at a time, so a thread has that many loads in flight, not one; each row's
  // arithmetic is the one-row code's (rmsnorm.cuh, block_inv_rms: a thread's four chains over float4s
  // t, t + 256, ..., the butterfly, the warps' sums in warp order), so the factors do not change.
  constexpr int R = kFactorRows;
  float* per_warp = sm.red;
  if (P.in == GemvIn::NORM) {
    const float4* x4 = static_cast<const float4*>(P.x);
    const int d4 = K / 4;  // K % 64 == 0, x 16-byte aligned: block_inv_rms's float4 path
    for (int m0 = 0; m0 < M; m0 += R) {
      float s[R][4] = {};
      for (int v = threadIdx.x; v < d4; v += kMThreads) {
        float4 q[R];
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (m0 + r < M) q[r] = x4[static_cast<size_t>(m0 + r) * d4 + v];
        if (keep && m0 == 0)  // the norm weight's 4 columns of this float4
          reinterpret_cast<uint2*>(const_cast<bf16*>(sm.nw))[v] = __ldg(reinterpret_cast<const uint2*>(P.norm_w) + v);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (m0 + r >= M) continue;
          if (keep) reinterpret_cast<float4*>(sm.raw)[static_cast<size_t>(m0 + r) * d4 + v] = q[r];
          s[r][0] = fmaf(q[r].x, q[r].x, s[r][0]);
          s[r][1] = fmaf(q[r].y, q[r].y, s[r][1]);
          s[r][2] = fmaf(q[r].z, q[r].z, s[r][2]);
          s[r][3] = fmaf(q[r].w, q[r].w, s[r][3]);
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float ss = (s[r][0] + s[r][1]) + (s[r][2] + s[r][3]);
#pragma unroll
        for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        if (lane == 0 && m0 + r < M) per_warp[warp * kMMaxRows + m0 + r] = ss;
      }
    }
    __syncthreads();
    for (int m = threadIdx.x; m < M; m += kMThreads) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kMWarps; ++w) total += per_warp[w * kMMaxRows + m];
      sm.up[m] = rsqrtf(total / static_cast<float>(K) + P.eps);
      sm.xscale[m] = 1.f;
    }
  } else if (P.in == GemvIn::BF16) {
    const uint4* x8 = static_cast<const uint4*>(P.x);
    for (int m0 = 0; m0 < M; m0 += R) {
      float amax[R] = {};
      for (int v = threadIdx.x; v < K / 8; v += kMThreads) {
        uint4 q[R];
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (m0 + r < M) q[r] = __ldcg(x8 + static_cast<size_t>(m0 + r) * (K / 8) + v);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (m0 + r >= M) continue;
          if (keep) *reinterpret_cast<uint4*>(sm.x + static_cast<size_t>(m0 + r) * (2 * P.slab + 16) + 16 * v) = q[r];
          const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&q[r]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(h[i]);
            amax[r] = fmaxf(amax[r], fmaxf(fabsf(f.x), fabsf(f.y)));
          }
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float a = amax[r];
#pragma unroll
        for (int off = 16; off > 0; off /= 2) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, off));
        if (lane == 0 && m0 + r < M) per_warp[warp * kMMaxRows + m0 + r] = a;
      }
    }
    __syncthreads();
    for (int m = threadIdx.x; m < M; m += kMThreads) {
      float amax = 0.f;
#pragma unroll
      for (int w = 0; w < kMWarps; ++w) amax = fmaxf(amax, per_warp[w * kMMaxRows + m]);
      const int s = f16_row_shift(amax);  // act16.cuh
      sm.up[m] = ldexpf(1.f, s);
      sm.xscale[m] = ldexpf(1.f, -s);
    }
  } else {
    for (int m = threadIdx.x; m < M; m += kMThreads) sm.xscale[m] = 1.f;
  }
}

// x[:, col0 : col0 + slab) (the part inside K) into shared memory as fp16, 8 values per 16-byte piece.
// kept: the raw bf16 rows are already there (row_factors' keep), converted in place. The caller puts a
// barrier on each side.
static __device__ void stage_slab(const MProduct& P, const MSmem& sm, int col0, bool kept) {
  const int M = P.M, K = P.K, pieces = P.slab / 8, xs = 2 * P.slab + 16;
  for (int v = threadIdx.x; v < M * pieces; v += kMThreads) {
    const int m = v / pieces, p = v - m * pieces, col = col0 + 8 * p;
    if (col >= K) continue;  // groups past K are never read
    uint4* dst = reinterpret_cast<uint4*>(sm.x + static_cast<size_t>(m) * xs + 16 * p);
    const size_t at = static_cast<size_t>(m) * K + col;
    if (P.in == GemvIn::F16) {
      cp_async16(dst, static_cast<const uint16_t*>(P.x) + at);
    } else if (P.in == GemvIn::BF16) {
      const uint4 q = kept ? *dst : __ldcg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(P.x) + at));
      *dst = bf16x8_to_f16(q, sm.up[m]);
    } else {
      float4 a, b;
      uint4 nw;
      if (kept) {
        const float4* xf = reinterpret_cast<const float4*>(sm.raw + at);
        a = xf[0];
        b = xf[1];
        nw = *reinterpret_cast<const uint4*>(sm.nw + col);
      } else {
        const float4* xf = reinterpret_cast<const float4*>(static_cast<const float*>(P.x) + at);
        a = __ldcg(xf);
        b = __ldcg(xf + 1);
        nw = __ldg(reinterpret_cast<const uint4*>(P.norm_w + col));
      }
      const bf16* wv = reinterpret_cast<const bf16*>(&nw);
      const float r = sm.up[m];
      const __half2 h0 = __halves2half2(rmsnorm_value(a.x, r, wv[0]), rmsnorm_value(a.y, r, wv[1]));
      const __half2 h1 = __halves2half2(rmsnorm_value(a.z, r, wv[2]), rmsnorm_value(a.w, r, wv[3]));
      const __half2 h2 = __halves2half2(rmsnorm_value(b.x, r, wv[4]), rmsnorm_value(b.y, r, wv[5]));
      const __half2 h3 = __halves2half2(rmsnorm_value(b.z, r, wv[6]), rmsnorm_value(b.w, r, wv[7]));
      uint4 q;
      q.x = *reinterpret_cast<const uint32_t*>(&h0);
      q.y = *reinterpret_cast<const uint32_t*>(&h1);
      q.z = *reinterpret_cast<const uint32_t*>(&h2);
      q.w = *reinterpret_cast<const uint32_t*>(&h3);
      *dst = q;
    }
  }
  cp_async_wait_all();
}

// One iteration of a warp: its NC classes in each of S = groups / NC stripes from stripe st0 on, for
// tile rows ra (A rows g) and rb (A rows g + 8). All loads are issued before any math (the decode
// GEMV's scoreboard rule, gemv_w8a16_body.cuh).
template <int NT, int NC>
struct MIter {
  static constexpr int S = m_groups(NT) / NC, NSC = NC >= 2 ? NC / 2 : 1;
  uint4 wa[S][NC], wb[S][NC];
  float sa[S][NSC], sb[S][NSC];

  __device__ __forceinline__ void load(const MProduct& P, int ra, int rb, int st0, int c0, uint64_t policy) {
    const int K = P.K, G_end = K / 64, SG = CEIL_DIV(K, 128), q = threadIdx.x % 4;
    const uint8_t* a = P.w + static_cast<size_t>(ra) * K + 16 * q;
    const uint8_t* b = P.w + static_cast<size_t>(rb) * K + 16 * q;
#pragma unroll
    for (int j = 0; j < S; ++j) {
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int G = 8 * (st0 + j) + c0 + c;
        if (G < G_end) {  // warp-uniform
          wa[j][c] = ld_stream16(reinterpret_cast<const uint4*>(a + 64 * G), policy);
          wb[j][c] = ld_stream16(reinterpret_cast<const uint4*>(b + 64 * G), policy);
        }
      }
#pragma unroll
      for (int c = 0; c < NSC; ++c) {
        const int G = 8 * (st0 + j) + c0 + 2 * c;  // classes 2c and 2c + 1 share a 128-column scale
        if (G < G_end) {
          sa[j][c] = __ldg(P.scales + static_cast<size_t>(ra) * SG + G / 2);
          sb[j][c] = __ldg(P.scales + static_cast<size_t>(rb) * SG + G / 2);
        }
      }
    }
  }

  // acc[c][t][0..1]: row ra, tokens 8 t + 2 q, + 1; acc[c][t][2..3]: row rb. x_base: shared address
  // of this lane's B row (token 8 t + g, clamped to M - 1) at the slab's column col0.
  __device__ __forceinline__ void math(float (&acc)[NC][NT][4], const uint32_t (&x_row)[NT], int st0, int c0, int col0,
                                       int G_end) const {
    const int q = threadIdx.x % 4;
#pragma unroll
    for (int j = 0; j < S; ++j) {
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int G = 8 * (st0 + j) + c0 + c;
        if (G >= G_end) continue;  // warp-uniform
        uint32_t a_lo[4], a_hi[4], b_lo[4], b_hi[4];
        const uint32_t wa4[4] = {wa[j][c].x, wa[j][c].y, wa[j][c].z, wa[j][c].w};
        const uint32_t wb4[4] = {wb[j][c].x, wb[j][c].y, wb[j][c].z, wb[j][c].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          e4m3x4_to_f16x2(wa4[i], a_lo[i], a_hi[i]);
          e4m3x4_to_f16x2(wb4[i], b_lo[i], b_hi[i]);
        }
        const float s_a = sa[j][NC >= 2 ? c / 2 : 0], s_b = sb[j][NC >= 2 ? c / 2 : 0];
        const uint32_t off = 2 * (64 * G - col0) + 32 * q;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const uint4 x0 = ld_shared16(x_row[t] + off), x1 = ld_shared16(x_row[t] + off + 16);
          const uint32_t xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
          float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int i = 0; i < 4; ++i) mma16816(d, a_lo[i], b_lo[i], a_hi[i], b_hi[i], xv[2 * i], xv[2 * i + 1]);
          acc[c][t][0] = fmaf(d[0], s_a, acc[c][t][0]);
          acc[c][t][1] = fmaf(d[1], s_a, acc[c][t][1]);
          acc[c][t][2] = fmaf(d[2], s_b, acc[c][t][2]);
          acc[c][t][3] = fmaf(d[3], s_b, acc[c][t][3]);
        }
      }
    }
  }
};

template <int NT, int NC>
static __global__ void __launch_bounds__(kMThreads, 1) gemv_w8a16_m_kernel(const MProduct P) {
  constexpr int WT = 8 / NC, S = m_groups(NT) / NC, NV = m_pair_vals(NC);
  extern __shared__ uint4 smem[];
  const MSmem sm(smem, P.M, NT, NC, P.slab, P.K);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int M = P.M, N = P.N, K = P.K;
  const bool swiglu = P.ep == Epilogue::SwiGLU, roped = P.ep == Epilogue::RopeKV;
  const int F = N / 2;
  const int n_tiles = m_tiles(P.ep, N);
  const int n_bt = CEIL_DIV(n_tiles, NC);
  const int G_end = K / 64, stripes = CEIL_DIV(K, 512), n_slabs = CEIL_DIV(K, P.slab), xs = 2 * P.slab + 16;
  const uint64_t policy = stream_policy();
  // x resident in one slab: the factor scan keeps the raw rows in shared memory (row_factors).
  const bool keep = P.keep;
  const uint32_t x_smem = static_cast<uint32_t>(__cvta_generic_to_shared(sm.x));
  uint32_t x_row[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) x_row[t] = x_smem + min(8 * t + g, M - 1) * xs;

  pdl_launch_dependents();
  bool waited = false;
  // AddResidual: the leader lanes' residual values of the first block tile, loaded right after the wait
  // (beside x's staging) instead of after the products: an L2 round trip fewer at the end. The engine's
  // instances only (NT <= 2): 4 and 8 token tiles have no registers to spare.
  constexpr bool kEarlyRes = NT <= 2;
  float res[kEarlyRes ? NT : 1][4];
  const bool add = P.ep == Epilogue::AddResidual;
  for (int bt = blockIdx.x; bt < n_bt; bt += gridDim.x) {
    const int tile = bt * NC + warp / WT, c0 = (warp % WT) * NC;
    const bool active = tile < n_tiles;
    const bool first = bt == static_cast<int>(blockIdx.x);
    int ra, rb;
    if (swiglu) {
      ra = min(8 * tile + g, F - 1);
      rb = F + ra;
    } else if (roped && tile < m_rot_tiles(P.rope)) {
      const int per_head = P.rope.D / 16;
      ra = (tile / per_head) * P.rope.D + (tile % per_head) * 8 + g;
      rb = ra + P.rope.D / 2;
    } else if (roped) {
      const int v0 = (P.rope.H + P.rope.Hkv) * P.rope.D + 16 * (tile - m_rot_tiles(P.rope));
      ra = min(v0 + g, N - 1);
      rb = min(v0 + 8 + g, N - 1);
    } else {
      ra = min(16 * tile + g, N - 1);
      rb = min(16 * tile + 8 + g, N - 1);
    }
    float acc[NC][NT][4];
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[c][t][0] = acc[c][t][1] = acc[c][t][2] = acc[c][t][3] = 0.f;

    for (int slab = 0; slab < n_slabs; ++slab) {
      const int col0 = slab * P.slab, st_begin = col0 / 512, st_end = min(stripes, (col0 + P.slab) / 512);
      // Two iterations in flight, ping-pong: the slab's first two go out before x is staged (on the
      // first trip, before the PDL wait: weights are immutable); then each iteration's math runs while
      // the next one's loads are in flight, and its registers take the one after.
      MIter<NT, NC> ia, ib;
      if (active) {
        ia.load(P, ra, rb, st_begin, c0, policy);
        if (st_begin + S < st_end) ib.load(P, ra, rb, st_begin + S, c0, policy);
      }
      if (!waited) {  // block-uniform
        pdl_wait();   // x (and for AddResidual, out) come from earlier kernels
        if (kEarlyRes && add && active && warp % WT == 0) {
#pragma unroll
          for (int t = 0; t < (kEarlyRes ? NT : 0); ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int m = 8 * t + 2 * q + (e & 1), r = 16 * tile + g + 8 * (e >> 1);
              res[t][e] =
                  m < M && r < N ? __ldcg(static_cast<const float*>(P.out) + static_cast<size_t>(m) * N + r) : 0.f;
            }
        }
        row_factors(P, sm, keep);
      }
      if (!waited || n_slabs > 1) {
        __syncthreads();  // every warp is done with the previous slab (and the factors are in)
        stage_slab(P, sm, col0, keep && !waited);
        __syncthreads();
      }
      waited = true;
      if (active) {
        for (int st0 = st_begin;; st0 += 2 * S) {
          ia.math(acc, x_row, st0, c0, col0, G_end);
          if (st0 + S >= st_end) break;
          if (st0 + 2 * S < st_end) ia.load(P, ra, rb, st0 + 2 * S, c0, policy);
          ib.math(acc, x_row, st0 + S, c0, col0, G_end);
          if (st0 + 2 * S >= st_end) break;
          if (st0 + 3 * S < st_end) ib.load(P, ra, rb, st0 + 3 * S, c0, policy);
        }
      }
    }

    // The classes meet in the decode GEMV's tree: pair sums p_k = a_2k + a_2k+1, then
    // (p0 + p2) + (p1 + p3). A warp of several classes adds its pairs itself; the leader of the
    // tile's warps gathers the rest through shared memory.
    float pv[NV][NT][4];
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          pv[k][t][e] = NC >= 2 ? acc[2 * k][t][e] + acc[NC >= 2 ? 2 * k + 1 : 0][t][e] : acc[0][t][e];
    float y[NT][4];
    static_assert(WT >= 2, "the tile leader gathers the classes of the tile's warps");
    __syncthreads();  // the previous round's leaders have read the exchange
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) sm.comb[((warp * NV + k) * NT + t) * 128 + e * 32 + lane] = pv[k][t][e];
    __syncthreads();
    const bool leader = warp % WT == 0;
    if (leader) {
      // value k' of the tile's warp i, one output of this lane
      auto at = [&](int i, int k, int t, int e) {
        return sm.comb[(((warp + i) * NV + k) * NT + t) * 128 + e * 32 + lane];
      };
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p[4];
#pragma unroll
          for (int k = 0; k < 4; ++k)
            p[k] = NC >= 2 ? at(2 * k / NC, (2 * k % NC) / 2, t, e) : at(2 * k, 0, t, e) + at(2 * k + 1, 0, t, e);
          y[t][e] = (p[0] + p[2]) + (p[1] + p[3]);
        }
    }

    if (leader && active) {
      const int pos0 = roped ? *P.rope.pos : 0;  // after the wait: an earlier kernel wrote it
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int m = 8 * t + 2 * q + (e & 1);
          if (m >= M) continue;
          const float v = y[t][e] * sm.xscale[m];
          if (roped) {
            // rope_kv_append's arithmetic on Store's row: the bias in one rounded add, then rope.cuh.
            const RopeKVArgs& R = P.rope;
            const int p = pos0 + m, D = R.D, Hkv = R.Hkv, H = R.H;
            const bool in_cache = p < R.max_context;
            if (tile < m_rot_tiles(R)) {
              if (e >= 2) continue;  // e: row i of the pair, e + 2: row i + D / 2
              const int head = ra / D, i = ra % D;
              // The row Store writes (a lone product: nothing to contract it into), then the bias.
              float x1 = __fmul_rn(y[t][e], sm.xscale[m]), x2 = __fmul_rn(y[t][e + 2], sm.xscale[m]);
              if (R.bias != nullptr) {
                x1 = __fadd_rn(x1, R.bias[ra]);
                x2 = __fadd_rn(x2, R.bias[rb]);
              }
              float c, sn, o1, o2;
              rope_cos_sin(p, R.inv_freq[i], c, sn);
              rope_rotate(x1, x2, c, sn, o1, o2);
              bf16* dst = head < H ? R.q_out + (static_cast<size_t>(m) * H + head) * D
                                   : (in_cache ? R.k_cache + (static_cast<size_t>(p) * Hkv + head - H) * D : nullptr);
              if (dst == nullptr) continue;
              dst[i] = __float2bfloat16(o1);
              dst[i + D / 2] = __float2bfloat16(o2);
            } else {
              const int v0 = (H + Hkv) * D, r = v0 + 16 * (tile - m_rot_tiles(R)) + g + 8 * (e >> 1);
              if (r >= N || !in_cache) continue;
              const float x = __fmul_rn(y[t][e], sm.xscale[m]);
              const float val = R.bias != nullptr ? __fadd_rn(x, R.bias[r]) : x;
              R.v_cache[static_cast<size_t>(p) * Hkv * D + (r - v0)] = __float2bfloat16(val);
            }
          } else if (swiglu) {
            if (e >= 2) continue;  // e: gate, e + 2: up
            const int p = 8 * tile + g;
            if (p >= F) continue;
            const float up = y[t][e + 2] * sm.xscale[m];
            const float silu = v / (1.f + expf(-v));
            static_cast<uint16_t*>(P.out)[static_cast<size_t>(m) * F + p] = act16_bits(silu * up, P.f16_overflow);
          } else {
            const int r = 16 * tile + g + 8 * (e >> 1);
            if (r >= N) continue;
            float* o = static_cast<float*>(P.out) + static_cast<size_t>(m) * N + r;
            *o = add ? (kEarlyRes && first ? res[kEarlyRes ? t : 0][e] : __ldcg(o)) + v : v;
          }
        }
    }
  }
}

// ---- plan table ----

// The decode GEMV with token columns (gemv_w8a16_cols.cu) takes 2..kColsMaxRows rows of the products of
// at least kColsMinWeights weights, where its staging fits two blocks an SM; the tile kernel the rest.
// Each token column costs every warp a chain of products per chunk (interleaved 4 at a time) and a read
// of x from shared memory per row pair, so it pays only up to 4 rows and on long weight streams
// (bench_kernels.py --sections gemv_m_products, H100, tiles -> columns at M = 2 / 3 / 4: 8B gate_up 56.1
// -> 44.8 / 56.7 -> 46.6 / 57.3 -> 50.9 us, 3B down 15.0 -> 13.8 / 15.6 -> 14.4 / 16.2 -> 14.8, 3B lm_head
// 165 -> 144 / 166 -> 145 / 166 -> 146; but 3B gate_up 26.8 -> 27.4 at 4, and the o products (16.8 M
// weights on the 8B) 8-26% slower. At 5 rows (two groups of chains) 3B gate_up 28.1 -> 37.7. Short rows
// lose too: SmolLM2's head (49152 x 576) 19.1 -> 24.6 us at 2 rows; rows of kColsMinK or more only.
constexpr int kColsMaxRows = 4;
constexpr size_t kColsMinWeights = 20u << 20;
constexpr int kColsMinK = 3072;
// Token tiles of 8: M padded to 8, 16, 32 or 64.
constexpr int calc_nt(int M) { return M <= 8 ? 1 : M <= 16 ? 2 : M <= 32 ? 4 : 8; }
// Column classes per warp, most first: 8 / nc warps share a tile. At most 64 accumulators a lane (nc x
// nt x 4), and at least 2 classes with 32 rows and more (an iteration of one class spans 4096 columns:
// too much x to stage).
constexpr int max_nc(int nt) { return nt <= 4 ? 4 : 2; }
constexpr int min_nc(int nt) { return nt <= 2 ? 1 : 2; }
// The widest slab within the shared memory budget: K whole (x resident) when it fits.
constexpr int calc_slab(int M, int nt, int nc, int K) {
  const int iw = m_iter_cols(nt, nc);
  const int whole = CEIL_DIV(K, iw) * iw;
  if (m_smem_bytes(M, nt, nc, whole) <= kMSmemMax) return whole;
  const size_t rest = kMSmemMax - (m_smem_bytes(M, nt, nc, 0) - m_x_bytes(M, 0));  // for x
  const int cols = static_cast<int>((rest / M - 16) / 2);
  return cols / iw * iw;
}
// The most classes per warp (x staged by the fewest blocks: each block reads all of x) that still gives
// every other SM a block tile (enough loads in flight: a block keeps 64 KB in flight).
constexpr int calc_nc(int nt, int n_tiles, int sms) {
  for (int nc = max_nc(nt); nc > min_nc(nt); nc /= 2)
    if (2 * CEIL_DIV(n_tiles, nc) >= sms) return nc;
  return min_nc(nt);
}
static_assert(calc_nc(2, 3072 / 16, 132) == 2 && calc_nc(2, 5120 / 16, 132) == 4 && calc_nc(2, 8192 / 8, 132) == 4,
              "3B at M = 16: o and down 2 classes per warp, qkv and gate/up 4");
static_assert(calc_slab(16, 2, 2, 3072) >= 3072 && calc_slab(16, 2, 2, 8192) < 8192 &&
                  calc_slab(64, 8, 2, 18944) >= 1024,
              "3B o at M = 16 resident; Qwen 7B down at M = 64 in slabs");

// Blocks of the <NT, NC> instance with `smem` bytes resident at once on the current device. The first
// call per (device, smem) raises the instance's shared memory limit and asks the occupancy; later calls
// (every launch) take it from the cache. Host-side, capture-safe.
template <int NT, int NC>
int m_resident_blocks(size_t smem) {
  struct Seen {
    int device;
    size_t smem;
    int blocks;
  };
  static std::mutex mu;
  static std::vector<Seen> seen;
  int device = 0;
  AF_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mu);
  bool raised = false;  // the limit is raised once per device, to the device's opt-in maximum
  for (const Seen& e : seen) {
    if (e.device != device) continue;
    if (e.smem == smem) return e.blocks;
    raised = true;
  }
  int sms = 0, optin = 0, per_sm = 0;
  AF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  AF_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  AF_CHECK(smem <= static_cast<size_t>(optin), "gemv_w8a16_m: the plan's shared memory exceeds the device's");
  if (!raised)
    AF_CUDA_CHECK(
        cudaFuncSetAttribute(gemv_w8a16_m_kernel<NT, NC>, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
  AF_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_w8a16_m_kernel<NT, NC>, kMThreads, smem));
  AF_CHECK(per_sm >= 1, "gemv_w8a16_m: kernel does not fit on an SM");
  seen.push_back({device, smem, sms * per_sm});
  return seen.back().blocks;
}

// The instances: (nt, nc) with min_nc(nt) <= nc <= max_nc(nt).
template <class F>
auto dispatch_m(int nt, int nc, F&& f) {
  switch (nt * 16 + nc) {
    case 1 * 16 + 1: return f(std::integral_constant<int, 1>{}, std::integral_constant<int, 1>{});
    case 1 * 16 + 2: return f(std::integral_constant<int, 1>{}, std::integral_constant<int, 2>{});
    case 1 * 16 + 4: return f(std::integral_constant<int, 1>{}, std::integral_constant<int, 4>{});
    case 2 * 16 + 1: return f(std::integral_constant<int, 2>{}, std::integral_constant<int, 1>{});
    case 2 * 16 + 2: return f(std::integral_constant<int, 2>{}, std::integral_constant<int, 2>{});
    case 2 * 16 + 4: return f(std::integral_constant<int, 2>{}, std::integral_constant<int, 4>{});
    case 4 * 16 + 2: return f(std::integral_constant<int, 4>{}, std::integral_constant<int, 2>{});
    case 4 * 16 + 4: return f(std::integral_constant<int, 4>{}, std::integral_constant<int, 4>{});
    case 8 * 16 + 2: return f(std::integral_constant<int, 8>{}, std::integral_constant<int, 2>{});
    default: break;
  }
  AF_CHECK(false, "gemv_w8a16_m: no instance for these token tiles and classes per warp");
  return f(std::integral_constant<int, 1>{}, std::integral_constant<int, 1>{});
}

const char* m_ep_name(Epilogue ep) {
  return ep == Epilogue::Store         ? "Store"
         : ep == Epilogue::AddResidual ? "AddResidual"
         : ep == Epilogue::SwiGLU      ? "SwiGLU"
                                       : "RopeKV";
}
const char* m_in_name(GemvIn in) { return in == GemvIn::BF16 ? "BF16" : in == GemvIn::F16 ? "F16" : "NORM"; }

void launch_m(const GemvMPlan& plan, const MProduct& P, cudaStream_t stream) {
  AF_CHECK(plan.ep == P.ep && plan.in == P.in && plan.M == P.M && plan.N == P.N && plan.K == P.K &&
               plan.threads == kMThreads && plan.blocks >= 1 && plan.slab == P.slab,
           "gemv_w8a16_m: the plan is not this launch's (plan_gemv_m(ep, in, M, N, K))");
  AF_CHECK(P.M >= 1 && P.M <= 8 * plan.nt && P.N >= 1 && P.K >= 64 && P.K % 64 == 0,
           "gemv_w8a16_m: need 1 <= M <= 64, N >= 1 and K a multiple of 64");
  AF_CHECK(P.ep != Epilogue::SwiGLU || P.N % 2 == 0, "gemv_w8a16_m: SwiGLU needs N = 2F (gate rows, then up rows)");
  AF_CHECK(
      P.ep == Epilogue::Store || P.ep == Epilogue::AddResidual || P.ep == Epilogue::SwiGLU || P.ep == Epilogue::RopeKV,
      "gemv_w8a16_m: the Store, AddResidual, SwiGLU and RopeKV epilogues only");
  AF_CHECK(P.f16_overflow == nullptr || P.ep == Epilogue::SwiGLU, "gemv_w8a16_m: an fp16 output is SwiGLU's only");
  if (P.ep == Epilogue::RopeKV) {
    const RopeKVArgs& r = P.rope;
    AF_CHECK(r.H >= 1 && r.Hkv >= 1 && r.max_context >= 1 && r.D >= 16 && r.D % 16 == 0 && r.D <= kMaxRopeHeadDim,
             "gemv_w8a16_m: RopeKV needs H, Hkv, max_context >= 1 and head_dim a multiple of 16, <= 1024");
    AF_CHECK(P.N == (r.H + 2 * r.Hkv) * r.D, "gemv_w8a16_m: RopeKV needs N = (H + 2 Hkv) head_dim");
    AF_CHECK(
        r.inv_freq != nullptr && r.pos != nullptr && r.q_out != nullptr && r.k_cache != nullptr && r.v_cache != nullptr,
        "gemv_w8a16_m: RopeKV needs inv_freq, pos, q_out and the caches");
  }
  AF_CHECK(reinterpret_cast<uintptr_t>(P.w) % 16 == 0 && reinterpret_cast<uintptr_t>(P.x) % 16 == 0 &&
               (P.norm_w == nullptr || reinterpret_cast<uintptr_t>(P.norm_w) % 16 == 0),
           "gemv_w8a16_m: w, x and norm_w must be 16-byte aligned");
  if (plan.cols.blocks > 0) {  // the decode GEMV with token columns (plan_gemv_cols)
    AF_CHECK(plan.cols.ep == P.ep && plan.cols.in == P.in, "gemv_w8a16_m: the plan's columns are not this launch's");
    GemvPlan cols = plan.cols;
    cols.bias = P.ep == Epilogue::RopeKV && P.rope.bias != nullptr;  // the same grid and staging either way
    gemv_cols(cols, P.w, P.scales, P.x, P.norm_w, P.eps, P.M, P.N, P.K, P.out, P.f16_overflow, P.rope, stream);
    return;
  }
  dispatch_m(plan.nt, plan.nc, [&](auto nt_c, auto nc_c) {
    constexpr int NT = decltype(nt_c)::value, NC = decltype(nc_c)::value;
    AF_CHECK(plan.slab % m_iter_cols(NT, NC) == 0 && P.keep == plan.keep &&
                 plan.smem == m_smem_bytes(P.M, NT, NC, plan.slab) + (plan.keep ? m_keep_bytes(P.in, P.M, P.K) : 0),
             "gemv_w8a16_m: the plan's slab does not fit its instance");
    AF_CHECK((m_resident_blocks<NT, NC>(plan.smem) >= plan.blocks), "gemv_w8a16_m: the plan's grid does not fit");
    af_launch(gemv_w8a16_m_kernel<NT, NC>, dim3(plan.blocks), dim3(kMThreads), plan.smem, stream, P);
    return 0;
  });
}

}  // namespace

GemvMPlan plan_gemv_m(Epilogue ep, GemvIn in, int M, int N, int K, const GemvMKnobs& knobs) {
  AF_CHECK(M >= 1 && M <= kMMaxRows, "plan_gemv_m: 1 <= M <= 64");
  AF_CHECK(N >= 1 && K >= 64 && K % 64 == 0, "plan_gemv_m: N >= 1, K a multiple of 64");
  AF_CHECK(ep == Epilogue::Store || ep == Epilogue::AddResidual || ep == Epilogue::SwiGLU || ep == Epilogue::RopeKV,
           "plan_gemv_m: the Store, AddResidual, SwiGLU and RopeKV epilogues only");
  AF_CHECK(ep != Epilogue::SwiGLU || N % 2 == 0, "plan_gemv_m: SwiGLU needs an even N");
  GemvMPlan plan{};
  plan.ep = ep;
  plan.in = in;
  plan.M = M;
  plan.N = N;
  plan.K = K;
  plan.nt = calc_nt(M);
  plan.threads = kMThreads;
  const int n_tiles = m_tiles(ep, N);
  int device = 0, sms = 0;
  AF_CUDA_CHECK(cudaGetDevice(&device));
  AF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  plan.nc = knobs.nc != 0 ? knobs.nc : calc_nc(plan.nt, n_tiles, sms);
  AF_CHECK(plan.nc >= min_nc(plan.nt) && plan.nc <= max_nc(plan.nt) && (plan.nc & (plan.nc - 1)) == 0,
           "plan_gemv_m: classes per warp must be a power of two in [min_nc, max_nc] of M's token tiles");
  const int iw = m_iter_cols(plan.nt, plan.nc);
  plan.slab = knobs.slab != 0 ? CEIL_DIV(std::min(knobs.slab, CEIL_DIV(K, iw) * iw), iw) * iw
                              : calc_slab(M, plan.nt, plan.nc, K);
  AF_CHECK(plan.slab >= iw, "plan_gemv_m: x does not fit in shared memory");
  plan.smem = m_smem_bytes(M, plan.nt, plan.nc, plan.slab);
  // The factor scan keeps x's raw rows for the staging when x is resident and they fit (bf16: in x's own
  // area; NORM: fp32 rows and the weight beside it): one read of x from L2 instead of two.
  plan.keep =
      (in == GemvIn::BF16 || in == GemvIn::NORM) && plan.slab >= K && plan.smem + m_keep_bytes(in, M, K) <= kMSmemMax;
  if (plan.keep) plan.smem += m_keep_bytes(in, M, K);
  AF_CHECK(plan.smem <= kMSmemMax, "plan_gemv_m: the slab does not fit in shared memory");
  const int resident = dispatch_m(plan.nt, plan.nc, [&](auto nt_c, auto nc_c) {
    return m_resident_blocks<decltype(nt_c)::value, decltype(nc_c)::value>(plan.smem);
  });
  plan.blocks = std::min(CEIL_DIV(n_tiles, plan.nc), resident);
  const bool by_table = M >= 2 && M <= kColsMaxRows && K >= kColsMinK && static_cast<size_t>(N) * K >= kColsMinWeights;
  if (!knobs.tiles && M <= kGemvColsMT && (knobs.cols || by_table)) plan.cols = plan_gemv_cols(ep, in, M, N, K);
  return plan;
}

std::string gemv_m_variant_name(const GemvMPlan& plan) {
  if (plan.cols.blocks > 0) return gemv_variant_name(plan.cols);
  return std::string("gemv_w8a16_m<") + m_ep_name(plan.ep) + ", " + m_in_name(plan.in) +
         ", nt=" + std::to_string(plan.nt) + ", nc=" + std::to_string(plan.nc) + ", slab=" + std::to_string(plan.slab) +
         (plan.keep ? ", keep" : "") + ">";
}

void gemv_w8a16_m(const GemvMPlan& plan, const uint8_t* w, const float* scales, const void* x, Act x_type, int M, int N,
                  int K, Epilogue ep, void* out, cudaStream_t stream, int* f16_overflow) {
  AF_CHECK(ep != Epilogue::RopeKV, "gemv_w8a16_m: RopeKV is gemv_w8a16_m_rmsnorm_rope's");
  const GemvIn in = x_type == Act::F16 ? GemvIn::F16 : GemvIn::BF16;
  const MProduct P{w, scales, x, nullptr, 0.f, M, N, K, plan.slab, plan.keep, ep, in, out, f16_overflow};
  launch_m(plan, P, stream);
}

void gemv_w8a16_m_rmsnorm(const GemvMPlan& plan, const uint8_t* w, const float* scales, const float* x,
                          const bf16* norm_w, float eps, int M, int N, int K, Epilogue ep, void* out,
                          cudaStream_t stream, int* f16_overflow) {
  AF_CHECK(norm_w != nullptr, "gemv_w8a16_m_rmsnorm: needs the norm weight");
  AF_CHECK(ep != Epilogue::RopeKV, "gemv_w8a16_m_rmsnorm: RopeKV is gemv_w8a16_m_rmsnorm_rope's");
  const MProduct P{w, scales, x, norm_w, eps, M, N, K, plan.slab, plan.keep, ep, GemvIn::NORM, out, f16_overflow};
  launch_m(plan, P, stream);
}

void gemv_w8a16_m_rmsnorm_rope(const GemvMPlan& plan, const uint8_t* w, const float* scales, const float* x,
                               const bf16* norm_w, float eps, int M, int K, const RopeKVArgs& rope,
                               cudaStream_t stream) {
  AF_CHECK(norm_w != nullptr, "gemv_w8a16_m_rmsnorm_rope: needs the norm weight");
  const int N = (rope.H + 2 * rope.Hkv) * rope.D;
  const MProduct P{w,       scales,  x,   norm_w, eps, M, N, K, plan.slab, plan.keep, Epilogue::RopeKV, GemvIn::NORM,
                   nullptr, nullptr, rope};
  launch_m(plan, P, stream);
}

}  // namespace atomflow::kernels

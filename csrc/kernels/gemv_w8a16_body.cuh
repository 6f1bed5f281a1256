// The W8A16 GEMV's building blocks, for one warp on one row pair: the tensor-core dot product of
// a 16-byte chunk (dot_chunk), one iteration's loads and math (load_iter, dot_iter), staging x into
// shared memory (stage_x), and the epilogues (store_pair). The kernel that schedules them is in
// gemv_w8a16.cu; its variants (staged second pairs, tickets) in gemv_w8a16_variants.cuh.
// Included by gemv_w8a16.cu and gemv_w8a16_cols.cu (the same pieces on token columns). One idea (what a
// warp does with a row pair), kept whole past the usual size because its pieces share the register and
// scoreboard rules below.
//
// Two rules the compiler imposes, both seen in the SASS (tools/sass_check.py) and measured
// (docs/design/gemv_w8a16.md): every weight load of the kernel shares ONE scoreboard, so math must
// never wait for an iteration while the next one's loads are already issued (no rolling pipeline
// within a warp: other warps hide the round trip), and a loop must not consume registers loaded by
// an earlier trip or by a conditional load outside it (the compiler then serializes the loads of a
// burst). Hence x is staged by cp.async (not register loads) and the first iteration loaded before
// the PDL wait is consumed by a peeled copy of the loop.
#pragma once
#include <cfloat>

#include <cuda_fp16.h>

#include "atomflow/act16.cuh"
#include "atomflow/kernels.h"
#include "atomflow/loads.cuh"
#include "atomflow/order_key.cuh"
#include "atomflow/rmsnorm.cuh"
#include "atomflow/rope.cuh"
#include "atomflow/trace.cuh"
#include "gemv_w8a16_plan.h"

namespace atomflow::kernels {

// x is stored as fp16 (16 values = 32 B per chunk) with a swizzle: the two 16-byte halves of chunk c
// sit in order when (c >> 2) & 1 is 0 and swapped when it is 1. Lanes read 32 B apart; without the
// swizzle every quarter-warp of a 128-bit shared load would hit the same banks twice.
static __device__ __forceinline__ int x_slot(int c, int h) { return 2 * c + (h ^ ((c >> 2) & 1)); }  // in uint4

// D = A B + C on the tensor cores: m16n8k16, fp16 inputs, fp32 accumulation (products of fp16 values
// are exact in fp32).
static __device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four packed e4m3 -> two f16x2 (exact): bytes 0-1 into lo, bytes 2-3 into hi. Written as one PTX
// block that splits the register into its 16-bit halves, so the conversion of the high half reads
// it in place (F2FP ... R.H1) instead of after a shift: 8 instructions fewer per chunk of the loop.
static __device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t four, uint32_t& lo, uint32_t& hi) {
  asm("{.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;}"
      : "=r"(lo), "=r"(hi)
      : "r"(four));
}

static __device__ __forceinline__ uint4 ld_shared16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// The two 16-weight dot products of one chunk per lane, for the whole warp, as four tensor-core
// products. Lane l = 4 g + q holds 16 weights of row a and of row b at its chunk and the 16 x values
// of that chunk. In the m16n8k16 product, A row g is row a's weights of lane group g (lanes 4g..4g+3,
// 64 contiguous bytes), A row g + 8 is row b's at the same columns, and B column g is x at those
// columns: the k order inside a product is free as long as A and B agree, and each lane supplies
// exactly its own weights and x. D[g][g] and D[g + 8][g] are then group g's partial sums of row a and
// row b; lane 4 g + g / 2 holds them (in d[g & 1] and d[2 + (g & 1)]). The other 112 entries of D are
// cross terms and are not used. Per 32 weights a lane spends 16 conversions (each reading a 16-bit
// half of a weight register in place), 4 products and 2 shared loads, against ~110 instructions with
// fp32 FMAs. x_lo / x_hi: shared addresses of the chunk's two 8-value halves.
static __device__ __forceinline__ void dot_chunk(uint4 wa, uint4 wb, uint32_t x_lo, uint32_t x_hi, float (&d)[4]) {
  const uint4 x0 = ld_shared16(x_lo), x1 = ld_shared16(x_hi);
  const uint32_t a[4] = {wa.x, wa.y, wa.z, wa.w};
  const uint32_t b[4] = {wb.x, wb.y, wb.z, wb.w};
  const uint32_t xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
  d[0] = d[1] = d[2] = d[3] = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // bytes 4j, 4j+1 pair with x values 4j, 4j+1; bytes 4j+2, 4j+3 with 4j+2, 4j+3
    uint32_t a_lo, a_hi, b_lo, b_hi;
    e4m3x4_to_f16x2(a[j], a_lo, a_hi);
    e4m3x4_to_f16x2(b[j], b_lo, b_hi);
    mma16816(d, a_lo, b_lo, a_hi, b_hi, xv[2 * j], xv[2 * j + 1]);
  }
}

// The kernel's epilogues (kernels.h: the public three and RoPE + KV append for the fused QKV
// product), and what it reads as x: 16-bit x (bf16 or fp16), or the fp32 residual stream to normalize.
using Ep = Epilogue;
using In = GemvIn;

// One matrix product: y = W x with W [N, K] (+ scales), x as IN says, into out.
struct Product {
  const uint8_t* w;
  const float* scales;
  const void* x;
  const bf16* norm_w;  // In::NORM
  int N, K;
  void* out;
  int staged_warps;   // warps per block whose second row pair is copied into shared memory early (0: none)
  unsigned* tickets;  // SwiGLU of several rounds: counters that hand out the row pairs past the first round (Tickets)
  uint64_t* best;     // Store: each block's argmax key of the rows it wrote (gemv_w8a16_rmsnorm_argmax), or null
  int* f16_overflow;  // SwiGLU: fp16 output, flagged past kF16Max (act16.cuh); null: bf16
  int pre_warps;      // warps per block that load their first iteration before the PDL wait (GemvPlan)
  bool late_trigger;  // the dependents launch after this kernel's PDL wait, not at its start (GemvPlan)
};

// Which rows row pair p covers. SwiGLU pairs gate row p with up row F + p; RopeKV pairs (i, i + D/2)
// of a q or k head, then consecutive v rows; otherwise rows 2p and 2p + 1 (for odd N the last
// pair reads its one row twice and stores once). A row's sum does not depend on its partner.
template <Ep EP>
struct RowPairs {
  int N, half, qk_pairs;
  __device__ RowPairs(int n, const RopeKVArgs& rope) : N(n), half(rope.D / 2), qk_pairs((rope.H + rope.Hkv) * half) {}
  __host__ __device__ static int count(int n) { return EP == Ep::SwiGLU || EP == Ep::RopeKV ? n / 2 : CEIL_DIV(n, 2); }
  __device__ int count() const { return count(N); }
  __device__ void rows(int p, int& r0, int& r1) const {
    if constexpr (EP == Ep::SwiGLU) {
      r0 = p;
      r1 = p + N / 2;
    } else if constexpr (EP == Ep::RopeKV) {
      if (p < qk_pairs) {
        r0 = (p / half) * 2 * half + p % half;
        r1 = r0 + half;
      } else {
        r0 = 2 * p;  // = (H + Hkv) * D + 2 (p - qk_pairs)
        r1 = r0 + 1;
      }
    } else {
      r0 = 2 * p;
      r1 = min(2 * p + 1, N - 1);
    }
  }
};

// This warp's trace stamps (trace.cuh), in shared memory until the warp exits; without
// ATOMFLOW_TRACE every member is empty and compiles to nothing.
struct WarpTrace {
  uint64_t* t;  // kStamps of this warp, or nullptr
  int i;        // iterations summed so far
  __device__ __forceinline__ void stamp(int slot) const {
    if constexpr (trace::kOn)
      if (threadIdx.x % 32 == 0) t[slot] = trace::now();
  }
  __device__ __forceinline__ void iter() {
    if constexpr (trace::kOn) {
      stamp(i < trace::kIterSlots ? trace::kIter0 + i : trace::kIterLast);
      ++i;
    }
  }
};

// One iteration of a warp on a row pair: kGemvUnroll 16-byte chunks of each row per lane (chunks
// c0 + 32 u), with their scales. All loads are issued before any math, and they are the only
// weight loads in flight when the math waits for them (see the top of this file).
// The scales: an iteration spans 32 scale groups of each row, so lane l loads group l's scale of each
// (coalesced) and the lane that accumulates chunk c fetches group c / 8's by a shuffle. A tail group
// (TAIL: K % 128 == 64) is group c / 8 of its 4 chunks like any other; only the row's count of
// scales, ceil(K / 128), differs.
// U chunks per row per lane (kGemvUnroll; fewer in the column kernel, gemv_w8a16_cols.cu, whose
// accumulators take the registers): the order in which a lane sums its chunks does not depend on U.
template <int U = kGemvUnroll>
struct IterU {
  uint4 wa[U], wb[U];
  float sa, sb;
};
using Iter = IterU<>;

// Whether step u of an iteration (chunks c0 + 32 u, c0 = the warp's chunk + lane) has any lane inside
// the row: warp-uniform. WHOLE (K a multiple of 512): the active steps are a prefix, counted once per
// iteration, and every lane of an active step is inside the row.
template <bool WHOLE>
struct Steps {
  int c0, C, n;
  __device__ Steps(int c0_, int C_) : c0(c0_), C(C_), n((C_ - (c0_ - static_cast<int>(threadIdx.x % 32))) / 32) {}
  __device__ bool active(int u) const { return WHOLE ? u < n : c0 + 32 * u - static_cast<int>(threadIdx.x % 32) < C; }
};

template <bool WHOLE, bool TAIL, int U = kGemvUnroll>
static __device__ __forceinline__ void load_iter(IterU<U>& it, const Product& P, int r0, int r1, int c0,
                                                 uint64_t policy) {
  const int C = P.K / 16, G = gemv_scale_groups<TAIL>(P.K);
  const uint8_t* w0 = P.w + static_cast<size_t>(r0) * P.K;
  const uint8_t* w1 = P.w + static_cast<size_t>(r1) * P.K;
  const float* s0 = P.scales + static_cast<size_t>(r0) * G;
  const float* s1 = P.scales + static_cast<size_t>(r1) * G;
  static_assert(U <= 8 && 32 * kGemvUnroll / 8 == 32, "at most one scale group per lane per iteration");
  const int lane = threadIdx.x % 32, g = (c0 - lane) / 8 + lane;
  // The step condition is warp-uniform, as in dot_iter. (With a per-lane condition instead, ptxas
  // moved some of a burst's loads behind the math: sass_check.)
  if constexpr (WHOLE) {
    // Every lane of an active step is inside the row: each load is one base address plus a
    // constant, with no address arithmetic per chunk.
    const uint4* a = reinterpret_cast<const uint4*>(w0) + c0;
    const uint4* b = reinterpret_cast<const uint4*>(w1) + c0;
    const Steps<true> steps(c0, C);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (steps.active(u)) {
        it.wa[u] = ld_stream16(a + 32 * u, policy);
        it.wb[u] = ld_stream16(b + 32 * u, policy);
      }
    }
  } else {
    // A lane past the row's end re-reads the row's last chunk.
    const Steps<false> steps(c0, C);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (steps.active(u)) {
        it.wa[u] = ld_stream16(reinterpret_cast<const uint4*>(w0 + 16 * min(c, C - 1)), policy);
        it.wb[u] = ld_stream16(reinterpret_cast<const uint4*>(w1 + 16 * min(c, C - 1)), policy);
      }
    }
  }
  if (g < G && (U == kGemvUnroll || lane < 4 * U)) {  // lanes past 4 U: groups of the next iteration
    it.sa = __ldg(s0 + g);
    it.sb = __ldg(s1 + g);
  }
}

// One iteration's math. Chunks past the row's end (K not a multiple of 512) belong to whole lane
// groups (C is a multiple of 4: K % 64 == 0), so they only touch their own groups' diagonal entries,
// which are not accumulated (their x reads land in the staging's padding); the products are warp-wide and run
// whenever any lane's chunk is in range. (c >> 2) & 1 is the same for c0 + 32 u as for c0, so the
// swizzle is fixed per iteration and each x load is a base register plus a constant.
template <bool WHOLE, int U = kGemvUnroll>
static __device__ __forceinline__ void dot_iter(const IterU<U>& it, const uint4* xs, int c0, int C, float& acc0,
                                                float& acc1) {
  const int lane = threadIdx.x % 32;
  const Steps<WHOLE> steps(c0, C);
  const bool odd = (lane >> 2) & 1;  // which column of D holds this lane's diagonal entries
  const uint32_t x_lo = static_cast<uint32_t>(__cvta_generic_to_shared(xs + x_slot(c0, 0)));
  const uint32_t x_hi = static_cast<uint32_t>(__cvta_generic_to_shared(xs + x_slot(c0, 1)));
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = c0 + 32 * u;
    if (steps.active(u)) {
      float d[4];
      dot_chunk(it.wa[u], it.wb[u], x_lo + 1024 * u, x_hi + 1024 * u, d);
      const float sa = __shfl_sync(0xffffffffu, it.sa, (lane >> 3) + 4 * u);  // group c / 8
      const float sb = __shfl_sync(0xffffffffu, it.sb, (lane >> 3) + 4 * u);
      if (WHOLE || c < C) {
        acc0 = fmaf(odd ? d[1] : d[0], sa, acc0);
        acc1 = fmaf(odd ? d[3] : d[2], sb, acc1);
      }
    }
  }
}

// 16 bytes global -> shared without registers (cp.async, through L2: coherent for data of earlier
// kernels). Its completion is tracked apart from the weight loads' scoreboard, so staging x never
// waits for the weights in flight (top of this file).
static __device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}
static __device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Shared memory of a block: x as the products read it (K fp16, swizzled, padded), and for In::NORM the raw
// residual row (K fp32) and the norm weight (K bf16) it is computed from.
struct Staging {
  uint4* xs;
  float* raw;
  bf16* norm_w;
  __device__ Staging(uint4* smem, int K)
      : xs(smem),
        raw(reinterpret_cast<float*>(smem + gemv_x_padded(K) / 8)),
        norm_w(reinterpret_cast<bf16*>(raw + K)) {}
};
template <In IN>
__host__ __device__ static size_t staging_bytes(int K) {
  return gemv_staging_bytes(IN, K);
}

// In::NORM, before the PDL wait: the norm weight (immutable) on its way into shared memory.
template <In IN>
static __device__ void stage_weights(const Product& P, const Staging& st) {
  if constexpr (IN == In::NORM) {
    for (int v = threadIdx.x; v < P.K / 8; v += kGemvThreads) cp_async16(st.norm_w + 8 * v, P.norm_w + 8 * v);
  }
}

// Stage x into shared memory as fp16 (swizzled) and return the factor the products' sums are
// multiplied by: fp16 x is copied as is; the RMSNorm of the fp32 residual stream is rounded to fp16
// exactly as rmsnorm.cu does (same 256-thread reduction tree, on a copy of the row in shared memory);
// bf16 x is multiplied by a power of two 2^s that puts its largest magnitude in [2^14, 2^15), so
// every value within 2^-28 of the largest converts to fp16 exactly and none overflows, and the sums
// are multiplied back by 2^-s (exact).
template <In IN>
static __device__ float stage_x(const Product& P, float eps, const Staging& st, float* red, const WarpTrace& tr) {
  const int K = P.K;
  uint4* xs = st.xs;
  // Each loop below handles kStageBatch of a thread's 16-byte pieces at a time, all their loads
  // before any store: a store to shared memory may alias the next piece's load, so one piece at a
  // time is one shared-memory (or L2) round trip per piece (docs/design/gemv_w8a16.md).
  constexpr int kStageBatch = 4;
  if constexpr (IN == In::NORM) {
    // No barrier between the copies and the norm: block_inv_rms reads float4 v in thread v mod 256,
    // the thread that copied it (its own copies have landed once cp.async.wait_all returns).
    static_assert(kGemvThreads == 256, "the copies' mapping is block_inv_rms's");
    const float* xf = static_cast<const float*>(P.x);
    for (int v = threadIdx.x; v < K / 4; v += kGemvThreads) cp_async16(st.raw + 4 * v, xf + 4 * v);
    cp_async_wait_all();  // this thread's copies (and its norm weight copies) have landed
    tr.stamp(trace::kLanded);
    const float r = block_inv_rms<kGemvThreads>(st.raw, K, eps, red);  // its barrier publishes every copy
    tr.stamp(trace::kReduced);
    // 4 values per piece: a float4 of the row, 4 norm weights, 4 fp16 into half of an x slot.
    const float4* raw4 = reinterpret_cast<const float4*>(st.raw);
    const uint2* nw4 = reinterpret_cast<const uint2*>(st.norm_w);
    uint2* xh4 = reinterpret_cast<uint2*>(xs);
    for (int v0 = threadIdx.x; v0 < K / 4; v0 += kStageBatch * kGemvThreads) {
      float4 a[kStageBatch];
      uint2 w[kStageBatch];
#pragma unroll
      for (int j = 0; j < kStageBatch; ++j) {
        const int v = v0 + j * kGemvThreads;
        if (v < K / 4) {
          a[j] = raw4[v];
          w[j] = nw4[v];
        }
      }
#pragma unroll
      for (int j = 0; j < kStageBatch; ++j) {
        const int v = v0 + j * kGemvThreads;
        if (v < K / 4) {
          const bf16* wv = reinterpret_cast<const bf16*>(&w[j]);
          const __half2 lo = __halves2half2(rmsnorm_value(a[j].x, r, wv[0]), rmsnorm_value(a[j].y, r, wv[1]));
          const __half2 hi = __halves2half2(rmsnorm_value(a[j].z, r, wv[2]), rmsnorm_value(a[j].w, r, wv[3]));
          uint2 out;
          out.x = *reinterpret_cast<const uint32_t*>(&lo);
          out.y = *reinterpret_cast<const uint32_t*>(&hi);
          xh4[2 * x_slot(v / 4, (v / 2) % 2) + v % 2] = out;  // values 4v .. 4v + 3 of chunk v / 4
        }
      }
    }
    tr.stamp(trace::kConverted);
    return 1.f;
  } else {
    // 8 values per 16-byte piece = half v % 2 of chunk v / 2, copied with cp.async, not loaded into
    // registers: a register load shares the weight loads' scoreboard, so the first use of x would
    // wait for the early weight loads of this warp too (top of this file).
    const uint4* x8 = static_cast<const uint4*>(P.x);
    for (int v = threadIdx.x; v < K / 8; v += kGemvThreads) cp_async16(xs + x_slot(v / 2, v % 2), x8 + v);
    cp_async_wait_all();  // this thread's copies have landed; it reads only those below
    // This thread's pieces v0, v0 + 256, ... (up to kStageBatch of them) from their slots.
    auto own_pieces = [&](int v0, uint4(&q)[kStageBatch]) {
#pragma unroll
      for (int j = 0; j < kStageBatch; ++j) {
        const int v = v0 + j * kGemvThreads;
        if (v < K / 8) q[j] = xs[x_slot(v / 2, v % 2)];
      }
    };
    float amax = 0.f;
    if constexpr (IN == In::BF16) {
      for (int v0 = threadIdx.x; v0 < K / 8; v0 += kStageBatch * kGemvThreads) {
        uint4 q[kStageBatch];
        own_pieces(v0, q);
#pragma unroll
        for (int j = 0; j < kStageBatch; ++j) {
          if (v0 + j * kGemvThreads >= K / 8) continue;
          const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&q[j]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(h[i]);
            amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
          }
        }
      }
    }
    tr.stamp(trace::kLanded);
    if constexpr (IN == In::F16) {
      return 1.f;
    } else {
#pragma unroll
      for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = amax;
      __syncthreads();
      tr.stamp(trace::kBarrier);
      amax = 0.f;
#pragma unroll
      for (int w = 0; w < kGemvWarps; ++w) amax = fmaxf(amax, red[w]);
      const int s = f16_row_shift(amax);  // act16.cuh
      const float up = ldexpf(1.f, s);
      for (int v0 = threadIdx.x; v0 < K / 8; v0 += kStageBatch * kGemvThreads) {  // the slots this thread wrote
        uint4 q[kStageBatch];
        own_pieces(v0, q);
#pragma unroll
        for (int j = 0; j < kStageBatch; ++j) {
          const int v = v0 + j * kGemvThreads;
          if (v >= K / 8) continue;
          xs[x_slot(v / 2, v % 2)] = bf16x8_to_f16(q[j], up);
        }
      }
      tr.stamp(trace::kConverted);
      return ldexpf(1.f, -s);
    }
  }
}

// What an epilogue reads from earlier kernels, loaded by lane 0 right after the PDL wait, while x is
// staged, instead of after the math: the position (RopeKV), and for AddResidual the residual values
// of the warp's first row pair p0 (later pairs load theirs in the epilogue); for RopeKV with BIAS,
// the bias of p0's rows the same way.
//
// BIAS (RopeKV only): the epilogue adds rope.bias (Qwen2's q/k/v biases) before RoPE. A compile-time
// choice, not a null test, so that the instances without it keep the machine code they had before
// biases existed (docs/design/gemv_w8a16.md).
struct Prior {
  float r0, r1;
  int p0;
  int pos;
  float freq = 0.f;  // RopeKV: the first pair's inv_freq (a q / k pair), loaded before the products
};

template <Ep EP, bool BIAS>
static __device__ __forceinline__ Prior load_prior(const Product& P, const RowPairs<EP>& pairs, const RopeKVArgs& rope,
                                                   int p0) {
  Prior pr{0.f, 0.f, p0, 0};
  if (threadIdx.x % 32 != 0) return pr;
  if constexpr (EP == Ep::RopeKV) {
    pr.pos = *rope.pos;  // plain (coherent) load: the previous step wrote it
    if (p0 < pairs.qk_pairs) pr.freq = __ldg(rope.inv_freq + p0 % pairs.half);
    if constexpr (BIAS) {
      if (p0 < pairs.count()) {
        int r0, r1;
        pairs.rows(p0, r0, r1);
        pr.r0 = rope.bias[r0];
        pr.r1 = rope.bias[r1];
      }
    }
  }
  if constexpr (EP == Ep::AddResidual) {
    if (p0 < pairs.count()) {
      int r0, r1;
      pairs.rows(p0, r0, r1);
      const float* o = static_cast<const float*>(P.out);
      pr.r0 = __ldcg(o + r0);
      pr.r1 = __ldcg(o + r1);
    }
  }
  return pr;
}

// Row pair p's two complete sums (lane 0 of the warp stores them): apply the epilogue.
template <Ep EP, bool BIAS>
static __device__ __forceinline__ void store_pair(const Product& P, const RowPairs<EP>& pairs, const RopeKVArgs& rope,
                                                  const Prior& pr, int p, float acc0, float acc1) {
  int r0, r1;
  pairs.rows(p, r0, r1);
  if constexpr (EP == Ep::SwiGLU) {
    const float silu = acc0 / (1.f + expf(-acc0));
    static_cast<uint16_t*>(P.out)[p] = act16_bits(silu * acc1, P.f16_overflow);  // act16.cuh
  } else if constexpr (EP == Ep::RopeKV) {
    if constexpr (BIAS) {  // one rounded add each (no FMA with the scaling), as rope_kv_append adds it
      acc0 = __fadd_rn(acc0, p == pr.p0 ? pr.r0 : rope.bias[r0]);
      acc1 = __fadd_rn(acc1, p == pr.p0 ? pr.r1 : rope.bias[r1]);
    }
    const int half = pairs.half;
    const int pos = pr.pos;
    const bool in_cache = pos < rope.max_context;
    const size_t cache_row = static_cast<size_t>(in_cache ? pos : 0) * rope.Hkv * rope.D;
    if (p < pairs.qk_pairs) {
      // cos / sin of this pair's frequency, computed by the one lane that needs them (staging them
      // for the block before the products put a position load on the critical path).
      const int head = p / half, i = p % half;
      float c, sn, o1, o2;
      rope_cos_sin(pos, p == pr.p0 ? pr.freq : __ldg(rope.inv_freq + i), c, sn);
      rope_rotate(acc0, acc1, c, sn, o1, o2);
      bf16* dst = nullptr;
      if (head < rope.H)
        dst = rope.q_out + static_cast<size_t>(head) * rope.D;
      else if (in_cache)
        dst = rope.k_cache + cache_row + static_cast<size_t>(head - rope.H) * rope.D;
      if (dst != nullptr) {
        dst[i] = __float2bfloat16(o1);
        dst[i + half] = __float2bfloat16(o2);
      }
    } else if (in_cache) {
      const int j = 2 * (p - pairs.qk_pairs);  // index into the v row
      rope.v_cache[cache_row + j] = __float2bfloat16(acc0);
      rope.v_cache[cache_row + j + 1] = __float2bfloat16(acc1);
    }
  } else {
    float* o = static_cast<float*>(P.out);
    const bool second = 2 * p + 1 < P.N;
    if constexpr (EP == Ep::Store) {
      o[r0] = acc0;
      if (second) o[r1] = acc1;
    } else if (p == pr.p0) {
      o[r0] = pr.r0 + acc0;
      if (second) o[r1] = pr.r1 + acc1;
    } else {
      o[r0] += acc0;
      if (second) o[r1] += acc1;
    }
  }
}

// A row pair's partial sums sit in the 8 lanes that hold D's diagonal (dot_chunk): reduce them,
// undo x's scaling, lane 0 stores, and the warp reconverges before its next loads (a lane left
// behind would replay the whole next row pair's loads and math on its own).
template <Ep EP, bool BIAS>
static __device__ __forceinline__ void finish_pair(const Product& P, const RowPairs<EP>& pairs, const RopeKVArgs& rope,
                                                   const Prior& pr, int p, float acc0, float acc1, float x_scale,
                                                   uint64_t& top) {
  const int lane = threadIdx.x % 32;
  if ((lane & 3) != (lane >> 3)) acc0 = acc1 = 0.f;  // lane 4 g + q holds group g's sums iff q = g / 2
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    acc0 += __shfl_xor_sync(0xffffffffu, acc0, off);
    acc1 += __shfl_xor_sync(0xffffffffu, acc1, off);
  }
  if (lane == 0) {
    const float y0 = acc0 * x_scale, y1 = acc1 * x_scale;
    store_pair<EP, BIAS>(P, pairs, rope, pr, p, y0, y1);
    if constexpr (EP == Ep::Store) {  // the head's argmax (P.best): lane 0's running max of what it stored
      int r0, r1;
      pairs.rows(p, r0, r1);
      top = max(top, argmax_key(y0, r0));
      if (2 * p + 1 < P.N) top = max(top, argmax_key(y1, r1));
    }
  }
  __syncwarp();
}

// Row pair p from the warp's chunk `base` on (lane l starts at base + l; acc0 / acc1 hold the sums of
// the chunks before), then its epilogue. The loop counts on the warp's chunk, not the lane's, so every
// lane makes the same trips: with a per-lane bound, a K whose chunks end within a warp's first 32
// (K = 256, or 4096 + 256) sent only some lanes into the warp-wide products and shuffles (a hang,
// seen with K = 256 and several row pairs per warp).
// SwiGLU's ticketed pairs (Tickets): with `grab`, lane 0 takes the warp's next ticket into *ticket
// right after the first iteration's loads are issued, so the atomic's round trip runs beside
// theirs (issued before them, it held the loads: they share its scoreboard).
template <Ep EP, bool BIAS, bool WHOLE, bool TAIL>
static __device__ __forceinline__ void finish_rows(const Product& P, const RowPairs<EP>& pairs, const RopeKVArgs& rope,
                                                   const Prior& pr, const uint4* xs, float x_scale, int p, int base,
                                                   float acc0, float acc1, uint64_t policy, WarpTrace& tr,
                                                   uint64_t& top, unsigned* grab = nullptr,
                                                   unsigned* ticket = nullptr) {
  const int C = P.K / 16, lane = threadIdx.x % 32;
  int r0, r1;
  pairs.rows(p, r0, r1);
  for (; base < C; base += 32 * kGemvUnroll) {
    Iter it;
    load_iter<WHOLE, TAIL>(it, P, r0, r1, base + lane, policy);
    if constexpr (EP == Ep::SwiGLU) {
      if (grab != nullptr && lane == 0) *ticket = atomicAdd(grab, 1u);
      grab = nullptr;
    }
    dot_iter<WHOLE>(it, xs, base + lane, C, acc0, acc1);
    tr.iter();
  }
  finish_pair<EP, BIAS>(P, pairs, rope, pr, p, acc0, acc1, x_scale, top);
}

}  // namespace atomflow::kernels

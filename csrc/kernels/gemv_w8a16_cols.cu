// The decode GEMV with token columns: y[m, n] = sum_k x[m, k] * fp8[n, k] * scale[n, k / 128] for a
// few rows of x (1 <= M <= MT = kGemvColsMT), each weight byte read once for all of them, with the
// decode GEMV's work layout (a warp per row pair, two blocks an SM, the first iteration loaded before
// the PDL wait) and its epilogues per token. The small-M GEMV's plan (plan_gemv_m, GemvMPlan::cols) launches it where
// its table says so; why: docs/design/gemv_w8a16_m.md ("The decode GEMV with token columns").
//
// Contract of gemv_cols_kernel<EP, IN, WHOLE, TAIL, BIAS, MT>(P, M, raw_rows, eps, rope), grid
// plan.blocks x 256 threads:
//  Inputs   gemv_w8a16_kernel's, with x per IN of M rows: bf16 or fp16 [M, K], or for NORM the fp32
//           residual stream [M, K] (each row normalized with rmsnorm.cu's arithmetic and tree).
//  Work     gemv_w8a16_kernel's row pairs, strided over the grid (no staged pairs, no tickets). Per
//           16-byte chunk a lane converts its e4m3 weights once and runs the decode GEMV's chain of 4
//           tensor-core products (dot_chunk) once per token, B = that token's x at the same k slots;
//           the tokens' chains interleave kColsGroup at a time (columns past M run on row M - 1 and
//           are dropped).
//  x        all M rows staged into shared memory as fp16 before the products (x_slot's swizzle, one
//           row after another); NORM copies the raw fp32 rows raw_rows at a time beside them (a thread
//           reads back only what it copied: no barrier between groups).
//  Before its PDL wait it reads only immutable data (the plan's pre_warps load their first iteration).
//           RopeKV (and a late_trigger plan) triggers its dependents after its wait, the others at entry.
//  Writes   token m's row as gemv_w8a16_kernel writes its one row: Store out fp32 [M, N]; AddResidual
//           out[m, n] += y; SwiGLU out [M, N / 2] (fp16 given f16_overflow, flagged past kF16Max);
//           RopeKV q_out [M, H, D] and the K / V rows at *pos + m inside the cache. Each element once.
//  Leaves   nothing behind.
//  Invariants row m of the result is gemv_w8a16_kernel's on x[m], bit for bit: the same products (A =
//           the same two rows' bytes in the same k slots, a tensor-core output depending only on its A
//           row, B column and C), the same fmaf chain of a lane's chunks in ascending order (whatever
//           the unroll), the same butterfly, bf16 x scaled by the same power of two of its row maximum.
#include "atomflow/pdl.cuh"
#include "gemv_w8a16_body.cuh"
#include "gemv_w8a16_plan.h"

namespace atomflow::kernels {

namespace {

// Tokens whose product chains a lane interleaves (each chain is 4 dependent tensor-core products).
constexpr int kColsGroup = 4;
static_assert(kGemvColsMT % kColsGroup == 0, "whole groups");

// Where a block keeps x: M rows of fp16 (gemv_x_padded(K) values each, x_slot's layout), then for NORM
// raw_rows fp32 rows of the residual stream and the norm weight (bf16 [K]).
struct ColsStaging {
  uint4* xs;
  float* raw;
  bf16* norm_w;
  int row;  // uint4 per x row
  __device__ ColsStaging(uint4* smem, int M, int K, int raw_rows)
      : xs(smem),
        raw(reinterpret_cast<float*>(smem + static_cast<size_t>(M) * (gemv_x_padded(K) / 8))),
        norm_w(reinterpret_cast<bf16*>(raw + static_cast<size_t>(raw_rows) * K)),
        row(gemv_x_padded(K) / 8) {}
};

// Stage the M rows of x into shared memory as fp16; for bf16 x, each row's factor 2^-s into xscale[m]
// (stage_x's power of two, per row). red: MT x kGemvWarps floats, a slice per row, so that no row's
// reduction waits for another's readers.
template <In IN, int MT>
__device__ void stage_cols(const Product& P, int M, int raw_rows, float eps, const ColsStaging& st, float* red,
                           float* xscale) {
  const int K = P.K;
  if constexpr (IN == In::NORM) {
    // Thread v mod 256 copies float4 v of a row, the one block_inv_rms has it read (rmsnorm.cuh).
    static_assert(kGemvThreads == 256, "the copies' mapping is block_inv_rms's");
    const float* xf = static_cast<const float*>(P.x);
    const uint2* nw4 = reinterpret_cast<const uint2*>(st.norm_w);
    for (int t0 = 0; t0 < M; t0 += raw_rows) {
      const int n = min(raw_rows, M - t0);
      for (int r = 0; r < n; ++r)
        for (int v = threadIdx.x; v < K / 4; v += kGemvThreads)
          cp_async16(st.raw + static_cast<size_t>(r) * K + 4 * v, xf + static_cast<size_t>(t0 + r) * K + 4 * v);
      cp_async_wait_all();
      for (int r = 0; r < n; ++r) {
        const float* raw = st.raw + static_cast<size_t>(r) * K;
        const float inv = block_inv_rms<kGemvThreads>(raw, K, eps, red + kGemvWarps * (t0 + r));
        const float4* raw4 = reinterpret_cast<const float4*>(raw);
        uint2* xh4 = reinterpret_cast<uint2*>(st.xs + static_cast<size_t>(t0 + r) * st.row);
        for (int v = threadIdx.x; v < K / 4; v += kGemvThreads) {
          const float4 a = raw4[v];
          const uint2 w = nw4[v];
          const bf16* wv = reinterpret_cast<const bf16*>(&w);
          const __half2 lo = __halves2half2(rmsnorm_value(a.x, inv, wv[0]), rmsnorm_value(a.y, inv, wv[1]));
          const __half2 hi = __halves2half2(rmsnorm_value(a.z, inv, wv[2]), rmsnorm_value(a.w, inv, wv[3]));
          uint2 out;
          out.x = *reinterpret_cast<const uint32_t*>(&lo);
          out.y = *reinterpret_cast<const uint32_t*>(&hi);
          xh4[2 * x_slot(v / 4, (v / 2) % 2) + v % 2] = out;  // values 4v .. 4v + 3 of chunk v / 4
        }
      }
    }
  } else {
    const uint4* x8 = static_cast<const uint4*>(P.x);
    for (int t = 0; t < M; ++t)
      for (int v = threadIdx.x; v < K / 8; v += kGemvThreads)
        cp_async16(st.xs + static_cast<size_t>(t) * st.row + x_slot(v / 2, v % 2),
                   x8 + static_cast<size_t>(t) * (K / 8) + v);
    cp_async_wait_all();  // this thread's copies; it reads back only those
    if constexpr (IN == In::BF16) {
      const int warp = threadIdx.x / 32;
      for (int t = 0; t < M; ++t) {
        const uint4* xs = st.xs + static_cast<size_t>(t) * st.row;
        float amax = 0.f;
        for (int v = threadIdx.x; v < K / 8; v += kGemvThreads) {
          const uint4 q = xs[x_slot(v / 2, v % 2)];
          const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(h[i]);
            amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
          }
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        if (threadIdx.x % 32 == 0) red[kGemvWarps * t + warp] = amax;
      }
      __syncthreads();
      for (int t = 0; t < M; ++t) {
        float amax = 0.f;
#pragma unroll
        for (int w = 0; w < kGemvWarps; ++w) amax = fmaxf(amax, red[kGemvWarps * t + w]);
        const int s = f16_row_shift(amax);
        const float up = ldexpf(1.f, s);
        if (threadIdx.x == 0) xscale[t] = ldexpf(1.f, -s);
        uint4* xs = st.xs + static_cast<size_t>(t) * st.row;
        for (int v = threadIdx.x; v < K / 8; v += kGemvThreads)
          xs[x_slot(v / 2, v % 2)] = bf16x8_to_f16(xs[x_slot(v / 2, v % 2)], up);
      }
    }
  }
}

// One iteration's math for every token: dot_iter's chunks, their weights converted once, the chain of
// 4 products and the fmaf into the token's accumulators once per token (dot_chunk's, B = token t's x).
template <bool WHOLE, int U, int MT>
__device__ __forceinline__ void dot_iter_cols(const IterU<U>& it, const ColsStaging& st, int c0, int C, int M,
                                              float (&acc0)[MT], float (&acc1)[MT]) {
  const int lane = threadIdx.x % 32;
  const Steps<WHOLE> steps(c0, C);
  const bool odd = (lane >> 2) & 1;
  const uint32_t x_lo = static_cast<uint32_t>(__cvta_generic_to_shared(st.xs + x_slot(c0, 0)));
  const uint32_t x_hi = static_cast<uint32_t>(__cvta_generic_to_shared(st.xs + x_slot(c0, 1)));
  const uint32_t row_bytes = 16u * st.row;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = c0 + 32 * u;
    if (steps.active(u)) {
      const uint32_t a[4] = {it.wa[u].x, it.wa[u].y, it.wa[u].z, it.wa[u].w};
      const uint32_t b[4] = {it.wb[u].x, it.wb[u].y, it.wb[u].z, it.wb[u].w};
      uint32_t a_lo[4], a_hi[4], b_lo[4], b_hi[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        e4m3x4_to_f16x2(a[j], a_lo[j], a_hi[j]);
        e4m3x4_to_f16x2(b[j], b_lo[j], b_hi[j]);
      }
      const float sa = __shfl_sync(0xffffffffu, it.sa, (lane >> 3) + 4 * u);  // group c / 8
      const float sb = __shfl_sync(0xffffffffu, it.sb, (lane >> 3) + 4 * u);
      // Tokens in groups of kColsGroup, every column of a group run (those past M on row M - 1, their
      // sums dropped): no branch between a group's chains, so they interleave (one chain's latency for
      // the group); a group wholly past M is skipped.
#pragma unroll
      for (int t0 = 0; t0 < MT; t0 += kColsGroup) {
        if (t0 >= M) break;
        float d[kColsGroup][4];
#pragma unroll
        for (int i = 0; i < kColsGroup; ++i) {
          const uint32_t row = static_cast<uint32_t>(min(t0 + i, M - 1)) * row_bytes + 1024 * u;
          const uint4 x0 = ld_shared16(x_lo + row);
          const uint4 x1 = ld_shared16(x_hi + row);
          const uint32_t xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
          d[i][0] = d[i][1] = d[i][2] = d[i][3] = 0.f;
#pragma unroll
          for (int j = 0; j < 4; ++j) mma16816(d[i], a_lo[j], b_lo[j], a_hi[j], b_hi[j], xv[2 * j], xv[2 * j + 1]);
        }
        if (WHOLE || c < C) {
#pragma unroll
          for (int i = 0; i < kColsGroup; ++i) {
            acc0[t0 + i] = fmaf(odd ? d[i][1] : d[i][0], sa, acc0[t0 + i]);
            acc1[t0 + i] = fmaf(odd ? d[i][3] : d[i][2], sb, acc1[t0 + i]);
          }
        }
      }
    }
  }
}

// The row pair's sums of every token (finish_pair's butterfly per token), then lane 0 applies the
// epilogue to token m's outputs (store_pair on the token's rows of out, q_out and the cache).
template <Ep EP, In IN, bool BIAS, int MT>
__device__ __forceinline__ void finish_pair_cols(const Product& P, const RowPairs<EP>& pairs, const RopeKVArgs& rope,
                                                 int pos0, int M, const float* xscale, int p, float (&acc0)[MT],
                                                 float (&acc1)[MT]) {
  const int lane = threadIdx.x % 32;
  const bool mine = (lane & 3) == (lane >> 3);  // lane 4 g + q holds group g's sums iff q = g / 2
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    if (!mine) acc0[t] = acc1[t] = 0.f;
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      acc0[t] += __shfl_xor_sync(0xffffffffu, acc0[t], off);
      acc1[t] += __shfl_xor_sync(0xffffffffu, acc1[t], off);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      if (t >= M) break;
      const float x_scale = IN == In::BF16 ? xscale[t] : 1.f;
      const float y0 = acc0[t] * x_scale, y1 = acc1[t] * x_scale;
      Product Pt = P;
      RopeKVArgs rt = rope;
      if constexpr (EP == Ep::SwiGLU)
        Pt.out = static_cast<uint16_t*>(P.out) + static_cast<size_t>(t) * (P.N / 2);
      else if constexpr (EP == Ep::RopeKV)
        rt.q_out = rope.q_out + static_cast<size_t>(t) * rope.H * rope.D;
      else
        Pt.out = static_cast<float*>(P.out) + static_cast<size_t>(t) * P.N;
      const Prior pr{0.f, 0.f, -1, pos0 + t};  // no pair's residual or bias loaded early
      store_pair<EP, BIAS>(Pt, pairs, rt, pr, p, y0, y1);
    }
  }
  __syncwarp();
}

template <Ep EP, In IN, bool WHOLE, bool TAIL, bool BIAS, int MT>
__device__ __forceinline__ void finish_rows_cols(const Product& P, const RowPairs<EP>& pairs, const RopeKVArgs& rope,
                                                 int pos0, int M, const ColsStaging& st, const float* xscale, int p,
                                                 int base, float (&acc0)[MT], float (&acc1)[MT], uint64_t policy) {
  constexpr int U = kGemvColsUnroll;
  const int C = P.K / 16, lane = threadIdx.x % 32;
  int r0, r1;
  pairs.rows(p, r0, r1);
  for (; base < C; base += 32 * U) {
    IterU<U> it;
    load_iter<WHOLE, TAIL, U>(it, P, r0, r1, base + lane, policy);
    dot_iter_cols<WHOLE, U, MT>(it, st, base + lane, C, M, acc0, acc1);
  }
  finish_pair_cols<EP, IN, BIAS, MT>(P, pairs, rope, pos0, M, xscale, p, acc0, acc1);
}

template <Ep EP, In IN, bool WHOLE, bool TAIL, bool BIAS, int MT>
__global__ void __launch_bounds__(kGemvThreads, 2)
    gemv_cols_kernel(const Product P, int M, int raw_rows, float eps, const RopeKVArgs rope) {
  static_assert(!(WHOLE && TAIL), "a row of whole 512-column steps has no tail group");
  static_assert(!BIAS || EP == Ep::RopeKV, "a bias is the QKV product's only");
  constexpr int U = kGemvColsUnroll;
  extern __shared__ uint4 smem[];
  __shared__ float red[MT * kGemvWarps];
  __shared__ float xscale[MT];
  const ColsStaging st(smem, M, P.K, raw_rows);
  const RowPairs<EP> pairs(P.N, rope);
  const int n_pairs = pairs.count();
  const int lane = threadIdx.x % 32, stride = gridDim.x * kGemvWarps;
  const uint64_t policy = stream_policy();
  const int p0 = blockIdx.x + gridDim.x * (threadIdx.x / 32);

  // The decode GEMV's early loads: the first iteration of the first row pair before the wait.
  const bool pre = threadIdx.x / 32 < P.pre_warps;
  IterU<U> first;
  if (pre && p0 < n_pairs) {
    int r0, r1;
    pairs.rows(p0, r0, r1);
    load_iter<WHOLE, TAIL, U>(first, P, r0, r1, lane, policy);
  }
  if constexpr (IN == In::NORM) {
    for (int v = threadIdx.x; v < P.K / 8; v += kGemvThreads) cp_async16(st.norm_w + 8 * v, P.norm_w + 8 * v);
  }
  const bool late = EP == Ep::RopeKV || P.late_trigger;
  if (!late) pdl_launch_dependents();
  pdl_wait();  // x (AddResidual: out; RopeKV: *pos) come from earlier kernels
  if (late) pdl_launch_dependents();
  int pos0 = 0;
  if constexpr (EP == Ep::RopeKV) {
    if (lane == 0) pos0 = *rope.pos;  // plain (coherent) load: an earlier kernel may have written it
  }
  stage_cols<IN, MT>(P, M, raw_rows, eps, st, red, xscale);
  __syncthreads();

  float acc0[MT], acc1[MT];
  int p = p0;
  if (pre && p < n_pairs) {
#pragma unroll
    for (int t = 0; t < MT; ++t) acc0[t] = acc1[t] = 0.f;
    dot_iter_cols<WHOLE, U, MT>(first, st, lane, P.K / 16, M, acc0, acc1);
    finish_rows_cols<EP, IN, WHOLE, TAIL, BIAS, MT>(P, pairs, rope, pos0, M, st, xscale, p, 32 * U, acc0, acc1, policy);
    p += stride;
  }
  for (; p < n_pairs; p += stride) {
#pragma unroll
    for (int t = 0; t < MT; ++t) acc0[t] = acc1[t] = 0.f;
    finish_rows_cols<EP, IN, WHOLE, TAIL, BIAS, MT>(P, pairs, rope, pos0, M, st, xscale, p, 0, acc0, acc1, policy);
  }
}

// The instances: every (EP, IN) of the small-M GEMV (RopeKV on NORM only, with and without its bias),
// whole / ragged / tail-group rows, kGemvColsMT columns.
template <Ep EP, In IN, bool BIAS, int MT, class F>
auto by_shape(bool whole, bool tail, F&& f) {
  if (whole) return f(gemv_cols_kernel<EP, IN, true, false, BIAS, MT>);
  return tail ? f(gemv_cols_kernel<EP, IN, false, true, BIAS, MT>)
              : f(gemv_cols_kernel<EP, IN, false, false, BIAS, MT>);
}

template <int MT, class F>
auto by_kind(Epilogue ep, GemvIn in, bool whole, bool tail, bool bias, F&& f) {
  const auto by_in = [&](auto ep_c) {
    constexpr Ep EP = decltype(ep_c)::value;
    if constexpr (EP == Ep::RopeKV) {
      AF_CHECK(in == In::NORM, "gemv_cols: the RopeKV epilogue needs the fused RMSNorm");
      return bias ? by_shape<EP, In::NORM, true, MT>(whole, tail, f)
                  : by_shape<EP, In::NORM, false, MT>(whole, tail, f);
    } else {
      AF_CHECK(!bias, "gemv_cols: a bias is the RopeKV epilogue's only");
      switch (in) {
        case In::BF16: return by_shape<EP, In::BF16, false, MT>(whole, tail, f);
        case In::F16: return by_shape<EP, In::F16, false, MT>(whole, tail, f);
        default: return by_shape<EP, In::NORM, false, MT>(whole, tail, f);
      }
    }
  };
  switch (ep) {
    case Ep::Store: return by_in(std::integral_constant<Ep, Ep::Store>{});
    case Ep::AddResidual: return by_in(std::integral_constant<Ep, Ep::AddResidual>{});
    case Ep::SwiGLU: return by_in(std::integral_constant<Ep, Ep::SwiGLU>{});
    default: return by_in(std::integral_constant<Ep, Ep::RopeKV>{});
  }
}

}  // namespace

int gemv_cols_resident_blocks(Epilogue ep, GemvIn in, bool whole, bool tail, bool bias, size_t smem) {
  return by_kind<kGemvColsMT>(ep, in, whole, tail, bias, [&](auto kernel) {
    return gemv_kernel_resident_blocks(reinterpret_cast<const void*>(kernel), smem);
  });
}

void gemv_cols(const GemvPlan& plan, const uint8_t* w, const float* scales, const void* x, const bf16* norm_w,
               float eps, int M, int N, int K, void* out, int* f16_overflow, const RopeKVArgs& rope,
               cudaStream_t stream) {
  AF_CHECK(plan.rows == M && plan.N == N && plan.K == K && plan.mt == kGemvColsMT && M >= 1 && M <= plan.mt &&
               plan.blocks >= 1 && plan.threads == kGemvThreads && plan.whole == gemv_whole_steps(K) &&
               plan.tail == gemv_tail_group(K) && plan.smem == gemv_cols_smem(plan.in, M, K, plan.raw_rows) &&
               (plan.in != GemvIn::NORM || plan.raw_rows >= 1),
           "gemv_cols: the plan is not this launch's (plan_gemv_cols(ep, in, M, N, K, bias))");
  AF_CHECK(plan.bias == (plan.ep == Epilogue::RopeKV && rope.bias != nullptr),
           "gemv_cols: rope.bias must be given iff the plan is for a bias");
  AF_CHECK(gemv_cols_resident_blocks(plan.ep, plan.in, plan.whole, plan.tail, plan.bias, plan.smem) >= plan.blocks,
           "gemv_cols: the plan's grid does not fit");
  const Product P{
      w, scales, x, norm_w, N, K, out, 0, nullptr, nullptr, f16_overflow, plan.pre_warps, plan.late_trigger};
  by_kind<kGemvColsMT>(plan.ep, plan.in, plan.whole, plan.tail, plan.bias, [&](auto kernel) {
    af_launch(kernel, dim3(plan.blocks), dim3(kGemvThreads), plan.smem, stream, P, M, plan.raw_rows, eps, rope);
    return 0;
  });
}

}  // namespace atomflow::kernels

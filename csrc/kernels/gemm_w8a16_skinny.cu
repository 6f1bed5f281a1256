// W8A16 product for prompt chunks of up to 64 rows: y[m, n] = sum_k x[m, k] * fp8[n, k] * scale[n, k / 128].
//
// Such a chunk is bound by the weight stream (64 rows: 128 FLOPs a weight byte, under the tensor cores'
// ridge), so the kernel streams the weights as the decode GEMV does and keeps the tensor cores out of the
// way:
//  - A block is 8 warps on 128 weight rows, each warp a 16-row tile. A warp copies its rows' weights a
//    slab (256 columns) at a time into shared memory, 256 contiguous bytes a row and 16 lanes (cp.async;
//    runs as long as the decode GEMV's, not the 64 bytes a row that loading the MMA fragments directly
//    would give), two slabs a warp at 4 token tiles (one read while the next lands), four at 8 (64 KB a
//    block, two blocks an SM / 128 KB, one); the first ones before the PDL wait (weights are immutable).
//    Lane (g = lane / 4, q = lane % 4) then reads 16 bytes of rows g and g + 8 at column 16 q of each
//    64-column iteration, which feed four m16n8k16 steps: k is permuted within the iteration so that
//    step j takes physical columns 16 q + 4 j .. + 3 in the slots 2q, 2q + 1, 2q + 8, 2q + 9; x (the B
//    operand, tokens on the 8-wide side, nt tiles of 8) is read with the same permutation, 32 contiguous
//    bytes a lane and token.
//  - Weights are converted exactly to x's type; each 128-column scale group's partial sums start from
//    zero and are added to the fp32 accumulator times the row's scale (gemm_w8a16's recipe).
//  - x streams through shared memory in slabs of 256 columns, one bulk copy a token row (TMA, on an
//    mbarrier; rows past M stay zero), two slabs: one read while the next lands, one block barrier a
//    slab. The split's scales are staged once, before the PDL wait.
//  - A product with fewer 128-row blocks than SMs splits its scale groups over a cluster of up to 8
//    blocks (portable size). Every block leaves its partial sums in shared memory; after a cluster
//    barrier, block r adds the slice r of the rows from every block in rank order (the same sum
//    whatever the schedule) and runs the epilogue on it: no workspace, no second launch.
//  - SwiGLU: a block's rows are 64 gate rows and their 64 up rows (warps 0..3 gate, 4..7 up), so one
//    block holds both inputs of each of its 64 outputs.
//  - RopeKV: a block's 128 rows are whole heads (head_dim divides 128), so it holds both halves of each
//    rotation pair; a split's slice of the outputs is a range of pairs (i, i + D / 2), rotated and stored
//    with rope.cuh's arithmetic: the bits of Store and then rope_kv_append.
//
// Contract of gemm_w8a16_skinny (launcher at the end; plan_gemm_skinny: kernels.h):
//  Inputs   w fp8 e4m3 [N, K] row-major, scales fp32 [N, ceil(K / 128)], x 16-bit [M, K] of the plan's type;
//           1 <= M <= 64, N % 16 == 0 (SwiGLU N % 32 == 0), K % 64 == 0 (a last group of 64 columns
//           when K % 128 == 64); 16-byte aligned.
//  Before its PDL wait: lets the next kernel launch, loads weights and scales (nothing an earlier kernel
//           writes).
//  Writes   Store: out fp32 [M, N] = y; AddResidual: out += y; SwiGLU (N = 2F): out bf16 [M, F] =
//           bf16(silu(y[:, :F]) * y[:, F:]); RopeKV (N = (H + 2 Hkv) D, 128 % D == 0): q_out bf16 [M, H, D]
//           and the K / V cache rows of positions *pos + m below max_context, as rope_kv_append writes them
//           from y (+ bias). Each element once, by one block. With a SkinnyNormOut (AddResidual): also
//           xw bf16 [M, N] = bf16(out * w) and ss [M, row_groups], each row group's sums of squares of out per
//           row (a cluster's blocks add theirs over DSMEM, in split order); with a SkinnyNormIn: y of row m
//           times rsqrt(sum of ss[m, :] / d + eps) before the epilogue (kernels.h).
//  Leaves   nothing else; no scratch.
#include <cooperative_groups.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "atomflow/kernels.h"
#include "atomflow/pdl.cuh"
#include "atomflow/rope.cuh"
#include "mma_w8a16.cuh"

namespace atomflow::kernels {

namespace {

namespace cg = cooperative_groups;

constexpr int kSkThreads = 256;                  // 8 warps of one 16-row tile each
constexpr int kSkRows = 128;                     // weight rows a block
constexpr int kSkIter = 64;                      // columns an iteration: 4 lanes x 16 bytes
constexpr int kSkSlab = 4 * kSkIter;             // x columns a slab (256)
constexpr int kSkSlabStride = kSkSlab * 2 + 16;  // bytes a token row of a slab: 16 mod 128, conflict-free LDS.128
constexpr int kSkRedStride = kSkRows + 4;        // floats a token row of the partial sums: conflict-free stores
constexpr int kGroup = 128;                      // columns a scale group
constexpr int kStageBytes = 16 * kSkSlab;        // a warp's weights a slab: 16 rows x 256 bytes

// NT token tiles of 8; a warp keeps kRing slabs of its weights in shared memory (one read, the others
// landing): 64 KB a block at NT = 4 (two blocks an SM), 128 KB at NT = 8 (one).
template <int NT>
struct SkTile {
  static constexpr int kTokens = 8 * NT;
  static constexpr int kRing = NT <= 4 ? 2 : 4;
  static constexpr int kBlocksPerSm = NT <= 4 ? 2 : 1;
  static constexpr int kSlabBytes = kTokens * kSkSlabStride;
  static constexpr int kXBytes = 2 * kSlabBytes;  // two slabs: one read, one landing
  static constexpr int kWBytes = (kSkThreads / 32) * kRing * kStageBytes;
  static constexpr int kRedBytes = kTokens * kSkRedStride * 4;
  static constexpr int kMainBytes = kXBytes + kWBytes;               // the partial sums reuse it after the main loop
  static constexpr int kSqBytes = 4 * kTokens * (kSkRows / 4);       // a norm's squares, [M][quads]
  static constexpr int kSlotBytes = 4 * kSkinnyMaxSplits * kTokens;  // rank 0's: each block's row sums
  static_assert(kRedBytes + kSqBytes + kSlotBytes <= kMainBytes,
                "the partial sums, a norm's squares and its slots fit where x and the weights were");
};

// Scale rows in shared memory: kg groups padded to an odd stride (8 lanes read 8 rows of one group).
__host__ __device__ constexpr int scale_stride(int kg) { return kg | 1; }

constexpr int kMaxRopeFreqs = kSkRows / 2;  // RopeKV: head_dim divides 128

// Shared memory: the main loop's x slabs and weight stages (the partial sums and a norm's squares reuse them
// after it), the split's scales, two mbarriers, the rows' norm factors and RoPE's frequencies.
template <int NT>
size_t skinny_smem(int kg) {
  return static_cast<size_t>(SkTile<NT>::kMainBytes) + sizeof(float) * kSkRows * scale_stride(kg) +
         2 * sizeof(uint64_t) + sizeof(float) * (kSkinnyMaxRows + kMaxRopeFreqs);
}

struct SkArgs {
  const uint8_t* w;
  const float* scales;
  const uint16_t* x;
  void* out;
  int M, N, K;
  int kg;              // scale groups a split
  RopeKVArgs rope;     // RopeKV: where the rotated q and the K / V rows go (out unused)
  SkinnyNormOut nout;  // AddResidual: the next RMSNorm's half (ss null: none)
  SkinnyNormIn nin;    // the other epilogues: the previous RMSNorm's half (ss null: none)
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(smem)), "l"(gmem));
}
// 16 bytes of streamed weights. No L2 evict-first hint: ptxas 13.0 puts that copy's 64-bit cache policy in
// an odd uniform register pair here (desc[UR1]), an illegal instruction on the GPU.
__device__ __forceinline__ void cp_async16_weights(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nLAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@p bra LAB_DONE;\nbra LAB_WAIT;\nLAB_DONE:\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// size bytes (a multiple of 16, both ends 16-byte aligned) global -> shared, counted on bar.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t size, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
      "l"(src), "r"(size), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Local row lr (0..127) of row group rg -> weight row, or -1 past the end. SwiGLU: lr < 64 gate row
// i = 64 rg + lr, else up row F + i of i = 64 rg + lr - 64.
template <Epilogue EP>
__device__ __forceinline__ int weight_row(int lr, int rg, int N) {
  if constexpr (EP == Epilogue::SwiGLU) {
    const int F = N / 2, i = rg * (kSkRows / 2) + lr % (kSkRows / 2);
    return i >= F ? -1 : lr < kSkRows / 2 ? i : F + i;
  } else {
    const int n = rg * kSkRows + lr;
    return n < N ? n : -1;
  }
}

template <int NT, Epilogue EP, Act A>
__global__ void __launch_bounds__(kSkThreads, SkTile<NT>::kBlocksPerSm) gemm_skinny_kernel(const SkArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using T = SkTile<NT>;
  constexpr int R = T::kRing;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* const xring = smem;
  uint8_t* const wring = smem + T::kXBytes;
  float* const red = reinterpret_cast<float*>(smem);  // after the main loop
  float* const ssc = reinterpret_cast<float*>(smem + T::kMainBytes);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, q = lane % 4;
  const int split = blockIdx.x, splits = gridDim.x, rg = blockIdx.y;
  const int G = (a.K + kGroup - 1) / kGroup;
  const int g0 = split * a.kg;
  const int ng = min(a.kg, G - g0);  // this split's scale groups (>= 1: the plan drops empty splits)
  const int kgp = scale_stride(a.kg);
  uint64_t* const xbar = reinterpret_cast<uint64_t*>(ssc + kSkRows * kgp);
  float* const rsm = reinterpret_cast<float*>(xbar + 2);  // row m: SkinnyNormIn 1 / rms
  float* const freqs = rsm + kSkinnyMaxRows;              // RopeKV: inv_freq [D / 2]
  const int k0 = g0 * kGroup, k1 = min(a.K, (g0 + ng) * kGroup);
  const int n_it = (k1 - k0) / kSkIter;
  const int n_slab = (n_it + 3) / 4;

  const int lr0 = 16 * warp + g, lr1 = lr0 + 8;
  // The warp's slab s of weights (its 16 rows x 256 columns) into stage s % R, one commit group a slab:
  // copy i takes rows 2i and 2i + 1, 256 contiguous bytes each (16 lanes a row). Row r's 16-byte chunk c
  // sits at chunk c ^ 4 (r & 1): the fragment reads (rows g and g + 1 of a quarter warp, chunks 4 j + q)
  // meet no bank twice.
  uint8_t* const stages = wring + warp * (R * kStageBytes);
  const int cr = lane / 16, cc = lane % 16;
  auto fetch = [&](int s) {
    const int kc = k0 + s * kSkSlab + 16 * cc;
    if (s < n_slab && kc < k1) {
      uint8_t* dst = stages + (s % R) * kStageBytes;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int r = 2 * i + cr;
        const int row = max(weight_row<EP>(16 * warp + r, rg, a.N), 0);
        // Rows past the end stream row 0 (their sums are never stored).
        cp_async16_weights(dst + r * kSkSlab + 16 * (cc ^ (4 * (r & 1))), a.w + static_cast<size_t>(row) * a.K + kc);
      }
    }
    cp_async_commit();
  };

  pdl_launch_dependents();
  // Before the wait: what is immutable (the split's scales, then the first R slabs of weights).
  for (int i = tid; i < kSkRows * ng; i += kSkThreads) {
    const int lr = i / ng, gi = i % ng;
    const int row = weight_row<EP>(lr, rg, a.N);
    cp_async4(ssc + lr * kgp + gi, a.scales + static_cast<size_t>(max(row, 0)) * G + g0 + gi);
  }
  if constexpr (EP == Epilogue::RopeKV)
    for (int i = tid; i < a.rope.D / 2; i += kSkThreads) cp_async4(freqs + i, a.rope.inv_freq + i);
  cp_async_commit();
#pragma unroll 1
  for (int s = 0; s < R; ++s) fetch(s);
  // x's token rows past M stay zero in both slabs (the bulk copies fill rows < M only).
  for (int i = tid; i < 2 * (T::kTokens - a.M) * (kSkSlabStride / 16); i += kSkThreads) {
    const int b = i / ((T::kTokens - a.M) * (kSkSlabStride / 16)), r = i % ((T::kTokens - a.M) * (kSkSlabStride / 16));
    const int m = a.M + r / (kSkSlabStride / 16), c = r % (kSkSlabStride / 16);
    *reinterpret_cast<uint4*>(xring + b * T::kSlabBytes + m * kSkSlabStride + 16 * c) = make_uint4(0, 0, 0, 0);
  }
  if (tid == 0) {
    mbar_init(&xbar[0]);
    mbar_init(&xbar[1]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  pdl_wait();
  // Slab s: x[0 .. M)[k0 + 256 s, + 256) into slab buffer s % 2, counted on xbar[s % 2]: one bulk copy a
  // token row, token m by lane m / 8 of warp m % 8 (a warp issues its lanes' copies one at a time).
  auto stage = [&](int s) {
    const int kc = k0 + s * kSkSlab;
    const uint32_t bytes = static_cast<uint32_t>(min(kSkSlab, k1 - kc)) * 2;
    uint8_t* dst = xring + (s % 2) * T::kSlabBytes;
    if (tid == 0) mbar_expect_tx(&xbar[s % 2], bytes * a.M);
    const int m = warp + 8 * lane;
    if (m < a.M) bulk_load(dst + m * kSkSlabStride, a.x + static_cast<size_t>(m) * a.K + kc, bytes, &xbar[s % 2]);
  };
  stage(0);
  if (n_slab > 1) stage(1);
  const int pos0 = EP == Epilogue::RopeKV ? __ldcg(a.rope.pos) : 0;  // RopeKV: the chunk's first position
  // SkinnyNormIn: each row's 1 / rms from the P sums of squares the AddResidual product left, a warp a row
  // (lane 0's order: its strided partial, then the butterfly). A warp's loads of 64 sums of each of its rows
  // go out together (one trip to L2, under x's first slabs); the main loop's first barrier publishes rsm.
  if (a.nin.ss != nullptr) {
    constexpr int W = kSkThreads / 32, RW = kSkinnyMaxRows / W;
    float t[RW];
#pragma unroll
    for (int j = 0; j < RW; ++j) t[j] = 0.f;
    for (int p0 = 0; p0 < a.nin.parts; p0 += 64) {
      float v[RW][2];
#pragma unroll
      for (int j = 0; j < RW; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int m = warp + W * j, p = p0 + lane + 32 * h;
          v[j][h] = m < a.M && p < a.nin.parts ? __ldcg(a.nin.ss + static_cast<size_t>(m) * a.nin.parts + p) : 0.f;
        }
#pragma unroll
      for (int j = 0; j < RW; ++j) t[j] = t[j] + v[j][0] + v[j][1];
    }
#pragma unroll
    for (int j = 0; j < RW; ++j) {
#pragma unroll
      for (int off = 16; off > 0; off /= 2) t[j] += __shfl_xor_sync(0xffffffffu, t[j], off);
      const int m = warp + W * j;
      if (lane == 0 && m < a.M) rsm[m] = rsqrtf(t[j] / static_cast<float>(a.nin.d) + a.nin.eps);
    }
  }

  // The epilogue's slice (below), known from the start: the thread's first output quad. AddResidual loads its
  // residual now (an L2 trip under the main loop instead of after the reduction; only this thread writes
  // it), and a SkinnyNormOut its four weights.
  constexpr bool kPairs = EP == Epilogue::SwiGLU || EP == Epilogue::RopeKV;
  constexpr int kOuts = kPairs ? kSkRows / 2 : kSkRows;
  const int per = (CEIL_DIV(kOuts, splits) + 3) / 4 * 4;
  const int o0 = split * per, o1 = min(kOuts, o0 + per);
  const int quads = max(0, (o1 - o0) / 4);
  const bool norm_out = EP == Epilogue::AddResidual && a.nout.ss != nullptr;
  float4 res0 = make_float4(0.f, 0.f, 0.f, 0.f), nw0 = res0;
  if constexpr (EP == Epilogue::AddResidual) {
    const int n = rg * kSkRows + o0 + 4 * (tid % max(quads, 1));
    if (tid < a.M * quads && n < a.N) {
      res0 = __ldcg(reinterpret_cast<const float4*>(static_cast<const float*>(a.out) +
                                                    static_cast<size_t>(tid / quads) * a.N + n));
      if (norm_out) {
        const uint2 wb = *reinterpret_cast<const uint2*>(a.nout.w + n);
        const __nv_bfloat162 lo2 = *reinterpret_cast<const __nv_bfloat162*>(&wb.x);
        const __nv_bfloat162 hi2 = *reinterpret_cast<const __nv_bfloat162*>(&wb.y);
        nw0 = make_float4(__low2float(lo2), __high2float(lo2), __low2float(hi2), __high2float(hi2));
      }
    }
  }

  float acc[NT][4], part[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[t][e] = part[t][e] = 0.f;

#pragma unroll 1
  for (int s = 0; s < n_slab; ++s) {
    mbar_wait(&xbar[s % 2], (s / 2) & 1);  // slab s of x landed
    cp_async_wait<R - 1>();                // this lane's copies of the warp's slab s (and, first, the scales)
    if (s == 0)
      __syncthreads();  // everyone's scales
    else
      __syncwarp();  // the warp's copies
    const uint8_t* xs = xring + (s % 2) * T::kSlabBytes + g * kSkSlabStride + 32 * q;
    const uint8_t* ws = stages + (s % R) * kStageBytes + g * kSkSlab;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int it = s * 4 + j;
      if (it < n_it) {
        const int c = (4 * j + q) ^ (4 * (g & 1));  // rows g and g + 8 have g's parity
        const uint4 wa = *reinterpret_cast<const uint4*>(ws + 16 * c);
        const uint4 wb = *reinterpret_cast<const uint4*>(ws + 8 * kSkSlab + 16 * c);
        uint32_t af[4][4];  // step st: a0 (row g, slots 2q, 2q+1), a1 (row g + 8), a2, a3 (slots 2q+8, 2q+9)
#pragma unroll
        for (int st = 0; st < 4; ++st) {
          const uint32_t lo = word(wa, st), hi = word(wb, st);
          af[st][0] = fp8x2_to_16x2<A>(lo & 0xFFFFu);
          af[st][1] = fp8x2_to_16x2<A>(hi & 0xFFFFu);
          af[st][2] = fp8x2_to_16x2<A>(lo >> 16);
          af[st][3] = fp8x2_to_16x2<A>(hi >> 16);
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const uint8_t* xr = xs + t * 8 * kSkSlabStride + j * kSkIter * 2;
          const uint4 x0 = *reinterpret_cast<const uint4*>(xr);
          const uint4 x1 = *reinterpret_cast<const uint4*>(xr + 16);
          mma16<A>(part[t], af[0][0], af[0][1], af[0][2], af[0][3], x0.x, x0.y);
          mma16<A>(part[t], af[1][0], af[1][1], af[1][2], af[1][3], x0.z, x0.w);
          mma16<A>(part[t], af[2][0], af[2][1], af[2][2], af[2][3], x1.x, x1.y);
          mma16<A>(part[t], af[3][0], af[3][1], af[3][2], af[3][3], x1.z, x1.w);
        }
        // A scale group ends after every second iteration (k0 is a group boundary), and at a row's
        // 64-column tail group.
        if ((it & 1) || it + 1 == n_it) {
          const float s0 = ssc[lr0 * kgp + it / 2], s1 = ssc[lr1 * kgp + it / 2];
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            acc[t][0] = fmaf(part[t][0], s0, acc[t][0]);
            acc[t][1] = fmaf(part[t][1], s0, acc[t][1]);
            acc[t][2] = fmaf(part[t][2], s1, acc[t][2]);
            acc[t][3] = fmaf(part[t][3], s1, acc[t][3]);
#pragma unroll
            for (int e = 0; e < 4; ++e) part[t][e] = 0.f;
          }
        }
      }
    }
    __syncwarp();  // the warp is past its slab s of weights: the stage takes slab s + R
    fetch(s + R);
    // Everyone is past slab s of x: its buffer takes slab s + 2.
    __syncthreads();
    if (s + 2 < n_slab) stage(s + 2);
  }

  // The partial sums, [token][local row], over x and the weight slots (every copy has landed: the last
  // commit groups are empty, every slab was waited for).
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int m = 8 * t + 2 * q;  // c0, c1: row g, tokens m, m + 1; c2, c3: row g + 8
    red[m * kSkRedStride + lr0] = acc[t][0];
    red[(m + 1) * kSkRedStride + lr0] = acc[t][1];
    red[m * kSkRedStride + lr1] = acc[t][2];
    red[(m + 1) * kSkRedStride + lr1] = acc[t][3];
  }
  cg::cluster_group cluster = cg::this_cluster();
  if (splits > 1)
    cluster.sync();  // every block's sums are in its shared memory
  else
    __syncthreads();

  // This block's slice of the outputs (o0 .. o1, above), 4 consecutive a thread: the sums of every split in
  // rank order, their loads issued together. SwiGLU and RopeKV own pairs of rows (lo, lo + half): gate and up
  // rows, the two halves of a rotation.
  const int half = EP == Epilogue::RopeKV ? a.rope.D / 2 : kSkRows / 2;
  float* const sq = reinterpret_cast<float*>(smem + SkTile<NT>::kRedBytes);  // SkinnyNormOut: [M][quads]
  for (int i = tid; i < a.M * quads; i += kSkThreads) {
    const int m = i / quads, o = o0 + 4 * (i % quads);
    const int lo = kPairs ? o / half * (2 * half) + o % half : o;  // pair o's first row (half % 4 == 0)
    float4 vy[kSkinnyMaxSplits], vu[kSkinnyMaxSplits];
#pragma unroll
    for (int r = 0; r < kSkinnyMaxSplits; ++r) {
      if (r < splits) {
        const float* src = (splits > 1 ? cluster.map_shared_rank(red, r) : red) + m * kSkRedStride + lo;
        vy[r] = *reinterpret_cast<const float4*>(src);
        if constexpr (kPairs) vu[r] = *reinterpret_cast<const float4*>(src + half);
      }
    }
    float4 y = vy[0], u = kPairs ? vu[0] : y;
#pragma unroll
    for (int r = 1; r < kSkinnyMaxSplits; ++r) {
      if (r < splits) {
        y.x += vy[r].x, y.y += vy[r].y, y.z += vy[r].z, y.w += vy[r].w;
        if constexpr (kPairs) u.x += vu[r].x, u.y += vu[r].y, u.z += vu[r].z, u.w += vu[r].w;
      }
    }
    if (EP != Epilogue::AddResidual && a.nin.ss != nullptr) {  // the normalized x's product
      const float r = rsm[m];
      y.x *= r, y.y *= r, y.z *= r, y.w *= r;
      u.x *= r, u.y *= r, u.z *= r, u.w *= r;
    }
    if constexpr (EP == Epilogue::SwiGLU) {
      const int F = a.N / 2, n = rg * (kSkRows / 2) + o;
      if (n >= F) continue;
      auto act = [](float gate, float up) { return gate / (1.f + expf(-gate)) * up; };
      const __nv_bfloat162 lo2 = __floats2bfloat162_rn(act(y.x, u.x), act(y.y, u.y));
      const __nv_bfloat162 hi2 = __floats2bfloat162_rn(act(y.z, u.z), act(y.w, u.w));
      uint2 bits;
      bits.x = *reinterpret_cast<const uint32_t*>(&lo2);
      bits.y = *reinterpret_cast<const uint32_t*>(&hi2);
      *reinterpret_cast<uint2*>(static_cast<bf16*>(a.out) + static_cast<size_t>(m) * F + n) = bits;
    } else if constexpr (EP == Epilogue::RopeKV) {
      const RopeKVArgs& R = a.rope;
      const int n = rg * kSkRows + lo;  // the pairs' first column: head n / D, frequencies n % D ..
      if (n >= a.N) continue;
      const int head = n / R.D, f = n % R.D;
      float x1[4] = {y.x, y.y, y.z, y.w}, x2[4] = {u.x, u.y, u.z, u.w};
      if (R.bias != nullptr) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          x1[e] = __fadd_rn(x1[e], R.bias[n + e]);
          x2[e] = __fadd_rn(x2[e], R.bias[n + half + e]);
        }
      }
      const int p = pos0 + m;
      bf16* dst;
      if (head < R.H)
        dst = R.q_out + (static_cast<size_t>(m) * R.H + head) * R.D + f;
      else if (p >= R.max_context)
        continue;  // a token past the cache: its key and value are not kept
      else if (head < R.H + R.Hkv)
        dst = R.k_cache + (static_cast<size_t>(p) * R.Hkv + head - R.H) * R.D + f;
      else
        dst = R.v_cache + (static_cast<size_t>(p) * R.Hkv + head - R.H - R.Hkv) * R.D + f;
      if (head < R.H + R.Hkv) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float c, sn;
          rope_cos_sin(p, freqs[f + e], c, sn);
          rope_rotate(x1[e], x2[e], c, sn, x1[e], x2[e]);
        }
      }
      const __nv_bfloat162 a01 = __floats2bfloat162_rn(x1[0], x1[1]), a23 = __floats2bfloat162_rn(x1[2], x1[3]);
      const __nv_bfloat162 b01 = __floats2bfloat162_rn(x2[0], x2[1]), b23 = __floats2bfloat162_rn(x2[2], x2[3]);
      *reinterpret_cast<uint2*>(dst) =
          make_uint2(*reinterpret_cast<const uint32_t*>(&a01), *reinterpret_cast<const uint32_t*>(&a23));
      *reinterpret_cast<uint2*>(dst + half) =
          make_uint2(*reinterpret_cast<const uint32_t*>(&b01), *reinterpret_cast<const uint32_t*>(&b23));
    } else {
      const int n = rg * kSkRows + o;
      if (n >= a.N) {
        if (norm_out) sq[i] = 0.f;
        continue;
      }
      float4* dst = reinterpret_cast<float4*>(static_cast<float*>(a.out) + static_cast<size_t>(m) * a.N + n);
      if constexpr (EP == Epilogue::AddResidual) {
        const bool first = i == tid;  // loaded before the main loop
        const float4 r = first ? res0 : __ldcg(dst);
        y.x += r.x, y.y += r.y, y.z += r.z, y.w += r.w;
        if (norm_out) {  // the next RMSNorm's half: bf16(out * w) and the squares of out
          float4 w4 = nw0;
          if (!first) {
            const bf16* wn = a.nout.w + n;
            w4 = make_float4(__bfloat162float(wn[0]), __bfloat162float(wn[1]), __bfloat162float(wn[2]),
                             __bfloat162float(wn[3]));
          }
          const __nv_bfloat162 lo2 = __floats2bfloat162_rn(y.x * w4.x, y.y * w4.y);
          const __nv_bfloat162 hi2 = __floats2bfloat162_rn(y.z * w4.z, y.w * w4.w);
          *reinterpret_cast<uint2*>(a.nout.xw + static_cast<size_t>(m) * a.N + n) =
              make_uint2(*reinterpret_cast<const uint32_t*>(&lo2), *reinterpret_cast<const uint32_t*>(&hi2));
          sq[i] = fmaf(y.w, y.w, fmaf(y.z, y.z, fmaf(y.y, y.y, y.x * y.x)));
        }
      }
      *dst = y;
    }
  }
  if (norm_out) {  // each row's sum over its row group's columns, in column order, into ss[m, rg]
    float* const slots = reinterpret_cast<float*>(smem + T::kRedBytes + T::kSqBytes);  // rank 0's: [split][m]
    float* const dst = splits > 1 ? cluster.map_shared_rank(slots, 0) : slots;
    __syncthreads();
    for (int m = tid; m < a.M; m += kSkThreads) {  // this block's columns, into rank 0's slot
      float t = 0.f;
      for (int j = 0; j < quads; ++j) t += sq[m * quads + j];
      dst[split * T::kTokens + m] = t;
    }
    // Every slot written and every remote read of the partial sums done: after this barrier no block touches
    // another's shared memory, so none waits for the others to leave.
    if (splits > 1)
      cluster.sync();
    else
      __syncthreads();
    if (split == 0) {
      for (int m = tid; m < a.M; m += kSkThreads) {  // the cluster's blocks, in split (= column) order
        float t = slots[m];
        for (int r = 1; r < splits; ++r) t += slots[r * T::kTokens + m];
        a.nout.ss[static_cast<size_t>(m) * gridDim.y + rg] = t;
      }
    }
  } else if (splits > 1) {
    cluster.sync();  // no block leaves while another reads its shared memory
  }
#endif
}

using SkKernel = void (*)(SkArgs);

// The instance, its shared-memory limit raised once (to the most any plan asks).
template <int NT, Epilogue EP, Act A>
SkKernel skinny_kernel() {
  static const bool configured = [] {
    AF_CUDA_CHECK(cudaFuncSetAttribute(gemm_skinny_kernel<NT, EP, A>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(skinny_smem<NT>(kSkinnyMaxGroups))));
    return true;
  }();
  (void)configured;
  return gemm_skinny_kernel<NT, EP, A>;
}

template <int NT, Act A>
SkKernel kernel_for_ep(Epilogue ep) {
  switch (ep) {
    case Epilogue::Store: return skinny_kernel<NT, Epilogue::Store, A>();
    case Epilogue::AddResidual: return skinny_kernel<NT, Epilogue::AddResidual, A>();
    case Epilogue::SwiGLU: return skinny_kernel<NT, Epilogue::SwiGLU, A>();
    case Epilogue::RopeKV: return skinny_kernel<NT, Epilogue::RopeKV, A>();
    default: AF_CHECK(false, "gemm_w8a16_skinny: unknown epilogue");
  }
  return nullptr;
}

SkKernel kernel_of(int nt, Epilogue ep, Act xt) {
  if (xt == Act::F16) return nt == 4 ? kernel_for_ep<4, Act::F16>(ep) : kernel_for_ep<8, Act::F16>(ep);
  return nt == 4 ? kernel_for_ep<4, Act::BF16>(ep) : kernel_for_ep<8, Act::BF16>(ep);
}

// Clusters of `splits` blocks of this instance at `smem` bytes each that the current device holds at once
// (cudaOccupancyMaxActiveClusters: a cluster sits in one GPC, so fewer than the SMs' block slots suggest).
int resident_clusters(SkKernel k, int splits, size_t smem) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = splits;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(splits, 1, 1);
  cfg.blockDim = dim3(kSkThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int n = 0;
  AF_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, k, &cfg));
  return n;
}

}  // namespace

bool gemm_w8a16_skinny_supported(Epilogue ep, int M, int N, int K) {
  const bool ep_ok = ep == Epilogue::Store || ep == Epilogue::AddResidual || ep == Epilogue::RopeKV ||
                     (ep == Epilogue::SwiGLU && N % 32 == 0);
  return ep_ok && M >= 1 && M <= kSkinnyMaxRows && N >= 16 && N % 16 == 0 && K >= kSkIter && K % kSkIter == 0 &&
         CEIL_DIV(K, kGroup) <= kSkinnyMaxSplits * kSkinnyMaxGroups;
}

// Splits by a cost in scale groups a block streams: the blocks of a wave stream at once, each its kg groups
// plus one for the fixed part (x's first slabs, the reduction), and a wave is the clusters the device holds
// at once (resident_clusters). A block alone on its SM streams slower than two blocks on one do, so a tie
// goes to the most splits (measured: docs/design/gemm_w8a16_skinny.md, every split of the 3B and 8B
// products); then as many groups a split as that leaves (no empty split).
static int choose_splits(int nt, Epilogue ep, Act xt, int row_groups, int G) {
  const SkKernel k = kernel_of(nt, ep, xt);
  int best = 0, best_cost = 0;
  for (int s = CEIL_DIV(G, kSkinnyMaxGroups); s <= std::min(kSkinnyMaxSplits, G); ++s) {
    const int kg = CEIL_DIV(G, s);
    if (CEIL_DIV(G, kg) != s) continue;  // the same split as a smaller s
    const int clusters = resident_clusters(k, s, nt == 4 ? skinny_smem<4>(kg) : skinny_smem<8>(kg));
    if (clusters == 0) continue;
    const int cost = CEIL_DIV(row_groups, clusters) * (kg + 1);
    if (best == 0 || cost <= best_cost) best = s, best_cost = cost;
  }
  AF_CHECK(best > 0, "gemm_w8a16_skinny: no split of the scale groups fits the device");
  return best;
}

// choose_splits, asked once per device and shape (a prompt chunk plans every product it launches).
static int skinny_splits(int nt, Epilogue ep, Act xt, int row_groups, int G) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int, int, int, int>, int> known;
  int device = 0;
  AF_CUDA_CHECK(cudaGetDevice(&device));
  const auto key = std::make_tuple(device, nt, static_cast<int>(ep), static_cast<int>(xt), row_groups, G);
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = known.find(key);
    if (it != known.end()) return it->second;
  }
  const int s = choose_splits(nt, ep, xt, row_groups, G);
  std::lock_guard<std::mutex> lock(mu);
  known.emplace(key, s);
  return s;
}

SkinnyPlan plan_gemm_skinny(Epilogue ep, Act xt, int M, int N, int K, int splits) {
  AF_CHECK(gemm_w8a16_skinny_supported(ep, M, N, K),
           "gemm_w8a16_skinny: unsupported shape (needs 1 <= M <= 64, N % 16 == 0 (SwiGLU N % 32 == 0), K % 64 == 0, "
           "K <= 24576)");
  const int G = CEIL_DIV(K, kGroup);
  SkinnyPlan p{};
  p.ep = ep, p.xt = xt, p.M = M, p.N = N, p.K = K;
  p.nt = M <= 32 ? 4 : 8;
  p.row_groups = ep == Epilogue::SwiGLU ? CEIL_DIV(N / 2, kSkRows / 2) : CEIL_DIV(N, kSkRows);
  AF_CHECK(p.row_groups <= 65535, "gemm_w8a16_skinny: N too large for the grid");
  const int s = splits == 0 ? skinny_splits(p.nt, ep, xt, p.row_groups, G) : splits;
  AF_CHECK(s >= 1 && s <= kSkinnyMaxSplits, "gemm_w8a16_skinny: splits must be 1..8");
  p.kg = CEIL_DIV(G, std::min(s, G));
  AF_CHECK(p.kg <= kSkinnyMaxGroups, "gemm_w8a16_skinny: too few splits for K (at most 24 scale groups a split)");
  p.splits = CEIL_DIV(G, p.kg);
  p.threads = kSkThreads;
  p.smem = p.nt == 4 ? skinny_smem<4>(p.kg) : skinny_smem<8>(p.kg);
  return p;
}

static void run_skinny(const SkinnyPlan& p, const uint8_t* w, const float* scales, const void* x, void* out,
                       const RopeKVArgs& rope, cudaStream_t stream, const SkinnyNormOut* nout,
                       const SkinnyNormIn* nin) {
  AF_CHECK(gemm_w8a16_skinny_supported(p.ep, p.M, p.N, p.K) && (p.nt == 4 || p.nt == 8) && p.nt * 8 >= p.M &&
               p.splits >= 1 && p.splits <= kSkinnyMaxSplits && p.kg >= 1 && p.kg <= kSkinnyMaxGroups &&
               (p.splits - 1) * p.kg < CEIL_DIV(p.K, kGroup) && p.splits * p.kg >= CEIL_DIV(p.K, kGroup),
           "gemm_w8a16_skinny: the plan is not one plan_gemm_skinny makes");
  AF_CHECK(reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
               (p.ep == Epilogue::RopeKV || (out != nullptr && reinterpret_cast<uintptr_t>(out) % 16 == 0)),
           "gemm_w8a16_skinny: w, x and out must be 16-byte aligned");
  if (nout != nullptr)
    AF_CHECK(p.ep == Epilogue::AddResidual && p.row_groups == skinny_norm_parts(p.N) && nout->w != nullptr &&
                 nout->xw != nullptr && nout->ss != nullptr && reinterpret_cast<uintptr_t>(nout->w) % 8 == 0 &&
                 reinterpret_cast<uintptr_t>(nout->xw) % 8 == 0,
             "gemm_w8a16_skinny: norm_out needs AddResidual, w and xw 8-byte aligned, and ss");
  if (nin != nullptr)
    AF_CHECK(p.ep != Epilogue::AddResidual && p.xt == Act::BF16 && nin->ss != nullptr && nin->parts >= 1 &&
                 nin->d >= 1 && nin->eps > 0.f,
             "gemm_w8a16_skinny: norm_in needs bf16 x (a norm_out's xw), not AddResidual, ss, parts, d and eps > 0");
  const SkArgs a{w,
                 scales,
                 static_cast<const uint16_t*>(x),
                 out,
                 p.M,
                 p.N,
                 p.K,
                 p.kg,
                 rope,
                 nout != nullptr ? *nout : SkinnyNormOut{},
                 nin != nullptr ? *nin : SkinnyNormIn{}};
  af_launch_clusters(kernel_of(p.nt, p.ep, p.xt), dim3(p.splits, p.row_groups), dim3(kSkThreads), dim3(p.splits, 1, 1),
                     p.smem, stream, a);
}

bool gemm_w8a16_skinny_rope_supported(int N, int H, int Hkv, int D) {
  return H >= 1 && Hkv >= 1 && D >= 8 && D % 8 == 0 && kSkRows % D == 0 && N == (H + 2 * Hkv) * D;
}

void gemm_w8a16_skinny(const SkinnyPlan& p, const uint8_t* w, const float* scales, const void* x, void* out,
                       cudaStream_t stream, const SkinnyNormOut* norm_out, const SkinnyNormIn* norm_in) {
  AF_CHECK(p.ep != Epilogue::RopeKV, "gemm_w8a16_skinny: RopeKV is gemm_w8a16_skinny_rope's");
  run_skinny(p, w, scales, x, out, RopeKVArgs{}, stream, norm_out, norm_in);
}

void gemm_w8a16_skinny_rope(const SkinnyPlan& p, const uint8_t* w, const float* scales, const void* x,
                            const RopeKVArgs& rope, cudaStream_t stream, const SkinnyNormIn* norm_in) {
  AF_CHECK(p.ep == Epilogue::RopeKV, "gemm_w8a16_skinny_rope: the plan must be RopeKV's");
  AF_CHECK(gemm_w8a16_skinny_rope_supported(p.N, rope.H, rope.Hkv, rope.D) && rope.max_context >= 1,
           "gemm_w8a16_skinny_rope: needs N = (H + 2 Hkv) head_dim, head_dim a multiple of 8 dividing 128, "
           "max_context >= 1");
  AF_CHECK(rope.inv_freq != nullptr && rope.pos != nullptr && rope.q_out != nullptr && rope.k_cache != nullptr &&
               rope.v_cache != nullptr,
           "gemm_w8a16_skinny_rope: needs inv_freq, pos, q_out and the caches");
  AF_CHECK(reinterpret_cast<uintptr_t>(rope.q_out) % 8 == 0 && reinterpret_cast<uintptr_t>(rope.k_cache) % 8 == 0 &&
               reinterpret_cast<uintptr_t>(rope.v_cache) % 8 == 0,
           "gemm_w8a16_skinny_rope: q_out and the caches must be 8-byte aligned");
  run_skinny(p, w, scales, x, nullptr, rope, stream, nullptr, norm_in);
}

}  // namespace atomflow::kernels

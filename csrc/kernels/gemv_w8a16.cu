// W8A16 GEMV for M = 1 decode: y[n] = sum_k x[k] * fp8[n, k] * scale[n, k / 128], fp32 accumulation,
// with a Store / AddResidual / SwiGLU epilogue and, optionally, RMSNorm fused into the prologue.
// The hot kernel: ~95% of the bytes of a decode step.
//
// Why it is shaped this way: at M = 1 a GEMV is a pure stream of weights, so what matters is
// that HBM never idles, also between kernels. Weights never depend on an earlier kernel, so
//  - the weights travel by the bulk-copy engine (cp.async.bulk, completion on an mbarrier) into a
//    ring of kStages shared-memory tiles: bytes in flight cost no registers, and
//  - the first kStages tiles are requested BEFORE the kernel waits for its predecessor (PDL,
//    pdl.cuh). One block per SM with a small footprint leaves room for the next kernel's block,
//    which PDL starts early, so the next matrix is already streaming while this one finishes.
// The scales travel the same way: with a row group's first tile, its 16 rows x K/128 scales go
// into a scale slot (a dependent scale miss inside the loop cost a DRAM round trip per tile).
// A tile is 16 rows x KC bytes (KC <= 1024, KC | K): warp w owns tile rows 2w and 2w + 1 (SwiGLU:
// gate row i and up row F + i, so the epilogue has both); lane l owns 16-byte chunks l, l + 32.
// x lives in shared memory as bf16 (fused RMSNorm: computed there from the fp32 residual
// stream, rounded like the rmsnorm kernel), read once per chunk for both rows.
// Per weight byte: ~3 instructions (packed e4m3x2 -> f16x2 cvt, f16 -> f32, FMA).
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "atomflow/kernels.h"
#include "atomflow/pdl.cuh"

namespace atomflow::kernels {

constexpr int kGemvThreads = 256;   // 8 warps
constexpr int kTileRows = 16;       // 2 rows per warp
constexpr int kMaxKC = 1024;        // bytes of a row per tile
constexpr int kStages = 5;          // tiles in flight per block: 5 x 16 KB
constexpr int kQuantGroup = 128;
constexpr int kTileBytes = kTileRows * kMaxKC;

// ---- bulk copy and mbarrier (PTX, sm_90) ---------------------------------------------------

static __device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

static __device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)));
}

static __device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

static __device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// bytes (multiple of 16, both addresses 16-byte aligned) from global to shared, on the copy engine.
static __device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

// ---- the work ------------------------------------------------------------------------------

// Which weight rows tile row r (0..15) of row group g holds; -1 past the end of the matrix.
template <Epilogue EP>
static __device__ __forceinline__ int tile_row(int g, int r, int N) {
  if constexpr (EP == Epilogue::SwiGLU) {
    const int F = N / 2, i = g * (kTileRows / 2) + (r % 8);
    return i < F ? (r < 8 ? i : F + i) : -1;
  } else {
    const int n = g * kTileRows + r;
    return n < N ? n : -1;
  }
}

// Thread 0: request tile t (row group, K chunk) of this block into stage t % kStages; with a row
// group's first tile, also its scales [16 rows][G] into scale slot (t / n_kc) % kStages (a slot
// is refilled only after the last tile of its group was consumed: kStages tiles are in flight).
template <Epilogue EP>
static __device__ void issue_tile(const uint8_t* w, const float* scales, int N, int K, int KC, int n_kc, int t,
                                  uint8_t* tiles, float* sslots, uint64_t* bars) {
  const int g = blockIdx.x + (t / n_kc) * gridDim.x, k0 = (t % n_kc) * KC;
  const int s = t % kStages, G = K / kQuantGroup;
  uint8_t* dst = tiles + s * kTileBytes;
  uint32_t bytes = 0;
  for (int r = 0; r < kTileRows; ++r) bytes += tile_row<EP>(g, r, N) >= 0 ? KC : 0;
  const bool first = t % n_kc == 0;
  float* sdst = sslots + static_cast<size_t>((t / n_kc) % kStages) * kTileRows * G;
  // Scales of the group: runs of consecutive rows (one run; SwiGLU: gate run and up run).
  const int runs = EP == Epilogue::SwiGLU ? 2 : 1, run_rows = kTileRows / runs;
  int run_n[2] = {0, 0}, run_r0[2] = {0, 0};
  bool bulk_scales = true;
  if (first) {
    for (int j = 0; j < runs; ++j) {
      for (int r = 0; r < run_rows; ++r) run_n[j] += tile_row<EP>(g, j * run_rows + r, N) >= 0;
      run_r0[j] = tile_row<EP>(g, j * run_rows, N);
      // the copy engine needs 16-byte aligned, 16-byte multiple ranges
      bulk_scales &= (static_cast<size_t>(run_r0[j]) * G) % 4 == 0 && (run_n[j] * G) % 4 == 0;
    }
    if (bulk_scales) {
      for (int j = 0; j < runs; ++j) bytes += run_n[j] * G * 4;
    } else {  // odd shapes: plain loads, published by the mbarrier arrive below (release)
      for (int j = 0; j < runs; ++j)
        for (int i = 0; i < run_n[j] * G; ++i) sdst[j * run_rows * G + i] = scales[static_cast<size_t>(run_r0[j]) * G + i];
    }
  }
  mbar_expect_tx(&bars[s], bytes);
  for (int r = 0; r < kTileRows; ++r) {
    const int n = tile_row<EP>(g, r, N);
    if (n >= 0) bulk_g2s(dst + r * KC, w + static_cast<size_t>(n) * K + k0, KC, &bars[s]);
  }
  if (first && bulk_scales)
    for (int j = 0; j < runs; ++j)
      bulk_g2s(sdst + j * run_rows * G, scales + static_cast<size_t>(run_r0[j]) * G, run_n[j] * G * 4, &bars[s]);
}

// 16 bf16 x values (two 16-byte shared loads) dot 16 fp8 weights, for two rows at once.
static __device__ __forceinline__ void dot16x2(uint4 wa, uint4 wb, const uint4* xs2, float& da, float& db) {
  const uint4 xv[2] = {xs2[0], xs2[1]};
  const uint32_t a[4] = {wa.x, wa.y, wa.z, wa.w}, b[4] = {wb.x, wb.y, wb.z, wb.w};
  const uint32_t xw[8] = {xv[0].x, xv[0].y, xv[0].z, xv[0].w, xv[1].x, xv[1].y, xv[1].z, xv[1].w};
  float sa = 0.f, sb = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // bf16 -> fp32 is a shift; weights: e4m3 pairs -> f16x2 (exact) -> f32.
    const float x0 = __uint_as_float(xw[2 * i] << 16), x1 = __uint_as_float(xw[2 * i] & 0xFFFF0000u);
    const float x2 = __uint_as_float(xw[2 * i + 1] << 16), x3 = __uint_as_float(xw[2 * i + 1] & 0xFFFF0000u);
    const float2 a01 = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(a[i] & 0xFFFFu, __NV_E4M3)));
    const float2 a23 = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(a[i] >> 16, __NV_E4M3)));
    const float2 b01 = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(b[i] & 0xFFFFu, __NV_E4M3)));
    const float2 b23 = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(b[i] >> 16, __NV_E4M3)));
    sa = fmaf(a01.x, x0, sa);
    sa = fmaf(a01.y, x1, sa);
    sa = fmaf(a23.x, x2, sa);
    sa = fmaf(a23.y, x3, sa);
    sb = fmaf(b01.x, x0, sb);
    sb = fmaf(b01.y, x1, sb);
    sb = fmaf(b23.x, x2, sb);
    sb = fmaf(b23.y, x3, sb);
  }
  da = sa;
  db = sb;
}

static __device__ __forceinline__ int lane_of(int tid) { return tid % 32; }

// Stage x into shared memory as bf16: a copy of bf16 x, or RMSNorm of the fp32 residual stream
// (x * rsqrt(mean(x^2) + eps) * norm_w, rounded to bf16 exactly as the rmsnorm kernel does).
template <bool NORM>
static __device__ void stage_x(const void* x, const bf16* __restrict__ norm_w, float eps, int K, bf16* xs,
                               float* red) {
  if constexpr (NORM) {
    const float* xf = static_cast<const float*>(x);
    float ss = 0.f;
    for (int i = threadIdx.x; i < K; i += kGemvThreads) ss = fmaf(xf[i], xf[i], ss);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
    __syncthreads();
    // The same tree as rmsnorm.cu (256 threads there too), so the two paths agree to the bit.
    float total = lane_of(threadIdx.x) < kGemvThreads / 32 ? red[lane_of(threadIdx.x)] : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off /= 2) total += __shfl_xor_sync(0xffffffffu, total, off);
    const float r = rsqrtf(total / static_cast<float>(K) + eps);
    for (int i = threadIdx.x; i < K; i += kGemvThreads) xs[i] = __float2bfloat16(xf[i] * r * __bfloat162float(norm_w[i]));
  } else {
    const uint4* src = static_cast<const uint4*>(x);
    uint4* dst = reinterpret_cast<uint4*>(xs);
    for (int i = threadIdx.x; i < K / 8; i += kGemvThreads) dst[i] = __ldcg(src + i);  // coherent: pdl.cuh
  }
}

template <Epilogue EP, bool NORM>
static __global__ void __launch_bounds__(kGemvThreads, 2)
    gemv_w8a16_kernel(const uint8_t* __restrict__ w, const float* __restrict__ scales, const void* x,
                      const bf16* __restrict__ norm_w, float eps, int N, int K, int KC, void* out) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int G = K / kQuantGroup;
  uint8_t* tiles = smem;                                                     // kStages x 16 x KC
  bf16* xs = reinterpret_cast<bf16*>(smem + kStages * kTileBytes);           // K
  float* sslots = reinterpret_cast<float*>(xs + K);                          // kStages x 16 x G
  __shared__ __align__(8) uint64_t bars[kStages];
  __shared__ float red[kGemvThreads / 32];

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int n_groups = EP == Epilogue::SwiGLU ? CEIL_DIV(N / 2, kTileRows / 2) : CEIL_DIV(N, kTileRows);
  const int my_groups = blockIdx.x < n_groups ? CEIL_DIV(n_groups - static_cast<int>(blockIdx.x), gridDim.x) : 0;
  const int n_kc = K / KC;
  const int n_tiles = my_groups * n_kc;

  // Weights first: they depend on nothing, so they stream while the previous kernel finishes.
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&bars[s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int t = 0; t < min(kStages, n_tiles); ++t) issue_tile<EP>(w, scales, N, K, KC, n_kc, t, tiles, sslots, bars);
  }
  pdl_launch_dependents();
  pdl_wait();  // x (and, for AddResidual, out) come from earlier kernels
  stage_x<NORM>(x, norm_w, eps, K, xs, red);
  __syncthreads();  // x staged; the barriers' init is visible to every thread

  float acc0 = 0.f, acc1 = 0.f;
  const int chunks = KC / 16;
  for (int t = 0; t < n_tiles; ++t) {
    const int s = t % kStages, g = blockIdx.x + (t / n_kc) * gridDim.x, kc = t % n_kc, k0 = kc * KC;
    mbar_wait(&bars[s], (t / kStages) & 1);
    const uint8_t* tile = tiles + s * kTileBytes;
    const float* ts = sslots + static_cast<size_t>((t / n_kc) % kStages) * kTileRows * G;  // [16][G]
    const int ra = tile_row<EP>(g, EP == Epilogue::SwiGLU ? warp : 2 * warp, N);
    const int rb = tile_row<EP>(g, EP == Epilogue::SwiGLU ? warp + 8 : 2 * warp + 1, N);
    const uint8_t* wa = tile + (EP == Epilogue::SwiGLU ? warp : 2 * warp) * KC;
    const uint8_t* wb = tile + (EP == Epilogue::SwiGLU ? warp + 8 : 2 * warp + 1) * KC;
    if (ra >= 0) {
      for (int c = lane; c < chunks; c += 32) {
        const int k = k0 + 16 * c;
        // a missing second row (odd N) reads row a's bytes and is never stored
        const uint4 va = *reinterpret_cast<const uint4*>(wa + 16 * c);
        const uint4 vb = rb >= 0 ? *reinterpret_cast<const uint4*>(wb + 16 * c) : va;
        float da, db;
        dot16x2(va, vb, reinterpret_cast<const uint4*>(xs + k), da, db);
        const int ia = EP == Epilogue::SwiGLU ? warp : 2 * warp, ib = EP == Epilogue::SwiGLU ? warp + 8 : 2 * warp + 1;
        acc0 = fmaf(da, ts[ia * G + k / kQuantGroup], acc0);
        if (rb >= 0) acc1 = fmaf(db, ts[ib * G + k / kQuantGroup], acc1);
      }
    }
    if (kc == n_kc - 1) {  // the row group is complete: reduce over the warp and write
#pragma unroll
      for (int off = 16; off > 0; off /= 2) {
        acc0 += __shfl_xor_sync(0xffffffffu, acc0, off);
        acc1 += __shfl_xor_sync(0xffffffffu, acc1, off);
      }
      if (lane == 0 && ra >= 0) {
        if constexpr (EP == Epilogue::SwiGLU) {
          const float silu = acc0 / (1.f + expf(-acc0));
          static_cast<bf16*>(out)[ra] = __float2bfloat16(silu * acc1);
        } else if constexpr (EP == Epilogue::Store) {
          static_cast<float*>(out)[ra] = acc0;
          if (rb >= 0) static_cast<float*>(out)[rb] = acc1;
        } else {
          static_cast<float*>(out)[ra] += acc0;
          if (rb >= 0) static_cast<float*>(out)[rb] += acc1;
        }
      }
      acc0 = acc1 = 0.f;
    }
    __syncthreads();  // every warp is done with stage s: it may be refilled
    if (threadIdx.x == 0 && t + kStages < n_tiles) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic reads before async writes
      issue_tile<EP>(w, scales, N, K, KC, n_kc, t + kStages, tiles, sslots, bars);
    }
  }
}

// ---- launcher ----

template <Epilogue EP, bool NORM>
static void launch_gemv(const uint8_t* w, const float* scales, const void* x, const bf16* norm_w, float eps, int N,
                        int K, void* out, cudaStream_t stream) {
  int KC = kMaxKC;
  while (K % KC) KC /= 2;  // K % 128 == 0, so this stops at 128 at the latest
  const size_t smem = static_cast<size_t>(kStages) * kTileBytes + static_cast<size_t>(K) * sizeof(bf16) +
                      static_cast<size_t>(kStages) * kTileRows * (K / kQuantGroup) * sizeof(float);
  static size_t configured = 48 << 10;  // raise the dynamic limit only when needed (host-side, capture-safe)
  if (smem > configured) {
    AF_CUDA_CHECK(cudaFuncSetAttribute(gemv_w8a16_kernel<EP, NORM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
    configured = smem;
  }
  int device = 0, sms = 0;
  AF_CUDA_CHECK(cudaGetDevice(&device));
  AF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int n_groups = EP == Epilogue::SwiGLU ? CEIL_DIV(N / 2, kTileRows / 2) : CEIL_DIV(N, kTileRows);
  // One block per SM: its ring keeps 80 KB in flight, and the SM keeps room for the next kernel.
  const int blocks = min(n_groups, sms);
  af_launch(gemv_w8a16_kernel<EP, NORM>, dim3(blocks), dim3(kGemvThreads), smem, stream, w, scales, x, norm_w, eps,
            N, K, KC, out);
}

template <bool NORM>
static void dispatch_gemv(const uint8_t* w, const float* scales, const void* x, const bf16* norm_w, float eps, int N,
                          int K, Epilogue ep, void* out, cudaStream_t stream) {
  AF_CHECK(N >= 1 && K >= kQuantGroup, "gemv_w8a16: N must be >= 1 and K >= 128");
  AF_CHECK(K % kQuantGroup == 0, "gemv_w8a16: K must be a multiple of 128 (the scale group)");
  AF_CHECK(K <= 32768, "gemv_w8a16: K > 32768 is not supported (x is staged in shared memory)");
  AF_CHECK(reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0,
           "gemv_w8a16: w and x must be 16-byte aligned");
  switch (ep) {
    case Epilogue::Store: launch_gemv<Epilogue::Store, NORM>(w, scales, x, norm_w, eps, N, K, out, stream); break;
    case Epilogue::AddResidual:
      launch_gemv<Epilogue::AddResidual, NORM>(w, scales, x, norm_w, eps, N, K, out, stream);
      break;
    case Epilogue::SwiGLU:
      AF_CHECK(N % 2 == 0, "gemv_w8a16: SwiGLU needs N = 2F (gate rows, then up rows)");
      launch_gemv<Epilogue::SwiGLU, NORM>(w, scales, x, norm_w, eps, N, K, out, stream);
      break;
    default: AF_CHECK(false, "gemv_w8a16: unknown epilogue");
  }
}

void gemv_w8a16(const uint8_t* w, const float* scales, const bf16* x, int N, int K, Epilogue ep, void* out,
                cudaStream_t stream) {
  dispatch_gemv<false>(w, scales, x, nullptr, 0.f, N, K, ep, out, stream);
}

void gemv_w8a16_rmsnorm(const uint8_t* w, const float* scales, const float* x, const bf16* norm_w, float eps, int N,
                        int K, Epilogue ep, void* out, cudaStream_t stream) {
  AF_CHECK(norm_w != nullptr, "gemv_w8a16_rmsnorm: needs the norm weight");
  dispatch_gemv<true>(w, scales, x, norm_w, eps, N, K, ep, out, stream);
}

}  // namespace atomflow::kernels

// W8A16 GEMM for M > 1 (prefill) on tensor cores: y[m, n] = sum_k x[m, k] * fp8[n, k] * scale[n, k / 128],
// mma.sync m16n8k16 (bf16 or fp16, the activation's type) with fp32 accumulation, same three
// epilogues as the GEMV.
//
//  - Block tile 128 (M) x 64 (N) x 128 (K = one scale group), 4 warps of 64 x 32, 2-stage cp.async
//    pipeline (x tile 16-bit, weight tile fp8, both kept in their stored precision in shared memory).
//  - The weight fragments are converted fp8 -> the activation's 16-bit type in registers (exact). Each k-tile is one
//  scale
//    group, so its mma results go to a zeroed fp32 partial that is added to the accumulator times
//    the per-column scale: products and sums stay fp32, as in the GEMV (no bf16 rounding of w * s).
//  - K is permuted inside each 32-wide k-step so that every lane reads contiguous bytes: for mma j
//    (0, 1) of the step, lane (g = lane / 4, c = lane % 4) holds physical k = 8c + 4j + {0, 1, 2, 3}
//    in the slots of logical k = {2c, 2c+1, 2c+8, 2c+9}. A and B use the same permutation, so the
//    dot products are unchanged; the lane then needs 16 B of x (LDS.128) and 8 B of w (LDS.64).
//  - SwiGLU: a block's 64 columns are 32 gate rows and the 32 matching up rows, arranged so that the
//    same lane holds gate (n-tiles 0, 1) and up (n-tiles 2, 3) of the same outputs.
//
//  - K % 128 == 64 (TAIL): the last k-tile is the row's 64-column tail group. Its columns past K are
//    zero-filled by the copies (x and w alike, so no stale shared memory enters a product) and the
//    tile runs as a full one; the instances for K % 128 == 0 compile without that check.
//
// Contract of gemm_w8a16_kernel<EP, A, TAIL>, grid (ceil(M / 128), N tiles of 64 columns) x 128 threads:
//  Inputs   w fp8 e4m3 [N, K] row-major, scales fp32 [N, ceil(K / 128)], x 16-bit [M, K] of type A;
//           K % 128 == 0, or with TAIL K % 128 == 64.
//  Before its PDL wait nothing: pdl_prologue() lets the next kernel launch, then waits.
//  Writes   Store: out fp32 [M, N]; AddResidual: out += y; SwiGLU: out 16-bit [M, N / 2]. Each element once.
//  Leaves   nothing else; no scratch.
#include "atomflow/kernels.h"
#include "atomflow/pdl.cuh"
#include "mma_w8a16.cuh"

namespace atomflow::kernels {

constexpr int kGemmThreads = 128;  // 4 warps: 2 along M x 2 along N
constexpr int kBM = 128, kBN = 64, kBK = 128;
constexpr int kWarpM = 64, kWarpN = 32;
constexpr int kMT = kWarpM / 16;  // m16 tiles per warp
constexpr int kNT = kWarpN / 8;   // n8 tiles per warp
// Row strides in shared memory (bytes), padded so the fragment loads are free of bank conflicts:
// A rows 64 B apart mod 128 (LDS.128 quarter-warp: 2 rows x 64 B), B rows 32 B apart (LDS.64
// half-warp: 4 rows x 32 B).
constexpr int kAStride = kBK * 2 + 64;
constexpr int kBStride = kBK + 32;
constexpr int kABytes = kBM * kAStride;
constexpr int kBBytes = kBN * kBStride;
constexpr int kStageBytes = kABytes + kBBytes;
constexpr int kStages = 2;
constexpr int kGemmSmem = kStages * kStageBytes;  // 100 KB: two blocks per SM

// Block-local column j (0..63) -> weight row, or -1 past the end. SwiGLU: j = 32 wn + 16 t + q is
// gate (t = 0) or up (t = 1) of output i = i0 + 16 wn + q.
template <Epilogue EP>
static __device__ __forceinline__ int weight_row(int j, int n_tile, int N) {
  if constexpr (EP == Epilogue::SwiGLU) {
    const int F = N / 2;
    const int i = n_tile * (kBN / 2) + (j / 32) * 16 + j % 16;
    if (i >= F) return -1;
    return (j / 16) % 2 ? F + i : i;
  } else {
    const int n = n_tile * kBN + j;
    return n < N ? n : -1;
  }
}

template <Epilogue EP, Act A, bool TAIL>
static __global__ void __launch_bounds__(kGemmThreads, 2)
    gemm_w8a16_kernel(const uint8_t* __restrict__ w, const float* __restrict__ scales, const uint16_t* x, int M, int N,
                      int K, void* __restrict__ out) {
  extern __shared__ __align__(16) uint8_t smem[];
  pdl_prologue();
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / 2, wn = warp % 2;
  const int g = lane / 4, c = lane % 4;
  // blockIdx.x walks M so the blocks sharing a weight tile run together (weights leave DRAM once).
  const int m0 = blockIdx.x * kBM;
  const int n_tile = blockIdx.y;
  const int KT = TAIL ? CEIL_DIV(K, kBK) : K / kBK;
  const int G = TAIL ? CEIL_DIV(K, kBK) : K / kBK;  // scale groups per row (kBK is the group size)

  // Loader assignment: A = 128 rows x 16 chunks, 16 per thread (fixed chunk column, 16 rows);
  // B = 64 rows x 8 chunks, 4 per thread.
  const int a_col = tid % 16, a_row0 = tid / 16;
  const int b_col = tid % 8, b_row0 = tid / 8;
  int b_wrow[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) b_wrow[i] = weight_row<EP>(b_row0 + 16 * i, n_tile, N);

  auto load_tile = [&](int kt, int stage) {
    uint8_t* sA = smem + stage * kStageBytes;
    uint8_t* sB = sA + kABytes;
    // TAIL: this thread's chunk column past the row's end (only in the last tile) is zero-filled.
    const bool a_in = !TAIL || kt * kBK + a_col * 8 < K;
    const bool b_in = !TAIL || kt * kBK + b_col * 16 < K;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int r = a_row0 + 8 * i;
      const bool ok = m0 + r < M;
      const uint16_t* src = x + static_cast<size_t>(ok ? m0 + r : 0) * K + kt * kBK + a_col * 8;
      cp_async16_zfill(sA + r * kAStride + a_col * 16, a_in ? src : x, ok && a_in);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = b_row0 + 16 * i;
      const bool ok = b_wrow[i] >= 0;
      const uint8_t* src = w + static_cast<size_t>(ok ? b_wrow[i] : 0) * K + kt * kBK + b_col * 16;
      cp_async16_zfill(sB + r * kBStride + b_col * 16, b_in ? src : w, ok && b_in);
    }
    asm volatile("cp.async.commit_group;");
  };

  // This lane's accumulator columns: n-tile nt, e = 0/1 -> block column wn*32 + nt*8 + 2c + e.
  int col_row[kNT][2];
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) col_row[nt][e] = weight_row<EP>(wn * kWarpN + nt * 8 + 2 * c + e, n_tile, N);

  float acc[kMT][kNT][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;

  load_tile(0, 0);
  for (int kt = 0; kt < KT; ++kt) {
    if (kt + 1 < KT)
      load_tile(kt + 1, (kt + 1) % kStages);
    else
      asm volatile("cp.async.commit_group;");  // empty group: keeps "wait for all but one" exact
    // Scales of this k-tile for this lane's 8 columns; in flight while the tile lands and the mma run.
    float sc[kNT][2];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        sc[nt][e] = col_row[nt][e] >= 0 ? __ldg(scales + static_cast<size_t>(col_row[nt][e]) * G + kt) : 0.f;
    asm volatile("cp.async.wait_group 1;" ::: "memory");
    __syncthreads();

    const uint8_t* sA = smem + (kt % kStages) * kStageBytes;
    const uint8_t* sB = sA + kABytes;
    float part[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) part[mt][nt][e] = 0.f;

#pragma unroll
    for (int ks = 0; ks < kBK / 32; ++ks) {
      // A: rows g and g + 8 of each m-tile, physical k [8c, 8c + 8) of the step (16 B each).
      uint4 a_lo[kMT], a_hi[kMT];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const int r = wm * kWarpM + mt * 16 + g;
        a_lo[mt] = *reinterpret_cast<const uint4*>(sA + r * kAStride + ks * 64 + c * 16);
        a_hi[mt] = *reinterpret_cast<const uint4*>(sA + (r + 8) * kAStride + ks * 64 + c * 16);
      }
      // B: column g of each n-tile, physical k [8c, 8c + 8) of the step (8 fp8 bytes).
      uint2 b8[kNT];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
        b8[nt] = *reinterpret_cast<const uint2*>(sB + (wn * kWarpN + nt * 8 + g) * kBStride + ks * 32 + c * 8);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t b[kNT][2];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const uint32_t four = j ? b8[nt].y : b8[nt].x;  // physical k 8c + 4j + 0..3
          b[nt][0] = fp8x2_to_16x2<A>(four & 0xFFFFu);
          b[nt][1] = fp8x2_to_16x2<A>(four >> 16);
        }
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const uint32_t a0 = j ? a_lo[mt].z : a_lo[mt].x;  // row g,     physical k 8c + 4j + 0, 1
          const uint32_t a2 = j ? a_lo[mt].w : a_lo[mt].y;  // row g,     physical k 8c + 4j + 2, 3
          const uint32_t a1 = j ? a_hi[mt].z : a_hi[mt].x;  // row g + 8
          const uint32_t a3 = j ? a_hi[mt].w : a_hi[mt].y;
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) mma16<A>(part[mt][nt], a0, a1, a2, a3, b[nt][0], b[nt][1]);
        }
      }
    }
    // One scale group done: acc += partial * scale[column].
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        acc[mt][nt][0] = fmaf(part[mt][nt][0], sc[nt][0], acc[mt][nt][0]);
        acc[mt][nt][1] = fmaf(part[mt][nt][1], sc[nt][1], acc[mt][nt][1]);
        acc[mt][nt][2] = fmaf(part[mt][nt][2], sc[nt][0], acc[mt][nt][2]);
        acc[mt][nt][3] = fmaf(part[mt][nt][3], sc[nt][1], acc[mt][nt][3]);
      }
    __syncthreads();  // the stage just read is the next iteration's load target
  }

  // Epilogue: d[0], d[1] = (row g, columns 2c, 2c + 1); d[2], d[3] = (row g + 8, same columns).
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + wm * kWarpM + mt * 16 + g + 8 * h;
      if (m >= M) continue;
      if constexpr (EP == Epilogue::SwiGLU) {
        const int F = N / 2;
        bf16* o = static_cast<bf16*>(out) + static_cast<size_t>(m) * F;
#pragma unroll
        for (int nt = 0; nt < kNT / 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = col_row[nt][e];  // gate row index == output index
            if (i < 0) continue;
            const float gate = acc[mt][nt][2 * h + e], up = acc[mt][nt + kNT / 2][2 * h + e];
            o[i] = __float2bfloat16(gate / (1.f + expf(-gate)) * up);
          }
      } else {
        float* o = static_cast<float*>(out) + static_cast<size_t>(m) * N;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int n = col_row[nt][e];
            if (n < 0) continue;
            if constexpr (EP == Epilogue::Store)
              o[n] = acc[mt][nt][2 * h + e];
            else
              o[n] += acc[mt][nt][2 * h + e];
          }
      }
    }
}

// ---- launcher ----

template <Epilogue EP, Act A, bool TAIL>
static void launch_gemm(const uint8_t* w, const float* scales, const void* x, int M, int N, int K, void* out,
                        cudaStream_t stream) {
  // 100 KB of dynamic shared memory: set once (not inside a graph capture).
  static const bool configured = [] {
    AF_CUDA_CHECK(
        cudaFuncSetAttribute(gemm_w8a16_kernel<EP, A, TAIL>, cudaFuncAttributeMaxDynamicSharedMemorySize, kGemmSmem));
    return true;
  }();
  (void)configured;
  const int n_tiles = EP == Epilogue::SwiGLU ? CEIL_DIV(N / 2, kBN / 2) : CEIL_DIV(N, kBN);
  AF_CHECK(n_tiles <= 65535, "gemm_w8a16: N too large for the grid");
  const dim3 grid(CEIL_DIV(M, kBM), n_tiles);
  af_launch(gemm_w8a16_kernel<EP, A, TAIL>, grid, dim3(kGemmThreads), kGemmSmem, stream, w, scales,
            static_cast<const uint16_t*>(x), M, N, K, out);
}

template <Act A, bool TAIL>
static void dispatch_gemm(const uint8_t* w, const float* scales, const void* x, int M, int N, int K, Epilogue ep,
                          void* out, cudaStream_t stream) {
  switch (ep) {
    case Epilogue::Store: launch_gemm<Epilogue::Store, A, TAIL>(w, scales, x, M, N, K, out, stream); break;
    case Epilogue::AddResidual: launch_gemm<Epilogue::AddResidual, A, TAIL>(w, scales, x, M, N, K, out, stream); break;
    case Epilogue::SwiGLU:
      AF_CHECK(N % 2 == 0, "gemm_w8a16: SwiGLU needs N = 2F (gate rows, then up rows)");
      launch_gemm<Epilogue::SwiGLU, A, TAIL>(w, scales, x, M, N, K, out, stream);
      break;
    default: AF_CHECK(false, "gemm_w8a16: unknown epilogue");
  }
}

void gemm_w8a16(const uint8_t* w, const float* scales, const void* x, Act x_type, int M, int N, int K, Epilogue ep,
                void* out, cudaStream_t stream) {
  AF_CHECK(M >= 1 && N >= 1 && K >= kBK / 2, "gemm_w8a16: M, N must be >= 1 and K >= 64");
  AF_CHECK(K % (kBK / 2) == 0, "gemm_w8a16: K must be a multiple of 64 (scales [N, ceil(K / 128)])");
  AF_CHECK(reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0,
           "gemm_w8a16: w and x must be 16-byte aligned");
  // K % 128 == 64: the instances whose last k-tile is a 64-column tail group.
  const bool tail = K % kBK != 0;
  if (x_type == Act::F16)
    tail ? dispatch_gemm<Act::F16, true>(w, scales, x, M, N, K, ep, out, stream)
         : dispatch_gemm<Act::F16, false>(w, scales, x, M, N, K, ep, out, stream);
  else
    tail ? dispatch_gemm<Act::BF16, true>(w, scales, x, M, N, K, ep, out, stream)
         : dispatch_gemm<Act::BF16, false>(w, scales, x, M, N, K, ep, out, stream);
}

}  // namespace atomflow::kernels

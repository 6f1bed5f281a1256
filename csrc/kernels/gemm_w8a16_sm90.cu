// W8A16 GEMM for prefill chunks on Hopper (sm_90a): y[m, n] = sum_k x[m, k] * fp8[n, k] * scale[n, k / 128],
// CUTLASS 3.x's mixed-input warp-specialized GEMM (TMA loads, wgmma, fp32 accumulation), the epilogues of
// gemm_w8a16 (kernels.h).
//
//  - The narrow operand (the FP8 weight) must be wgmma's A operand, read from registers, where it is
//    converted; so the product runs transposed (CUTLASS example 55): D'[n, m] = sum_k W[n, k] X^T[k, m],
//    W [N, K] K-major as A, X [M, K] K-major as B, D' column-major [N, M], which is y [M, N] row-major.
//  - Each weight becomes the activation's 16-bit type as A = type(float(fp8) * scale) with an fp32 scale:
//    one rounding of the exact dequantized weight (relative error <= 2^-9 for bf16, 2^-11 for fp16; fp16
//    products below 2^-14 are subnormal, an absolute error <= 2^-25). gemm_w8a16 applies the scale to fp32
//    partial sums instead (no rounding of w * s); tests/test_gemm_sm90_gpu.py states the difference.
//  - Tile 128 (weight rows) x 256, 128 or 64 (tokens) x 64 (k; 128 with 64 tokens); cluster 1x1,
//    cooperative schedule (two consumer warpgroups, one TMA producer warp), persistent blocks with the
//    data-parallel or the stream-K tile scheduler (deterministic reduction of split tiles in the
//    workspace); TMA epilogue. Which of the five kinds runs: kernels.h's sm90_tile_for(M, N, SMs).
//  - Rows of x past M and weight rows past N are TMA's out-of-bounds zeros; their outputs are not stored.
//    The scale group of k is k / 128 for every k (CUTLASS's group index of a 64- or 128-wide k-tile), so
//    a 64-column tail group (K % 128 == 64) needs nothing special.
//
// Contract of gemm_w8a16_sm90 (launcher at the end):
//  Inputs   w fp8 e4m3 [N, K] row-major, scales fp32 [N, ceil(K / 128)], x 16-bit [M, K] row-major of
//           type x_type; K % 64 == 0, N % 8 == 0 (TMA strides), pointers 16-byte aligned.
//  Launches 1. scale_transpose: scales -> workspace [ceil(K / 128), N] fp32 (CUTLASS's scales are N-major),
//              unless the caller passes them transposed already (scales_gn; the engine's, made at load);
//           2. the CUTLASS GEMM: Store: out fp32 [M, N] = y; AddResidual: out += y (C is out, beta = 1);
//              SwiGLU (N = 2F): y fp32 [M, N] into the workspace, then
//           3. swiglu_rows: out bf16 [M, F] = silu(y[:, :F]) * y[:, F:].
//           Plain stream-ordered launches (no PDL): each waits for everything before it.
//  Workspace gemm_w8a16_sm90_workspace_bytes(ep, M, N, K, tile) bytes of device memory, 256-byte aligned,
//           used by one stream at a time, no initial value needed, nothing left in it for later calls.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "atomflow/kernels.h"
#include "gemm_sm90_common.cuh"

#if ATOMFLOW_SM90_GEMM
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#endif

namespace atomflow::kernels {

namespace {

using sm90::align_up;
using sm90::kScaleGroup;
using sm90::kWsAlign;

// ---------------------------------------------------------------------------------------
// kernels

// out [G, N] = in [N, G] (fp32), through a 32 x 33 shared tile so reads and writes are both coalesced.
__global__ void scale_transpose(const float* __restrict__ in, int N, int G, float* __restrict__ out) {
  __shared__ float tile[32][33];
  const int n0 = blockIdx.x * 32, g0 = blockIdx.y * 32;
  for (int r = threadIdx.y; r < 32; r += blockDim.y) {
    const int n = n0 + r, g = g0 + threadIdx.x;
    if (n < N && g < G) tile[r][threadIdx.x] = in[static_cast<size_t>(n) * G + g];
  }
  __syncthreads();
  for (int r = threadIdx.y; r < 32; r += blockDim.y) {
    const int g = g0 + r, n = n0 + threadIdx.x;
    if (n < N && g < G) out[static_cast<size_t>(g) * N + n] = tile[threadIdx.x][r];
  }
}

// out bf16 [M, F] = silu(y[:, :F]) * y[:, F:], y fp32 [M, 2F]; gemm_w8a16's formula and rounding. Grid
// (ceil(F / 4 / 256), M): each thread 4 consecutive columns of one row (16-byte loads; F % 8 == 0).
constexpr int kSwigluThreads = 256;
__global__ void swiglu_rows(const float* __restrict__ y, int F, bf16* __restrict__ out) {
  const int f = 4 * (blockIdx.x * kSwigluThreads + threadIdx.x);
  if (f >= F) return;
  const size_t m = blockIdx.y;
  const float4 g = *reinterpret_cast<const float4*>(y + m * 2 * F + f);
  const float4 u = *reinterpret_cast<const float4*>(y + m * 2 * F + F + f);
  const auto act = [](float gate, float up) { return gate / (1.f + expf(-gate)) * up; };
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out + m * F + f);
  o[0] = __floats2bfloat162_rn(act(g.x, u.x), act(g.y, u.y));
  o[1] = __floats2bfloat162_rn(act(g.z, u.z), act(g.w, u.w));
}

#if ATOMFLOW_SM90_GEMM
using namespace cute;

// The CUTLASS kernels, one per activation type. Names follow the transposed product: A = the weight
// (N rows), B = x (M columns), D' = y^T. Declared at namespace scope with concrete types (inside a
// class template the host compiler rejects the builders' dependent names).
using ElementW = cutlass::float_e4m3_t;
using ElementScale = float;                    // fp32: the weight is rounded once, after the scale (see the top)
using LayoutW = cutlass::layout::RowMajor;     // A [N, K], K-major
using LayoutX = cutlass::layout::ColumnMajor;  // B [K, M] column-major = x [M, K] row-major
using LayoutD = cutlass::layout::ColumnMajor;  // D' [N, M] column-major = y [M, N] row-major
constexpr int kAlignW = 16, kAlignX = 8, kAlignD = 4;  // elements of 16 bytes
using ClusterShape = Shape<_1, _1, _1>;                // 2 x 1 clusters (x tiles multicast) measured no faster
// Three tile widths along the tokens: xwide (256: each weight converted serves twice the tokens of a wide
// tile; ~10% less time per FLOP when the waves of tiles are full), wide (128), and narrow (64) for short
// chunks, where a 128-token tile would run half its MMAs or more on rows past M (kernels.h: sm90_tile_for
// picks one by M and N). The narrow tile takes 128 columns of k a stage (one scale group; 64 measured 3-7%
// slower at 64 rows), the others 64 (128 measured even on wide; xwide's stages would not fit).
using TileXWide = Shape<_128, _256, _64>;
using TileWide = Shape<_128, _128, _64>;
using TileNarrow = Shape<_128, _64, _128>;

template <class Tile>
using EpilogueOp = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, LayoutD, kAlignD, float, LayoutD, kAlignD,
    cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

template <class T, class Tile>
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cute::tuple<ElementW, ElementScale>, LayoutW, kAlignW, T,
    LayoutX, kAlignX, float, Tile, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename EpilogueOp<Tile>::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

// Scheduler: PersistentScheduler (data-parallel: one block per tile at a time), or StreamKScheduler: the
// k-loops of all tiles spread over the SMs, so a product with fewer tiles than SMs (o and down of a
// short chunk: N / 128 tiles) still runs on every SM; split tiles are reduced in the workspace in a fixed
// order (deterministic), then one block runs the epilogue.
template <class T, class Tile, class Scheduler>
using Kernel =
    cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop<T, Tile>, EpilogueOp<Tile>, Scheduler>;

// Argument packing and launch of one of them (T: the activation's CUTLASS type).
template <class T, class Tile, class Scheduler>
struct Sm90Gemm {
  using K_ = Kernel<T, Tile, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<K_>;

  static typename Gemm::Arguments arguments(const uint8_t* w, const float* scales_gn, const void* x, int M, int N,
                                            int K, float beta, const float* c, float* d) {
    using StrideW = typename K_::StrideA;
    using StrideX = typename K_::StrideB;
    using StrideC = typename K_::StrideC;
    using StrideD = typename K_::StrideD;
    using StrideS = typename K_::CollectiveMainloop::StrideScale;
    const int G = CEIL_DIV(K, kScaleGroup);
    const StrideW sw = cutlass::make_cute_packed_stride(StrideW{}, make_shape(N, K, 1));
    const StrideX sx = cutlass::make_cute_packed_stride(StrideX{}, make_shape(M, K, 1));
    const StrideC sc = cutlass::make_cute_packed_stride(StrideC{}, make_shape(N, M, 1));
    const StrideD sd = cutlass::make_cute_packed_stride(StrideD{}, make_shape(N, M, 1));
    const StrideS ss = cutlass::make_cute_packed_stride(StrideS{}, make_shape(N, G, 1));
    cutlass::KernelHardwareInfo hw{};
    hw.sm_count = current_sm_count();
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {N, M, K, 1},
        {reinterpret_cast<const ElementW*>(w), sw, static_cast<const T*>(x), sx, scales_gn, ss, kScaleGroup},
        {{1.f, beta}, c, sc, d, sd},
        hw};
    return args;
  }

  static size_t workspace_bytes(int M, int N, int K) {
    return Gemm::get_workspace_size(arguments(nullptr, nullptr, nullptr, M, N, K, 0.f, nullptr, nullptr));
  }

  // y = x w^T (beta 0) or out += x w^T (beta 1, c = d = out).
  static void run(const uint8_t* w, const float* scales_gn, const void* x, int M, int N, int K, float beta, float* out,
                  void* workspace, cudaStream_t stream, bool pdl) {
    sm90::run_cutlass<K_, Gemm>(arguments(w, scales_gn, x, M, N, K, beta, out, out), workspace, stream,
                                "gemm_w8a16_sm90", pdl);
  }
};

// The kernel for (activation type, tile): one call site per instance.
template <class T, class Fn>
void dispatch_tile(Sm90Tile tile, Fn&& fn) {
  using P = cutlass::gemm::PersistentScheduler;
  using S = cutlass::gemm::StreamKScheduler;
  switch (tile) {
    case Sm90Tile::Wide: return fn(Sm90Gemm<T, TileWide, P>{});
    case Sm90Tile::Narrow: return fn(Sm90Gemm<T, TileNarrow, P>{});
    case Sm90Tile::WideStreamK: return fn(Sm90Gemm<T, TileWide, S>{});
    case Sm90Tile::XWide: return fn(Sm90Gemm<T, TileXWide, P>{});
    default: return fn(Sm90Gemm<T, TileNarrow, S>{});
  }
}
template <class Fn>
void dispatch(Act x_type, Sm90Tile tile, Fn&& fn) {
  if (x_type == Act::F16)
    dispatch_tile<cutlass::half_t>(tile, fn);
  else
    dispatch_tile<cutlass::bfloat16_t>(tile, fn);
}

size_t cutlass_workspace_bytes(Act x_type, Sm90Tile tile, int M, int N, int K) {
  size_t bytes = 0;
  dispatch(x_type, tile, [&](auto g) { bytes = decltype(g)::workspace_bytes(M, N, K); });
  return bytes;
}
#else
size_t cutlass_workspace_bytes(Act, Sm90Tile, int, int, int) { return 0; }
#endif

// Workspace carve-up: [scales G x N fp32][SwiGLU's y M x N fp32][CUTLASS's own workspace].
struct Carve {
  size_t scales, swiglu, cutlass, total;
};
Carve carve(Epilogue ep, Act x_type, Sm90Tile tile, int M, int N, int K) {
  Carve c{};
  c.scales = align_up(sizeof(float) * static_cast<size_t>(CEIL_DIV(K, kScaleGroup)) * N);
  c.swiglu = ep == Epilogue::SwiGLU ? align_up(sizeof(float) * static_cast<size_t>(M) * N) : 0;
  c.cutlass = align_up(cutlass_workspace_bytes(x_type, tile, M, N, K));
  c.total = c.scales + c.swiglu + c.cutlass;
  return c;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// launcher

bool gemm_w8a16_sm90_built() { return ATOMFLOW_SM90_GEMM != 0; }

bool gemm_w8a16_sm90_supported(Epilogue ep, int M, int N, int K) {
  if (!gemm_w8a16_sm90_built()) return false;
  if (ep != Epilogue::Store && ep != Epilogue::AddResidual && ep != Epilogue::SwiGLU) return false;
  return M >= 1 && N >= 8 && N % 8 == 0 && K >= 64 && K % 64 == 0;
}

size_t gemm_w8a16_sm90_workspace_bytes(Epilogue ep, int M, int N, int K, Sm90Tile tile) {
  // The CUTLASS workspace does not depend on the activation type; take the larger to be sure. Auto: any kind
  // sm90_tile_for may pick for M (past the stream-K rows it depends on the GPU's SM count).
  if (tile == Sm90Tile::Auto && M > kSm90StreamKMaxRows)
    return std::max(gemm_w8a16_sm90_workspace_bytes(ep, M, N, K, Sm90Tile::Wide),
                    gemm_w8a16_sm90_workspace_bytes(ep, M, N, K, Sm90Tile::XWide));
  if (tile == Sm90Tile::Auto) tile = sm90_tile_for(M, N, 1);
  return std::max(carve(ep, Act::BF16, tile, M, N, K).total, carve(ep, Act::F16, tile, M, N, K).total);
}

bool gemm_w8a16_sm90_takes_layer(const Sm90Layer& l) {
  const int m = 1;  // the shape checks do not depend on the rows
  return gemm_w8a16_sm90_supported(Epilogue::Store, m, l.qkv_dim, l.d) &&
         gemm_w8a16_sm90_supported(Epilogue::AddResidual, m, l.d, l.q_dim) &&
         gemm_w8a16_sm90_supported(Epilogue::SwiGLU, m, 2 * l.f, l.d) && (2 * l.f) % 16 == 0 &&
         gemm_w8a16_sm90_supported(Epilogue::AddResidual, m, l.d, l.f);
}

size_t gemm_w8a16_sm90_layer_workspace_bytes(const Sm90Layer& l, int min_rows, int max_rows) {
  size_t bytes = 0;
  for (int m = std::max(min_rows, 1); m <= max_rows; ++m)
    for (size_t b : {gemm_w8a16_sm90_workspace_bytes(Epilogue::Store, m, l.qkv_dim, l.d),
                     gemm_w8a16_sm90_workspace_bytes(Epilogue::AddResidual, m, l.d, l.q_dim),
                     gemm_w8a16_sm90_workspace_bytes(Epilogue::SwiGLU, m, 2 * l.f, l.d),
                     gemm_w8a16_sm90_workspace_bytes(Epilogue::AddResidual, m, l.d, l.f),
                     gemm_w8a8_sm90_workspace_bytes(Epilogue::Store, m, l.qkv_dim, l.d),
                     gemm_w8a8_sm90_workspace_bytes(Epilogue::AddResidual, m, l.d, l.q_dim),
                     gemm_w8a8_sm90_workspace_bytes(Epilogue::SwiGLU, m, 2 * l.f, l.d),
                     gemm_w8a8_sm90_workspace_bytes(Epilogue::AddResidual, m, l.d, l.f)})
      bytes = std::max(bytes, b);
  return bytes;
}

const char* sm90_tile_name(Sm90Tile tile) {
  switch (tile) {
    case Sm90Tile::Wide: return "wide";
    case Sm90Tile::Narrow: return "narrow";
    case Sm90Tile::WideStreamK: return "wide-streamk";
    case Sm90Tile::NarrowStreamK: return "narrow-streamk";
    case Sm90Tile::XWide: return "xwide";
    default: return "auto";
  }
}

void gemm_w8a16_sm90_swiglu_rows(const float* y, int M, int F, bf16* out, cudaStream_t stream) {
  swiglu_rows<<<dim3(CEIL_DIV(F / 4, kSwigluThreads), M), kSwigluThreads, 0, stream>>>(y, F, out);
  AF_CUDA_CHECK(cudaGetLastError());
}

void gemm_w8a16_sm90_transpose_scales(const float* scales, int N, int K, float* out, cudaStream_t stream) {
  const int G = CEIL_DIV(K, kScaleGroup);
  scale_transpose<<<dim3(CEIL_DIV(N, 32), CEIL_DIV(G, 32)), dim3(32, 8), 0, stream>>>(scales, N, G, out);
  AF_CUDA_CHECK(cudaGetLastError());
}

void gemm_w8a16_sm90(const uint8_t* w, const float* scales, const void* x, Act x_type, int M, int N, int K, Epilogue ep,
                     void* out, void* workspace, size_t workspace_bytes, cudaStream_t stream, Sm90Tile tile,
                     const float* scales_pre, bool pdl) {
  AF_CHECK(gemm_w8a16_sm90_built(), "gemm_w8a16_sm90: this build has no sm90 GEMM (nvidia-cutlass was not found)");
  AF_CHECK(gemm_w8a16_sm90_supported(ep, M, N, K),
           "gemm_w8a16_sm90: needs M >= 1, N % 8 == 0, K % 64 == 0 and the Store, AddResidual or SwiGLU epilogue");
  AF_CHECK(ep != Epilogue::SwiGLU || N % 16 == 0, "gemm_w8a16_sm90: SwiGLU needs N = 2F with F % 8 == 0");
  for (const void* p :
       {static_cast<const void*>(w), static_cast<const void*>(scales), x, static_cast<const void*>(out)})
    AF_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "gemm_w8a16_sm90: w, scales, x and out must be 16-byte aligned");
  if (tile == Sm90Tile::Auto) tile = sm90_tile_for(M, N, current_sm_count());
  const Carve c = carve(ep, x_type, tile, M, N, K);
  AF_CHECK(workspace != nullptr && workspace_bytes >= c.total && reinterpret_cast<uintptr_t>(workspace) % kWsAlign == 0,
           "gemm_w8a16_sm90: the workspace must be gemm_w8a16_sm90_workspace_bytes() bytes, 256-byte aligned");
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  const float* scales_gn = scales_pre != nullptr ? scales_pre : reinterpret_cast<float*>(ws);
  float* y_swiglu = reinterpret_cast<float*>(ws + c.scales);
  void* cutlass_ws = ws + c.scales + c.swiglu;

  if (scales_pre == nullptr) gemm_w8a16_sm90_transpose_scales(scales, N, K, reinterpret_cast<float*>(ws), stream);

#if ATOMFLOW_SM90_GEMM
  float* y = ep == Epilogue::SwiGLU ? y_swiglu : static_cast<float*>(out);
  const float beta = ep == Epilogue::AddResidual ? 1.f : 0.f;
  dispatch(x_type, tile, [&](auto g) { decltype(g)::run(w, scales_gn, x, M, N, K, beta, y, cutlass_ws, stream, pdl); });
  AF_CUDA_CHECK(cudaGetLastError());
#else
  (void)y_swiglu;
  (void)cutlass_ws;
  (void)scales_gn;
#endif

  if (ep == Epilogue::SwiGLU) {
    const int F = N / 2;
    swiglu_rows<<<dim3(CEIL_DIV(F / 4, kSwigluThreads), M), kSwigluThreads, 0, stream>>>(y_swiglu, F,
                                                                                         static_cast<bf16*>(out));
    AF_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace atomflow::kernels

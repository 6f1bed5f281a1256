// W8A8 GEMM for prefill chunks on Hopper (sm_90a), the FP8 recipe: the activations quantized to e4m3 per
// token per 128 columns (scale = amax / 448), then y[m, n] = sum_g sx[m, g] s[n, g] sum_{k in g}
// x8[m, k] w8[n, k] on FP8 wgmma (twice the 16-bit rate, no weight conversion), CUTLASS's sm90 FP8
// blockwise-scaled GEMM with the group scales applied to fp32 partial sums (promotion every k-group).
//
//  - Run transposed as gemm_w8a16_sm90: D'[n, m] = W[n, :] . X8[m, :], W [N, K] K-major as A with its
//    scales [N, ceil(K / 128)] as they are in the file (granularity 1 x 128, K-major: no transpose), X8
//    [M, K] K-major as B with sx [M, ceil(K / 128)] (the same granularity), D' column-major = y [M, N].
//  - Tile 128 x 128 x 128, cluster 1x1, cooperative schedule, persistent tile scheduler, TMA epilogue.
//  - Rows past M / N and columns past K are TMA's out-of-bounds zeros (a 64-column tail group reads zeros
//    for its second half).
//
// Contract of gemm_w8a8_sm90 (launcher at the end):
//  Inputs   w fp8 e4m3 [N, K], scales fp32 [N, ceil(K / 128)], x 16-bit [M, K] of x_type; K % 64 == 0,
//           N % 8 == 0, pointers 16-byte aligned.
//  Launches 1. quantize_rows: x -> workspace x8 e4m3 [M, K] and sx fp32 [M, ceil(K / 128)];
//           2. the CUTLASS GEMM (Store: out fp32 [M, N]; AddResidual: out += y; SwiGLU: y fp32 into the
//              workspace), 3. for SwiGLU gemm_w8a16_sm90's swiglu_rows. Plain stream-ordered launches.
//  Workspace gemm_w8a8_sm90_workspace_bytes(ep, M, N, K), 256-byte aligned, no initial value.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <string>

#include "atomflow/kernels.h"
#include "gemm_sm90_common.cuh"

#if ATOMFLOW_SM90_GEMM
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
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
constexpr int kGroup = sm90::kScaleGroup;  // the activations' groups are the weights'

// One warp per (row, 128-column group): lane l holds columns 4l..4l+3 of the group (one 8-byte load),
// amax over the group by shuffles, then x / scale rounded to e4m3 (satfinite), the lane's 4 bytes in one
// store. scale = amax / 448 (1 where the group is all zeros). Columns past K (a 64-column tail) are not
// read. K % 64 == 0, so a lane's 4 columns are all inside or all past K, and its loads are aligned.
__device__ __forceinline__ void load4(const bf16* p, float (&v)[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}
__device__ __forceinline__ void load4(const f16* p, float (&v)[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
  v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}

template <typename T>
__global__ void quantize_rows(const T* __restrict__ x, int M, int K, uint8_t* __restrict__ x8, float* __restrict__ sx) {
  const int G = (K + kGroup - 1) / kGroup;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (warp >= M * G) return;
  const int m = warp / G, g = warp % G;
  const int k0 = g * kGroup + lane * 4;
  const size_t at = static_cast<size_t>(m) * K + k0;
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  if (k0 < K) load4(x + at, v);
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float scale = amax > 0.f ? amax / 448.f : 1.f;
  if (lane == 0) sx[static_cast<size_t>(m) * G + g] = scale;
  if (k0 < K) {
    const __nv_fp8x2_storage_t lo =
        __nv_cvt_float2_to_fp8x2(make_float2(v[0] / scale, v[1] / scale), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi =
        __nv_cvt_float2_to_fp8x2(make_float2(v[2] / scale, v[3] / scale), __NV_SATFINITE, __NV_E4M3);
    *reinterpret_cast<uint32_t*>(x8 + at) = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
}

#if ATOMFLOW_SM90_GEMM
using namespace cute;

using ElementW = cutlass::float_e4m3_t;
using ElementX = cutlass::float_e4m3_t;
using LayoutW = cutlass::layout::RowMajor;     // A [N, K], K-major
using LayoutX = cutlass::layout::ColumnMajor;  // B [K, M] column-major = x8 [M, K] row-major
using LayoutD = cutlass::layout::ColumnMajor;  // D' [N, M] column-major = y [M, N] row-major
constexpr int kAlign8 = 16, kAlignD = 4;       // elements of 16 bytes
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _1, _1>;
// Granularity 1 along the weight rows and the tokens, 128 along K; both K-major (row-major [rows, groups]).
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, kGroup, cute::GMMA::Major::K, cute::GMMA::Major::K>;
using LayoutSFW = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFX = decltype(ScaleConfig::deduce_layoutSFB());

using EpilogueOp = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, LayoutD, kAlignD, float, LayoutD, kAlignD,
    cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementW, cute::tuple<LayoutW, LayoutSFW>, kAlign8, ElementX,
    cute::tuple<LayoutX, LayoutSFX>, kAlign8, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename EpilogueOp::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum>::CollectiveOp;

// Scheduler: PersistentScheduler (data-parallel), or StreamKScheduler (the k-loops of all tiles spread over
// the SMs: a product with fewer tiles than SMs, o and down of a short chunk, still runs on every SM; split
// tiles reduced in the workspace in a fixed order).
template <class Scheduler>
struct W8A8Gemm {
  using K_ = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, EpilogueOp, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<K_>;

  static typename Gemm::Arguments arguments(const uint8_t* w, const float* sw, const void* x8, const float* sx, int M,
                                            int N, int K, float beta, const float* c, float* d) {
    const auto problem = make_shape(N, M, K, 1);
    using StrideW = typename K_::StrideA;
    using StrideX = typename K_::StrideB;
    using StrideC = typename K_::StrideC;
    using StrideD = typename K_::StrideD;
    const StrideW stride_w = cutlass::make_cute_packed_stride(StrideW{}, make_shape(N, K, 1));
    const StrideX stride_x = cutlass::make_cute_packed_stride(StrideX{}, make_shape(M, K, 1));
    const StrideC stride_c = cutlass::make_cute_packed_stride(StrideC{}, make_shape(N, M, 1));
    const StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, make_shape(N, M, 1));
    cutlass::KernelHardwareInfo hw{};
    hw.sm_count = current_sm_count();
    return typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {N, M, K, 1},
        {reinterpret_cast<const ElementW*>(w), stride_w, static_cast<const ElementX*>(x8), stride_x, sw,
         ScaleConfig::tile_atom_to_shape_SFA(problem), sx, ScaleConfig::tile_atom_to_shape_SFB(problem)},
        {{1.f, beta}, c, stride_c, d, stride_d},
        hw};
  }

  static size_t workspace_bytes(int M, int N, int K) {
    return Gemm::get_workspace_size(arguments(nullptr, nullptr, nullptr, nullptr, M, N, K, 0.f, nullptr, nullptr));
  }

  static void run(const uint8_t* w, const float* sw, const void* x8, const float* sx, int M, int N, int K, float beta,
                  float* out, void* workspace, cudaStream_t stream) {
    // Never under PDL: the blockwise mainloop's auxiliary load warp reads the activation scales (sx,
    // quantize_rows' output) without CUTLASS's wait for the kernel before.
    sm90::run_cutlass<K_, Gemm>(arguments(w, sw, x8, sx, M, N, K, beta, out, out), workspace, stream, "gemm_w8a8_sm90",
                                /*pdl=*/false);
  }
};

template <class Fn>
void dispatch(bool streamk, Fn&& fn) {
  if (streamk)
    fn(W8A8Gemm<cutlass::gemm::StreamKScheduler>{});
  else
    fn(W8A8Gemm<cutlass::gemm::PersistentScheduler>{});
}

size_t cutlass_workspace_bytes(bool streamk, int M, int N, int K) {
  size_t bytes = 0;
  dispatch(streamk, [&](auto g) { bytes = decltype(g)::workspace_bytes(M, N, K); });
  return bytes;
}
#else
size_t cutlass_workspace_bytes(bool, int, int, int) { return 0; }
#endif

// Workspace: [x8 M x K][sx M x G fp32][SwiGLU's y M x N fp32][CUTLASS's own].
struct Carve {
  size_t x8, sx, swiglu, cutlass, total;
};
Carve carve(Epilogue ep, int M, int N, int K, bool streamk) {
  Carve c{};
  c.x8 = align_up(static_cast<size_t>(M) * K);
  c.sx = align_up(sizeof(float) * static_cast<size_t>(M) * CEIL_DIV(K, kGroup));
  c.swiglu = ep == Epilogue::SwiGLU ? align_up(sizeof(float) * static_cast<size_t>(M) * N) : 0;
  c.cutlass = align_up(cutlass_workspace_bytes(streamk, M, N, K));
  c.total = c.x8 + c.sx + c.swiglu + c.cutlass;
  return c;
}

}  // namespace

size_t gemm_w8a8_sm90_workspace_bytes(Epilogue ep, int M, int N, int K, bool streamk) {
  return carve(ep, M, N, K, streamk).total;
}

void gemm_w8a8_sm90(const uint8_t* w, const float* scales, const void* x, Act x_type, int M, int N, int K, Epilogue ep,
                    void* out, void* workspace, size_t workspace_bytes, cudaStream_t stream, bool streamk) {
  AF_CHECK(gemm_w8a16_sm90_supported(ep, M, N, K),
           "gemm_w8a8_sm90: needs M >= 1, N % 8 == 0, K % 64 == 0 and the Store, AddResidual or SwiGLU epilogue");
  const Carve c = carve(ep, M, N, K, streamk);
  AF_CHECK(workspace != nullptr && workspace_bytes >= c.total &&
               reinterpret_cast<uintptr_t>(workspace) % sm90::kWsAlign == 0,
           "gemm_w8a8_sm90: the workspace must be gemm_w8a8_sm90_workspace_bytes() bytes, 256-byte aligned");
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  uint8_t* x8 = ws;
  auto* sx = reinterpret_cast<float*>(ws + c.x8);
  float* y_swiglu = reinterpret_cast<float*>(ws + c.x8 + c.sx);
  void* cutlass_ws = ws + c.x8 + c.sx + c.swiglu;

  const int G = CEIL_DIV(K, kGroup);
  const int warps = M * G, threads = 256;
  if (x_type == Act::F16)
    quantize_rows<<<CEIL_DIV(warps * 32, threads), threads, 0, stream>>>(static_cast<const f16*>(x), M, K, x8, sx);
  else
    quantize_rows<<<CEIL_DIV(warps * 32, threads), threads, 0, stream>>>(static_cast<const bf16*>(x), M, K, x8, sx);
  AF_CUDA_CHECK(cudaGetLastError());

#if ATOMFLOW_SM90_GEMM
  float* y = ep == Epilogue::SwiGLU ? y_swiglu : static_cast<float*>(out);
  dispatch(streamk, [&](auto g) {
    decltype(g)::run(w, scales, x8, sx, M, N, K, ep == Epilogue::AddResidual ? 1.f : 0.f, y, cutlass_ws, stream);
  });
#else
  (void)y_swiglu;
  (void)cutlass_ws;
  AF_CHECK(false, "gemm_w8a8_sm90: this build has no sm90 GEMM (nvidia-cutlass was not found)");
#endif
  if (ep == Epilogue::SwiGLU) gemm_w8a16_sm90_swiglu_rows(y_swiglu, M, N / 2, static_cast<bf16*>(out), stream);
}

}  // namespace atomflow::kernels

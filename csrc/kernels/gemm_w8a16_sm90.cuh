// The CUTLASS kernels behind gemm_w8a16_sm90 (its contract: the top of gemm_w8a16_sm90.cu), shared by the
// two files that instantiate them, so the build compiles the two sets in parallel:
//  - gemm_w8a16_sm90.cu: the fp32 epilogue (D = acc + beta C): Store, AddResidual, SwiGLU's gate half;
//  - gemm_w8a16_sm90_swiglu.cu: SwiGLU's up half, D bf16 = silu(C) * acc with C the gate half's fp32 y.
// Included by those two files only.
#pragma once

#include "atomflow/kernels.h"
#include "gemm_sm90_common.cuh"

#if ATOMFLOW_SM90_GEMM
#include <cmath>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace atomflow::kernels::sm90_w8a16 {

using namespace cute;
using sm90::kScaleGroup;

// Names follow the transposed product: A = the weight (N rows), B = x (M columns), D' = y^T. Declared at
// namespace scope with concrete types (inside a class template the host compiler rejects the builders'
// dependent names).
using ElementW = cutlass::float_e4m3_t;
using ElementScale = float;                            // fp32: the weight is rounded once, after the scale
using LayoutW = cutlass::layout::RowMajor;             // A [N, K], K-major
using LayoutX = cutlass::layout::ColumnMajor;          // B [K, M] column-major = x [M, K] row-major
using LayoutD = cutlass::layout::ColumnMajor;          // D' [N, M] column-major = y [M, N] row-major
constexpr int kAlignW = 16, kAlignX = 8, kAlignC = 4;  // elements of 16 bytes (C is fp32)
using ClusterShape = Shape<_1, _1, _1>;                // 2 x 1 clusters (x tiles multicast) measured no faster
// Three tile widths along the tokens: xwide (256: each weight converted serves twice the tokens of a wide
// tile; ~10% less time per FLOP when the waves of tiles are full), wide (128), and narrow (64) for short
// chunks, where a 128-token tile would run half its MMAs or more on rows past M (kernels.h: sm90_tile_for
// picks one by M and N). The narrow tile takes 128 columns of k a stage (one scale group; 64 measured 3-7%
// slower at 64 rows), the others 64 (128 measured even on wide; xwide's stages would not fit).
using TileXWide = Shape<_128, _256, _64>;
using TileWide = Shape<_128, _128, _64>;
using TileNarrow = Shape<_128, _64, _128>;

// The two epilogues. Plain: D fp32 = acc + beta C (alpha 1). SwiGLU's up half: D bf16 = silu(C) * acc, C the
// gate half's fp32 y, in the decode GEMV's formula (gate / (1 + exp(-gate)) * up, one rounding to bf16).
using PlainFusion = cutlass::epilogue::fusion::LinearCombination<float, float, float, float>;
template <class Frag>
struct SwigluFn {
  CUTLASS_HOST_DEVICE Frag operator()(const Frag& gate, const Frag& up) const {
    Frag out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < static_cast<int>(Frag::kElements); ++i) out[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
    return out;
  }
};
using SwigluFusion = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<SwigluFn, cutlass::bfloat16_t, float,
                                           cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90SrcFetch<float>, cutlass::epilogue::fusion::Sm90AccFetch>;

template <class Fusion>
struct EpilogueOut;
template <>
struct EpilogueOut<PlainFusion> {
  using type = float;
};
template <>
struct EpilogueOut<SwigluFusion> {
  using type = cutlass::bfloat16_t;
};

template <class Tile, class Fusion, class Out = typename EpilogueOut<Fusion>::type>
using EpilogueOp = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, LayoutD, kAlignC, Out, LayoutD,
    16 / static_cast<int>(sizeof(Out)), cutlass::epilogue::TmaWarpSpecializedCooperative, Fusion>::CollectiveOp;

template <class T, class Tile, class Fusion>
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cute::tuple<ElementW, ElementScale>, LayoutW, kAlignW, T,
    LayoutX, kAlignX, float, Tile, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename EpilogueOp<Tile, Fusion>::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

// Scheduler: PersistentScheduler (data-parallel: one block per tile at a time), or StreamKScheduler: the
// k-loops of all tiles spread over the SMs, so a product with fewer tiles than SMs (o and down of a
// short chunk: N / 128 tiles) still runs on every SM; split tiles are reduced in the workspace in a fixed
// order (deterministic), then one block runs the epilogue.
template <class T, class Tile, class Scheduler, class Fusion>
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop<T, Tile, Fusion>,
                                                    EpilogueOp<Tile, Fusion>, Scheduler>;

// Argument packing and launch of one of them (T: the activation's CUTLASS type). The weight's scales are
// [G, N] with row stride ld_s >= N (a half of SwiGLU's [G, 2F] is N = F columns of it).
template <class T, class Tile, class Scheduler, class Fusion>
struct Sm90Gemm {
  using K_ = Kernel<T, Tile, Scheduler, Fusion>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<K_>;
  using Out = typename K_::ElementD;
  using Thread = decltype(typename Gemm::Arguments{}.epilogue.thread);

  static typename Gemm::Arguments arguments(const uint8_t* w, const float* scales_gn, int ld_s, const void* x, int M,
                                            int N, int K, Thread thread, const float* c, Out* d) {
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
    const StrideS ss = cutlass::make_cute_packed_stride(StrideS{}, make_shape(ld_s, G, 1));
    cutlass::KernelHardwareInfo hw{};
    hw.sm_count = current_sm_count();
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {N, M, K, 1},
        {reinterpret_cast<const ElementW*>(w), sw, static_cast<const T*>(x), sx, scales_gn, ss, kScaleGroup},
        {thread, c, sc, d, sd},
        hw};
    return args;
  }

  static size_t workspace_bytes(int M, int N, int K) {
    return Gemm::get_workspace_size(arguments(nullptr, nullptr, N, nullptr, M, N, K, Thread{}, nullptr, nullptr));
  }

  static void run(const uint8_t* w, const float* scales_gn, int ld_s, const void* x, int M, int N, int K, Thread thread,
                  const float* c, Out* d, void* workspace, cudaStream_t stream, bool pdl) {
    sm90::run_cutlass<K_, Gemm>(arguments(w, scales_gn, ld_s, x, M, N, K, thread, c, d), workspace, stream,
                                "gemm_w8a16_sm90", pdl);
  }
};

// The kernel for (activation type, tile) of one epilogue: one call site per instance.
template <class Fusion, class T, class Fn>
void dispatch_tile(Sm90Tile tile, Fn&& fn) {
  using P = cutlass::gemm::PersistentScheduler;
  using S = cutlass::gemm::StreamKScheduler;
  switch (tile) {
    case Sm90Tile::Wide: return fn(Sm90Gemm<T, TileWide, P, Fusion>{});
    case Sm90Tile::Narrow: return fn(Sm90Gemm<T, TileNarrow, P, Fusion>{});
    case Sm90Tile::WideStreamK: return fn(Sm90Gemm<T, TileWide, S, Fusion>{});
    case Sm90Tile::XWide: return fn(Sm90Gemm<T, TileXWide, P, Fusion>{});
    default: return fn(Sm90Gemm<T, TileNarrow, S, Fusion>{});
  }
}
template <class Fusion, class Fn>
void dispatch(Act x_type, Sm90Tile tile, Fn&& fn) {
  if (x_type == Act::F16)
    dispatch_tile<Fusion, cutlass::half_t>(tile, fn);
  else
    dispatch_tile<Fusion, cutlass::bfloat16_t>(tile, fn);
}

}  // namespace atomflow::kernels::sm90_w8a16
#endif

namespace atomflow::kernels::sm90_w8a16 {
// gemm_w8a16_sm90_swiglu.cu: SwiGLU's up half, out bf16 [M, F] = silu(gate) * (x w_up^T), gate fp32 [M, F]
// (the gate half's y); w_up [F, K] fp8, scales_up its [G, F] columns of scales with row stride ld_s. Its
// CUTLASS workspace bytes (0 in a build without CUTLASS, whose launcher never runs).
size_t swiglu_up_workspace_bytes(Act x_type, Sm90Tile tile, int M, int F, int K);
void swiglu_up(const uint8_t* w_up, const float* scales_up, int ld_s, const void* x, Act x_type, int M, int F, int K,
               const float* gate, bf16* out, void* workspace, Sm90Tile tile, cudaStream_t stream, bool pdl);
}  // namespace atomflow::kernels::sm90_w8a16

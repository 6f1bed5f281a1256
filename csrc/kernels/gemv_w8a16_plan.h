// The W8A16 GEMV's shape constants and the plan table's private interface: shared by the kernel
// (gemv_w8a16.cu, gemv_w8a16_body.cuh) and its plan (gemv_w8a16_plan.cpp), host and device alike.
// Why each number is what it is: docs/design/gemv_w8a16.md.
#pragma once
#include <cstddef>
#include <cstdint>

#include "atomflow/kernels.h"

namespace atomflow::kernels {

constexpr int kGemvThreads = 256;
constexpr int kGemvWarps = kGemvThreads / 32;
constexpr int kGemvUnroll = 8;  // 16-byte chunks per row per lane per iteration
// Warps 0 .. kGemvPreWarps - 1 of a block send their first iteration's loads before the PDL wait,
// the others once x is staged; in the QKV product warps 0 .. kQkvPreWarps - 1 when it stages second
// pairs, every warp otherwise, and every warp in the o product on fp16 x (calc_pre_warps).
constexpr int kGemvPreWarps = kGemvWarps / 2;
constexpr int kQkvPreWarps = 6;
constexpr int kQuantGroup = 128;
// K of every product is a multiple of 64: a row's 16-byte chunks then fill whole groups of 4 lanes
// (one tensor-core row each, dot_chunk), and K % 128 == 64 leaves a last scale group of 64 columns
// (the tail group, docs/FORMAT.md).
constexpr int kGemvKStep = 64;
// K of a row that one iteration of a warp covers (32 lanes x kGemvUnroll chunks of 16 weights).
constexpr int kGemvIterK = 32 * kGemvUnroll * 16;
// SwiGLU's ticket counters (gemv_w8a16_variants.cuh): classes, one counter per 128-byte line.
constexpr int kTicketClasses = 64;
constexpr int kTicketStride = 128 / sizeof(unsigned);
// A warp's second row pair in shared memory (StagedPair): kGemvUnroll x 32 chunks of each row, and
// 32 scales of each.
constexpr size_t kStagedPairBytes = 2 * kGemvUnroll * 32 * 16 + 2 * 32 * sizeof(float);

// x's fp16 slots run to a multiple of 512 values (32 chunks): a 32-chunk step that a warp runs for
// some lanes reads inside the buffer for all of them.
__host__ __device__ constexpr int gemv_x_padded(int K) { return CEIL_DIV(K, 512) * 512; }

// Dynamic shared memory of a block before any staged pairs: x as fp16, and for GemvIn::NORM the raw
// fp32 residual row and the bf16 norm weight it is computed from.
__host__ __device__ constexpr size_t gemv_staging_bytes(GemvIn in, int K) {
  return gemv_x_padded(K) * sizeof(uint16_t) +
         (in == GemvIn::NORM ? static_cast<size_t>(K) * (sizeof(float) + sizeof(uint16_t)) : 0);
}

// Rows of whole 32-chunk steps (K a multiple of 512: every Llama shape) take the variant whose loads
// need no clamp at the row's end.
constexpr bool gemv_whole_steps(int K) { return K % (32 * 16) == 0; }

// K % 128 == 64: the last scale group of a row is 64 columns wide, so a row has ceil(K / 128) scales.
// Such a K takes the tail instance (never whole: 512 is a multiple of 128); every other K keeps the
// instances whose machine code predates tail groups.
constexpr bool gemv_tail_group(int K) { return K % kQuantGroup != 0; }

// Scales per row of W: K / 128, or ceil(K / 128) in the tail instance.
template <bool TAIL>
__host__ __device__ constexpr int gemv_scale_groups(int K) {
  return TAIL ? CEIL_DIV(K, kQuantGroup) : K / kQuantGroup;
}

// Row pairs of a product: SwiGLU and RopeKV pair rows of two halves, the others consecutive rows.
constexpr int gemv_row_pairs(Epilogue ep, int N) {
  return ep == Epilogue::SwiGLU || ep == Epilogue::RopeKV ? N / 2 : CEIL_DIV(N, 2);
}

// The decode GEMV with token columns (gemv_w8a16_cols.cu): its instances' columns (rows of x at most),
// and the chunks a lane loads per row per iteration (half the decode GEMV's 8: the registers go to the
// columns' accumulators and their interleaved product chains).
constexpr int kGemvColsMT = 4;
constexpr int kGemvColsUnroll = kGemvUnroll / 2;
// Its dynamic shared memory: M rows of fp16 x, and for NORM raw_rows fp32 rows and the norm weight.
__host__ __device__ constexpr size_t gemv_cols_smem(GemvIn in, int M, int K, int raw_rows) {
  return static_cast<size_t>(M) * gemv_x_padded(K) * sizeof(uint16_t) +
         (in == GemvIn::NORM ? static_cast<size_t>(raw_rows) * K * sizeof(float) + K * sizeof(uint16_t) : 0);
}

// gemv_w8a16.cu: blocks of a GEMV kernel (a gemv_w8a16_kernel or gemv_cols_kernel instance) with `smem`
// bytes of dynamic shared memory resident at once on the current device (2 per SM, fewer only if fewer
// fit); raises the kernel's dynamic shared memory limit to smem the first time.
int gemv_kernel_resident_blocks(const void* kernel, size_t smem);
// gemv_w8a16_cols.cu: the same for the cols instance of (ep, in, whole, tail, bias), and its launch
// (x [M, K] per plan.in; out and rope as gemv_w8a16_m's).
int gemv_cols_resident_blocks(Epilogue ep, GemvIn in, bool whole, bool tail, bool bias, size_t smem);
void gemv_cols(const GemvPlan& plan, const uint8_t* w, const float* scales, const void* x, const bf16* norm_w,
               float eps, int M, int N, int K, void* out, int* f16_overflow, const RopeKVArgs& rope,
               cudaStream_t stream);

// gemv_w8a16.cu: blocks of the (ep, in, whole, tail, bias) instance with `smem` bytes of dynamic
// shared memory resident at once on the current device (2 per SM, fewer only if fewer fit); raises
// the instance's dynamic shared memory limit to smem the first time. bias: RopeKV only.
int gemv_resident_blocks(Epilogue ep, GemvIn in, bool whole, bool tail, bool bias, size_t smem);

}  // namespace atomflow::kernels

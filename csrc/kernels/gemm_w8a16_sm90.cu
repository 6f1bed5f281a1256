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
//    workspace); TMA epilogue. Which of the five kinds runs: kernels.h's sm90_tile_for(M, N, SMs), N the
//    launch's (F for each half of SwiGLU). The kernels: gemm_w8a16_sm90.cuh.
//  - SwiGLU (N = 2F) by kernels.h's sm90_swiglu_halves: two launches of F rows, the gate half (w[:F]) writing
//    its fp32 y to the workspace and the up half (w[F:], gemm_w8a16_sm90_swiglu.cu) reading it as its
//    epilogue's C and storing bf16(silu(gate) * up); or one launch of 2F rows and swiglu_rows. Either way
//    gemm_w8a16's formula and roundings, the same bits.
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
//              SwiGLU (N = 2F), halves: gate fp32 [M, F] = x w[:F]^T into the workspace, then
//           3. the up half: out bf16 [M, F] = silu(gate) * (x w[F:]^T); or, one launch: y fp32 [M, 2F] into
//              the workspace, then swiglu_rows: out bf16 [M, F] = silu(y[:, :F]) * y[:, F:].
//           The GEMMs launch under PDL when pdl says so (each one's loads wait for the kernel before it).
//  Workspace gemm_w8a16_sm90_workspace_bytes(ep, M, N, K, tile) bytes of device memory, 256-byte aligned,
//           used by one stream at a time, no initial value needed, nothing left in it for later calls.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "atomflow/kernels.h"
#include "gemm_sm90_common.cuh"
#include "gemm_w8a16_sm90.cuh"

namespace atomflow::kernels {

namespace {

using sm90::align_up;
using sm90::kScaleGroup;
using sm90::kWsAlign;
#if ATOMFLOW_SM90_GEMM
using sm90_w8a16::dispatch;
using sm90_w8a16::PlainFusion;
#endif

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
size_t cutlass_workspace_bytes(Act x_type, Sm90Tile tile, int M, int N, int K) {
  size_t bytes = 0;
  dispatch<PlainFusion>(x_type, tile, [&](auto g) { bytes = decltype(g)::workspace_bytes(M, N, K); });
  return bytes;
}
#else
size_t cutlass_workspace_bytes(Act, Sm90Tile, int, int, int) { return 0; }
#endif

// The N of one launch: N, or F for each half of SwiGLU's N = 2F run as two launches.
int launch_rows(Epilogue ep, int N, bool halves) { return ep == Epilogue::SwiGLU && halves ? N / 2 : N; }

// Workspace carve-up: [scales G x N fp32][SwiGLU's y: the gate half's M x F fp32, or one launch's M x 2F]
// [CUTLASS's own workspace, one launch's at a time (the two halves in turn)].
struct Carve {
  size_t scales, y, cutlass, total;
};
Carve carve(Epilogue ep, Act x_type, Sm90Tile tile, int M, int N, int K, bool halves) {
  Carve c{};
  const int n = launch_rows(ep, N, halves);
  c.scales = align_up(sizeof(float) * static_cast<size_t>(CEIL_DIV(K, kScaleGroup)) * N);
  c.y = ep == Epilogue::SwiGLU ? align_up(sizeof(float) * static_cast<size_t>(M) * n) : 0;
  c.cutlass = align_up(cutlass_workspace_bytes(x_type, tile, M, n, K));
  if (ep == Epilogue::SwiGLU && halves)
    c.cutlass = std::max(c.cutlass, align_up(sm90_w8a16::swiglu_up_workspace_bytes(x_type, tile, M, n, K)));
  c.total = c.scales + c.y + c.cutlass;
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
  // SwiGLU: either way of running it (sm90_swiglu_halves depends on the GPU's SMs).
  size_t bytes = 0;
  for (bool halves : {false, true}) {
    if (ep != Epilogue::SwiGLU && halves) continue;
    const Sm90Tile kind = tile == Sm90Tile::Auto ? sm90_tile_for(M, launch_rows(ep, N, halves), 1) : tile;
    bytes = std::max(
        {bytes, carve(ep, Act::BF16, kind, M, N, K, halves).total, carve(ep, Act::F16, kind, M, N, K, halves).total});
  }
  return bytes;
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
                     const float* scales_pre, bool pdl, Sm90Swiglu swiglu) {
  AF_CHECK(gemm_w8a16_sm90_built(), "gemm_w8a16_sm90: this build has no sm90 GEMM (nvidia-cutlass was not found)");
  AF_CHECK(gemm_w8a16_sm90_supported(ep, M, N, K),
           "gemm_w8a16_sm90: needs M >= 1, N % 8 == 0, K % 64 == 0 and the Store, AddResidual or SwiGLU epilogue");
  AF_CHECK(ep != Epilogue::SwiGLU || N % 16 == 0, "gemm_w8a16_sm90: SwiGLU needs N = 2F with F % 8 == 0");
  for (const void* p :
       {static_cast<const void*>(w), static_cast<const void*>(scales), x, static_cast<const void*>(out)})
    AF_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "gemm_w8a16_sm90: w, scales, x and out must be 16-byte aligned");
  const int sms = current_sm_count();
  const bool halves = ep == Epilogue::SwiGLU &&
                      (swiglu == Sm90Swiglu::Auto ? sm90_swiglu_halves(M, N / 2, sms) : swiglu == Sm90Swiglu::Halves);
  const int n = launch_rows(ep, N, halves);
  if (tile == Sm90Tile::Auto) tile = sm90_tile_for(M, n, sms);
  const Carve c = carve(ep, x_type, tile, M, N, K, halves);
  AF_CHECK(workspace != nullptr && workspace_bytes >= c.total && reinterpret_cast<uintptr_t>(workspace) % kWsAlign == 0,
           "gemm_w8a16_sm90: the workspace must be gemm_w8a16_sm90_workspace_bytes() bytes, 256-byte aligned");
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  const float* scales_gn = scales_pre != nullptr ? scales_pre : reinterpret_cast<float*>(ws);
  float* y_swiglu = reinterpret_cast<float*>(ws + c.scales);
  void* cutlass_ws = ws + c.scales + c.y;

  if (scales_pre == nullptr) gemm_w8a16_sm90_transpose_scales(scales, N, K, reinterpret_cast<float*>(ws), stream);

#if ATOMFLOW_SM90_GEMM
  // Store / AddResidual: out (fp32) = y (+ out). SwiGLU: y of the gate half (or of all 2F rows) into the
  // workspace, then the up half with the activation in its epilogue (or swiglu_rows).
  float* y = ep == Epilogue::SwiGLU ? y_swiglu : static_cast<float*>(out);
  const float beta = ep == Epilogue::AddResidual ? 1.f : 0.f;
  dispatch<PlainFusion>(x_type, tile, [&](auto g) {
    using G = decltype(g);
    G::run(w, scales_gn, N, x, M, n, K, typename G::Thread{1.f, beta}, y, y, cutlass_ws, stream, pdl);
  });
  if (halves)
    sm90_w8a16::swiglu_up(w + static_cast<size_t>(n) * K, scales_gn + n, N, x, x_type, M, n, K, y_swiglu,
                          static_cast<bf16*>(out), cutlass_ws, tile, stream, pdl);
#else
  (void)cutlass_ws;
  (void)scales_gn;
#endif
  if (ep == Epilogue::SwiGLU && !halves)
    gemm_w8a16_sm90_swiglu_rows(y_swiglu, M, N / 2, static_cast<bf16*>(out), stream);
}

}  // namespace atomflow::kernels

// The bf16-weight head GEMV: one warp per output row, 16-byte loads, fp32 accumulation.
#include <cstdint>

#include "bf16_gemv.h"

#include "atomflow/pdl.cuh"

namespace atomflow {

// ---------------------------------------------------------------------------------------
// kernel

constexpr int kGemvWarps = 8;  // rows per block

static __global__ void __launch_bounds__(kGemvWarps * 32)
    bf16_gemv_kernel(const bf16* __restrict__ w, const f16* x, int N, int K, float* __restrict__ out) {
  pdl_prologue();
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kGemvWarps + threadIdx.x / 32;
  if (row >= N) return;
  const uint4* wr = reinterpret_cast<const uint4*>(w + static_cast<size_t>(row) * K);
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float acc = 0.f;
  for (int i = lane; i < K / 8; i += 32) {
    const uint4 a = wr[i];
    const uint4 b = xv[i];
    const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __half2* b2 = reinterpret_cast<const __half2*>(&b);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 fa = __bfloat1622float2(a2[j]);
      const float2 fb = __half22float2(b2[j]);
      acc = fmaf(fa.x, fb.x, acc);
      acc = fmaf(fa.y, fb.y, acc);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) out[row] = acc;
}

// ---------------------------------------------------------------------------------------
// launcher

void bf16_gemv(const bf16* w, const f16* x, int N, int K, float* out, cudaStream_t stream) {
  AF_CHECK(N > 0 && K > 0, "bf16_gemv needs N > 0 and K > 0");
  AF_CHECK(K % 8 == 0, "bf16_gemv needs K % 8 == 0 (16-byte loads)");
  AF_CHECK(reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0,
           "bf16_gemv needs 16-byte aligned w and x");
  af_launch(bf16_gemv_kernel, dim3(CEIL_DIV(N, kGemvWarps)), dim3(kGemvWarps * 32), 0, stream, w, x, N, K, out);
}

}  // namespace atomflow

// RMSNorm's arithmetic, shared by the rmsnorm kernel and the GEMV's fused prologue so that the
// two paths agree to the bit: one definition of the reduction tree and of the rounding.
#pragma once
#include "atomflow/common.h"

namespace atomflow {

// rsqrt(mean(x^2) + eps) of x [d], computed by all THREADS threads of the block (each returns
// it). red: THREADS / 32 floats of shared memory. Contains a __syncthreads().
template <int THREADS>
__device__ __forceinline__ float block_inv_rms(const float* x, int d, float eps, float* red) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps, one block");
  float ss = 0.f;
  for (int i = threadIdx.x; i < d; i += THREADS) ss = fmaf(x[i], x[i], ss);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = threadIdx.x % 32 < THREADS / 32 ? red[threadIdx.x % 32] : 0.f;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) total += __shfl_xor_sync(0xffffffffu, total, off);
  return rsqrtf(total / static_cast<float>(d) + eps);
}

// One normalized element as the matrix products consume it: fp16 (kernels.h).
__device__ __forceinline__ f16 rmsnorm_value(float x, float inv_rms, bf16 w) {
  return __float2half_rn(x * inv_rms * __bfloat162float(w));
}

}  // namespace atomflow

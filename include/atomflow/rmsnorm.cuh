// RMSNorm's arithmetic, shared by the rmsnorm kernel and the GEMV's fused prologue so that the
// two paths agree to the bit: one definition of the reduction tree and of the rounding.
#pragma once
#include "atomflow/common.h"

namespace atomflow {

// rsqrt(mean(x^2) + eps) of x [d], computed by all THREADS threads of the block (each returns
// it). red: THREADS / 32 floats of shared memory. Contains a __syncthreads().
// Thread t sums the squares of float4s t, t + THREADS, ... of x in four independent chains, one
// per component (d % 4 == 0 and x 16-byte aligned; otherwise of elements t, t + THREADS, ... in
// one chain); the lanes' sums meet in a butterfly, the warps' sums are added in warp order.
// Before the barrier a thread reads only those elements of x: a caller that copied x into
// shared memory with the same thread-to-float4 mapping needs no barrier before the call
// (gemv_w8a16.cu, stage_x).
template <int THREADS>
__device__ __forceinline__ float block_inv_rms(const float* x, int d, float eps, float* red) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps, one block");
  float ss = 0.f;
  if (d % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll 4
    for (int v = threadIdx.x; v < d / 4; v += THREADS) {
      const float4 q = x4[v];
      s0 = fmaf(q.x, q.x, s0);
      s1 = fmaf(q.y, q.y, s1);
      s2 = fmaf(q.z, q.z, s2);
      s3 = fmaf(q.w, q.w, s3);
    }
    ss = (s0 + s1) + (s2 + s3);
  } else {
    for (int i = threadIdx.x; i < d; i += THREADS) ss = fmaf(x[i], x[i], ss);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) total += red[w];
  return rsqrtf(total / static_cast<float>(d) + eps);
}

// One normalized element as the matrix products consume it: fp16 (kernels.h).
__device__ __forceinline__ f16 rmsnorm_value(float x, float inv_rms, bf16 w) {
  return __float2half_rn(x * inv_rms * __bfloat162float(w));
}

}  // namespace atomflow

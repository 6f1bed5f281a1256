// RMSNorm, one block per row: out = bf16(x * rsqrt(mean(x^2) + eps) * w), all in fp32 (HF
// LlamaRMSNorm semantics with the weight applied to the fp32 normalized value).
#include "atomflow/kernels.h"
#include "atomflow/pdl.cuh"

namespace atomflow::kernels {

constexpr int kNormThreads = 256;  // the fused GEMV prologue (gemv_w8a16.cu) reduces the same way

static __global__ void __launch_bounds__(kNormThreads)
    rmsnorm_kernel(const float* x, const bf16* __restrict__ w, int d, float eps,
                   f16* __restrict__ out) {
  __shared__ float warp_sums[kNormThreads / 32];
  __shared__ float inv_rms;
  pdl_prologue();
  const float* xr = x + static_cast<size_t>(blockIdx.x) * d;
  f16* orow = out + static_cast<size_t>(blockIdx.x) * d;

  float ss = 0.f;
  for (int i = threadIdx.x; i < d; i += kNormThreads) ss = fmaf(xr[i], xr[i], ss);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < kNormThreads / 32 ? warp_sums[threadIdx.x] : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (threadIdx.x == 0) inv_rms = rsqrtf(v / static_cast<float>(d) + eps);
  }
  __syncthreads();

  const float r = inv_rms;
  // Second read of the row hits L1/L2: it was just read by this block.
  for (int i = threadIdx.x; i < d; i += kNormThreads) orow[i] = __float2half_rn(xr[i] * r * __bfloat162float(w[i]));
}

// ---- launcher ----

void rmsnorm(const float* x, const bf16* w, int M, int d, float eps, f16* out, cudaStream_t stream) {
  AF_CHECK(M >= 1 && d >= 1, "rmsnorm: M and d must be >= 1");
  af_launch(rmsnorm_kernel, dim3(M), dim3(kNormThreads), 0, stream, x, w, d, eps, out);
  AF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace atomflow::kernels

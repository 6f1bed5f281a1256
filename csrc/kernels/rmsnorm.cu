// RMSNorm, one block per row: out = f16(x * rsqrt(mean(x^2) + eps) * w), all in fp32 (HF
// LlamaRMSNorm semantics with the weight applied to the fp32 normalized value).
// Contract: one block per row of x fp32 [M, d]; reads x only after its PDL wait (pdl_prologue);
// writes out fp16 [M, d], every element; the same reduction tree as the GEMV's fused prologue.
#include "atomflow/kernels.h"
#include "atomflow/pdl.cuh"
#include "atomflow/rmsnorm.cuh"

namespace atomflow::kernels {

constexpr int kNormThreads = 256;  // the fused GEMV prologue (gemv_w8a16.cu) reduces the same way

static __global__ void __launch_bounds__(kNormThreads)
    rmsnorm_kernel(const float* x, const bf16* __restrict__ w, int d, float eps, f16* __restrict__ out) {
  __shared__ float red[kNormThreads / 32];
  pdl_prologue();
  const float* xr = x + static_cast<size_t>(blockIdx.x) * d;
  f16* orow = out + static_cast<size_t>(blockIdx.x) * d;
  const float r = block_inv_rms<kNormThreads>(xr, d, eps, red);
  // Second read of the row hits L1/L2: it was just read by this block.
  for (int i = threadIdx.x; i < d; i += kNormThreads) orow[i] = rmsnorm_value(xr[i], r, w[i]);
}

// ---- launcher ----

void rmsnorm(const float* x, const bf16* w, int M, int d, float eps, f16* out, cudaStream_t stream) {
  AF_CHECK(M >= 1 && d >= 1, "rmsnorm: M and d must be >= 1");
  af_launch(rmsnorm_kernel, dim3(M), dim3(kNormThreads), 0, stream, x, w, d, eps, out);
  AF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace atomflow::kernels

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
  // Second read of the row hits L1/L2: it was just read by this block. Four columns a thread at a time
  // where the row allows (16-byte x, 8-byte w and out): the same value per element.
  if (d % 4 == 0 && reinterpret_cast<uintptr_t>(xr) % 16 == 0 && reinterpret_cast<uintptr_t>(w) % 8 == 0 &&
      reinterpret_cast<uintptr_t>(orow) % 8 == 0) {
    for (int v = threadIdx.x; v < d / 4; v += kNormThreads) {
      const float4 q = reinterpret_cast<const float4*>(xr)[v];
      const uint2 wv = reinterpret_cast<const uint2*>(w)[v];
      const bf16* w4 = reinterpret_cast<const bf16*>(&wv);
      __align__(8) f16 o4[4] = {rmsnorm_value(q.x, r, w4[0]), rmsnorm_value(q.y, r, w4[1]),
                                rmsnorm_value(q.z, r, w4[2]), rmsnorm_value(q.w, r, w4[3])};
      reinterpret_cast<uint2*>(orow)[v] = *reinterpret_cast<const uint2*>(o4);
    }
    return;
  }
  for (int i = threadIdx.x; i < d; i += kNormThreads) orow[i] = rmsnorm_value(xr[i], r, w[i]);
}

// ---- launcher ----

void rmsnorm(const float* x, const bf16* w, int M, int d, float eps, f16* out, cudaStream_t stream) {
  AF_CHECK(M >= 1 && d >= 1, "rmsnorm: M and d must be >= 1");
  af_launch(rmsnorm_kernel, dim3(M), dim3(kNormThreads), 0, stream, x, w, d, eps, out);
  AF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace atomflow::kernels

// Small elementwise ops the fused paths do not cover: x += y (fp32).
// Contract: reads x and y only after its PDL wait (pdl_prologue); writes x[0, n).
#include "atomflow/kernels.h"
#include "atomflow/pdl.cuh"

namespace atomflow::kernels {

constexpr int kAddThreads = 256;

static __global__ void __launch_bounds__(kAddThreads) add_inplace_kernel(float* __restrict__ x, const float* y, int n) {
  pdl_prologue();
  const int stride = gridDim.x * kAddThreads;
  for (int i = blockIdx.x * kAddThreads + threadIdx.x; i < n; i += stride) x[i] += y[i];
}

// ---- launcher ----

void add_inplace(float* x, const float* y, int n, cudaStream_t stream) {
  AF_CHECK(n >= 0, "add_inplace: n must be >= 0");
  if (n == 0) return;
  // A grid-stride loop: a few thousand blocks at most, each thread a few elements.
  const int blocks = min(CEIL_DIV(n, kAddThreads), 4096);
  af_launch(add_inplace_kernel, dim3(blocks), dim3(kAddThreads), 0, stream, x, y, n);
  AF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace atomflow::kernels

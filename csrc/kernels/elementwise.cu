// Small elementwise ops the fused paths do not cover: x += y (fp32); whether every value of x is finite.
// Contract (add_inplace): reads x and y only after its PDL wait (pdl_prologue); writes x[0, n).
// Contract (all_finite): one block; reads x[0, n) only after its PDL wait; writes *flag = 1 when no value is a
// NaN or an infinity, else 0 (a plain store: flag may be mapped host memory).
#include "atomflow/kernels.h"
#include "atomflow/pdl.cuh"

namespace atomflow::kernels {

constexpr int kAddThreads = 256;

static __global__ void __launch_bounds__(kAddThreads) add_inplace_kernel(float* __restrict__ x, const float* y, int n) {
  pdl_prologue();
  const int stride = gridDim.x * kAddThreads;
  for (int i = blockIdx.x * kAddThreads + threadIdx.x; i < n; i += stride) x[i] += y[i];
}

constexpr int kFiniteThreads = 1024;

// Exponent bits all ones: an infinity or a NaN. 16-byte loads where x is 16-byte aligned, then the tail.
static __global__ void __launch_bounds__(kFiniteThreads) all_finite_kernel(const float* x, int n, int32_t* flag) {
  pdl_prologue();
  auto bad = [](float v) { return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u; };
  bool any = false;
  const int n4 = reinterpret_cast<uintptr_t>(x) % 16 == 0 ? n / 4 : 0;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  for (int i = threadIdx.x; i < n4; i += kFiniteThreads) {
    const float4 v = __ldcg(x4 + i);
    any = any || bad(v.x) || bad(v.y) || bad(v.z) || bad(v.w);
  }
  for (int i = 4 * n4 + threadIdx.x; i < n; i += kFiniteThreads) any = any || bad(__ldcg(x + i));
  any = __syncthreads_or(any);
  if (threadIdx.x == 0) *flag = any ? 0 : 1;
}

// ---- launchers ----

void add_inplace(float* x, const float* y, int n, cudaStream_t stream) {
  AF_CHECK(n >= 0, "add_inplace: n must be >= 0");
  if (n == 0) return;
  // A grid-stride loop: a few thousand blocks at most, each thread a few elements.
  const int blocks = min(CEIL_DIV(n, kAddThreads), 4096);
  af_launch(add_inplace_kernel, dim3(blocks), dim3(kAddThreads), 0, stream, x, y, n);
  AF_CUDA_CHECK(cudaGetLastError());
}

void all_finite(const float* x, int n, int32_t* flag, cudaStream_t stream) {
  AF_CHECK(n >= 1 && x != nullptr && flag != nullptr, "all_finite: needs n >= 1, x and flag");
  af_launch(all_finite_kernel, dim3(1), dim3(kFiniteThreads), 0, stream, x, n, flag);
  AF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace atomflow::kernels

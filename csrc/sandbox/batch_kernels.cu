// gather_rows and argmax_rows (batch_kernels.h): one block per output row each.
#include <climits>

#include "atomflow/pdl.cuh"
#include "batch_kernels.h"

namespace atomflow::sandbox {

constexpr int kGatherThreads = 256;
constexpr int kArgmaxThreads = 1024;

// x and rows come from earlier kernels / the host: plain (coherent) loads, pdl.cuh.
static __global__ void __launch_bounds__(kGatherThreads)
    gather_rows_kernel(const float* x, const int32_t* rows, int d, float* __restrict__ out) {
  pdl_prologue();
  const float* src = x + static_cast<size_t>(rows[blockIdx.x]) * d;
  float* dst = out + static_cast<size_t>(blockIdx.x) * d;
  for (int i = threadIdx.x; i < d; i += kGatherThreads) dst[i] = src[i];
}

// (value, index) order: larger value first, then the lower index. NaN never replaces anything.
static __device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

static __global__ void __launch_bounds__(kArgmaxThreads)
    argmax_rows_kernel(const float* logits, int vocab, int32_t* __restrict__ tokens) {
  __shared__ float sv[kArgmaxThreads / 32];
  __shared__ int si[kArgmaxThreads / 32];
  pdl_prologue();
  const float* row = logits + static_cast<size_t>(blockIdx.x) * vocab;
  float bv = -INFINITY;
  int bi = INT_MAX;
  for (int j = threadIdx.x; j < vocab; j += kArgmaxThreads) {
    const float v = row[j];
    if (better(v, j, bv, bi)) bv = v, bi = j;
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
    if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  if (warp == 0) {
    bv = sv[lane];
    bi = si[lane];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
      if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    if (lane == 0) tokens[blockIdx.x] = bi == INT_MAX ? 0 : bi;  // all NaN: token 0
  }
}

// ---- launchers ----

void gather_rows(const float* x, const int32_t* rows, int L, int d, float* out, cudaStream_t stream) {
  AF_CHECK(L >= 1 && d >= 1, "gather_rows: L and d must be >= 1");
  af_launch(gather_rows_kernel, dim3(L), dim3(kGatherThreads), 0, stream, x, rows, d, out);
}

void argmax_rows(const float* logits, int L, int vocab, int32_t* tokens, cudaStream_t stream) {
  AF_CHECK(L >= 1 && vocab >= 1, "argmax_rows: L and vocab must be >= 1");
  af_launch(argmax_rows_kernel, dim3(L), dim3(kArgmaxThreads), 0, stream, logits, vocab, tokens);
}

}  // namespace atomflow::sandbox

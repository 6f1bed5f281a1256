// Token embedding lookup: out[m, :] = float(table[tokens[m], :]), one block per token.
// Contract: one block per token; reads the token ids only after its PDL wait (pdl_prologue), clamps
// them into [0, vocab); writes out fp32 [M, d], every element.
#include "atomflow/kernels.h"
#include "atomflow/pdl.cuh"

namespace atomflow::kernels {

constexpr int kEmbedThreads = 256;

// d is small (a few thousand): coalesced 2-byte loads are plenty, and any d works.
static __global__ void __launch_bounds__(kEmbedThreads)
    embedding_kernel(const bf16* __restrict__ table, const int32_t* tokens, int d, int vocab, float* __restrict__ out) {
  pdl_prologue();
  const int m = blockIdx.x;
  // The host validates ids; clamping keeps a bad id from ever reading out of bounds.
  const int tok = min(max(tokens[m], 0), vocab - 1);
  const bf16* row = table + static_cast<size_t>(tok) * d;
  float* o = out + static_cast<size_t>(m) * d;
  for (int i = threadIdx.x; i < d; i += kEmbedThreads) o[i] = __bfloat162float(row[i]);
}

// ---- launcher ----

void embedding(const bf16* table, const int32_t* tokens, int M, int d, int vocab, float* out, cudaStream_t stream) {
  AF_CHECK(M >= 1 && d >= 1 && vocab >= 1, "embedding: M, d and vocab must be >= 1");
  af_launch(embedding_kernel, dim3(M), dim3(kEmbedThreads), 0, stream, table, tokens, d, vocab, out);
  AF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace atomflow::kernels

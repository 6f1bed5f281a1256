// Small kernels the batched forward needs and the core engine does not: picking the rows that
// want logits, and a greedy token per row. Launched with PDL like every kernel (pdl.cuh).
#pragma once
#include <cstdint>

#include "atomflow/common.h"

namespace atomflow::sandbox {

// out[i, :] = x[rows[i], :], i < L. x, out fp32 [*, d]; rows int32 [L] (device, each < rows of x).
void gather_rows(const float* x, const int32_t* rows, int L, int d, float* out, cudaStream_t stream);

// tokens[i] = argmax_j logits[i, j] (the lowest index on ties, NaN never wins), i < L: the greedy
// choice of kernels::sample, for a batch of rows in one launch.
void argmax_rows(const float* logits, int L, int vocab, int32_t* tokens, cudaStream_t stream);

}  // namespace atomflow::sandbox

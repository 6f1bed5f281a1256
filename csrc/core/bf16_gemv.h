// The bf16-weight head: logits for a model whose lm_head is kept in bf16 (or is the tied
// embedding). Not the default path (the default head is FP8), so simple over fast.
#pragma once
#include "atomflow/common.h"

namespace atomflow {

// out[n] = sum_k float(w[n, k]) * float(x[k]); w bf16 [N, K] row-major, x fp16 [K] (the RMSNorm
// output), out fp32 [N].
// K % 8 == 0 and 16-byte aligned w and x (16-byte loads).
void bf16_gemv(const bf16* w, const f16* x, int N, int K, float* out, cudaStream_t stream);

}  // namespace atomflow

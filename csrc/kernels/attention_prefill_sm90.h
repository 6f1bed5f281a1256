// The warpgroup-MMA prefill attention (attention_prefill_sm90.cu, sm_90a, head_dim 128): what
// attention_prefill.cu's plan and launcher need of it.
#pragma once
#include <cstddef>
#include <cstdint>

#include "atomflow/common.h"

namespace atomflow::kernels {

int attention_prefill_wgmma_head_dim();  // the one head_dim it is built for
int attention_prefill_wgmma_rows();      // packed rows per block (grid.x = ceil(M * G / rows))
int attention_prefill_wgmma_threads();   // threads per block
size_t attention_prefill_wgmma_smem();   // dynamic shared memory per block
// Scratch bytes of the partials of `splits` blocks per tile (0 for one).
size_t attention_prefill_wgmma_scratch(int M, int H, int splits);
// q_scale: the softmax scale times log2(e). Grid (tiles, Hkv, splits); with splits > 1 the partials go to
// scratch and a merge kernel writes out.
void attention_prefill_wgmma(int tiles, int splits, const bf16* q, const bf16* k_cache, const bf16* v_cache,
                             const int32_t* pos, int M, int H, int Hkv, int max_context, float q_scale, bf16* out,
                             float* scratch, cudaStream_t stream);

}  // namespace atomflow::kernels

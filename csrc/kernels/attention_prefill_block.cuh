// What both prefill attention kernels (attention_prefill.cu, mma.sync; attention_prefill_sm90.cu, wgmma)
// share: how a block cuts its share of a chunk (blockIdx.y is the kv head, blockIdx.x a tile of kRows
// packed (query token, head) rows p = m * G + g of it, the last tile first: the longest key ranges start
// first), the zero-filling 16-byte copy of its loaders, and the packing of P.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "atomflow/common.h"
#include "atomflow/pdl.cuh"

namespace atomflow::kernels {

constexpr float kPfNegInit = -1e30f;  // finite "no key yet": exp2(kPfNegInit - kPfNegInit) = 1, never NaN

// 16 bytes global -> shared (a shared-space address), asynchronously; !valid zero-fills them instead
// (rows past the keys or the queries: an unwritten cache row never enters a sum).
__device__ __forceinline__ void pf_cp_async16(uint32_t smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(gmem), "r"(src_bytes));
}

// 2^x on the special-function unit, one MUFU.EX2 (exp2f without fast math adds the subnormal range's
// scaling around it). Flushes subnormal results to 0: a probability under 2^-126 of the row's max.
__device__ __forceinline__ float pf_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two probabilities -> bf16x2 bits (lo = the lower column), and their rounded sum (the row sum adds
// exactly what the P V product multiplies, so the weights of a row sum to 1 after the division).
__device__ __forceinline__ uint32_t pf_pack_p(float lo, float hi, float& sum) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  const float2 f = __bfloat1622float2(b);
  sum += f.x + f.y;
  return *reinterpret_cast<const uint32_t*>(&b);
}

struct PrefillBlock {
  int G;       // query heads per kv head
  int rows;    // packed rows of the kv head: M * G
  int p0;      // the block's first packed row
  int h;       // the kv head
  int pos;     // the chunk's first position (*pos, clamped so that no row past the cache is read)
  int n_keys;  // keys the block's last row sees: [0, pos + its query + 1)
};

// Waits for the previous kernel (PDL) before it reads *pos: q, *pos and the chunk's K / V rows are the
// previous kernels' output. A coherent load (pdl.cuh).
template <int kRows>
__device__ __forceinline__ PrefillBlock prefill_block(const int32_t* pos_ptr, int M, int H, int Hkv, int capacity) {
  PrefillBlock b;
  b.G = H / Hkv;
  b.rows = M * b.G;
  const int tiles = CEIL_DIV(b.rows, kRows);
  b.p0 = (tiles - 1 - static_cast<int>(blockIdx.x)) * kRows;
  b.h = blockIdx.y;
  pdl_wait();
  b.pos = min(max(__ldcg(pos_ptr), 0), capacity - M);
  b.n_keys = b.pos + (min(b.p0 + kRows, b.rows) - 1) / b.G + 1;
  return b;
}

}  // namespace atomflow::kernels

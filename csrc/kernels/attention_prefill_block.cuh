// A prefill attention block's share of a chunk, as both kernels (attention_prefill.cu, mma.sync;
// attention_prefill_sm90.cu, wgmma) cut it: blockIdx.y is the kv head, blockIdx.x a tile of kRows packed
// (query token, head) rows p = m * G + g of it, the last tile first (the longest key ranges start first).
#pragma once
#include <cstdint>

#include "atomflow/common.h"
#include "atomflow/pdl.cuh"

namespace atomflow::kernels {

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

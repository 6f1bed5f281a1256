// The streaming load: 16 bytes of data read exactly once and never written while a kernel runs
// (weights). Non-coherent path, no L1 allocation, so the L1 keeps what is reused (x, scales), and
// marked evict-first in L2 (a policy from stream_policy()), so the stream does not push out what
// is reused there (activations, the KV cache, scales; docs/design/gemv_w8a16.md). The GEMV
// streams its weights with it and stream_read measures the ceiling with
// it, so the efficiency figures compare like with like. Never use it on data an earlier kernel
// wrote (pdl.cuh).
#pragma once
#include <cstdint>

namespace atomflow {

__device__ __forceinline__ uint64_t stream_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ uint4 ld_stream16(const uint4* p, uint64_t policy) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "l"(policy));
  return v;
}

}  // namespace atomflow

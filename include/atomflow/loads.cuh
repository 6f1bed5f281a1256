// The streaming load: 16 bytes of data read exactly once and never written while a kernel runs
// (weights). Non-coherent path, no L1 allocation, so the L1 keeps what is reused (x, scales).
// The GEMV streams its weights with it and stream_read measures the ceiling with it, so the
// efficiency figures compare like with like. Never use it on data an earlier kernel wrote
// (pdl.cuh).
#pragma once
#include <cstdint>

namespace atomflow {

__device__ __forceinline__ uint4 ld_stream16(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

}  // namespace atomflow

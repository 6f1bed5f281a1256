// The 16-bit activation a producer hands to a matrix product (kernels.h): fp16 when the caller gives
// f16_overflow, which is then set to 1 for a value whose magnitude passes kF16Max (its fp16 is inf,
// and the engine reruns the step in bf16), else bf16. One flag store at most, and only then. Shared
// by attention's output and the SwiGLU epilogue, the two producers of such activations.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "atomflow/kernels.h"

namespace atomflow::kernels {

__device__ __forceinline__ uint16_t act16_bits(float v, int* f16_overflow) {
  if (f16_overflow != nullptr) {
    if (fabsf(v) > kF16Max) *f16_overflow = 1;
    return __half_as_ushort(__float2half_rn(v));
  }
  return __bfloat16_as_ushort(__float2bfloat16(v));
}

// Two values packed low first (a, b), as a 32-bit store writes them: the same bits as two
// act16_bits, converted as a pair.
__device__ __forceinline__ uint32_t act16x2_bits(float a, float b, int* f16_overflow) {
  if (f16_overflow != nullptr) {
    if (fmaxf(fabsf(a), fabsf(b)) > kF16Max) *f16_overflow = 1;
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

}  // namespace atomflow::kernels

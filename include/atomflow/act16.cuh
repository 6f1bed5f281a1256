// The 16-bit activation a producer hands to a matrix product (kernels.h): fp16 when the caller gives
// f16_overflow, which is then set to 1 for a value whose magnitude passes kF16Max (its fp16 is inf,
// and the engine reruns the step in bf16), else bf16. One flag store at most, and only then. Shared
// by attention's output and the SwiGLU epilogue, the two producers of such activations.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
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

// And the other way, bf16 activations into a product's fp16 operands (the GEMVs' x): a row is multiplied
// by the power of two 2^s that puts its largest magnitude amax in [2^14, 2^15), so every value within 2^-28
// of the largest converts exactly and none overflows; the sums are multiplied back by 2^-s (exact). s is
// clamped to [-120, 100]; 0 for amax 0, inf or NaN (no scaling).
__device__ __forceinline__ int f16_row_shift(float amax) {
  int s = 0;
  if (amax > 0.f && amax <= FLT_MAX) {
    int e;
    frexpf(amax, &e);  // amax < 2^e <= 2 amax
    s = max(-120, min(100, 15 - e));
  }
  return s;
}
// Eight bf16 values (one 16-byte piece) times up = 2^s, as eight fp16.
__device__ __forceinline__ uint4 bf16x8_to_f16(uint4 q, float up) {
  uint32_t* w = reinterpret_cast<uint32_t*>(&q);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
    const __half2 h = __floats2half2_rn(f.x * up, f.y * up);
    w[i] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return q;
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

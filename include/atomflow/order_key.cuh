// Floats as ordered integers, for argmax by integer max (sampling.cu, the head GEMV's per-block
// maxima in gemv_w8a16.cu): one definition, so both find the same token.
#pragma once
#include <cstdint>

namespace atomflow {

// Monotone map float -> uint32 (larger float, larger key), and back. -0 maps to +0's key: the
// two compare equal, so they must tie (as in numpy). NaN is not ordered (the sampler does not
// support NaN logits).
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t b = __float_as_uint(x) == 0x80000000u ? 0u : __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// Argmax as one integer max: the larger value first, then the lower index (~index).
__device__ __forceinline__ uint64_t argmax_key(float x, uint32_t index) {
  return (uint64_t{order_key(x)} << 32) | ~index;
}

}  // namespace atomflow

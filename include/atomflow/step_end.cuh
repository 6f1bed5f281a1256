// The last writes of a decode step, shared by the sampler that ends it (sampling.cu, sample_step)
// and the separate finish launch (csrc/core/step_kernels.cu, a step plan with fused_tail = false).
#pragma once
#include <cstdint>

namespace atomflow {

// One thread: the token of the step at position p into ring slot p % ring_size (mapped host
// memory) and the step's fp16 overflow flag into slot ring_size + p % ring_size (the flag then
// cleared for the next step), then the position advanced (pos[0] = p + 1, pos[1] = p + 2: the
// sampler's RNG counter).
__device__ __forceinline__ void publish_step(int32_t* ring, int ring_size, int32_t* pos, int32_t p, int32_t token,
                                             int32_t* f16_overflow) {
  // volatile: a store straight to host memory over the bus, never held in a cache line.
  *reinterpret_cast<volatile int32_t*>(ring + ring_size + p % ring_size) = *f16_overflow;
  *f16_overflow = 0;
  *reinterpret_cast<volatile int32_t*>(ring + p % ring_size) = token;
  __threadfence_system();  // the token is visible to the host before the step counts as done
  pos[0] = p + 1;
  pos[1] = p + 2;
}

}  // namespace atomflow

// Attention scratch for tests, benchmarks and bindings (the engines carve theirs from the arena):
// the merge counters zeroed as the kernels require (kernels.h), the partials poisoned (0xFF bytes,
// NaN) so a merge that read a partial it did not write cannot pass.
#pragma once
#include <cstddef>

#include "atomflow/device_buffer.h"
#include "atomflow/kernels.h"

namespace atomflow {

inline DeviceBuffer attention_scratch(size_t bytes) {
  DeviceBuffer d = DeviceBuffer::poisoned(bytes);
  kernels::attention_scratch_clear(d.get(), bytes, nullptr);
  return d;
}

}  // namespace atomflow

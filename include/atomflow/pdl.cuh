// Programmatic dependent launch (PDL, sm_90): a kernel launched through af_launch() may start
// while the kernel before it on the stream is still running, so its launch latency and its
// reads of immutable data (weights) overlap the previous kernel's tail. The contract, for every
// kernel launched this way:
//   - pdl_wait() before reading anything an earlier kernel wrote, and before writing anything
//     an earlier kernel reads (it returns once the previous grid has completed and flushed);
//   - pdl_launch_dependents() early, to let the next kernel's blocks start: as early as possible,
//     unless what they do before their wait (a GEMV's weight loads) would slow this kernel's
//     critical path (attention_decode.cu launches them after its key loop);
//   - the one exception to the first rule: when the previous kernel triggers only after its own
//     wait, every kernel before it has completed when this one starts (each waits before it
//     completes), so their data may be read before this kernel's wait. The decode QKV GEMV does so,
//     and attention reads the position and the cached K/V of earlier steps early (`early`);
//   - never read data an earlier kernel wrote through the non-coherent path (ld.global.nc,
//     __ldg, or a `const T* __restrict__` parameter, which lets the compiler pick it): .nc
//     promises the data is read-only for the kernel's lifetime, and under PDL that lifetime
//     overlaps the producer's (seen: multi-chunk prefill read stale activations). Weights,
//     scales and other immutable tensors keep __restrict__ and .nc.
// Graph capture keeps the programmatic edges. Kill switch: ATOMFLOW_NO_PDL=1. On GPUs before
// sm_90 both calls compile to nothing and launches are ordinary.
#pragma once
#include <cstdlib>
#include <utility>

#include "atomflow/common.h"

namespace atomflow {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// What most kernels do first: let the next kernel launch, then wait for the previous one.
__device__ __forceinline__ void pdl_prologue() {
  pdl_launch_dependents();
  pdl_wait();
}

// The one switch the core reads from the environment: a coarse debug switch (is a failure or a
// timing PDL's doing?), read once. Every other choice is the step plan's (step_plan.h).
inline bool pdl_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("ATOMFLOW_NO_PDL");  // any value but empty or "0" turns PDL off
    return v == nullptr || v[0] == '\0' || v[0] == '0';
  }();
  return on;
}

// kernel<<<grid, block, smem, stream>>>(args...) in thread-block clusters of `cluster` blocks (grid a
// multiple of it), with the PDL attribute when enabled; checked.
template <typename... KernelArgs, typename... Args>
void af_launch_clusters(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, dim3 cluster, size_t smem,
                        cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n].val.clusterDim.z = cluster.z;
    ++n;
  }
  if (pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  AF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute when enabled; checked.
template <typename... KernelArgs, typename... Args>
void af_launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  af_launch_clusters(kernel, grid, block, dim3(1, 1, 1), smem, stream, std::forward<Args>(args)...);
}

}  // namespace atomflow

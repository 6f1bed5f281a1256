// NVTX ranges for Nsight Systems timelines (scripts/profile.sh nsys): header-only NVTX3 from the
// CUDA toolkit. Without a tool attached each call is a load and a branch, so they stay compiled
// in. Host-side only: during graph capture they mark the capture, and a replayed graph shows as
// one cudaGraphLaunch (run eagerly, ATOMFLOW_EAGER=1, to see each layer's range per step).
#pragma once
#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define ATOMFLOW_HAVE_NVTX 1
#endif

namespace atomflow {

// A range for the lifetime of the object; `name` must outlive it (string literals, the
// engine's precomputed layer names).
class NvtxRange {
 public:
  explicit NvtxRange(const char* name) {
#ifdef ATOMFLOW_HAVE_NVTX
    nvtxRangePushA(name);
#else
    (void)name;
#endif
  }
  ~NvtxRange() {
#ifdef ATOMFLOW_HAVE_NVTX
    nvtxRangePop();
#endif
  }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace atomflow

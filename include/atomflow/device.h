// What GPU is here, whether atomflow can run on it, and what this build targets.
// None of these throw on a machine without a GPU or a driver, except device_info (no device).
#pragma once
#include <cstddef>
#include <string>

namespace atomflow {

struct Availability {
  bool ok = false;
  std::string reason;  // why not, when !ok
};

// A usable GPU of compute capability >= 8.9 (FP8) that this build has code for.
Availability cuda_available();

struct DeviceInfo {
  int index = 0;
  std::string name;
  int major = 0, minor = 0;
  size_t total_memory = 0, free_memory = 0;
  int sm_count = 0;
  size_t l2_bytes = 0;
};
DeviceInfo device_info();  // the current device; throws CudaError without one

struct BuildInfo {
  std::string cuda_arch;    // ATOMFLOW_CUDA_ARCH, e.g. "90" or "89;90"
  int runtime_version = 0;  // CUDA runtime linked in, e.g. 13000
  int driver_version = 0;   // 0 without a driver
};
BuildInfo build_info();

}  // namespace atomflow

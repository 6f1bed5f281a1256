// GPU presence and capability checks, device properties, build facts.
#include "atomflow/device.h"

#include <cctype>
#include <climits>

#include "atomflow/common.h"

#ifndef ATOMFLOW_CUDA_ARCH
#define ATOMFLOW_CUDA_ARCH "unknown"  // set by CMake; a standalone compile check has no value
#endif

namespace atomflow {

namespace {

// The lowest architecture in "89;90a" -> 89; INT_MAX when the list cannot be read.
int lowest_built_arch(const std::string& list) {
  int lowest = INT_MAX, cur = -1;
  for (size_t i = 0; i <= list.size(); ++i) {
    char c = i < list.size() ? list[i] : ';';
    if (std::isdigit(static_cast<unsigned char>(c))) {
      cur = (cur < 0 ? 0 : cur * 10) + (c - '0');
    } else if (c == ';' || c == ',' || c == ' ') {
      if (cur >= 0 && cur < lowest) lowest = cur;
      cur = -1;
    } else if (cur >= 0 && c != 'a' && c != 'f' && c != '-') {
      return INT_MAX;  // "native", "all", ...: cannot tell, do not refuse
    }
  }
  return lowest;
}

}  // namespace

Availability cuda_available() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it: this is an answer, not a failure
    return {false, std::string("no CUDA device: ") + cudaGetErrorString(err)};
  }
  if (count == 0) return {false, "no CUDA device: none found"};
  int dev = 0;
  cudaDeviceProp p{};
  if ((err = cudaGetDevice(&dev)) != cudaSuccess || (err = cudaGetDeviceProperties(&p, dev)) != cudaSuccess) {
    cudaGetLastError();
    return {false, std::string("no CUDA device: ") + cudaGetErrorString(err)};
  }
  const int cc = p.major * 10 + p.minor;
  const std::string ccs = std::to_string(p.major) + "." + std::to_string(p.minor);
  if (cc < 89)
    return {false, "GPU " + std::string(p.name) + " has compute capability " + ccs + "; atomflow needs >= 8.9 (FP8)"};
  // sm_XY code runs on X.Y and later of the same major only through PTX; below the lowest
  // built arch nothing runs at all.
  const int built = lowest_built_arch(ATOMFLOW_CUDA_ARCH);
  if (built != INT_MAX && cc < built)
    return {false, "GPU " + std::string(p.name) + " has compute capability " + ccs + " but this build targets sm_" +
                       ATOMFLOW_CUDA_ARCH + ", and atomflow supports sm_90 (H100/H200) only"};
  if ((err = cudaFree(nullptr)) != cudaSuccess) {  // creates the context: the device is usable
    cudaGetLastError();
    return {false, "GPU " + std::string(p.name) + " is not usable: " + cudaGetErrorString(err)};
  }
  return {true, ""};
}

DeviceInfo device_info() {
  DeviceInfo info;
  AF_CUDA_CHECK(cudaGetDevice(&info.index));
  cudaDeviceProp p{};
  AF_CUDA_CHECK(cudaGetDeviceProperties(&p, info.index));
  info.name = p.name;
  info.major = p.major;
  info.minor = p.minor;
  info.sm_count = p.multiProcessorCount;
  info.l2_bytes = static_cast<size_t>(p.l2CacheSize);
  AF_CUDA_CHECK(cudaMemGetInfo(&info.free_memory, &info.total_memory));
  return info;
}

BuildInfo build_info() {
  BuildInfo b;
  b.cuda_arch = ATOMFLOW_CUDA_ARCH;
  if (cudaRuntimeGetVersion(&b.runtime_version) != cudaSuccess) b.runtime_version = 0;
  if (cudaDriverGetVersion(&b.driver_version) != cudaSuccess) b.driver_version = 0;
  cudaGetLastError();
  return b;
}

}  // namespace atomflow

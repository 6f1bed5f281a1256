// Shared by every CUDA file: the one error macro, CEIL_DIV, the bf16 alias, the current device's SM count.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace atomflow {

using bf16 = __nv_bfloat16;
using f16 = __half;

// A failed CUDA call, with the call's text, file and line. Surfaces in Python as RuntimeError.
struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void cuda_fail(cudaError_t err, const char* call, const char* file, int line) {
  throw CudaError(std::string("CUDA error: ") + cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ") in " +
                  call + " at " + file + ":" + std::to_string(line));
}

[[noreturn]] inline void check_fail(const char* what, const std::string& msg, const char* file, int line) {
  throw std::invalid_argument(std::string(what) + ": " + msg + " (" + file + ":" + std::to_string(line) + ")");
}

}  // namespace atomflow

// Wrap every CUDA runtime call and follow every launch with AF_CUDA_CHECK(cudaGetLastError()).
#define AF_CUDA_CHECK(call)                                                                \
  do {                                                                                     \
    cudaError_t af_err_ = (call);                                                          \
    if (af_err_ != cudaSuccess) ::atomflow::cuda_fail(af_err_, #call, __FILE__, __LINE__); \
  } while (0)

// A launcher's assumption about its arguments; throws std::invalid_argument (Python ValueError).
#define AF_CHECK(cond, msg)                                                                 \
  do {                                                                                      \
    if (!(cond)) ::atomflow::check_fail("check failed: " #cond, (msg), __FILE__, __LINE__); \
  } while (0)

#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))

namespace atomflow {

// The SM count of the current device, read once per process (the engine runs on one GPU).
inline int current_sm_count() {
  static const int n = [] {
    int dev = 0, sms = 0;
    AF_CUDA_CHECK(cudaGetDevice(&dev));
    AF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    return sms;
  }();
  return n;
}

}  // namespace atomflow

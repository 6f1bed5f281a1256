// DeviceBuffer: one cudaMalloc'd block that frees itself. For tests, benchmarks and bindings
// only: the engine allocates once (the arena) and never uses this on its hot path.
#pragma once
#include <cstddef>
#include <utility>

#include "atomflow/common.h"

namespace atomflow {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) AF_CUDA_CHECK(cudaMalloc(&ptr_, bytes_));
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);  // no check: destructors must not throw
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }

  template <class T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

  void upload(const void* src, size_t n) {
    AF_CHECK(n <= bytes_, "upload larger than the buffer");
    if (n) AF_CUDA_CHECK(cudaMemcpy(ptr_, src, n, cudaMemcpyHostToDevice));
  }
  void download(void* dst, size_t n) const {
    AF_CHECK(n <= bytes_, "download larger than the buffer");
    if (n) AF_CUDA_CHECK(cudaMemcpy(dst, ptr_, n, cudaMemcpyDeviceToHost));
  }
  // Every byte = value; 0xFF poisons floats with NaN so unwritten outputs are caught.
  void fill(unsigned char value) {
    if (bytes_) AF_CUDA_CHECK(cudaMemset(ptr_, value, bytes_));
  }
  // A test output: every byte 0xFF (NaN as floats), so anything a kernel fails to write shows.
  static DeviceBuffer poisoned(size_t bytes) {
    DeviceBuffer d(bytes);
    d.fill(0xFF);
    return d;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace atomflow

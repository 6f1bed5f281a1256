// Engine-private tiny kernels: device state writes and the end of a decode step.
// Single-thread kernels: they touch a few bytes, and a launch in the graph costs ~1 us either way.
#include "step_kernels.h"

namespace atomflow::step {

// ---------------------------------------------------------------------------------------
// kernels

static __global__ void write_int_kernel(int32_t* dst, int32_t value) { *dst = value; }

static __global__ void write_pos_kernel(int32_t* pos, int32_t p) {
  pos[0] = p;
  pos[1] = p + 1;
}

static __global__ void write_sampling_kernel(kernels::SamplingConfig* dst, kernels::SamplingConfig cfg) {
  *dst = cfg;
}

static __global__ void advance_pos_kernel(int32_t* pos, int32_t n) {
  const int32_t p = pos[0] + n;
  pos[0] = p;
  pos[1] = p + 1;
}

static __global__ void finish_step_kernel(const int32_t* token, int32_t* pos, int32_t* ring, int ring_size) {
  const int32_t p = pos[0];
  // volatile: a store straight to host memory over the bus, never held in a cache line.
  *reinterpret_cast<volatile int32_t*>(ring + p % ring_size) = *token;
  __threadfence_system();  // the token is visible to the host before the step counts as done
  pos[0] = p + 1;
  pos[1] = p + 2;
}

// ---------------------------------------------------------------------------------------
// launchers

void write_int(int32_t* dst, int32_t value, cudaStream_t stream) {
  write_int_kernel<<<1, 1, 0, stream>>>(dst, value);
  AF_CUDA_CHECK(cudaGetLastError());
}

void write_pos(int32_t* pos, int32_t p, cudaStream_t stream) {
  write_pos_kernel<<<1, 1, 0, stream>>>(pos, p);
  AF_CUDA_CHECK(cudaGetLastError());
}

void write_sampling(kernels::SamplingConfig* dst, const kernels::SamplingConfig& cfg, cudaStream_t stream) {
  write_sampling_kernel<<<1, 1, 0, stream>>>(dst, cfg);
  AF_CUDA_CHECK(cudaGetLastError());
}

void advance_pos(int32_t* pos, int32_t n, cudaStream_t stream) {
  advance_pos_kernel<<<1, 1, 0, stream>>>(pos, n);
  AF_CUDA_CHECK(cudaGetLastError());
}

void finish_step(const int32_t* token, int32_t* pos, int32_t* ring, int ring_size, cudaStream_t stream) {
  AF_CHECK(ring_size > 0, "the token ring needs at least one slot");
  finish_step_kernel<<<1, 1, 0, stream>>>(token, pos, ring, ring_size);
  AF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace atomflow::step

// Engine-private tiny kernels: device state writes and the end of a decode step.
// Single-thread kernels: they touch a few bytes. Launched with PDL like the rest of the step, so
// their launch overlaps the kernel before them.
#include "step_kernels.h"

#include "atomflow/pdl.cuh"
#include "atomflow/step_end.cuh"

namespace atomflow::step {

// ---------------------------------------------------------------------------------------
// kernels

static __global__ void write_int_kernel(int32_t* dst, int32_t value) {
  pdl_prologue();
  *dst = value;
}

static __global__ void take_int_kernel(int32_t* src, int32_t* dst) {
  pdl_prologue();
  *reinterpret_cast<volatile int32_t*>(dst) = *src;
  *src = 0;
}

static __global__ void write_pos_kernel(int32_t* pos, int32_t p) {
  pdl_prologue();
  pos[0] = p;
  pos[1] = p + 1;
}

static __global__ void write_sampling_kernel(kernels::SamplingConfig* dst, kernels::SamplingConfig cfg) {
  pdl_prologue();
  *dst = cfg;
}

static __global__ void advance_pos_kernel(int32_t* pos, int32_t n) {
  pdl_prologue();
  const int32_t p = pos[0] + n;
  pos[0] = p;
  pos[1] = p + 1;
}

static __global__ void finish_step_kernel(const int32_t* token, int32_t* pos, int32_t* ring, int ring_size,
                                          int32_t* f16_overflow) {
  pdl_prologue();
  publish_step(ring, ring_size, pos, pos[0], *token, f16_overflow);
}

// One thread polls host memory (volatile: every read crosses the bus). No PDL: the gate must
// finish before anything behind it starts.
static __global__ void gate_kernel(const int32_t* flag, int32_t ticket, uint64_t timeout_ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    if (*reinterpret_cast<const volatile int32_t*>(flag) == ticket) return;
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < timeout_ns);
}

// ---------------------------------------------------------------------------------------
// launchers

void write_int(int32_t* dst, int32_t value, cudaStream_t stream) {
  af_launch(write_int_kernel, dim3(1), dim3(1), 0, stream, dst, value);
}

void take_int(int32_t* src, int32_t* dst, cudaStream_t stream) {
  af_launch(take_int_kernel, dim3(1), dim3(1), 0, stream, src, dst);
}

void write_pos(int32_t* pos, int32_t p, cudaStream_t stream) {
  af_launch(write_pos_kernel, dim3(1), dim3(1), 0, stream, pos, p);
}

void write_sampling(kernels::SamplingConfig* dst, const kernels::SamplingConfig& cfg, cudaStream_t stream) {
  af_launch(write_sampling_kernel, dim3(1), dim3(1), 0, stream, dst, cfg);
}

void advance_pos(int32_t* pos, int32_t n, cudaStream_t stream) {
  af_launch(advance_pos_kernel, dim3(1), dim3(1), 0, stream, pos, n);
}

void finish_step(const int32_t* token, int32_t* pos, int32_t* ring, int ring_size, int32_t* f16_overflow,
                 cudaStream_t stream) {
  AF_CHECK(ring_size > 0 && f16_overflow != nullptr, "finish_step: a ring slot and the overflow flag");
  af_launch(finish_step_kernel, dim3(1), dim3(1), 0, stream, token, pos, ring, ring_size, f16_overflow);
}

void gate(const int32_t* flag, int32_t ticket, uint64_t timeout_ns, cudaStream_t stream) {
  gate_kernel<<<1, 1, 0, stream>>>(flag, ticket, timeout_ns);
  AF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace atomflow::step

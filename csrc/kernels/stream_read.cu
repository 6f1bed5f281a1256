// The read-bandwidth ceiling: every byte read once with 16-byte streaming loads (the same load
// the GEMV uses for weights), folded into a checksum so the reads cannot be elided.
// Contract: a plain launch (no PDL); reads n_bytes of data once, writes sink[0] only.
#include "atomflow/kernels.h"
#include "atomflow/loads.cuh"

namespace atomflow::kernels {

constexpr int kStreamThreads = 256;
constexpr int kStreamUnroll = 4;  // independent 16-byte loads in flight per thread

static __global__ void __launch_bounds__(kStreamThreads)
    stream_read_kernel(const uint4* __restrict__ data, size_t n16, uint32_t* __restrict__ sink) {
  __shared__ uint32_t warp_x[kStreamThreads / 32];
  const size_t stride = static_cast<size_t>(gridDim.x) * kStreamThreads;
  const uint64_t policy = stream_policy();
  uint32_t acc = 0;
  size_t i = static_cast<size_t>(blockIdx.x) * kStreamThreads + threadIdx.x;
  for (; i + (kStreamUnroll - 1) * stride < n16; i += kStreamUnroll * stride) {
    uint4 v[kStreamUnroll];
#pragma unroll
    for (int u = 0; u < kStreamUnroll; ++u) v[u] = ld_stream16(data + i + u * stride, policy);
#pragma unroll
    for (int u = 0; u < kStreamUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n16; i += stride) {
    const uint4 v = ld_stream16(data + i, policy);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc ^= __shfl_xor_sync(0xffffffffu, acc, off);
  if (threadIdx.x % 32 == 0) warp_x[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t b = 0;
    for (int w = 0; w < kStreamThreads / 32; ++w) b ^= warp_x[w];
    atomicXor(sink, b);  // one atomic per block
  }
}

// ---- launcher ----

void stream_read(const void* data, size_t n_bytes, uint32_t* sink, cudaStream_t stream) {
  AF_CHECK(n_bytes % 16 == 0, "stream_read: n_bytes must be a multiple of 16");
  AF_CHECK(reinterpret_cast<uintptr_t>(data) % 16 == 0, "stream_read: data must be 16-byte aligned");
  if (n_bytes == 0) return;
  int device = 0, sms = 0;
  AF_CUDA_CHECK(cudaGetDevice(&device));
  AF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // Full occupancy (8 blocks x 256 threads per SM), never more blocks than there is work.
  const size_t n16 = n_bytes / 16;
  const size_t want = CEIL_DIV(n16, static_cast<size_t>(kStreamThreads));
  const int blocks = static_cast<int>(want < static_cast<size_t>(sms) * 8 ? want : static_cast<size_t>(sms) * 8);
  stream_read_kernel<<<blocks, kStreamThreads, 0, stream>>>(static_cast<const uint4*>(data), n16, sink);
  AF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace atomflow::kernels

// Which ways of touching data ahead of time leave it in L2 for a later streaming read? A standalone
// probe (docs/perf-log.md, 2026-11-21): after an L2 flush, each mode touches a 32 MB buffer, then a
// streaming kernel reads it; a read that hits L2 takes less time than a cold one.
//
//   nvcc -arch=sm_90 -O2 -o /tmp/l2_probe tools/l2_probe.cu && /tmp/l2_probe
//
// Measured on the H200: a plain read and a bulk copy into shared memory (cp.async.bulk) leave the
// data in L2; cp.async.bulk.prefetch.L2 (16 KB or 128 KB pieces) and prefetch.global.L2 do not:
// the later read costs what a cold one does.
#include <cuda_runtime.h>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#define CHECK(x)                                                   \
  do {                                                             \
    cudaError_t e = (x);                                           \
    if (e != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); \
      return 1;                                                    \
    }                                                              \
  } while (0)

// The engine's weight load: non-coherent, no L1 allocation, optionally marked evict-first in L2.
template <bool EVICT_FIRST>
__device__ __forceinline__ uint4 load16(const uint4* p) {
  uint4 v;
  if (EVICT_FIRST) {
    uint64_t policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(policy));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  }
  return v;
}

// Each warp reads 8 x 512 contiguous bytes per trip, grid-stride; the xor keeps the loads alive.
template <bool EVICT_FIRST>
__global__ void __launch_bounds__(256) stream_read(const uint4* p, size_t n16, unsigned* sink) {
  unsigned acc = 0;
  const size_t warp = (blockIdx.x * 256ull + threadIdx.x) / 32, lane = threadIdx.x % 32;
  for (size_t base = warp * 256; base < n16; base += gridDim.x * 8ull * 256) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const size_t i = base + u * 32 + lane;
      v[u] = i < n16 ? load16<EVICT_FIRST>(p + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678u) *sink = acc;
}

// One thread per piece: cp.async.bulk.prefetch.L2.
__global__ void prefetch_bulk(const char* p, size_t bytes, size_t piece) {
  const size_t i = (blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x) * piece;
  if (i >= bytes) return;
  const unsigned n = static_cast<unsigned>(piece < bytes - i ? piece : bytes - i);
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + i), "r"(n) : "memory");
}

// One prefetch.global.L2 per 128-byte line.
__global__ void prefetch_lines(const char* p, size_t bytes) {
  for (size_t i = (blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x) * 128; i < bytes;
       i += static_cast<size_t>(gridDim.x) * blockDim.x * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i) : "memory");
}

// Thread 0 of each block copies its 32 KB pieces into one shared-memory landing area (the data is
// discarded) and waits for them on an mbarrier.
__global__ void copy_to_shared(const char* p, size_t bytes) {
  extern __shared__ __align__(128) char land[];
  __shared__ __align__(8) unsigned long long bar;
  constexpr size_t kPiece = 32768;
  if (threadIdx.x != 0) return;
  const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(land));
  unsigned total = 0;
  for (size_t i = blockIdx.x * kPiece; i < bytes; i += gridDim.x * kPiece)
    total += static_cast<unsigned>(kPiece < bytes - i ? kPiece : bytes - i);
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b));
  asm volatile("fence.mbarrier_init.release.cluster;");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(total));
  for (size_t i = blockIdx.x * kPiece; i < bytes; i += gridDim.x * kPiece) {
    const unsigned n = static_cast<unsigned>(kPiece < bytes - i ? kPiece : bytes - i);
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(d),
                 "l"(p + i), "r"(n), "r"(b)
                 : "memory");
  }
  asm volatile("{ .reg .pred P; W: mbarrier.try_wait.parity.shared::cta.b64 P, [%0], 0; @!P bra W; }" ::"r"(b)
               : "memory");
}

int main() {
  constexpr size_t kFlush = 512ull << 20, kBytes = 32ull << 20;
  char *flush = nullptr, *buf = nullptr;
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&flush, kFlush));
  CHECK(cudaMalloc(&buf, kBytes));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemset(flush, 1, kFlush));
  CHECK(cudaMemset(buf, 2, kBytes));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  const char* modes[] = {"cold (after an L2 flush)",      "after a plain read",       "after bulk L2 prefetch, 128 KB",
                         "after bulk L2 prefetch, 16 KB", "after prefetch.global.L2", "after bulk copy to smem"};
  const uint4* b16 = reinterpret_cast<const uint4*>(buf);
  std::printf("32 MB streaming read (ld.global.nc), median of 9, us\n%-34s %10s %12s\n", "", "plain", "evict-first");
  for (int mode = 0; mode < 6; ++mode) {
    float med[2];
    for (int ef = 0; ef < 2; ++ef) {
      std::vector<float> us;
      for (int rep = 0; rep < 9; ++rep) {
        stream_read<false><<<sms * 2, 256>>>(reinterpret_cast<const uint4*>(flush), kFlush / 16, sink);
        if (mode == 1) stream_read<false><<<sms * 2, 256>>>(b16, kBytes / 16, sink);
        if (mode == 2) prefetch_bulk<<<1, 256>>>(buf, kBytes, 128 << 10);
        if (mode == 3) prefetch_bulk<<<8, 256>>>(buf, kBytes, 16 << 10);
        if (mode == 4) prefetch_lines<<<sms * 4, 256>>>(buf, kBytes);
        if (mode == 5) copy_to_shared<<<sms * 2, 32, 32768>>>(buf, kBytes);
        CHECK(cudaDeviceSynchronize());
        usleep(200);  // time for prefetches still in flight after their kernel ended
        CHECK(cudaEventRecord(t0));
        if (ef)
          stream_read<true><<<sms * 2, 256>>>(b16, kBytes / 16, sink);
        else
          stream_read<false><<<sms * 2, 256>>>(b16, kBytes / 16, sink);
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        float ms = 0.f;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        us.push_back(ms * 1000.f);
      }
      std::sort(us.begin(), us.end());
      med[ef] = us[us.size() / 2];
    }
    std::printf("%-34s %10.2f %12.2f\n", modes[mode], med[0], med[1]);
  }
  CHECK(cudaGetLastError());
  return 0;
}

// Kernel timing for the micro-benchmarks (the ops harness and the sandbox): CUDA events around
// batches of back-to-back launches, median over the batches.
#pragma once
#include <algorithm>
#include <functional>
#include <vector>

#include "atomflow/common.h"

namespace atomflow {

constexpr int kTimingBatch = 10;

// Median over iters samples of the mean time (us) of kTimingBatch back-to-back launches, after
// warmup launches. Back-to-back launches hide the launch latency, as a CUDA graph replay does;
// launch(i) gets a running index so callers can rotate through copies of their data (so that
// the L2 cannot serve what a real step would read from memory).
inline double median_us(const std::function<void(int)>& launch, int iters, int warmup) {
  AF_CHECK(iters >= 1, "iters must be >= 1");
  cudaEvent_t start, stop;
  AF_CUDA_CHECK(cudaEventCreate(&start));
  AF_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms(static_cast<size_t>(iters));
  int n = 0;
  for (; n < warmup; ++n) launch(n);
  for (int i = 0; i < iters; ++i) {
    AF_CUDA_CHECK(cudaEventRecord(start));
    for (int b = 0; b < kTimingBatch; ++b) launch(n++);
    AF_CUDA_CHECK(cudaEventRecord(stop));
    AF_CUDA_CHECK(cudaEventSynchronize(stop));
    AF_CUDA_CHECK(cudaEventElapsedTime(&ms[static_cast<size_t>(i)], start, stop));
  }
  AF_CUDA_CHECK(cudaEventDestroy(start));
  AF_CUDA_CHECK(cudaEventDestroy(stop));
  std::nth_element(ms.begin(), ms.begin() + iters / 2, ms.end());
  return 1000.0 * ms[static_cast<size_t>(iters / 2)] / kTimingBatch;
}

}  // namespace atomflow

// The W8A16 GEMV's two scheduling variants beside the plain stride over row pairs, each chosen by
// the plan (gemv_w8a16_plan.cpp) and each giving the same bits as the plain schedule:
//  - StagedPair: a QKV warp's second row pair copied into shared memory by cp.async while the warp
//    sums its first, so both round trips overlap (products of one-iteration rows, 1-2 pairs per warp).
//  - Tickets: the gate/up product's row pairs past the first round handed out by atomic counters, so
//    a warp whose loads come back sooner takes more of them.
// Included by gemv_w8a16.cu only, after gemv_w8a16_body.cuh. Measurements: docs/design/gemv_w8a16.md.
#pragma once
#include "gemv_w8a16_body.cuh"

namespace atomflow::kernels {

// cp.async for weights: evict-first in L2 like ld_stream16 (loads.cuh), and 4-byte copies for scales.
static __device__ __forceinline__ void cp_async16_stream(void* smem, const void* gmem, uint64_t policy) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "l"(policy)
               : "memory");
}
static __device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(gmem) : "memory");
}

// A warp's second row pair, copied into shared memory by cp.async while the warp still works on its
// first (products of one-iteration rows with at most two pairs per warp). Lane l's chunks sit at
// [u][l] of each row, so a lane reads back exactly what it copied: no barrier, only the lane's own
// cp.async.wait_all. The copies do not share the weight loads' scoreboard (gemv_w8a16_body.cuh), so
// the first pair's math does not wait for them.
struct StagedPair {
  uint4 wa[kGemvUnroll][32], wb[kGemvUnroll][32];
  float sa[32], sb[32];
};

static __device__ __forceinline__ void copy_pair(StagedPair& sp, const Product& P, int r0, int r1, uint64_t policy) {
  const int C = P.K / 16, G = P.K / kQuantGroup, lane = threadIdx.x % 32;
  const uint4* a = reinterpret_cast<const uint4*>(P.w + static_cast<size_t>(r0) * P.K) + lane;
  const uint4* b = reinterpret_cast<const uint4*>(P.w + static_cast<size_t>(r1) * P.K) + lane;
  const Steps<true> steps(lane, C);
#pragma unroll
  for (int u = 0; u < kGemvUnroll; ++u) {
    if (steps.active(u)) {
      cp_async16_stream(&sp.wa[u][lane], a + 32 * u, policy);
      cp_async16_stream(&sp.wb[u][lane], b + 32 * u, policy);
    }
  }
  if (lane < G) {
    cp_async4(&sp.sa[lane], P.scales + static_cast<size_t>(r0) * G + lane);
    cp_async4(&sp.sb[lane], P.scales + static_cast<size_t>(r1) * G + lane);
  }
}

static __device__ __forceinline__ void read_pair(Iter& it, const StagedPair& sp, int C) {
  const int lane = threadIdx.x % 32;
  const Steps<true> steps(lane, C);
#pragma unroll
  for (int u = 0; u < kGemvUnroll; ++u) {
    if (steps.active(u)) {
      it.wa[u] = sp.wa[u][lane];
      it.wb[u] = sp.wb[u][lane];
    }
  }
  it.sa = sp.sa[lane];
  it.sb = sp.sb[lane];
}
static_assert(sizeof(StagedPair) == kStagedPairBytes, "the plan sizes the staged pairs");

// Tickets: the gate/up product's row pairs past the first round are handed out by atomic counters
// instead of by a fixed stride. Pairs stride + j + 64 t are counted out by counter j (kTicketClasses),
// which the warps whose first pair is j mod 64 share: atomics on one address serialize. Each warp of
// class j grabs until a ticket comes back empty, so the grabs on counter j are its pairs plus its
// warps, and the warp that takes the last value sets the counter back to 0 for the next launch.
// Every grab follows the PDL wait, so two launches never count on the same counters at once if they
// share a stream.
static_assert(kGemvTicketBytes == kTicketClasses * kTicketStride * sizeof(unsigned), "one counter per 128-byte line");

}  // namespace atomflow::kernels

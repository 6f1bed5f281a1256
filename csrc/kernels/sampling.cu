// One token from fp32 logits on the device: one thread-block cluster of 8 blocks x 1024 threads,
// block r owning the contiguous slice [r * chunk, (r + 1) * chunk) of the vocabulary; blocks
// combine their results through distributed shared memory (no global scratch, no host sync).
//
// Semantics: those of atomflow/sampling.py sample_numpy (the CPU reference), exactly:
//  - temperature <= 0 (or NaN): argmax of the logits, the lowest index on ties.
//  - otherwise z = logits / T; w_i = exp(z_i - max z). The allowed set is {x_i >= tau}:
//      top_k (0 < k < vocab): tau = the k-th largest logit (ties with it are kept);
//      top_p (< 1): then tau = the largest logit value whose set {x >= value} (within the top-k set)
//      holds mass >= top_p * (mass of the top-k set), i.e. the fewest most probable tokens whose
//      mass reaches top_p, ties with the last one kept. (top_p <= 0 behaves like a tiny top_p.)
//  - the draw: u = Philox4x64-10, key (seed, 0), counter (*pos + 1, 0, 0, 0), first output word
//    >> 11 times 2^-53; the token is the smallest allowed i with sum_{allowed j <= i} w_j > u * sum w.
// Numerics: w_i = expf((x_i - max) / T) in fp32, then fixed point w * 2^40 in uint64, so every sum
// (top-p mass, the CDF) is exact and order-independent: results are deterministic and the
// threshold searches and the CDF agree with each other to the last bit. Tokens with w < 2^-41 have
// zero weight (they would be drawn with probability < 2^-41), -Inf logits too (masked tokens).
// Logits holding a NaN or +Inf, or nothing but -Inf, give -1 (their keys sit at the ends of the
// order: the largest key's value is not finite, or the smallest one's is a NaN); the greedy draw
// from the head's block maxima sees only the largest key.
//
// Cost: greedy = one read of the logits spread over 8 SMs plus one cluster reduction, or, given
// the head GEMV's per-block maxima (sample_step), one block reducing those (a few hundred). Sampling
// caches the slice in shared memory (key + weight, 8 B per token); top-k / top-p each run an
// 8-ary search over the 32-bit order-preserving key space (<= 11 rounds of one cluster reduction).
//
// Contract of sample_kernel, one cluster of 8 blocks x 1024 threads:
//  Inputs   logits fp32 [vocab] (or, greedy with the FP8 head, block_best [n_best]), the settings
//           *cfg and the position in device memory.
//  Before its PDL wait, ending a decode step (sample_step) only: *cfg and pos[0], which no kernel of
//           the step writes (see kernels.h, sample_step). It triggers its dependents first.
//  Writes   the token (*token_out; -1 when none was drawn); ending a step also the ring slot (token
//           and overflow flag, fenced stores to mapped host memory), pos[0..1] + 1, the next step's
//           embedding row x (token 0's for -1: a valid input, so a step enqueued after it still runs
//           its fp16 overflow check; the host drops or reruns it), and clears the overflow flag. No
//           scratch in global memory.
#include <cooperative_groups.h>

#include "atomflow/kernels.h"
#include "atomflow/order_key.cuh"
#include "atomflow/pdl.cuh"
#include "atomflow/step_end.cuh"

namespace cg = cooperative_groups;

namespace atomflow::kernels {

constexpr int kSampleBlocks = 8;  // the cluster: portable maximum size
constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;
constexpr int kProbes = 7;                     // thresholds per search round: an 8-ary search
constexpr float kFixedOne = 1099511627776.0f;  // 2^40: weights in (0, 1] -> fixed point

struct SampleShared {
  uint64_t warp_part[kSampleWarps][kProbes];
  uint64_t slot[2][kProbes];  // this block's contribution to a cluster reduction (double-buffered)
  uint64_t result[kProbes];
  uint64_t warp_mass[kSampleWarps];
  int32_t token;  // block 0: the drawn token, written by the block that drew it (StepEnd)
};

struct OpMax {
  __device__ uint64_t operator()(uint64_t a, uint64_t b) const { return a > b ? a : b; }
};
struct OpSum {
  __device__ uint64_t operator()(uint64_t a, uint64_t b) const { return a + b; }
};

static __device__ __forceinline__ uint64_t fixed_weight(float w) { return __float2ull_rn(w * kFixedOne); }

template <class Op>
static __device__ __forceinline__ uint64_t warp_reduce(uint64_t v, Op op) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Block-wide reduction of N values per thread: warp 0's lane 0 writes the block's results to dst
// (shared memory); the caller synchronizes before anyone reads them.
template <int N, class Op>
static __device__ void block_reduce(uint64_t (&v)[N], Op op, SampleShared& sh, uint64_t* dst) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = warp_reduce(v[i], op);
  if (lane == 0)
#pragma unroll
    for (int i = 0; i < N; ++i) sh.warp_part[warp][i] = v[i];
  __syncthreads();
  if (warp == 0)
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const uint64_t x = warp_reduce(sh.warp_part[lane][i], op);
      if (lane == 0) dst[i] = x;
    }
}

// Cluster-wide reduction of N values per thread (identity 0 for both ops); every thread of every
// block gets the same result. Slots alternate between rounds, so one cluster barrier per round
// suffices: a block rewrites slot b only two rounds later, after every reader has passed the
// barrier of the round in between.
template <int N, class Op>
static __device__ void cluster_allreduce(uint64_t (&v)[N], Op op, SampleShared& sh, int& round) {
  cg::cluster_group cluster = cg::this_cluster();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int b = round++ & 1;
  block_reduce(v, op, sh, sh.slot[b]);
  cluster.sync();
  if (warp == 0) {
    const uint64_t* remote = cluster.map_shared_rank(&sh.slot[b][0], lane % kSampleBlocks);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const uint64_t x = warp_reduce(lane < kSampleBlocks ? remote[i] : uint64_t{0}, op);
      if (lane == 0) sh.result[i] = x;
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = sh.result[i];
}

// The largest t in [lo, hi) with f(t) >= target, where f(t) = sum over cached tokens with key >= t
// of (use_mass ? fixed weight : 1); f(lo) >= target and f(hi) = f_hi < target are given. Tokens
// outside [lo, hi) are skipped: those above are already in f_hi.
static __device__ uint32_t search_threshold(uint64_t lo, uint64_t hi, uint64_t f_hi, uint64_t target, bool use_mass,
                                            const uint32_t* s_key, const float* s_w, int n_local, SampleShared& sh,
                                            int& round) {
  while (hi - lo > 1) {
    const uint64_t step = (hi - lo + kProbes) / (kProbes + 1);
    uint64_t t[kProbes], f[kProbes];
#pragma unroll
    for (int j = 0; j < kProbes; ++j) {
      t[j] = lo + (j + 1) * step;
      f[j] = 0;
    }
    for (int i = threadIdx.x; i < n_local; i += kSampleThreads) {
      const uint32_t u = s_key[i];
      if (u < lo || u >= hi) continue;
      const uint64_t q = use_mass ? fixed_weight(s_w[i]) : 1;
#pragma unroll
      for (int j = 0; j < kProbes; ++j)
        if (u >= t[j]) f[j] += q;
    }
    cluster_allreduce(f, OpSum{}, sh, round);
    uint64_t new_lo = lo, new_hi = hi, new_f_hi = f_hi;
#pragma unroll
    for (int j = 0; j < kProbes; ++j) {
      if (t[j] >= hi) break;
      if (f[j] + f_hi >= target) {
        new_lo = t[j];
      } else {
        new_hi = t[j];
        new_f_hi = f[j] + f_hi;
        break;  // f is non-increasing in t
      }
    }
    lo = new_lo;
    hi = new_hi;
    f_hi = new_f_hi;
  }
  return static_cast<uint32_t>(lo);
}

// Philox4x64-10 with key (seed, 0) on counter (ctr, 0, 0, 0): the first 64-bit output word.
static __device__ uint64_t philox4x64_word0(uint64_t seed, uint64_t ctr) {
  uint64_t c0 = ctr, c1 = 0, c2 = 0, c3 = 0, k0 = seed, k1 = 0;
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += 0x9E3779B97F4A7C15ull;
      k1 += 0xBB67AE8584CAA73Bull;
    }
    const uint64_t m0 = 0xD2E7470EE14C6C93ull, m1 = 0xCA5A826395121157ull;
    const uint64_t hi0 = __umul64hi(m0, c0), lo0 = m0 * c0;
    const uint64_t hi1 = __umul64hi(m1, c2), lo1 = m1 * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  return c0;
}

// The end of a decode step (StepEnd), run by every block once the token is known to all of them:
// block `part` of `parts` writes its slice of the next step's input row (warps 1..); block 0's
// thread 0 writes the token ring and advances the position p = pos[0], beside it.
// A token of -1 (no draw) is published as it is; the next input row is then token 0's.
static __device__ void end_step(const StepEnd& end, int32_t token, int32_t p, int part, int parts) {
  if (threadIdx.x < 32) {
    if (part == 0 && threadIdx.x == 0) publish_step(end.ring, end.ring_size, end.pos, p, token, end.f16_overflow);
    return;
  }
  const int per = CEIL_DIV(end.d, parts);
  const int lo = part * per, hi = min(end.d, lo + per);
  const bf16* row = end.embed + static_cast<size_t>(max(token, 0)) * end.d;
  for (int i = lo + threadIdx.x - 32; i < hi; i += kSampleThreads - 32) end.x[i] = __bfloat162float(row[i]);
}

static __global__ void __cluster_dims__(kSampleBlocks, 1, 1) __launch_bounds__(kSampleThreads, 1)
    sample_kernel(const float* logits, int vocab, const uint64_t* block_best, int n_best, const SamplingConfig* cfg_ptr,
                  const int32_t* pos_ptr, int32_t* __restrict__ token_out, const StepEnd end) {
  extern __shared__ uint32_t cache[];  // sampling only: keys [chunk], then weights (float) [chunk]
  __shared__ SampleShared sh;
  // Ending a decode step, the settings and the position are read before the wait: no kernel of
  // the step writes them, and every earlier one has completed (StepEnd, kernels.h).
  const bool ends = end.pos != nullptr;
  SamplingConfig cfg;
  int32_t pos = 0;
  pdl_launch_dependents();
  if (ends) {
    cfg = *cfg_ptr;
    pos = end.pos[0];
  }
  pdl_wait();
  if (!ends) cfg = *cfg_ptr;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int chunk = CEIL_DIV(vocab, kSampleBlocks);
  const int begin = rank * chunk;
  const int n_local = max(0, min(chunk, vocab - begin));
  int round = 0;
  if (tid == 0) sh.token = -1;  // block 0's stays -1 unless a token is drawn (the cluster syncs first)

  // Greedy from the head's per-block maxima (gemv_w8a16_rmsnorm_argmax): block 0 alone reduces
  // them; the others have nothing to do (no block touches another's shared memory on this path).
  if (n_best > 0 && !(cfg.temperature > 0.f)) {
    if (rank != 0) return;
    uint64_t v[1] = {0};
    for (int i = tid; i < n_best; i += kSampleThreads) v[0] = max(v[0], block_best[i]);
    block_reduce(v, OpMax{}, sh, sh.result);
    __syncthreads();
    const bool finite = isfinite(key_value(static_cast<uint32_t>(sh.result[0] >> 32)));
    const int32_t token = finite ? static_cast<int32_t>(~static_cast<uint32_t>(sh.result[0])) : -1;
    if (tid == 0) *token_out = token;
    if (ends) end_step(end, token, pos, 0, 1);
    return;
  }

  // Argmax as one max over (key << 32 | ~index): larger logit first, then the lower index.
  // The second value is the complement of the smallest key (max of complements = min).
  uint64_t v[2] = {0, 0};
#pragma unroll 4
  for (int i = tid; i < n_local; i += kSampleThreads) {
    const float x = logits[begin + i];
    v[0] = max(v[0], argmax_key(x, static_cast<uint32_t>(begin + i)));
    v[1] = max(v[1], uint64_t{~order_key(x)});
  }
  cluster_allreduce(v, OpMax{}, sh, round);
  const uint32_t key_max = static_cast<uint32_t>(v[0] >> 32);
  const uint32_t key_min = ~static_cast<uint32_t>(v[1]);
  // The same in every block: no NaN, no +Inf, not all -Inf.
  const bool finite = isfinite(key_value(key_max)) && !isnan(key_value(key_min));

  if (!(cfg.temperature > 0.f) || !finite) {
    const int32_t token = finite ? static_cast<int32_t>(~static_cast<uint32_t>(v[0])) : -1;  // every block has it
    if (rank == 0 && tid == 0) *token_out = token;
    if (ends) end_step(end, token, pos, rank, kSampleBlocks);
    cluster.sync();  // no block leaves while another may still read its shared memory
    return;
  }

  // Cache the slice: order keys and weights w = exp((x - max) / T) in (0, 1].
  uint32_t* s_key = cache;
  float* s_w = reinterpret_cast<float*>(cache + chunk);
  const float x_max = key_value(key_max);
  for (int i = tid; i < n_local; i += kSampleThreads) {
    const float x = logits[begin + i];
    s_key[i] = order_key(x);
    s_w[i] = expf((x - x_max) / cfg.temperature);
  }
  __syncthreads();

  uint32_t tau = key_min;  // allowed: key >= tau
  if (cfg.top_k > 0 && cfg.top_k < vocab)
    tau = search_threshold(key_min, uint64_t{key_max} + 1, 0, static_cast<uint64_t>(cfg.top_k), false, s_key, s_w,
                           n_local, sh, round);
  if (cfg.top_p < 1.f) {
    uint64_t z[1] = {0};  // mass of the top-k set
    for (int i = tid; i < n_local; i += kSampleThreads)
      if (s_key[i] >= tau) z[0] += fixed_weight(s_w[i]);
    cluster_allreduce(z, OpSum{}, sh, round);
    // mass >= top_p * Z  <=>  mass >= ceil(top_p * Z) for integer masses; at least 1 (the max).
    const double want = ceil(static_cast<double>(cfg.top_p) * static_cast<double>(z[0]));
    const uint64_t target = want < 1.0 ? 1 : (want > static_cast<double>(z[0]) ? z[0] : static_cast<uint64_t>(want));
    tau = search_threshold(tau, uint64_t{key_max} + 1, 0, target, true, s_key, s_w, n_local, sh, round);
  }

  // The draw: inverse CDF in token order. Each warp owns a contiguous segment of the block slice.
  const int seg = CEIL_DIV(n_local, kSampleThreads) * 32;
  const int ws = warp * seg, we = min(ws + seg, n_local);
  uint64_t mass = 0;
  for (int i = ws + lane; i < we; i += 32)
    if (s_key[i] >= tau) mass += fixed_weight(s_w[i]);
  mass = warp_reduce(mass, OpSum{});
  if (lane == 0) sh.warp_mass[warp] = mass;
  __syncthreads();
  // Every block learns every block's mass (one slot each), hence the prefix and the total.
  const int b = round++ & 1;
  if (tid == 0) {
    uint64_t block_mass = 0;
    for (int w = 0; w < kSampleWarps; ++w) block_mass += sh.warp_mass[w];
    sh.slot[b][0] = block_mass;
  }
  cluster.sync();
  if (tid == 0) {
    uint64_t before = 0, total = 0;
    for (int r = 0; r < kSampleBlocks; ++r) {
      const uint64_t m = *cluster.map_shared_rank(&sh.slot[b][0], r);
      if (r < rank) before += m;
      total += m;
    }
    // target = floor(u * total), u = (word >> 11) * 2^-53: exact in 128-bit arithmetic.
    const uint64_t word = philox4x64_word0(cfg.seed, static_cast<uint64_t>(*pos_ptr) + 1);
    const uint64_t target = __umul64hi(total, word & ~uint64_t{0x7FF});
    sh.result[0] = before;
    sh.result[1] = target;
  }
  __syncthreads();
  const uint64_t before = sh.result[0], target = sh.result[1];
  // The token is in this block iff before <= target < before + block mass (exactly one block).
  uint64_t prefix = before;
  int owner = -1;
  for (int w = 0; w < kSampleWarps; ++w) {
    if (target < prefix + sh.warp_mass[w]) {
      owner = w;
      break;
    }
    prefix += sh.warp_mass[w];
  }
  if (target >= before && owner == warp) {
    // Walk the warp's segment 32 tokens at a time with an inclusive scan of the weights.
    for (int i0 = ws; i0 < we; i0 += 32) {
      const int i = i0 + lane;
      uint64_t incl = (i < we && s_key[i] >= tau) ? fixed_weight(s_w[i]) : 0;
#pragma unroll
      for (int off = 1; off < 32; off *= 2) {
        const uint64_t o = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += o;
      }
      const unsigned hit = __ballot_sync(0xffffffffu, prefix + incl > target);
      if (hit) {
        if (lane == __ffs(hit) - 1) *cluster.map_shared_rank(&sh.token, 0) = begin + i;  // block 0 hands it out
        break;
      }
      prefix += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
  cluster.sync();  // no block leaves while another may still read its shared memory
  if (!ends) {
    if (rank == 0 && tid == 0) *token_out = sh.token;
    return;
  }
  const int32_t token = *cluster.map_shared_rank(&sh.token, 0);
  if (rank == 0 && tid == 0) *token_out = token;
  end_step(end, token, pos, rank, kSampleBlocks);
  cluster.sync();  // block 0's shared memory stays until every block has read the token
}

// ---- launcher ----

size_t sampling_scratch_bytes(int vocab) {
  AF_CHECK(vocab >= 1, "sampling_scratch_bytes: vocab must be >= 1");
  return 0;  // the cluster exchanges everything through distributed shared memory
}

static void launch_sample(const float* logits, int vocab, const uint64_t* block_best, int n_best,
                          const SamplingConfig* cfg, const int32_t* pos, int32_t* token_out, const StepEnd& end,
                          cudaStream_t stream) {
  AF_CHECK(vocab >= 1, "sample: vocab must be >= 1");
  int device = 0, smem_optin = 0;
  AF_CUDA_CHECK(cudaGetDevice(&device));
  AF_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const size_t smem = static_cast<size_t>(CEIL_DIV(vocab, kSampleBlocks)) * 8;
  AF_CHECK(smem + sizeof(SampleShared) <= static_cast<size_t>(smem_optin),
           "sample: vocab too large (the 8-block cluster caches 8 bytes per token in shared memory)");
  // The slice cache may exceed 48 KB: raise the kernel's dynamic limit to what this vocab needs
  // (a host-side attribute, legal during graph capture). Only ever raised, so one setting serves
  // every smaller vocab too.
  static size_t configured = 0;
  if (smem > configured) {
    cudaFuncAttributes attr{};
    AF_CUDA_CHECK(cudaFuncGetAttributes(&attr, sample_kernel));
    AF_CHECK(smem + attr.sharedSizeBytes <= static_cast<size_t>(smem_optin),
             "sample: vocab too large (the 8-block cluster caches 8 bytes per token in shared memory)");
    AF_CUDA_CHECK(
        cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    configured = smem;
  }
  af_launch(sample_kernel, dim3(kSampleBlocks), dim3(kSampleThreads), smem, stream, logits, vocab, block_best, n_best,
            cfg, pos, token_out, end);
}

void sample(const float* logits, int vocab, const SamplingConfig* cfg, const int32_t* pos, void* scratch,
            int32_t* token_out, cudaStream_t stream) {
  (void)scratch;  // sampling_scratch_bytes() == 0
  launch_sample(logits, vocab, nullptr, 0, cfg, pos, token_out, StepEnd{}, stream);
}

void sample_step(const float* logits, int vocab, const uint64_t* block_best, int n_best, const SamplingConfig* cfg,
                 int32_t* token_out, const StepEnd& end, cudaStream_t stream) {
  AF_CHECK(n_best >= 0 && (n_best == 0 || block_best != nullptr), "sample_step: n_best must be >= 0, with block_best");
  AF_CHECK(end.pos && end.ring && end.ring_size > 0 && end.embed && end.d >= 1 && end.x,
           "sample_step: the step's end needs pos, a ring of >= 1 slot, the embedding table, d >= 1 and x");
  // pos[1] = pos[0] + 1 is the RNG counter, as sample() is given it.
  launch_sample(logits, vocab, block_best, n_best, cfg, end.pos + 1, token_out, end, stream);
}

// ---------------------------------------------------------------------------------------
// argmax_rows: one block per row, the row read once with coalesced loads; argmax_key (order_key.cuh)
// makes the choice the greedy sampler's (the larger value, then the lower index), and -1 where the
// sampler gives it: a NaN (either sign) or +Inf in the row, or every value -Inf (-Inf alone is a
// masked token).

static constexpr int kArgmaxThreads = 512;

static __global__ void __launch_bounds__(kArgmaxThreads)
    argmax_rows_kernel(const float* __restrict__ logits, int vocab, int32_t* __restrict__ out) {
  const float* row = logits + static_cast<size_t>(blockIdx.x) * vocab;
  uint64_t best = 0;
  bool bad = false, any = false;  // a NaN or +Inf; a value above -Inf
  for (int i = threadIdx.x; i < vocab; i += kArgmaxThreads) {
    const float v = row[i];
    bad = bad || isnan(v) || v == INFINITY;
    any = any || v != -INFINITY;
    best = max(best, argmax_key(v, static_cast<uint32_t>(i)));
  }
  for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
  bad = __any_sync(0xffffffffu, bad);
  any = __any_sync(0xffffffffu, any);
  __shared__ uint64_t warp_best[kArgmaxThreads / 32];
  __shared__ int warp_flags[kArgmaxThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_best[warp] = best;
    warp_flags[warp] = (bad ? 1 : 0) | (any ? 2 : 0);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int flags = warp_flags[0];
    for (int w = 1; w < kArgmaxThreads / 32; ++w) {
      best = max(best, warp_best[w]);
      flags |= warp_flags[w];
    }
    out[blockIdx.x] = flags == 2 ? static_cast<int32_t>(~static_cast<uint32_t>(best)) : -1;
  }
}

void argmax_rows(const float* logits, int rows, int vocab, int32_t* out, cudaStream_t stream) {
  AF_CHECK(rows >= 1 && vocab >= 1 && logits && out, "argmax_rows: needs rows >= 1, vocab >= 1, logits and out");
  argmax_rows_kernel<<<rows, kArgmaxThreads, 0, stream>>>(logits, vocab, out);
  AF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace atomflow::kernels

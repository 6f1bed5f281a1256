// W8A16 GEMV for M = 1 decode: y[n] = sum_k x[k] * fp8[n, k] * scale[n, k / 128], fp32 accumulation,
// with a Store / AddResidual / SwiGLU / RopeKV epilogue and, optionally, RMSNorm fused into the
// prologue. The hot kernel: ~95% of the bytes of a decode step. This file: the kernel, its contract
// and its launchers; the per-warp building blocks are in gemv_w8a16_body.cuh, the staged-pair and
// ticket variants in gemv_w8a16_variants.cuh, the launch decisions in gemv_w8a16_plan.cpp, and the
// measurements behind all of them in docs/design/gemv_w8a16.md.
//
// Contract of gemv_w8a16_kernel<EP, IN, WHOLE, TAIL, BIAS>(P, eps, rope), grid plan.blocks x 256
// threads:
//  Inputs   W fp8 e4m3 [N, K] row-major (one row = K contiguous bytes, 16-byte aligned), scales fp32
//           [N, ceil(K / 128)]; x per IN: bf16 or fp16 [K] (16-byte aligned), or for NORM the fp32
//           residual stream [K] and the bf16 norm weight [K] (x_n = f16(x * rsqrt(mean(x^2) + eps)
//           * norm_w), rmsnorm.cu's arithmetic and reduction tree: bit-identical to the two kernels).
//           K % 64 == 0. WHOLE: K % 512 == 0. TAIL: K % 128 == 64, the last scale group of a row
//           64 columns wide (ceil(K / 128) scales per row; never WHOLE). Every other K, a multiple of
//           128, takes the instances without TAIL, whose machine code does not depend on it.
//           BIAS (RopeKV only, plan.bias): rope.bias fp32 [N] added to each sum before RoPE; the
//           instances without it never read rope.bias and compile as if it did not exist.
//  Work     A warp owns a PAIR of rows (SwiGLU: gate row p and up row F + p; RopeKV: rows i and
//           i + D/2 of a q or k head, then consecutive v rows; otherwise 2p and 2p + 1) and streams
//           both across K, lane l reading 16 bytes of each row at chunk l + 32 u (u < 8) per
//           iteration. Row pair p goes to block p mod grid, warp p / grid of it, then + 8 x grid per
//           round (persistent-style: x is staged once per block). The plan may hand the QKV warps'
//           second pairs to shared memory early (staged_warps) and SwiGLU's later rounds out by
//           ticket (ticketed); a row's sums never depend on which warp took it.
//  Before its PDL wait (pdl.cuh) it reads only immutable data: plan.pre_warps warps per block load
//           their first iteration's weights and scales into registers, and NORM blocks start copying
//           the norm weight into shared memory. RopeKV triggers its dependents only after its wait,
//           so the attention after it may read older cache rows early (attention_decode.cu); the
//           other epilogues trigger before it.
//  After the wait it reads x (and for AddResidual the residual it adds to, for RopeKV *pos and with
//           BIAS the first pair's biases) right away, beside x's staging, and takes SwiGLU's first
//           ticket.
//  Writes   Store: out fp32 [N] (and with P.best each block's argmax key of the rows it wrote);
//           AddResidual: out[n] += y[n]; SwiGLU: out [N / 2] bf16, or fp16 given f16_overflow (set
//           to 1 when a value passes kF16Max); RopeKV: q_out [H, D] bf16 and the K / V cache rows at
//           *pos (nothing when *pos >= max_context). Every output element is written exactly once.
//  Leaves   the ticket counters at zero (each launch resets what it used), nothing else behind.
//  Invariants  x enters the tensor-core products as fp16 (bf16 x scaled into fp16's range by a
//           power of two first and the sums scaled back: exact in practice); a 16-byte chunk never
//           straddles a 128-column scale group, and the chunks past a row's end fill whole groups of
//           4 lanes (K % 64 == 0), whose sums are dropped; blocks of 256 threads, at most 2 per SM.
#include <algorithm>
#include <mutex>
#include <vector>

#include "atomflow/pdl.cuh"
#include "gemv_w8a16_body.cuh"
#include "gemv_w8a16_plan.h"
#include "gemv_w8a16_variants.cuh"

namespace atomflow::kernels {

#ifdef ATOMFLOW_TRACE
static __device__ trace::Buf g_trace;  // set by gemv_trace_arm (trace.cuh)
#endif

template <Ep EP, In IN, bool WHOLE, bool TAIL, bool BIAS>
static __global__ void __launch_bounds__(kGemvThreads, 2)
    gemv_w8a16_kernel(const Product P, float eps, const RopeKVArgs rope) {
  static_assert(!(WHOLE && TAIL), "a row of whole 512-column steps has no tail group");
  static_assert(!BIAS || EP == Ep::RopeKV, "a bias is the QKV product's only");
  extern __shared__ uint4 smem[];  // Staging
  __shared__ float red[kGemvWarps];
  const Staging st(smem, P.K);
#ifdef ATOMFLOW_TRACE
  __shared__ uint64_t tr_t[kGemvWarps][trace::kStamps];
  WarpTrace tr{tr_t[threadIdx.x / 32], 0};
  if (threadIdx.x % 32 < trace::kStamps) tr.t[threadIdx.x % 32] = 0;
  __syncwarp();
#else
  WarpTrace tr{nullptr, 0};
#endif
  tr.stamp(trace::kEntry);

  const RowPairs<EP> pairs(P.N, rope);
  const int n_pairs = pairs.count();
  const int lane = threadIdx.x % 32, stride = gridDim.x * kGemvWarps;
  const uint64_t policy = stream_policy();
  const int p0 = blockIdx.x + gridDim.x * (threadIdx.x / 32);  // the warp's first row pair

  // Weights never depend on an earlier kernel: in P.pre_warps of the 8 warps (the plan's
  // calc_pre_warps) the first iteration of the first row pair goes out to DRAM before the wait for
  // the previous kernel (PDL), so that round trip overlaps the previous kernel's tail and the
  // staging of x.
  const bool pre = threadIdx.x / 32 < P.pre_warps;
  Iter first;
  if (pre && p0 < n_pairs) {
    int r0, r1;
    pairs.rows(p0, r0, r1);
    load_iter<WHOLE, TAIL>(first, P, r0, r1, lane, policy);
  }
  stage_weights<IN>(P, st);
  // The decode QKV product (RopeKV, or Store with P.late_trigger) lets the attention after it launch
  // only once the kernel before it has completed (its own wait), so attention may read the KV cache of
  // earlier steps before its wait (attention_decode.cu, `early`). Its blocks need the SMs this grid
  // holds anyway.
  const bool late = EP == Ep::RopeKV || P.late_trigger;
  if (!late) pdl_launch_dependents();
  pdl_wait();  // x (and, for AddResidual, out; for RopeKV, *pos) come from earlier kernels
  if (late) pdl_launch_dependents();
  tr.stamp(trace::kWaited);

  // SwiGLU of several rounds: lane 0 takes the ticket of the warp's second row pair now, so its
  // round trip runs beside x's staging (Tickets above).
  const bool ticketed = EP == Ep::SwiGLU && P.tickets != nullptr;  // the launcher checks the counts
  const int t_class = p0 % kTicketClasses;
  unsigned* const t_ctr = ticketed ? P.tickets + kTicketStride * t_class : nullptr;
  unsigned ticket = 0;
  if (ticketed && lane == 0) ticket = atomicAdd(t_ctr, 1u);

  const Prior pr = load_prior<EP, BIAS>(P, pairs, rope, p0);
  const float x_scale = stage_x<IN>(P, eps, st, red, tr);
  __syncthreads();
  tr.stamp(trace::kStaged);

  // A QKV warp with a second row pair (the launcher sets staged_warps only for rows of one
  // iteration and at most two pairs per warp) copies it into shared memory now, so its round trip
  // overlaps the first pair's instead of following it. Other products compile without the path.
  const int warp = threadIdx.x / 32;
  const bool staged = EP == Ep::RopeKV && WHOLE && warp < P.staged_warps && p0 + stride < n_pairs;
  StagedPair* sp = reinterpret_cast<StagedPair*>(reinterpret_cast<char*>(smem) + staging_bytes<IN>(P.K)) + warp;
  if (staged) {
    int r0, r1;
    pairs.rows(p0 + stride, r0, r1);
    copy_pair(*sp, P, r0, r1, policy);
  }

  // A warp that loaded early starts its first row pair from those registers (a peeled copy:
  // gemv_w8a16_body.cuh); every other row pair runs the plain load-then-math loop.
  uint64_t top = 0;  // Store with P.best: lane 0's largest argmax key of the rows it stored
  int p = p0;
  if (pre && p < n_pairs) {
    float acc0 = 0.f, acc1 = 0.f;
    dot_iter<WHOLE>(first, st.xs, lane, P.K / 16, acc0, acc1);
    tr.iter();
    finish_rows<EP, BIAS, WHOLE, TAIL>(P, pairs, rope, pr, st.xs, x_scale, p, 32 * kGemvUnroll, acc0, acc1, policy, tr,
                                       top);
    p += stride;
  } else if (staged) {
    // A staged warp past kQkvPreWarps (none in the Llama 3 shapes: 3B and 8B stage 2 and 4 warps per
    // block) sums its first pair with the plain loop.
    finish_rows<EP, BIAS, WHOLE, TAIL>(P, pairs, rope, pr, st.xs, x_scale, p, 0, 0.f, 0.f, policy, tr, top);
    p += stride;
  }
  if (staged) {
    cp_async_wait_all();  // this lane's copies; it reads back only those
    Iter it;
    read_pair(it, *sp, P.K / 16);
    float acc0 = 0.f, acc1 = 0.f;
    dot_iter<WHOLE>(it, st.xs, lane, P.K / 16, acc0, acc1);
    tr.iter();
    finish_pair<EP, BIAS>(P, pairs, rope, pr, p, acc0, acc1, x_scale, top);
    p += stride;
  }
  if constexpr (EP == Ep::SwiGLU) {
    // One loop for both ways of handing out pairs (a second inlined copy of finish_rows made the
    // kernel half again as long). Ticketed, a warp that did not load early still sums its own first
    // pair p0 first; every later pair comes by ticket, the next one taken while this one runs.
    bool own = p < n_pairs && (!ticketed || p == p0);
    for (;;) {
      int q = p;
      unsigned* grab = nullptr;  // no ticket to take during the warp's own first pair
      if (!own) {
        if (!ticketed) break;
        ticket = __shfl_sync(0xffffffffu, ticket, 0);
        q = stride + t_class + kTicketClasses * static_cast<int>(ticket);
        if (q >= n_pairs) break;
        grab = t_ctr;
      }
      finish_rows<EP, BIAS, WHOLE, TAIL>(P, pairs, rope, pr, st.xs, x_scale, q, 0, 0.f, 0.f, policy, tr, top, grab,
                                         &ticket);
      p += stride;
      own = !ticketed && p < n_pairs;
    }
    if (ticketed) {
      const int extra = max(0, n_pairs - stride - t_class);
      const unsigned last = CEIL_DIV(extra, kTicketClasses) + CEIL_DIV(stride - t_class, kTicketClasses) - 1;
      if (lane == 0 && ticket == last) atomicExch(t_ctr, 0u);
    }
  } else {
    for (; p < n_pairs; p += stride)
      finish_rows<EP, BIAS, WHOLE, TAIL>(P, pairs, rope, pr, st.xs, x_scale, p, 0, 0.f, 0.f, policy, tr, top);
  }
  if constexpr (EP == Ep::Store) {
    // The head's argmax for the greedy sampler: the block's largest key over its warps' lane 0s.
    if (P.best != nullptr) {
      __shared__ uint64_t best[kGemvWarps];
      if (lane == 0) best[warp] = top;
      __syncthreads();
      if (threadIdx.x == 0) {
        for (int w = 1; w < kGemvWarps; ++w) top = max(top, best[w]);
        P.best[blockIdx.x] = top;
      }
    }
  }
#ifdef ATOMFLOW_TRACE
  tr.stamp(trace::kExit);
  if (lane == 0) {
    trace::Rec r{};
    r.id = reinterpret_cast<uint64_t>(P.w);
    r.kind = static_cast<uint32_t>(EP) | static_cast<uint32_t>(IN) << 4;
    r.block = blockIdx.x;
    r.warp = threadIdx.x / 32;
    r.K = P.K;
    r.n = tr.i;
    trace::write(g_trace, r, tr.t);
  }
#endif
}

#ifdef ATOMFLOW_TRACE
void gemv_trace_arm(const trace::Buf& b) { AF_CUDA_CHECK(cudaMemcpyToSymbol(g_trace, &b, sizeof(b))); }
#endif

// ---- launchers ----

// How many blocks of a GEMV kernel (gemv_w8a16_kernel or gemv_cols_kernel) with `smem` bytes of dynamic
// shared memory are resident at once on the current device: 2 per SM, fewer only if fewer fit. The first
// launch of a (kernel, device, smem) queries it and raises the kernel's dynamic limit to what it needs
// (not only above 48 KB: the default limit counts the static `red` too, so K = 12288, exactly 48 KB of
// x, failed); later launches take it from the cache, so eager mode does not pay the queries on every
// GEMV (a captured graph pays them once either way). Host-side, capture-safe.
int gemv_kernel_resident_blocks(const void* kernel, size_t smem) {
  struct Seen {
    const void* kernel;
    int device;
    size_t smem;
    int blocks;
  };
  static std::mutex mu;
  static std::vector<Seen> seen;  // one entry per (kernel, device, K) in use: a few dozen
  int device = 0;
  AF_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mu);
  size_t raised = 0;  // the largest limit set for this kernel on this device so far
  for (const Seen& e : seen) {
    if (e.kernel != kernel || e.device != device) continue;
    if (e.smem == smem) return e.blocks;
    raised = std::max(raised, e.smem);
  }
  int sms = 0, smem_optin = 0;
  AF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  AF_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  AF_CHECK(smem <= static_cast<size_t>(smem_optin), "gemv_w8a16: K too large to stage x in shared memory");
  if (smem > raised)
    AF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per_sm = 0;
  AF_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kGemvThreads, smem));
  AF_CHECK(per_sm >= 1, "gemv_w8a16: kernel does not fit on an SM");
  seen.push_back({kernel, device, smem, sms * std::min(per_sm, 2)});
  return seen.back().blocks;
}

template <Ep EP, In IN, bool WHOLE, bool TAIL, bool BIAS>
static int resident_blocks(size_t smem) {
  return gemv_kernel_resident_blocks(reinterpret_cast<const void*>(gemv_w8a16_kernel<EP, IN, WHOLE, TAIL, BIAS>), smem);
}

// The three instances of one (EP, IN, BIAS): whole steps, a ragged last step, and a ragged last
// step with the tail group (whole steps never have one).
template <Ep EP, In IN, bool BIAS = false>
static int resident_blocks_of(bool whole, bool tail, size_t smem) {
  if (whole) return resident_blocks<EP, IN, true, false, BIAS>(smem);
  return tail ? resident_blocks<EP, IN, false, true, BIAS>(smem) : resident_blocks<EP, IN, false, false, BIAS>(smem);
}

int gemv_resident_blocks(Epilogue ep, GemvIn in, bool whole, bool tail, bool bias, size_t smem) {
  AF_CHECK(!(whole && tail), "gemv_w8a16: a row of whole steps has no tail group");
  AF_CHECK(!bias || ep == Ep::RopeKV, "gemv_w8a16: a bias is the RopeKV epilogue's only");
  // The instances the launchers below use: RopeKV only with the fused RMSNorm, with or without bias.
  const auto by_in = [&](auto ep_c) {
    constexpr Ep EP = decltype(ep_c)::value;
    if constexpr (EP == Ep::RopeKV) {
      AF_CHECK(in == In::NORM, "gemv_w8a16: the RopeKV epilogue needs the fused RMSNorm");
      return bias ? resident_blocks_of<EP, In::NORM, true>(whole, tail, smem)
                  : resident_blocks_of<EP, In::NORM, false>(whole, tail, smem);
    } else {
      switch (in) {
        case In::BF16: return resident_blocks_of<EP, In::BF16>(whole, tail, smem);
        case In::F16: return resident_blocks_of<EP, In::F16>(whole, tail, smem);
        default: return resident_blocks_of<EP, In::NORM>(whole, tail, smem);
      }
    }
  };
  switch (ep) {
    case Ep::Store: return by_in(std::integral_constant<Ep, Ep::Store>{});
    case Ep::AddResidual: return by_in(std::integral_constant<Ep, Ep::AddResidual>{});
    case Ep::SwiGLU: return by_in(std::integral_constant<Ep, Ep::SwiGLU>{});
    case Ep::RopeKV: return by_in(std::integral_constant<Ep, Ep::RopeKV>{});
  }
  AF_CHECK(false, "gemv_w8a16: unknown epilogue");
  return 0;
}

// The plan's launch: the kernel instance, grid and shared memory it names, and its per-warp choices
// in the Product. resident_blocks (cached) makes sure the instance's shared memory limit admits
// plan.smem on this device.
template <Ep EP, In IN, bool WHOLE, bool TAIL, bool BIAS>
static void launch_gemv_as(const GemvPlan& plan, Product P, float eps, const RopeKVArgs& rope, cudaStream_t stream) {
  AF_CHECK((resident_blocks<EP, IN, WHOLE, TAIL, BIAS>(plan.smem) >= plan.blocks),
           "gemv_w8a16: the plan's grid does not fit");
  P.staged_warps = plan.staged_warps;
  P.pre_warps = plan.pre_warps;
  P.late_trigger = plan.late_trigger;
  if (!plan.ticketed) P.tickets = nullptr;
  af_launch(gemv_w8a16_kernel<EP, IN, WHOLE, TAIL, BIAS>, dim3(plan.blocks), dim3(kGemvThreads), plan.smem, stream, P,
            eps, rope);
}

template <Ep EP, In IN, bool BIAS = false>
static void launch_gemv(const GemvPlan& plan, const uint8_t* w, const float* scales, const void* x, const bf16* norm_w,
                        float eps, int N, int K, void* out, const RopeKVArgs& rope, cudaStream_t stream,
                        unsigned* tickets = nullptr, uint64_t* best = nullptr, int* f16_overflow = nullptr) {
  AF_CHECK(plan.ep == EP && plan.in == IN && plan.bias == BIAS && plan.N == N && plan.K == K &&
               plan.whole == gemv_whole_steps(K) && plan.tail == gemv_tail_group(K) && plan.threads == kGemvThreads &&
               plan.blocks >= 1,
           "gemv_w8a16: the plan is not this launch's (plan_gemv(ep, in, N, K, knobs, bias))");
  const Product P{w, scales, x, norm_w, N, K, out, 0, tickets, best, f16_overflow, 0};
  if (plan.whole)
    launch_gemv_as<EP, IN, true, false, BIAS>(plan, P, eps, rope, stream);
  else if (plan.tail)
    launch_gemv_as<EP, IN, false, true, BIAS>(plan, P, eps, rope, stream);
  else
    launch_gemv_as<EP, IN, false, false, BIAS>(plan, P, eps, rope, stream);
}

static void check_args(const uint8_t* w, const void* x, int N, int K) {
  AF_CHECK(N >= 1 && K >= kGemvKStep, "gemv_w8a16: N must be >= 1 and K >= 64");
  AF_CHECK(K % kGemvKStep == 0, "gemv_w8a16: K must be a multiple of 64 (scales [N, ceil(K / 128)])");
  AF_CHECK(reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0,
           "gemv_w8a16: w and x must be 16-byte aligned");
}

template <In IN>
static void dispatch_gemv(const GemvPlan& plan, const uint8_t* w, const float* scales, const void* x,
                          const bf16* norm_w, float eps, int N, int K, Epilogue ep, void* out, cudaStream_t stream,
                          unsigned* tickets, int* f16_overflow) {
  check_args(w, x, N, K);
  AF_CHECK(f16_overflow == nullptr || ep == Epilogue::SwiGLU, "gemv_w8a16: an fp16 output is SwiGLU's only");
  const RopeKVArgs none{};
  switch (ep) {
    case Epilogue::Store: launch_gemv<Ep::Store, IN>(plan, w, scales, x, norm_w, eps, N, K, out, none, stream); break;
    case Epilogue::AddResidual:
      launch_gemv<Ep::AddResidual, IN>(plan, w, scales, x, norm_w, eps, N, K, out, none, stream);
      break;
    case Epilogue::SwiGLU:
      AF_CHECK(N % 2 == 0, "gemv_w8a16: SwiGLU needs N = 2F (gate rows, then up rows)");
      launch_gemv<Ep::SwiGLU, IN>(plan, w, scales, x, norm_w, eps, N, K, out, none, stream, tickets, nullptr,
                                  f16_overflow);
      break;
    default: AF_CHECK(false, "gemv_w8a16: the Store, AddResidual and SwiGLU epilogues only");
  }
}

void gemv_w8a16(const GemvPlan& plan, const uint8_t* w, const float* scales, const void* x, Act x_type, int N, int K,
                Epilogue ep, void* out, cudaStream_t stream, unsigned* tickets, int* f16_overflow) {
  if (x_type == Act::F16)
    dispatch_gemv<In::F16>(plan, w, scales, x, nullptr, 0.f, N, K, ep, out, stream, tickets, f16_overflow);
  else
    dispatch_gemv<In::BF16>(plan, w, scales, x, nullptr, 0.f, N, K, ep, out, stream, tickets, f16_overflow);
}

void gemv_w8a16_rmsnorm(const GemvPlan& plan, const uint8_t* w, const float* scales, const float* x, const bf16* norm_w,
                        float eps, int N, int K, Epilogue ep, void* out, cudaStream_t stream, unsigned* tickets,
                        int* f16_overflow) {
  AF_CHECK(norm_w != nullptr, "gemv_w8a16_rmsnorm: needs the norm weight");
  dispatch_gemv<In::NORM>(plan, w, scales, x, norm_w, eps, N, K, ep, out, stream, tickets, f16_overflow);
}

void gemv_w8a16_rmsnorm_rope(const GemvPlan& plan, const uint8_t* w, const float* scales, const float* x,
                             const bf16* norm_w, float eps, int K, const RopeKVArgs& rope, cudaStream_t stream) {
  AF_CHECK(norm_w != nullptr, "gemv_w8a16_rmsnorm_rope: needs the norm weight");
  AF_CHECK(rope.H >= 1 && rope.Hkv >= 1 && rope.max_context >= 1,
           "gemv_w8a16_rmsnorm_rope: H, Hkv, max_context must be >= 1");
  AF_CHECK(rope.D >= 2 && rope.D % 2 == 0 && rope.D <= kMaxRopeHeadDim,
           "gemv_w8a16_rmsnorm_rope: head_dim must be even and <= 1024");
  AF_CHECK(rope.inv_freq && rope.pos && rope.q_out && rope.k_cache && rope.v_cache,
           "gemv_w8a16_rmsnorm_rope: null pointer argument");
  // The plan names the instance, with or without the bias add: the bias is given iff it is the bias one.
  AF_CHECK(plan.bias == (rope.bias != nullptr),
           "gemv_w8a16_rmsnorm_rope: rope.bias must be given iff the plan is for a bias (plan_gemv(..., bias))");
  const int N = (rope.H + 2 * rope.Hkv) * rope.D;
  check_args(w, x, N, K);
  if (plan.bias)
    launch_gemv<Ep::RopeKV, In::NORM, true>(plan, w, scales, x, norm_w, eps, N, K, nullptr, rope, stream);
  else
    launch_gemv<Ep::RopeKV, In::NORM, false>(plan, w, scales, x, norm_w, eps, N, K, nullptr, rope, stream);
}

void gemv_w8a16_rmsnorm_argmax(const GemvPlan& plan, const uint8_t* w, const float* scales, const float* x,
                               const bf16* norm_w, float eps, int N, int K, float* out, uint64_t* block_best,
                               cudaStream_t stream) {
  AF_CHECK(norm_w != nullptr && block_best != nullptr,
           "gemv_w8a16_rmsnorm_argmax: needs the norm weight and block_best");
  check_args(w, x, N, K);
  launch_gemv<Ep::Store, In::NORM>(plan, w, scales, x, norm_w, eps, N, K, out, RopeKVArgs{}, stream, nullptr,
                                   block_best);
}

}  // namespace atomflow::kernels

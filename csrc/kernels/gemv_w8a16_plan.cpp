// The W8A16 GEMV's plan table: for a product's shape (epilogue, input, N, K) on this device, the
// grid, the early-loading warps, the staged second pairs and the tickets (kernels.h, GemvPlan).
// Host only: the decisions are constexpr functions of the shape (ggml-cuda mmvq.cu's calc_nwarps),
// the device enters only through the number of resident blocks. Why each rule: docs/design/gemv_w8a16.md.
#include <string>

#include "gemv_w8a16_plan.h"

namespace atomflow::kernels {

namespace {

// Blocks of a product: one row pair per warp when there are fewer pairs than resident warps, so the
// block slots left free take the next kernel's blocks at once; every resident slot otherwise (the
// QKV product too: the attention after it needs several free slots of one GPC at once for its
// clusters).
constexpr int calc_blocks(int n_pairs, int resident) {
  return CEIL_DIV(n_pairs, kGemvWarps) < resident ? CEIL_DIV(n_pairs, kGemvWarps) : resident;
}

// Warps per block whose second row pair is copied into shared memory early: the QKV product with rows
// of one iteration (K <= 4096, a multiple of 512) and more row pairs than warps, at most two per warp
// (3B and 8B: 1.2 and 1.5 pairs per warp). Warp w of block b has one iff b + w * blocks < n_pairs -
// stride. 0: none. (The caller keeps them only if the grid still fits with the extra shared memory.)
constexpr int calc_staged_warps(Epilogue ep, bool whole, int K, int n_pairs, int blocks) {
  const int stride = blocks * kGemvWarps;
  const bool fits = ep == Epilogue::RopeKV && whole && K <= kGemvIterK && n_pairs > stride && n_pairs <= 2 * stride;
  return fits ? CEIL_DIV(n_pairs - stride, blocks) : 0;
}

// SwiGLU with more row pairs than warps and a warp of every ticket class.
constexpr bool calc_ticketed(Epilogue ep, int n_pairs, int blocks) {
  const int stride = blocks * kGemvWarps;
  return ep == Epilogue::SwiGLU && n_pairs > stride && stride >= kTicketClasses;
}

// Warps per block that load their first iteration before the PDL wait: half (the early loads queue
// ahead of the wait's release and of x's staging); in the QKV product 6 with staged pairs and all 8
// without; all 8 in the o product (AddResidual on fp16 x, rows of one iteration, one pair per warp),
// whose staging is one copy and a barrier.
constexpr int calc_pre_warps(Epilogue ep, GemvIn in, bool whole, int K, int n_pairs, int blocks, int staged_warps) {
  if (ep == Epilogue::RopeKV) return staged_warps > 0 ? kQkvPreWarps : kGemvWarps;
  const bool one_pair_per_warp = n_pairs <= blocks * kGemvWarps;
  if (ep == Epilogue::AddResidual && in == GemvIn::F16 && whole && K <= kGemvIterK && one_pair_per_warp)
    return kGemvWarps;
  return kGemvPreWarps;
}

// The Llama 3 shapes on an H100 SXM (132 SMs, 264 resident blocks), as the table gives them: a check
// of the rules above, not a source of them.
static_assert(calc_blocks(1536, 264) == 192 &&
                  calc_pre_warps(Epilogue::AddResidual, GemvIn::F16, true, 3072, 1536, 192, 0) == kGemvWarps,
              "3B o: one pair per warp, every warp early");
static_assert(calc_staged_warps(Epilogue::RopeKV, true, 3072, 2560, 264) == 2, "3B qkv: 2 staged warps per block");
static_assert(calc_staged_warps(Epilogue::RopeKV, true, 4096, 3072, 264) == 4, "8B qkv: 4 staged warps per block");
static_assert(calc_ticketed(Epilogue::SwiGLU, 14336, 264) && !calc_ticketed(Epilogue::SwiGLU, 2048, 256),
              "8B gate/up ticketed; one round is not");

const char* ep_name(Epilogue ep) {
  switch (ep) {
    case Epilogue::Store: return "Store";
    case Epilogue::AddResidual: return "AddResidual";
    case Epilogue::SwiGLU: return "SwiGLU";
    case Epilogue::RopeKV: return "RopeKV";
  }
  return "?";
}

const char* in_name(GemvIn in) {
  switch (in) {
    case GemvIn::BF16: return "BF16";
    case GemvIn::F16: return "F16";
    case GemvIn::NORM: return "NORM";
  }
  return "?";
}

// What every plan of a product's shape holds (the instance's kind and rows), after the shape's checks;
// `who` names the planner in the errors.
GemvPlan shape_plan(Epilogue ep, GemvIn in, int N, int K, bool bias, const std::string& who) {
  AF_CHECK(N >= 1 && K >= kGemvKStep && K % kGemvKStep == 0, who + ": N >= 1, K a multiple of 64");
  AF_CHECK((ep != Epilogue::SwiGLU && ep != Epilogue::RopeKV) || N % 2 == 0,
           who + ": SwiGLU and RopeKV need an even N");
  AF_CHECK(ep != Epilogue::RopeKV || in == GemvIn::NORM, who + ": RopeKV needs the fused RMSNorm");
  AF_CHECK(!bias || ep == Epilogue::RopeKV, who + ": a bias is the RopeKV epilogue's only");
  GemvPlan plan{};
  plan.ep = ep;
  plan.in = in;
  plan.N = N;
  plan.K = K;
  plan.bias = bias;
  plan.whole = gemv_whole_steps(K);
  plan.tail = gemv_tail_group(K);
  plan.threads = kGemvThreads;
  return plan;
}

}  // namespace

GemvPlan plan_gemv(Epilogue ep, GemvIn in, int N, int K, const GemvKnobs& knobs, bool bias) {
  GemvPlan plan = shape_plan(ep, in, N, K, bias, "plan_gemv");
  plan.smem = gemv_staging_bytes(in, K);
  const int resident = gemv_resident_blocks(ep, in, plan.whole, plan.tail, bias, plan.smem);
  const int n_pairs = gemv_row_pairs(ep, N);
  plan.blocks = calc_blocks(n_pairs, resident);
  if (knobs.staged_pair) {
    const int warps = calc_staged_warps(ep, plan.whole, K, n_pairs, plan.blocks);
    const size_t smem = plan.smem + warps * kStagedPairBytes;
    if (warps > 0 && gemv_resident_blocks(ep, in, plan.whole, plan.tail, bias, smem) == resident) {
      plan.staged_warps = warps;
      plan.smem = smem;
    }
  }
  plan.ticketed = knobs.tickets && calc_ticketed(ep, n_pairs, plan.blocks);
  plan.pre_warps = calc_pre_warps(ep, in, plan.whole, K, n_pairs, plan.blocks, plan.staged_warps);
  return plan;
}

GemvPlan plan_gemv_cols(Epilogue ep, GemvIn in, int M, int N, int K, bool bias) {
  AF_CHECK(M >= 1 && M <= kGemvColsMT, "plan_gemv_cols: 1 <= M <= 4");
  GemvPlan plan = shape_plan(ep, in, N, K, bias, "plan_gemv_cols");
  plan.rows = M;
  plan.mt = kGemvColsMT;
  int device = 0, sms = 0, per_sm = 0;
  AF_CUDA_CHECK(cudaGetDevice(&device));
  AF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  AF_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  // Two blocks an SM, as the decode GEMV (its loads in flight): NORM stages as many raw rows at a time as
  // then fit; x's M rows must fit whole.
  const int most_raw = in == GemvIn::NORM ? M : 0;
  for (int raw = most_raw; raw >= (in == GemvIn::NORM ? 1 : 0); --raw) {
    const size_t smem = gemv_cols_smem(in, M, K, raw);
    if (smem > static_cast<size_t>(per_sm) / 2) continue;
    const int resident = gemv_cols_resident_blocks(ep, in, plan.whole, plan.tail, bias, smem);
    if (resident < 2 * sms) continue;
    const int n_pairs = gemv_row_pairs(ep, N);
    plan.raw_rows = raw;
    plan.smem = smem;
    plan.blocks = calc_blocks(n_pairs, resident);
    plan.pre_warps = calc_pre_warps(ep, in, plan.whole, K, n_pairs, plan.blocks, 0);
    return plan;
  }
  plan.blocks = 0;  // does not fit two blocks an SM: the tile kernel's
  return plan;
}

std::string gemv_variant_name(const GemvPlan& plan) {
  const std::string kind = std::string(ep_name(plan.ep)) + ", " + in_name(plan.in) +
                           (plan.whole  ? ", whole"
                            : plan.tail ? ", ragged, tail group"
                                        : ", ragged") +
                           (plan.bias ? ", bias" : "");
  if (plan.mt == 1) return "gemv_w8a16<" + kind + ">";
  return "gemv_cols<" + kind + ", mt=" + std::to_string(plan.mt) +
         (plan.in == GemvIn::NORM ? ", raw_rows=" + std::to_string(plan.raw_rows) : std::string()) + ">";
}

}  // namespace atomflow::kernels

// W8A16 GEMV for M = 1 decode: y[n] = sum_k x[k] * fp8[n, k] * scale[n, k / 128], fp32 accumulation,
// with a Store / AddResidual / SwiGLU epilogue and, optionally, RMSNorm fused into the prologue.
// The hot kernel: ~95% of the bytes of a decode step.
//
// Layout of the work
//  - One warp owns a PAIR of rows and streams both across K: lane l reads 16 weight bytes of each
//    row at chunk c = l + 32 u (u < kUnroll = 8), so one warp instruction reads 512 contiguous bytes
//    per row and each lane keeps 2 x 8 = 16 independent 16-byte loads (256 B) in flight: a row of
//    K <= 4096 arrives in one DRAM round trip, K = 14336 in four. 2 blocks x 8 warps per SM.
//    SwiGLU pairs row i with row F + i (gate and up of the same output), the other epilogues pair
//    rows 2p and 2p + 1; the x values each lane reads from shared memory serve both rows.
//  - Blocks are persistent-style: the grid is what fits on the SMs (2 per SM) and warps stride over
//    row pairs, so x (16-bit [K] -> fp16 in shared memory) is staged once per block, not per pair.
//    Row pair p goes to block p mod grid (warp p / grid of it, then + 8 x grid per round): every
//    block, hence every SM, gets the same number of pairs +-1, and the rows left over for a second
//    round are spread over all SMs instead of filling the first blocks' warps (docs/PERF.md,
//    b322060: an SM serves only so many loads at once, so per-SM balance matters even when the
//    grid's total is the same).
//  - A product with fewer row pairs than the resident warps (3B o and down: 1536 pairs on 2112)
//    runs on just enough blocks for one pair per warp, not on every slot with idle warps: the
//    block slots left free take the NEXT kernel's blocks at once, and their weight loads (before
//    their PDL wait) go out while this product runs (docs/PERF.md: 3B 1.372 -> 1.339 ms).
//  - Weights depend on no earlier kernel: half the warps of a block (kGemvPreWarps) load the first
//    iteration of their first row pair into registers BEFORE they wait for the previous kernel
//    (PDL, pdl.cuh), so that DRAM round trip overlaps the previous kernel's tail and the x staging
//    (-1 to -2.5 us per GEMV); the other half load theirs once x is staged. Only half: requests
//    queue in issue order, and the in-kernel trace (trace.cuh, tools/trace_step.py) shows the
//    wait's release and x's loads paying for what is queued ahead of them. With all 8 warps (17 MB
//    for the whole grid), the wait of gate_up and down released 2-3 us after the previous kernel's
//    last warp had exited, and staging x took 2-3.6 us, for reads that hit L2; with 4,
//    3B 1.33 -> 1.30 ms, 8B 2.51 -> 2.46 (docs/PERF.md 2026-11-21; 3 of 8 measured the same). The
//    other half's loads sent right after x's copies instead, in flight during the staging, were
//    slower still (3B +5%): they delay the copies of the warps that issue theirs later.
//    The QKV product is the exception: its blocks enter in down's spare slots and as down's blocks
//    leave, long before their wait, and more of its warps load early. With a second round (the
//    staged pairs below: 3B, 8B) 6 of 8 (kQkvPreWarps): against all 8, 3B -0.3%, 8B -0.4% (7 and 5
//    the same as 8, 4 slower); with one pair per warp (1B) all 8, since a late warp's round trip
//    then ends the product (6 there: 1B +0.5 to +1.0%; docs/PERF.md 2026-11-24). Every early warp
//    in gate_up, down or o, on top of QKV's 8, cost 3B +2.0%, +0.5%, 0% and 8B +0.7%, +0.3%, +0.5%
//    (docs/PERF.md 2026-11-24, in a build with the staged path in every GEMV); 3, 5 (o, gate_up,
//    down) or 2 (o) instead of 4 ran the same or slower, and so did early loads by bulk copies into
//    shared memory (docs/PERF.md 2026-11-24).
//  - The QKV product, rows of one iteration with 1-2 row pairs per warp (3B 2560 pairs and 8B 3072
//    on 2112 warps), would read its second round only after the first one's math. The warps with a
//    second pair instead copy it into shared memory by cp.async right after x is staged
//    (StagedPair; the copies keep off the weight loads' scoreboard), so its round trip runs beside
//    the first pair's. Only in the RopeKV instances: compiled into every GEMV, the path changed the
//    other products' register allocation and cost 3B +4.2%, 8B +1.4%. With the early loads of every
//    QKV warp (above), against neither: 3B 1.2656 -> 1.2616 ms, 8B 2.4341 -> 2.4299; the early loads
//    alone cost +1.2% / +2.3% (docs/PERF.md 2026-11-24). Not before the wait with cp.async: x's
//    copies, after them, would wait for them too (cp.async groups complete in order); a bulk copy
//    with its own barrier could, unmeasured.
//  - The gate/up product of several rounds (SwiGLU, given the caller's counters) hands out its row
//    pairs past the first round by ticket (Tickets below): a warp whose loads come back sooner takes
//    more pairs. 8B 2.423 -> 2.384 ms (6.8 pairs per warp), 3B unchanged (3.9); with the atomics on
//    8 counters instead of 64, 3B +2.6%, 8B +2.2% (docs/PERF.md 2026-11-24, tickets).
//  - What an epilogue reads from earlier kernels (AddResidual's residual of the warp's first pair,
//    RopeKV's position) is loaded right after the wait, next to x's staging, not after the math:
//    a round trip fewer at the end of o and down (docs/PERF.md, 9eb48ab).
//  - Fused RMSNorm (gemv_w8a16_rmsnorm): x is the fp32 residual stream; the block computes the
//    norm with the rmsnorm kernel's exact arithmetic and reduction tree, so the result is
//    bit-identical to rmsnorm() + gemv_w8a16(Act::F16), with one launch and one round trip fewer.
//  - The QKV variant (gemv_w8a16_rmsnorm_rope) pairs rows (i, i + D/2) of each q / k head instead,
//    so the warp that owns a rotation pair applies RoPE (rope.cuh, the rope kernel's arithmetic)
//    and writes q and the KV-cache rows itself: the rope kernel's launch and round trip disappear.
//  - The dot products run on the tensor cores (dot_chunk): per 16-byte chunk of both rows a lane
//    converts its 32 weights to fp16 (exact) and the warp issues four m16n8k16 products whose
//    diagonal holds the lane groups' partial sums, fp32-accumulated; ~31-35 instructions per 32 weights
//    against ~110 with fp32 FMAs. That is what a warp's burst costs between its data's arrival and
//    its next loads, and what the tail of every GEMV costs (docs/PERF.md, 25db0f9).
//    x enters the products as fp16: the RMSNorm output already is, and so are the decode step's
//    attention and SwiGLU outputs (kernels.h); bf16 x is scaled by a power of two into fp16's range
//    first and the sums scaled back (stage_x), exact in practice. That scaling is a block-wide
//    maximum, a barrier and a second pass over x on the chain of every o and down GEMV; taking their
//    x in fp16 instead, copied as is, made the 3B step 4.9% faster (docs/PERF.md 2026-11-24).
//  - A 16-byte chunk never straddles a 128-column scale group: each 64-byte group of four lanes
//    sits in one scale group, so a partial sum is multiplied by its scale once.
//  (Tried and measured slower, docs/PERF.md 2026-11-20/21: weights through a cp.async.bulk ring
//  into shared memory, 1 block per SM, 16-row tiles of 1 KB copies shared by the block (34% of the
//  stream ceiling; per-warp rings of copies of up to 4 KB do stream at it); an L2 prefetch of the
//  first rows before the PDL wait (slightly slower than none: L2 prefetch instructions leave
//  nothing in L2 that a later read hits, tools/l2_probe.cu); idle warps of o warming gate_up's
//  later rows in L2 with real reads during attention (gate_up faster, attention slower by more); a
//  two-slot rolling register pipeline; 128-thread blocks, 3 or 4 per SM (lm_head 85%); a
//  multi-iteration row pair's K slices spread over the block's warps (that GEMV faster, the next
//  one slower: no SM frees early for it); with the tensor-core loop: 6-chunk iterations with 3
//  blocks per SM, a second iteration per warp in flight through shared memory (down faster, its
//  neighbours slower), and o -> gate_up -> down -> qkv as one persistent launch with grid barriers
//  (14% slower; with its weights in per-warp bulk-copy rings, 19% slower: 8 warps per SM cannot
//  hide the math's latency); the MLP as one launch with down split along F over the blocks and one
//  barrier at the end (23% slower: the barrier and the cross-slice sum cost ~6 us per layer, and
//  gate/up in contiguous 1-block-per-SM slices ran slower); 80 registers so that a block of the next
//  kernel fits beside the grid's two (steady state 20% slower); and with the packed grid below:
//  fewer blocks for a product of several rounds, its last round on whole blocks, and down's second
//  iteration landed in shared memory before the wait (3% slower: those requests queue ahead of
//  gate_up's last ones).)
//
// The compiler and the weight loads: every weight load of the kernel shares ONE scoreboard, and
// an instruction that waits for any of them waits for all. Two consequences, both seen in the
// SASS and measured (lm_head at 62% of the ceiling instead of 95%): math must never wait for an
// iteration while the next one's loads are already issued (so no rolling pipeline within a warp:
// other warps hide the round trip), and a loop must not consume registers loaded by an earlier
// trip or by a conditional load outside it (the compiler then waits for the scoreboard between
// the loads of one burst, serializing them). Hence the first iteration loaded before the PDL wait
// is consumed by a peeled copy of the loop, not by the loop.
#include <algorithm>
#include <cfloat>
#include <mutex>
#include <vector>

#include <cuda_fp16.h>

#include "atomflow/act16.cuh"
#include "atomflow/kernels.h"
#include "atomflow/loads.cuh"
#include "atomflow/order_key.cuh"
#include "atomflow/pdl.cuh"
#include "atomflow/rmsnorm.cuh"
#include "atomflow/rope.cuh"
#include "atomflow/trace.cuh"

namespace atomflow::kernels {

#ifdef ATOMFLOW_TRACE
static __device__ trace::Buf g_trace;  // set by gemv_trace_arm (trace.cuh)
#endif

constexpr int kGemvThreads = 256;
constexpr int kGemvWarps = kGemvThreads / 32;
constexpr int kGemvUnroll = 8;  // 16-byte chunks per row per lane per iteration
// Warps 0 .. kGemvPreWarps - 1 of a block send their first iteration's loads before the PDL wait,
// the others once x is staged (kernel comment: the early loads queue ahead of the wait's release);
// in the QKV product warps 0 .. kQkvPreWarps - 1 when it stages second pairs, every warp otherwise,
// and every warp in the o product on fp16 x (GemvPlan::pre_warps).
constexpr int kGemvPreWarps = kGemvWarps / 2;
constexpr int kQkvPreWarps = 6;
constexpr int kQuantGroup = 128;

// x is stored as fp16 (16 values = 32 B per chunk) with a swizzle: the two 16-byte halves of chunk c
// sit in order when (c >> 2) & 1 is 0 and swapped when it is 1. Lanes read 32 B apart; without the
// swizzle every quarter-warp of a 128-bit shared load would hit the same banks twice.
static __device__ __forceinline__ int x_slot(int c, int h) { return 2 * c + (h ^ ((c >> 2) & 1)); }  // in uint4

// D = A B + C on the tensor cores: m16n8k16, fp16 inputs, fp32 accumulation (products of fp16 values
// are exact in fp32).
static __device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four packed e4m3 -> two f16x2 (exact): bytes 0-1 into lo, bytes 2-3 into hi. Written as one PTX
// block that splits the register into its 16-bit halves, so the conversion of the high half reads
// it in place (F2FP ... R.H1) instead of after a shift: 8 instructions fewer per chunk of the loop.
static __device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t four, uint32_t& lo, uint32_t& hi) {
  asm("{.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;}"
      : "=r"(lo), "=r"(hi)
      : "r"(four));
}

static __device__ __forceinline__ uint4 ld_shared16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// The two 16-weight dot products of one chunk per lane, for the whole warp, as four tensor-core
// products. Lane l = 4 g + q holds 16 weights of row a and of row b at its chunk and the 16 x values
// of that chunk. In the m16n8k16 product, A row g is row a's weights of lane group g (lanes 4g..4g+3,
// 64 contiguous bytes), A row g + 8 is row b's at the same columns, and B column g is x at those
// columns: the k order inside a product is free as long as A and B agree, and each lane supplies
// exactly its own weights and x. D[g][g] and D[g + 8][g] are then group g's partial sums of row a and
// row b; lane 4 g + g / 2 holds them (in d[g & 1] and d[2 + (g & 1)]). The other 112 entries of D are
// cross terms and are not used. Per 32 weights a lane spends 16 conversions (each reading a 16-bit
// half of a weight register in place), 4 products and 2 shared loads, against ~110 instructions with
// fp32 FMAs. x_lo / x_hi: shared addresses of the chunk's two 8-value halves.
static __device__ __forceinline__ void dot_chunk(uint4 wa, uint4 wb, uint32_t x_lo, uint32_t x_hi, float (&d)[4]) {
  const uint4 x0 = ld_shared16(x_lo), x1 = ld_shared16(x_hi);
  const uint32_t a[4] = {wa.x, wa.y, wa.z, wa.w};
  const uint32_t b[4] = {wb.x, wb.y, wb.z, wb.w};
  const uint32_t xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
  d[0] = d[1] = d[2] = d[3] = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // bytes 4j, 4j+1 pair with x values 4j, 4j+1; bytes 4j+2, 4j+3 with 4j+2, 4j+3
    uint32_t a_lo, a_hi, b_lo, b_hi;
    e4m3x4_to_f16x2(a[j], a_lo, a_hi);
    e4m3x4_to_f16x2(b[j], b_lo, b_hi);
    mma16816(d, a_lo, b_lo, a_hi, b_hi, xv[2 * j], xv[2 * j + 1]);
  }
}

// The kernel's epilogues: the public three, and RoPE + KV append for the fused QKV product.
enum class Ep { Store, AddResidual, SwiGLU, RopeKV };

// What the GEMV reads: 16-bit x (bf16 or fp16), or the fp32 residual stream to normalize.
enum class In { BF16, F16, NORM };

// One matrix product: y = W x with W [N, K] (+ scales), x as IN says, into out.
struct Product {
  const uint8_t* w;
  const float* scales;
  const void* x;
  const bf16* norm_w;  // In::NORM
  int N, K;
  void* out;
  int staged_warps;  // warps per block whose second row pair is copied into shared memory early (0: none)
  unsigned* tickets; // SwiGLU of several rounds: counters that hand out the row pairs past the first round (Tickets)
  uint64_t* best;    // Store: each block's argmax key of the rows it wrote (gemv_w8a16_rmsnorm_argmax), or null
  int* f16_overflow; // SwiGLU: fp16 output, flagged past kF16Max (act16.cuh); null: bf16
  int pre_warps;     // warps per block that load their first iteration before the PDL wait (GemvPlan)
};

// Which rows row pair p covers. SwiGLU pairs gate row p with up row F + p; RopeKV pairs (i, i + D/2)
// of a q or k head, then consecutive v rows; otherwise rows 2p and 2p + 1 (for odd N the last
// pair reads its one row twice and stores once). A row's sum does not depend on its partner.
template <Ep EP>
struct RowPairs {
  int N, half, qk_pairs;
  __device__ RowPairs(int n, const RopeKVArgs& rope) : N(n), half(rope.D / 2), qk_pairs((rope.H + rope.Hkv) * half) {}
  __host__ __device__ static int count(int n) { return EP == Ep::SwiGLU || EP == Ep::RopeKV ? n / 2 : CEIL_DIV(n, 2); }
  __device__ int count() const { return count(N); }
  __device__ void rows(int p, int& r0, int& r1) const {
    if constexpr (EP == Ep::SwiGLU) {
      r0 = p;
      r1 = p + N / 2;
    } else if constexpr (EP == Ep::RopeKV) {
      if (p < qk_pairs) {
        r0 = (p / half) * 2 * half + p % half;
        r1 = r0 + half;
      } else {
        r0 = 2 * p;  // = (H + Hkv) * D + 2 (p - qk_pairs)
        r1 = r0 + 1;
      }
    } else {
      r0 = 2 * p;
      r1 = min(2 * p + 1, N - 1);
    }
  }
};

// This warp's trace stamps (trace.cuh), in shared memory until the warp exits; without
// ATOMFLOW_TRACE every member is empty and compiles to nothing.
struct WarpTrace {
  uint64_t* t;  // kStamps of this warp, or nullptr
  int i;        // iterations summed so far
  __device__ __forceinline__ void stamp(int slot) const {
    if constexpr (trace::kOn)
      if (threadIdx.x % 32 == 0) t[slot] = trace::now();
  }
  __device__ __forceinline__ void iter() {
    if constexpr (trace::kOn) {
      stamp(i < trace::kIterSlots ? trace::kIter0 + i : trace::kIterLast);
      ++i;
    }
  }
};

// One iteration of a warp on a row pair: kGemvUnroll 16-byte chunks of each row per lane (chunks
// c0 + 32 u), with their scales. All loads are issued before any math, and they are the only
// weight loads in flight when the math waits for them (see the top of the file).
// The scales: an iteration spans 32 scale groups of each row, so lane l loads group l's scale of each
// (coalesced) and the lane that accumulates chunk c fetches group c / 8's by a shuffle.
struct Iter {
  uint4 wa[kGemvUnroll], wb[kGemvUnroll];
  float sa, sb;
};

// Whether step u of an iteration (chunks c0 + 32 u, c0 = the warp's chunk + lane) has any lane inside
// the row: warp-uniform. WHOLE (K a multiple of 512): the active steps are a prefix, counted once per
// iteration, and every lane of an active step is inside the row.
template <bool WHOLE>
struct Steps {
  int c0, C, n;
  __device__ Steps(int c0_, int C_) : c0(c0_), C(C_), n((C_ - (c0_ - static_cast<int>(threadIdx.x % 32))) / 32) {}
  __device__ bool active(int u) const { return WHOLE ? u < n : c0 + 32 * u - static_cast<int>(threadIdx.x % 32) < C; }
};

template <bool WHOLE>
static __device__ __forceinline__ void load_iter(Iter& it, const Product& P, int r0, int r1, int c0, uint64_t policy) {
  const int C = P.K / 16, G = P.K / kQuantGroup;
  const uint8_t* w0 = P.w + static_cast<size_t>(r0) * P.K;
  const uint8_t* w1 = P.w + static_cast<size_t>(r1) * P.K;
  const float* s0 = P.scales + static_cast<size_t>(r0) * G;
  const float* s1 = P.scales + static_cast<size_t>(r1) * G;
  static_assert(32 * kGemvUnroll / 8 == 32, "one scale group per lane per iteration");
  const int lane = threadIdx.x % 32, g = (c0 - lane) / 8 + lane;
  // The step condition is warp-uniform, as in dot_iter. (With a per-lane condition instead, ptxas
  // moved some of a burst's loads behind the math: sass_check.)
  if constexpr (WHOLE) {
    // Every lane of an active step is inside the row: each load is one base address plus a
    // constant, with no address arithmetic per chunk.
    const uint4* a = reinterpret_cast<const uint4*>(w0) + c0;
    const uint4* b = reinterpret_cast<const uint4*>(w1) + c0;
    const Steps<true> steps(c0, C);
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      if (steps.active(u)) {
        it.wa[u] = ld_stream16(a + 32 * u, policy);
        it.wb[u] = ld_stream16(b + 32 * u, policy);
      }
    }
  } else {
    // A lane past the row's end re-reads the row's last chunk.
    const Steps<false> steps(c0, C);
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int c = c0 + 32 * u;
      if (steps.active(u)) {
        it.wa[u] = ld_stream16(reinterpret_cast<const uint4*>(w0 + 16 * min(c, C - 1)), policy);
        it.wb[u] = ld_stream16(reinterpret_cast<const uint4*>(w1 + 16 * min(c, C - 1)), policy);
      }
    }
  }
  if (g < G) {
    it.sa = __ldg(s0 + g);
    it.sb = __ldg(s1 + g);
  }
}

// One iteration's math. Chunks past the row's end (K not a multiple of 512) belong to whole lane
// groups (C is a multiple of 8), so they only touch their own groups' diagonal entries, which are not
// accumulated (their x reads land in the staging's padding); the products are warp-wide and run
// whenever any lane's chunk is in range. (c >> 2) & 1 is the same for c0 + 32 u as for c0, so the
// swizzle is fixed per iteration and each x load is a base register plus a constant.
template <bool WHOLE>
static __device__ __forceinline__ void dot_iter(const Iter& it, const uint4* xs, int c0, int C, float& acc0,
                                                float& acc1) {
  const int lane = threadIdx.x % 32;
  const Steps<WHOLE> steps(c0, C);
  const bool odd = (lane >> 2) & 1;  // which column of D holds this lane's diagonal entries
  const uint32_t x_lo = static_cast<uint32_t>(__cvta_generic_to_shared(xs + x_slot(c0, 0)));
  const uint32_t x_hi = static_cast<uint32_t>(__cvta_generic_to_shared(xs + x_slot(c0, 1)));
#pragma unroll
  for (int u = 0; u < kGemvUnroll; ++u) {
    const int c = c0 + 32 * u;
    if (steps.active(u)) {
      float d[4];
      dot_chunk(it.wa[u], it.wb[u], x_lo + 1024 * u, x_hi + 1024 * u, d);
      const float sa = __shfl_sync(0xffffffffu, it.sa, (lane >> 3) + 4 * u);  // group c / 8
      const float sb = __shfl_sync(0xffffffffu, it.sb, (lane >> 3) + 4 * u);
      if (WHOLE || c < C) {
        acc0 = fmaf(odd ? d[1] : d[0], sa, acc0);
        acc1 = fmaf(odd ? d[3] : d[2], sb, acc1);
      }
    }
  }
}

// 16 bytes global -> shared without registers (cp.async, through L2: coherent for data of earlier
// kernels). Its completion is tracked apart from the weight loads' scoreboard, so staging x never
// waits for the weights in flight (top of the file).
static __device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}
static __device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// The same for weights: evict-first in L2 like ld_stream16 (loads.cuh), and 4-byte copies for scales.
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
// first (kernel comment: products of one-iteration rows with at most two pairs per warp). Lane l's
// chunks sit at [u][l] of each row, so a lane reads back exactly what it copied: no barrier, only
// the lane's own cp.async.wait_all. The copies do not share the weight loads' scoreboard (top of
// the file), so the first pair's math does not wait for them.
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

// Tickets: the gate/up product's row pairs past the first round are handed out by atomic counters
// instead of by a fixed stride, so a warp whose round trips come back sooner takes more of them and
// the product's last warps exit closer together (8B: 6.8 row pairs per warp). Pairs stride + j + 64 t
// are counted out by counter j, which the warps whose first pair is j mod 64 share: atomics on one
// address serialize, and with 8 counters (264 warps each) the launch ran slower than with none
// (docs/PERF.md 2026-11-24, tickets). Each warp of class j grabs until a ticket comes back empty, so the
// grabs on counter j are its pairs plus its warps, and the warp that takes the last value sets the
// counter back to 0 for the next launch. Every grab follows the PDL wait, so two launches never
// count on the same counters at once if they share a stream.
constexpr int kTicketClasses = 64;
constexpr int kTicketStride = 128 / sizeof(unsigned);  // counters one 128-byte line apart
static_assert(kGemvTicketBytes == kTicketClasses * kTicketStride * sizeof(unsigned),
              "one counter per 128-byte line");

// Shared memory of a block: x as the products read it (K fp16, swizzled, padded), and for In::NORM the raw
// residual row (K fp32) and the norm weight (K bf16) it is computed from.
struct Staging {
  uint4* xs;
  float* raw;
  bf16* norm_w;
  __device__ Staging(uint4* smem, int K)
      : xs(smem), raw(reinterpret_cast<float*>(smem + x_padded(K) / 8)), norm_w(reinterpret_cast<bf16*>(raw + K)) {}
  // x's slots run to a multiple of 512 values (32 chunks): a 32-chunk step that dot_iter runs for
  // some lanes reads inside the buffer for all of them.
  __host__ __device__ static int x_padded(int K) { return CEIL_DIV(K, 512) * 512; }
};
template <In IN>
__host__ __device__ static size_t staging_bytes(int K) {
  return Staging::x_padded(K) * sizeof(f16) + (IN == In::NORM ? static_cast<size_t>(K) * (sizeof(float) + sizeof(bf16)) : 0);
}

// In::NORM, before the PDL wait: the norm weight (immutable) on its way into shared memory.
template <In IN>
static __device__ void stage_weights(const Product& P, const Staging& st) {
  if constexpr (IN == In::NORM) {
    for (int v = threadIdx.x; v < P.K / 8; v += kGemvThreads) cp_async16(st.norm_w + 8 * v, P.norm_w + 8 * v);
  }
}

// Stage x into shared memory as fp16 (swizzled) and return the factor the products' sums are
// multiplied by: fp16 x is copied as is; the RMSNorm of the fp32 residual stream is rounded to fp16
// exactly as rmsnorm.cu does (same 256-thread reduction tree, on a copy of the row in shared memory);
// bf16 x is multiplied by a power of two 2^s that puts its largest magnitude in [2^14, 2^15), so
// every value within 2^-28 of the largest converts to fp16 exactly and none overflows, and the sums
// are multiplied back by 2^-s (exact).
template <In IN>
static __device__ float stage_x(const Product& P, float eps, const Staging& st, float* red, const WarpTrace& tr) {
  const int K = P.K;
  uint4* xs = st.xs;
  // Each loop below handles kStageBatch of a thread's 16-byte pieces at a time, all their loads
  // before any store: a store to shared memory may alias the next piece's load, so one piece at a
  // time is one shared-memory (or L2) round trip per piece (docs/PERF.md 2026-11-21).
  constexpr int kStageBatch = 4;
  if constexpr (IN == In::NORM) {
    // No barrier between the copies and the norm: block_inv_rms reads float4 v in thread v mod 256,
    // the thread that copied it (its own copies have landed once cp.async.wait_all returns).
    static_assert(kGemvThreads == 256, "the copies' mapping is block_inv_rms's");
    const float* xf = static_cast<const float*>(P.x);
    for (int v = threadIdx.x; v < K / 4; v += kGemvThreads) cp_async16(st.raw + 4 * v, xf + 4 * v);
    cp_async_wait_all();  // this thread's copies (and its norm weight copies) have landed
    tr.stamp(trace::kLanded);
    const float r = block_inv_rms<kGemvThreads>(st.raw, K, eps, red);  // its barrier publishes every copy
    tr.stamp(trace::kReduced);
    // 4 values per piece: a float4 of the row, 4 norm weights, 4 fp16 into half of an x slot.
    const float4* raw4 = reinterpret_cast<const float4*>(st.raw);
    const uint2* nw4 = reinterpret_cast<const uint2*>(st.norm_w);
    uint2* xh4 = reinterpret_cast<uint2*>(xs);
    for (int v0 = threadIdx.x; v0 < K / 4; v0 += kStageBatch * kGemvThreads) {
      float4 a[kStageBatch];
      uint2 w[kStageBatch];
#pragma unroll
      for (int j = 0; j < kStageBatch; ++j) {
        const int v = v0 + j * kGemvThreads;
        if (v < K / 4) {
          a[j] = raw4[v];
          w[j] = nw4[v];
        }
      }
#pragma unroll
      for (int j = 0; j < kStageBatch; ++j) {
        const int v = v0 + j * kGemvThreads;
        if (v < K / 4) {
          const bf16* wv = reinterpret_cast<const bf16*>(&w[j]);
          const __half2 lo = __halves2half2(rmsnorm_value(a[j].x, r, wv[0]), rmsnorm_value(a[j].y, r, wv[1]));
          const __half2 hi = __halves2half2(rmsnorm_value(a[j].z, r, wv[2]), rmsnorm_value(a[j].w, r, wv[3]));
          uint2 out;
          out.x = *reinterpret_cast<const uint32_t*>(&lo);
          out.y = *reinterpret_cast<const uint32_t*>(&hi);
          xh4[2 * x_slot(v / 4, (v / 2) % 2) + v % 2] = out;  // values 4v .. 4v + 3 of chunk v / 4
        }
      }
    }
    tr.stamp(trace::kConverted);
    return 1.f;
  } else {
    // 8 values per 16-byte piece = half v % 2 of chunk v / 2, copied with cp.async, not loaded into
    // registers: a register load shares the weight loads' scoreboard, so the first use of x would
    // wait for the early weight loads of this warp too (top of the file).
    const uint4* x8 = static_cast<const uint4*>(P.x);
    for (int v = threadIdx.x; v < K / 8; v += kGemvThreads) cp_async16(xs + x_slot(v / 2, v % 2), x8 + v);
    cp_async_wait_all();  // this thread's copies have landed; it reads only those below
    // This thread's pieces v0, v0 + 256, ... (up to kStageBatch of them) from their slots.
    auto own_pieces = [&](int v0, uint4 (&q)[kStageBatch]) {
#pragma unroll
      for (int j = 0; j < kStageBatch; ++j) {
        const int v = v0 + j * kGemvThreads;
        if (v < K / 8) q[j] = xs[x_slot(v / 2, v % 2)];
      }
    };
    float amax = 0.f;
    if constexpr (IN == In::BF16) {
      for (int v0 = threadIdx.x; v0 < K / 8; v0 += kStageBatch * kGemvThreads) {
        uint4 q[kStageBatch];
        own_pieces(v0, q);
#pragma unroll
        for (int j = 0; j < kStageBatch; ++j) {
          if (v0 + j * kGemvThreads >= K / 8) continue;
          const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&q[j]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(h[i]);
            amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
          }
        }
      }
    }
    tr.stamp(trace::kLanded);
    if constexpr (IN == In::F16) {
      return 1.f;
    } else {
#pragma unroll
      for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = amax;
      __syncthreads();
      tr.stamp(trace::kBarrier);
      amax = 0.f;
#pragma unroll
      for (int w = 0; w < kGemvWarps; ++w) amax = fmaxf(amax, red[w]);
      int s = 0;  // 0, inf and NaN: no scaling
      if (amax > 0.f && amax <= FLT_MAX) {
        int e;
        frexpf(amax, &e);  // amax < 2^e <= 2 amax
        s = max(-120, min(100, 15 - e));
      }
      const float up = ldexpf(1.f, s);
      for (int v0 = threadIdx.x; v0 < K / 8; v0 += kStageBatch * kGemvThreads) {  // the slots this thread wrote
        uint4 q[kStageBatch];
        own_pieces(v0, q);
#pragma unroll
        for (int j = 0; j < kStageBatch; ++j) {
          const int v = v0 + j * kGemvThreads;
          if (v >= K / 8) continue;
          uint32_t* w = reinterpret_cast<uint32_t*>(&q[j]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
            const __half2 h = __floats2half2_rn(f.x * up, f.y * up);
            w[i] = *reinterpret_cast<const uint32_t*>(&h);
          }
          xs[x_slot(v / 2, v % 2)] = q[j];
        }
      }
      tr.stamp(trace::kConverted);
      return ldexpf(1.f, -s);
    }
  }
}

// What an epilogue reads from earlier kernels, loaded by lane 0 right after the PDL wait, while x is
// staged, instead of after the math: the position (RopeKV), and for AddResidual the residual values
// of the warp's first row pair p0 (later pairs load theirs in the epilogue).
struct Prior {
  float r0, r1;
  int p0;
  int pos;
};

template <Ep EP>
static __device__ __forceinline__ Prior load_prior(const Product& P, const RowPairs<EP>& pairs, const RopeKVArgs& rope,
                                                   int p0) {
  Prior pr{0.f, 0.f, p0, 0};
  if (threadIdx.x % 32 != 0) return pr;
  if constexpr (EP == Ep::RopeKV) pr.pos = *rope.pos;  // plain (coherent) load: the previous step wrote it
  if constexpr (EP == Ep::AddResidual) {
    if (p0 < pairs.count()) {
      int r0, r1;
      pairs.rows(p0, r0, r1);
      const float* o = static_cast<const float*>(P.out);
      pr.r0 = __ldcg(o + r0);
      pr.r1 = __ldcg(o + r1);
    }
  }
  return pr;
}

// Row pair p's two complete sums (lane 0 of the warp stores them): apply the epilogue.
template <Ep EP>
static __device__ __forceinline__ void store_pair(const Product& P, const RowPairs<EP>& pairs, const RopeKVArgs& rope,
                                                  const Prior& pr, int p, float acc0, float acc1) {
  int r0, r1;
  pairs.rows(p, r0, r1);
  if constexpr (EP == Ep::SwiGLU) {
    const float silu = acc0 / (1.f + expf(-acc0));
    static_cast<uint16_t*>(P.out)[p] = act16_bits(silu * acc1, P.f16_overflow);  // act16.cuh
  } else if constexpr (EP == Ep::RopeKV) {
    const int half = pairs.half;
    const int pos = pr.pos;
    const bool in_cache = pos < rope.max_context;
    const size_t cache_row = static_cast<size_t>(in_cache ? pos : 0) * rope.Hkv * rope.D;
    if (p < pairs.qk_pairs) {
      // cos / sin of this pair's frequency, computed by the one lane that needs them (staging them
      // for the block before the products put a position load on the critical path).
      const int head = p / half, i = p % half;
      float c, sn, o1, o2;
      rope_cos_sin(pos, rope.inv_freq[i], c, sn);
      rope_rotate(acc0, acc1, c, sn, o1, o2);
      bf16* dst = nullptr;
      if (head < rope.H)
        dst = rope.q_out + static_cast<size_t>(head) * rope.D;
      else if (in_cache)
        dst = rope.k_cache + cache_row + static_cast<size_t>(head - rope.H) * rope.D;
      if (dst != nullptr) {
        dst[i] = __float2bfloat16(o1);
        dst[i + half] = __float2bfloat16(o2);
      }
    } else if (in_cache) {
      const int j = 2 * (p - pairs.qk_pairs);  // index into the v row
      rope.v_cache[cache_row + j] = __float2bfloat16(acc0);
      rope.v_cache[cache_row + j + 1] = __float2bfloat16(acc1);
    }
  } else {
    float* o = static_cast<float*>(P.out);
    const bool second = 2 * p + 1 < P.N;
    if constexpr (EP == Ep::Store) {
      o[r0] = acc0;
      if (second) o[r1] = acc1;
    } else if (p == pr.p0) {
      o[r0] = pr.r0 + acc0;
      if (second) o[r1] = pr.r1 + acc1;
    } else {
      o[r0] += acc0;
      if (second) o[r1] += acc1;
    }
  }
}

// A row pair's partial sums sit in the 8 lanes that hold D's diagonal (dot_chunk): reduce them,
// undo x's scaling, lane 0 stores, and the warp reconverges before its next loads (a lane left
// behind would replay the whole next row pair's loads and math on its own).
template <Ep EP>
static __device__ __forceinline__ void finish_pair(const Product& P, const RowPairs<EP>& pairs, const RopeKVArgs& rope,
                                                   const Prior& pr, int p, float acc0, float acc1, float x_scale,
                                                   uint64_t& top) {
  const int lane = threadIdx.x % 32;
  if ((lane & 3) != (lane >> 3)) acc0 = acc1 = 0.f;  // lane 4 g + q holds group g's sums iff q = g / 2
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    acc0 += __shfl_xor_sync(0xffffffffu, acc0, off);
    acc1 += __shfl_xor_sync(0xffffffffu, acc1, off);
  }
  if (lane == 0) {
    const float y0 = acc0 * x_scale, y1 = acc1 * x_scale;
    store_pair<EP>(P, pairs, rope, pr, p, y0, y1);
    if constexpr (EP == Ep::Store) {  // the head's argmax (P.best): lane 0's running max of what it stored
      int r0, r1;
      pairs.rows(p, r0, r1);
      top = max(top, argmax_key(y0, r0));
      if (2 * p + 1 < P.N) top = max(top, argmax_key(y1, r1));
    }
  }
  __syncwarp();
}

// Row pair p from the warp's chunk `base` on (lane l starts at base + l; acc0 / acc1 hold the sums of
// the chunks before), then its epilogue. The loop counts on the warp's chunk, not the lane's, so every
// lane makes the same trips: with a per-lane bound, a K whose chunks end within a warp's first 32
// (K = 256, or 4096 + 256) sent only some lanes into the warp-wide products and shuffles (a hang,
// seen with K = 256 and several row pairs per warp).
// SwiGLU's ticketed pairs (Tickets): with `grab`, lane 0 takes the warp's next ticket into *ticket
// right after the first iteration's loads are issued, so the atomic's round trip runs beside
// theirs (issued before them, it held the loads: they share its scoreboard).
template <Ep EP, bool WHOLE>
static __device__ __forceinline__ void finish_rows(const Product& P, const RowPairs<EP>& pairs, const RopeKVArgs& rope,
                                                   const Prior& pr, const uint4* xs, float x_scale, int p, int base,
                                                   float acc0, float acc1, uint64_t policy, WarpTrace& tr, uint64_t& top,
                                                   unsigned* grab = nullptr, unsigned* ticket = nullptr) {
  const int C = P.K / 16, lane = threadIdx.x % 32;
  int r0, r1;
  pairs.rows(p, r0, r1);
  for (; base < C; base += 32 * kGemvUnroll) {
    Iter it;
    load_iter<WHOLE>(it, P, r0, r1, base + lane, policy);
    if constexpr (EP == Ep::SwiGLU) {
      if (grab != nullptr && lane == 0) *ticket = atomicAdd(grab, 1u);
      grab = nullptr;
    }
    dot_iter<WHOLE>(it, xs, base + lane, C, acc0, acc1);
    tr.iter();
  }
  finish_pair<EP>(P, pairs, rope, pr, p, acc0, acc1, x_scale, top);
}

template <Ep EP, In IN, bool WHOLE>
static __global__ void __launch_bounds__(kGemvThreads, 2)
    gemv_w8a16_kernel(const Product P, float eps, const RopeKVArgs rope) {
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

  // Weights never depend on an earlier kernel: in P.pre_warps of the 8 warps (half; 6 or 8 in the
  // QKV product, 8 in the o product on fp16 x: GemvPlan) the first iteration of the first row pair
  // goes out to DRAM before the wait for the previous kernel (PDL), so that round trip overlaps the
  // previous kernel's tail and the staging of x (top of the file: why half, and why more there).
  const bool pre = threadIdx.x / 32 < P.pre_warps;
  Iter first;
  if (pre && p0 < n_pairs) {
    int r0, r1;
    pairs.rows(p0, r0, r1);
    load_iter<WHOLE>(first, P, r0, r1, lane, policy);
  }
  stage_weights<IN>(P, st);
  // The decode QKV product lets the attention after it launch only once the kernel before it has
  // completed (its own wait), so attention may read the KV cache of earlier steps before its wait
  // (attention_decode.cu, `early`). Its blocks need the SMs this grid holds anyway.
  if constexpr (EP != Ep::RopeKV) pdl_launch_dependents();
  pdl_wait();  // x (and, for AddResidual, out; for RopeKV, *pos) come from earlier kernels
  if constexpr (EP == Ep::RopeKV) pdl_launch_dependents();
  tr.stamp(trace::kWaited);

  // SwiGLU of several rounds: lane 0 takes the ticket of the warp's second row pair now, so its
  // round trip runs beside x's staging (Tickets above).
  const bool ticketed = EP == Ep::SwiGLU && P.tickets != nullptr;  // the launcher checks the counts
  const int t_class = p0 % kTicketClasses;
  unsigned* const t_ctr = ticketed ? P.tickets + kTicketStride * t_class : nullptr;
  unsigned ticket = 0;
  if (ticketed && lane == 0) ticket = atomicAdd(t_ctr, 1u);

  const Prior pr = load_prior<EP>(P, pairs, rope, p0);
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

  // A warp that loaded early starts its first row pair from those registers (a peeled copy: see
  // the top of the file); every other row pair runs the plain load-then-math loop.
  uint64_t top = 0;  // Store with P.best: lane 0's largest argmax key of the rows it stored
  int p = p0;
  if (pre && p < n_pairs) {
    float acc0 = 0.f, acc1 = 0.f;
    dot_iter<WHOLE>(first, st.xs, lane, P.K / 16, acc0, acc1);
    tr.iter();
    finish_rows<EP, WHOLE>(P, pairs, rope, pr, st.xs, x_scale, p, 32 * kGemvUnroll, acc0, acc1, policy, tr, top);
    p += stride;
  } else if (staged) {
    // A staged warp past kQkvPreWarps (none in the Llama 3 shapes: 3B and 8B stage 2 and 4 warps per
    // block) sums its first pair with the plain loop.
    finish_rows<EP, WHOLE>(P, pairs, rope, pr, st.xs, x_scale, p, 0, 0.f, 0.f, policy, tr, top);
    p += stride;
  }
  if (staged) {
    cp_async_wait_all();  // this lane's copies; it reads back only those
    Iter it;
    read_pair(it, *sp, P.K / 16);
    float acc0 = 0.f, acc1 = 0.f;
    dot_iter<WHOLE>(it, st.xs, lane, P.K / 16, acc0, acc1);
    tr.iter();
    finish_pair<EP>(P, pairs, rope, pr, p, acc0, acc1, x_scale, top);
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
      finish_rows<EP, WHOLE>(P, pairs, rope, pr, st.xs, x_scale, q, 0, 0.f, 0.f, policy, tr, top, grab, &ticket);
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
      finish_rows<EP, WHOLE>(P, pairs, rope, pr, st.xs, x_scale, p, 0, 0.f, 0.f, policy, tr, top);
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

// ---- launcher ----

// How many blocks of gemv_w8a16_kernel<EP, IN, WHOLE> with `smem` bytes of dynamic shared memory are resident at
// once on the current device: 2 per SM, fewer only if fewer fit. The first launch of a (device, smem)
// queries it and raises the kernel's dynamic limit to what it needs (not only above 48 KB: the
// default limit counts the static `red` too, so K = 12288, exactly 48 KB of x, failed); later launches
// take it from the cache, so eager mode does not pay the queries on every GEMV (a captured graph pays
// them once either way). Host-side, capture-safe.
template <Ep EP, In IN, bool WHOLE>
static int resident_blocks(size_t smem) {
  struct Seen {
    int device;
    size_t smem;
    int blocks;
  };
  static std::mutex mu;
  static std::vector<Seen> seen;  // one entry per (device, K) in use: a handful
  int device = 0;
  AF_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mu);
  size_t raised = 0;  // the largest limit set on this device so far
  for (const Seen& e : seen) {
    if (e.device != device) continue;
    if (e.smem == smem) return e.blocks;
    raised = std::max(raised, e.smem);
  }
  int sms = 0, smem_optin = 0;
  AF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  AF_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  AF_CHECK(smem <= static_cast<size_t>(smem_optin), "gemv_w8a16: K too large to stage x in shared memory");
  if (smem > raised)
    AF_CUDA_CHECK(cudaFuncSetAttribute(gemv_w8a16_kernel<EP, IN, WHOLE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  int per_sm = 0;
  AF_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_w8a16_kernel<EP, IN, WHOLE>, kGemvThreads,
                                                              smem));
  AF_CHECK(per_sm >= 1, "gemv_w8a16: kernel does not fit on an SM");
  seen.push_back({device, smem, sms * std::min(per_sm, 2)});
  return seen.back().blocks;
}

// How a decode GEMV of one shape runs: its grid, the warps per block that copy their second row pair
// into shared memory early (kernel comment; 0: none), its dynamic shared memory, and whether it
// hands out row pairs by ticket when the caller gives it counters (Tickets).
struct GemvPlan {
  int blocks, staged_warps, pre_warps;
  size_t smem;
  bool ticketed;
};

template <Ep EP, In IN, bool WHOLE>
static GemvPlan plan_gemv(int N, int K) {
  GemvPlan plan{0, 0, kGemvPreWarps, staging_bytes<IN>(K), false};
  // Every warp has a row pair when there are fewer pairs than resident warps (kernel comment). A
  // product with more takes every slot, the QKV product too: leaving 24 of them to the attention after
  // it measured faster once (docs/PERF.md), but no longer once attention ran in thread-block clusters,
  // which need several free slots of one GPC at once (none spare: 3B -0.2%, 8B -0.8% at contexts up
  // to 256, docs/PERF.md 2026-11-23). Since 67aa8ed only steps of at most 512 keys run in clusters;
  // deeper steps, plain launches again, have not been measured with spare slots.
  const int resident = resident_blocks<EP, IN, WHOLE>(plan.smem);
  const int n_pairs = RowPairs<EP>::count(N);
  plan.blocks = std::min(CEIL_DIV(n_pairs, kGemvWarps), resident);
  // QKV rows of one iteration (K <= 4096) and more pairs than warps, at most two per warp (3B and
  // 8B: 1.2 and 1.5 pairs per warp): the warps with a second pair copy it into shared memory
  // early, if the grid still fits with that much more shared memory. Warp w of block b has one iff
  // b + w * blocks < n_pairs - stride. Kill switch: ATOMFLOW_NO_STAGED_PAIR=1 (which also puts every
  // QKV warp back to loading early: the plan keeps kQkvPreWarps only with staged pairs).
  static const bool off = env_flag("ATOMFLOW_NO_STAGED_PAIR");
  const int stride = plan.blocks * kGemvWarps;
  if (EP == Ep::RopeKV && WHOLE && K <= 32 * kGemvUnroll * 16 && n_pairs > stride && n_pairs <= 2 * stride && !off) {
    const int warps = CEIL_DIV(n_pairs - stride, plan.blocks);
    const size_t smem = plan.smem + warps * sizeof(StagedPair);
    if (resident_blocks<EP, IN, WHOLE>(smem) == resident) {
      plan.staged_warps = warps;
      plan.smem = smem;
    }
  }
  // SwiGLU with more row pairs than warps and a warp of every ticket class. Kill switch:
  // ATOMFLOW_NO_TICKETS=1.
  static const bool no_tickets = env_flag("ATOMFLOW_NO_TICKETS");
  plan.ticketed = EP == Ep::SwiGLU && !no_tickets && n_pairs > stride && stride >= kTicketClasses;
  // Early-loading warps (kernel comment): in QKV 6 with staged pairs, else all 8. In the o product
  // (AddResidual on fp16 x, rows of one iteration, one pair per warp) all 8 too since its x comes
  // as fp16: its staging is one copy and a barrier, and the late warps' round trip after it ended
  // the product (3B -1.1%; down, of two iterations, was slower with 8 or 6: docs/PERF.md
  // 2026-11-24). Kill switch: ATOMFLOW_NO_EARLY_O=1.
  static const bool no_early_o = env_flag("ATOMFLOW_NO_EARLY_O");
  if (EP == Ep::RopeKV)
    plan.pre_warps = plan.staged_warps > 0 ? kQkvPreWarps : kGemvWarps;
  else if (EP == Ep::AddResidual && IN == In::F16 && WHOLE && K <= 32 * kGemvUnroll * 16 && n_pairs <= stride &&
           !no_early_o)
    plan.pre_warps = kGemvWarps;
  return plan;
}

template <Ep EP, In IN, bool WHOLE>
static void launch_gemv_as(Product P, float eps, const RopeKVArgs& rope, cudaStream_t stream) {
  const GemvPlan plan = plan_gemv<EP, IN, WHOLE>(P.N, P.K);
  P.staged_warps = plan.staged_warps;
  P.pre_warps = plan.pre_warps;
  if (!plan.ticketed) P.tickets = nullptr;
  af_launch(gemv_w8a16_kernel<EP, IN, WHOLE>, dim3(plan.blocks), dim3(kGemvThreads), plan.smem, stream, P, eps, rope);
}

// Rows of whole 32-chunk steps (K a multiple of 512: every Llama shape) take the variant whose loads
// need no clamp at the row's end (load_iter).
static bool whole_steps(int K) { return K % (32 * 16) == 0; }

// The plan of the variant a launch of this shape runs (for the queries at the end of the file).
template <Ep EP, In IN>
static GemvPlan plan_of(int N, int K) {
  return whole_steps(K) ? plan_gemv<EP, IN, true>(N, K) : plan_gemv<EP, IN, false>(N, K);
}

template <Ep EP, In IN>
static void launch_gemv(const uint8_t* w, const float* scales, const void* x, const bf16* norm_w, float eps, int N,
                        int K, void* out, const RopeKVArgs& rope, cudaStream_t stream, unsigned* tickets = nullptr,
                        uint64_t* best = nullptr, int* f16_overflow = nullptr) {
  const Product P{w, scales, x, norm_w, N, K, out, 0, tickets, best, f16_overflow, 0};
  if (whole_steps(K))
    launch_gemv_as<EP, IN, true>(P, eps, rope, stream);
  else
    launch_gemv_as<EP, IN, false>(P, eps, rope, stream);
}

static void check_args(const uint8_t* w, const void* x, int N, int K) {
  AF_CHECK(N >= 1 && K >= kQuantGroup, "gemv_w8a16: N must be >= 1 and K >= 128");
  AF_CHECK(K % kQuantGroup == 0, "gemv_w8a16: K must be a multiple of 128 (the scale group)");
  AF_CHECK(reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0,
           "gemv_w8a16: w and x must be 16-byte aligned");
}

template <In IN>
static void dispatch_gemv(const uint8_t* w, const float* scales, const void* x, const bf16* norm_w, float eps, int N,
                          int K, Epilogue ep, void* out, cudaStream_t stream, unsigned* tickets,
                          int* f16_overflow) {
  check_args(w, x, N, K);
  AF_CHECK(f16_overflow == nullptr || ep == Epilogue::SwiGLU, "gemv_w8a16: an fp16 output is SwiGLU's only");
  const RopeKVArgs none{};
  switch (ep) {
    case Epilogue::Store:
      launch_gemv<Ep::Store, IN>(w, scales, x, norm_w, eps, N, K, out, none, stream);
      break;
    case Epilogue::AddResidual:
      launch_gemv<Ep::AddResidual, IN>(w, scales, x, norm_w, eps, N, K, out, none, stream);
      break;
    case Epilogue::SwiGLU:
      AF_CHECK(N % 2 == 0, "gemv_w8a16: SwiGLU needs N = 2F (gate rows, then up rows)");
      launch_gemv<Ep::SwiGLU, IN>(w, scales, x, norm_w, eps, N, K, out, none, stream, tickets, nullptr, f16_overflow);
      break;
    default: AF_CHECK(false, "gemv_w8a16: unknown epilogue");
  }
}

void gemv_w8a16(const uint8_t* w, const float* scales, const void* x, Act x_type, int N, int K, Epilogue ep,
                void* out, cudaStream_t stream, unsigned* tickets, int* f16_overflow) {
  if (x_type == Act::F16)
    dispatch_gemv<In::F16>(w, scales, x, nullptr, 0.f, N, K, ep, out, stream, tickets, f16_overflow);
  else
    dispatch_gemv<In::BF16>(w, scales, x, nullptr, 0.f, N, K, ep, out, stream, tickets, f16_overflow);
}

void gemv_w8a16_rmsnorm(const uint8_t* w, const float* scales, const float* x, const bf16* norm_w, float eps, int N,
                        int K, Epilogue ep, void* out, cudaStream_t stream, unsigned* tickets, int* f16_overflow) {
  AF_CHECK(norm_w != nullptr, "gemv_w8a16_rmsnorm: needs the norm weight");
  dispatch_gemv<In::NORM>(w, scales, x, norm_w, eps, N, K, ep, out, stream, tickets, f16_overflow);
}

void gemv_w8a16_rmsnorm_rope(const uint8_t* w, const float* scales, const float* x, const bf16* norm_w, float eps,
                             int K, const RopeKVArgs& rope, cudaStream_t stream) {
  AF_CHECK(norm_w != nullptr, "gemv_w8a16_rmsnorm_rope: needs the norm weight");
  AF_CHECK(rope.H >= 1 && rope.Hkv >= 1 && rope.max_context >= 1,
           "gemv_w8a16_rmsnorm_rope: H, Hkv, max_context must be >= 1");
  AF_CHECK(rope.D >= 2 && rope.D % 2 == 0 && rope.D <= kMaxRopeHeadDim,
           "gemv_w8a16_rmsnorm_rope: head_dim must be even and <= 1024");
  AF_CHECK(rope.inv_freq && rope.pos && rope.q_out && rope.k_cache && rope.v_cache,
           "gemv_w8a16_rmsnorm_rope: null pointer argument");
  const int N = (rope.H + 2 * rope.Hkv) * rope.D;
  check_args(w, x, N, K);
  launch_gemv<Ep::RopeKV, In::NORM>(w, scales, x, norm_w, eps, N, K, nullptr, rope, stream);
}

void gemv_w8a16_rmsnorm_argmax(const uint8_t* w, const float* scales, const float* x, const bf16* norm_w, float eps,
                               int N, int K, float* out, uint64_t* block_best, cudaStream_t stream) {
  AF_CHECK(norm_w != nullptr && block_best != nullptr, "gemv_w8a16_rmsnorm_argmax: needs the norm weight and block_best");
  check_args(w, x, N, K);
  launch_gemv<Ep::Store, In::NORM>(w, scales, x, norm_w, eps, N, K, out, RopeKVArgs{}, stream, nullptr, block_best);
}

int gemv_argmax_blocks(int N, int K) {
  AF_CHECK(N >= 1 && K >= kQuantGroup && K % kQuantGroup == 0, "gemv_argmax_blocks: N >= 1, K a multiple of 128");
  return plan_of<Ep::Store, In::NORM>(N, K).blocks;
}

int gemv_qkv_staged_warps(int H, int Hkv, int D, int K) {
  AF_CHECK(H >= 1 && Hkv >= 1 && D >= 2 && K >= kQuantGroup && K % kQuantGroup == 0,
           "gemv_qkv_staged_warps: H, Hkv >= 1, D >= 2, K a multiple of 128");
  const int N = (H + 2 * Hkv) * D;
  return plan_of<Ep::RopeKV, In::NORM>(N, K).staged_warps;
}

bool gemv_swiglu_ticketed(int N, int K, bool norm) {
  AF_CHECK(N >= 2 && N % 2 == 0 && K >= kQuantGroup && K % kQuantGroup == 0,
           "gemv_swiglu_ticketed: N even and >= 2, K a multiple of 128");
  return norm ? plan_of<Ep::SwiGLU, In::NORM>(N, K).ticketed : plan_of<Ep::SwiGLU, In::F16>(N, K).ticketed;
}

}  // namespace atomflow::kernels

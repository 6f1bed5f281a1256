// Causal GQA attention over a KV cache, contiguous or paged (flash-decoding), for decode (M = 1)
// and prefill chunks (M > 1), one sequence or a batch, in ONE kernel launch (no separate merge
// pass). One idea, hence one file past the usual size: the key loop and both merges share the
// partials' layout and summation order, which is what makes their results bit-identical.
// Each block = (split of the keys, kv head, tile of QT query tokens of one sequence)
// streams its keys once for all G = H / Hkv query heads of the group and makes an unnormalized
// partial (m, l, acc[D]) per query row. The splits' partials are merged in one of two ways:
//  - In a cluster (short contexts). When one thread-block cluster holds every split of a group
//    (s_max <= 16 for the Llama decode shapes; cluster_splits), the grid runs in clusters of a
//    group's splits. Each
//    writes its partial into the shared memory of the cluster's leader (split 0), arrives on the
//    cluster barrier and exits; the leader waits on the barrier and merges. No scratch, no ticket,
//    no round trip through L2.
//  - Through the scratch (more splits than a cluster holds). Each block writes its partial to the
//    scratch and takes a ticket from its group's counter (one per query tile x kv head, in the
//    scratch); the group's last block merges the partials of all the active splits for its
//    R = G * QT rows, writes the bf16 output and resets the counter to 0, so every call leaves the
//    counters as it found them (zero: the caller clears them once, attention_scratch_clear).
// Both merges sum the splits in the same order, fixed by the shapes alone: the result does not
// depend on which block came last, nor on which way the partials travelled.
//
// Split policy: the grid is fixed by (B, M, Hkv, capacity) so one captured graph serves every
// position; blocks read the position and derive their key range. With n_keys = start + M (a
// sequence's keys after this call), it first takes n = min(s_max, ceil(n_keys / 32)) splits, where
// s_max = min(64, max(128 / (B * M), 1), ceil(capacity / 32)) (capacity = max_context for the
// core, B = 1; 32 in place of 64 for a halved plan, kHalvedMaxSplits), then rounds their length
// up to whole K/V steps of the block (32 keys for the Llama 3 shapes): chunk = ceil(ceil(n_keys / n)
// / step) * step, n_active = ceil(n_keys / chunk). Short contexts spread over splits of one step each
// (latency stays low); long ones use up to 64 splits of several steps each (M = 1, Hkv = 8: 512
// blocks, one wave at 4 per SM on 132 SMs). Blocks past n_active exit. n depends on the capacity only
// through s_max >= min(64, ceil(n_keys / 32)), so any capacity that holds the keys gives the same
// splits and the same bits: the core plans the grid of steps of at most 512 keys for 512
// (step_plan.h, kShortKeys). Why 64 and 32, and what more splits cost: docs/design/attention_decode.md.
//
// Inside a block: D / 8 lanes hold one key row (16 B each; padded to a power of two, kLanesPerRow),
// so a warp covers 32 / kLanesPerRow<D> keys per load; each such lane group is an independent "key stream" with its own
// online softmax (scores in the log2 domain, q prescaled by scale * log2 e) over KT keys per step (all K and V loads of
// the step issued first). Streams are merged in-warp by shuffles, then across warps in shared memory.
//
// Addressing policies (STYLE.md habit 11: one kernel, several variants): the kernel is templated
// on where sequence b's keys live. ContiguousKV is the core engine's cache (row p of a
// [capacity, Hkv, D] array per sequence); PagedKV is the sandbox's (key p in block table[p / bs],
// slot p % bs, of a [num_blocks, bs, Hkv, D] pool). Batching = grid.z walks (sequence, query tile);
// each sequence has its own length. RopedKV is the contiguous cache of a decode step whose QKV
// product left its row raw (Qwen3's per-head q/k RMSNorm): each block makes its query heads and its kv
// head's new key / value row itself (make_new_rows, rope_kv_append's arithmetic) instead of reading
// them. For the same keys and split count every policy does the same arithmetic in the same order
// (bit-identical results).
//
// Query heads per block: the exact instances (head_dim 64 and 128, G = H / Hkv in {1, 2, 3, 4, 6, 8}:
// the Llama shapes) serve all G query heads of kv head blockIdx.x, with no mapping arithmetic in
// their machine code. Every other shape runs a HeadMapped<policy> instance, which carries a HeadMap:
// ratios 5 and 7 over two blocks of 3 or 4 heads, ratios past 8 over several blocks per kv head (a
// block's rows past its heads are masked), and head_dim 80, 96, 256 (for_shape picks from the shape).
//
// Contract of attention_kernel<KV, D, G, QT>, grid (Hkv x blocks per kv head (1 unless HeadMapped),
// splits padded to whole clusters, B x query tiles) x 128 threads, in clusters of (1, plan.cluster, 1)
// when plan.cluster > 1:
//  Inputs   q bf16 [B * M, H, D]; K / V bf16 rows as the policy addresses them ([capacity, Hkv, D]
//           per sequence for ContiguousKV); the sequence's start (*pos, or lens[b] - M) in device
//           memory; scale folded into q with log2 e. D in {64, 80, 96, 128, 256}; G in {1,2,3,4,6,8}
//           (1..4 at D = 256) query heads per block: H / Hkv exactly, or HeadMapped's share of the
//           call's H / Hkv in 1..16 (kv head blockIdx.x / hm.blocks).
//  Before its PDL wait (pdl.cuh) only with `early` (the core's decode, whose QKV GEMV triggers after
//           its own wait): *pos and the cached K / V rows below it (earlier steps' rows). Otherwise
//           nothing: the wait comes first. RopedKV (M = 1) waits first, issues the cached rows below
//           *pos, then reads the raw QKV row (the previous kernel's output) for its rows.
//  Triggers its dependents (the o GEMV) after its key loop, not at its start.
//  Scratch  the merge counters (zero on entry, zero again on exit: attention_scratch_clear once),
//           then each split's unnormalized partials; a cluster merge uses the leader's shared memory.
//  Writes   out [B * M, H, D], bf16, or fp16 given f16_overflow (set to 1 when a value passes
//           kF16Max). Every output row is written once, by the group's last block or its leader.
//           RopedKV: also the cache rows of kv head h at *pos (K and V), by the block holding *pos that
//           serves h's first query heads; no q is stored.
//  Invariants  the splits' partials are summed in an order fixed by the shapes alone, so the output
//           does not depend on timing, on the merge path, or on the capacity the grid is planned for.
#include <cooperative_groups.h>
#include <algorithm>
#include <string>
#include <type_traits>

#include "atomflow/act16.cuh"
#include "atomflow/kernels.h"
#include "atomflow/pdl.cuh"
#include "atomflow/rope.cuh"
#include "atomflow/trace.cuh"

namespace atomflow::kernels {

namespace cg = cooperative_groups;

#ifdef ATOMFLOW_TRACE
static __device__ trace::Buf g_trace;  // set by attention_trace_arm (trace.cuh)
void attention_trace_arm(const trace::Buf& b) { AF_CUDA_CHECK(cudaMemcpyToSymbol(g_trace, &b, sizeof(b))); }
#endif
// Attention's trace stamps (thread 0 of each active block): entry, cached rows issued, wait passed,
// key loop done, partial written, ticket taken, merge written.
enum AttnStamp { kAEntry, kAIssued, kAWaited, kALoop, kAPartial, kATicket, kAMerged };

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kMinKeysPerSplit = 32;  // short contexts: many blocks, one K/V step each
constexpr int kMaxSplits = 64;        // splits of one query row's keys
// A halved plan's (AttnPlan::halved): two blocks per kv head, so half the splits keep the grid at the
// unhalved plan's 512 blocks (Qwen3-8B) from 1024 keys on, one wave where 64 splits took two (H100,
// bench_kernels.py --sections attention_qkv, q/k norms, halved, 319fb60 -> 7d93a59: 2048 keys 10.28 ->
// 9.52 us, 4096 18.01 -> 12.87; the cap alone, 64 / 32 / 16 splits: log 2026-11-26 i).
constexpr int kHalvedMaxSplits = 32;
constexpr int kMaxSplitBlocks = 128;  // splits x query rows of one call (prefill chunks, batches)
// The most splits per thread-block cluster, by the leader's buffer. A call runs in clusters only when
// one holds all its splits (cluster_splits); a group's active splits then merge through the leader's
// shared memory (below).
template <int R, int D>
constexpr int kClusterSplits = R * D <= 512 ? 16 : (R * D <= 768 ? 8 : 4);  // the leader's buffer: <= 32 KB
constexpr float kNegInit = -1e30f;  // finite "no key yet": exp2(kNegInit - kNegInit) = 1, never NaN

// Lanes per key row: D / 8 (16 B each) rounded up to a power of two, so a row's lanes form an
// aligned group the xor shuffles stay inside. Head dims 80 and 96 take the 128 layout: their lanes
// past D / 8 load nothing and hold zeros (the loads, hence the bytes read, are D's own).
template <int D>
constexpr int kLanesPerRow = D / 8 <= 8 ? 8 : (D / 8 <= 16 ? 16 : 32);

// The most query heads of one kv head per block. A block holds R = G x QT query rows, each with 8 q
// values and 8 accumulators per lane: at most 8 rows keep the key loop off the stack (G = 8 uses
// ~225 registers). At D = 256 the rows' shared memory (sm_acc, 4 KB per row, and the leader's
// buffer) allows 4 of the 48 KB static limit.
template <int D>
constexpr int kMaxGroup = D <= 128 ? 8 : 4;

// Which query heads a block serves. A kv head's `group` = H / Hkv query heads are served by `blocks`
// blocks (grid.x = Hkv x blocks) of `per` heads each (the last may hold fewer): one block when the
// group fits kMaxGroup, otherwise each block streams the kv head's keys for its share (the second
// read of a key mostly from L2: the blocks of one kv head are adjacent in grid.x). The kernel is
// built for G in {1, 2, 3, 4, 6, 8} (at D = 256: 1..4); a block of `per` heads runs the smallest
// G >= per and masks its rows past `per` (no loads, no keys, no writes).
struct HeadMap {
  int group;   // H / Hkv
  int blocks;  // blocks per kv head (grid.x = Hkv x blocks)
  int per;     // query heads per block (G >= per)
};

// The merge counters, one int per (sequence, query tile, kv head), at the start of the scratch
// with a size fixed by no call's shape: the engines share one scratch between calls of different
// B and M (decode, then a prefill chunk), and a call's partials must never land where a later
// call's counters are. Only calls with 2+ splits count, and those have B * M <= kMaxSplitBlocks / 2
// query rows (max_splits), hence at most kMaxSplitBlocks / 2 * grid.x counters (grid.x = Hkv x blocks
// per kv head, HeadMap). A multiple of 16 bytes: the float4 partials follow.
constexpr int kMaxKvHeads = 256;
constexpr size_t kCounterBytes = static_cast<size_t>(kMaxSplitBlocks / 2) * kMaxKvHeads * sizeof(int);

// Splits planned for (grid.y and scratch): fixed by the query rows of the call (rows = B * M), the
// per-sequence key capacity and whether a halved plan halves the shape (halves() below) only. A batch
// shares the 128 splits' worth of blocks among its rows. The scratch is sized for the unhalved count.
static int max_splits(int rows, int capacity, bool fewer = false) {
  const int most = fewer ? kHalvedMaxSplits : kMaxSplits;
  const int shared = kMaxSplitBlocks / rows > 1 ? kMaxSplitBlocks / rows : 1;
  const int by_rows = shared < most ? shared : most;
  const int by_keys = CEIL_DIV(capacity, kMinKeysPerSplit);
  return by_rows < by_keys ? by_rows : by_keys;
}

// ---- KV addressing policies ----
// A policy answers, for sequence b of the call: where its first query sits (start), how many keys
// it may hold (capacity), and which row of the K / V arrays ([rows, Hkv, D]) holds key `key`. The
// row lookup is split in two so the paged table read can be issued a step ahead of its use:
// entry(b, key) is the (possibly loaded) handle, row(b, entry, key) the arithmetic.
// Positions and tables are written by the host or earlier kernels: coherent loads only (pdl.cuh).

// Sequence b's first query of this call is at position pos[b] + bias: the core passes its device
// position (*pos, bias 0, B = 1), the batched launchers pass lens[b] (keys after this call) with
// bias = -M.
struct SeqStart {
  const int32_t* pos;
  int bias;
  __device__ __forceinline__ int start(int b) const { return pos[b] + bias; }
};

// Each sequence owns `capacity` consecutive rows: k, v [B, capacity, Hkv, D].
struct ContiguousKV {
  const bf16* k;
  const bf16* v;
  SeqStart seq;
  int capacity;
  __device__ __forceinline__ int entry(int, int) const { return 0; }
  __device__ __forceinline__ size_t row(int b, int, int key) const { return static_cast<size_t>(b) * capacity + key; }
};

// The rows of one chunk as sequences of one query each (B = the chunk's rows, M = 1), all in one
// contiguous cache [capacity, Hkv, D]: row b is at position pos[0] + b and sees keys 0 .. pos[0] + b,
// split as a decode step at that position splits them (its own key count; the plan's s_max is a decode
// step's), so every row is bit-identical to that decode step (AttnPlan::rows_as_steps).
struct ChunkRowsKV {
  const bf16* k;
  const bf16* v;
  struct Start {
    const int32_t* pos;
    __device__ __forceinline__ int start(int b) const { return pos[0] + b; }
  } seq;
  int capacity;
  __device__ __forceinline__ int entry(int, int) const { return 0; }
  __device__ __forceinline__ size_t row(int, int, int key) const { return static_cast<size_t>(key); }
};

// The core's decode step (M = 1) on the QKV product's raw row (a split-QKV model: StepPlan::fused_qkv
// false, the per-head q/k RMSNorm): the contiguous cache, plus what rope_kv_append would take. Each
// block makes its query rows and, when its split holds *pos, its kv head's new key and value row
// (bias, norms, RoPE: rope_kv_append's arithmetic, so the same bits) in shared memory; the block that
// serves the kv head's first query heads also writes that row into the cache (k, v) for later steps.
struct RopedKV : ContiguousKV {
  const float* qkv;       // fp32 [(H + 2 Hkv) D], written by the previous kernel: coherent loads
  const float* inv_freq;  // [D / 2]
  QkvExtras ex;           // bias, q_norm / k_norm, eps (kernels.h)
};

// Key p of sequence b lives in block tables[b, p >> shift], slot p & (bs - 1): k, v
// [num_blocks, bs, Hkv, D], tables int32 [B, max_blocks]. A bad table entry is clamped into the
// pool so it can never read outside it (the block manager never writes one).
struct PagedKV {
  const bf16* k;
  const bf16* v;
  SeqStart seq;
  int capacity;  // max_blocks << shift
  const int32_t* tables;
  int max_blocks, shift, num_blocks;
  __device__ __forceinline__ int entry(int b, int key) const {
    const int e = __ldcg(tables + static_cast<size_t>(b) * max_blocks + (key >> shift));
    return min(max(e, 0), num_blocks - 1);
  }
  __device__ __forceinline__ size_t row(int, int e, int key) const {
    return (static_cast<size_t>(e) << shift) + (key & ((1 << shift) - 1));
  }
};

// Any policy above, with blocks serving a HeadMap's share of their kv head's query heads (grid.x =
// Hkv x hm.blocks) instead of exactly G: the shapes the exact instances are not built for
// (for_shape). The mapping's arithmetic is in these instances only.
template <class KV>
struct HeadMapped : KV {
  HeadMap hm;
};
template <class KV>
constexpr bool kHeadMapped = false;
template <class KV>
constexpr bool kHeadMapped<HeadMapped<KV>> = true;
// Whether a policy's blocks make their query rows and the new K / V row from the raw QKV row (RopedKV,
// mapped or not).
template <class KV>
constexpr bool kRoped = std::is_base_of_v<RopedKV, KV>;
// Whether a policy's calls split each query row as a decode step (ChunkRowsKV, mapped or not).
template <class KV>
constexpr bool kRowsAsSteps = std::is_same_v<KV, ChunkRowsKV> || std::is_same_v<KV, HeadMapped<ChunkRowsKV>>;

// The block's kv head h and its query heads first_head(h) .. first_head(h) + block_heads() - 1 (at
// most G). Functions, not values: an exact instance computes h * G at each use (held in a variable, it
// moved the Llama shapes' machine code and registers: docs/design/attention_decode.md).
template <class KV>
static __device__ __forceinline__ int kv_head(const KV& kv) {
  if constexpr (kHeadMapped<KV>)
    return blockIdx.x / kv.hm.blocks;
  else
    return blockIdx.x;
}
template <int G, class KV>
static __device__ __forceinline__ int first_head(const KV& kv, int h) {
  if constexpr (kHeadMapped<KV>)
    return h * kv.hm.group + blockIdx.x % kv.hm.blocks * kv.hm.per;
  else
    return h * G;
}
template <int G, class KV>
static __device__ __forceinline__ int block_heads(const KV& kv) {
  if constexpr (kHeadMapped<KV>)
    return min(kv.hm.per, kv.hm.group - blockIdx.x % kv.hm.blocks * kv.hm.per);
  else
    return G;
}

// Keys seen by the last query of sequence b, clamped so a bad position never reads past its capacity.
template <class KV>
static __device__ __forceinline__ int call_keys(const KV& kv, int b, int M) {
  return min(max(kv.seq.start(b) + M, 1), kv.capacity);
}
// How a call's n_keys are split (the policy above): n_active splits of `chunk` keys, a multiple of
// the block's keys per step. Rounding never adds a step to a split, and never raises n_active.
struct SplitPlan {
  int n_active, chunk;
};
template <int STEP>
static __device__ __forceinline__ SplitPlan plan_splits(int n_keys, int s_max) {
  const int n = min(s_max, CEIL_DIV(n_keys, kMinKeysPerSplit));
  const int chunk = CEIL_DIV(CEIL_DIV(n_keys, n), STEP) * STEP;
  return {CEIL_DIV(n_keys, chunk), chunk};
}

static __device__ __forceinline__ uint4 ld_kv(const bf16* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

static __device__ __forceinline__ void bf16x8_to_float(uint4 v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

// RopedKV's prologue: query heads first .. first + nq - 1 into sq, and with `owns` (the block's keys
// hold *pos) kv head h's new key and value rows into snew, each a bf16 row as rope_kv_append writes it:
// its arithmetic in its order (one warp per head: a lane's squares in ascending columns, the butterfly,
// the inverse RMS, then per rotation pair (x r) w and rope_rotate), so the bits are the same. Every
// task's raw values are loaded at once (one L2 round trip), the cos / sin of pos's angles computed while
// they travel; with `early` (the QKV product launched this kernel after its own wait) the cos / sin come
// before this kernel's PDL wait and only the raw row after it. With `writes` the block also stores the
// new rows in the cache at *pos for later steps; its own keys take them from snew. cs: D floats of
// shared memory (cos, then sin).
template <int D, int R>
static __device__ __forceinline__ void make_new_rows(const RopedKV& kv, int H, int Hkv, int h, int first, int nq,
                                                     int pos, bool owns, bool writes, bool early, bf16 (&sq)[R][D],
                                                     bf16 (&snew)[2][D], float* cs) {
  constexpr int half = D / 2;
  constexpr int kCols = CEIL_DIV(D, 32);               // a lane's columns of a head: lane + 32 j
  constexpr int kTasks = CEIL_DIV(R + 2, kAttnWarps);  // a warp's heads, at most
  constexpr bool kPairsInLane = D % 64 == 0;           // pair (c, c + D/2): columns j and j + D/64 of a lane
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const QkvExtras& ex = kv.ex;
  const auto value = [&](int c) { return ex.bias != nullptr ? __fadd_rn(kv.qkv[c], ex.bias[c]) : kv.qkv[c]; };
  const int tasks = nq + (owns ? 2 : 0);  // q heads, then the new key, then the new value
  // Task t's head in qkv: a q head, the k head, the v head.
  const auto head_of = [&](int t) { return t < nq ? first + t : (t == nq ? H + h : H + Hkv + h); };
  const auto angles = [&] {
    for (int i = threadIdx.x; i < half; i += kAttnThreads) rope_cos_sin(pos, kv.inv_freq[i], cs[i], cs[half + i]);
  };
  if (early) {
    angles();
    pdl_wait();
  }
  float x[kTasks][kCols];
#pragma unroll
  for (int s = 0; s < kTasks; ++s) {
    const int t = warp + s * kAttnWarps;
#pragma unroll
    for (int j = 0; j < kCols; ++j)
      x[s][j] = t < tasks && lane + 32 * j < D ? value(head_of(t) * D + lane + 32 * j) : 0.f;
  }
  if (!early) angles();
  __syncthreads();
#pragma unroll
  for (int s = 0; s < kTasks; ++s) {
    const int t = warp + s * kAttnWarps;
    if (t >= tasks) break;
    if (t == nq + 1) {
#pragma unroll
      for (int j = 0; j < kCols; ++j)
        if (lane + 32 * j < D) snew[1][lane + 32 * j] = __float2bfloat16(x[s][j]);
      continue;
    }
    const bool is_q = t < nq;
    bf16* dst = is_q ? sq[t] : snew[0];
    float r = 1.f;
    const bf16* w = nullptr;
    if (ex.q_norm != nullptr) {
      float ss = 0.f;
#pragma unroll
      for (int j = 0; j < kCols; ++j)
        if (lane + 32 * j < D) ss = fmaf(x[s][j], x[s][j], ss);
#pragma unroll
      for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      r = rsqrtf(ss / static_cast<float>(D) + ex.eps);
      w = is_q ? ex.q_norm : ex.k_norm;
    }
    const int c0 = head_of(t) * D;
#pragma unroll
    for (int j = 0; j < CEIL_DIV(half, 32); ++j) {
      const int i = lane + 32 * j;
      if (i >= half) break;
      float x1, x2;
      if constexpr (kPairsInLane) {
        x1 = x[s][j];
        x2 = x[s][j + half / 32];
      } else {
        x1 = value(c0 + i);
        x2 = value(c0 + i + half);
      }
      if (w != nullptr) {
        x1 = x1 * r * __bfloat162float(w[i]);
        x2 = x2 * r * __bfloat162float(w[i + half]);
      }
      float o1, o2;
      rope_rotate(x1, x2, cs[i], cs[half + i], o1, o2);
      dst[i] = __float2bfloat16(o1);
      dst[i + half] = __float2bfloat16(o2);
    }
  }
  __syncthreads();
  if (owns && writes) {
    constexpr int C16 = D / 8;  // 16-byte pieces of a row
    const size_t at = (static_cast<size_t>(pos) * Hkv + h) * D;
    for (int i = threadIdx.x; i < 2 * C16; i += kAttnThreads) {
      // The caches this kernel reads: its key loads are .cg and asm volatile, never cached across this store.
      bf16* dst = const_cast<bf16*>(i < C16 ? kv.k : kv.v) + at;
      reinterpret_cast<uint4*>(dst)[i % C16] = reinterpret_cast<const uint4*>(snew[i / C16])[i % C16];
    }
  }
}

// Four outputs at float4 column c of output row o_row, already divided by l: bf16, or fp16 given
// f16_overflow (the decode step, act16.cuh).
template <int D>
static __device__ __forceinline__ void store_out4(void* __restrict__ out, size_t o_row, int c, float a, float b,
                                                  float cc, float d, int* f16_overflow) {
  const uint2 packed{act16x2_bits(a, b, f16_overflow), act16x2_bits(cc, d, f16_overflow)};
  reinterpret_cast<uint2*>(static_cast<uint16_t*>(out) + o_row * D)[c] = packed;
}

// The leader's merge of its cluster's n_splits partials (shared memory, [split][row][float4 column]):
// the same arithmetic in the same order as the merge from the scratch in attention_kernel (each
// output sums SPL contiguous ranges of splits, then adds the ranges in order), so a group's output
// has the same bits whichever way its partials travelled.
template <int R, int D, int G, int SPL, int CS, class KV>
static __device__ __forceinline__ void merge_in_cluster(const float4 (&acc)[CS][R][D / 4], const float2 (&ml)[CS][R],
                                                        int n_splits, int b, int M, int m0, int H, const KV& kv, int h,
                                                        int nq, void* __restrict__ out, int* f16_overflow) {
  constexpr int C4 = D / 4;
  const int per = CEIL_DIV(n_splits, SPL);
  for (int idx = threadIdx.x; idx < R * C4; idx += kAttnThreads) {
    const int r = idx / C4, c = idx % C4;
    if (m0 + r / G >= M || (kHeadMapped<KV> && r % G >= nq)) continue;
    float mx = kNegInit;
    for (int s = 0; s < n_splits; ++s) mx = fmaxf(mx, ml[s][r].x);
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    float l = 0.f;
#pragma unroll
    for (int part = 0; part < SPL; ++part) {
      float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
      float tl = 0.f;
      for (int s = part * per; s < min(n_splits, part * per + per); ++s) {
        const float w = exp2f(ml[s][r].x - mx);
        const float4 a = acc[s][r][c];
        t.x = fmaf(w, a.x, t.x);
        t.y = fmaf(w, a.y, t.y);
        t.z = fmaf(w, a.z, t.z);
        t.w = fmaf(w, a.w, t.w);
        tl = fmaf(w, ml[s][r].y, tl);
      }
      if (part == 0) {
        o = t;
        l = tl;
      } else {
        o.x += t.x;
        o.y += t.y;
        o.z += t.z;
        o.w += t.w;
        l += tl;
      }
    }
    const size_t o_row = (static_cast<size_t>(b) * M + m0 + r / G) * H + first_head<G>(kv, h) + r % G;
    const float inv_l = 1.f / l;  // > 0: split 0 holds key 0, seen by every query
    store_out4<D>(out, o_row, c, o.x * inv_l, o.y * inv_l, o.z * inv_l, o.w * inv_l, f16_overflow);
  }
}

// Query rows are (sequence b, token m) -> row b * M + m of q [B * M, H, D] and of the output.
// Partials: index ((row * H + head) * s_max + split); ml holds (max, sum) pairs, acc D floats.
// The partials are written and read back by blocks of the same grid: plain stores, .cg loads, and
// no __restrict__ on them (pdl.cuh: .nc must never see data written while the kernel runs).
//
// `early` (the core's decode, ContiguousKV only): the caller guarantees that every kernel before the
// previous one has completed when this one starts (the previous kernel, the QKV GEMV, lets it launch
// only after its own PDL wait, and every kernel waits before it completes). Then the position and the
// cache rows below it, written by earlier steps, are read BEFORE the wait: inactive splits leave at
// once, and the first step's cached keys are in flight while the QKV product finishes; only q and the
// new key (row pos, written by the QKV GEMV) are read after it.
// Instances of up to 4 query rows per block run four blocks per SM (128 registers) where the exact
// ContiguousKV ones do, without spilling: RopedKV's prologue holds the first step's rows in registers
// while it runs, and HeadMapped's arithmetic (two blocks of 3 or 4 heads for ratios 5 and 7) took them
// to ~150-168 registers, three blocks per SM (a second wave of blocks at long contexts). 6 and 8 heads
// spill at 128 and keep their ~220 (two per SM, as the exact instances); so does the sandbox's paged
// policy (its mapped 4 heads spill at 128).
// Keys per stream per step. A halved plan's blocks of two heads (mapped, head_dim 64 / 128) keep the
// unhalved block's 4: the same short splits on twice the blocks (Qwen3-8B decode -2.5%, log 2026-11-26
// i; with 8 a split held 64 keys and the halving paid only its prologue).
template <int R, int D, bool MAPPED>
constexpr int kKeysPerStream = R <= 2 && !(MAPPED && (D == 64 || D == 128)) ? 8 : (R <= 4 ? 4 : 2);
template <class KV>
constexpr int kAttnMinBlocks(int rows) {
  return (kRoped<KV> || (kHeadMapped<KV> && !std::is_base_of_v<PagedKV, KV>)) && rows <= 4 ? 4 : 1;
}
template <class KV, int D, int G, int QT>
static __global__ void __launch_bounds__(kAttnThreads, kAttnMinBlocks<KV>(G* QT))
    attention_kernel(const bf16* q, KV kv, int M, int H, int Hkv, int s_max, float q_scale, int* counters,
                     float* part_acc, float* part_ml, void* __restrict__ out, int* f16_overflow, bool early) {
  constexpr bool MAPPED = kHeadMapped<KV>;                        // rows past the block's heads are masked
  constexpr int LD = D / 8;                                       // lanes holding a key row's data (16 B each)
  constexpr int LPR = kLanesPerRow<D>;                            // lanes per key row: LD padded to a power of two
  constexpr int GPW = 32 / LPR;                                   // key streams per warp
  constexpr int NS = kAttnWarps * GPW;                            // key streams per block
  constexpr int R = G * QT;                                       // query rows per block
  constexpr int KT = kKeysPerStream<R, D, MAPPED>;                // keys per stream per step (registers: R x KT scores)
  constexpr int C4 = D / 4;                                       // float4 columns of a partial's acc
  constexpr int NO = R * C4;                                      // float4 outputs of the merge
  constexpr int IPT = CEIL_DIV(NO, kAttnThreads);                 // merge outputs per thread
  constexpr int SPL = NO < kAttnThreads ? kAttnThreads / NO : 1;  // merge threads per output
  constexpr int CS = kClusterSplits<R, D>;                        // the most splits per cluster (the leader's buffer)
  __shared__ float sm_m[kAttnWarps][R], sm_l[kAttnWarps][R];
  __shared__ float sm_acc[kAttnWarps][R][D];
  __shared__ float sm_w[R][kMaxSplits], sm_ls[R][kMaxSplits];  // merge: 2^(m_s - Mx) and l_s per split
  __shared__ float4 sm_part_o[SPL > 1 ? kAttnThreads : 1];     // merge: the SPL threads' sums
  __shared__ float sm_part_l[SPL > 1 ? kAttnThreads : 1];
  __shared__ float4 cl_acc[CS][R][C4];  // the leader's: the cluster's partials (acc, then (m, l))
  __shared__ float2 cl_ml[CS][R];
  __shared__ int sm_n_active;
  __shared__ bool sm_last;
  constexpr bool ROPED = kRoped<KV>;
  // RopedKV: the block's query rows and the new key / value row (make_new_rows), cos / sin of *pos.
  __shared__ __align__(16) bf16 sm_q[ROPED ? R : 1][ROPED ? D : 8];
  __shared__ __align__(16) bf16 sm_new[ROPED ? 2 : 1][ROPED ? D : 8];
  __shared__ float sm_cs[ROPED ? D : 1];
#ifdef ATOMFLOW_TRACE
  __shared__ uint64_t tr_t[trace::kStamps];
  const uint64_t t_entry = trace::now();
  auto stamp = [&](int slot) {
    if (threadIdx.x == 0) tr_t[slot] = trace::now();
  };
  auto flush = [&](bool merged) {
    if (threadIdx.x != 0) return;
    trace::Rec r{};
    r.id = reinterpret_cast<uint64_t>(kv.k);
    r.kind = 0x100u | (merged ? 0x10u : 0u);
    r.block = blockIdx.x | blockIdx.y << 16;
    r.warp = sm_n_active;
    r.K = call_keys(kv, 0, M);
    trace::write(g_trace, r, tr_t);
  };
#else
  auto stamp = [](int) {};
  auto flush = [](bool) {};
#endif

  // The next kernel (the o GEMV) may launch only once this block's keys are in: launched at the
  // start, its early weight loads compete with the K/V loads on this kernel's critical path
  // (docs/design/attention_decode.md).
  if (!early) pdl_wait();
  const int tiles = CEIL_DIV(M, QT);
  const int h = kv_head(kv), split = blockIdx.y, b = blockIdx.z / tiles, m0 = (blockIdx.z % tiles) * QT;
  // Row r = (token m0 + r / G, head first_head(h) + r % G) is a row of the call while valid(r).
  const int nq = block_heads<G>(kv);
  const auto valid = [&](int r) { return m0 + r / G < M && (!MAPPED || r % G < nq); };
  const int pos = kv.seq.start(b);
  const int n_keys = call_keys(kv, b, M);
  const auto [n_active, chunk] = plan_splits<NS * KT>(n_keys, s_max);
  if (split >= n_active) return;  // neither counted nor merged: the merge reads the active splits only
  // The merge needs n_active after the key loop: held in a register through it, it spilled
  // (PagedKV, G = 1); the barriers before the write-out publish it.
  if (threadIdx.x == 0) sm_n_active = n_active;
  // A block may write a peer's shared memory only once the peer runs: the cluster's active blocks
  // arrive here and wait (long since complete) just before their writes to the leader.
  if (n_active <= static_cast<int>(cg::this_cluster().num_blocks())) __cluster_barrier_arrive_relaxed();
#ifdef ATOMFLOW_TRACE
  if (threadIdx.x < trace::kStamps) tr_t[threadIdx.x] = 0;
  __syncthreads();
  if (threadIdx.x == 0) tr_t[kAEntry] = t_entry;
#endif
  const int m_last = min(m0 + QT, M) - 1;
  const int kb = split * chunk;
  const int ke = min(min(kb + chunk, pos + m_last + 1), n_keys);

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int grp = lane / LPR, li = lane % LPR;
  const int stream = warp * GPW + grp;
  const size_t key_stride = static_cast<size_t>(Hkv) * D;
  const bf16* k_base = kv.k + static_cast<size_t>(h) * D + li * 8;  // li >= LD: never loaded
  const bf16* v_base = kv.v + static_cast<size_t>(h) * D + li * 8;

  // This stream's keys of a step are base + j * NS + stream (j < KT). `entries` reads their row
  // handles (nothing for contiguous; a paged table is read one step ahead of its rows), `load_rows`
  // the K / V rows of those in [lo, hi), leaving the others as they are.
  int ent[KT] = {};
  auto entries = [&](int base) {
#pragma unroll
    for (int j = 0; j < KT; ++j) {
      const int key = base + j * NS + stream;
      if (key < ke) ent[j] = kv.entry(b, key);
    }
  };
  auto load_rows = [&](int base, int lo, int hi, uint4(&kd)[KT], uint4(&vd)[KT]) {
#pragma unroll
    for (int j = 0; j < KT; ++j) {
      const int key = base + j * NS + stream;
      if (key >= lo && key < hi && (LD == LPR || li < LD)) {
        if constexpr (ROPED) {
          if (key == pos) {  // the new row, made by this block (make_new_rows)
            kd[j] = reinterpret_cast<const uint4*>(sm_new[0])[li];
            vd[j] = reinterpret_cast<const uint4*>(sm_new[1])[li];
            continue;
          }
        }
        const size_t row = kv.row(b, ent[j], key);
        kd[j] = ld_kv(k_base + row * key_stride);
        vd[j] = ld_kv(v_base + row * key_stride);
      }
    }
  };

  // The first step's rows: with `early`, those below pos before the wait and the rest after it;
  // RopedKV, those below pos before make_new_rows makes the row at pos (and waits, with `early`);
  // otherwise all after the wait.
  entries(kb);
  uint4 kr[KT], vr[KT];
#pragma unroll
  for (int j = 0; j < KT; ++j) kr[j] = vr[j] = make_uint4(0, 0, 0, 0);
  const int cached = early || ROPED ? pos : kb;  // keys below this are loaded first
  load_rows(kb, kb, min(ke, cached), kr, vr);
  stamp(kAIssued);
  if constexpr (ROPED) {
    bool writes = true;  // one block of the kv head stores the new row
    if constexpr (MAPPED) writes = blockIdx.x % kv.hm.blocks == 0;
    make_new_rows<D, R>(kv, H, Hkv, h, first_head<G>(kv, h), nq, pos, kb <= pos && pos < ke, writes, early, sm_q,
                        sm_new, sm_cs);
  } else if (early) {
    pdl_wait();
  }
  stamp(kAWaited);
  load_rows(kb, cached, ke, kr, vr);
  entries(kb + NS * KT);

  // Row r = (query token m0 + r / G, head first_head(h) + r % G): this lane's 8 q values, prescaled
  // (zero on a padding lane, li >= LD, and on a row past the call's, which sees no keys).
  float qf[R][8];
  int end_r[R];  // exclusive key bound of row r in this block (causal and split)
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int m = m0 + r / G;
    if (valid(r)) {
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (LD == LPR || li < LD) {
        if constexpr (ROPED) {
          raw = reinterpret_cast<const uint4*>(sm_q[r])[li];  // M = 1: row r is query head first + r
        } else {
          const size_t row = static_cast<size_t>(b) * M + m;
          raw = __ldcg(reinterpret_cast<const uint4*>(q + (row * H + first_head<G>(kv, h) + r % G) * D) + li);
        }
      }
      bf16x8_to_float(raw, qf[r]);
#pragma unroll
      for (int e = 0; e < 8; ++e) qf[r][e] *= q_scale;
      end_r[r] = min(ke, pos + m + 1);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) qf[r][e] = 0.f;
      end_r[r] = kb;  // no keys
    }
  }

  float m_run[R], l_run[R], acc[R][8];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m_run[r] = kNegInit;
    l_run[r] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
  }

  // One step's math on its rows (KT keys per stream from `base` on): scores, the causal / split
  // mask, the online softmax. A separate copy runs the first step, whose rows were loaded above
  // (consumed by the loop instead, they were carried into it and cost ~30 registers: G = 4).
  auto step = [&](const uint4(&kr)[KT], const uint4(&vr)[KT], int base) {
    float s[KT][R];
#pragma unroll
    for (int j = 0; j < KT; ++j) {
      float kf[8];
      bf16x8_to_float(kr[j], kf);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) d = fmaf(qf[r][e], kf[e], d);
        s[j][r] = d;
      }
    }
    // Sum the D / 8 slices of each score across the lane group (xor stays inside the group).
#pragma unroll
    for (int off = LPR / 2; off > 0; off /= 2)
#pragma unroll
      for (int j = 0; j < KT; ++j)
#pragma unroll
        for (int r = 0; r < R; ++r) s[j][r] += __shfl_xor_sync(0xffffffffu, s[j][r], off);
#pragma unroll
    for (int j = 0; j < KT; ++j) {
      const int key = base + j * NS + stream;
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (key >= end_r[r]) s[j][r] = -INFINITY;
    }
    // Online softmax: rescale once per step, then accumulate the step's KT keys.
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float mx = s[0][r];
#pragma unroll
      for (int j = 1; j < KT; ++j) mx = fmaxf(mx, s[j][r]);
      const float m_new = fmaxf(m_run[r], mx);
      const float corr = exp2f(m_run[r] - m_new);
      m_run[r] = m_new;
      l_run[r] *= corr;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] *= corr;
    }
#pragma unroll
    for (int j = 0; j < KT; ++j) {
      float vf[8];
      bf16x8_to_float(vr[j], vf);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float p = exp2f(s[j][r] - m_run[r]);  // masked: exp2(-inf) = 0
        l_run[r] += p;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(p, vf[e], acc[r][e]);
      }
    }
  };
  if (kb < ke) step(kr, vr, kb);
  for (int base = kb + NS * KT; base < ke; base += NS * KT) {
    uint4 kn[KT], vn[KT];
#pragma unroll
    for (int j = 0; j < KT; ++j) kn[j] = vn[j] = make_uint4(0, 0, 0, 0);
    load_rows(base, base, ke, kn, vn);
    entries(base + NS * KT);
    step(kn, vn, base);
  }

  pdl_launch_dependents();  // see the pdl_wait() above; blocks that returned count as launched
  stamp(kALoop);
  // Merge the warp's key streams (lanes LPR apart hold the same d-slice of different streams).
#pragma unroll
  for (int off = LPR; off < 32; off *= 2)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float m_o = __shfl_xor_sync(0xffffffffu, m_run[r], off);
      const float l_o = __shfl_xor_sync(0xffffffffu, l_run[r], off);
      const float m_new = fmaxf(m_run[r], m_o);
      const float fa = exp2f(m_run[r] - m_new), fb = exp2f(m_o - m_new);
      m_run[r] = m_new;
      l_run[r] = l_run[r] * fa + l_o * fb;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float a_o = __shfl_xor_sync(0xffffffffu, acc[r][e], off);
        acc[r][e] = acc[r][e] * fa + a_o * fb;
      }
    }
  if (grp == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (LD == LPR || li < LD)
#pragma unroll
        for (int e = 0; e < 8; ++e) sm_acc[warp][r][li * 8 + e] = acc[r][e];
      if (lane == 0) {
        sm_m[warp][r] = m_run[r];
        sm_l[warp][r] = l_run[r];
      }
    }
  }
  __syncthreads();

  // Merge the warps and write this split's partial for each valid row: to the scratch, or, when
  // every active split of the group lies in its first cluster (split = rank in the cluster), to the
  // shared memory of the cluster's leader (split 0), which merges them with no ticket and no round
  // trip through L2 (short contexts: up to CS * NS * KT keys).
  const int n_splits = sm_n_active;
  const bool in_cluster = n_splits <= static_cast<int>(cg::this_cluster().num_blocks());
  if (in_cluster) __cluster_barrier_wait();  // every active block of the cluster runs (arrived at its start)
  float* const cl_acc0 = cg::this_cluster().map_shared_rank(&cl_acc[0][0][0].x, 0);
  float2* const cl_ml0 = cg::this_cluster().map_shared_rank(&cl_ml[0][0], 0);
  for (int idx = threadIdx.x; idx < R * D; idx += kAttnThreads) {
    const int r = idx / D, d = idx % D;
    const int m = m0 + r / G;
    if (!valid(r)) continue;
    float mx = sm_m[0][r];
#pragma unroll
    for (int w = 1; w < kAttnWarps; ++w) mx = fmaxf(mx, sm_m[w][r]);
    float a = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) {
      const float f = exp2f(sm_m[w][r] - mx);
      a = fmaf(f, sm_acc[w][r][d], a);
      l = fmaf(f, sm_l[w][r], l);
    }
    if (in_cluster) {
      cl_acc0[(split * R + r) * D + d] = a;
      if (d == 0) cl_ml0[split * R + r] = make_float2(mx, l);
      continue;
    }
    const size_t p = ((static_cast<size_t>(b) * M + m) * H + first_head<G>(kv, h) + r % G) * s_max + split;
    part_acc[p * D + d] = a;
    if (d == 0) {
      part_ml[2 * p] = mx;
      part_ml[2 * p + 1] = l;
    }
  }
  if (in_cluster) {
    stamp(kAPartial);
    __cluster_barrier_arrive();  // release: this thread's share of the partial
    if (split != 0) {
      stamp(kATicket);  // its exit (no ticket)
      flush(false);
      return;  // exited threads do not hold up the cluster barrier
    }
    __cluster_barrier_wait();  // acquire: every active split's partial
    stamp(kATicket);           // the leader: every partial in
    merge_in_cluster<R, D, G, SPL>(cl_acc, cl_ml, n_splits, b, M, m0, H, kv, h, nq, out, f16_overflow);
    stamp(kAMerged);
    flush(true);
    return;
  }

  // The last of the group's n_splits blocks to finish merges them all (no second kernel). The
  // block's partials are complete at the barrier; thread 0 takes a ticket with an acquire-release
  // add (release: the partials the barrier ordered before it, cumulatively; acquire: the partials
  // of the blocks that counted before, for its threads after the next barrier). One fence instead of
  // the two sequentially consistent ones of __threadfence (docs/design/attention_decode.md).
  __syncthreads();
  stamp(kAPartial);
  if (n_splits > 1) {
    if (threadIdx.x == 0) {
      int* counter = counters + blockIdx.z * gridDim.x + blockIdx.x;  // in range: see kCounterBytes
      int before;
      asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
      sm_last = before == n_splits - 1;
      if (sm_last) *counter = 0;  // every block of the group has counted: ready for the next call
    }
    __syncthreads();
    stamp(kATicket);
    if (!sm_last) {
      flush(false);
      return;
    }
  }

  // The merge: out = sum_s w_s acc_s / sum_s w_s l_s over the NO float4 outputs of the group. One
  // block has to read every partial, so its loads must overlap: with NO >= 128 a thread sums IPT
  // outputs side by side; with fewer, SPL threads share an output, each summing a contiguous range
  // of splits, and their sums are added in range order. Either way the order is fixed by (R, D,
  // n_splits) alone: the bits do not depend on which block came last.
  const int part = threadIdx.x / NO;  // >= SPL: an empty range of splits
  const int per = CEIL_DIV(n_splits, SPL);
  const int s0 = part * per, s1 = min(n_splits, s0 + per);
  float4 o[IPT];
  float l[IPT];
  int r_of[IPT], c_of[IPT];
  bool ok[IPT];
  const float4* src[IPT];
#pragma unroll
  for (int i = 0; i < IPT; ++i) {
    const int idx = threadIdx.x % NO + i * kAttnThreads;
    ok[i] = idx < NO && valid(idx / C4);
    // An output not to write still sums (no branch in the loop below) a valid row: row 0's.
    r_of[i] = ok[i] ? idx / C4 : 0;
    c_of[i] = idx % C4;
    const size_t o_row = (static_cast<size_t>(b) * M + m0 + r_of[i] / G) * H + first_head<G>(kv, h) + r_of[i] % G;
    src[i] = reinterpret_cast<const float4*>(part_acc + o_row * s_max * D) + c_of[i];
    o[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    l[i] = 0.f;
  }
  // The first PF splits' partials are read now, with the (m, l) pairs below, so the merge waits for
  // one round trip instead of two when a group has at most PF splits (short contexts).
  // Registers: G = 4 and 8 at 8 kept them at 160+; so would 3 rows of two outputs per thread (D = 256).
  constexpr int PF = R <= 3 && IPT == 1 ? 8 : (IPT >= 4 ? 1 : 4 / IPT);
  float4 pre[PF][IPT];
#pragma unroll
  for (int k = 0; k < PF; ++k)
#pragma unroll
    for (int i = 0; i < IPT; ++i)
      pre[k][i] = s0 + k < s1 ? __ldcg(src[i] + static_cast<size_t>(s0 + k) * C4) : make_float4(0.f, 0.f, 0.f, 0.f);

  // Per row, the splits' weights w_s = 2^(m_s - Mx) (a warp per row, a lane per 32 splits).
#pragma unroll
  for (int r = warp; r < R; r += kAttnWarps) {
    const int m = m0 + r / G;
    if (!valid(r)) continue;
    const size_t p0 = ((static_cast<size_t>(b) * M + m) * H + first_head<G>(kv, h) + r % G) * s_max;
    float2 ml[kMaxSplits / 32];
    float mx = kNegInit;
#pragma unroll
    for (int i = 0; i < kMaxSplits / 32; ++i) {
      const int s = i * 32 + lane;
      ml[i] = s < n_splits ? __ldcg(reinterpret_cast<const float2*>(part_ml) + p0 + s) : make_float2(kNegInit, 0.f);
      mx = fmaxf(mx, ml[i].x);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
#pragma unroll
    for (int i = 0; i < kMaxSplits / 32; ++i) {
      const int s = i * 32 + lane;
      if (s < n_splits) {
        sm_w[r][s] = exp2f(ml[i].x - mx);
        sm_ls[r][s] = ml[i].y;
      }
    }
  }
  __syncthreads();

  // Split s's share of output i, in split order: the prefetched splits first, then the rest.
  auto add = [&](int i, int s, const float4 a) {
    const float w = sm_w[r_of[i]][s];
    o[i].x = fmaf(w, a.x, o[i].x);
    o[i].y = fmaf(w, a.y, o[i].y);
    o[i].z = fmaf(w, a.z, o[i].z);
    o[i].w = fmaf(w, a.w, o[i].w);
    l[i] = fmaf(w, sm_ls[r_of[i]][s], l[i]);
  };
#pragma unroll
  for (int k = 0; k < PF; ++k) {
    if (s0 + k < s1) {
#pragma unroll
      for (int i = 0; i < IPT; ++i) add(i, s0 + k, pre[k][i]);
    }
  }
#pragma unroll 8
  for (int s = s0 + PF; s < s1; ++s)
#pragma unroll
    for (int i = 0; i < IPT; ++i) add(i, s, __ldcg(src[i] + static_cast<size_t>(s) * C4));
  if constexpr (SPL > 1) {
    sm_part_o[threadIdx.x] = o[0];
    sm_part_l[threadIdx.x] = l[0];
    __syncthreads();
    if (part != 0) return;
    for (int j = 1; j < SPL; ++j) {
      const float4 t = sm_part_o[j * NO + threadIdx.x];
      o[0].x += t.x;
      o[0].y += t.y;
      o[0].z += t.z;
      o[0].w += t.w;
      l[0] += sm_part_l[j * NO + threadIdx.x];
    }
  }
#pragma unroll
  for (int i = 0; i < IPT; ++i) {
    if (part != 0 || !ok[i]) continue;  // part > 0 here: past SPL * NO (NO = 96: threads 96..127)
    const int r = r_of[i];
    const size_t o_row = (static_cast<size_t>(b) * M + m0 + r / G) * H + first_head<G>(kv, h) + r % G;
    const float inv_l = 1.f / l[i];  // > 0: split 0 holds key 0, seen by every query
    store_out4<D>(out, o_row, c_of[i], o[i].x * inv_l, o[i].y * inv_l, o[i].z * inv_l, o[i].w * inv_l, f16_overflow);
  }
  stamp(kAMerged);
  flush(true);
}

// ---- launchers ----

// Scratch: the counters (kCounterBytes), then acc [rows, H, s_max, D], then ml [rows, H, s_max, 2].
static size_t scratch_bytes(int rows, int H, int D, int capacity, int splits) {
  return kCounterBytes + static_cast<size_t>(rows) * H * splits * (D + 2) * sizeof(float);
}
static size_t scratch_bytes(int rows, int H, int D, int capacity) {
  return scratch_bytes(rows, H, D, capacity, max_splits(rows, capacity));
}

// The core's calls of M rows: the chunk's plan, or up to kMaxAttnRowsAsSteps rows as decode steps
// (a decode step's splits per row).
size_t attention_scratch_bytes(int M, int H, int D, int max_context) {
  AF_CHECK(M >= 1 && H >= 1 && D >= 1 && max_context >= 1, "attention_scratch_bytes: arguments must be >= 1");
  const size_t chunk = scratch_bytes(M, H, D, max_context);
  if (M > kMaxAttnRowsAsSteps) return chunk;
  return std::max(chunk, scratch_bytes(M, H, D, max_context, max_splits(1, max_context)));
}

void attention_scratch_clear(void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  AF_CHECK(scratch_bytes >= kCounterBytes, "attention_scratch_clear: smaller than any attention scratch");
  AF_CUDA_CHECK(cudaMemsetAsync(scratch, 0, kCounterBytes, stream));
}

// Splits per cluster: the smallest power of two that holds s_max, when kClusterSplits<R, D> (16 for
// the Llama decode shapes; 8, the portable maximum, where the GPU cannot run a 16-block cluster of
// this kernel) does and `merge` allows clusters; otherwise 1, a plain launch. A grid of several
// clusters per group only pays for them: a group that spans clusters merges through the scratch
// anyway, and the clusters cost the deep key loops their wave (docs/design/attention_decode.md).
// Short steps of a large cache keep their cluster merge through the core's grid planned for 512 keys
// (step_plan.h, kShortKeys).
template <class KV, int D, int G, int QT>
static int cluster_splits(int s_max, bool merge) {
  constexpr int R = G * QT;
  static const int most = [] {
    int n = kClusterSplits<R, D>;
    if (n <= 8) return n;
    int clusters = 0;
    if (cudaFuncSetAttribute(attention_kernel<KV, D, G, QT>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) ==
        cudaSuccess) {
      cudaLaunchAttribute attr;
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = 1;
      attr.val.clusterDim.y = n;
      attr.val.clusterDim.z = 1;
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(1, n, 1);
      cfg.blockDim = dim3(kAttnThreads);
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      if (cudaOccupancyMaxActiveClusters(&clusters, attention_kernel<KV, D, G, QT>, &cfg) != cudaSuccess) clusters = 0;
    }
    cudaGetLastError();  // a refusal above only means: no 16-block clusters
    return clusters >= 1 ? n : 8;
  }();
  if (!merge || s_max > most) return 1;
  int cs = 1;
  while (cs < s_max) cs *= 2;
  return cs;
}

template <class KV, int D, int G, int QT>
static void launch_attention(const bf16* q, const KV& kv, int B, int M, int H, int Hkv, int s_max, int cs, float scale,
                             void* scratch, void* out, int* f16_overflow, cudaStream_t stream, bool early, bool fewer) {
  AF_CHECK(s_max == (kRowsAsSteps<KV> ? max_splits(1, kv.capacity, fewer) : max_splits(B * M, kv.capacity, fewer)) &&
               cs >= 1 && (cs == 1 || cs >= s_max),
           "attention: the plan's splits are not this call's");
  int* counters = static_cast<int*>(scratch);
  float* part_acc = reinterpret_cast<float*>(static_cast<char*>(scratch) + kCounterBytes);
  float* part_ml = part_acc + static_cast<size_t>(B) * M * H * s_max * D;
  // Kv heads along x, splits along y: blocks start in index order, so the active splits of every head
  // (split < n_active) come before the ones past it, which only wait for the previous kernel and exit
  // (with the capacity of a default context, 8192 keys, 64 splits: 7 in 8 blocks at 256 keys).
  // grid.y is padded to whole clusters; the padding's blocks are past every n_active and exit.
  int blocks = 1;  // per kv head
  if constexpr (kHeadMapped<KV>) blocks = kv.hm.blocks;
  const dim3 grid(Hkv * blocks, CEIL_DIV(s_max, cs) * cs, B * CEIL_DIV(M, QT));
  const float q_scale = scale * 1.4426950408889634f;     // scores in log2 units: exp2f in the softmax
  early = early && std::is_base_of_v<ContiguousKV, KV>;  // a paged table is read with the rows: after the wait
  af_launch_clusters(attention_kernel<KV, D, G, QT>, grid, dim3(kAttnThreads), dim3(1, cs, 1), 0, stream, q, kv, M, H,
                     Hkv, s_max, q_scale, counters, part_acc, part_ml, out, f16_overflow, early);
}

// Decode uses one query token per block; prefill chunks tile QT tokens so that G * QT <= kMaxGroup<D>
// query rows share each K/V load.
template <int G, int D>
constexpr int kQueryTile = kMaxGroup<D> / G > 1 ? kMaxGroup<D> / G : 1;

bool attention_supported(int D, int group) {
  return (D == 64 || D == 80 || D == 96 || D == 128 || D == 256) && group >= 1 && group <= kMaxAttnGroup;
}

// A ratio that fits one block but has no instance of its own (5, 7 at head_dim <= 128) runs two blocks
// of 3 or 4 heads rather than one padded to 6 or 8: half the rows per block and twice the blocks (a
// Qwen2.5-7B decode step, 4 kv heads, has as many blocks as a Llama-3.1-8B one), the kv head's keys read
// twice (the second time mostly from L2: its blocks are adjacent in grid.x).
// A plan `halved` (AttnPlan::halved) runs ratios 4, 6 and 8 so, at head_dim <= 128 (StepPlan::attn_halved
// says which models): half the heads a block, twice the blocks, each split the unhalved plan's keys; the
// model's verify rows and probed steps take the same map, hence the same bits. Such a plan also stops at
// kHalvedMaxSplits (max_splits), which ratios 5 and 7 (two blocks already) do not take.
static bool halves(int D, int group, bool halved) {
  return halved && D <= 128 && (group == 4 || group == 6 || group == 8);  // 5 and 7 run two blocks anyway
}
static HeadMap head_map(int D, int group, bool halved = false) {
  const int most = D <= 128 ? kMaxGroup<128> : kMaxGroup<256>;
  const bool padded = group <= most && group > 4 && group != 6 && group != 8;
  const bool half = halves(D, group, halved);
  const int blocks = padded || half ? 2 : CEIL_DIV(group, most);
  return {group, blocks, CEIL_DIV(group, blocks)};
}

// fn(D, G, QT, MAPPED) as std::integral_constants, for the head dims and GQA group sizes the kernel
// is built for and the query tile of M tokens per sequence (1 for decode, kQueryTile<G, D> for a
// chunk): the one place that maps a call's shape to its template instance. Head dims 64 and 128 with
// H / Hkv in {1, 2, 3, 4, 6, 8} run the exact instances (MAPPED false: one block of G = H / Hkv heads
// per kv head); every other shape runs HeadMapped ones (head_map) of G, the smallest built size that
// holds a block's heads. The paged policy is built for head_dim 64 and 128 only (the sandbox's model
// takes those; each further head_dim costs ~10 instances of compile time per policy).
template <class KV, class Fn>
static decltype(auto) for_shape(int D, int group, int M, bool halved, Fn&& fn) {
  constexpr bool every_dim = !std::is_same_v<KV, PagedKV>;
  if constexpr (every_dim)
    AF_CHECK(attention_supported(D, 1), "attention: head_dim must be one of 64, 80, 96, 128, 256");
  else
    AF_CHECK(D == 64 || D == 128, "attention_paged: head_dim must be 64 or 128");
  AF_CHECK(attention_supported(D, group), "attention: GQA group size H / Hkv must be in 1..16");
  const int per = head_map(D, group, halved).per;
  const int G = per <= 4 ? per : (per <= 6 ? 6 : 8);
  const bool exact = (D == 64 || D == 128) && G == group;  // hence one block per kv head, no padding
  using Exact = std::false_type;
  using Mapped = std::true_type;
  const auto tile = [&](auto d, auto g, auto mapped) -> decltype(auto) {
    using One = std::integral_constant<int, 1>;
    using Tile = std::integral_constant<int, kQueryTile<decltype(g)::value, decltype(d)::value>>;
    if constexpr (std::is_same_v<KV, ChunkRowsKV> || kRoped<KV>)
      return fn(d, g, One{}, mapped);  // one query per sequence (its rows are decode steps; RopedKV: M = 1)
    else
      return M == 1 ? fn(d, g, One{}, mapped) : fn(d, g, Tile{}, mapped);
  };
  const auto group_of = [&](auto d, auto mapped) -> decltype(auto) {
    constexpr int Dc = decltype(d)::value;
    if constexpr (decltype(mapped)::value && (Dc == 64 || Dc == 128)) {
      // Not exact at these head dims: 5 and 7 heads per kv head (two blocks of 3 or 4), 9..16 (5..8 per block);
      // a halved plan's 4..8 (two blocks of 2..4; not the paged policy's: the sandbox plans no halving).
      if constexpr (!std::is_same_v<KV, PagedKV>)
        if (G == 2) return tile(d, std::integral_constant<int, 2>{}, mapped);
      if (G == 3) return tile(d, std::integral_constant<int, 3>{}, mapped);
      if (G == 4) return tile(d, std::integral_constant<int, 4>{}, mapped);
      if (G == 6) return tile(d, std::integral_constant<int, 6>{}, mapped);
      return tile(d, std::integral_constant<int, 8>{}, mapped);
    } else {
      switch (G) {
        case 1: return tile(d, std::integral_constant<int, 1>{}, mapped);
        case 2: return tile(d, std::integral_constant<int, 2>{}, mapped);
        case 3: return tile(d, std::integral_constant<int, 3>{}, mapped);
        case 4: return tile(d, std::integral_constant<int, 4>{}, mapped);
        default:
          if constexpr (kMaxGroup<Dc> >= 8) {
            if (G == 6) return tile(d, std::integral_constant<int, 6>{}, mapped);
            return tile(d, std::integral_constant<int, 8>{}, mapped);
          } else {
            return tile(d, std::integral_constant<int, 4>{}, mapped);  // not reached: per <= kMaxGroup<D>
          }
      }
    }
  };
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  if constexpr (every_dim) {
    switch (D) {
      case 64: return exact ? group_of(D64{}, Exact{}) : group_of(D64{}, Mapped{});
      case 80: return group_of(std::integral_constant<int, 80>{}, Mapped{});
      case 96: return group_of(std::integral_constant<int, 96>{}, Mapped{});
      case 128: return exact ? group_of(D128{}, Exact{}) : group_of(D128{}, Mapped{});
      default: return group_of(std::integral_constant<int, 256>{}, Mapped{});
    }
  } else {
    if (D == 64) return exact ? group_of(D64{}, Exact{}) : group_of(D64{}, Mapped{});
    return exact ? group_of(D128{}, Exact{}) : group_of(D128{}, Mapped{});
  }
}

// The instance's policy: KV itself, or HeadMapped<KV> (for_shape's MAPPED).
template <class KV, bool MAPPED>
using PolicyOf = std::conditional_t<MAPPED, HeadMapped<KV>, KV>;

// plan: the contiguous core's (attention()); null for the sandbox's batched and paged calls, which
// plan here with the cluster merge on.
template <class KV>
static void dispatch(const AttnPlan* plan, const bf16* q, const KV& kv, int B, int M, int H, int Hkv, int D,
                     float scale, void* scratch, void* out, cudaStream_t stream, bool early = false,
                     int* f16_overflow = nullptr) {
  AF_CHECK(B >= 1 && M >= 1 && H >= 1 && Hkv >= 1, "attention: B, M, H, Hkv must be >= 1");
  AF_CHECK(H % Hkv == 0, "attention: H must be a multiple of Hkv");
  const bool halved = plan != nullptr && plan->halved;
  for_shape<KV>(D, H / Hkv, M, halved, [&](auto d, auto g, auto qt, auto mapped) {
    constexpr int Dc = decltype(d)::value, Gc = decltype(g)::value, QTc = decltype(qt)::value;
    using P = PolicyOf<KV, decltype(mapped)::value>;
    const HeadMap hm = head_map(D, H / Hkv, halved);
    AF_CHECK(Hkv * hm.blocks <= kMaxKvHeads, "attention: at most 256 kv heads x blocks per kv head (the counters)");
    AF_CHECK(static_cast<long long>(B) * M <= 65535, "attention: B * M too large for the grid");
    const bool fewer = halves(D, H / Hkv, halved);  // a halved map's splits (max_splits)
    const int s_max = plan ? plan->splits : max_splits(B * M, kv.capacity, fewer);
    const int cs = plan ? plan->cluster : cluster_splits<P, Dc, Gc, QTc>(s_max, true);
    if constexpr (kHeadMapped<P>)
      launch_attention<P, Dc, Gc, QTc>(q, P{kv, hm}, B, M, H, Hkv, s_max, cs, scale, scratch, out, f16_overflow, stream,
                                       early, fewer);
    else
      launch_attention<P, Dc, Gc, QTc>(q, kv, B, M, H, Hkv, s_max, cs, scale, scratch, out, f16_overflow, stream, early,
                                       fewer);
  });
}

AttnPlan plan_attention(int M, int H, int Hkv, int D, int capacity, bool cluster_merge, bool rows_as_steps, bool qkv_in,
                        bool halved) {
  AF_CHECK(M >= 1 && H >= 1 && Hkv >= 1 && capacity >= 1 && H % Hkv == 0,
           "plan_attention: M, H, Hkv, capacity must be >= 1, H a multiple of Hkv");
  AF_CHECK(!rows_as_steps || M <= kMaxAttnRowsAsSteps, "plan_attention: rows as decode steps: at most 16 rows");
  AF_CHECK(!qkv_in || (M == 1 && !rows_as_steps), "plan_attention: the raw QKV input is the decode step's (M = 1)");
  const bool fewer = halves(D, H / Hkv, halved);  // a halved map's splits (max_splits)
  AttnPlan plan{M,        H,
                Hkv,      D,
                capacity, rows_as_steps ? max_splits(1, capacity, fewer) : max_splits(M, capacity, fewer),
                1,        rows_as_steps,
                qkv_in,   halved};
  const auto cluster = [&](auto kv) {
    using KV = decltype(kv);
    return for_shape<KV>(D, H / Hkv, M, halved, [&](auto d, auto g, auto qt, auto mapped) {
      using P = PolicyOf<KV, decltype(mapped)::value>;
      return cluster_splits<P, decltype(d)::value, decltype(g)::value, decltype(qt)::value>(plan.splits, cluster_merge);
    });
  };
  plan.cluster = rows_as_steps ? cluster(ChunkRowsKV{}) : (qkv_in ? cluster(RopedKV{}) : cluster(ContiguousKV{}));
  return plan;
}

int attention_blocks_per_kv_head(const AttnPlan& plan) {
  return head_map(plan.D, plan.H / plan.Hkv, plan.halved).blocks;
}

std::string attention_instance_name(const AttnPlan& plan) {
  std::string out;
  const auto name = [&](auto kv, const char* policy) {
    using KV = decltype(kv);
    for_shape<KV>(plan.D, plan.H / plan.Hkv, plan.M, plan.halved, [&](auto d, auto g, auto qt, auto mapped) {
      const std::string p = decltype(mapped)::value ? std::string("HeadMapped<") + policy + ">" : std::string(policy);
      out = "attention_kernel<" + p + ", " + std::to_string(decltype(d)::value) + ", " +
            std::to_string(decltype(g)::value) + ", " + std::to_string(decltype(qt)::value) + ">";
    });
  };
  if (plan.rows_as_steps)
    name(ChunkRowsKV{}, "ChunkRowsKV");
  else if (plan.qkv_in)
    name(RopedKV{}, "RopedKV");
  else
    name(ContiguousKV{}, "ContiguousKV");
  return out;
}

const char* attention_merge_name(const AttnPlan& plan) {
  return plan.cluster > 1 ? "cluster" : (plan.splits > 1 ? "scratch" : "none");
}

void attention(const AttnPlan& plan, const bf16* q, const bf16* k_cache, const bf16* v_cache, const int32_t* pos, int M,
               int H, int Hkv, int D, int max_context, float scale, void* scratch, void* out, cudaStream_t stream,
               bool early, int* f16_overflow) {
  AF_CHECK(M >= 1 && H >= 1 && Hkv >= 1 && max_context >= 1, "attention: M, H, Hkv, max_context must be >= 1");
  AF_CHECK(M <= 65535, "attention: M too large for the grid");
  AF_CHECK(static_cast<size_t>(max_context) * Hkv * D < (size_t{1} << 31),
           "attention: cache too large for int offsets");
  AF_CHECK(plan.M == M && plan.H == H && plan.Hkv == Hkv && plan.D == D && plan.capacity == max_context,
           "attention: the plan is not this call's (plan_attention(M, H, Hkv, D, max_context))");
  AF_CHECK(!plan.qkv_in, "attention: a plan for the raw QKV input runs attention_qkv");
  if (plan.rows_as_steps) {  // the M rows as M sequences of one query on the one cache
    const ChunkRowsKV kv{k_cache, v_cache, {pos}, max_context};
    dispatch(&plan, q, kv, M, 1, H, Hkv, D, scale, scratch, out, stream, false, f16_overflow);
    return;
  }
  const ContiguousKV kv{k_cache, v_cache, SeqStart{pos, 0}, max_context};
  dispatch(&plan, q, kv, 1, M, H, Hkv, D, scale, scratch, out, stream, early, f16_overflow);
}

void attention_qkv(const AttnPlan& plan, const AttnQkvIn& in, bf16* k_cache, bf16* v_cache, const int32_t* pos, int H,
                   int Hkv, int D, int max_context, float scale, void* scratch, void* out, cudaStream_t stream,
                   bool early, int* f16_overflow) {
  AF_CHECK(H >= 1 && Hkv >= 1 && max_context >= 1, "attention_qkv: H, Hkv, max_context must be >= 1");
  AF_CHECK(in.qkv && in.inv_freq && k_cache && v_cache && pos, "attention_qkv: null pointer argument");
  AF_CHECK((in.extras.q_norm == nullptr) == (in.extras.k_norm == nullptr),
           "attention_qkv: q_norm and k_norm come together");
  AF_CHECK(in.extras.q_norm == nullptr || in.extras.eps > 0.f, "attention_qkv: the q/k norms need eps > 0");
  AF_CHECK(static_cast<size_t>(max_context) * Hkv * D < (size_t{1} << 31),
           "attention_qkv: cache too large for int offsets");
  AF_CHECK(
      plan.qkv_in && plan.M == 1 && plan.H == H && plan.Hkv == Hkv && plan.D == D && plan.capacity == max_context,
      "attention_qkv: the plan is not this call's (plan_attention(1, H, Hkv, D, max_context, merge, false, true))");
  const RopedKV kv{{k_cache, v_cache, SeqStart{pos, 0}, max_context}, in.qkv, in.inv_freq, in.extras};
  dispatch(&plan, static_cast<const bf16*>(nullptr), kv, 1, 1, H, Hkv, D, scale, scratch, out, stream, early,
           f16_overflow);
}

// ---- batched launchers (the sandbox): sequence b's M queries sit at lens[b] - M .. lens[b] - 1 ----

size_t attention_batched_scratch_bytes(int B, int M, int H, int D, int capacity) {
  AF_CHECK(B >= 1 && M >= 1 && H >= 1 && D >= 1 && capacity >= 1,
           "attention_batched_scratch_bytes: arguments must be >= 1");
  return scratch_bytes(B * M, H, D, capacity);
}

void attention_batched(const bf16* q, const bf16* k_cache, const bf16* v_cache, const int32_t* lens, int B, int M,
                       int H, int Hkv, int D, int capacity, float scale, void* scratch, bf16* out,
                       cudaStream_t stream) {
  AF_CHECK(capacity >= 1, "attention_batched: capacity must be >= 1");
  const ContiguousKV kv{k_cache, v_cache, SeqStart{lens, -M}, capacity};
  dispatch(nullptr, q, kv, B, M, H, Hkv, D, scale, scratch, out, stream);
}

static int block_shift(int block_size) {
  AF_CHECK(block_size >= 8 && block_size <= 256 && (block_size & (block_size - 1)) == 0,
           "attention_paged: block_size must be a power of two in [8, 256]");
  int shift = 0;
  while ((1 << shift) < block_size) ++shift;
  return shift;
}

size_t attention_paged_scratch_bytes(int B, int M, int H, int D, int max_blocks, int block_size) {
  AF_CHECK(max_blocks >= 1, "attention_paged_scratch_bytes: max_blocks must be >= 1");
  AF_CHECK(static_cast<long long>(max_blocks) * block_size < (1LL << 31),
           "attention_paged: max_blocks * block_size overflows");
  return attention_batched_scratch_bytes(B, M, H, D, max_blocks << block_shift(block_size));
}

void attention_paged(const bf16* q, const bf16* k_pool, const bf16* v_pool, const int32_t* block_tables,
                     const int32_t* lens, int B, int M, int H, int Hkv, int D, int block_size, int num_blocks,
                     int max_blocks, float scale, void* scratch, void* out, cudaStream_t stream, int* f16_overflow) {
  AF_CHECK(num_blocks >= 1 && max_blocks >= 1, "attention_paged: num_blocks and max_blocks must be >= 1");
  AF_CHECK(static_cast<long long>(max_blocks) * block_size < (1LL << 31),
           "attention_paged: max_blocks * block_size overflows");
  const int shift = block_shift(block_size);
  const PagedKV kv{k_pool,     v_pool, SeqStart{lens, -M}, max_blocks << shift, block_tables,
                   max_blocks, shift,  num_blocks};
  dispatch(nullptr, q, kv, B, M, H, Hkv, D, scale, scratch, out, stream, false, f16_overflow);
}

}  // namespace atomflow::kernels

// Causal GQA attention over a KV cache, contiguous or paged (flash-decoding), for decode (M = 1)
// and prefill chunks (M > 1), one sequence or a batch. Pass 1: each block = (split of the keys,
// kv head, tile of QT query tokens of one sequence) streams its keys once for all G = H / Hkv
// query heads of the group and writes an unnormalized partial (m, l, acc[D]) per query row.
// Pass 2 merges the partials of the splits.
//
// Split policy: the grid is fixed by (B, M, Hkv, capacity) so one captured graph serves every
// position; blocks read the position and derive their key range. With n_keys = start + M (a
// sequence's keys after this call), it uses n_active = min(s_max, ceil(n_keys / 32)) splits of
// ceil(n_keys / n_active) keys, where s_max = min(max(128 / (B * M), 1), ceil(capacity / 32))
// (capacity = max_context for the core, B = 1): short contexts spread over splits of >= 32
// keys (about one K/V load step per block, so latency stays low), long ones use all s_max splits
// (M = 1: 128 x Hkv blocks, enough to fill 132 SMs several times); blocks past n_active exit.
//
// Inside a block: D / 8 lanes hold one key row (16 B each), so a warp covers 32 / (D / 8) keys per
// load; each such lane group is an independent "key stream" with its own online softmax (scores
// in the log2 domain, q prescaled by scale * log2 e) over KT keys per step (all K and V loads of
// the step issued first). Streams are merged in-warp by shuffles, then across warps in shared memory.
//
// Addressing policies (STYLE.md habit 11: one kernel, several variants): the split and merge kernels
// are templated on where sequence b's keys live. ContiguousKV is the core engine's cache (row p of a
// [capacity, Hkv, D] array per sequence); PagedKV is the sandbox's (key p in block table[p / bs],
// slot p % bs, of a [num_blocks, bs, Hkv, D] pool). Batching = grid.z walks (sequence, query tile);
// each sequence has its own length. With B = 1 and the core's position pointer the contiguous
// variant does the original kernel's arithmetic in the original order (bit-identical results).
#include "atomflow/kernels.h"
#include "atomflow/pdl.cuh"

namespace atomflow::kernels {

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kMinKeysPerSplit = 32;    // short contexts: many blocks, one K/V step each
constexpr int kMaxSplits = 128;     // also the merge kernel's block size
constexpr float kNegInit = -1e30f;  // finite "no key yet": exp2(kNegInit - kNegInit) = 1, never NaN

// Splits planned for (grid.x and scratch): fixed by the query rows of the call (rows = B * M) and
// the per-sequence key capacity only. A batch shares the 128 splits' worth of blocks among its rows.
static int max_splits(int rows, int capacity) {
  const int by_rows = kMaxSplits / rows > 1 ? kMaxSplits / rows : 1;
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
  __device__ __forceinline__ size_t row(int b, int, int key) const {
    return static_cast<size_t>(b) * capacity + key;
  }
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

// Keys seen by the last query of sequence b, clamped so a bad position never reads past its capacity.
template <class KV>
static __device__ __forceinline__ int call_keys(const KV& kv, int b, int M) {
  return min(max(kv.seq.start(b) + M, 1), kv.capacity);
}
static __device__ __forceinline__ int active_splits(int n_keys, int s_max) {
  return min(s_max, CEIL_DIV(n_keys, kMinKeysPerSplit));
}

static __device__ __forceinline__ uint4 ld_kv(const bf16* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
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

// Query rows are (sequence b, token m) -> row b * M + m of q [B * M, H, D] and of the output.
// Partials: index ((row * H + head) * s_max + split); ml holds (max, sum) pairs, acc D floats.
template <class KV, int D, int G, int QT>
static __global__ void __launch_bounds__(kAttnThreads)
    attention_split_kernel(const bf16* q, KV kv, int M, int H, int Hkv, int s_max, float q_scale,
                           float* __restrict__ part_ml, float* __restrict__ part_acc) {
  constexpr int LPR = D / 8;                // lanes per key row
  constexpr int GPW = 32 / LPR;             // key streams per warp
  constexpr int NS = kAttnWarps * GPW;      // key streams per block
  constexpr int R = G * QT;                 // query rows per block
  constexpr int KT = R <= 2 ? 8 : (R <= 4 ? 4 : 2);  // keys per stream per step (registers: R x KT scores)
  __shared__ float sm_m[kAttnWarps][R], sm_l[kAttnWarps][R];
  __shared__ float sm_acc[kAttnWarps][R][D];

  pdl_prologue();
  const int tiles = CEIL_DIV(M, QT);
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z / tiles, m0 = (blockIdx.z % tiles) * QT;
  const int pos = kv.seq.start(b);
  const int n_keys = call_keys(kv, b, M);
  const int n_active = active_splits(n_keys, s_max);
  if (split >= n_active) return;  // the merge reads only the active splits
  const int chunk = CEIL_DIV(n_keys, n_active);
  const int m_last = min(m0 + QT, M) - 1;
  const int kb = split * chunk;
  const int ke = min(min(kb + chunk, pos + m_last + 1), n_keys);

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int grp = lane / LPR, li = lane % LPR;
  const int stream = warp * GPW + grp;

  // Row r = (query token m0 + r / G, head h * G + r % G): this lane's 8 q values, prescaled.
  float qf[R][8];
  int end_r[R];  // exclusive key bound of row r in this block (causal and split)
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int m = m0 + r / G;
    if (m < M) {
      const size_t row = static_cast<size_t>(b) * M + m;
      const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(q + (row * H + h * G + r % G) * D) + li);
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

  const size_t key_stride = static_cast<size_t>(Hkv) * D;
  const bf16* k_base = kv.k + static_cast<size_t>(h) * D + li * 8;
  const bf16* v_base = kv.v + static_cast<size_t>(h) * D + li * 8;

  // The row handles of this step's keys, loaded one step ahead (nothing for contiguous).
  int ent[KT];
#pragma unroll
  for (int j = 0; j < KT; ++j) {
    const int key = kb + j * NS + stream;
    ent[j] = key < ke ? kv.entry(b, key) : 0;
  }

  for (int base = kb; base < ke; base += NS * KT) {
    uint4 kr[KT], vr[KT];
#pragma unroll
    for (int j = 0; j < KT; ++j) {
      const int key = base + j * NS + stream;
      if (key < ke) {
        const size_t row = kv.row(b, ent[j], key);
        kr[j] = ld_kv(k_base + row * key_stride);
        vr[j] = ld_kv(v_base + row * key_stride);
      } else {
        kr[j] = vr[j] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int j = 0; j < KT; ++j) {
      const int key = base + NS * KT + j * NS + stream;
      if (key < ke) ent[j] = kv.entry(b, key);
    }
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
  }

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
#pragma unroll
      for (int e = 0; e < 8; ++e) sm_acc[warp][r][li * 8 + e] = acc[r][e];
      if (lane == 0) {
        sm_m[warp][r] = m_run[r];
        sm_l[warp][r] = l_run[r];
      }
    }
  }
  __syncthreads();

  // Merge the warps and write this split's partial for each valid row.
  for (int idx = threadIdx.x; idx < R * D; idx += kAttnThreads) {
    const int r = idx / D, d = idx % D;
    const int m = m0 + r / G;
    if (m >= M) continue;
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
    const size_t p = ((static_cast<size_t>(b) * M + m) * H + h * G + r % G) * s_max + split;
    part_acc[p * D + d] = a;
    if (d == 0) {
      part_ml[2 * p] = mx;
      part_ml[2 * p + 1] = l;
    }
  }
}

// One block per (head, query row): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
template <class KV, int D>
static __global__ void __launch_bounds__(kMaxSplits)
    attention_merge_kernel(const float* part_ml, const float* part_acc, KV kv, int M, int H, int s_max,
                           bf16* __restrict__ out) {
  __shared__ float weight[kMaxSplits];
  __shared__ float red[kMaxSplits / 32];
  __shared__ float row_max, inv_l;
  pdl_prologue();
  const int head = blockIdx.x, m = blockIdx.y, tid = threadIdx.x;  // m: the query row b * M + token
  const int n_active = active_splits(call_keys(kv, m / M, M), s_max);
  const size_t p0 = (static_cast<size_t>(m) * H + head) * s_max;

  const float ms = tid < n_active ? part_ml[2 * (p0 + tid)] : kNegInit;
  float v = ms;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  if (tid % 32 == 0) red[tid / 32] = v;
  __syncthreads();
  if (tid == 0) {
    float mx = red[0];
    for (int w = 1; w < kMaxSplits / 32; ++w) mx = fmaxf(mx, red[w]);
    row_max = mx;
  }
  __syncthreads();
  const float wgt = tid < n_active ? exp2f(ms - row_max) : 0.f;
  weight[tid] = wgt;
  float l = tid < n_active ? wgt * part_ml[2 * (p0 + tid) + 1] : 0.f;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) l += __shfl_xor_sync(0xffffffffu, l, off);
  __syncthreads();  // red[] is reused
  if (tid % 32 == 0) red[tid / 32] = l;
  __syncthreads();
  if (tid == 0) {
    float sum = 0.f;
    for (int w = 0; w < kMaxSplits / 32; ++w) sum += red[w];
    inv_l = 1.f / sum;  // > 0: split 0 holds key 0, seen by every query
  }
  __syncthreads();

  for (int d = tid; d < D; d += kMaxSplits) {
    float o = 0.f;
#pragma unroll 8
    for (int s = 0; s < n_active; ++s) o = fmaf(weight[s], part_acc[(p0 + s) * D + d], o);
    out[(static_cast<size_t>(m) * H + head) * D + d] = __float2bfloat16(o * inv_l);
  }
}

// ---- launchers ----

size_t attention_scratch_bytes(int M, int H, int D, int max_context) {
  AF_CHECK(M >= 1 && H >= 1 && D >= 1 && max_context >= 1, "attention_scratch_bytes: arguments must be >= 1");
  return static_cast<size_t>(M) * H * max_splits(M, max_context) * (D + 2) * sizeof(float);
}

template <class KV, int D, int G, int QT>
static void launch_attention(const bf16* q, const KV& kv, int B, int M, int H, int Hkv, float scale, void* scratch,
                             bf16* out, cudaStream_t stream) {
  const int s_max = max_splits(B * M, kv.capacity);
  float* part_ml = static_cast<float*>(scratch);
  float* part_acc = part_ml + static_cast<size_t>(B) * M * H * s_max * 2;
  const dim3 grid(s_max, Hkv, B * CEIL_DIV(M, QT));
  const float q_scale = scale * 1.4426950408889634f;  // scores in log2 units: exp2f in the softmax
  af_launch(attention_split_kernel<KV, D, G, QT>, grid, dim3(kAttnThreads), 0, stream, q, kv, M, H, Hkv, s_max,
            q_scale, part_ml, part_acc);
  af_launch(attention_merge_kernel<KV, D>, dim3(H, B * M), dim3(kMaxSplits), 0, stream, part_ml, part_acc, kv, M, H,
            s_max, out);
}

// Decode uses one query token per block; prefill chunks tile QT tokens so that G * QT <= 8 query
// rows share each K/V load.
template <class KV, int D, int G>
static void dispatch_tokens(const bf16* q, const KV& kv, int B, int M, int H, int Hkv, float scale, void* scratch,
                            bf16* out, cudaStream_t stream) {
  constexpr int QT = 8 / G > 1 ? 8 / G : 1;
  AF_CHECK(static_cast<long long>(B) * M <= 65535, "attention: B * M too large for the grid");
  if (M == 1)
    launch_attention<KV, D, G, 1>(q, kv, B, M, H, Hkv, scale, scratch, out, stream);
  else
    launch_attention<KV, D, G, QT>(q, kv, B, M, H, Hkv, scale, scratch, out, stream);
}

template <class KV, int D>
static void dispatch_group(const bf16* q, const KV& kv, int B, int M, int H, int Hkv, float scale, void* scratch,
                           bf16* out, cudaStream_t stream) {
  switch (H / Hkv) {
    case 1: dispatch_tokens<KV, D, 1>(q, kv, B, M, H, Hkv, scale, scratch, out, stream); break;
    case 2: dispatch_tokens<KV, D, 2>(q, kv, B, M, H, Hkv, scale, scratch, out, stream); break;
    case 3: dispatch_tokens<KV, D, 3>(q, kv, B, M, H, Hkv, scale, scratch, out, stream); break;
    case 4: dispatch_tokens<KV, D, 4>(q, kv, B, M, H, Hkv, scale, scratch, out, stream); break;
    case 6: dispatch_tokens<KV, D, 6>(q, kv, B, M, H, Hkv, scale, scratch, out, stream); break;
    case 8: dispatch_tokens<KV, D, 8>(q, kv, B, M, H, Hkv, scale, scratch, out, stream); break;
    default: AF_CHECK(false, "attention: GQA group size H / Hkv must be one of 1, 2, 3, 4, 6, 8");
  }
}

template <class KV>
static void dispatch(const bf16* q, const KV& kv, int B, int M, int H, int Hkv, int D, float scale, void* scratch,
                     bf16* out, cudaStream_t stream) {
  AF_CHECK(B >= 1 && M >= 1 && H >= 1 && Hkv >= 1, "attention: B, M, H, Hkv must be >= 1");
  AF_CHECK(H % Hkv == 0, "attention: H must be a multiple of Hkv");
  switch (D) {
    case 64: dispatch_group<KV, 64>(q, kv, B, M, H, Hkv, scale, scratch, out, stream); break;
    case 128: dispatch_group<KV, 128>(q, kv, B, M, H, Hkv, scale, scratch, out, stream); break;
    default: AF_CHECK(false, "attention: head_dim must be 64 or 128");
  }
}

void attention(const bf16* q, const bf16* k_cache, const bf16* v_cache, const int32_t* pos, int M, int H, int Hkv,
               int D, int max_context, float scale, void* scratch, bf16* out, cudaStream_t stream) {
  AF_CHECK(M >= 1 && H >= 1 && Hkv >= 1 && max_context >= 1, "attention: M, H, Hkv, max_context must be >= 1");
  AF_CHECK(M <= 65535, "attention: M too large for the grid");
  AF_CHECK(static_cast<size_t>(max_context) * Hkv * D < (size_t{1} << 31), "attention: cache too large for int offsets");
  const ContiguousKV kv{k_cache, v_cache, SeqStart{pos, 0}, max_context};
  dispatch(q, kv, 1, M, H, Hkv, D, scale, scratch, out, stream);
}

// ---- batched launchers (the sandbox): sequence b's M queries sit at lens[b] - M .. lens[b] - 1 ----

size_t attention_batched_scratch_bytes(int B, int M, int H, int D, int capacity) {
  AF_CHECK(B >= 1 && M >= 1 && H >= 1 && D >= 1 && capacity >= 1, "attention_batched_scratch_bytes: arguments must be >= 1");
  return static_cast<size_t>(B) * M * H * max_splits(B * M, capacity) * (D + 2) * sizeof(float);
}

void attention_batched(const bf16* q, const bf16* k_cache, const bf16* v_cache, const int32_t* lens, int B, int M,
                       int H, int Hkv, int D, int capacity, float scale, void* scratch, bf16* out, cudaStream_t stream) {
  AF_CHECK(capacity >= 1, "attention_batched: capacity must be >= 1");
  const ContiguousKV kv{k_cache, v_cache, SeqStart{lens, -M}, capacity};
  dispatch(q, kv, B, M, H, Hkv, D, scale, scratch, out, stream);
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
  AF_CHECK(static_cast<long long>(max_blocks) * block_size < (1LL << 31), "attention_paged: max_blocks * block_size overflows");
  return attention_batched_scratch_bytes(B, M, H, D, max_blocks << block_shift(block_size));
}

void attention_paged(const bf16* q, const bf16* k_pool, const bf16* v_pool, const int32_t* block_tables,
                     const int32_t* lens, int B, int M, int H, int Hkv, int D, int block_size, int num_blocks,
                     int max_blocks, float scale, void* scratch, bf16* out, cudaStream_t stream) {
  AF_CHECK(num_blocks >= 1 && max_blocks >= 1, "attention_paged: num_blocks and max_blocks must be >= 1");
  AF_CHECK(static_cast<long long>(max_blocks) * block_size < (1LL << 31), "attention_paged: max_blocks * block_size overflows");
  const int shift = block_shift(block_size);
  const PagedKV kv{k_pool, v_pool, SeqStart{lens, -M}, max_blocks << shift, block_tables, max_blocks, shift, num_blocks};
  dispatch(q, kv, B, M, H, Hkv, D, scale, scratch, out, stream);
}

}  // namespace atomflow::kernels

// Causal GQA attention of a prefill chunk on tensor cores (FlashAttention-2 style): mma.sync m16n8k16
// bf16 with fp32 accumulation, online softmax in registers, ldmatrix fragment loads and a cp.async
// double-buffered K/V pipeline. Each K/V tile is shared by all G = H / Hkv query heads of its group:
// a block's 64 rows are (query token, head) pairs of ONE kv head, packed p = m * G + g, so any G in
// 1..16 fills the tensor-core M dimension and reads each key once per 64 packed rows.
// No split of the keys across blocks: one block per (query tile, kv head) walks every key its rows
// see, so the kernel needs no scratch and nothing that grows with the context (the wgmma kernel splits
// them deep in a context where its blocks would leave SMs idle, attention_prefill_sm90.cu).
// Why this shape, its FLOPs and the predicted times: docs/design/attention_prefill.md.
//
// Contract of attention_prefill_kernel<D, KG>, grid (ceil(M * G / 64), Hkv) x 128 * KG threads,
// plan.smem bytes of dynamic shared memory:
//  Inputs   q bf16 [M, H, D] (rotated), caches bf16 [capacity, Hkv, D] holding rows [0, *pos + M)
//           (the chunk's own rows appended already), *pos in device memory. Query m (position *pos + m)
//           attends to rows [0, *pos + m]. Rows at or past *pos + M are never read (the K/V tile
//           loader zero-fills them), so their contents do not matter.
//  Before its PDL wait nothing: q, *pos and the chunk's cache rows come from the kernel before.
//  Triggers its dependents (the o GEMM) after its key loop.
//  Writes   out bf16 [M, H, D], every element once; no scratch.
// Inside a block: warp w of key group k (KG groups of 4 warps) owns packed rows 16 w .. 16 w + 15
// and the key tiles k, k + KG, k + 2 KG, ...; with KG = 2 the two groups' (m, l, O) meet in shared
// memory at the end (one more warp per SM sub-partition when a chunk has fewer blocks than SMs).
#include <cstdint>
#include <string>
#include <type_traits>

#include "atomflow/kernels.h"
#include "atomflow/pdl.cuh"
#include "attention_prefill_block.cuh"
#include "attention_prefill_sm90.h"

namespace atomflow::kernels {

constexpr int kPfRows = 64;           // packed (query, head) rows per block: 4 warps x m16
constexpr int kPfKeys = 64;           // keys per K/V tile
constexpr int kPfGroupThreads = 128;  // one key group: 4 warps

// Shared memory rows are D + 8 bf16 (16 B of padding): the 8 rows of an ldmatrix phase then start
// in 8 different 16-byte bank groups for every D that is a multiple of 16 (64, 80, 96, 128).
template <int D>
struct PfLayout {
  static constexpr int kStride = D + 8;            // bf16 elements per shared memory row
  static constexpr int kTile = kPfKeys * kStride;  // one K or V tile
  static constexpr int kQ = kPfRows * kStride;     // the Q tile
  static constexpr int kGroup = 2 * 2 * kTile;     // a key group's 2 stages of (K, V)
  static constexpr size_t bytes(int kg) { return (static_cast<size_t>(kQ) + kg * kGroup) * sizeof(bf16); }
};

static __device__ __forceinline__ void pf_cp_async16(void* smem, const void* gmem, bool valid) {
  pf_cp_async16(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), gmem, valid);
}
static __device__ __forceinline__ void pf_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
static __device__ __forceinline__ void pf_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// The key group's own barrier (ids 1, 2; __syncthreads is 0): the groups run their loops apart.
// Immediate ids: a register id makes ptxas reserve all 16 barriers of the block.
static __device__ __forceinline__ void pf_group_sync(int group) {
  if (group == 0)
    asm volatile("bar.sync 1, %0;" ::"n"(kPfGroupThreads) : "memory");
  else
    asm volatile("bar.sync 2, %0;" ::"n"(kPfGroupThreads) : "memory");
}

static __device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* p) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
static __device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16* p) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
// d += a (16 x 16, row) * b (16 x 8, col), bf16 in, fp32 accumulate.
static __device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Fragment layouts (PTX m16n8k16): lane = 4 g + c holds accumulator rows g and g + 8 at columns
// 2c, 2c + 1 of each n8 tile (s[j][0..1]: row g, s[j][2..3]: row g + 8).
template <int D, int KG>
static __global__ void __launch_bounds__(kPfGroupThreads* KG, KG == 1 ? 2 : 1)
    attention_prefill_kernel(const bf16* q, const bf16* k_cache, const bf16* v_cache, const int32_t* pos_ptr, int M,
                             int H, int Hkv, int capacity, float q_scale, bf16* out) {
  using L = PfLayout<D>;
  constexpr int S = L::kStride;
  constexpr int KS = D / 16;       // k-steps of Q K^T (and d-pairs of P V)
  constexpr int NT = kPfKeys / 8;  // n8 tiles of a score row block
  constexpr int CH = D / 8;        // 16-byte chunks per row
  static_assert(D % 16 == 0 && kPfKeys * CH % kPfGroupThreads == 0, "whole fragments, whole loader rounds");
  extern __shared__ __align__(16) uint8_t pf_smem[];
  bf16* const sQ = reinterpret_cast<bf16*>(pf_smem);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int group = warp / 4, wq = warp % 4, gtid = tid % kPfGroupThreads;
  const int g = lane / 4, c = lane % 4;
  bf16* const sKV = sQ + L::kQ + group * L::kGroup;  // stage st: K at st * 2 kTile, V after it

  const PrefillBlock b = prefill_block<kPfRows>(pos_ptr, M, H, Hkv, capacity);  // after the PDL wait
  const int G = b.G, rows = b.rows, p0 = b.p0, h = b.h, pos = b.pos, n_keys = b.n_keys;
  const int n_kt = CEIL_DIV(n_keys, kPfKeys);

  // Q tile: packed row p = m * G + gh is q row (m, head h * G + gh); rows past M * G are zeros.
  for (int i = tid; i < kPfRows * CH; i += kPfGroupThreads * KG) {
    const int r = i / CH, ch = i % CH, p = p0 + r;
    const bool ok = p < rows;
    const int m = ok ? p / G : 0, gh = ok ? p % G : 0;
    pf_cp_async16(sQ + r * S + ch * 8, q + (static_cast<size_t>(m) * H + h * G + gh) * D + ch * 8, ok);
  }
  pf_commit();

  const size_t key_stride = static_cast<size_t>(Hkv) * D;
  auto load_kv = [&](int kt, int st) {
    bf16* const dk = sKV + st * 2 * L::kTile;
    bf16* const dv = dk + L::kTile;
#pragma unroll
    for (int n = 0; n < kPfKeys * CH / kPfGroupThreads; ++n) {
      const int i = gtid + n * kPfGroupThreads;
      const int r = i / CH, ch = i % CH, key = kt * kPfKeys + r;
      const bool ok = key < n_keys;  // past the block's keys: zeros, never the (unwritten) cache row
      const size_t off = (ok ? key : 0) * key_stride + static_cast<size_t>(h) * D + ch * 8;
      pf_cp_async16(dk + r * S + ch * 8, k_cache + off, ok);
      pf_cp_async16(dv + r * S + ch * 8, v_cache + off, ok);
    }
  };
  int kt = group;
  if (kt < n_kt) load_kv(kt, 0);
  pf_commit();
  pf_wait<1>();  // this thread's Q chunks
  __syncthreads();

  // This warp's 16 rows of Q as A fragments, for every k-step.
  uint32_t qf[KS][4];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) ldmatrix_x4(qf[ks], sQ + (wq * 16 + lane % 16) * S + ks * 16 + (lane / 16) * 8);

  // Causal limits (the last key each row sees): this lane's rows g and g + 8, and the warp's range.
  // Rows past M * G take the last row's limit: finite scores, never written out.
  auto limit = [&](int r) { return pos + min(p0 + r, rows - 1) / G; };
  const int lim0 = limit(wq * 16 + g), lim1 = limit(wq * 16 + g + 8);
  const int warp_lo = limit(wq * 16), warp_hi = limit(wq * 16 + 15);

  float o[2 * KS][4];
#pragma unroll
  for (int j = 0; j < 2 * KS; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_run[2] = {kPfNegInit, kPfNegInit}, l_run[2] = {0.f, 0.f};  // l: this lane's columns only

  for (int it = 0; kt < n_kt; kt += KG, ++it) {
    const int st = it & 1;
    if (kt + KG < n_kt) load_kv(kt + KG, st ^ 1);  // the stage read in the previous iteration
    pf_commit();
    pf_wait<1>();
    pf_group_sync(group);  // tile kt is in for the whole group
    const int kb = kt * kPfKeys;
    if (kb <= warp_hi) {  // else every row of this warp is past the tile: nothing to add
      const bf16* const sk = sKV + st * 2 * L::kTile;
      const bf16* const sv = sk + L::kTile;
      float s[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
      // S = Q K^T: per 16 keys, one ldmatrix.x4 gives the B fragments of two n8 tiles for one k-step.
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
#pragma unroll
        for (int nb = 0; nb < NT / 2; ++nb) {
          uint32_t b[4];
          ldmatrix_x4(b, sk + (nb * 16 + (lane / 16) * 8 + lane % 8) * S + ks * 16 + ((lane / 8) % 2) * 8);
          mma_bf16(s[2 * nb], qf[ks], b[0], b[1]);
          mma_bf16(s[2 * nb + 1], qf[ks], b[2], b[3]);
        }
      // Scores in log2 units; the causal mask only where the tile crosses a row's limit.
      const bool masked = kb + kPfKeys - 1 > warp_lo;
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = s[j][e] * q_scale;
          if (masked && kb + 8 * j + 2 * c + (e & 1) > (e < 2 ? lim0 : lim1)) v = -INFINITY;
          s[j][e] = v;
        }
      // Online softmax per row (the 4 lanes of a quad share a row): rescale once per tile.
      float mx[2] = {m_run[0], m_run[1]};
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        mx[0] = fmaxf(mx[0], fmaxf(s[j][0], s[j][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[j][2], s[j][3]));
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        const float corr = exp2f(m_run[i] - mx[i]);  // mx >= m_run, finite: in (0, 1]
        m_run[i] = mx[i];
        l_run[i] *= corr;
#pragma unroll
        for (int j = 0; j < 2 * KS; ++j) {
          o[j][2 * i] *= corr;
          o[j][2 * i + 1] *= corr;
        }
      }
      // O += P V: P's accumulator layout is the A fragment of 16 keys (n8 tiles 2 kk and 2 kk + 1);
      // V [key][d] row-major needs the transposing ldmatrix for the col-major B operand.
#pragma unroll
      for (int kk = 0; kk < NT / 2; ++kk) {
        uint32_t a[4];
        a[0] = pf_pack_p(exp2f(s[2 * kk][0] - m_run[0]), exp2f(s[2 * kk][1] - m_run[0]), l_run[0]);
        a[1] = pf_pack_p(exp2f(s[2 * kk][2] - m_run[1]), exp2f(s[2 * kk][3] - m_run[1]), l_run[1]);
        a[2] = pf_pack_p(exp2f(s[2 * kk + 1][0] - m_run[0]), exp2f(s[2 * kk + 1][1] - m_run[0]), l_run[0]);
        a[3] = pf_pack_p(exp2f(s[2 * kk + 1][2] - m_run[1]), exp2f(s[2 * kk + 1][3] - m_run[1]), l_run[1]);
#pragma unroll
        for (int dn = 0; dn < KS; ++dn) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, sv + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * S + dn * 16 + (lane / 16) * 8);
          mma_bf16(o[2 * dn], a, b[0], b[1]);
          mma_bf16(o[2 * dn + 1], a, b[2], b[3]);
        }
      }
    }
    pf_group_sync(group);  // stage st read by the whole group: the next iteration may refill it
  }
  pf_wait<0>();  // only empty groups can be pending; none may land after the merge reuses the stages
  pdl_launch_dependents();

  // The row sums over the quad's columns.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
  }
  if constexpr (KG == 2) {
    // Group 1 hands its (m, l, O) to the lane of group 0 that holds the same rows and columns,
    // through its own (now idle) K / V stages: [value][128 lanes] floats, conflict-free.
    float* const xch = reinterpret_cast<float*>(sQ + L::kQ + L::kGroup);
    constexpr int NV = 2 * KS * 4 + 4;
    static_assert(NV * kPfGroupThreads * sizeof(float) <= L::kGroup * sizeof(bf16), "exchange fits the stages");
    if (group == 1) {
#pragma unroll
      for (int j = 0; j < 2 * KS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) xch[(j * 4 + e) * kPfGroupThreads + gtid] = o[j][e];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        xch[(8 * KS + i) * kPfGroupThreads + gtid] = m_run[i];
        xch[(8 * KS + 2 + i) * kPfGroupThreads + gtid] = l_run[i];
      }
    }
    __syncthreads();
    if (group == 1) return;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m1 = xch[(8 * KS + i) * kPfGroupThreads + gtid], l1 = xch[(8 * KS + 2 + i) * kPfGroupThreads + gtid];
      const float mx = fmaxf(m_run[i], m1);
      const float f0 = exp2f(m_run[i] - mx), f1 = exp2f(m1 - mx);  // a group without keys: m = kPfNegInit, l = 0
      l_run[i] = l_run[i] * f0 + l1 * f1;
#pragma unroll
      for (int j = 0; j < 2 * KS; ++j) {
        o[j][2 * i] = o[j][2 * i] * f0 + xch[(j * 4 + 2 * i) * kPfGroupThreads + gtid] * f1;
        o[j][2 * i + 1] = o[j][2 * i + 1] * f0 + xch[(j * 4 + 2 * i + 1) * kPfGroupThreads + gtid] * f1;
      }
    }
  }

  // Out: row (m, head h * G + gh) of packed row p = m * G + gh; l > 0 (key 0 is seen by every row).
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int p = p0 + wq * 16 + g + 8 * i;
    if (p >= rows) continue;
    const int m = p / G, gh = p % G;
    bf16* const dst = out + (static_cast<size_t>(m) * H + h * G + gh) * D + 2 * c;
    const float inv_l = 1.f / l_run[i];
#pragma unroll
    for (int j = 0; j < 2 * KS; ++j)
      *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) =
          __floats2bfloat162_rn(o[j][2 * i] * inv_l, o[j][2 * i + 1] * inv_l);
  }
}

// ---- launchers ----

// Key groups per block: two (8 warps, one block per SM for D = 128) when the chunk has no more
// blocks than SMs, so the SMs it occupies run 8 warps instead of 4; else one (4 warps, 2 blocks per SM).
// sm_count 0 (the test harness's override) always gives one.
static int pf_key_groups(int blocks, int sm_count) { return blocks <= sm_count ? 2 : 1; }

template <class Fn>
static decltype(auto) pf_for_head_dim(int D, Fn&& fn) {
  switch (D) {
    case 64: return fn(std::integral_constant<int, 64>{});
    case 80: return fn(std::integral_constant<int, 80>{});
    case 96: return fn(std::integral_constant<int, 96>{});
    case 128: return fn(std::integral_constant<int, 128>{});
    default: AF_CHECK(false, "attention_prefill: head_dim must be 64, 80, 96 or 128");
  }
  return fn(std::integral_constant<int, 64>{});  // not reached
}

bool attention_prefill_supported(int D, int group) {
  return group >= 1 && group <= kMaxPrefillGroup && (D == 64 || D == 80 || D == 96 || D == 128);
}

bool attention_prefill_wgmma_takes(int D) { return D == attention_prefill_wgmma_head_dim(); }

PrefillAttnPlan plan_attention_prefill(int M, int H, int Hkv, int D, int sm_count, PrefillAttnKernel kernel,
                                       int prior) {
  AF_CHECK(M >= 1 && H >= 1 && Hkv >= 1 && H % Hkv == 0, "plan_attention_prefill: M, H, Hkv >= 1, H a multiple of Hkv");
  AF_CHECK(H / Hkv <= kMaxPrefillGroup, "attention_prefill: at most 16 query heads per kv head");
  AF_CHECK(D == 64 || D == 80 || D == 96 || D == 128, "attention_prefill: head_dim must be 64, 80, 96 or 128");
  AF_CHECK(sm_count >= 0 && prior >= 0, "plan_attention_prefill: sm_count and prior must be >= 0");
  AF_CHECK(kernel != PrefillAttnKernel::Wgmma || attention_prefill_wgmma_takes(D),
           "attention_prefill: the wgmma kernel takes head_dim 128");
  PrefillAttnPlan p{};
  p.M = M;
  p.H = H;
  p.Hkv = Hkv;
  p.D = D;
  p.kernel = kernel != PrefillAttnKernel::Auto  ? kernel
             : attention_prefill_wgmma_takes(D) ? PrefillAttnKernel::Wgmma
                                                : PrefillAttnKernel::Mma;
  if (p.kernel == PrefillAttnKernel::Wgmma) {
    p.tiles = CEIL_DIV(M * (H / Hkv), attention_prefill_wgmma_rows());
    p.key_groups = 1;
    p.threads = attention_prefill_wgmma_threads();
    p.smem = attention_prefill_wgmma_smem();
    // The key tiles of the chunk's last block (its rows see every key), split where that costs less.
    const int blocks = p.tiles * Hkv, key_tiles = CEIL_DIV(prior + M, attention_prefill_wgmma_rows());
    p.splits = 1;
    if (sm_count > 0) {
      long long best = prefill_attn_split_cost(blocks, key_tiles, 1, sm_count);
      for (int s = 2; s <= kPrefillAttnMaxSplits && s * kPrefillAttnSplitTiles <= key_tiles &&
                      static_cast<long long>(blocks) * s <= static_cast<long long>(kPrefillAttnSplitWaves) * sm_count;
           ++s) {
        const long long c = prefill_attn_split_cost(blocks, key_tiles, s, sm_count);
        if (c < best) best = c, p.splits = s;
      }
    }
    return p;
  }
  p.splits = 1;
  p.tiles = CEIL_DIV(M * (H / Hkv), kPfRows);
  p.key_groups = pf_key_groups(p.tiles * Hkv, sm_count);
  p.threads = kPfGroupThreads * p.key_groups;
  p.smem = pf_for_head_dim(D, [&](auto d) { return PfLayout<decltype(d)::value>::bytes(p.key_groups); });
  return p;
}

size_t attention_prefill_scratch_bytes(const PrefillAttnPlan& p) {
  return p.kernel == PrefillAttnKernel::Wgmma ? attention_prefill_wgmma_scratch(p.M, p.H, p.splits) : 0;
}

size_t attention_prefill_scratch_max(int D, int sm_count) {
  if (!attention_prefill_wgmma_takes(D)) return 0;
  return static_cast<size_t>(kPrefillAttnSplitWaves) * sm_count * attention_prefill_wgmma_rows() * (D + 2) *
         sizeof(float);
}

std::string attention_prefill_name(const PrefillAttnPlan& p) {
  if (p.kernel == PrefillAttnKernel::Wgmma)
    return "attention_prefill_wgmma<D=" + std::to_string(p.D) + ">" +
           (p.splits > 1 ? " x " + std::to_string(p.splits) + " splits" : "");
  return "attention_prefill<D=" + std::to_string(p.D) + ", KG=" + std::to_string(p.key_groups) + ">";
}

template <int D, int KG>
static void launch_prefill(const PrefillAttnPlan& plan, const bf16* q, const bf16* k_cache, const bf16* v_cache,
                           const int32_t* pos, int max_context, float q_scale, bf16* out, cudaStream_t stream) {
  // Past 48 KB of dynamic shared memory: set once (not inside a graph capture: the engine's first
  // prefill runs before it captures the decode step, and tests call it eagerly).
  static const bool configured = [] {
    AF_CUDA_CHECK(cudaFuncSetAttribute(attention_prefill_kernel<D, KG>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(PfLayout<D>::bytes(KG))));
    return true;
  }();
  (void)configured;
  af_launch(attention_prefill_kernel<D, KG>, dim3(plan.tiles, plan.Hkv), dim3(plan.threads), plan.smem, stream, q,
            k_cache, v_cache, pos, plan.M, plan.H, plan.Hkv, max_context, q_scale, out);
}

void attention_prefill(const PrefillAttnPlan& plan, const bf16* q, const bf16* k_cache, const bf16* v_cache,
                       const int32_t* pos, int M, int H, int Hkv, int D, int max_context, float scale, bf16* out,
                       cudaStream_t stream, void* scratch) {
  AF_CHECK(plan.M == M && plan.H == H && plan.Hkv == Hkv && plan.D == D,
           "attention_prefill: the plan is not this call's (plan_attention_prefill(M, H, Hkv, D, sm_count))");
  AF_CHECK(M >= 1 && M <= max_context, "attention_prefill: need 1 <= M <= max_context");
  AF_CHECK(Hkv <= 65535, "attention_prefill: Hkv too large for the grid");
  AF_CHECK(reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(k_cache) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(v_cache) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 4 == 0,
           "attention_prefill: q and the caches must be 16-byte aligned, out 4-byte aligned");
  const float q_scale = scale * 1.4426950408889634f;  // scores in log2 units: exp2f in the softmax
  if (plan.kernel == PrefillAttnKernel::Wgmma) {
    AF_CHECK(
        plan.splits == 1 || (scratch != nullptr && reinterpret_cast<uintptr_t>(scratch) % 16 == 0),
        "attention_prefill: a plan with splits needs a 16-byte aligned scratch of attention_prefill_scratch_bytes");
    attention_prefill_wgmma(plan.tiles, plan.splits, q, k_cache, v_cache, pos, M, H, Hkv, max_context, q_scale, out,
                            static_cast<float*>(scratch), stream);
    return;
  }
  pf_for_head_dim(D, [&](auto d) {
    constexpr int Dc = decltype(d)::value;
    if (plan.key_groups == 2)
      launch_prefill<Dc, 2>(plan, q, k_cache, v_cache, pos, max_context, q_scale, out, stream);
    else
      launch_prefill<Dc, 1>(plan, q, k_cache, v_cache, pos, max_context, q_scale, out, stream);
    return 0;
  });
}

}  // namespace atomflow::kernels

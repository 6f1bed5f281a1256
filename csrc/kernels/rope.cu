// RoPE (HF rotate-half) on the q and k heads of a fused qkv row, then the KV-cache append:
// one block per token (and per 8 heads with the per-head q/k norms); cos/sin computed once per
// (token, frequency) in a block and shared by its heads.
// Templated on a row policy (STYLE.md habit 11): where token m sits and which cache row it
// fills. ContiguousRows is the core engine's (position *pos + m, row = position); SlotRows is the
// sandbox's paged cache (position and destination row given per token by the host).
//
// Contract of rope_kv_append_kernel<Rows, QK_NORM>, grid (M, 1) (QK_NORM: (M, ceil((H + 2 Hkv) /
// kRopeWarps))): reads qkv fp32 [M, (H + 2 Hkv) D], inv_freq, and the position (or positions /
// slots) only after its PDL wait (pdl_prologue); writes q bf16 [M, H, D] and the token's K / V cache
// rows (nothing for a row outside the cache), each element once. The extras (kernels.h, QkvExtras):
// the bias, added to every column as it is read; with QK_NORM, one warp per head (a block holds
// kRopeWarps of them) reduces a q / k head's D biased values to its inverse RMS, then normalizes,
// rotates and stores them (the plain instance splits heads into rotation pairs instead).
// Generic over D (even, <= kMaxRopeHeadDim): a lane strides over a head's values.
#include "atomflow/kernels.h"
#include "atomflow/pdl.cuh"
#include "atomflow/rope.cuh"

namespace atomflow::kernels {

constexpr int kRopeThreads = 256;
constexpr int kRopeWarps = kRopeThreads / 32;  // heads per block of the QK_NORM instance

// Token m at position *pos + m, stored in cache row p while p < max_context.
struct ContiguousRows {
  const int32_t* pos;
  int max_context;
  __device__ __forceinline__ int position(int m) const { return *pos + m; }
  __device__ __forceinline__ long long row(int, int p) const { return p < max_context ? p : -1; }
};

// Token m at positions[m], stored in row slots[m] of the pool while the slot is inside it.
struct SlotRows {
  const int32_t* positions;
  const int32_t* slots;
  long long num_slots;
  __device__ __forceinline__ int position(int m) const { return positions[m]; }
  __device__ __forceinline__ long long row(int m, int) const {
    const long long s = slots[m];
    return s >= 0 && s < num_slots ? s : -1;
  }
};

template <class Rows, bool QK_NORM>
static __global__ void __launch_bounds__(kRopeThreads)
    rope_kv_append_kernel(const float* qkv, const float* __restrict__ inv_freq, const Rows rows, int H, int Hkv, int D,
                          const QkvExtras ex, bf16* __restrict__ q_out, bf16* __restrict__ k_cache,
                          bf16* __restrict__ v_cache) {
  extern __shared__ float cs[];  // cos [D/2], then sin [D/2]
  pdl_prologue();
  const int half = D / 2;
  const int m = blockIdx.x;
  const int p = rows.position(m);
  // The destination row, -1 for none. Read before the sincosf loop: read after it, ptxas gave the
  // kernel a stack frame. The host guards the position too; a token past the cache is still
  // rotated into q_out but never written outside the cache.
  const long long dest = rows.row(m, p);
  for (int i = threadIdx.x; i < half; i += kRopeThreads) {
    rope_cos_sin(p, inv_freq[i], cs[i], cs[half + i]);
  }
  __syncthreads();

  const float* row = qkv + static_cast<size_t>(m) * (H + 2 * Hkv) * D;
  const bool in_cache = dest >= 0;
  bf16* k_row = k_cache + static_cast<size_t>(in_cache ? dest : 0) * Hkv * D;
  bf16* v_row = v_cache + static_cast<size_t>(in_cache ? dest : 0) * Hkv * D;
  // Column c of the row with its bias: one rounded add, as the fused QKV epilogue does it.
  const float* bias = ex.bias;
  const auto value = [&](int c) { return bias != nullptr ? __fadd_rn(row[c], bias[c]) : row[c]; };

  if constexpr (!QK_NORM) {
    // Rotation pairs (i, i + D/2) of the H query heads, then of the Hkv key heads.
    for (int idx = threadIdx.x; idx < (H + Hkv) * half; idx += kRopeThreads) {
      const int head = idx / half, i = idx % half;
      const float x1 = value(head * D + i), x2 = value(head * D + i + half);
      float o1, o2;
      rope_rotate(x1, x2, cs[i], cs[half + i], o1, o2);
      if (head < H) {
        bf16* q = q_out + (static_cast<size_t>(m) * H + head) * D;
        q[i] = __float2bfloat16(o1);
        q[i + half] = __float2bfloat16(o2);
      } else if (in_cache) {
        bf16* k = k_row + (head - H) * D;
        k[i] = __float2bfloat16(o1);
        k[i + half] = __float2bfloat16(o2);
      }
    }
    if (in_cache) {
      const int v0 = (H + Hkv) * D;
      for (int idx = threadIdx.x; idx < Hkv * D; idx += kRopeThreads) v_row[idx] = __float2bfloat16(value(v0 + idx));
    }
  } else {
    // One warp per head of the row, grid.y covering the H + 2 Hkv heads kRopeWarps at a time (a decode
    // step's one token still spreads over several SMs): a q or k head's inverse RMS over its D biased
    // values (a lane's squares, then a butterfly), then each pair normalized with the head's weight,
    // rotated and stored; a v head appended as it is.
    const int lane = threadIdx.x % 32;
    const int head = blockIdx.y * kRopeWarps + threadIdx.x / 32;
    const int c0 = head * D;
    if (head >= H + Hkv) {
      if (head < H + 2 * Hkv && in_cache) {
        bf16* v = v_row + static_cast<size_t>(head - H - Hkv) * D;
        for (int i = lane; i < D; i += 32) v[i] = __float2bfloat16(value(c0 + i));
      }
      return;
    }
    float ss = 0.f;
    for (int i = lane; i < D; i += 32) {
      const float x = value(c0 + i);
      ss = fmaf(x, x, ss);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float r = rsqrtf(ss / static_cast<float>(D) + ex.eps);
    const bf16* w = head < H ? ex.q_norm : ex.k_norm;
    bf16* dst = head < H ? q_out + (static_cast<size_t>(m) * H + head) * D
                         : (in_cache ? k_row + static_cast<size_t>(head - H) * D : nullptr);
    if (dst == nullptr) return;  // a key past the cache: nothing to write
    for (int i = lane; i < half; i += 32) {
      const float x1 = value(c0 + i) * r * __bfloat162float(w[i]);
      const float x2 = value(c0 + i + half) * r * __bfloat162float(w[i + half]);
      float o1, o2;
      rope_rotate(x1, x2, cs[i], cs[half + i], o1, o2);
      dst[i] = __float2bfloat16(o1);
      dst[i + half] = __float2bfloat16(o2);
    }
  }
}

// ---- launchers ----

// Checks shared by both row policies, then the instance the extras need.
template <class Rows>
static void launch_rope(const char* what, const float* qkv, const float* inv_freq, const Rows& rows, int M, int H,
                        int Hkv, int D, const QkvExtras& ex, bf16* q_out, bf16* k_cache, bf16* v_cache,
                        cudaStream_t stream) {
  AF_CHECK(D >= 2 && D % 2 == 0 && D <= kMaxRopeHeadDim, std::string(what) + ": head_dim must be even and <= 1024");
  AF_CHECK((ex.q_norm == nullptr) == (ex.k_norm == nullptr), std::string(what) + ": q_norm and k_norm come together");
  AF_CHECK(ex.q_norm == nullptr || ex.eps > 0.f, std::string(what) + ": the q/k norms need eps > 0");
  const size_t smem = static_cast<size_t>(D) * sizeof(float);
  if (ex.q_norm != nullptr)  // a block per token and kRopeWarps heads
    af_launch(rope_kv_append_kernel<Rows, true>, dim3(M, CEIL_DIV(H + 2 * Hkv, kRopeWarps)), dim3(kRopeThreads), smem,
              stream, qkv, inv_freq, rows, H, Hkv, D, ex, q_out, k_cache, v_cache);
  else
    af_launch(rope_kv_append_kernel<Rows, false>, dim3(M), dim3(kRopeThreads), smem, stream, qkv, inv_freq, rows, H,
              Hkv, D, ex, q_out, k_cache, v_cache);
}

void rope_kv_append(const float* qkv, const float* inv_freq, const int32_t* pos, int M, int H, int Hkv, int D,
                    int max_context, bf16* q_out, bf16* k_cache, bf16* v_cache, cudaStream_t stream,
                    const QkvExtras& extras) {
  AF_CHECK(M >= 1 && H >= 1 && Hkv >= 1 && max_context >= 1, "rope_kv_append: M, H, Hkv, max_context must be >= 1");
  launch_rope("rope_kv_append", qkv, inv_freq, ContiguousRows{pos, max_context}, M, H, Hkv, D, extras, q_out, k_cache,
              v_cache, stream);
}

void rope_kv_append_slots(const float* qkv, const float* inv_freq, const int32_t* positions, const int32_t* slots,
                          int M, int H, int Hkv, int D, long long num_slots, bf16* q_out, bf16* k_pool, bf16* v_pool,
                          cudaStream_t stream, const QkvExtras& extras) {
  AF_CHECK(M >= 1 && H >= 1 && Hkv >= 1 && num_slots >= 1, "rope_kv_append_slots: M, H, Hkv, num_slots must be >= 1");
  launch_rope("rope_kv_append_slots", qkv, inv_freq, SlotRows{positions, slots, num_slots}, M, H, Hkv, D, extras, q_out,
              k_pool, v_pool, stream);
}

}  // namespace atomflow::kernels

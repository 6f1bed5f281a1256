// The sandbox's kernel harness: each sandbox kernel on host arrays (device copies in, outputs
// poisoned with 0xFF bytes first so an unwritten element cannot pass, one launch, copies out), and
// the timers behind `atomflow sandbox bench`. bf16 values travel as uint16 bit patterns.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace atomflow::sandbox {

// attention_paged: q [B * M, H, D], pools [num_blocks, block_size, Hkv, D], tables [B, max_blocks],
// lens [B] -> out [B * M, H, D].
void run_attention_paged(const uint16_t* q, const uint16_t* k_pool, const uint16_t* v_pool, const int32_t* tables,
                         const int32_t* lens, int B, int M, int H, int Hkv, int D, int block_size, int num_blocks,
                         int max_blocks, float scale, uint16_t* out);
// attention_batched: caches [B, capacity, Hkv, D].
void run_attention_batched(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* lens,
                           int B, int M, int H, int Hkv, int D, int capacity, float scale, uint16_t* out);
// attention_batched, several calls in a row on ONE scratch (sized for the largest, cleared once), as
// the engines call it: each call as run_attention_batched; H, Hkv and D shared.
struct BatchedAttentionCall {
  const uint16_t* q;
  const uint16_t* k_cache;
  const uint16_t* v_cache;
  const int32_t* lens;
  int B, M, capacity;
  uint16_t* out;
};
void run_attention_batched_calls(const std::vector<BatchedAttentionCall>& calls, int H, int Hkv, int D, float scale);
// attention (the core's launcher): caches [capacity, Hkv, D], queries at pos .. pos + M - 1.
void run_attention_contiguous(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, int pos, int M,
                              int H, int Hkv, int D, int capacity, float scale, uint16_t* out);
// rope_kv_append_slots: qkv f32 [M, (H + 2 Hkv) D]; pools [num_slots, Hkv, D] updated in place.
void run_rope_slots(const float* qkv, const float* inv_freq, const int32_t* positions, const int32_t* slots, int M,
                    int H, int Hkv, int D, long long num_slots, uint16_t* q_out, uint16_t* k_pool, uint16_t* v_pool);
// argmax_rows: logits f32 [L, vocab] -> tokens [L].
void run_argmax_rows(const float* logits, int L, int vocab, int32_t* tokens);

// Microseconds per decode-attention call (split + merge) for sequences of the given lengths (one
// query each), median over `iters` batches of 10 back-to-back calls, the KV rotated over enough
// copies that the L2 cannot serve it. layout: "contiguous" (B = 1: the core's attention(); B > 1:
// attention_batched over [B, max(lens)] caches) or "paged" (attention_paged; with scatter the
// blocks of each sequence are a random permutation of the pool, else consecutive).
double time_attention(const std::string& layout, const std::vector<int32_t>& lens, int H, int Hkv, int D,
                      int block_size, bool scatter, int iters, uint64_t seed);
// GB/s of the streaming-read kernel over n_bytes (the bandwidth ceiling the bench reports against).
double stream_read_gbs(size_t n_bytes, int iters);
// Whether a usable GPU is present: (ok, reason). Never throws.
std::pair<bool, std::string> cuda_available();
// The current device's name and memory: (name, total bytes, free bytes). Throws without a GPU.
std::tuple<std::string, size_t, size_t> device_info();

}  // namespace atomflow::sandbox

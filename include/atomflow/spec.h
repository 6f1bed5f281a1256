// ModelSpec: the C++ mirror of atomflow/model/spec.py's validated dataclass. Plain data, no logic
// beyond derived sizes; Python validates, C++ trusts (and asserts what kernels need).
#pragma once
#include <cstdint>

namespace atomflow {

enum class RopeType : int32_t { Default = 0, Llama3 = 1, Linear = 2 };  // informational: inv_freq carries it
// informational: what differs between them is the fields below (attention_bias, qk_norm)
enum class Arch : int32_t { Llama = 0, Mistral = 1, Qwen2 = 2, Qwen3 = 3 };

struct ModelSpec {
  int32_t vocab_size = 0;
  int32_t hidden_size = 0;        // d
  int32_t intermediate_size = 0;  // ffn
  int32_t num_layers = 0;
  int32_t num_heads = 0;     // query heads
  int32_t num_kv_heads = 0;  // GQA: num_heads % num_kv_heads == 0
  int32_t head_dim = 0;      // independent of hidden_size / num_heads (Qwen3)
  float rms_norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  RopeType rope_type = RopeType::Default;
  float rope_factor = 1.0f;
  float rope_low_freq_factor = 1.0f;
  float rope_high_freq_factor = 4.0f;
  int32_t rope_original_max_position_embeddings = 0;
  int32_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool lm_head_fp8 = true;  // false: lm_head is bf16 (or the embedding itself when tied)
  Arch arch = Arch::Llama;
  bool attention_bias = false;  // q/k/v biases (Qwen2): layers.{i}.bqkv fp32 [qkv_dim], added to the QKV product
  bool qk_norm = false;         // RMSNorm of each q and k head over head_dim before RoPE (Qwen3): layers.{i}.q_norm,
                                // k_norm bf16 [head_dim], eps = rms_norm_eps
  int32_t sliding_window = 0;   // 0: none; else the front never runs a longer context (Mistral v0.1)

  int32_t q_dim() const { return num_heads * head_dim; }
  int32_t kv_dim() const { return num_kv_heads * head_dim; }
  int32_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }
  int32_t group_size() const { return num_heads / num_kv_heads; }
};

// FP8 quantization: one fp32 scale per output row per this many input columns.
constexpr int kQuantGroup = 128;

}  // namespace atomflow

// The model's layout in the arena: which tensor of the file feeds which role (checked against
// the spec), and the offset of every slot (weights, KV cache, activations, scratch, state).
#pragma once
#include <cstddef>
#include <string>
#include <unordered_map>
#include <vector>

#include "atomflow/arena.h"
#include "atomflow/loader.h"
#include "atomflow/spec.h"

namespace atomflow {

// The file's tensors by role. Pointers into the table handed to the engine.
struct LayerTensors {
  const TensorInfo *attn_norm, *wqkv, *wqkv_scale, *wo, *wo_scale;
  const TensorInfo *mlp_norm, *w13, *w13_scale, *w2, *w2_scale;
  const TensorInfo* bqkv = nullptr;                       // with the spec's attention_bias
  const TensorInfo *q_norm = nullptr, *k_norm = nullptr;  // with the spec's qk_norm
};

struct ModelTensors {
  const TensorInfo* embed = nullptr;
  const TensorInfo* final_norm = nullptr;
  const TensorInfo* lm_head = nullptr;        // == embed for a tied bf16 head
  const TensorInfo* lm_head_scale = nullptr;  // only for an FP8 head
  bool lm_head_fp8 = true;
  std::vector<LayerTensors> layers;
};

// Finds every tensor the engine reads and checks its dtype, shape, byte count and that it lies
// inside a file of `file_size` bytes. Throws std::invalid_argument naming the first problem.
ModelTensors resolve_tensors(const ModelSpec& spec, const std::vector<TensorInfo>& table, uint64_t file_size);

// The slot of a tensor the model does not have (LayerSlots' optional ones).
constexpr size_t kNoSlot = static_cast<size_t>(-1);

struct LayerSlots {
  size_t attn_norm, wqkv, wqkv_scale, wo, wo_scale, mlp_norm, w13, w13_scale, w2, w2_scale;
  size_t bqkv, q_norm, k_norm;  // kNoSlot without attention_bias / qk_norm
  // The four products' scales transposed to [ceil(K / 128), N] for the sm90 prefill GEMM (made at load;
  // kNoSlot when the plan does not run it).
  size_t wqkv_scale_gn, wo_scale_gn, w13_scale_gn, w2_scale_gn;
  size_t k_cache, v_cache;  // bf16 [max_context, kv_heads, head_dim] each
};

struct Layout {
  ArenaPlan plan;
  std::unordered_map<const TensorInfo*, size_t> weight_slot;  // every tensor copied from the file
  size_t embed, final_norm, lm_head, lm_head_scale, inv_freq;
  std::vector<LayerSlots> layers;
  // Activations, sized for `prefill_chunk` rows (decode uses row 0).
  size_t x;         // fp32 [chunk, d]   the residual stream
  size_t xn;        // bf16 [chunk, d]   rmsnorm output
  size_t qkv;       // fp32 [chunk, qkv_dim]
  size_t q;         // bf16 [chunk, heads, head_dim]  roped queries
  size_t attn_out;  // 16-bit [chunk, heads, head_dim]: bf16, fp16 in a decode step (kernels.h)
  size_t ffn;       // 16-bit [chunk, ffn]  SwiGLU output, typed as attn_out
  size_t logits;    // fp32 [StepPlan::kLogitRows, vocab]
  size_t ids;       // int32 [max_context]  prompt ids
  // Scratch and the small device state the decode graph reads.
  size_t attn_scratch, sample_scratch, gemv_tickets;
  size_t attn_prefill_scratch;  // the prefill attention's split partials (kernels.h), kNoSlot when none
  size_t norm_ss;               // fp32: the skinny GEMM's sums of squares of a split RMSNorm (kernels.h, SkinnyNormOut)
  size_t gemm_ws;               // the sm90 prefill GEMM's workspace (kernels.h), sized for a chunk's largest product
  size_t gemm_ws_bytes;
  size_t head_best;  // uint64 [head_best_n]: the FP8 head's per-block argmax keys (kernels.h)
  int head_best_n;
  size_t pos;           // int32[2] = {tokens in the KV cache, that + 1: the sampler's RNG counter}
  size_t token;         // int32: the decode step's input token (the sampled one after the step)
  size_t f16_overflow;  // int32: set by a decode step whose fp16 activations overflowed (kernels.h)
  size_t sampling;      // kernels::SamplingConfig
};

// Pure function of its arguments, so the engine can also search for the largest max_context
// that fits the free memory.
// head_blocks: the FP8 head GEMV's grid (the step plan's head.blocks), one argmax key per block.
// prefill_scales: reserve the transposed scales of the sm90 prefill GEMM (StepPlan::sm90_gemm_min_rows).
// prefill_attn_scratch: bytes of the prefill attention's split partials (attention_prefill_scratch_max).
Layout plan_layout(const ModelSpec& spec, const ModelTensors& tensors, int max_context, int prefill_chunk,
                   int head_blocks, bool prefill_scales, size_t prefill_attn_scratch);

}  // namespace atomflow

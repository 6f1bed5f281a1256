// make_step_plan: the engine's launch decisions for one model on this GPU (include/atomflow/step_plan.h).
#include "atomflow/step_plan.h"

#include <algorithm>
#include <iterator>
#include <stdexcept>

#include "atomflow/pdl.cuh"

namespace atomflow {

namespace {

// Whether the decode QKV product may take RoPE and the KV append into its epilogue (StepPlan::fused_qkv):
// every per-row step of the Llama family fits it (the bias is one add per output), a per-head
// reduction does not (qk_norm: a warp holds two outputs of a head, the head's D outputs lie across
// D / 2 warps and blocks); there attention takes the product's raw row (attention_qkv), where a
// warp holds a whole head.
bool qkv_fusable(const ModelSpec& s) { return !s.qk_norm; }

}  // namespace

const kernels::AttnPlan& StepPlan::decode_attention(int attn_keys) const {
  if (attn_keys == attn.capacity) return attn;
  if (short_keys > 0 && attn_keys == attn_short.capacity) return attn_short;
  throw std::logic_error("step plan: no decode attention planned for " + std::to_string(attn_keys) + " keys");
}

kernels::AttnPlan StepPlan::probe_attention(int attn_keys) const {
  return kernels::plan_attention(1, num_heads, num_kv_heads, head_dim, attn_keys, options.cluster_merge, false, false,
                                 attn_halved);
}

kernels::PrefillAttnPlan StepPlan::prefill_attention(int rows, int prior) const {
  return kernels::plan_attention_prefill(rows, num_heads, num_kv_heads, head_dim, sm_count, prefill_attn_kernel, prior);
}

StepPlan make_step_plan(const ModelSpec& s, int max_context, const PlanOptions& options) {
  using kernels::Epilogue;
  using kernels::GemvIn;
  AF_CHECK(max_context >= 1, "step plan: max_context must be >= 1");
  StepPlan p;
  p.options = options;
  p.max_context = max_context;
  int dev = 0;
  cudaDeviceProp prop{};
  AF_CUDA_CHECK(cudaGetDevice(&dev));
  AF_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  p.device = prop.name;
  p.sm_count = prop.multiProcessorCount;
  p.cc_major = prop.major;
  p.cc_minor = prop.minor;
  p.pdl = pdl_enabled();
  p.short_keys = options.short_steps && max_context > StepPlan::kShortKeys ? StepPlan::kShortKeys : 0;

  const int d = s.hidden_size, f = s.intermediate_size;
  const kernels::GemvKnobs knobs = p.knobs();
  p.fused_qkv = qkv_fusable(s);
  // A fused product with q/k/v biases is its own instance (qkv.bias): one without keeps a Llama's
  // machine code free of the bias.
  p.qkv = kernels::plan_gemv(p.fused_qkv ? Epilogue::RopeKV : Epilogue::Store, GemvIn::NORM, s.qkv_dim(), d, knobs,
                             p.fused_qkv && s.attention_bias);
  // Either way attention may read the cache of earlier steps before its wait (`early`): the product
  // lets it launch only after its own wait (RopeKV always does; the split path's Store says so).
  p.qkv.late_trigger = !p.fused_qkv;
  p.small_m_rope = p.fused_qkv && s.head_dim % 16 == 0;
  p.o_f16 = kernels::plan_gemv(Epilogue::AddResidual, GemvIn::F16, d, s.q_dim(), knobs);
  p.o_bf16 = kernels::plan_gemv(Epilogue::AddResidual, GemvIn::BF16, d, s.q_dim(), knobs);
  p.gate_up = kernels::plan_gemv(Epilogue::SwiGLU, GemvIn::NORM, 2 * f, d, knobs);
  p.down_f16 = kernels::plan_gemv(Epilogue::AddResidual, GemvIn::F16, d, f, knobs);
  p.down_bf16 = kernels::plan_gemv(Epilogue::AddResidual, GemvIn::BF16, d, f, knobs);
  p.fp8_head = s.lm_head_fp8;
  if (s.lm_head_fp8) {
    p.head = kernels::plan_gemv(Epilogue::Store, GemvIn::NORM, s.vocab_size, d, knobs);
    p.probe_head = kernels::plan_gemv(Epilogue::Store, GemvIn::F16, s.vocab_size, d, knobs);
  }
  p.probe_qkv = kernels::plan_gemv(Epilogue::Store, GemvIn::F16, s.qkv_dim(), d, knobs);
  p.probe_gate_up = kernels::plan_gemv(Epilogue::SwiGLU, GemvIn::F16, 2 * f, d, knobs);

  const int H = s.num_heads, Hkv = s.num_kv_heads, D = s.head_dim;
  // A split QKV path's decode attention takes the product's raw row (attention_qkv).
  const bool qkv_in = !p.fused_qkv;
  // Halved (StepPlan::attn_halved): a qk_norm model (its prologue makes the query heads), and 4 query
  // heads per kv head at head_dim 128 (the measured shape: Llama-3.1-8B decode at depth 8192 3.762 ->
  // 3.453 ms, 1024 -1.7%, but 128..384 keys +0.8%; log 2026-11-26 j).
  p.attn_halved = qkv_in || (H / Hkv == 4 && D == 128);
  p.attn = kernels::plan_attention(1, H, Hkv, D, max_context, options.cluster_merge, false, qkv_in, p.attn_halved);
  if (p.short_keys > 0)
    p.attn_short =
        kernels::plan_attention(1, H, Hkv, D, p.short_keys, options.cluster_merge, false, qkv_in, p.attn_halved);
  p.head_dim = D;
  p.num_heads = H;
  p.num_kv_heads = Hkv;
  // Head dims the tensor-core kernel is not built for (256) keep every chunk on the decode kernel.
  p.prefill_attn_min_rows =
      kernels::attention_prefill_supported(D, H / Hkv) ? StepPlan::kPrefillAttnMinRows : StepPlan::kNever;
  p.prefill_attn_kernel = p.cc_major == 9 && kernels::attention_prefill_wgmma_takes(D)
                              ? kernels::PrefillAttnKernel::Wgmma
                              : kernels::PrefillAttnKernel::Mma;
  // Short prompt chunks deep in a context only where the kernel splits its keys.
  p.prefill_attn_deep_prior = p.prefill_attn_splits() ? StepPlan::kPrefillAttnDeepPrior : StepPlan::kNever;
  // The Hopper GEMM takes a chunk's products only when every one of them is a shape it runs.
  const kernels::Sm90Layer layer{d, f, s.q_dim(), s.qkv_dim()};
  const bool sm90_gemm = p.cc_major == 9 && kernels::gemm_w8a16_sm90_takes_layer(layer);
  p.sm90_gemm_min_rows = sm90_gemm ? StepPlan::kSm90GemmMinRows : StepPlan::kNever;
  p.prefill_chunk =
      std::min(sm90_gemm ? StepPlan::prefill_chunk_for(layer, p.sm_count) : StepPlan::kPrefillChunkSmall, max_context);
  p.w8a8_min_rows = sm90_gemm && options.prefill_fp8 ? StepPlan::kW8A8MinRows : StepPlan::kNever;
  const int M = StepPlan::kSkinnyMaxRows;
  const bool skinny = p.cc_major == 9 && options.skinny_gemm &&
                      kernels::gemm_w8a16_skinny_supported(kernels::Epilogue::Store, M, s.qkv_dim(), d) &&
                      kernels::gemm_w8a16_skinny_supported(kernels::Epilogue::AddResidual, M, d, s.q_dim()) &&
                      kernels::gemm_w8a16_skinny_supported(kernels::Epilogue::SwiGLU, M, 2 * f, d) &&
                      kernels::gemm_w8a16_skinny_supported(kernels::Epilogue::AddResidual, M, d, f);
  p.skinny_max_rows = skinny ? StepPlan::kSkinnyMaxRows : 0;
  p.skinny_norm = skinny && options.skinny_norm &&
                  std::find(std::begin(StepPlan::kSkinnyNormHidden), std::end(StepPlan::kSkinnyNormHidden), d) !=
                      std::end(StepPlan::kSkinnyNormHidden);
  p.skinny_rope = skinny && options.skinny_rope && !s.qk_norm &&
                  kernels::gemm_w8a16_skinny_rope_supported(s.qkv_dim(), s.num_heads, s.num_kv_heads, s.head_dim);
  return p;
}

}  // namespace atomflow

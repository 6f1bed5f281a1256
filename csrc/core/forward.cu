// The forward pass as launches on the engine's stream: the layer stack for `rows` tokens, the
// head on one row, the decode step (what the CUDA graph holds) and a prefill chunk.
// Nothing here synchronizes or allocates, so all of it can be captured. NVTX ranges (host-side)
// name the layers and kernel groups for Nsight Systems; mark() ends a launch group for the
// profiler (profiler.cu) and does nothing outside profile_decode.
#include <cmath>

#include "atomflow/engine.h"
#include "bf16_gemv.h"
#include "nvtx.h"
#include "step_kernels.h"

namespace atomflow {

namespace {

using kernels::Epilogue;

// Where a chunk's product runs (the step plan's thresholds) and the sm90 GEMM's workspace.
struct GemmRoute {
  int small_m;      // StepPlan::small_m_rows: up to these rows, the small-M GEMV
  int sm90_min;     // StepPlan::sm90_gemm_min_rows
  int w8a8_min;     // StepPlan::w8a8_min_rows: from these rows on, gemm_w8a8_sm90
  int skinny_max;   // StepPlan::skinny_max_rows: up to these rows, gemm_w8a16_skinny
  bool gemm_pdl;    // PlanOptions::gemm_pdl
  void* ws;         // the engine's gemm_ws
  size_t ws_bytes;  // its size
};

// One row streams the weights once through the decode GEMV (as `plan` says); up to small_m rows
// (StepPlan::small_m_rows) through the small-M GEMV, which also reads each weight byte once; more
// rows go to the tensor-core GEMM: up to skinny_max rows the one that streams the weights as the GEMV does
// (gemm_w8a16_skinny), from sm90_min rows on the Hopper one (gemm_w8a16_sm90).
// tickets: the engine's counters for SwiGLU GEMVs; f16_overflow: SwiGLU's fp16 output (kernels.h).
// scales_gn: the scales transposed for the sm90 GEMM at load (LayerPtrs), or null. norm_out / norm_in: a
// split RMSNorm's halves, on the skinny GEMM only (kernels.h).
void linear(const kernels::GemvPlan& plan, const GemmRoute& route, const uint8_t* w, const float* scales,
            const float* scales_gn, const void* x, kernels::Act xt, int rows, int N, int K, Epilogue ep, void* out,
            cudaStream_t stream, unsigned* tickets = nullptr, int* f16_overflow = nullptr,
            const kernels::SkinnyNormOut* norm_out = nullptr, const kernels::SkinnyNormIn* norm_in = nullptr) {
  const bool skinny = rows > route.small_m && rows <= route.skinny_max;
  AF_CHECK(skinny || (norm_out == nullptr && norm_in == nullptr), "linear: a split RMSNorm off the skinny GEMM");
  if (rows == 1) {
    kernels::gemv_w8a16(plan, w, scales, x, xt, N, K, ep, out, stream, tickets, f16_overflow);
  } else if (rows <= route.small_m) {
    const kernels::GemvIn in = xt == kernels::Act::F16 ? kernels::GemvIn::F16 : kernels::GemvIn::BF16;
    kernels::gemv_w8a16_m(kernels::plan_gemv_m(ep, in, rows, N, K), w, scales, x, xt, rows, N, K, ep, out, stream);
  } else if (rows <= route.skinny_max) {
    kernels::gemm_w8a16_skinny(kernels::plan_gemm_skinny(ep, xt, rows, N, K), w, scales, x, out, stream, norm_out,
                               norm_in);
  } else if (rows >= route.w8a8_min) {
    kernels::gemm_w8a8_sm90(w, scales, x, xt, rows, N, K, ep, out, route.ws, route.ws_bytes, stream);
  } else if (rows >= route.sm90_min) {
    kernels::gemm_w8a16_sm90(w, scales, x, xt, rows, N, K, ep, out, route.ws, route.ws_bytes, stream,
                             kernels::Sm90Tile::Auto, scales_gn, route.gemm_pdl);
  } else {
    kernels::gemm_w8a16(w, scales, x, xt, rows, N, K, ep, out, stream);
  }
}

// The route of this engine's chunks (its plan's thresholds, its workspace); step_rows: a chunk whose rows are
// decode steps (StepPlan::small_m_rows).
GemmRoute route_of(const StepPlan& plan, void* ws, size_t ws_bytes, bool step_rows) {
  return GemmRoute{plan.small_m_rows(step_rows),
                   plan.sm90_gemm_min_rows,
                   plan.w8a8_min_rows,
                   plan.skinny_max_rows,
                   plan.options.gemm_pdl,
                   ws,
                   ws_bytes};
}

}  // namespace

// rows tokens at positions *pos .. *pos + rows - 1, embedded in buf_.x, through every layer. The
// attention grid is planned for attn_keys keys: at least the keys of the last row (engine.h).
void Engine::enqueue_layers(int rows, int attn_keys, int prior) {
  const ModelSpec& s = spec_;
  const int d = s.hidden_size, f = s.intermediate_size;
  const int H = s.num_heads, Hkv = s.num_kv_heads, D = s.head_dim, C = opt_.max_context;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // Decode outside the probes runs the fused QKV GEMV where the plan says so (StepPlan::fused_qkv). Either
  // way its QKV product lets attention launch only after its own wait (the plan's qkv.late_trigger), so
  // attention may read the cache rows of earlier steps early (kernels.h).
  const bool fused_qkv = rows == 1 && !probe_ && step_plan_.fused_qkv;
  // The other decode steps outside the probes hand attention the product's raw row (attention_qkv).
  const bool qkv_in = rows == 1 && !probe_ && !step_plan_.fused_qkv;
  // A small-M chunk's QKV product does RoPE + KV append in its epilogue where the plan says so.
  const StepPlan& plan = step_plan_;
  const GemmRoute route = route_of(plan, buf_.gemm_ws, buf_.gemm_ws_bytes, step_rows_);
  // A chunk on the small-M GEMV (its rows decode steps', or a short prompt's: StepPlan::small_m_rows).
  const bool small_m = rows > 1 && rows <= route.small_m;
  const bool small_m_rope = small_m && !probe_ && plan.small_m_rope;
  // A chunk on the skinny GEMM: the same, with the RMSNorm apart (StepPlan::skinny_rope).
  const bool skinny = rows > route.small_m && rows <= route.skinny_max && !probe_;
  const bool skinny_rope = skinny && plan.skinny_rope;
  // Its RMSNorms but layer 0's first split between the products around them (StepPlan::skinny_norm): o and down
  // leave bf16(x * the next norm's weight) in buf_.xn and their row groups' sums of squares in buf_.norm_ss, and
  // the next product (qkv, gate_up) takes that x and scales its sums by each row's 1 / rms.
  const bool skinny_norm = skinny && plan.skinny_norm;
  // A decode step's attention and SwiGLU outputs are fp16 (kernels.h), flagged when they overflow;
  // the o and down GEMVs then take x as it is. A chunk whose rows run as decode steps (step_rows_): the same.
  const bool half = (rows == 1 || step_rows_) && f16_acts_;
  const kernels::Act act = half ? kernels::Act::F16 : kernels::Act::BF16;
  int* const overflow = half ? buf_.f16_overflow : nullptr;
  const kernels::GemvPlan& o_plan = half ? plan.o_f16 : plan.o_bf16;
  const kernels::GemvPlan& down_plan = half ? plan.down_f16 : plan.down_bf16;
  // A split RMSNorm's sums a row: its producer's row groups (kernels.h, SkinnyNormOut).
  const kernels::SkinnyNormIn after_norm{buf_.norm_ss, kernels::skinny_norm_parts(d), d, s.rms_norm_eps};
  bf16* const xw = reinterpret_cast<bf16*>(buf_.xn);  // a split RMSNorm's x: bf16(x * w), where xn was
  // A decode step's attention grid is the plan's for attn_keys; a prefill chunk's is planned for its
  // M and prior: on tensor cores from the plan's threshold of rows on (or deep in a context: a prompt's
  // chunk, not a verify's), else the decode kernel with the plan's options.
  const bool tc_attn = rows > 1 && plan.prefill_on_tensor_cores(rows, prior, step_rows_);
  kernels::AttnPlan attn_plan{};
  kernels::PrefillAttnPlan prefill_plan{};
  if (rows == 1)
    attn_plan = probe_ ? plan.probe_attention(attn_keys) : plan.decode_attention(attn_keys);
  else if (tc_attn)
    prefill_plan = plan.prefill_attention(rows, prior);
  else  // the small-M GEMV's chunks (the decode step's bits) run their rows as decode steps
    attn_plan = kernels::plan_attention(rows, H, Hkv, D, attn_keys, plan.options.cluster_merge,
                                        /*rows_as_steps=*/small_m, false, plan.attn_halved);
  for (size_t i = 0; i < buf_.layers.size(); ++i) {
    const LayerPtrs& L = buf_.layers[i];
    const int li = static_cast<int>(i);
    const bool attn_split = skinny_norm && i > 0;  // this layer's attn_norm split (layer 0's stays a launch)
    NvtxRange layer_range(layer_names_[i].c_str());
    const kernels::QkvExtras extras{L.bqkv, L.q_norm, L.k_norm, s.rms_norm_eps};  // the split QKV path's
    {
      NvtxRange r("attention_block");
      if (fused_qkv) {
        // RMSNorm -> QKV (+ bias) -> RoPE + KV append in one launch (bit-identical to the three kernels).
        const kernels::RopeKVArgs rope{buf_.inv_freq, buf_.pos, H, Hkv, D, C, buf_.q, L.k_cache, L.v_cache, L.bqkv};
        kernels::gemv_w8a16_rmsnorm_rope(plan.qkv, L.wqkv, L.wqkv_scale, buf_.x, L.attn_norm, s.rms_norm_eps, d, rope,
                                         stream_);
        mark("gemv_qkv+norm+rope", li);
      } else if (small_m_rope) {
        // The same three steps for a chunk of a few rows (bit-identical to rmsnorm, gemv_w8a16_m, rope_kv_append).
        const kernels::RopeKVArgs rope{buf_.inv_freq, buf_.pos, H, Hkv, D, C, buf_.q, L.k_cache, L.v_cache, L.bqkv};
        kernels::gemv_w8a16_m_rmsnorm_rope(
            kernels::plan_gemv_m(Epilogue::RopeKV, kernels::GemvIn::NORM, rows, s.qkv_dim(), d), L.wqkv, L.wqkv_scale,
            buf_.x, L.attn_norm, s.rms_norm_eps, rows, d, rope, stream_);
        mark("gemv_qkv+norm+rope", li);
      } else if (skinny_rope) {
        // RMSNorm, then the QKV product with RoPE + KV append (bit-identical to its Store and rope_kv_append).
        const kernels::RopeKVArgs rope{buf_.inv_freq, buf_.pos, H, Hkv, D, C, buf_.q, L.k_cache, L.v_cache, L.bqkv};
        // Split norm: xn already holds bf16(x * attn_norm) and norm_ss the sums, from the last down product.
        if (!attn_split) kernels::rmsnorm(buf_.x, L.attn_norm, rows, d, s.rms_norm_eps, buf_.xn, stream_);
        kernels::gemm_w8a16_skinny_rope(
            kernels::plan_gemm_skinny(Epilogue::RopeKV, attn_split ? kernels::Act::BF16 : kernels::Act::F16, rows,
                                      s.qkv_dim(), d),
            L.wqkv, L.wqkv_scale, buf_.xn, rope, stream_, attn_split ? &after_norm : nullptr);
        mark("gemm_qkv+rope", li);
      } else {
        // Prefill chunks, probed steps, and the decode steps of a split-QKV plan (plan.qkv: Store, NORM;
        // a fused plan never reaches here with one unprobed row).
        normed_linear(L.attn_norm, "attn_norm", li, plan.qkv, plan.probe_qkv, L.wqkv, L.wqkv_scale, L.wqkv_scale_gn,
                      rows, s.qkv_dim(), Epilogue::Store, buf_.qkv, nullptr, attn_split ? &after_norm : nullptr);
        mark("gemv_qkv+norm", li);
        if (!qkv_in) {
          kernels::rope_kv_append(buf_.qkv, buf_.inv_freq, buf_.pos, rows, H, Hkv, D, C, buf_.q, L.k_cache, L.v_cache,
                                  stream_, extras);
          mark("rope_kv_append", li);
        }
      }
      // The split count of a query row is min(64, ceil(keys / 32)) on any grid that holds its keys, so
      // the bits do not depend on attn_keys (attention_decode.cu).
      if (tc_attn)
        kernels::attention_prefill(prefill_plan, buf_.q, L.k_cache, L.v_cache, buf_.pos, rows, H, Hkv, D, C, scale,
                                   static_cast<bf16*>(buf_.attn_out), stream_, buf_.attn_prefill_scratch);
      else if (qkv_in)
        kernels::attention_qkv(attn_plan, kernels::AttnQkvIn{buf_.qkv, buf_.inv_freq, extras}, L.k_cache, L.v_cache,
                               buf_.pos, H, Hkv, D, attn_keys, scale, buf_.attn_scratch, buf_.attn_out, stream_,
                               /*early=*/true, overflow);
      else
        kernels::attention(attn_plan, buf_.q, L.k_cache, L.v_cache, buf_.pos, rows, H, Hkv, D, attn_keys, scale,
                           buf_.attn_scratch, buf_.attn_out, stream_, /*early=*/fused_qkv, overflow);
      mark("attention", li);
      if (probe_) probe_snapshot(rows);
      const kernels::SkinnyNormOut o_norm{L.mlp_norm, xw, buf_.norm_ss};  // the mlp_norm's half
      linear(o_plan, route, L.wo, L.wo_scale, L.wo_scale_gn, buf_.attn_out, act, rows, d, s.q_dim(),
             Epilogue::AddResidual, buf_.x, stream_, nullptr, nullptr, skinny_norm ? &o_norm : nullptr);
      mark("gemv_o", li);
    }
    if (probe_) {
      probe_point("attn_out", li, ProbeSrc::X_DELTA, rows);
      probe_point("resid_mid", li, ProbeSrc::X, rows);
    }
    {
      NvtxRange r("mlp_block");
      normed_linear(L.mlp_norm, nullptr, li, plan.gate_up, plan.probe_gate_up, L.w13, L.w13_scale, L.w13_scale_gn, rows,
                    2 * f, Epilogue::SwiGLU, buf_.ffn, overflow, skinny_norm ? &after_norm : nullptr);
      mark("gemv_gate_up+norm", li);
      if (probe_) probe_snapshot(rows);
      // The next layer's attn_norm's half (the last layer's final norm is the head GEMV's).
      const bool next = skinny_norm && i + 1 < buf_.layers.size();
      const kernels::SkinnyNormOut down_norm{next ? buf_.layers[i + 1].attn_norm : nullptr, xw, buf_.norm_ss};
      linear(down_plan, route, L.w2, L.w2_scale, L.w2_scale_gn, buf_.ffn, act, rows, d, f, Epilogue::AddResidual,
             buf_.x, stream_, nullptr, nullptr, next ? &down_norm : nullptr);
      mark("gemv_down", li);
    }
    if (probe_) {
      probe_point("mlp_out", li, ProbeSrc::X_DELTA, rows);
      probe_point("layer_out", li, ProbeSrc::X, rows);
    }
  }
}

// RMSNorm of the residual stream, then a linear layer. At M = 1 the norm is fused into the GEMV's
// prologue (bit-identical to the two kernels, as the plan `fused` says), and so it is on the small-M
// GEMV (2..StepPlan::small_m_rows rows: gemv_w8a16_m_rmsnorm, bit-identical to rmsnorm + gemv_w8a16_m); probe
// mode keeps them apart to see the norm (the GEMV as the plan `probed` says).
void Engine::normed_linear(const bf16* norm, const char* probe_name, int layer, const kernels::GemvPlan& fused,
                           const kernels::GemvPlan& probed, const uint8_t* w, const float* scales,
                           const float* scales_gn, int rows, int N, Epilogue ep, void* out, int* f16_overflow,
                           const kernels::SkinnyNormIn* norm_in) {
  const int d = spec_.hidden_size;
  if (rows == 1 && !probe_) {
    kernels::gemv_w8a16_rmsnorm(fused, w, scales, buf_.x, norm, spec_.rms_norm_eps, N, d, ep, out, stream_,
                                buf_.gemv_tickets, f16_overflow);
    return;
  }
  const GemmRoute route = route_of(step_plan_, buf_.gemm_ws, buf_.gemm_ws_bytes, step_rows_);
  if (rows <= route.small_m && !probe_) {
    kernels::gemv_w8a16_m_rmsnorm(kernels::plan_gemv_m(ep, kernels::GemvIn::NORM, rows, N, d), w, scales, buf_.x, norm,
                                  spec_.rms_norm_eps, rows, N, d, ep, out, stream_, f16_overflow);
    return;
  }
  // With norm_in (a skinny chunk's split norm) buf_.xn already holds bf16(x * norm) and the product normalizes.
  if (norm_in == nullptr) {
    kernels::rmsnorm(buf_.x, norm, rows, d, spec_.rms_norm_eps, buf_.xn, stream_);
    if (probe_ && probe_name) probe_point(probe_name, layer, ProbeSrc::XN, rows);
  }
  linear(probed, route, w, scales, scales_gn, buf_.xn, norm_in ? kernels::Act::BF16 : kernels::Act::F16, rows, N, d, ep,
         out, stream_, buf_.gemv_tickets, f16_overflow, nullptr, norm_in);
}

// Final norm and lm_head on one row of the residual stream -> buf_.logits fp32 [vocab].
void Engine::enqueue_head(int row) {
  NvtxRange range("lm_head");
  ++logits_writes_;  // buf_.logits is this head's (prompt_logits)
  const int d = spec_.hidden_size, vocab = spec_.vocab_size;
  const float* xrow = buf_.x + static_cast<size_t>(row) * d;
  if (spec_.lm_head_fp8 && !probe_) {
    // Each block also leaves the argmax of its rows for a greedy sampler (sample_step).
    kernels::gemv_w8a16_rmsnorm_argmax(step_plan_.head, static_cast<const uint8_t*>(buf_.lm_head), buf_.lm_head_scale,
                                       xrow, buf_.final_norm, spec_.rms_norm_eps, vocab, d, buf_.logits, buf_.head_best,
                                       stream_);
    return;
  }
  kernels::rmsnorm(xrow, buf_.final_norm, 1, d, spec_.rms_norm_eps, buf_.xn, stream_);
  if (probe_) probe_point("final_norm", -1, ProbeSrc::XN, 1);
  if (spec_.lm_head_fp8)
    kernels::gemv_w8a16(step_plan_.probe_head, static_cast<const uint8_t*>(buf_.lm_head), buf_.lm_head_scale, buf_.xn,
                        kernels::Act::F16, vocab, d, Epilogue::Store, buf_.logits, stream_);
  else
    bf16_gemv(static_cast<const bf16*>(buf_.lm_head), buf_.xn, vocab, d, buf_.logits, stream_);
  if (probe_) probe_point("logits", -1, ProbeSrc::LOGITS, 1);
}

// The head on x rows first .. first + n - 1 (n <= kLogitRows) -> buf_.logits fp32 [n, vocab], each row
// the bits enqueue_head gives it: an FP8 head in one small-M launch (RMSNorm fused, the decode head's
// products per row), a bf16 head row by row (each row's logits moved down from row 0, last row first).
void Engine::enqueue_head_rows(int first, int n) {
  NvtxRange range("lm_head rows");
  ++logits_writes_;
  const int d = spec_.hidden_size, vocab = spec_.vocab_size;
  if (spec_.lm_head_fp8 && !probe_) {
    const kernels::GemvMPlan plan = kernels::plan_gemv_m(Epilogue::Store, kernels::GemvIn::NORM, n, vocab, d);
    kernels::gemv_w8a16_m_rmsnorm(plan, static_cast<const uint8_t*>(buf_.lm_head), buf_.lm_head_scale,
                                  buf_.x + static_cast<size_t>(first) * d, buf_.final_norm, spec_.rms_norm_eps, n,
                                  vocab, d, Epilogue::Store, buf_.logits, stream_);
    return;
  }
  for (int r = n - 1; r >= 0; --r) {
    enqueue_head(first + r);
    if (r > 0)
      AF_CUDA_CHECK(cudaMemcpyAsync(buf_.logits + static_cast<size_t>(r) * vocab, buf_.logits, sizeof(float) * vocab,
                                    cudaMemcpyDeviceToDevice, stream_));
  }
}

// One token: *token at position *pos in, logits and the sampled token (in *token and the ring)
// out, *pos advanced. Reads all its inputs from device memory, so one graph serves every step whose
// keys fit attn_keys (launch_step: max_context, or the plan's short_keys for a short step). With the fused tail
// (engine.h) the input's embedding is already in x (set_token, or the step before), and the sampler
// writes the next one there once the head has read x.
void Engine::enqueue_decode_step(int attn_keys) {
  const int d = spec_.hidden_size, vocab = spec_.vocab_size;
  if (!step_plan_.options.fused_tail) {
    kernels::embedding(buf_.embed, buf_.token, 1, d, vocab, buf_.x, stream_);
    mark("embedding", -1);
  }
  enqueue_layers(1, attn_keys);
  enqueue_head(0);
  mark("lm_head", -1);  // the final RMSNorm is fused into it (or its own launch with a bf16 head)
  enqueue_sample();
}

// The end of a decode step, on the logits enqueue_head left in row 0: the token sampled into *token
// and ring slot *pos % kRingSize, *pos advanced. The embedding has read *token, so the sample may
// overwrite it with the next input; its RNG counter is the position after this token (sample_pos), as
// on the CPU.
void Engine::enqueue_sample() {
  const int d = spec_.hidden_size, vocab = spec_.vocab_size;
  NvtxRange range("sample");
  if (step_plan_.options.fused_tail) {
    const bool best = spec_.lm_head_fp8 && !probe_;  // enqueue_head left the per-block maxima
    kernels::sample_step(
        buf_.logits, vocab, best ? buf_.head_best : nullptr, best ? buf_.head_best_n : 0, buf_.sampling, buf_.token,
        kernels::StepEnd{buf_.pos, ring_dev_, kRingSize, buf_.f16_overflow, buf_.embed, d, buf_.x}, stream_);
    mark("sample", -1);  // with the ring, the position and the next embedding
    return;
  }
  kernels::sample(buf_.logits, vocab, buf_.sampling, buf_.sample_pos, buf_.sample_scratch, buf_.token, stream_);
  mark("sample", -1);
  step::finish_step(buf_.token, buf_.pos, ring_dev_, kRingSize, buf_.f16_overflow, stream_);
  mark("finish", -1);
}

// ids[offset .. offset + rows) (already on the device) at *pos .., then *pos += rows unless the caller
// sets the position itself (begin_prompt).
void Engine::enqueue_prefill_chunk(int offset, int rows, bool advance) {
  NvtxRange range("prefill_chunk");
  kernels::embedding(buf_.embed, buf_.ids + offset, rows, spec_.hidden_size, spec_.vocab_size, buf_.x, stream_);
  enqueue_layers(rows, opt_.max_context, host_pos_ + offset);  // the chunk's first position
  if (advance) step::advance_pos(buf_.pos, rows, stream_);
}

}  // namespace atomflow

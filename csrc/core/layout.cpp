// Tensor table -> roles (with every check the loader relies on), and the arena plan.
#include "layout.h"

#include <algorithm>
#include <stdexcept>

#include "atomflow/kernels.h"
#include "atomflow/step_plan.h"

namespace atomflow {

namespace {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t dtype_bytes(const std::string& dtype) {
  if (dtype == "F8_E4M3") return 1;
  if (dtype == "BF16") return 2;
  if (dtype == "F32") return 4;
  return 0;
}

class TableIndex {
 public:
  TableIndex(const std::vector<TensorInfo>& table, uint64_t file_size) : file_size_(file_size) {
    for (const TensorInfo& t : table) by_name_.emplace(t.name, &t);
  }
  bool has(const std::string& name) const { return by_name_.count(name) != 0; }

  const TensorInfo* need(const std::string& name, const char* dtype, std::vector<int64_t> shape) const {
    auto it = by_name_.find(name);
    if (it == by_name_.end())
      throw std::invalid_argument("model file has no tensor '" + name + "' (expected " + dtype + " " +
                                  shape_str(shape) + ")");
    const TensorInfo& t = *it->second;
    if (t.dtype != dtype || t.shape != shape)
      throw std::invalid_argument("tensor '" + name + "' is " + t.dtype + " " + shape_str(t.shape) + ", expected " +
                                  dtype + " " + shape_str(shape));
    int64_t n = dtype_bytes(t.dtype);
    for (int64_t s : t.shape) n *= s;
    if (static_cast<uint64_t>(n) != t.nbytes)
      throw std::invalid_argument("tensor '" + name + "': nbytes " + std::to_string(t.nbytes) + " does not match " +
                                  t.dtype + " " + shape_str(t.shape) + " (" + std::to_string(n) + " bytes)");
    if (t.offset > file_size_ || t.nbytes > file_size_ - t.offset)
      throw std::invalid_argument("tensor '" + name + "' (bytes " + std::to_string(t.offset) + ".." +
                                  std::to_string(t.offset + t.nbytes) + ") lies past the end of the " +
                                  std::to_string(file_size_) + "-byte file: truncated?");
    return &t;
  }

 private:
  uint64_t file_size_;
  std::unordered_map<std::string, const TensorInfo*> by_name_;
};

}  // namespace

ModelTensors resolve_tensors(const ModelSpec& s, const std::vector<TensorInfo>& table, uint64_t file_size) {
  const TableIndex idx(table, file_size);
  const int64_t d = s.hidden_size, f = s.intermediate_size, g = kQuantGroup;
  ModelTensors m;
  m.embed = idx.need("embed", "BF16", {s.vocab_size, d});
  for (int i = 0; i < s.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    LayerTensors L;
    L.attn_norm = idx.need(p + "attn_norm", "BF16", {d});
    L.wqkv = idx.need(p + "wqkv", "F8_E4M3", {s.qkv_dim(), d});
    L.wqkv_scale = idx.need(p + "wqkv.scale", "F32", {s.qkv_dim(), CEIL_DIV(d, g)});
    L.wo = idx.need(p + "wo", "F8_E4M3", {d, s.q_dim()});
    L.wo_scale = idx.need(p + "wo.scale", "F32", {d, CEIL_DIV(s.q_dim(), g)});
    L.mlp_norm = idx.need(p + "mlp_norm", "BF16", {d});
    L.w13 = idx.need(p + "w13", "F8_E4M3", {2 * f, d});
    L.w13_scale = idx.need(p + "w13.scale", "F32", {2 * f, CEIL_DIV(d, g)});
    L.w2 = idx.need(p + "w2", "F8_E4M3", {d, f});
    L.w2_scale = idx.need(p + "w2.scale", "F32", {d, CEIL_DIV(f, g)});
    // The spec's extras and their tensors come together: a missing one would leave the engine without
    // a weight, an unexpected one would be silently left out of the math.
    const auto extra = [&](bool wanted, const char* flag, const std::string& name, const char* dtype, int64_t n) {
      if (wanted) {
        if (!idx.has(name))
          throw std::invalid_argument(std::string("model file has no tensor '") + name + "' (expected " + dtype + " [" +
                                      std::to_string(n) + "]), which the spec's " + flag + " needs");
        return idx.need(name, dtype, {n});
      }
      if (idx.has(name))
        throw std::invalid_argument("model file has a tensor '" + name + "' but the spec's " + flag +
                                    " is false: the file does not match its spec");
      return static_cast<const TensorInfo*>(nullptr);
    };
    L.bqkv = extra(s.attention_bias, "attention_bias", p + "bqkv", "F32", s.qkv_dim());
    L.q_norm = extra(s.qk_norm, "qk_norm", p + "q_norm", "BF16", s.head_dim);
    L.k_norm = extra(s.qk_norm, "qk_norm", p + "k_norm", "BF16", s.head_dim);
    m.layers.push_back(L);
  }
  m.final_norm = idx.need("final_norm", "BF16", {d});
  m.lm_head_fp8 = s.lm_head_fp8;
  if (s.lm_head_fp8) {
    m.lm_head = idx.need("lm_head", "F8_E4M3", {s.vocab_size, d});
    m.lm_head_scale = idx.need("lm_head.scale", "F32", {s.vocab_size, CEIL_DIV(d, g)});
  } else if (idx.has("lm_head")) {
    m.lm_head = idx.need("lm_head", "BF16", {s.vocab_size, d});
  } else if (s.tie_word_embeddings) {
    m.lm_head = m.embed;  // tied and kept in bf16: the embedding table is the head
  } else {
    throw std::invalid_argument("model file has no tensor 'lm_head' and the model does not tie its embeddings");
  }
  return m;
}

Layout plan_layout(const ModelSpec& s, const ModelTensors& t, int max_context, int prefill_chunk, int head_blocks,
                   bool prefill_scales, size_t prefill_attn_scratch) {
  Layout L;
  ArenaPlan& plan = L.plan;

  // Weights in file order, so the loader writes the arena front to back as it reads the file.
  std::vector<const TensorInfo*> weights = {t.embed, t.final_norm, t.lm_head};
  if (t.lm_head_scale) weights.push_back(t.lm_head_scale);
  for (const LayerTensors& l : t.layers) {
    weights.insert(weights.end(), {l.attn_norm, l.wqkv, l.wqkv_scale, l.wo, l.wo_scale, l.mlp_norm, l.w13, l.w13_scale,
                                   l.w2, l.w2_scale});
    for (const TensorInfo* extra : {l.bqkv, l.q_norm, l.k_norm})
      if (extra) weights.push_back(extra);
  }
  std::sort(weights.begin(), weights.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  weights.erase(std::unique(weights.begin(), weights.end()), weights.end());  // tied head == embed
  for (const TensorInfo* w : weights) L.weight_slot[w] = plan.reserve("weights", w->nbytes);
  L.inv_freq = plan.reserve("weights", sizeof(float) * s.head_dim / 2);
  // The sm90 prefill GEMM's transposed scales, the same size as the scales they are made from at load:
  // in the weights' group, before anything else (the engine zeroes everything after the weights).
  std::vector<size_t> transposed;
  if (prefill_scales)
    for (const LayerTensors& l : t.layers)
      for (const TensorInfo* scale : {l.wqkv_scale, l.wo_scale, l.w13_scale, l.w2_scale})
        transposed.push_back(plan.reserve("weights", scale->nbytes));

  L.embed = L.weight_slot.at(t.embed);
  L.final_norm = L.weight_slot.at(t.final_norm);
  L.lm_head = L.weight_slot.at(t.lm_head);
  L.lm_head_scale = t.lm_head_scale ? L.weight_slot.at(t.lm_head_scale) : 0;

  const size_t kv_bytes = size_t(max_context) * s.kv_dim() * sizeof(bf16);
  for (const LayerTensors& l : t.layers) {
    LayerSlots ls;
    const size_t li = L.layers.size();
    ls.attn_norm = L.weight_slot.at(l.attn_norm);
    ls.wqkv = L.weight_slot.at(l.wqkv);
    ls.wqkv_scale = L.weight_slot.at(l.wqkv_scale);
    ls.wo = L.weight_slot.at(l.wo);
    ls.wo_scale = L.weight_slot.at(l.wo_scale);
    ls.mlp_norm = L.weight_slot.at(l.mlp_norm);
    ls.w13 = L.weight_slot.at(l.w13);
    ls.w13_scale = L.weight_slot.at(l.w13_scale);
    ls.w2 = L.weight_slot.at(l.w2);
    ls.w2_scale = L.weight_slot.at(l.w2_scale);
    ls.bqkv = l.bqkv ? L.weight_slot.at(l.bqkv) : kNoSlot;
    ls.wqkv_scale_gn = prefill_scales ? transposed[4 * li] : kNoSlot;
    ls.wo_scale_gn = prefill_scales ? transposed[4 * li + 1] : kNoSlot;
    ls.w13_scale_gn = prefill_scales ? transposed[4 * li + 2] : kNoSlot;
    ls.w2_scale_gn = prefill_scales ? transposed[4 * li + 3] : kNoSlot;
    ls.q_norm = l.q_norm ? L.weight_slot.at(l.q_norm) : kNoSlot;
    ls.k_norm = l.k_norm ? L.weight_slot.at(l.k_norm) : kNoSlot;
    ls.k_cache = plan.reserve("kv", kv_bytes);
    ls.v_cache = plan.reserve("kv", kv_bytes);
    L.layers.push_back(ls);
  }

  const size_t rows = static_cast<size_t>(prefill_chunk);
  L.x = plan.reserve("activations", rows * s.hidden_size * sizeof(float));
  L.xn = plan.reserve("activations", rows * s.hidden_size * sizeof(f16));
  L.qkv = plan.reserve("activations", rows * s.qkv_dim() * sizeof(float));
  L.q = plan.reserve("activations", rows * s.q_dim() * sizeof(bf16));
  L.attn_out = plan.reserve("activations", rows * s.q_dim() * sizeof(bf16));  // or f16: the same size
  L.ffn = plan.reserve("activations", rows * s.intermediate_size * sizeof(bf16));
  L.logits = plan.reserve("activations", size_t(StepPlan::kLogitRows) * s.vocab_size * sizeof(float));
  L.ids = plan.reserve("activations", size_t(max_context) * sizeof(int32_t));

  // Chunks run with any row count from 1 to prefill_chunk: size for the largest need.
  size_t attn_scratch = 0;
  for (int m = 1; m <= prefill_chunk; ++m)
    attn_scratch = std::max(attn_scratch, kernels::attention_scratch_bytes(m, s.num_heads, s.head_dim, max_context));
  L.attn_scratch = plan.reserve("scratch", attn_scratch);
  L.attn_prefill_scratch = prefill_attn_scratch > 0 ? plan.reserve("scratch", prefill_attn_scratch) : kNoSlot;
  L.sample_scratch = plan.reserve("scratch", kernels::sampling_scratch_bytes(s.vocab_size));
  L.gemv_tickets = plan.reserve("scratch", kernels::kGemvTicketBytes);
  // The skinny GEMM's sums of squares for a chunk's split RMSNorm (kernels.h, SkinnyNormOut): a row's slot per
  // row group of a product of N = hidden_size.
  L.norm_ss =
      plan.reserve("scratch", sizeof(float) * kernels::kSkinnyMaxRows * kernels::skinny_norm_parts(s.hidden_size));
  // The sm90 GEMM's workspace: the products' transposed scales, and SwiGLU's fp32 y [chunk, 2 ffn].
  L.gemm_ws_bytes = 0;
  if (kernels::gemm_w8a16_sm90_built())
    L.gemm_ws_bytes = kernels::gemm_w8a16_sm90_layer_workspace_bytes(
        kernels::Sm90Layer{s.hidden_size, s.intermediate_size, s.q_dim(), s.qkv_dim()}, 1, prefill_chunk);
  L.gemm_ws = plan.reserve("scratch", std::max<size_t>(L.gemm_ws_bytes, 256));
  L.head_best_n = s.lm_head_fp8 ? head_blocks : 0;
  L.head_best = plan.reserve("scratch", std::max(L.head_best_n, 1) * sizeof(uint64_t));
  L.pos = plan.reserve("scratch", 2 * sizeof(int32_t));
  L.token = plan.reserve("scratch", sizeof(int32_t));
  L.f16_overflow = plan.reserve("scratch", sizeof(int32_t));
  L.sampling = plan.reserve("scratch", sizeof(kernels::SamplingConfig));
  return L;
}

}  // namespace atomflow

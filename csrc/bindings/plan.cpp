// The step plan for Python: plan_to_dict (Engine.step_plan, _core.plan_for) and _core.plan_for,
// which plans a model's step on this GPU without loading it (`atomflow info MODEL --plan`).
#include "plan.h"

#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "atomflow/spec.h"
#include "atomflow/step_plan.h"

namespace py = pybind11;

namespace atomflow::bindings {

ModelSpec spec_from_dict(const py::dict& d);  // core.cpp

namespace {

py::dict gemv_row(const char* product, const char* when, const kernels::GemvPlan& g) {
  py::dict r;
  r["product"] = product;
  r["when"] = when;
  r["kernel"] = kernels::gemv_variant_name(g);
  r["N"] = g.N;
  r["K"] = g.K;
  r["blocks"] = g.blocks;
  r["warps"] = g.threads / 32;
  r["pre_warps"] = g.pre_warps;
  r["staged_warps"] = g.staged_warps;
  r["tickets"] = g.ticketed;
  r["smem"] = g.smem;
  return r;
}

py::dict attention_row(const char* when, const kernels::AttnPlan& a) {
  py::dict r;
  r["product"] = "attention";
  r["when"] = when;
  r["kernel"] = kernels::attention_instance_name(a);  // the instance: heads per block, not H / Hkv
  r["keys"] = a.capacity;
  r["splits"] = a.splits;
  r["cluster"] = a.cluster;
  r["merge"] = kernels::attention_merge_name(a);
  r["halved"] = a.halved;  // ratios 4, 6, 8 on two blocks per kv head (AttnPlan::halved)
  r["blocks"] = a.Hkv * kernels::attention_blocks_per_kv_head(a) * ((a.splits + a.cluster - 1) / a.cluster) * a.cluster;
  r["warps"] = 4;
  return r;
}

}  // namespace

py::dict plan_to_dict(const StepPlan& p) {
  py::dict d;
  py::dict dev;
  dev["name"] = p.device;
  dev["sm_count"] = p.sm_count;
  dev["capability"] = py::make_tuple(p.cc_major, p.cc_minor);
  d["device"] = dev;
  const PlanOptions& o = p.options;
  py::dict opt;
  opt["eager"] = o.eager;
  opt["f16_activations"] = o.f16_activations;
  opt["fused_tail"] = o.fused_tail;
  opt["short_steps"] = o.short_steps;
  opt["cluster_merge"] = o.cluster_merge;
  opt["staged_pair"] = o.staged_pair;
  opt["tickets"] = o.tickets;
  opt["prefill_fp8"] = o.prefill_fp8;
  opt["gemm_pdl"] = o.gemm_pdl;
  opt["skinny_gemm"] = o.skinny_gemm;
  opt["skinny_rope"] = o.skinny_rope;
  opt["skinny_norm"] = o.skinny_norm;
  opt["pdl"] = p.pdl;
  d["options"] = opt;
  d["max_context"] = p.max_context;
  d["activations"] = o.f16_activations ? "f16" : "bf16";
  py::list graphs;
  if (!o.eager) {
    graphs.append(py::dict(py::arg("keys") = p.max_context, py::arg("steps") = "the rest"));
    if (p.short_keys > 0)
      graphs.append(
          py::dict(py::arg("keys") = p.short_keys, py::arg("steps") = "positions < " + std::to_string(p.short_keys)));
  }
  d["graphs"] = graphs;  // empty: eager
  d["tail"] = o.fused_tail ? "fused (sample_step)" : "embedding, sample, finish";
  d["qkv_path"] = p.fused_qkv ? "fused" : "attention";  // StepPlan::fused_qkv
  py::list products;
  products.append(gemv_row("qkv", "decode", p.qkv));
  products.append(gemv_row("o", "decode, f16 activations", p.o_f16));
  products.append(gemv_row("o", "decode, bf16 activations", p.o_bf16));
  products.append(gemv_row("gate_up", "decode", p.gate_up));
  products.append(gemv_row("down", "decode, f16 activations", p.down_f16));
  products.append(gemv_row("down", "decode, bf16 activations", p.down_bf16));
  if (p.fp8_head) products.append(gemv_row("lm_head", "decode", p.head));
  products.append(gemv_row("qkv", "probed decode", p.probe_qkv));
  products.append(gemv_row("gate_up", "probed decode", p.probe_gate_up));
  if (p.fp8_head) products.append(gemv_row("lm_head", "probed decode", p.probe_head));
  d["products"] = products;
  py::list attn;
  attn.append(attention_row("decode", p.attn));
  if (p.short_keys > 0) attn.append(attention_row("decode, short steps", p.attn_short));
  d["attention"] = attn;
  // Prefill chunks of at least min_rows rows: attention on tensor cores, one block per tile of packed
  // (query, head) rows per kv head (the kernel's tile); shown for a chunk of min_rows rows, of 256 and of
  // the model's default chunk (StepPlan::prefill_chunk).
  py::dict pre;
  const bool tc = p.prefill_attn_min_rows < StepPlan::kNever;
  pre["min_rows"] = tc ? py::object(py::int_(p.prefill_attn_min_rows)) : py::object(py::none());
  // and prompt chunks of 2 rows or more after deep_prior cached keys (None: never)
  pre["deep_prior"] = p.prefill_attn_deep_prior < StepPlan::kNever ? py::object(py::int_(p.prefill_attn_deep_prior))
                                                                   : py::object(py::none());
  py::list chunks;
  for (int rows : tc ? std::vector<int>{p.prefill_attn_min_rows, 256, p.prefill_chunk} : std::vector<int>{}) {
    const kernels::PrefillAttnPlan a = p.prefill_attention(rows);
    chunks.append(py::dict(py::arg("rows") = rows, py::arg("kernel") = kernels::attention_prefill_name(a),
                           py::arg("blocks") = a.tiles * a.Hkv, py::arg("warps") = a.threads / 32,
                           py::arg("smem") = a.smem));
  }
  pre["chunks"] = chunks;
  d["prefill_chunk"] = p.prefill_chunk;  // rows per prefill pass by default
  d["prefill_attention"] = pre;
  d["prefill_small_m_max_rows"] = p.small_m_max_rows;  // chunks of 2..this many rows: gemv_w8a16_m
  d["prefill_small_m_rope"] = p.small_m_rope;          // ... their QKV product with RoPE + KV append fused
  // prompt chunks of skinny_min..skinny_max rows: gemm_w8a16_skinny (None: never); verify chunks and
  // prefill_rows' rows take it only past prefill_small_m_max_rows (StepPlan::small_m_rows)
  d["prefill_skinny_min_rows"] =
      p.skinny_max_rows > 0 ? py::object(py::int_(p.small_m_rows(false) + 1)) : py::object(py::none());
  d["prefill_skinny_max_rows"] =
      p.skinny_max_rows > 0 ? py::object(py::int_(p.skinny_max_rows)) : py::object(py::none());
  d["prefill_skinny_rope"] = p.skinny_rope;  // ... their QKV product with RoPE + KV append fused
  d["prefill_skinny_norm"] = p.skinny_norm;  // ... their RMSNorms split between the products around them
  // chunks of at least this many rows: gemm_w8a16_sm90 (None: never)
  d["prefill_sm90_gemm_min_rows"] =
      p.sm90_gemm_min_rows < StepPlan::kNever ? py::object(py::int_(p.sm90_gemm_min_rows)) : py::object(py::none());
  // chunks of at least this many rows: gemm_w8a8_sm90, the FP8 recipe (None: never; PlanOptions::prefill_fp8)
  d["prefill_w8a8_min_rows"] =
      p.w8a8_min_rows < StepPlan::kNever ? py::object(py::int_(p.w8a8_min_rows)) : py::object(py::none());
  // its tile kind by chunk rows (kernels::sm90_tile_for): [(up to rows, kind)], the last for any more (there
  // the product's width decides between two kinds by their waves of tiles over the SMs)
  py::list tiles;
  for (int rows : {kernels::kSm90NarrowMaxRows, kernels::kSm90StreamKMaxRows})
    tiles.append(py::make_tuple(rows, kernels::sm90_tile_name(kernels::sm90_tile_for(rows, 1, 1))));
  tiles.append(py::make_tuple(py::none(), std::string(kernels::sm90_tile_name(kernels::Sm90Tile::XWide)) + " or " +
                                              kernels::sm90_tile_name(kernels::Sm90Tile::Wide) + " by tile waves"));
  d["prefill_sm90_tiles"] = tiles;
  return d;
}

void register_plan(py::module_& m) {
  m.def(
      "plan_for",
      [](const py::dict& spec, int max_context, bool eager, bool f16_activations, bool fused_tail, bool short_steps,
         bool cluster_merge, bool staged_pair, bool tickets, bool prefill_fp8, bool gemm_pdl, bool skinny_gemm,
         bool skinny_rope, bool skinny_norm) {
        const ModelSpec s = spec_from_dict(spec);
        AF_CHECK(s.hidden_size > 0 && s.intermediate_size > 0 && s.num_heads > 0 && s.num_kv_heads > 0 &&
                     s.num_heads % s.num_kv_heads == 0 && s.vocab_size > 0,
                 "plan_for: a model spec with positive sizes, num_heads a multiple of num_kv_heads");
        const PlanOptions o{eager,   f16_activations, fused_tail, short_steps, cluster_merge, staged_pair,
                            tickets, prefill_fp8,     gemm_pdl,   skinny_gemm, skinny_rope,   skinny_norm};
        return plan_to_dict(make_step_plan(s, max_context, o));
      },
      py::arg("spec"), py::arg("max_context"), py::arg("eager") = false, py::arg("f16_activations") = true,
      py::arg("fused_tail") = true, py::arg("short_steps") = true, py::arg("cluster_merge") = true,
      py::arg("staged_pair") = true, py::arg("tickets") = true, py::arg("prefill_fp8") = false,
      py::arg("gemm_pdl") = true, py::arg("skinny_gemm") = true, py::arg("skinny_rope") = true,
      py::arg("skinny_norm") = true,
      "the step plan an Engine of this spec and options would make on the current GPU, without loading weights");
  m.def(
      "prefill_chunk_for",
      [](int hidden_size, int intermediate_size, int num_heads, int num_kv_heads, int head_dim, int sm_count) {
        AF_CHECK(hidden_size >= 1 && intermediate_size >= 1 && num_heads >= 1 && num_kv_heads >= 1 && head_dim >= 1 &&
                     sm_count >= 1,
                 "prefill_chunk_for: every size and sm_count must be >= 1");
        ModelSpec s;
        s.num_heads = num_heads;
        s.num_kv_heads = num_kv_heads;
        s.head_dim = head_dim;
        return StepPlan::prefill_chunk_for(kernels::Sm90Layer{hidden_size, intermediate_size, s.q_dim(), s.qkv_dim()},
                                           sm_count);
      },
      py::arg("hidden_size"), py::arg("intermediate_size"), py::arg("num_heads"), py::arg("num_kv_heads"),
      py::arg("head_dim"), py::arg("sm_count"),
      "the default rows per prefill pass of a model of these sizes on a Hopper GPU of sm_count SMs whose sm90 GEMM "
      "takes its layers (StepPlan::prefill_chunk_for), before max_context's bound; no GPU needed");
}

}  // namespace atomflow::bindings

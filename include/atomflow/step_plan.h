// The step plan: every launch decision of the engine, made once at load from the options, the
// device and the model's shape, and printed by `atomflow info MODEL --plan`. The forward pass
// (csrc/core/forward.cu) hands each launcher its part; no launcher reads the environment or decides
// a grid of its own. The decisions keyed by shape are the kernels' constexpr tables
// (gemv_w8a16_plan.cpp, attention_decode.cu's max_splits / cluster_splits, the prefill attention's
// row threshold below); this struct holds
// their answers for the shapes one model's decode step has.
#pragma once
#include <algorithm>
#include <string>

#include "atomflow/kernels.h"
#include "atomflow/spec.h"

namespace atomflow {

// What a caller may choose (EngineOptions::plan; the Python front fills it from its arguments and
// the environment, atomflow/backends/cuda.py). eager and f16_activations are user settings; prefill_fp8
// and skinny_gemm change a prompt's rounding (below); the others change the schedule, never the bits.
// All but the user settings exist so that tests compare both ways in one process
// (tests/test_engine_gpu.py, tests/test_kernels_gpu.py).
struct PlanOptions {
  bool eager = false;           // run the decode step's launches directly instead of a CUDA graph
  bool f16_activations = true;  // decode steps write attention's and SwiGLU's outputs in fp16 (engine.h)
  bool fused_tail = true;       // the sampler ends the step: token ring, position, next embedding
  bool short_steps = true;      // steps of at most kShortKeys keys replay a grid planned for them
  bool cluster_merge = true;    // attention merges its splits in a thread-block cluster when one holds them
  bool staged_pair = true;      // the QKV GEMV copies its warps' second row pairs to shared memory early
  bool tickets = true;          // the gate/up GEMV hands out its row pairs past the first round by ticket
  // A recipe, not a schedule (other bits): prefill chunks of at least StepPlan::w8a8_min_rows rows
  // quantize their activations to FP8 per token per 128 columns (gemm_w8a8_sm90) instead of W8A16.
  // Off by default (docs/design/gemm_w8a8_sm90.md: its quality on real text).
  bool prefill_fp8 = false;
  // Prompt chunks' sm90 W8A16 GEMM launches under PDL (CUTLASS built with its grid-dependency control):
  // its prologue overlaps the kernel before it, and the kernel after it launches at its last tile.
  bool gemm_pdl = true;
  // Prompt chunks of up to StepPlan::skinny_max_rows rows past the small-M range run gemm_w8a16_skinny (the
  // weights streamed as the decode GEMV streams them) instead of the sm90 GEMM. Other bits (its recipe keeps
  // w * s exact, the sm90 GEMM rounds it to 16 bits): off only for comparisons.
  bool skinny_gemm = true;
  // Those chunks' QKV product does RoPE + KV append in its epilogue where StepPlan::skinny_rope says it can
  // (same bits as the two launches).
  bool skinny_rope = true;
  // Those chunks' RMSNorms (but layer 0's first) split between the products around them instead of an rmsnorm
  // launch, where StepPlan::skinny_norm says it pays: the AddResidual product leaves bf16(out * w) and its row
  // groups' sums of squares, the next product scales its sums by each row's 1 / rms (kernels.h, SkinnyNormOut /
  // SkinnyNormIn). A prompt's rounding: not the rmsnorm kernel's bits.
  bool skinny_norm = true;
};

struct StepPlan {
  // 512 = 16 splits of 32 keys (attention_decode.cu): the most keys whose splits one 16-block cluster holds.
  static constexpr int kShortKeys = 512;

  PlanOptions options;
  // The device planned for (occupancy and cluster queries ran on it).
  std::string device;
  int sm_count = 0, cc_major = 0, cc_minor = 0;
  bool pdl = true;  // programmatic dependent launch (off only with the debug switch ATOMFLOW_NO_PDL=1)
  int max_context = 0;

  // Graph layout: one graph with attention planned for max_context; with short_keys > 0 a second
  // one planned for short_keys keys, replayed by the steps whose keys fit (same bits: the split
  // count per position does not depend on the grid). Eager steps plan their launches the same way.
  int short_keys = 0;

  // The decode step's QKV path. Fused (fused_qkv): one launch, qkv = (RopeKV, NORM): RMSNorm + QKV
  // GEMV (+ bias: with attention_bias, the instance that adds it, qkv.bias) + RoPE + KV append.
  // In attention (fused_qkv false): qkv = (Store, NORM) into the activation buffer, and attention
  // takes that raw row (attention_qkv, planned with qkv_in: each block makes its query heads and the
  // new K / V row with the bias, per-head q/k RMSNorm and RoPE, rope_kv_append's bits). A model with
  // per-head q/k RMSNorm (qk_norm, Qwen3) takes it: the norm needs a head's D outputs together, and
  // each warp of the fused epilogue holds two of them (qkv_fusable in step_plan.cpp). Either way the
  // decode step's attention reads the cached rows early (kernels.h, attention's `early`: the product
  // triggers it after its own wait). Probed steps run rope_kv_append and attention apart, and so do
  // prompt chunks but those of up to small_m_max_rows rows with small_m_rope (below).
  bool fused_qkv = true;
  // The decode step's products (M = 1), in launch order. o and down run on fp16 x while the
  // activations are fp16 and on bf16 x after an overflow (or from load without f16_activations).
  kernels::GemvPlan qkv;                  // RMSNorm + QKV (+ RoPE + KV append when fused_qkv)
  kernels::GemvPlan o_f16, o_bf16;        // AddResidual on attention's output
  kernels::GemvPlan gate_up;              // RMSNorm + gate/up + SwiGLU (SwiGLU, NORM)
  kernels::GemvPlan down_f16, down_bf16;  // AddResidual on SwiGLU's output
  bool fp8_head = false;
  kernels::GemvPlan head;  // final RMSNorm + lm_head + per-block argmax (Store, NORM): FP8 head
  // The validator's decode step (probes between the norms and the products): the same products
  // with the norms apart.
  kernels::GemvPlan probe_qkv, probe_gate_up, probe_head;
  // Attention of a decode step: the grid planned for max_context, and for short_keys (qkv_in where
  // fused_qkv is false).
  kernels::AttnPlan attn, attn_short;
  // Every attention plan of the model on the decode kernel (decode, probed, a chunk's rows) halves its
  // query-head ratios of 4, 6 and 8 (AttnPlan::halved: two blocks of half the heads per kv head, the
  // unhalved plan's key steps, at most 32 splits) where fused_qkv is false, whose decode step makes its
  // query heads in attention's prologue (Qwen3-8B -3.9% on an H100, log 2026-11-26 f and i), and at
  // ratio 4 with head_dim 128 on any model (Llama-3.1-8B -8% at depth 8192, log 2026-11-26 i).
  bool attn_halved = false;
  // Prefill chunks (M > 1) run the tensor-core GEMM. Their attention: chunks of at least
  // prefill_attn_min_rows rows run attention_prefill on tensor cores (planned per chunk by
  // prefill_attention: its grid depends on the rows and the keys before them); shorter ones run the decode
  // kernel, planned per chunk with options.cluster_merge (the chunk's M sets the splits), but a prompt's
  // chunk after at least prefill_attn_deep_prior cached keys takes the tensor-core kernel from 2 rows where
  // it splits its keys (the Wgmma kernel): a verify's rows keep the decode kernel, the decode step's bits.
  // H200, 2..31 rows after 0..16384 keys (`ops.time_attention` against `ops.time_attention_prefill`, us a
  // layer, docs/design/attention_prefill.md "Short chunks deep in a context"): from an empty cache the
  // decode kernel is 0-0.9 us faster on the 3B's heads at 2..16 rows (the 8B's: 0.3-0.9 slower); after 64
  // keys the wgmma kernel is faster at every row count (3B 16 rows 8.8 -> 6.9 us), after 128..512 within
  // 1.3 us either way at 2..8 rows and faster from 12, after 4096 keys 25.7 -> 15.1 (2 rows), 88.9 -> 16.1
  // (16), 160.1 -> 17.4 (31).
  static constexpr int kPrefillAttnMinRows = 32, kPrefillAttnDeepPrior = 64;
  static constexpr int kNever = 1 << 30;  // prefill_attn_min_rows of a shape attention_prefill does not take
  // The default rows per prefill pass (EngineOptions::prefill_chunk 0): of kPrefillChunkSmall and
  // kPrefillChunkLarge, the one that puts more of a layer's product FLOPs on the sm90 GEMM's 256-token tile
  // (sm90_tile_for on this GPU's SMs: by waves of tiles; ~10% less time per FLOP than the 128-token tile when
  // its waves are full), the smaller on a tie; kPrefillChunkSmall where the sm90 GEMM does not take the
  // layer. On an H100 (132 SMs) the 1B and 3B shapes take the tile for 3 and 1 of their 4 products at 2048
  // rows and all 4 at 4096; Qwen2.5-7B 3 at 2048 and 1 at 4096; the 8B all 4 at both. That picks the faster
  // chunk of each: `tools/prefill_profile.py MODEL -p 8192,32768 --chunk 2048,4096,8192` (docs/perf-log.md
  // 2026-11-28 a): 3B pp8192 133.8 / 125.6 / 127.7 ms, pp32768 906 / 874 / 880; 8B pp8192 261.4 / 266.3 / 272.5,
  // pp32768 1614 / 1625 / 1664; with `-p 8192,16384 --chunk 2048,4096`: 1B 64.1 / 62.6, 185.5 / 178.9;
  // Qwen2.5-7B 236.3 / 251.2, 556.2 / 578.1 (tests/test_prefill_chunk.py holds those picks).
  static constexpr int kPrefillChunkSmall = 2048, kPrefillChunkLarge = 4096;
  static constexpr double xwide_flops(const kernels::Sm90Layer& l, int rows, int sms) {
    // N x K of each launch: qkv, o, SwiGLU's two halves of f rows or one launch of 2f
    // (kernels::sm90_swiglu_halves), down.
    const bool halves = kernels::sm90_swiglu_halves(rows, l.f, sms);
    const double products[5][2] = {{1.0 * l.qkv_dim, 1.0 * l.d},
                                   {1.0 * l.d, 1.0 * l.q_dim},
                                   {(halves ? 1.0 : 2.0) * l.f, 1.0 * l.d},
                                   {halves ? 1.0 * l.f : 0.0, 1.0 * l.d},
                                   {1.0 * l.d, 1.0 * l.f}};
    double sum = 0;
    for (const auto& nk : products)
      if (nk[0] > 0 && kernels::sm90_tile_for(rows, static_cast<int>(nk[0]), sms) == kernels::Sm90Tile::XWide)
        sum += nk[0] * nk[1];
    return sum;
  }
  static constexpr int prefill_chunk_for(const kernels::Sm90Layer& l, int sms) {
    return xwide_flops(l, kPrefillChunkLarge, sms) > xwide_flops(l, kPrefillChunkSmall, sms) ? kPrefillChunkLarge
                                                                                             : kPrefillChunkSmall;
  }
  int prefill_chunk = kPrefillChunkSmall;  // this model's default (prefill_chunk_for), at most max_context
  int prefill_attn_min_rows = kPrefillAttnMinRows;
  int prefill_attn_deep_prior = kPrefillAttnDeepPrior;  // kNever where the chunks keep the decode kernel
  // Which attention_prefill kernel such a chunk runs: the warpgroup-MMA one (attention_prefill_sm90.cu)
  // on sm_90 at head_dim 128, the mma.sync one otherwise (docs/design/attention_prefill.md).
  kernels::PrefillAttnKernel prefill_attn_kernel = kernels::PrefillAttnKernel::Mma;
  int head_dim = 0, num_heads = 0, num_kv_heads = 0;  // the attention shape prefill_attention plans
  // A prefill chunk's products: up to small_m_max_rows rows run the small-M GEMV (gemv_w8a16_m: each
  // weight byte read once for all rows, planned per call), more rows the tensor-core GEMM. Measured on
  // an H200 (bench_kernels.py, one 3B layer): 16 rows 142 us against the GEMM's 284, 32 rows 294 against
  // 293, 64 rows 594 against 317 (docs/design/gemv_w8a16_m.md).
  static constexpr int kSmallMMaxRows = 16;
  static_assert(kSmallMMaxRows <= kernels::kMaxAttnRowsAsSteps, "small-M chunks run attention as decode steps");
  int small_m_max_rows = kSmallMMaxRows;
  // Such a chunk's QKV product takes RoPE + KV append into its epilogue (gemv_w8a16_m_rmsnorm_rope:
  // rope_kv_append's bits, one launch fewer per layer) where the decode step's does (fused_qkv) and
  // head_dim % 16 == 0 (a tile holds 8 rotation pairs of one head); else it stores the raw row and
  // rope_kv_append follows.
  bool small_m_rope = false;
  // Rows of logits the engine holds at once (a speculative verify's chunk; the FP8 head runs them on the
  // small-M GEMV in one launch).
  static constexpr int kLogitRows = kSmallMMaxRows;
  // Chunks of at least sm90_gemm_min_rows rows run their products on the Hopper GEMM (gemm_w8a16_sm90:
  // CUTLASS, TMA + wgmma) instead of gemm_w8a16; kNever where it is not built (no nvidia-cutlass at
  // build time), the device is not sm_90, or a product's shape is not one it takes. Measured on an H200
  // (bench_kernels.py, one 3B layer): it beats gemm_w8a16 at every M from 16 rows on (16 rows 168 us
  // against 284, 64 rows 162 against 315, 512 rows 265 against 642), and the small-M GEMV keeps up to
  // 16 rows (143 us), so every chunk past the small-M range takes it.
  static constexpr int kSm90GemmMinRows = kSmallMMaxRows + 1;
  int sm90_gemm_min_rows = kSm90GemmMinRows;
  // Chunks of sm90_gemm_min_rows..skinny_max_rows rows run their products on gemm_w8a16_skinny instead
  // (0: never; PlanOptions::skinny_gemm, sm_90, every product a shape it takes). Measured on an H100
  // (bench_kernels.py --sections gemm_skinny, one layer, weights from DRAM): 3B 17 / 32 rows 67 / 73 us
  // against the sm90 GEMM's 116, 48 rows 160 against 116 (its 8 token tiles: one block an SM); 8B 32 rows
  // 134 against 168.
  static constexpr int kSkinnyMaxRows = 32;
  static_assert(kSkinnyMaxRows <= kernels::kSkinnyMaxRows, "the skinny GEMM's rows");
  int skinny_max_rows = 0;
  // Their QKV product with RoPE + KV append in its epilogue (gemm_w8a16_skinny_rope, the bits of the Store
  // product and rope_kv_append): PlanOptions::skinny_rope, no per-head q/k norm, head_dim dividing 128.
  bool skinny_rope = false;
  // Their RMSNorms split between the products around them (PlanOptions::skinny_norm), for the hidden sizes
  // where it was measured to pay (kSkinnyNormHidden). It trades the norm launches (~7-8 us each, two a layer)
  // for slower products: the next product no longer streams its first weights while a norm runs. Measured
  // (H100, `tools/timeline.py MODEL --prefill 32 --option skinny_norm=0`, `tools/prefill_profile.py MODEL -p
  // 8,16,24,32 --reps 5 --option skinny_norm=0`): 3B (hidden 3072) a 32-token prompt's span 2682 -> 2535 us,
  // 8..32 rows 0.08-0.21 ms faster (three runs); 1B (2048) 0.01-0.05 ms slower; 8B (4096) the span unchanged
  // (5020 / 5024 us), 24 rows 0.28-0.35 ms slower (three runs); again with 7bf8ce5's shorter tail: 1B even, 8B
  // 0.12-0.23 ms slower at 24 and 32 rows.
  static constexpr int kSkinnyNormHidden[] = {3072};
  bool skinny_norm = false;
  // A prompt chunk (not a verify chunk nor prefill_rows' rows, which must be decode steps' bits) of
  // kSkinnyMinRows..small_m_max_rows rows takes the skinny GEMM too (RMSNorm apart), where skinny_max_rows says
  // it runs. Measured (H100, `tools/prefill_profile.py MODEL -p 2,3,4,5,6,8,... --option skinny_gemm=0`, the
  // skinny GEMM from 2 rows against the small-M GEMV, Engine.prefill wall): 3B 2 / 3 / 4 / 5 / 6 / 8 rows 2.50 /
  // 2.48 / 2.48 / 2.50 / 2.48 / 2.47 ms against 2.21 / 2.37 / 2.48 / 2.61 / 2.62 / 2.75; 8B 2 / 4 / 6 rows 4.56 /
  // 4.63 / 4.54 against 4.02 / 4.52 / 5.05: the skinny GEMM from 5 rows.
  static constexpr int kSkinnyMinRows = 5;
  // The most rows of a chunk that runs on the small-M GEMV: every chunk of up to small_m_max_rows whose rows
  // are decode steps; a prompt chunk below kSkinnyMinRows where the skinny GEMM runs.
  int small_m_rows(bool step_rows) const {
    return step_rows || skinny_max_rows == 0 ? small_m_max_rows : std::min(small_m_max_rows, kSkinnyMinRows - 1);
  }
  // With PlanOptions::prefill_fp8, chunks of at least w8a8_min_rows rows run their products on the FP8
  // recipe (gemm_w8a8_sm90), kNever otherwise. Measured on an H200 (bench_kernels.py --sections
  // gemm_w8a8, one layer against the W8A16 GEMM's kind for the rows, the activation quantizer
  // included): 3B 0.92x at 16..64 rows, 1.02x at 128, 1.11x at 256, 1.24x at 512 and 1024; 8B 0.91x at
  // 128, 1.05x at 256, 1.18x at 512.
  static constexpr int kW8A8MinRows = 256;
  int w8a8_min_rows = kNever;

  kernels::GemvKnobs knobs() const { return {options.staged_pair, options.tickets}; }
  // The attention plan of a decode step whose grid is planned for attn_keys keys.
  const kernels::AttnPlan& decode_attention(int attn_keys) const;
  // A probed decode step's (q from rope_kv_append, never qkv_in).
  kernels::AttnPlan probe_attention(int attn_keys) const;
  // Whether chunks on attention_prefill split their keys (the Wgmma kernel): the engine reserves the
  // partials' scratch, and short prompt chunks deep in a context take it (prefill_attn_deep_prior).
  bool prefill_attn_splits() const {
    return prefill_attn_min_rows < kNever && prefill_attn_kernel == kernels::PrefillAttnKernel::Wgmma;
  }
  // Whether a chunk of `rows` query tokens runs attention_prefill, and its plan when it does.
  // rows of a chunk whose first position is prior; step_rows: a chunk whose rows are decode steps' (a verify).
  bool prefill_on_tensor_cores(int rows, int prior, bool step_rows) const {
    return rows >= prefill_attn_min_rows || (rows > 1 && !step_rows && prior >= prefill_attn_deep_prior);
  }
  // prior: the chunk's first position (its key tiles set the splits, kernels.h).
  kernels::PrefillAttnPlan prefill_attention(int rows, int prior = 0) const;
};

// Needs the GPU that will run the engine as the current device.
StepPlan make_step_plan(const ModelSpec& spec, int max_context, const PlanOptions& options);

}  // namespace atomflow

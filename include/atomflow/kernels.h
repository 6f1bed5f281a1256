// The kernel launchers: the one boundary shared by the core engine (csrc/core) and the
// sandbox (csrc/sandbox). One op per file in csrc/kernels/, each file = kernel(s) + launcher.
//
// Conventions
//  - Activations entering a matrix product are 16-bit: the RMSNorm output in fp16 (its values are
//    normalized, so fp16's 3 extra mantissa bits are free precision: 8x less rounding error than
//    bf16 where the engine's error budget is largest), attention and SwiGLU outputs in bf16 (their
//    range is not bounded), except in the decode step (M = 1), which writes them in fp16 and raises
//    a flag (f16_overflow) when a value lies past fp16's range: the o and down GEMVs then copy x as
//    it is instead of rescaling bf16 into fp16 behind a block-wide maximum (docs/design/gemv_w8a16.md),
//    and the engine reruns a flagged step with bf16 activations (engine.h). The
//    residual stream is fp32 (at M = 1 it is a few KB, so full precision costs nothing in
//    bandwidth); accumulation is fp32.
//  - Linear weights are FP8 E4M3 (OCP e4m3fn) stored row-major [N, K] (one output row is K
//    contiguous bytes), with fp32 scales [N, ceil(K / 128)]: w[n, k] = fp8[n, k] * scale[n, k / 128].
//    K is a multiple of 64; where K % 128 == 64 the last scale group of a row (the tail group)
//    covers its last 64 columns (docs/FORMAT.md).
//  - The current position (tokens already in the KV cache) lives in DEVICE memory (`pos`), so
//    a captured CUDA graph serves every position. Kernels read it; only the engine advances it.
//  - KV cache per layer: K and V each [max_context, num_kv_heads, head_dim] bf16, contiguous.
//  - Every launcher takes a cudaStream_t, checks its assumptions (AF_CHECK), and ends with
//    AF_CUDA_CHECK(cudaGetLastError()). A launcher with choices (the GEMV, attention) takes them as
//    its part of the step plan (plan_gemv, plan_attention; step_plan.h) and reads no environment. No launcher allocates
//    memory: scratch comes from the caller (sizes from the *_scratch_bytes functions), so everything can be
//    graph-captured.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "atomflow/common.h"

namespace atomflow::kernels {

// ---------------------------------------------------------------------------------------
// embedding.cu: out[m, :] = float(table[tokens[m], :]), m < M. table bf16 [vocab, d].
// Token ids are checked on the host before they reach the device; the kernel clamps to
// [0, vocab) so a bad id can never read out of bounds.
void embedding(const bf16* table, const int32_t* tokens, int M, int d, int vocab, float* out, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// rmsnorm.cu: out[m, :] = f16(x[m, :] * rsqrt(mean(x[m, :]^2) + eps) * w), x fp32 [M, d],
// w bf16 [d]. Matches HF LlamaRMSNorm in fp32 (the weight multiplies the normalized fp32).
void rmsnorm(const float* x, const bf16* w, int M, int d, float eps, f16* out, cudaStream_t stream);

// The 16-bit type of a matrix product's activation input.
enum class Act : int { BF16 = 0, F16 = 1 };
// fp16's largest finite value. A kernel that writes an fp16 activation where bf16 is the default
// (f16_overflow below) sets *f16_overflow = 1 when a value's magnitude passes it; it never clears it.
constexpr float kF16Max = 65504.f;

// ---------------------------------------------------------------------------------------
// gemv_w8a16.cu / gemm_w8a16.cu: y[m, n] = sum_k x[m, k] * w[n, k], with an epilogue:
enum class Epilogue : int {
  Store = 0,        // out fp32 [M, N]:  out = y
  AddResidual = 1,  // out fp32 [M, N]:  out += y      (O and down projections)
  SwiGLU = 2,       // N = 2F, out bf16 [M, F]: out = silu(y[:, :F]) * y[:, F:]   (fused gate/up)
                    //   (the GEMVs: fp16 given f16_overflow, kF16Max)
  RopeKV = 3,       // the decode QKV GEMV only (gemv_w8a16_rmsnorm_rope): RoPE + KV append (+ bias)
};
// What a GEMV reads as x: 16-bit activations (Act's values), or the fp32 residual stream that its
// prologue normalizes (RMSNorm fused).
enum class GemvIn : int { BF16 = 0, F16 = 1, NORM = 2 };

// How one GEMV launch runs: its part of the step plan (include/atomflow/step_plan.h), computed by
// plan_gemv (gemv_w8a16_plan.cpp) from the shape, the device and the knobs, printed by `atomflow
// info --plan`. A launcher checks that its plan is of its own kind and shape; it decides nothing.
struct GemvPlan {
  Epilogue ep;
  GemvIn in;
  int N, K;
  bool whole;        // K % 512 == 0: the instance whose loads need no clamp at a row's end
  bool tail;         // K % 128 == 64: the instance whose rows end in a 64-column scale group (never whole)
  bool bias;         // RopeKV: the instance that adds RopeKVArgs::bias (the model's attention_bias);
                     // without, the instance has no trace of a bias in its machine code
  int blocks;        // grid: at most the blocks resident at once (2 per SM), fewer when there are
                     // fewer row pairs than resident warps
  int threads;       // per block (256: 8 warps)
  int pre_warps;     // warps per block that load their first iteration before the PDL wait
  int staged_warps;  // warps per block that copy their second row pair into shared memory early (QKV)
  bool ticketed;     // SwiGLU: row pairs past the first round handed out by ticket (given counters)
  size_t smem;       // dynamic shared memory per block
  // The dependents launch after the kernel's PDL wait instead of at its start (always for RopeKV): the
  // decode QKV product before an attention that reads the cache early (the step plan sets it).
  bool late_trigger = false;
  // Token columns (plan_gemv_cols: the decode GEMV on 1..mt rows of x; rows = mt = 1 for the decode GEMV
  // itself): the rows of x, the instance's columns (kGemvColsMT), and for NORM the raw fp32 rows staged at
  // a time.
  int rows = 1;
  int mt = 1;
  int raw_rows = 0;
};
// The plan's overrides of the default schedule (each same bits, a comparison for the tests): the
// QKV product's staged second pairs, and SwiGLU's tickets.
struct GemvKnobs {
  bool staged_pair = true;
  bool tickets = true;
};
// Needs the device (occupancy): call with the GPU that will run the launch current. bias (RopeKV
// only): plan the instance that adds a bias (GemvPlan::bias).
GemvPlan plan_gemv(Epilogue ep, GemvIn in, int N, int K, const GemvKnobs& knobs = {}, bool bias = false);
// "gemv_w8a16<RopeKV, NORM, whole>" (or "ragged", "ragged, tail group"; then ", bias" for the bias
// instance): the kernel instance a plan launches.
std::string gemv_variant_name(const GemvPlan& plan);

// M = 1 decode. K % 64 == 0, scales [N, ceil(K / 128)]. Weights read exactly once with 16-byte
// register loads; the plan's pre_warps load their first iteration of weights into registers before
// the kernel waits for its predecessor (PDL). plan: plan_gemv(ep, GemvIn(x_type), N, K) (or the
// step plan's).
//
// tickets (SwiGLU only, may be null): kGemvTicketBytes of zeroed device memory, used by one stream.
// With it, a plan with `ticketed` hands out the pairs past the first round by atomic counters
// instead of a fixed stride (same bits), and leaves the counters at zero.
// f16_overflow (SwiGLU only, may be null): the output is fp16 instead of bf16, and
// *f16_overflow = 1 when a value's magnitude passes kF16Max (its store is then inf).
constexpr size_t kGemvTicketBytes = 64 * 128;
void gemv_w8a16(const GemvPlan& plan, const uint8_t* w, const float* scales, const void* x, Act x_type, int N, int K,
                Epilogue ep, void* out, cudaStream_t stream, unsigned* tickets = nullptr, int* f16_overflow = nullptr);
// The same with RMSNorm fused into the prologue: the GEMV's input is
// f16(x * rsqrt(mean(x^2) + eps) * norm_w), x the fp32 residual stream [K] (bit-identical to
// rmsnorm() followed by gemv_w8a16(..., Act::F16, ...), one launch and one round trip fewer).
// plan: plan_gemv(ep, GemvIn::NORM, N, K).
void gemv_w8a16_rmsnorm(const GemvPlan& plan, const uint8_t* w, const float* scales, const float* x, const bf16* norm_w,
                        float eps, int N, int K, Epilogue ep, void* out, cudaStream_t stream,
                        unsigned* tickets = nullptr, int* f16_overflow = nullptr);
// The decode QKV product with RMSNorm in the prologue and RoPE + KV append in the epilogue: w is
// the fused [(H + 2 Hkv) * D, K] qkv matrix; the output is what gemv_w8a16_rmsnorm(Store) followed
// by rope_kv_append(M = 1, QkvExtras{bias}) writes (q_out, the cache rows at *pos), bit-identical,
// in one launch. No per-head q/k RMSNorm: a warp holds two outputs of a head, never all D of them
// (the step plan sends qk_norm models to the two launches, step_plan.h).
// plan: plan_gemv(Epilogue::RopeKV, GemvIn::NORM, (H + 2 Hkv) * D, K, knobs, bias = rope.bias != null):
// the bias is a compile-time choice of the instance (plan.bias), so the launch fails unless
// rope.bias is given exactly when the plan's instance adds it.
struct RopeKVArgs {
  const float* inv_freq;  // [D / 2]
  const int32_t* pos;     // device: the token's position (the cache row it fills)
  int H, Hkv, D, max_context;
  bf16* q_out;    // [H, D]
  bf16* k_cache;  // [max_context, Hkv, D]
  bf16* v_cache;
  const float* bias = nullptr;  // fp32 [(H + 2 Hkv) D], added to each output before RoPE (Qwen2); iff plan.bias
};
void gemv_w8a16_rmsnorm_rope(const GemvPlan& plan, const uint8_t* w, const float* scales, const float* x,
                             const bf16* norm_w, float eps, int K, const RopeKVArgs& rope, cudaStream_t stream);
// gemv_w8a16_rmsnorm(..., Epilogue::Store, ...) that also leaves, for the greedy sampler, the
// largest (order key of out[r]) << 32 | ~r over the rows r each block wrote in block_best[block]
// (plan.blocks entries): their maximum is the argmax of out, lowest index on ties.
// plan: plan_gemv(Epilogue::Store, GemvIn::NORM, N, K).
void gemv_w8a16_rmsnorm_argmax(const GemvPlan& plan, const uint8_t* w, const float* scales, const float* x,
                               const bf16* norm_w, float eps, int N, int K, float* out, uint64_t* block_best,
                               cudaStream_t stream);
// M > 1 prefill on tensor cores (FP8 converted exactly to the activation's 16-bit type in the
// main loop). x [M, K] of x_type; K % 64 == 0, scales [N, ceil(K / 128)].
void gemm_w8a16(const uint8_t* w, const float* scales, const void* x, Act x_type, int M, int N, int K, Epilogue ep,
                void* out, cudaStream_t stream);
// gemm_w8a16_sm90.cu: the same product on Hopper's warpgroup MMA (CUTLASS's mixed-input TMA + wgmma
// GEMM, built for sm_90a from the nvidia-cutlass headers). Each weight is rounded once to x_type after
// its fp32 scale (gemm_w8a16 keeps w * s exact: bf16 adds <= 2^-9 relative per weight, fp16 2^-11).
// Epilogues Store and AddResidual (fp32 [M, N]) and SwiGLU (N = 2F, bf16 [M, F]; two launches or one, by
// sm90_swiglu_halves below, the same bits either way). N % 8 == 0 (N % 16 == 0 for SwiGLU), K % 64 == 0, M >= 1.
// workspace: gemm_w8a16_sm90_workspace_bytes(ep, M, N, K, tile) bytes (256-byte aligned), no initial value,
// one stream at a time. Under PDL or not as its pdl argument says (below).
// Tokens per tile: XWide 256, Wide 128, Narrow 64; the StreamK kinds split the k-loops of the tiles over all
// SMs (CUTLASS's stream-K scheduler), so a product with fewer tiles than SMs still runs on every SM.
// Auto: sm90_tile_for(M, N, SMs) with N a launch's (F for a SwiGLU half), the best kind per product as measured
// (docs/design/gemm_w8a16_sm90.md). An explicit kind serves every launch of the call.
enum class Sm90Tile { Auto, Wide, Narrow, WideStreamK, NarrowStreamK, XWide };
constexpr int kSm90NarrowMaxRows = 64, kSm90StreamKMaxRows = 256;
// Past kSm90StreamKMaxRows, XWide (256 tokens a tile) when its waves of tiles over the SMs take less time
// than Wide's, an xwide tile costing kSm90XWideTileCost wide ones (measured: 1.76..1.9 pick the faster kind
// of every 3B and 8B product at 512..2048 rows but one within 5%).
constexpr double kSm90XWideTileCost = 1.8;
constexpr Sm90Tile sm90_tile_for(int M, int N, int sms) {
  if (M <= kSm90NarrowMaxRows) return Sm90Tile::NarrowStreamK;
  if (M <= kSm90StreamKMaxRows) return Sm90Tile::WideStreamK;
  const int row_tiles = (N + 127) / 128;
  const int wide_waves = (row_tiles * ((M + 127) / 128) + sms - 1) / sms;
  const int xwide_waves = (row_tiles * ((M + 255) / 256) + sms - 1) / sms;
  return xwide_waves * kSm90XWideTileCost < wide_waves ? Sm90Tile::XWide : Sm90Tile::Wide;
}
// Tiles of a product of M tokens and N weight rows on a kind (tokens per tile: XWide 256, Wide 128, Narrow 64).
constexpr int sm90_tiles(int M, int N, Sm90Tile kind) {
  const int tokens = kind == Sm90Tile::XWide                                       ? 256
                     : kind == Sm90Tile::Narrow || kind == Sm90Tile::NarrowStreamK ? 64
                                                                                   : 128;
  return ((N + 127) / 128) * ((M + tokens - 1) / tokens);
}
// SwiGLU (N = 2F) as two launches of F rows, the up half's epilogue taking the gate half's fp32 y (no fp32
// [M, 2F] round trip), past the stream-K rows when each half runs on the 256-token tile (sm90_tile_for at F)
// and its tiles outnumber the SMs; otherwise one launch of 2F rows and swiglu_rows on its fp32 y in the
// workspace. A half in one partial wave pays the boundary between the two launches (the up half's loads wait
// for the gate half's last tile), which one launch's persistent tiles overlap; halves on the 128-token tile
// where one launch would take the 256-token one convert each weight for half the tokens. Measured in the
// engine on an H100 (docs/design/gemm_w8a16_sm90.md, "SwiGLU"; tests/test_sm90_tiles.py).
constexpr bool sm90_swiglu_halves(int M, int F, int sms) {
  return M > kSm90StreamKMaxRows && sm90_tile_for(M, F, sms) == Sm90Tile::XWide &&
         sm90_tiles(M, F, Sm90Tile::XWide) > sms;
}
// How gemm_w8a16_sm90 runs SwiGLU: Auto (sm90_swiglu_halves), Halves or OneLaunch (the harness's knobs).
enum class Sm90Swiglu { Auto, Halves, OneLaunch };
bool gemm_w8a16_sm90_built();  // false: nvidia-cutlass was missing at build time (the launcher fails)
bool gemm_w8a16_sm90_supported(Epilogue ep, int M, int N, int K);
size_t gemm_w8a16_sm90_workspace_bytes(Epilogue ep, int M, int N, int K, Sm90Tile tile = Sm90Tile::Auto);
// scales_gn (may be null): the scales already transposed by gemm_w8a16_sm90_transpose_scales (the engine
// does it once at load); null: the launcher transposes them into the workspace first. pdl: the GEMM launches
// under PDL (when enabled, pdl.cuh), its loads after its wait for the kernel before; off, it starts after
// that kernel ends (the same bits either way).
void gemm_w8a16_sm90(const uint8_t* w, const float* scales, const void* x, Act x_type, int M, int N, int K, Epilogue ep,
                     void* out, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                     Sm90Tile tile = Sm90Tile::Auto, const float* scales_gn = nullptr, bool pdl = true,
                     Sm90Swiglu swiglu = Sm90Swiglu::Auto);
// A Llama layer's four products as a prefill chunk runs them: qkv [qkv_dim, d] (Store), o [d, q_dim] and
// down [d, f] (AddResidual), gate/up [2 f, d] (SwiGLU). Whether this build's sm90 GEMM takes every one of
// them (the caller checks the device is sm_90), and the workspace that serves any chunk of min_rows..
// max_rows rows (the scheduler's share is not monotonic in the rows).
struct Sm90Layer {
  int d, f, q_dim, qkv_dim;
};
bool gemm_w8a16_sm90_takes_layer(const Sm90Layer& layer);
size_t gemm_w8a16_sm90_layer_workspace_bytes(const Sm90Layer& layer, int min_rows, int max_rows);
// The tile kind's name ("wide", "narrow-streamk", ...; "auto"), as `atomflow info --plan` and the ops
// harness spell it.
const char* sm90_tile_name(Sm90Tile tile);
// out bf16 [M, F] = silu(y[:, :F]) * y[:, F:] of the GEMM's fp32 y [M, 2F] (F % 8 == 0, 16-byte aligned).
void gemm_w8a16_sm90_swiglu_rows(const float* y, int M, int F, bf16* out, cudaStream_t stream);
// gemm_w8a8_sm90.cu: the FP8 recipe of the same product (activations quantized per token per 128 columns,
// amax / 448; FP8 wgmma with the group scales applied to fp32 partial sums). Shapes, epilogues and
// workspace rules as gemm_w8a16_sm90's. The step plan routes chunks of StepPlan::w8a8_min_rows+ rows to it
// under PlanOptions::prefill_fp8. streamk: the stream-K scheduler instead of the data-parallel one (128 x
// 128 tiles either way; the workspace is the kind's).
size_t gemm_w8a8_sm90_workspace_bytes(Epilogue ep, int M, int N, int K, bool streamk = false);
void gemm_w8a8_sm90(const uint8_t* w, const float* scales, const void* x, Act x_type, int M, int N, int K, Epilogue ep,
                    void* out, void* workspace, size_t workspace_bytes, cudaStream_t stream, bool streamk = false);
// out fp32 [ceil(K / 128), N] = scales [N, ceil(K / 128)] transposed (what the sm90 GEMM reads).
void gemm_w8a16_sm90_transpose_scales(const float* scales, int N, int K, float* out, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// gemm_w8a16_skinny.cu: the same product for prompt chunks of up to kSkinnyMaxRows rows, its weights
// streamed in long runs of each row (256 bytes, through shared memory, on every SM) into mma.sync with the
// tokens on its 8-wide side; products with fewer 128-row blocks than SMs split their scale groups over a
// thread-block cluster whose blocks add each other's partial sums in rank order (deterministic). Weights
// exact in the activation's 16-bit type, the group scales applied to fp32 partial sums (gemm_w8a16's
// recipe, not the sm90 GEMM's rounding of w * s). Epilogues Store, AddResidual (fp32 [M, N]), SwiGLU
// (N = 2F, bf16 [M, F]) and RopeKV (gemm_w8a16_skinny_rope); under PDL (its weights and scales load before
// its wait). No workspace.
// Shapes: 1 <= M <= kSkinnyMaxRows, N % 16 == 0 (SwiGLU: N % 32 == 0), K % 64 == 0, at most
// kSkinnyMaxSplits x kSkinnyMaxGroups scale groups (K <= 24576).
constexpr int kSkinnyMaxRows = 64, kSkinnyMaxSplits = 8, kSkinnyMaxGroups = 24;
struct SkinnyPlan {
  Epilogue ep;
  Act xt;
  int M, N, K;
  int nt;          // token tiles of 8: 4 (M <= 32) or 8
  int splits;      // blocks of a cluster: each takes kg scale groups of every row of its row group
  int kg;          // scale groups (128 columns) per split
  int row_groups;  // blocks per split: 128 weight rows each (SwiGLU: 64 gate rows and their 64 up rows)
  int threads;     // per block (256)
  size_t smem;     // dynamic shared memory per block
};
bool gemm_w8a16_skinny_supported(Epilogue ep, int M, int N, int K);
// splits > 0 overrides the plan's choice (the tests and benches; 1..kSkinnyMaxSplits, at most the scale
// groups). The choice asks the current device how many clusters of each size it holds at once, once per
// device and shape (cached: no driver query on the prompt path after the first chunk of a shape).
SkinnyPlan plan_gemm_skinny(Epilogue ep, Act xt, int M, int N, int K, int splits = 0);
// A chunk's RMSNorm split between the products around it (prompt rows: not the rmsnorm kernel's bits). The
// AddResidual product (norm_out) writes, beside out fp32 [M, N], xw bf16 [M, N] = bf16(out * w) and ss fp32
// [M, P] (P = its plan's row_groups): entry rg of row m is the sum of squares of the row group's columns of out
// (each split block adds its columns in order, the cluster's blocks in split order), so a row's P entries
// cover its N columns once, in column order.
// The next product takes xw as its bf16 x (norm_in) and multiplies each row's sums by rsqrt(the row's P entries,
// added in a fixed order, / d + eps) before its epilogue (SwiGLU's gate and up, RopeKV's before the bias).
struct SkinnyNormOut {
  const bf16* w = nullptr;  // [N]: the next RMSNorm's weight
  bf16* xw = nullptr;       // [M, N]
  float* ss = nullptr;      // [M, P]
};
// A SkinnyNormOut's P for N columns: its row groups.
constexpr int skinny_norm_parts(int N) { return (N + 127) / 128; }
struct SkinnyNormIn {
  const float* ss = nullptr;  // [M, parts], a SkinnyNormOut's
  int parts = 0;              // P of the product that wrote it
  int d = 0;                  // the row length of the normalized residual
  float eps = 0.f;
};
// norm_out: only with AddResidual; norm_in: not with AddResidual (its x must be a SkinnyNormOut's xw, bf16).
void gemm_w8a16_skinny(const SkinnyPlan& plan, const uint8_t* w, const float* scales, const void* x, void* out,
                       cudaStream_t stream, const SkinnyNormOut* norm_out = nullptr,
                       const SkinnyNormIn* norm_in = nullptr);
// The QKV product with RoPE + KV append in its epilogue: the bits of gemm_w8a16_skinny(Store) then
// rope_kv_append(extras: the bias only) in one launch. Needs N = (H + 2 Hkv) D with D a multiple of 8 that
// divides 128 (a block's rows are whole heads); no per-head q/k norm. plan: plan_gemm_skinny(RopeKV, ...).
bool gemm_w8a16_skinny_rope_supported(int N, int H, int Hkv, int D);
void gemm_w8a16_skinny_rope(const SkinnyPlan& plan, const uint8_t* w, const float* scales, const void* x,
                            const RopeKVArgs& rope, cudaStream_t stream, const SkinnyNormIn* norm_in = nullptr);

// ---------------------------------------------------------------------------------------
// gemv_w8a16_m.cu: the GEMV for small M (1 <= M <= 64 rows of x: short prompts, a chunked prompt's
// tail, speculative verification, batched decode). Each weight byte is read once for all M rows;
// row m of the result is bit-identical to gemv_w8a16 (M = 1) on x[m] (the decode GEMV's products, k
// order, per-class fp32 chains and reduction tree; docs/design/gemv_w8a16_m.md). K % 64 == 0, scales
// [N, ceil(K / 128)] (a last group of 64 columns when K % 128 == 64). Epilogues Store, AddResidual and
// SwiGLU as gemm_w8a16's, outputs [M, N] / [M, N / 2].
struct GemvMPlan {
  Epilogue ep;
  GemvIn in;
  int M, N, K;
  int nt;       // token tiles of 8 (M padded to 8 nt): 1, 2, 4 or 8
  int nc;       // column classes (64-column groups mod 8) per warp: 8 / nc warps share a 16-row tile
  int slab;     // columns of x staged in shared memory at once; >= K: x staged once per block
  bool keep;    // x resident: its raw rows stay in shared memory from the factor scan to the staging
  int blocks;   // grid: the block tiles (nc tiles each), at most the blocks resident at once
  int threads;  // per block (256)
  size_t smem;  // dynamic shared memory per block
  // Where the table runs M on the decode GEMV with token columns instead (cols.blocks > 0): its plan
  // (plan_gemv_cols). The tile kernel's fields above stay planned either way.
  GemvPlan cols{};
};
// Overrides of the table, for the tests and the benches (0: the table's choice; tiles: never the
// token columns; cols: the token columns wherever they fit, past the table's crossover).
struct GemvMKnobs {
  int nc = 0;
  int slab = 0;
  bool tiles = false;
  bool cols = false;
};
// Needs the device (occupancy): call with the GPU that will run the launch current.
GemvMPlan plan_gemv_m(Epilogue ep, GemvIn in, int M, int N, int K, const GemvMKnobs& knobs = {});
// The decode GEMV with token columns for M rows (1 <= M <= 4), where both blocks of an SM fit their
// staging: blocks = 0 when they do not (the tile kernel's case). Needs the device.
GemvPlan plan_gemv_cols(Epilogue ep, GemvIn in, int M, int N, int K, bool bias = false);
std::string gemv_m_variant_name(const GemvMPlan& plan);  // "gemv_w8a16_m<SwiGLU, F16, nt=2, nc=8, slab=3072>"
// x [M, K] of x_type. plan: plan_gemv_m(ep, GemvIn(x_type), M, N, K). f16_overflow (SwiGLU only, may be
// null): the output is fp16 instead of bf16, and *f16_overflow = 1 when a value passes kF16Max.
void gemv_w8a16_m(const GemvMPlan& plan, const uint8_t* w, const float* scales, const void* x, Act x_type, int M, int N,
                  int K, Epilogue ep, void* out, cudaStream_t stream, int* f16_overflow = nullptr);
// The same with RMSNorm fused into the prologue: x the fp32 residual stream [M, K], row m normalized as
// rmsnorm() does (bit-identical to rmsnorm() followed by gemv_w8a16_m(..., Act::F16, ...)).
// plan: plan_gemv_m(ep, GemvIn::NORM, M, N, K).
void gemv_w8a16_m_rmsnorm(const GemvMPlan& plan, const uint8_t* w, const float* scales, const float* x,
                          const bf16* norm_w, float eps, int M, int N, int K, Epilogue ep, void* out,
                          cudaStream_t stream, int* f16_overflow = nullptr);
// The small-M QKV product of a chunk with RoPE + KV append in its epilogue: what
// gemv_w8a16_m_rmsnorm(Store) then rope_kv_append, bit for bit, in one launch (q into rope.q_out
// [M, H, D]; token m's K / V rows at *rope.pos + m while inside the cache). head_dim % 16 == 0.
// plan: plan_gemv_m(Epilogue::RopeKV, GemvIn::NORM, M, (H + 2 Hkv) D, K).
void gemv_w8a16_m_rmsnorm_rope(const GemvMPlan& plan, const uint8_t* w, const float* scales, const float* x,
                               const bf16* norm_w, float eps, int M, int K, const RopeKVArgs& rope,
                               cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// rope.cu: RoPE (HF rotate-half convention) on q and k of a fused qkv row, then the KV append.
//   qkv fp32 [M, (H + 2 * Hkv) * D]: q heads, then k heads, then v heads.
//   token m sits at position p = *pos + m; angle_i = p * inv_freq[i], i < D / 2
//   (inv_freq computed on the host by atomflow/model/spec.py, llama3 scaling included, fp32).
//   q_out bf16 [M, H, D] = rope(q); k_cache[p] = bf16(rope(k)); v_cache[p] = bf16(v).
// With extras (the Qwen family; all null: Llama), before RoPE: row += bias (q, k and v), then each q
// head h = row[h D, (h + 1) D) becomes h * rsqrt(mean(h^2) + eps) * q_norm, each k head the same with
// k_norm (fp32; q_norm and k_norm come together).
struct QkvExtras {
  const float* bias = nullptr;   // fp32 [(H + 2 Hkv) D] (Qwen2's q/k/v biases)
  const bf16* q_norm = nullptr;  // bf16 [D] (Qwen3)
  const bf16* k_norm = nullptr;  // bf16 [D]
  float eps = 0.f;               // the norms' epsilon (the spec's rms_norm_eps)
};
void rope_kv_append(const float* qkv, const float* inv_freq, const int32_t* pos, int M, int H, int Hkv, int D,
                    int max_context, bf16* q_out, bf16* k_cache, bf16* v_cache, cudaStream_t stream,
                    const QkvExtras& extras = {});

// ---------------------------------------------------------------------------------------
// attention_decode.cu: causal GQA attention over the contiguous cache, for decode (M = 1) and
// prefill chunks (M > 1). Query m (at position *pos + m) attends to cache rows [0, *pos + m].
//   q bf16 [M, H, D], caches bf16 [max_context, Hkv, D], out bf16 [M, H, D], scale = 1/sqrt(D).
// Flash-decoding in one launch: the context is split across blocks (the grid is fixed by
// max_context, the work per block is derived from *pos on the device), each K/V row is loaded once
// for all H / Hkv query heads of its group, and the groups' partials are merged in the shared
// memory of a thread-block cluster (when one cluster holds every split a max_context can have: up to
// 16) or by the last block of the group to finish. D in {64, 80, 96, 128, 256}, H / Hkv in 1..16
// (more than 8 query heads per kv head, 4 at D = 256, are served by several blocks per kv head, each
// streaming its keys), Hkv x those blocks <= 256 (attention_supported).
// The grid is the call's plan (plan_attention): the splits s_max, fixed by M and the capacity the grid
// is planned for, and the blocks per cluster (1: a plain launch, the splits merged through the
// scratch; cluster_merge = false plans that for every shape, the same bits).
// Scratch contract (every attention entry point): the scratch starts with merge counters that
// must be ZERO before the first call; every call leaves them zero again (nothing to do between
// calls or graph replays, and calls of any B, M and capacity may share one scratch sized for the
// largest). A caller that allocates its own scratch clears it once with attention_scratch_clear
// (zeroes the counters only, on `stream`; the rest needs no initial value).
constexpr int kMaxAttnGroup = 16;  // the most query heads per kv head (H / Hkv)
// Whether every attention launcher (attention, attention_batched, attention_paged) runs head_dim D
// with `group` = H / Hkv query heads per kv head.
bool attention_supported(int D, int group);
size_t attention_scratch_bytes(int M, int H, int D, int max_context);
struct AttnPlan {
  int M, H, Hkv, D, capacity;  // the call's shape; capacity: the keys the grid is planned for
  int splits;                  // s_max: the most splits of one query row's keys (grid.y before padding)
  int cluster;                 // blocks per thread-block cluster (1: no cluster, merge through the scratch)
  // Each of the M (<= kMaxAttnRowsAsSteps) rows split as a decode step at its position splits its keys
  // (its own key count, a decode step's s_max), so row m is bit-identical to that decode step; a chunk's
  // plan otherwise shares one split of the last row's keys among its rows (s_max = 128 / M), which
  // matches the decode step's only while every split is one K/V step (up to ~32 x 128 / M keys).
  bool rows_as_steps = false;
  // The decode step's attention on the QKV product's raw row (attention_qkv): M = 1.
  bool qkv_in = false;
  // Query-head ratios 4, 6 and 8 at head_dim <= 128 on two blocks per kv head of half the heads (ratios 5
  // and 7 always are), at most 32 splits (attention_decode.cu's kHalvedMaxSplits): every path of a model
  // the step plan halves (StepPlan::attn_halved), so they keep one set of bits.
  bool halved = false;
};
constexpr int kMaxAttnRowsAsSteps = 16;
AttnPlan plan_attention(int M, int H, int Hkv, int D, int capacity, bool cluster_merge = true,
                        bool rows_as_steps = false, bool qkv_in = false, bool halved = false);
const char* attention_merge_name(const AttnPlan& plan);  // "cluster", "scratch" or "none" (one split)
// The kernel instance a plan launches, as its symbol reads: "attention_kernel<HeadMapped<RopedKV>, 128, 2, 1>".
std::string attention_instance_name(const AttnPlan& plan);
// Blocks per kv head of the plan's grid: 1, or 2+ where a kv head's query heads run on several blocks
// (ratios 5 and 7, a halved plan's 4..8, ratios past a block's rows).
int attention_blocks_per_kv_head(const AttnPlan& plan);
void attention_scratch_clear(void* scratch, size_t scratch_bytes, cudaStream_t stream);
// early: the previous kernel lets this one launch only after its own PDL wait (the decode QKV GEMV
// does), so *pos and the cache rows below it may be read before this kernel's wait (see the kernel).
// f16_overflow (may be null): out is fp16 instead of bf16, and *f16_overflow = 1 when a value's
// magnitude passes kF16Max.
void attention(const AttnPlan& plan, const bf16* q, const bf16* k_cache, const bf16* v_cache, const int32_t* pos, int M,
               int H, int Hkv, int D, int max_context, float scale, void* scratch, void* out, cudaStream_t stream,
               bool early = false, int* f16_overflow = nullptr);
// The decode step (M = 1) of a model whose QKV product stores its row raw (StepPlan::fused_qkv false:
// Qwen3's per-head q/k RMSNorm): rope_kv_append(M = 1, in.extras) and attention() in one launch, the
// same bits. Each block makes its query heads and, when its keys hold *pos, its kv head's new key and
// value row (bias, norms, RoPE) from in.qkv after its PDL wait, and the cache row at *pos is written
// for later steps; no q is stored. plan: plan_attention(1, H, Hkv, D, max_context, merge, false, true, halved).
struct AttnQkvIn {
  const float* qkv;       // fp32 [(H + 2 Hkv) D]: the QKV product's row (before bias, norms, RoPE)
  const float* inv_freq;  // [D / 2]
  QkvExtras extras;       // bias, q_norm / k_norm, eps (as rope_kv_append takes them)
};
// early: as attention()'s (the QKV GEMV's plan has late_trigger): *pos, the cos / sin of its angles
// and the cache rows below it are taken before the wait, only the raw row after it.
void attention_qkv(const AttnPlan& plan, const AttnQkvIn& in, bf16* k_cache, bf16* v_cache, const int32_t* pos, int H,
                   int Hkv, int D, int max_context, float scale, void* scratch, void* out, cudaStream_t stream,
                   bool early = false, int* f16_overflow = nullptr);

// ---------------------------------------------------------------------------------------
// attention_prefill.cu: the causal GQA attention of attention() for a prefill chunk of M query
// tokens, on tensor cores. Query m (at position *pos + m) attends to cache rows [0, *pos + m]; rows at
// or past *pos + M are never read. q bf16 [M, H, D] (rotated), caches bf16 [max_context, Hkv, D], out
// bf16 [M, H, D]. One block per (tile of packed (query token, head) rows of one kv head, kv head) walks
// all the keys its rows see; where those blocks leave SMs idle deep in a context (a short chunk after a long
// prompt, or a last wave only partly filled), the Wgmma kernel splits each block's keys over `splits` blocks
// that write unnormalized partials to a scratch, merged by a second kernel (its size:
// attention_prefill_scratch_bytes, bounded by the SMs, never by the context). Two kernels:
//  - Mma (attention_prefill.cu, FlashAttention-2 style: mma.sync bf16, fp32 accumulation, online
//    softmax in registers): tiles of 64 rows; D in {64, 80, 96, 128};
//  - Wgmma (attention_prefill_sm90.cu, warpgroup MMA on sm_90a): tiles of 128 rows, two warpgroups
//    sharing 128-key tiles; D = 128 only.
// H / Hkv in 1..16. The step plan picks it for chunks of at least prefill_attn_min_rows rows, and for a
// prompt's chunks of 2 or more after prefill_attn_deep_prior cached keys (step_plan.h); decode (M = 1) and a
// verify's rows keep attention().
constexpr int kMaxPrefillGroup = 16;                // query heads per kv head
enum class PrefillAttnKernel { Auto, Mma, Wgmma };  // Auto: Wgmma where it takes D, else Mma
struct PrefillAttnPlan {
  int M, H, Hkv, D;          // the call's shape
  PrefillAttnKernel kernel;  // never Auto
  int tiles;                 // grid.x: tiles of packed rows per kv head (grid.y = Hkv): 64 (Mma) or 128 rows
  int key_groups;            // Mma: groups of 4 warps per block, each taking every key_groups-th key tile (1 or 2)
  int threads;               // Mma: 128 * key_groups; Wgmma: 256
  size_t smem;               // dynamic shared memory per block
  int splits;                // Wgmma: blocks per (tile, kv head) sharing its key tiles (grid.z); 1: no scratch
};
// sm_count: the SMs of the GPU that runs it (the step plan's); it picks the Mma kernel's key groups
// (0: one group) and the Wgmma kernel's splits. prior: the keys cached before the chunk (the chunk's first
// position), which the splits follow: of 1..kPrefillAttnMaxSplits with at least kPrefillAttnSplitTiles key
// tiles a split and tiles x Hkv x splits <= kPrefillAttnSplitWaves x sm_count, the fewest of the least cost
// prefill_attn_split_cost (docs/design/attention_prefill.md, "Splits").
constexpr int kPrefillAttnMaxSplits = 32, kPrefillAttnSplitTiles = 2, kPrefillAttnSplitWaves = 4;
// The cost of `splits` splits of `blocks` blocks whose longest walks `key_tiles` key tiles, in units of
// 1 / (2 sm_count) of one block's pass over a key tile: the waves of split blocks, each walking its run of
// tiles and writing its partials (one tile's time), the merge reading a partial of every split block (one
// tile's time a split block, spread over the SMs) and its launch (half a tile). Fitted to the 3B and 8B
// shapes' splits on an H200 (132 SMs; 64..1024 rows after 512..16384 keys): the pick is within 3.5% of the
// fastest measured split count but at two of 56 points (7% and 10%).
constexpr long long prefill_attn_split_cost(int blocks, int key_tiles, int splits, int sm_count) {
  const long long waves = (static_cast<long long>(blocks) * splits + sm_count - 1) / sm_count;
  const long long run = (key_tiles + splits - 1) / splits;
  if (splits == 1) return 2LL * sm_count * waves * run;
  return 2LL * sm_count * waves * (run + 1) + 2LL * splits * blocks + sm_count;
}
PrefillAttnPlan plan_attention_prefill(int M, int H, int Hkv, int D, int sm_count,
                                       PrefillAttnKernel kernel = PrefillAttnKernel::Auto, int prior = 0);
// The scratch a plan's partials take (0 without splits): fp32 O, max and sum per packed row and split; and
// the most any chunk's plan takes on sm_count SMs (kPrefillAttnSplitWaves x sm_count blocks of 128 rows).
size_t attention_prefill_scratch_bytes(const PrefillAttnPlan& plan);
size_t attention_prefill_scratch_max(int D, int sm_count);
// Whether attention_prefill is built for this head_dim and query heads per KV head; whether its Wgmma
// kernel takes this head_dim (Auto's rule).
bool attention_prefill_supported(int D, int group);
bool attention_prefill_wgmma_takes(int D);
// "attention_prefill<D=128, KG=2>" or "attention_prefill_wgmma<D=128>"
std::string attention_prefill_name(const PrefillAttnPlan& plan);
// scratch: attention_prefill_scratch_bytes(plan) bytes (may be null when that is 0); no state is kept in it.
void attention_prefill(const PrefillAttnPlan& plan, const bf16* q, const bf16* k_cache, const bf16* v_cache,
                       const int32_t* pos, int M, int H, int Hkv, int D, int max_context, float scale, bf16* out,
                       cudaStream_t stream, void* scratch = nullptr);

// ---------------------------------------------------------------------------------------
// Paged and batched decode attention (the sandbox, docs/SANDBOX.md): the same kernel as
// attention() with another KV addressing policy (STYLE.md habit 11), the same scratch contract
// (attention_scratch_clear once after allocating). B sequences, M
// query tokens each (decode: M = 1): q bf16 [B * M, H, D] (row b * M + m), out bf16 [B * M, H, D]
// (attention_paged given f16_overflow: fp16, as attention()'s).
// lens int32 [B] (device): the keys sequence b holds INCLUDING this call's M tokens, so its query m
// sits at position lens[b] - M + m and sees keys [0, lens[b] - M + m]. Requires M <= lens[b].
//  - attention_paged: caches are pools bf16 [num_blocks, block_size, Hkv, D]; key p of sequence b
//    is in block block_tables[b * max_blocks + p / block_size], slot p % block_size. block_size a
//    power of two in [8, 256]; lens[b] <= max_blocks * block_size. head_dim 64 or 128 (the sandbox's
//    model's; each further one would cost compile time), H / Hkv in 1..16.
//  - attention_batched: contiguous caches bf16 [B, capacity, Hkv, D] (the paging-free baseline); the
//    shapes of attention().
size_t attention_paged_scratch_bytes(int B, int M, int H, int D, int max_blocks, int block_size);
void attention_paged(const bf16* q, const bf16* k_pool, const bf16* v_pool, const int32_t* block_tables,
                     const int32_t* lens, int B, int M, int H, int Hkv, int D, int block_size, int num_blocks,
                     int max_blocks, float scale, void* scratch, void* out, cudaStream_t stream,
                     int* f16_overflow = nullptr);
size_t attention_batched_scratch_bytes(int B, int M, int H, int D, int capacity);
void attention_batched(const bf16* q, const bf16* k_cache, const bf16* v_cache, const int32_t* lens, int B, int M,
                       int H, int Hkv, int D, int capacity, float scale, void* scratch, bf16* out, cudaStream_t stream);

// rope.cu, slot-addressed variant of rope_kv_append (the same kernel, another row policy): token
// row m is at position positions[m] and its K / V go to row slots[m] of k_pool / v_pool
// ([num_slots, Hkv, D] viewed flat; for a paged pool slot = block * block_size + offset). A slot
// outside [0, num_slots) writes nothing (q is still rotated). positions, slots int32 [M] (device).
void rope_kv_append_slots(const float* qkv, const float* inv_freq, const int32_t* positions, const int32_t* slots,
                          int M, int H, int Hkv, int D, long long num_slots, bf16* q_out, bf16* k_pool, bf16* v_pool,
                          cudaStream_t stream, const QkvExtras& extras = {});

// ---------------------------------------------------------------------------------------
// elementwise.cu: small ops the fused paths do not cover.
void add_inplace(float* x, const float* y, int n, cudaStream_t stream);  // x += y
// *flag = 1 when x[0, n) holds no NaN and no infinity, else 0 (one block; flag may be mapped host memory).
void all_finite(const float* x, int n, int32_t* flag, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// sampling.cu: one token from fp32 logits [vocab], entirely on the device.
// Parameters live in device memory so one captured graph serves any settings.
struct SamplingConfig {
  float temperature;  // 0 = greedy (argmax, lowest index on ties)
  int32_t top_k;      // 0 = off
  float top_p;        // 1 = off
  uint32_t pad_;
  uint64_t seed;  // with the position, keys a counter-based RNG: same seed, same tokens
};
size_t sampling_scratch_bytes(int vocab);
// Reads *pos (device) as the RNG counter; writes the token to *token_out (device).
void sample(const float* logits, int vocab, const SamplingConfig* cfg, const int32_t* pos, void* scratch,
            int32_t* token_out, cudaStream_t stream);
// The end of a decode step, done by the sampler once the token is drawn: ring[pos[0] % ring_size] =
// token and ring[ring_size + pos[0] % ring_size] = *f16_overflow (stores to mapped host memory,
// fenced; the flag then cleared), pos[0..1] advanced by one, and the next step's input row
// x[0..d) = float(embed[token]).
struct StepEnd {
  int32_t* pos;   // [2]: pos[0] tokens in the cache, pos[1] = pos[0] + 1 (the RNG counter)
  int32_t* ring;  // [2 ring_size]
  int ring_size;
  int32_t* f16_overflow;  // the step's flag (kF16Max)
  const bf16* embed;      // [vocab, d]
  int d;
  float* x;
};
// sample() with the RNG counter pos[1], then `end`. block_best (greedy only; may be null with
// n_best = 0): the head's per-block maxima (gemv_w8a16_rmsnorm_argmax); with them a greedy draw
// reduces n_best values instead of reading the logits (the same token).
// It reads *cfg and pos[0] before its PDL wait (pdl.cuh): launch it where no kernel still running
// may write them, as the decode step does (the step's QKV launches triggered only after their waits,
// so everything before the last of them has completed) or after a synchronizing copy.
void sample_step(const float* logits, int vocab, const uint64_t* block_best, int n_best, const SamplingConfig* cfg,
                 int32_t* token_out, const StepEnd& end, cudaStream_t stream);

// out[r] = the greedy token of logits[r, :] (fp32 [rows, vocab]): the argmax, the lower index on ties
// (the sampler's choice at temperature 0), or -1 when the row holds a NaN or an infinity. A plain
// launch: it starts after everything before it on the stream. out may be mapped host memory.
void argmax_rows(const float* logits, int rows, int vocab, int32_t* out, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// stream_read.cu: the read-bandwidth ceiling. Reads n_bytes (multiple of 16) once with 16-byte
// loads and writes a tiny checksum to sink[0] so the reads cannot be elided.
void stream_read(const void* data, size_t n_bytes, uint32_t* sink, cudaStream_t stream);

// The in-kernel trace (trace.cuh): whether this build records it, its per-SM regions, the size of
// a record, and pointing the GEMV and attention kernels at a buffer of trace_max_sms() regions of
// per_sm records (recs = nullptr: recording off). Only a build with ATOMFLOW_TRACE can be armed.
bool trace_built();
unsigned trace_max_sms();
size_t trace_record_bytes();
void trace_arm(void* recs, unsigned* counts, unsigned per_sm);

}  // namespace atomflow::kernels

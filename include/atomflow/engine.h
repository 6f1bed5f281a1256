// The single-stream engine: one model in one arena, prefill in chunks, and a decode step
// captured once as a CUDA graph that reads its position and input token from device memory.
//
// State the host mirrors: position() = tokens in the KV cache once every enqueued step has run.
// Pipelined generation: begin(token) sets the first input token; enqueue(n) launches n decode
// steps without waiting (each step samples on the device, and the sampled token is the next
// step's input); wait(n) returns the sampled tokens of the oldest n steps, read from a small
// ring in mapped pinned memory (-1 for a step whose logits, holding a NaN or an Inf, gave no
// draw). Not copyable; every public method takes an internal lock.
//
// fp16 activations: a decode step writes attention's and SwiGLU's outputs in fp16 (kernels.h), and
// its end copies the overflow flag into the ring beside the token. A step whose flag is set never
// gives its token or logits: the engine switches to bf16 activations for good (recapturing the
// graphs), rolls the position back to that step and runs it, and every step enqueued after it,
// again. PlanOptions::f16_activations = false decodes in bf16 from the start.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "atomflow/arena.h"
#include "atomflow/common.h"
#include "atomflow/kernels.h"
#include "atomflow/loader.h"
#include "atomflow/spec.h"
#include "atomflow/step_plan.h"

namespace atomflow {

struct EngineOptions {
  int max_context = 0;  // KV cache rows
  // Rows per prefill pass (at most max_context); sizes the activation buffers. 0: the step plan's default
  // for the model (StepPlan::prefill_chunk_for).
  int prefill_chunk = 0;
  bool verbose = true;  // print the arena plan and the load time to stderr
  PlanOptions plan;     // eager, activation precision and the schedule's overrides (step_plan.h)
};

class Engine {
 public:
  static constexpr int kRingSize = 8;  // decode steps that may be in flight at once

  // Plans the arena, checks it fits, allocates it, loads the weights, captures the graph.
  // inv_freq: fp32 [head_dim / 2]. Throws std::invalid_argument on a bad table or argument,
  // std::runtime_error when memory is short, CudaError on a CUDA failure.
  Engine(const std::string& path, const ModelSpec& spec, const std::vector<TensorInfo>& tensors,
         const std::vector<float>& inv_freq, const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Appends ids[0..n) at the current position; writes the last token's logits (fp32 [vocab]).
  void prefill(const int32_t* ids, int n, float* logits);
  // prefill() of one chunk (n <= prefill_chunk) that writes every row's logits, fp32 [n, vocab]. A chunk of
  // up to small_m_max_rows rows runs its rows as decode steps in the engine's activations, each row
  // bit-identical to a decode step's (fp16 while f16_activations(): where one passes fp16's range, the
  // engine moves to bf16, as a decode step would, and the chunk runs again in bf16). The heads: an FP8 one
  // once per kLogitRows rows on the small-M GEMV (RMSNorm fused: its rows are the decode head's bits), a
  // bf16 one once per row.
  void prefill_rows(const int32_t* ids, int n, float* logits);
  // Speculative verification (atomflow/speculate.py): a chunk of n <= kLogitRows rows whose rows are
  // decode steps' bits in the engine's activations (fp16 while f16_activations(): attention's and SwiGLU's
  // outputs fp16 with the overflow flag, o and down on fp16 x, as the decode step), then each row's greedy
  // token on the device (argmax, the lower index on ties: the decode step's greedy choice); -1 for a row
  // with a NaN or +Inf or only -Inf (the sampler's rule). Only the n tokens come back. false: an fp16
  // activation passed fp16's range; nothing was appended (the position is as before) and no token comes
  // back: decode steps go on from there, the overflowing one reruns in bf16 as plain decoding does.
  bool verify_greedy(const int32_t* ids, int n, int32_t* tokens);
  // Rows of logits the engine holds at once (buf_.logits is [kLogitRows, vocab]; decode uses row 0).
  static constexpr int kLogitRows = StepPlan::kLogitRows;
  // Feeds one token at the current position, runs the decode step, writes its logits.
  void decode(int32_t token, float* logits);

  void set_position(int position);  // roll back: 0 <= position <= position()
  void reset() { set_position(0); }
  void set_sampling(float temperature, int top_k, float top_p, uint64_t seed);

  void begin(int32_t token);
  // Pipelined generation from a prompt: prefills ids[0..n) at the current position and enqueues, as
  // the first step in flight, the sample of its last row (the decode step's sampler, RNG counter,
  // ring slot and fp16 overflow rule, as if that row had been fed to a decode step): wait(1) returns
  // that token, and on the device it is already the input of the next enqueued step. The prompt's
  // last token needs no decode step of its own. Once its token was waited for, prompt_finite() says
  // whether the row's logits are all finite (checked on the device: the row never crosses to the host on
  // this path), and prompt_logits() copies the row, until a later step overwrites it (then it throws).
  void begin_prompt(const int32_t* ids, int n);
  bool prompt_finite() const;
  void prompt_logits(float* logits);  // fp32 [vocab]
  void enqueue(int n);
  std::vector<int32_t> wait(int n);
  // Waits for all device work. Steps enqueued and not yet waited for are dropped (their tokens
  // are not returned), so position() is then settled and may be rolled back.
  void synchronize();

  // Probe mode, for the validator: the same launches run eagerly (never the graph), and after
  // each probe point the named activation goes to `sink` as fp32 [rows, dim] (names as in
  // atomflow/validate.py: attn_norm, attn_out, resid_mid, mlp_out, layer_out per layer;
  // final_norm and logits for the last row). Costs nothing when not used.
  using ProbeSink = std::function<void(const std::string& name, int layer, const std::vector<float>& rows, int dim)>;
  void prefill_probed(const int32_t* ids, int n, float* logits, const ProbeSink& sink);
  void decode_probed(int32_t token, float* logits, const ProbeSink& sink);

  // Profile mode, for `atomflow profile`: `steps` decode steps from `token` at the current
  // position (they advance it, like decode()), each timed on the device by CUDA events and
  // returned as (label, layer, microseconds) in launch order (layer -1 outside the layer stack).
  //   Kernels:   eager, an event after each launch group (static labels: "embedding",
  //              "gemv_qkv+norm", "rope_kv_append", "attention" (split + merge),
  //              "gemv_o", "gemv_gate_up+norm", "gemv_down", "lm_head" (final norm fused),
  //              "sample", "finish"); one entry per group.
  //   EagerStep: eager, one ("step", -1, us) entry per step (no events inside: PDL overlap kept).
  //   GraphStep: the captured graph, one ("step", -1, us) entry per step.
  // Each step's launches are queued behind a gate kernel the host opens once the step is fully
  // enqueued, so the times are the GPU's, not the host's launch rate. Events and the gate are
  // made at load: no allocation here.
  enum class ProfileMode { Kernels, EagerStep, GraphStep };
  struct ProfileEntry {
    const char* label;  // static storage
    int layer;
    float us;
  };
  std::vector<ProfileEntry> profile_decode(int32_t token, int steps, ProfileMode mode);

  const ModelSpec& spec() const { return spec_; }
  int max_context() const { return opt_.max_context; }
  int prefill_chunk() const { return opt_.prefill_chunk; }  // rows per prefill pass (at most max_context)
  int position() const { return host_pos_; }
  int in_flight() const { return in_flight_; }
  // Decode steps launched so far (the load's warm-up step included) with the attention grid planned
  // for StepPlan::kShortKeys keys (the short graph, or its launches when eager), and with the grid planned
  // for max_context.
  long long short_grid_steps() const { return short_grid_steps_; }
  // Whether decode steps write fp16 activations (false from load without PlanOptions::f16_activations,
  // or once a step overflowed fp16).
  bool f16_activations() const { return f16_acts_; }
  long long long_grid_steps() const { return long_grid_steps_; }
  int device_allocations() const { return allocations_; }
  double load_seconds() const { return load_seconds_; }
  bool graph_enabled() const { return graph_exec_ != nullptr; }
  // Verify chunks (verify_greedy) captured as CUDA graphs so far: one per row count 2..kLogitRows, on its
  // first use with graphs on, in the engine's activations (dropped when it moves to bf16).
  int verify_graphs() const;
  // (group, bytes) for weights, kv, activations, scratch, then ("total", bytes).
  std::vector<std::pair<std::string, size_t>> plan() const;
  // Every launch decision of the decode step, made at load (step_plan.h).
  const StepPlan& step_plan() const { return step_plan_; }

 private:
  // Device pointers carved out of the arena.
  struct LayerPtrs {
    const bf16* attn_norm;
    const uint8_t* wqkv;
    const float* wqkv_scale;
    const uint8_t* wo;
    const float* wo_scale;
    const bf16* mlp_norm;
    const uint8_t* w13;
    const float* w13_scale;
    const uint8_t* w2;
    const float* w2_scale;
    bf16* k_cache;
    bf16* v_cache;
    const float* bqkv;   // attention_bias only, else null
    const bf16* q_norm;  // qk_norm only, else null
    const bf16* k_norm;
    // The scales transposed for the sm90 prefill GEMM ([ceil(K / 128), N]); null when the plan does not run it.
    const float* wqkv_scale_gn = nullptr;
    const float* wo_scale_gn = nullptr;
    const float* w13_scale_gn = nullptr;
    const float* w2_scale_gn = nullptr;
  };
  struct Buffers {
    const bf16* embed;
    const bf16* final_norm;
    const void* lm_head;         // uint8_t FP8 or bf16
    const float* lm_head_scale;  // FP8 head only
    const float* inv_freq;
    std::vector<LayerPtrs> layers;
    float* x;
    f16* xn;  // RMSNorm output (fp16: kernels.h)
    float* qkv;
    bf16* q;
    void* attn_out;  // 16-bit: bf16 in prefill, in decode fp16 while f16_acts_ (kernels.h)
    void* ffn;       // typed as attn_out
    float* logits;
    int32_t* ids;
    void* attn_scratch;
    void* attn_prefill_scratch;  // the prefill attention's split partials (null: no wgmma prefill attention)
    void* sample_scratch;
    unsigned* gemv_tickets;  // the gate/up GEMV's counters (kernels.h), zeroed at load
    float* norm_ss;          // a skinny chunk's split RMSNorm: the products' sums of squares (kernels.h)
    void* gemm_ws;           // the sm90 prefill GEMM's workspace (kernels.h), gemm_ws_bytes
    size_t gemm_ws_bytes;
    uint64_t* head_best;    // the FP8 head's per-block argmax keys, for the greedy sampler (kernels.h)
    int head_best_n;        // their count (0: no FP8 head)
    int32_t* pos;           // [2]: pos[0] tokens in the cache, pos[1] = pos[0] + 1 (step_kernels.h)
    int32_t* sample_pos;    // &pos[1]: the RNG counter of the token sampled after pos[0]
    int32_t* token;         // the step's input token; its embedding is in x[0] when a step starts
    int32_t* f16_overflow;  // set by a step's fp16 activations past fp16's range, cleared by its end
    kernels::SamplingConfig* sampling;
  };

  // forward.cu: the launches, enqueued on stream_ (graph-capturable: no sync, no allocation).
  void enqueue_layers(int rows, int attn_keys, int prior = 0);
  // scales_gn: the scales transposed for the sm90 GEMM (LayerPtrs), or null.
  // norm_in: a skinny chunk's split RMSNorm (StepPlan::skinny_norm): buf_.xn holds bf16(x * norm) and the
  // product normalizes its sums (kernels.h, SkinnyNormIn), no rmsnorm launch.
  void normed_linear(const bf16* norm, const char* probe_name, int layer, const kernels::GemvPlan& fused,
                     const kernels::GemvPlan& probed, const uint8_t* w, const float* scales, const float* scales_gn,
                     int rows, int N, kernels::Epilogue ep, void* out, int* f16_overflow = nullptr,
                     const kernels::SkinnyNormIn* norm_in = nullptr);
  void enqueue_head(int row);
  void enqueue_decode_step(int attn_keys);                                // the keys its attention grid is planned for
  void enqueue_prefill_chunk(int offset, int rows, bool advance = true);  // advance: *pos += rows
  int prompt_chunk_rows(int offset, int n) const;                         // never a last chunk of one row
  void enqueue_sample();  // the decode step's sampler and step end on buf_.logits row 0

  // probes.cu: what a probe point reads; X_DELTA is x minus the last snapshot (the output of a
  // projection whose epilogue added it into the residual stream).
  enum class ProbeSrc { XN, X, X_DELTA, LOGITS };
  void probe_snapshot(int rows);
  void probe_point(const char* name, int layer, ProbeSrc src, int rows);

  // profiler.cu: mark() records the event that ends a launch group; a no-op outside Kernels mode.
  void init_profiler();
  void mark(const char* label, int layer);
  void release_profiler() noexcept;

  // engine.cu
  void init(const std::string& path, const std::vector<TensorInfo>& tensors, const std::vector<float>& inv_freq);
  void capture_graph();
  cudaGraphExec_t capture_step(int attn_keys);
  void destroy_verify_graphs();
  // Stream capture of enqueue()'s launches into an instantiated, uploaded graph; `what` names it in errors.
  cudaGraphExec_t capture(const std::string& name, const std::function<void()>& enqueue, size_t* nodes);
  void enqueue_verify(int n);  // a verify chunk of n rows already in buf_.ids: layers, heads, greedy tokens
  // A chunk's fp16 overflow flag: copied (and cleared) into the mapped slot after a verify's tokens, then,
  // once the stream has synced, read (and cleared) there.
  void enqueue_take_overflow();
  bool took_overflow();
  void launch_step();                        // one decode step: the graph, or its launches when eager
  void enqueue_steps(int n);                 // enqueue() without the lock
  bool step_overflowed(int position) const;  // the ring's flag of the step at `position` (it has run)
  // bf16 activations from now on: the steps in flight dropped, the graphs captured again (verify graphs on
  // their next use), the overflow flag cleared; `what` overflowed (the verbose message names it).
  void move_to_bf16(const std::string& what);
  // A step at `position` overflowed fp16: move_to_bf16, the position rolled back to it and `input` set as
  // its token. The caller runs the step (and any after it) again.
  void rerun_in_bf16(int position, int32_t input);
  void require_idle(const char* what) const;
  void check_token(int32_t token) const;
  void set_token(int32_t token);  // the next step's input: *token and its embedding in x[0]
  void copy_logits_out(float* logits);
  void enqueue_head_rows(int first, int n);       // logits of x rows first .. first + n - 1 into buf_.logits [n, vocab]
  void stage_prefill(const int32_t* ids, int n);  // prefill's checks, and the ids copied to the device
  void release() noexcept;

  ModelSpec spec_;
  EngineOptions opt_;
  Arena arena_;
  std::vector<std::pair<std::string, size_t>> plan_;
  Buffers buf_{};

  cudaStream_t stream_ = nullptr;
  cudaGraphExec_t graph_exec_ = nullptr;  // the decode step; nullptr: eager
  StepPlan step_plan_;                    // made at load, before the arena (it sizes the head's argmax buffer)
  // Steps whose keys fit step_plan_.short_keys replay short_graph_, whose attention grid is planned
  // for that many keys instead of max_context: fewer blocks that only exit, clusters that hold every
  // split; the same split count per position, so the same bits (forward.cu). Eager steps plan their
  // grid the same way.
  cudaGraphExec_t short_graph_ = nullptr;
  cudaGraphExec_t verify_graphs_[kLogitRows + 1] = {};    // [n]: the verify chunk of n rows; null: eager
  long long short_grid_steps_ = 0, long_grid_steps_ = 0;  // launch_step()'s choices
  bool f16_acts_ = true;  // decode steps write fp16 activations (engine comment at the top)
  // The input token of each step in flight (ring order), for a rerun in bf16; kUnknown: the output of
  // the step before it, filled in when wait() reads that one. next_input_: begin()'s token, for the
  // next step enqueued; last_output_: the last token wait() returned.
  static constexpr int32_t kUnknown = -1;
  int32_t step_input_[kRingSize] = {};
  int32_t next_input_ = kUnknown, last_output_ = kUnknown;
  cudaEvent_t step_done_[kRingSize] = {};
  // mapped pinned [2 kRingSize]: the step's end writes its token and its overflow flag (publish_step),
  // wait() reads them
  int32_t* ring_host_ = nullptr;
  int32_t* ring_dev_ = nullptr;   // the same memory as the device sees it
  float* logits_host_ = nullptr;  // pinned [vocab], for the D2H of the logits
  // After the ring and the verify's slots: begin_prompt's row is all finite (all_finite writes it).
  static constexpr int kPromptFiniteSlot = 2 * kRingSize + kLogitRows + 1;
  // Heads enqueued (each overwrites buf_.logits); begin_prompt's count after its head, for prompt_logits().
  long long logits_writes_ = 0, prompt_mark_ = -1;

  int host_pos_ = 0;     // position once every enqueued step has run
  int in_flight_ = 0;    // enqueued steps not yet waited for
  int oldest_ = 0;       // step_done_ index of the oldest of them
  int oldest_pos_ = 0;   // the input position of the oldest of them
  int allocations_ = 0;  // every cudaMalloc / cudaHostAlloc the engine made
  double load_seconds_ = 0;
  const ProbeSink* probe_ = nullptr;  // set only inside prefill_probed / decode_probed
  // Set only while a chunk whose rows run as decode steps (a verify's, prefill_rows' small-M ones) enqueues
  // its layers: they take the decode step's activations (enqueue_layers).
  bool step_rows_ = false;
  struct StepRows {  // step_rows_ = on for one scope
    bool& flag;
    StepRows(bool& f, bool on) : flag(f) { flag = on; }
    ~StepRows() { flag = false; }
  };
  std::vector<float> probe_x_;  // snapshot of x for the X_DELTA probes
  // A probed decode step's points, given to the sink once it has succeeded: a step rerun in bf16
  // (rerun_in_bf16) drops those of its first run. nullptr: straight to the sink (prefill).
  struct ProbeRecord {
    std::string name;
    int layer;
    std::vector<float> rows;
    int dim;
  };
  std::vector<ProbeRecord>* probe_records_ = nullptr;
  std::vector<std::string> layer_names_;  // "layer 0", ...: NVTX range names, made at load

  struct ProfileMark {
    const char* label;
    int layer;
  };
  bool profiling_ = false;                // set only inside profile_decode(Kernels)
  std::vector<cudaEvent_t> prof_events_;  // [0] starts a step, [i + 1] ends prof_marks_[i]
  std::vector<ProfileMark> prof_marks_;
  size_t prof_count_ = 0;         // marks recorded in the current step
  int32_t* gate_host_ = nullptr;  // mapped pinned: the host opens the gate here
  int32_t* gate_dev_ = nullptr;
  int32_t gate_ticket_ = 0;
  mutable std::mutex mu_;
};

}  // namespace atomflow

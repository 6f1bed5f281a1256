// The engine's life cycle (plan, allocate, load, capture, free) and its public API: prefill,
// decode, position control, sampling settings and pipelined generation over a pinned token ring.
#include "atomflow/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "layout.h"
#include "nvtx.h"
#include "step_kernels.h"

namespace atomflow {

namespace {

// Free device memory left beyond the arena for what the driver allocates on our behalf
// (kernel images, the instantiated graph, the sampling and attention launch state).
constexpr size_t kHeadroom = size_t(128) << 20;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

kernels::SamplingConfig greedy() { return kernels::SamplingConfig{0.0f, 0, 1.0f, 0u, 0ull}; }

// Throws when the arena does not fit, naming the largest max_context that would.
void check_fits(const ModelSpec& spec, const ModelTensors& tensors, const Layout& layout, int max_context,
                int prefill_chunk, int head_blocks, bool prefill_scales, size_t prefill_attn_scratch) {
  size_t free_bytes = 0, total_bytes = 0;
  AF_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const size_t needed = layout.plan.total() + kHeadroom;
  if (needed <= free_bytes) return;
  auto fits = [&](int ctx) {
    return plan_layout(spec, tensors, ctx, prefill_chunk, head_blocks, prefill_scales, prefill_attn_scratch)
                   .plan.total() +
               kHeadroom <=
           free_bytes;
  };
  std::string msg = "not enough GPU memory: max_context " + std::to_string(max_context) + " needs " +
                    format_bytes(needed) + " (" + layout.plan.summary() + ", plus " + format_bytes(kHeadroom) +
                    " headroom), " + format_bytes(free_bytes) + " of " + format_bytes(total_bytes) + " is free; ";
  if (!fits(1)) throw std::runtime_error(msg + "the weights alone do not fit");
  int lo = 1, hi = max_context;  // fits(lo), !fits(hi)
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  throw std::runtime_error(msg + "the largest max_context that fits is " + std::to_string(lo));
}

}  // namespace

// ---------------------------------------------------------------------------------------
// life cycle

Engine::Engine(const std::string& path, const ModelSpec& spec, const std::vector<TensorInfo>& tensors,
               const std::vector<float>& inv_freq, const EngineOptions& options)
    : spec_(spec), opt_(options) {
  try {
    init(path, tensors, inv_freq);
  } catch (...) {
    release();  // the arena member frees itself; the raw handles are ours
    throw;
  }
}

Engine::~Engine() { release(); }

void Engine::init(const std::string& path, const std::vector<TensorInfo>& table, const std::vector<float>& inv_freq) {
  const ModelSpec& s = spec_;
  if (opt_.max_context < 1)
    throw std::invalid_argument("max_context must be >= 1, got " + std::to_string(opt_.max_context));
  if (opt_.prefill_chunk < 0)
    throw std::invalid_argument("prefill_chunk must be >= 1 (or 0: the model's default), got " +
                                std::to_string(opt_.prefill_chunk));
  if (inv_freq.size() != static_cast<size_t>(s.head_dim / 2))
    throw std::invalid_argument("inv_freq must hold head_dim / 2 = " + std::to_string(s.head_dim / 2) +
                                " values, got " + std::to_string(inv_freq.size()));
  AF_CHECK(s.vocab_size > 0 && s.hidden_size > 0 && s.intermediate_size > 0 && s.num_layers > 0 && s.num_heads > 0 &&
               s.num_kv_heads > 0,
           "every size in the model spec must be positive");
  AF_CHECK(s.num_heads % s.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  AF_CHECK(kernels::attention_supported(s.head_dim, s.num_heads / s.num_kv_heads),
           "head_dim must be one of 64, 80, 96, 128, 256 and num_heads / num_kv_heads in 1..16");
  // Multiples of 64: a size with K % 128 == 64 ends its rows in a tail scale group (kernels.h).
  AF_CHECK(s.hidden_size % 64 == 0 && s.intermediate_size % 64 == 0 && s.q_dim() % 64 == 0,
           "hidden_size, intermediate_size and num_heads * head_dim must be multiples of 64");

  for (int i = 0; i < s.num_layers; ++i) layer_names_.push_back("layer " + std::to_string(i));  // NVTX

  // Plan the launches, then the arena; check, allocate.
  step_plan_ = make_step_plan(s, opt_.max_context, opt_.plan);
  if (opt_.prefill_chunk == 0) opt_.prefill_chunk = step_plan_.prefill_chunk;
  // No chunk holds more rows than the cache: the activation buffers need no more.
  opt_.prefill_chunk = std::min(opt_.prefill_chunk, opt_.max_context);
  const int head_blocks = step_plan_.fp8_head ? step_plan_.head.blocks : 0;
  MappedFile file(path);
  const ModelTensors tensors = resolve_tensors(s, table, file.size());
  const bool prefill_scales = step_plan_.sm90_gemm_min_rows < StepPlan::kNever;
  // The prefill attention's split partials (kernels.h).
  const size_t prefill_attn_scratch =
      step_plan_.prefill_attn_splits() ? kernels::attention_prefill_scratch_max(s.head_dim, step_plan_.sm_count) : 0;
  const Layout layout =
      plan_layout(s, tensors, opt_.max_context, opt_.prefill_chunk, head_blocks, prefill_scales, prefill_attn_scratch);
  check_fits(s, tensors, layout, opt_.max_context, opt_.prefill_chunk, head_blocks, prefill_scales,
             prefill_attn_scratch);
  if (opt_.verbose) std::fprintf(stderr, "atomflow: %s\n", layout.plan.summary().c_str());
  arena_ = Arena(layout.plan.total());
  ++allocations_;
  plan_ = layout.plan.groups();
  plan_.emplace_back("total", layout.plan.total());

  // Carve.
  buf_.embed = arena_.at<bf16>(layout.embed);
  buf_.final_norm = arena_.at<bf16>(layout.final_norm);
  buf_.lm_head = arena_.at<void>(layout.lm_head);
  buf_.lm_head_scale = s.lm_head_fp8 ? arena_.at<float>(layout.lm_head_scale) : nullptr;
  buf_.inv_freq = arena_.at<float>(layout.inv_freq);
  for (const LayerSlots& l : layout.layers) {
    buf_.layers.push_back(LayerPtrs{
        arena_.at<bf16>(l.attn_norm), arena_.at<uint8_t>(l.wqkv), arena_.at<float>(l.wqkv_scale),
        arena_.at<uint8_t>(l.wo), arena_.at<float>(l.wo_scale), arena_.at<bf16>(l.mlp_norm), arena_.at<uint8_t>(l.w13),
        arena_.at<float>(l.w13_scale), arena_.at<uint8_t>(l.w2), arena_.at<float>(l.w2_scale),
        arena_.at<bf16>(l.k_cache), arena_.at<bf16>(l.v_cache), l.bqkv == kNoSlot ? nullptr : arena_.at<float>(l.bqkv),
        l.q_norm == kNoSlot ? nullptr : arena_.at<bf16>(l.q_norm),
        l.k_norm == kNoSlot ? nullptr : arena_.at<bf16>(l.k_norm)});
    const auto slot = [&](size_t off) { return off == kNoSlot ? nullptr : arena_.at<float>(off); };
    LayerPtrs& p = buf_.layers.back();
    p.wqkv_scale_gn = slot(l.wqkv_scale_gn);
    p.wo_scale_gn = slot(l.wo_scale_gn);
    p.w13_scale_gn = slot(l.w13_scale_gn);
    p.w2_scale_gn = slot(l.w2_scale_gn);
  }
  buf_.x = arena_.at<float>(layout.x);
  buf_.xn = arena_.at<f16>(layout.xn);
  buf_.qkv = arena_.at<float>(layout.qkv);
  buf_.q = arena_.at<bf16>(layout.q);
  buf_.attn_out = arena_.at<void>(layout.attn_out);
  buf_.ffn = arena_.at<void>(layout.ffn);
  buf_.logits = arena_.at<float>(layout.logits);
  buf_.ids = arena_.at<int32_t>(layout.ids);
  buf_.attn_scratch = arena_.at<void>(layout.attn_scratch);
  buf_.attn_prefill_scratch =
      layout.attn_prefill_scratch == kNoSlot ? nullptr : arena_.at<void>(layout.attn_prefill_scratch);
  buf_.sample_scratch = arena_.at<void>(layout.sample_scratch);
  buf_.gemv_tickets = arena_.at<unsigned>(layout.gemv_tickets);
  buf_.norm_ss = arena_.at<float>(layout.norm_ss);
  buf_.gemm_ws = arena_.at<void>(layout.gemm_ws);
  buf_.gemm_ws_bytes = layout.gemm_ws_bytes;
  buf_.head_best = arena_.at<uint64_t>(layout.head_best);
  buf_.head_best_n = layout.head_best_n;
  buf_.pos = arena_.at<int32_t>(layout.pos);
  buf_.sample_pos = buf_.pos + 1;
  buf_.token = arena_.at<int32_t>(layout.token);
  buf_.f16_overflow = arena_.at<int32_t>(layout.f16_overflow);
  buf_.sampling = arena_.at<kernels::SamplingConfig>(layout.sampling);

  // Load the weights. load_seconds counts file -> device only (staging buffers included).
  const auto t_load = std::chrono::steady_clock::now();
  std::vector<CopyJob> jobs;
  for (const auto& [t, offset] : layout.weight_slot)
    jobs.push_back(CopyJob{t->offset, t->nbytes, arena_.at<void>(offset)});
  copy_to_device(file, jobs, LoadOptions{}, allocations_);
  load_seconds_ = seconds_since(t_load);
  AF_CUDA_CHECK(cudaMemcpy(arena_.at<float>(layout.inv_freq), inv_freq.data(), inv_freq.size() * sizeof(float),
                           cudaMemcpyHostToDevice));
  // The sm90 prefill GEMM's scales, transposed once here instead of in every prefill chunk.
  if (prefill_scales) {
    const int d = s.hidden_size, f = s.intermediate_size;
    for (const LayerSlots& l : layout.layers) {
      const auto transpose = [&](size_t scales, size_t out, int N, int K) {
        kernels::gemm_w8a16_sm90_transpose_scales(arena_.at<float>(scales), N, K, arena_.at<float>(out), nullptr);
      };
      transpose(l.wqkv_scale, l.wqkv_scale_gn, s.qkv_dim(), d);
      transpose(l.wo_scale, l.wo_scale_gn, d, s.q_dim());
      transpose(l.w13_scale, l.w13_scale_gn, 2 * f, d);
      transpose(l.w2_scale, l.w2_scale_gn, d, f);
    }
    AF_CUDA_CHECK(cudaDeviceSynchronize());
  }
  if (opt_.verbose) {
    const size_t w = layout.plan.group_bytes("weights");
    std::fprintf(stderr, "atomflow: loaded %s of weights in %.2f s (%.2f GB/s)\n", format_bytes(w).c_str(),
                 load_seconds_, static_cast<double>(w) / 1e9 / std::max(load_seconds_, 1e-9));
  }

  // The stream every launch goes to, the per-step events, the pinned token ring and logits.
  AF_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  for (cudaEvent_t& e : step_done_) AF_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  // The ring (tokens and overflow flags, 2 x kRingSize), then kLogitRows tokens of a verify and its overflow
  // flag (enqueue_verify), then begin_prompt's finite flag (kPromptFiniteSlot).
  AF_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&ring_host_), (kPromptFiniteSlot + 1) * sizeof(int32_t),
                              cudaHostAllocMapped));
  ++allocations_;
  std::memset(ring_host_, 0, (kPromptFiniteSlot + 1) * sizeof(int32_t));
  AF_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ring_dev_), ring_host_, 0));
  AF_CUDA_CHECK(
      cudaHostAlloc(reinterpret_cast<void**>(&logits_host_), s.vocab_size * sizeof(float), cudaHostAllocDefault));
  ++allocations_;
  init_profiler();

  // Everything after the weights starts at zero: no stale NaN in a KV row or activation can
  // leak into a result even through a kernel that reads past what it was given.
  const size_t weights_end = layout.plan.group_bytes("weights");
  AF_CUDA_CHECK(cudaMemsetAsync(arena_.at<char>(weights_end), 0, layout.plan.total() - weights_end, stream_));
  step::write_pos(buf_.pos, 0, stream_);
  step::write_sampling(buf_.sampling, greedy(), stream_);

  f16_acts_ = step_plan_.options.f16_activations;
  // Warm-up: one eager step loads every kernel (lazy module loading cannot happen inside a
  // capture) and surfaces a failing kernel here, with its own error, not as a graph failure.
  try {
    launch_step();
    AF_CUDA_CHECK(cudaStreamSynchronize(stream_));
  } catch (const CudaError& e) {
    throw CudaError(std::string("the decode step failed on its warm-up run (CUDA_LAUNCH_BLOCKING=1 names the "
                                "kernel): ") +
                    e.what());
  }
  if (!step_plan_.options.eager) capture_graph();
  step::write_pos(buf_.pos, 0, stream_);
  set_token(0);
  AF_CUDA_CHECK(cudaStreamSynchronize(stream_));
  host_pos_ = 0;
}

// Captures enqueue_decode_step(): once with the attention grid planned for max_context, and once
// more for the steps whose keys fit the plan's short_keys (engine.h). Its launches read pos, token and sampling
// from device memory and write to fixed buffers, so replaying a graph is exactly one more step.
void Engine::capture_graph() {
  graph_exec_ = capture_step(opt_.max_context);
  if (step_plan_.short_keys > 0) short_graph_ = capture_step(step_plan_.short_keys);
}

cudaGraphExec_t Engine::capture_step(int attn_keys) {
  size_t nodes = 0;
  cudaGraphExec_t exec = capture("the decode step", [&] { enqueue_decode_step(attn_keys); }, &nodes);
  if (opt_.verbose)
    std::fprintf(stderr, "atomflow: decode step captured as a CUDA graph (%zu nodes, attention for %d keys)\n", nodes,
                 attn_keys);
  return exec;
}

void Engine::destroy_verify_graphs() {
  for (cudaGraphExec_t& g : verify_graphs_) {
    if (g) cudaGraphExecDestroy(g);
    g = nullptr;
  }
}

int Engine::verify_graphs() const {
  int n = 0;
  for (cudaGraphExec_t g : verify_graphs_) n += g != nullptr;
  return n;
}

cudaGraphExec_t Engine::capture(const std::string& name, const std::function<void()>& enqueue, size_t* nodes) {
  const std::string what =
      "capturing " + name + " as a CUDA graph failed (eager=True or ATOMFLOW_EAGER=1 runs without it): ";
  cudaGraph_t graph = nullptr;
  AF_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  try {
    enqueue();
  } catch (const std::exception& e) {
    cudaStreamEndCapture(stream_, &graph);  // leave the stream usable whatever happened
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw std::runtime_error(what + e.what());
  }
  cudaError_t err = cudaStreamEndCapture(stream_, &graph);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(what + "cudaStreamEndCapture: " + cudaGetErrorString(err) +
                             " (a launcher made a call that cannot be captured: a synchronization or an allocation?)");
  }
  *nodes = 0;
  cudaGraphGetNodes(graph, nullptr, nodes);
  cudaGraphExec_t exec = nullptr;
  err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(what + "cudaGraphInstantiate: " + cudaGetErrorString(err));
  }
  err = cudaGraphUpload(exec, stream_);
  if (err != cudaSuccess) {
    cudaGraphExecDestroy(exec);
    AF_CUDA_CHECK(err);
  }
  return exec;
}

void Engine::release() noexcept {
  if (gate_host_) *reinterpret_cast<volatile int32_t*>(gate_host_) = gate_ticket_;  // profiler.cu
  if (stream_) cudaStreamSynchronize(stream_);  // nothing may still read what is freed below
  release_profiler();
  if (graph_exec_) cudaGraphExecDestroy(graph_exec_);
  graph_exec_ = nullptr;
  if (short_graph_) cudaGraphExecDestroy(short_graph_);
  short_graph_ = nullptr;
  destroy_verify_graphs();
  for (cudaEvent_t& e : step_done_) {
    if (e) cudaEventDestroy(e);
    e = nullptr;
  }
  if (stream_) cudaStreamDestroy(stream_);
  stream_ = nullptr;
  if (ring_host_) cudaFreeHost(ring_host_);
  ring_host_ = ring_dev_ = nullptr;
  if (logits_host_) cudaFreeHost(logits_host_);
  logits_host_ = nullptr;
  arena_ = Arena();
}

std::vector<std::pair<std::string, size_t>> Engine::plan() const { return plan_; }

// ---------------------------------------------------------------------------------------
// helpers

// The step at position host_pos_ attends to host_pos_ + 1 keys: the short graph when they fit it.
// Eager steps plan their attention grid the same way, so both modes run the same kernels.
// A probed step runs its launches (the graph holds no probe points).
void Engine::launch_step() {
  ++logits_writes_;
  const bool graph = graph_exec_ != nullptr && probe_ == nullptr;
  NvtxRange range(graph ? "decode_step (graph)" : "decode_step");
  const bool short_step = step_plan_.short_keys > 0 && host_pos_ < step_plan_.short_keys;
  ++(short_step ? short_grid_steps_ : long_grid_steps_);
  if (graph)
    AF_CUDA_CHECK(cudaGraphLaunch(short_step ? short_graph_ : graph_exec_, stream_));
  else
    enqueue_decode_step(short_step ? step_plan_.short_keys : opt_.max_context);
}

bool Engine::step_overflowed(int position) const {
  const volatile int32_t* flags = ring_host_ + kRingSize;  // written by the device (publish_step)
  return f16_acts_ && flags[position % kRingSize] != 0;
}

void Engine::move_to_bf16(const std::string& what) {
  AF_CUDA_CHECK(cudaStreamSynchronize(stream_));  // every step in flight has run: drop them
  in_flight_ = 0;
  oldest_ = 0;
  f16_acts_ = false;
  if (opt_.verbose)
    std::fprintf(stderr, "atomflow: an activation of %s passed fp16's range; decoding on with bf16 activations\n",
                 what.c_str());
  if (graph_exec_ != nullptr) {
    cudaGraphExecDestroy(graph_exec_);
    graph_exec_ = nullptr;
    if (short_graph_) cudaGraphExecDestroy(short_graph_);
    short_graph_ = nullptr;
    capture_graph();
  }
  destroy_verify_graphs();  // captured again in bf16 on their next use, as the decode step runs
  step::write_int(buf_.f16_overflow, 0, stream_);
}

void Engine::rerun_in_bf16(int position, int32_t input) {
  move_to_bf16("the decode step at position " + std::to_string(position));
  step::write_pos(buf_.pos, position, stream_);
  host_pos_ = position;
  if (probe_records_ != nullptr) probe_records_->clear();
  if (input == kUnknown)
    throw std::runtime_error("the decode step at position " + std::to_string(position) +
                             " passed fp16's range and its input token is not known to rerun it in bf16: "
                             "call begin() with it before enqueue()");
  set_token(input);
  next_input_ = input;
}

void Engine::require_idle(const char* what) const {
  if (in_flight_ > 0)
    throw std::runtime_error(std::string(what) + ": " + std::to_string(in_flight_) +
                             " enqueued decode steps have not been waited for; call wait() or synchronize() first");
}

void Engine::check_token(int32_t token) const {
  if (token < 0 || token >= spec_.vocab_size)
    throw std::invalid_argument("token id " + std::to_string(token) + " is out of range [0, " +
                                std::to_string(spec_.vocab_size) + ")");
}

void Engine::set_token(int32_t token) {
  step::write_int(buf_.token, token, stream_);
  // With the fused tail a step starts from the embedding the previous step's sampler wrote.
  if (step_plan_.options.fused_tail)
    kernels::embedding(buf_.embed, buf_.token, 1, spec_.hidden_size, spec_.vocab_size, buf_.x, stream_);
}

void Engine::copy_logits_out(float* logits) {
  const size_t bytes = static_cast<size_t>(spec_.vocab_size) * sizeof(float);
  AF_CUDA_CHECK(cudaMemcpyAsync(logits_host_, buf_.logits, bytes, cudaMemcpyDeviceToHost, stream_));
  AF_CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::memcpy(logits, logits_host_, bytes);
}

// ---------------------------------------------------------------------------------------
// prefill and decode

void Engine::stage_prefill(const int32_t* ids, int n) {
  require_idle("prefill");
  if (n < 1) throw std::invalid_argument("prefill: the prompt is empty");
  if (n > opt_.max_context - host_pos_)
    throw std::invalid_argument("prompt of " + std::to_string(n) + " tokens at position " + std::to_string(host_pos_) +
                                " does not fit max_context " + std::to_string(opt_.max_context));
  for (int i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= spec_.vocab_size)
      throw std::invalid_argument("token id " + std::to_string(ids[i]) + " at index " + std::to_string(i) +
                                  " is out of range [0, " + std::to_string(spec_.vocab_size) + ")");
  }
  // From pageable memory: returns once the ids are staged, so the caller's array may go.
  AF_CUDA_CHECK(
      cudaMemcpyAsync(buf_.ids, ids, static_cast<size_t>(n) * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
}

// The rows of the prompt chunk at offset (of n ids): prefill_chunk, except that a prompt of 2+ ids
// never ends on a one-row chunk (the chunk before it gives up a row): one row would run the decode
// kernels' fp16 hand-off, whose overflow rerun replays a decode step, and a prompt's rows must be the
// same bits whether prefill() or begin_prompt() runs them.
int Engine::prompt_chunk_rows(int offset, int n) const {
  int rows = std::min(opt_.prefill_chunk, n - offset);
  if (rows > 1 && n - offset - rows == 1) --rows;
  return rows;
}

void Engine::prefill(const int32_t* ids, int n, float* logits) {
  std::lock_guard<std::mutex> lock(mu_);
  NvtxRange range("prefill");
  stage_prefill(ids, n);
  int last_rows = 0;
  for (int offset = 0; offset < n; offset += last_rows) {
    last_rows = prompt_chunk_rows(offset, n);
    enqueue_prefill_chunk(offset, last_rows);
  }
  enqueue_head(last_rows - 1);  // the chunk's rows are still in buf_.x; only the last one counts
  host_pos_ += n;
  last_output_ = kUnknown;  // the next step's input is begin()'s: x now holds the prompt's rows
  copy_logits_out(logits);
}

void Engine::prefill_rows(const int32_t* ids, int n, float* logits) {
  std::lock_guard<std::mutex> lock(mu_);
  NvtxRange range("prefill_rows");
  if (n > opt_.prefill_chunk)
    throw std::invalid_argument("prefill_rows: " + std::to_string(n) + " rows do not fit one chunk of " +
                                std::to_string(opt_.prefill_chunk));
  stage_prefill(ids, n);
  // A small-M chunk's rows run as decode steps, in the engine's activations; in fp16 one that passes
  // fp16's range moves the engine to bf16 (as a decode step's would) and the chunk runs again.
  const bool as_steps = n <= step_plan_.small_m_max_rows;
  for (;;) {
    {
      StepRows scope(step_rows_, as_steps);
      enqueue_prefill_chunk(0, n);
    }
    const size_t vocab = static_cast<size_t>(spec_.vocab_size);
    for (int first = 0; first < n; first += kLogitRows) {
      const int rows = std::min(kLogitRows, n - first);
      enqueue_head_rows(first, rows);
      AF_CUDA_CHECK(cudaMemcpyAsync(logits + first * vocab, buf_.logits, rows * vocab * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream_));
    }
    const bool flagged = as_steps && f16_acts_;
    if (flagged) enqueue_take_overflow();
    AF_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (!flagged || !took_overflow()) break;
    move_to_bf16("a chunk of " + std::to_string(n) + " rows at position " + std::to_string(host_pos_));
    step::write_pos(buf_.pos, host_pos_, stream_);  // the same rows again (the ids are still staged)
  }
  host_pos_ += n;
  last_output_ = kUnknown;  // as prefill(): the next step's input is begin()'s
}

bool Engine::verify_greedy(const int32_t* ids, int n, int32_t* tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  NvtxRange range("verify_greedy");
  if (n > kLogitRows)
    throw std::invalid_argument("verify: " + std::to_string(n) + " rows, at most " + std::to_string(kLogitRows));
  if (n > opt_.prefill_chunk)
    throw std::invalid_argument("verify: " + std::to_string(n) + " rows do not fit one chunk of " +
                                std::to_string(opt_.prefill_chunk));
  stage_prefill(ids, n);  // checks the ids and that no step is in flight
  ++logits_writes_;       // its head's rows take buf_.logits, graph or not
  // A verify chunk's launches depend on its row count only (the ids, the position and the tokens' slots are
  // device memory): one graph per count, captured on its first use in the engine's activations.
  if (verify_graphs_[n] == nullptr && graph_exec_ != nullptr) {
    size_t nodes = 0;
    verify_graphs_[n] =
        capture("the verify chunk of " + std::to_string(n) + " rows", [&] { enqueue_verify(n); }, &nodes);
  }
  if (verify_graphs_[n] != nullptr)
    AF_CUDA_CHECK(cudaGraphLaunch(verify_graphs_[n], stream_));
  else
    enqueue_verify(n);
  AF_CUDA_CHECK(cudaStreamSynchronize(stream_));
  last_output_ = kUnknown;
  if (took_overflow()) {  // the rows are not the fp16 decode steps' (one passed fp16's range): dropped
    step::write_pos(buf_.pos, host_pos_, stream_);
    return false;
  }
  std::memcpy(tokens, ring_host_ + 2 * kRingSize, n * sizeof(int32_t));
  host_pos_ += n;
  return true;
}

void Engine::enqueue_verify(int n) {
  {
    StepRows scope(step_rows_, true);  // its layers run the decode step's activations (enqueue_layers)
    enqueue_prefill_chunk(0, n);
  }
  enqueue_head_rows(0, n);
  // Straight into the mapped host memory after the ring (the caller's sync makes the writes visible): the
  // tokens, and in fp16 the overflow flag (taken and cleared).
  kernels::argmax_rows(buf_.logits, n, spec_.vocab_size, ring_dev_ + 2 * kRingSize, stream_);
  if (f16_acts_) enqueue_take_overflow();
}

void Engine::enqueue_take_overflow() {
  step::take_int(buf_.f16_overflow, ring_dev_ + 2 * kRingSize + kLogitRows, stream_);
}

bool Engine::took_overflow() {
  volatile int32_t* slot = ring_host_ + 2 * kRingSize + kLogitRows;
  const bool overflowed = *slot != 0;
  *slot = 0;
  return overflowed;
}

void Engine::decode(int32_t token, float* logits) {
  std::lock_guard<std::mutex> lock(mu_);
  require_idle("decode");
  check_token(token);
  if (host_pos_ >= opt_.max_context)
    throw std::runtime_error("context full: max_context " + std::to_string(opt_.max_context) + " reached");
  set_token(token);
  const int position = host_pos_;
  launch_step();
  ++host_pos_;
  last_output_ = kUnknown;  // the token it sampled stays on the device
  copy_logits_out(logits);
  if (step_overflowed(position)) {
    rerun_in_bf16(position, token);
    launch_step();
    ++host_pos_;
    copy_logits_out(logits);
  }
}

// ---------------------------------------------------------------------------------------
// position and sampling: tiny kernels on the stream, so they land between steps in order

void Engine::set_position(int position) {
  std::lock_guard<std::mutex> lock(mu_);
  require_idle("set_position");
  if (position < 0 || position > host_pos_)
    throw std::invalid_argument("set_position(" + std::to_string(position) +
                                "): a position can only roll back, to [0, " + std::to_string(host_pos_) + "]");
  step::write_pos(buf_.pos, position, stream_);
  host_pos_ = position;
}

void Engine::set_sampling(float temperature, int top_k, float top_p, uint64_t seed) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!(temperature >= 0.0f) || !std::isfinite(temperature))
    throw std::invalid_argument("temperature must be finite and >= 0, got " + std::to_string(temperature));
  if (top_k < 0) throw std::invalid_argument("top_k must be >= 0 (0 = off), got " + std::to_string(top_k));
  if (!(top_p > 0.0f && top_p <= 1.0f))
    throw std::invalid_argument("top_p must be in (0, 1] (1 = off), got " + std::to_string(top_p));
  step::write_sampling(buf_.sampling, kernels::SamplingConfig{temperature, top_k, top_p, 0u, seed}, stream_);
}

// ---------------------------------------------------------------------------------------
// pipelined generation

void Engine::begin(int32_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  check_token(token);
  set_token(token);
  next_input_ = token;
}

void Engine::begin_prompt(const int32_t* ids, int n) {
  std::lock_guard<std::mutex> lock(mu_);
  NvtxRange range("prefill (pipelined)");
  if (n < 2) throw std::invalid_argument("begin_prompt: at least 2 ids (one id: begin() and enqueue())");
  stage_prefill(ids, n);  // idle: the sample below is the only step in flight
  for (int offset = 0, rows = 0; offset < n; offset += rows) {
    rows = prompt_chunk_rows(offset, n);
    const bool last = offset + rows == n;
    enqueue_prefill_chunk(offset, rows, /*advance=*/!last);
    if (last) {
      // *pos = the last row's position, for the sampler, which reads it before its PDL wait (sampling.cu):
      // written by a copy, a stream operation every later kernel waits for in full (a kernel writing it
      // could still be running when the sampler starts early behind the head).
      const int32_t p[2] = {host_pos_ + n - 1, host_pos_ + n};  // pageable: staged before the call returns
      AF_CUDA_CHECK(cudaMemcpyAsync(buf_.pos, p, sizeof(p), cudaMemcpyHostToDevice, stream_));
      enqueue_head(rows - 1);
    }
  }
  enqueue_sample();  // the last row's token into the ring, *pos past the prompt
  // Whether the row is all finite, into the mapped slot (a 4-byte answer instead of the row's copy).
  kernels::all_finite(buf_.logits, spec_.vocab_size, ring_dev_ + kPromptFiniteSlot, stream_);
  prompt_mark_ = logits_writes_;
  // The bookkeeping of one step at the last row's position whose input was ids[n - 1] (a rerun in
  // bf16 replays it as that decode step).
  host_pos_ += n - 1;
  oldest_pos_ = host_pos_;
  step_input_[oldest_] = ids[n - 1];
  next_input_ = kUnknown;
  last_output_ = kUnknown;
  AF_CUDA_CHECK(cudaEventRecord(step_done_[oldest_], stream_));
  in_flight_ = 1;
  ++host_pos_;
}

bool Engine::prompt_finite() const {
  const volatile int32_t* slot = ring_host_ + kPromptFiniteSlot;  // written by the device (all_finite)
  return *slot != 0;
}

void Engine::prompt_logits(float* logits) {
  std::lock_guard<std::mutex> lock(mu_);
  if (prompt_mark_ != logits_writes_)
    throw std::logic_error("prompt_logits: no begin_prompt row to give (a later step has overwritten it)");
  copy_logits_out(logits);
}

void Engine::enqueue(int n) {
  std::lock_guard<std::mutex> lock(mu_);
  enqueue_steps(n);
}

void Engine::enqueue_steps(int n) {
  if (n < 0) throw std::invalid_argument("enqueue(n): n must be >= 0");
  if (in_flight_ + n > kRingSize)
    throw std::invalid_argument("enqueue(" + std::to_string(n) + "): " + std::to_string(in_flight_) +
                                " steps already in flight and the token ring holds " + std::to_string(kRingSize) +
                                "; wait() for some first");
  for (int i = 0; i < n; ++i) {
    if (host_pos_ >= opt_.max_context)
      throw std::runtime_error("context full: max_context " + std::to_string(opt_.max_context) + " reached");
    launch_step();
    if (in_flight_ == 0) oldest_pos_ = host_pos_;
    const int slot = (oldest_ + in_flight_) % kRingSize;
    // Its input: begin()'s token, else the output of the step before (known once wait() read it).
    step_input_[slot] = next_input_ != kUnknown ? next_input_ : (in_flight_ == 0 ? last_output_ : kUnknown);
    next_input_ = kUnknown;
    AF_CUDA_CHECK(cudaEventRecord(step_done_[slot], stream_));
    ++in_flight_;
    ++host_pos_;
  }
}

std::vector<int32_t> Engine::wait(int n) {
  std::lock_guard<std::mutex> lock(mu_);
  if (n < 0 || n > in_flight_)
    throw std::invalid_argument("wait(" + std::to_string(n) + "): " + std::to_string(in_flight_) +
                                " steps are in flight");
  std::vector<int32_t> tokens;
  tokens.reserve(n);
  const volatile int32_t* ring = ring_host_;  // written by the device: read memory, not a register
  while (static_cast<int>(tokens.size()) < n) {
    AF_CUDA_CHECK(cudaEventSynchronize(step_done_[oldest_]));
    // The step's end (publish_step) wrote the token of the step at position p into slot
    // p % kRingSize, and its overflow flag into kRingSize + that. At most kRingSize consecutive
    // positions are in flight, so no slot is overwritten before it is read.
    if (step_overflowed(oldest_pos_)) {
      // This step and every one after it ran on an inf: run them all again in bf16.
      const int steps = in_flight_;
      rerun_in_bf16(oldest_pos_, step_input_[oldest_]);
      enqueue_steps(steps);
      continue;
    }
    const int32_t token = ring[oldest_pos_ % kRingSize];
    tokens.push_back(token);
    last_output_ = token;
    oldest_ = (oldest_ + 1) % kRingSize;
    ++oldest_pos_;
    --in_flight_;
    if (in_flight_ > 0 && step_input_[oldest_] == kUnknown) step_input_[oldest_] = token;
  }
  return tokens;
}

void Engine::synchronize() {
  std::lock_guard<std::mutex> lock(mu_);
  AF_CUDA_CHECK(cudaStreamSynchronize(stream_));
  in_flight_ = 0;
  oldest_ = 0;
  last_output_ = kUnknown;  // the dropped steps' tokens were never read
}

}  // namespace atomflow

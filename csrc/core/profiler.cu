// Profile mode (`atomflow profile`): decode steps timed on the device, per launch group or whole.
// Everything it needs (events, the mapped gate flag) is made at load, so a profiled step
// allocates nothing; outside profile_decode the only cost is mark()'s early return.
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "atomflow/engine.h"
#include "step_kernels.h"

namespace atomflow {

namespace {

constexpr uint64_t kGateTimeoutNs = 2'000'000'000ull;  // far beyond the time to enqueue one step

}  // namespace

void Engine::init_profiler() {
  // Launch groups per step: 5 per layer + lm_head + sample (+ embedding and finish with
  // a plan without the fused tail); room to spare so a new launch in forward.cu cannot overflow it
  // silently (mark() checks).
  const size_t n = 8 * static_cast<size_t>(spec_.num_layers) + 16;
  prof_marks_.resize(n);
  prof_events_.assign(n + 1, nullptr);
  for (cudaEvent_t& e : prof_events_) AF_CUDA_CHECK(cudaEventCreate(&e));  // timing enabled
  AF_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&gate_host_), sizeof(int32_t), cudaHostAllocMapped));
  ++allocations_;
  *gate_host_ = 0;
  AF_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&gate_dev_), gate_host_, 0));
}

void Engine::release_profiler() noexcept {
  for (cudaEvent_t& e : prof_events_)
    if (e) cudaEventDestroy(e);
  prof_events_.clear();
  if (gate_host_) cudaFreeHost(gate_host_);
  gate_host_ = gate_dev_ = nullptr;
}

void Engine::mark(const char* label, int layer) {
  if (!profiling_) return;
  if (prof_count_ + 1 >= prof_events_.size())
    throw std::logic_error("profile: more launch groups per step than events (init_profiler sizes them)");
  prof_marks_[prof_count_] = ProfileMark{label, layer};
  ++prof_count_;
  AF_CUDA_CHECK(cudaEventRecord(prof_events_[prof_count_], stream_));
}

std::vector<Engine::ProfileEntry> Engine::profile_decode(int32_t token, int steps, ProfileMode mode) {
  std::lock_guard<std::mutex> lock(mu_);
  require_idle("profile_decode");
  check_token(token);
  if (steps < 1) throw std::invalid_argument("profile_decode: steps must be >= 1, got " + std::to_string(steps));
  if (steps > opt_.max_context - host_pos_)
    throw std::invalid_argument("profile_decode: " + std::to_string(steps) + " steps at position " +
                                std::to_string(host_pos_) + " do not fit max_context " +
                                std::to_string(opt_.max_context));
  if (mode == ProfileMode::GraphStep && !graph_exec_)
    throw std::runtime_error("profile_decode: graph mode needs the CUDA graph, and this engine runs eagerly");

  std::vector<ProfileEntry> out;
  out.reserve(static_cast<size_t>(steps) * (mode == ProfileMode::Kernels ? prof_marks_.size() : 1));
  cudaGraphExec_t graph = graph_exec_;
  if (mode != ProfileMode::GraphStep) graph_exec_ = nullptr;  // launch_step() runs the launches
  auto restore = [&] {  // after a failure too: never leave the stream behind a closed gate
    profiling_ = false;
    graph_exec_ = graph;
    *reinterpret_cast<volatile int32_t*>(gate_host_) = gate_ticket_;
  };
  try {
    set_token(token);
    for (int s = 0; s < steps; ++s) {
      // Queue the whole step behind the gate, then open it: the GPU runs it back to back.
      const int32_t ticket = ++gate_ticket_;
      step::gate(gate_dev_, ticket, kGateTimeoutNs, stream_);
      AF_CUDA_CHECK(cudaEventRecord(prof_events_[0], stream_));
      prof_count_ = 0;
      profiling_ = mode == ProfileMode::Kernels;
      launch_step();
      profiling_ = false;
      if (mode != ProfileMode::Kernels) {
        prof_marks_[0] = ProfileMark{"step", -1};
        prof_count_ = 1;
        AF_CUDA_CHECK(cudaEventRecord(prof_events_[1], stream_));
      }
      std::atomic_thread_fence(std::memory_order_seq_cst);
      *reinterpret_cast<volatile int32_t*>(gate_host_) = ticket;
      ++host_pos_;
      AF_CUDA_CHECK(cudaEventSynchronize(prof_events_[prof_count_]));
      for (size_t i = 0; i < prof_count_; ++i) {
        float ms = 0.0f;
        AF_CUDA_CHECK(cudaEventElapsedTime(&ms, prof_events_[i], prof_events_[i + 1]));
        out.push_back(ProfileEntry{prof_marks_[i].label, prof_marks_[i].layer, ms * 1e3f});
      }
    }
  } catch (...) {
    restore();
    throw;
  }
  restore();
  return out;
}

}  // namespace atomflow

// Probe mode: the validator's view of the forward pass. Each probe point waits for the stream
// and copies one activation to the host, so it only ever runs eagerly, outside the graph.
#include <cstring>

#include "atomflow/engine.h"

namespace atomflow {

namespace {

// fp32, or (f16_src) the fp16 RMSNorm output, as fp32 on the host.
std::vector<float> to_host_f32(const void* dev, bool f16_src, size_t n, cudaStream_t stream) {
  std::vector<float> out(n);
  AF_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (!f16_src) {
    AF_CUDA_CHECK(cudaMemcpy(out.data(), dev, n * sizeof(float), cudaMemcpyDeviceToHost));
    return out;
  }
  std::vector<f16> tmp(n);
  AF_CUDA_CHECK(cudaMemcpy(tmp.data(), dev, n * sizeof(f16), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; ++i) out[i] = __half2float(tmp[i]);
  return out;
}

}  // namespace

void Engine::probe_snapshot(int rows) {
  probe_x_ = to_host_f32(buf_.x, false, static_cast<size_t>(rows) * spec_.hidden_size, stream_);
}

void Engine::probe_point(const char* name, int layer, ProbeSrc src, int rows) {
  const int d = spec_.hidden_size;
  const size_t n = static_cast<size_t>(rows) * d;
  std::vector<float> v;
  int dim = d;
  switch (src) {
    case ProbeSrc::XN: v = to_host_f32(buf_.xn, true, n, stream_); break;
    case ProbeSrc::X: v = to_host_f32(buf_.x, false, n, stream_); break;
    case ProbeSrc::X_DELTA:
      v = to_host_f32(buf_.x, false, n, stream_);
      for (size_t i = 0; i < n; ++i) v[i] -= probe_x_[i];
      break;
    case ProbeSrc::LOGITS:
      dim = spec_.vocab_size;
      v = to_host_f32(buf_.logits, false, static_cast<size_t>(dim), stream_);
      break;
  }
  if (probe_records_ != nullptr)
    probe_records_->push_back(ProbeRecord{name, layer, std::move(v), dim});
  else
    (*probe_)(name, layer, v, dim);
}

void Engine::prefill_probed(const int32_t* ids, int n, float* logits, const ProbeSink& sink) {
  probe_ = &sink;
  try {
    prefill(ids, n, logits);
  } catch (...) {
    probe_ = nullptr;
    throw;
  }
  probe_ = nullptr;
}

// The step's points are held until it has succeeded, so a step rerun in bf16 (engine.h) reports
// its second run only. With probe_ set, launch_step() runs the step's launches, not the graph.
void Engine::decode_probed(int32_t token, float* logits, const ProbeSink& sink) {
  std::vector<ProbeRecord> records;
  probe_ = &sink;
  probe_records_ = &records;
  try {
    decode(token, logits);
  } catch (...) {
    probe_ = nullptr;
    probe_records_ = nullptr;
    throw;
  }
  probe_ = nullptr;
  probe_records_ = nullptr;
  for (const ProbeRecord& r : records) sink(r.name, r.layer, r.rows, r.dim);
}

}  // namespace atomflow

// _core.ops: the in-kernel event trace (trace.cuh, tools/trace_step.py): arm, reset, read.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ops_common.h"

namespace atomflow::bindings::ops {

namespace {

// ------------------------------------------------------------------ in-kernel trace (trace.cuh)

struct TraceState {
  DeviceBuffer recs, counts;
  unsigned per_sm = 0;
};
TraceState& trace_state() {
  static TraceState t;
  return t;
}

// Allocates per_sm records per SM region and points the recording kernels at them (0: off).
void trace_arm(unsigned per_sm) {
  TraceState& t = trace_state();
  if (per_sm == 0) {
    k::trace_arm(nullptr, nullptr, 0);
    t = TraceState{};
    return;
  }
  const size_t sms = k::trace_max_sms();
  t.recs = DeviceBuffer(k::trace_record_bytes() * sms * per_sm);
  t.counts = DeviceBuffer(sizeof(unsigned) * sms);
  t.per_sm = per_sm;
  AF_CUDA_CHECK(cudaMemset(t.counts.get(), 0, t.counts.bytes()));
  k::trace_arm(t.recs.get(), t.counts.get<unsigned>(), per_sm);
  sync();
}

void trace_reset() {
  TraceState& t = trace_state();
  require(t.per_sm > 0, "trace: not armed (ops.trace_arm first)");
  sync();
  AF_CUDA_CHECK(cudaMemset(t.counts.get(), 0, t.counts.bytes()));
  sync();
}

// The records written since the last reset, as raw bytes (trace::Rec, 160 each), and how many were dropped.
py::tuple trace_read() {
  TraceState& t = trace_state();
  require(t.per_sm > 0, "trace: not armed (ops.trace_arm first)");
  sync();
  const size_t sms = k::trace_max_sms();
  std::vector<unsigned> counts(sms);
  t.counts.download(counts.data(), sizeof(unsigned) * sms);
  const size_t rec = k::trace_record_bytes();
  std::vector<uint8_t> all(rec * sms * t.per_sm);
  t.recs.download(all.data(), all.size());
  std::string out;
  size_t dropped = 0;
  for (size_t s = 0; s < sms; ++s) {
    const size_t n = std::min<size_t>(counts[s], t.per_sm);
    dropped += counts[s] - n;
    out.append(reinterpret_cast<const char*>(all.data() + rec * s * t.per_sm), rec * n);
  }
  return py::make_tuple(py::bytes(out), dropped);
}

}  // namespace

void register_trace(py::module_& m) {
  m.def("trace_built", &k::trace_built, "whether this build records the in-kernel trace (ATOMFLOW_TRACE)");
  m.def("trace_arm", &trace_arm, py::arg("per_sm"),
        "point the decode kernels at a trace buffer of per_sm records "
        "per SM (0: off)");
  m.def("trace_reset", &trace_reset, "forget the records written so far");
  m.def("trace_read", &trace_read, "(bytes of 160-byte records since the last reset, records dropped)");
}

}  // namespace atomflow::bindings::ops

// The in-kernel trace's host side (trace.cuh): which build this is, and pointing the recording
// kernels at a buffer.
#include "atomflow/kernels.h"
#include "atomflow/trace.cuh"

namespace atomflow::kernels {

#ifdef ATOMFLOW_TRACE
void gemv_trace_arm(const trace::Buf& b);       // gemv_w8a16.cu
void attention_trace_arm(const trace::Buf& b);  // attention_decode.cu
#endif

bool trace_built() { return trace::kOn; }

unsigned trace_max_sms() { return trace::kMaxSms; }

size_t trace_record_bytes() { return sizeof(trace::Rec); }

void trace_arm(void* recs, unsigned* counts, unsigned per_sm) {
  AF_CHECK(trace::kOn, "trace: this build has no trace (build with -C cmake.define.ATOMFLOW_TRACE=ON)");
#ifdef ATOMFLOW_TRACE
  const trace::Buf b{static_cast<trace::Rec*>(recs), counts, per_sm};
  gemv_trace_arm(b);
  attention_trace_arm(b);
#else
  (void)recs, (void)counts, (void)per_sm;
#endif
}

}  // namespace atomflow::kernels

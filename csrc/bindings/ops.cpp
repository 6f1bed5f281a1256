// _core.ops: each kernel exposed to Python for testing and benchmarking. numpy in (bf16 as uint16
// bit patterns, fp8 as uint8 bytes), device copies, outputs poisoned with 0xFF bytes (NaN for
// floats, -1 for ints) so an unwritten element cannot pass, one launch, synchronize, numpy out.
// The time_* helpers return microseconds per launch (CUDA events around batches of back-to-back
// launches, median over batches), rotating over enough weight / cache copies that the L2 cannot
// serve them.
#include <pybind11/pybind11.h>

#include "ops_common.h"

void register_ops(pybind11::module_& m) {
  namespace ops = atomflow::bindings::ops;
  m.doc() = "Kernel test harness: each kernel on numpy inputs (bf16 = uint16, fp8 = uint8), and timers";
  ops::register_small(m);              // ops_small.cpp
  ops::register_gemv(m);               // ops_gemv.cpp
  ops::register_gemv_m(m);             // ops_gemv_m.cpp
  ops::register_gemm_sm90(m);          // ops_gemm_sm90.cpp
  ops::register_gemm_skinny(m);        // ops_gemm_skinny.cpp
  ops::register_attention(m);          // ops_attention.cpp
  ops::register_attention_prefill(m);  // ops_attention_prefill.cpp
  ops::register_sampling(m);           // ops_sampling.cpp
  ops::register_trace(m);              // ops_trace.cpp
}

// What the two sm90 prefill GEMMs (gemm_w8a16_sm90.cu, gemm_w8a8_sm90.cu) share: the file's scale group,
// the workspace carve's alignment, and the launch of a CUTLASS kernel. Included by those two files only.
#pragma once
#include <cstddef>
#include <string>

#include "atomflow/common.h"

#if ATOMFLOW_SM90_GEMM
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#endif

namespace atomflow::kernels::sm90 {

constexpr int kScaleGroup = 128;  // columns per weight scale (the file's FP8 groups)
constexpr size_t kWsAlign = 256;  // every piece of a workspace starts at a multiple of this
inline size_t align_up(size_t n) { return (n + kWsAlign - 1) / kWsAlign * kWsAlign; }

#if ATOMFLOW_SM90_GEMM
// One launch of CUTLASS kernel K on args: GemmUniversalAdapter::initialize's steps without its per-call
// cudaFuncSetAttribute (a driver call on every launch): the kernel's shared-memory limit is raised once
// per instance. `what` names the GEMM in errors.
template <class K, class Gemm>
void run_cutlass(const typename Gemm::Arguments& args, void* workspace, cudaStream_t stream, const char* what) {
  AF_CHECK(K::can_implement(args), std::string(what) + ": CUTLASS cannot run this shape");
  static const bool smem_set = [] {
    AF_CUDA_CHECK(cudaFuncSetAttribute(cutlass::device_kernel<K>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(K::SharedStorageSize)));
    return true;
  }();
  (void)smem_set;
  const cutlass::Status init = K::initialize_workspace(args, workspace, stream);
  AF_CHECK(init == cutlass::Status::kSuccess,
           std::string(what) + ": workspace initialization failed: " + cutlassGetStatusString(init));
  typename K::Params params = K::to_underlying_arguments(args, workspace);
  // Gemm::run reads cudaGetLastError() after its launch and reports anything found there as its own
  // failure ("Error Internal"), an error an earlier runtime call of this thread left unread included: that
  // one is not this launch's, so it is cleared first (a sticky error, a faulted kernel, stays). Why:
  // docs/perf-log.md 2026-11-27 a.
  (void)cudaGetLastError();
  const cutlass::Status st = Gemm::run(params, stream);
  AF_CHECK(st == cutlass::Status::kSuccess, std::string(what) + ": launch failed: " + cutlassGetStatusString(st));
}
#endif

}  // namespace atomflow::kernels::sm90

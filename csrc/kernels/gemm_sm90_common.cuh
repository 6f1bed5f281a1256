// What the two sm90 prefill GEMMs (gemm_w8a16_sm90.cu, gemm_w8a8_sm90.cu) share: the file's scale group,
// the workspace carve's alignment, and the launch of a CUTLASS kernel. Included by those two files only.
#pragma once
#include <cstddef>
#include <string>

#include "atomflow/common.h"
#include "atomflow/pdl.cuh"

#if ATOMFLOW_SM90_GEMM
#include "cutlass/cutlass.h"
#include "cute/int_tuple.hpp"
#include "cutlass/device_kernel.h"
#endif

namespace atomflow::kernels::sm90 {

constexpr int kScaleGroup = 128;  // columns per weight scale (the file's FP8 groups)
constexpr size_t kWsAlign = 256;  // every piece of a workspace starts at a multiple of this
inline size_t align_up(size_t n) { return (n + kWsAlign - 1) / kWsAlign * kWsAlign; }

#if ATOMFLOW_SM90_GEMM
// One launch of CUTLASS kernel K on args: GemmUniversalAdapter::initialize's steps without its per-call
// cudaFuncSetAttribute (a driver call on every launch): the kernel's shared-memory limit is raised once
// per instance and module (the flag is module-local: every symbol is hidden, CMakeLists.txt). `what`
// names the GEMM in errors. pdl: launch with the PDL attribute (when enabled, pdl.cuh); only for kernels
// whose every warp that reads global memory first waits for the kernel before (griddepcontrol.wait,
// CUTLASS_GDC_ENABLED).
template <class K, class Gemm>
void run_cutlass(const typename Gemm::Arguments& args, void* workspace, cudaStream_t stream, const char* what,
                 bool pdl) {
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
  // Launched here rather than by Gemm::run, which reports any failure as "Error Internal" (it reads
  // cudaGetLastError() after its launch: an error an earlier call left unread included): this launch's
  // own error, by name, or none.
  using Cluster = typename K::DispatchPolicy::ClusterShape;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cute::size<0>(Cluster{});
  attr[0].val.clusterDim.y = cute::size<1>(Cluster{});
  attr[0].val.clusterDim.z = cute::size<2>(Cluster{});
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = Gemm::get_grid_shape(params);
  cfg.blockDim = K::get_block_shape();
  cfg.dynamicSmemBytes = K::SharedStorageSize;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl && pdl_enabled() ? 2 : 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, cutlass::device_kernel<K>, params);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // this launch's error, reported here: not left for the next check
    const dim3 g = cfg.gridDim;
    throw CudaError(std::string(what) + ": launch failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                    "), grid " + std::to_string(g.x) + "x" + std::to_string(g.y) + "x" + std::to_string(g.z) + ", " +
                    std::to_string(K::SharedStorageSize) + " bytes of shared memory");
  }
}
#endif

}  // namespace atomflow::kernels::sm90

// What does a kernel boundary cost? A standalone probe: a chain of N dependent kernels (each block
// reads a value the previous kernel wrote, block 0 writes the next one) captured in a CUDA graph,
// timed per kernel, for the ways one kernel can wait for the previous one:
//   plain  - ordinary stream order (no PDL attribute)
//   pdl    - PDL: launch_dependents at the start, griddepcontrol.wait before the read
//   flag   - PDL launch at the start, then each block spins on a counter that every block of the
//            previous kernel increments (release) after its write; no griddepcontrol.wait
//   grid   - one persistent kernel, N stages separated by counter-based grid barriers
// each with shared memory small (blocks of consecutive kernels may share an SM) and large (2
// blocks per SM: the next kernel's blocks start only where the previous kernel's have exited,
// as with the engine's GEMVs, which hold the whole register file).
//
//   nvcc -arch=sm_90 -O2 -o /tmp/boundary_probe tools/boundary_probe.cu && /tmp/boundary_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#define CHECK(x)                                                   \
  do {                                                             \
    cudaError_t e = (x);                                           \
    if (e != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); \
      std::exit(1);                                                \
    }                                                              \
  } while (0)

constexpr int kThreads = 256;

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// mode 0: no griddepcontrol at all; 1: PDL; 2: counters.
template <int MODE>
__global__ void __launch_bounds__(kThreads) link(int* vals, int* counters, int k, int expected) {
  extern __shared__ int pad[];
  if (MODE == 1) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  if (MODE == 2) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0 && k > 0)
      while (ld_acquire(counters + k - 1) < expected) {
      }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const int v = __ldcg(vals + k);  // written by kernel k - 1
    if (blockIdx.x == 0) vals[k + 1] = v + 1;
    pad[0] = v;
  }
  if (MODE == 2) {
    __syncthreads();
    if (threadIdx.x == 0) red_release(counters + k, 1);
  }
}

__global__ void __launch_bounds__(kThreads) persistent(int* vals, int* counters, int n, int expected) {
  extern __shared__ int pad[];
  for (int k = 0; k < n; ++k) {
    if (threadIdx.x == 0) {
      if (k > 0)
        while (ld_acquire(counters + k - 1) < expected) {
        }
      const int v = __ldcg(vals + k);
      if (blockIdx.x == 0) vals[k + 1] = v + 1;
      pad[0] = v;
    }
    __syncthreads();
    if (threadIdx.x == 0) red_release(counters + k, 1);
  }
}

template <int MODE>
static void launch(int* vals, int* counters, int k, int grid, size_t smem, cudaStream_t s) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = MODE == 0 ? 0 : 1;
  CHECK(cudaLaunchKernelEx(&cfg, link<MODE>, vals, counters, k, grid));
}

// Median us per kernel (or per stage) over `reps` graph launches of an n-kernel chain.
static double run(int mode, int n, int grid, size_t smem, int reps) {
  int *vals, *counters;
  CHECK(cudaMalloc(&vals, (n + 2) * sizeof(int)));
  CHECK(cudaMalloc(&counters, (n + 2) * sizeof(int)));
  CHECK(cudaMemset(vals, 0, (n + 2) * sizeof(int)));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  CHECK(cudaMemsetAsync(counters, 0, (n + 2) * sizeof(int), s));
  if (mode == 3) {
    persistent<<<grid, kThreads, smem, s>>>(vals, counters, n, grid);
  } else {
    for (int k = 0; k < n; ++k) {
      if (mode == 0) launch<0>(vals, counters, k, grid, smem, s);
      if (mode == 1) launch<1>(vals, counters, k, grid, smem, s);
      if (mode == 2) launch<2>(vals, counters, k, grid, smem, s);
    }
  }
  CHECK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t ge;
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int r = 0; r < reps + 3; ++r) {
    CHECK(cudaEventRecord(a, s));
    CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 3) t.push_back(ms);
  }
  int last = 0;
  CHECK(cudaMemcpy(&last, vals + n, sizeof(int), cudaMemcpyDeviceToHost));
  if (last != n) std::fprintf(stderr, "mode %d: chain value %d, expected %d\n", mode, last, n);
  std::sort(t.begin(), t.end());
  CHECK(cudaGraphExecDestroy(ge));
  CHECK(cudaGraphDestroy(g));
  CHECK(cudaFree(vals));
  CHECK(cudaFree(counters));
  CHECK(cudaStreamDestroy(s));
  return 1000.0 * t[t.size() / 2] / n;
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t big = 100 * 1024;
  CHECK(cudaFuncSetAttribute(link<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CHECK(cudaFuncSetAttribute(link<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CHECK(cudaFuncSetAttribute(link<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CHECK(cudaFuncSetAttribute(persistent, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  const int n = 200, reps = 20;
  const char* names[] = {"plain", "pdl", "flag", "grid"};
  std::printf("us per kernel boundary, chain of %d, %d SMs (median of %d graph launches)\n", n, sms, reps);
  std::printf("%-6s %10s %14s %14s\n", "mode", "grid", "smem 4 B", "smem 100 KB");
  for (int grid : {sms, 2 * sms})
    for (int mode = 0; mode < 4; ++mode)
      std::printf("%-6s %10d %14.3f %14.3f\n", names[mode], grid, run(mode, n, grid, 4, reps),
                  run(mode, n, grid, big, reps));
  return 0;
}

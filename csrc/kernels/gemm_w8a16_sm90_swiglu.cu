// SwiGLU's up half of gemm_w8a16_sm90 (contract: the top of gemm_w8a16_sm90.cu; kernels: gemm_w8a16_sm90.cuh):
// out bf16 [M, F] = silu(gate) * (x w_up^T) in the GEMM's epilogue, gate the fp32 [M, F] y of the gate half,
// read by the epilogue's TMA as its C. A file of its own so its instances compile beside the others.
#include "gemm_w8a16_sm90.cuh"

namespace atomflow::kernels::sm90_w8a16 {

#if ATOMFLOW_SM90_GEMM
size_t swiglu_up_workspace_bytes(Act x_type, Sm90Tile tile, int M, int F, int K) {
  size_t bytes = 0;
  dispatch<SwigluFusion>(x_type, tile, [&](auto g) { bytes = decltype(g)::workspace_bytes(M, F, K); });
  return bytes;
}

void swiglu_up(const uint8_t* w_up, const float* scales_up, int ld_s, const void* x, Act x_type, int M, int F, int K,
               const float* gate, bf16* out, void* workspace, Sm90Tile tile, cudaStream_t stream, bool pdl) {
  dispatch<SwigluFusion>(x_type, tile, [&](auto g) {
    using G = decltype(g);
    G::run(w_up, scales_up, ld_s, x, M, F, K, typename G::Thread{}, gate, reinterpret_cast<typename G::Out*>(out),
           workspace, stream, pdl);
  });
}
#else
size_t swiglu_up_workspace_bytes(Act, Sm90Tile, int, int, int) { return 0; }
void swiglu_up(const uint8_t*, const float*, int, const void*, Act, int, int, int, const float*, bf16*, void*, Sm90Tile,
               cudaStream_t, bool) {}
#endif

}  // namespace atomflow::kernels::sm90_w8a16

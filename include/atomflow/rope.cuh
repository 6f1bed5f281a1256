// The RoPE arithmetic shared by the rope kernel and the QKV GEMV's fused epilogue, written with
// explicit roundings (no contraction into FMAs) so both produce the same bits by construction.
#pragma once

namespace atomflow {

// The head_dim range both RoPE paths accept (even, <= this). Neither holds a table of that size: the
// rope kernel stages one row of D floats, the fused epilogue computes each pair's cos / sin itself.
constexpr int kMaxRopeHeadDim = 1024;

// cos and sin of position p's angle for frequency inv_freq. Accurate sincosf, not __sinf: the
// angles reach ~1e5 rad at long context.
__device__ __forceinline__ void rope_cos_sin(int p, float inv_freq, float& c, float& s) {
  sincosf(__fmul_rn(static_cast<float>(p), inv_freq), &s, &c);
}

// HF rotate-half on the pair (x1, x2) = (x[i], x[i + D/2]).
__device__ __forceinline__ void rope_rotate(float x1, float x2, float c, float s, float& o1, float& o2) {
  o1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
  o2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

}  // namespace atomflow

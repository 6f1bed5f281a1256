// The W8A16 tensor-core step shared by gemm_w8a16 and gemm_w8a16_skinny: FP8 weights converted exactly
// to the activation's 16-bit type, mma.sync m16n8k16 with fp32 accumulation, and the zero-filling copy.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "atomflow/kernels.h"

namespace atomflow::kernels {

// 16 bytes global -> shared (cp.async, L2 only); valid false zero-fills the 16 bytes (rows past M or N).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes));
}

// Two e4m3 bytes (low = lower k) -> the activation's 16-bit type, exactly (e4m3 fits both):
// fp16 directly (cvt.rn.f16x2.e4m3x2), bf16 through f32.
template <Act A>
__device__ __forceinline__ uint32_t fp8x2_to_16x2(uint32_t two_bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two_bytes, __NV_E4M3);
  if constexpr (A == Act::F16) {
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const float2 f = __half22float2(__half2(h));
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
    return *reinterpret_cast<const uint32_t*>(&b);
  }
}

// d += A (16 x 16, row-major fragments a0..a3) x B (16 x 8, col-major b0, b1), A's 16-bit type.
template <Act A>
__device__ __forceinline__ void mma16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                      uint32_t b1) {
  if constexpr (A == Act::F16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

}  // namespace atomflow::kernels

// Shared by the _core.ops harness files (ops_*.cpp): device copies of numpy arrays, the harness's
// ticket counters, synchronization, timing rotations and the 16-bit output type.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "args.h"
#include "atomflow/device_buffer.h"
#include "atomflow/kernels.h"

namespace atomflow::bindings::ops {

namespace py = pybind11;
namespace k = atomflow::kernels;
using atomflow::DeviceBuffer;

// A product's 16-bit input type by name ("bf16" or "f16").
inline k::Act act_arg(const std::string& x_dtype) {
  require(x_dtype == "bf16" || x_dtype == "f16", "x_dtype must be 'bf16' or 'f16', got '" + x_dtype + "'");
  return x_dtype == "f16" ? k::Act::F16 : k::Act::BF16;
}

inline k::Epilogue epilogue_arg(int ep) {
  require(ep >= 0 && ep <= 2, "epilogue must be 0 (Store), 1 (AddResidual) or 2 (SwiGLU), got " + std::to_string(ep));
  return static_cast<k::Epilogue>(ep);
}

// ------------------------------------------------------------------ device copies

template <class T>
inline DeviceBuffer to_device(const py::array_t<T>& a) {
  DeviceBuffer d(static_cast<size_t>(a.nbytes()));
  d.upload(a.data(), static_cast<size_t>(a.nbytes()));
  return d;
}

inline DeviceBuffer device_int(int32_t v) {
  DeviceBuffer d(sizeof(int32_t));
  d.upload(&v, sizeof(v));
  return d;
}

// The RoPE + KV append side of a fused QKV harness (gemv_rmsnorm_rope, gemv_m_rmsnorm_rope), checked and on
// the device: inv_freq f32 [D / 2], caches u16 [C, Hkv, D] (initial contents), pos >= 0, bias f32 [N] or
// None, and a poisoned q of q_elems. args() points a RopeKVArgs at them.
struct RopeInputs {
  int C = 0;
  DeviceBuffer freq, kc, vc, pos, bias, q;
  k::RopeKVArgs args(int H, int Hkv, int D) const {
    k::RopeKVArgs r{freq.get<float>(), pos.get<int32_t>(), H, Hkv, D, C, q.get<bf16>(), kc.get<bf16>(), vc.get<bf16>()};
    r.bias = bias.get<float>();  // null without one
    return r;
  }
};

inline RopeInputs rope_inputs(const py::array& inv_freq_, int pos, int Hkv, int D, const py::array& k_cache_,
                              const py::array& v_cache_, const py::object& bias_, int N, size_t q_elems) {
  auto inv_freq = arg<float>(inv_freq_, "inv_freq", {D / 2});
  auto kc = arg<uint16_t>(k_cache_, "k_cache", {-1, Hkv, D});
  const int C = static_cast<int>(kc.shape(0));
  auto vc = arg<uint16_t>(v_cache_, "v_cache", {C, Hkv, D});
  require(pos >= 0, "need pos >= 0");
  RopeInputs r;
  r.C = C;
  r.freq = to_device(inv_freq);
  r.kc = to_device(kc);
  r.vc = to_device(vc);
  r.pos = device_int(pos);
  r.q = DeviceBuffer::poisoned(sizeof(bf16) * q_elems);
  if (!bias_.is_none()) r.bias = to_device(arg<float>(bias_.cast<py::array>(), "bias", {N}));
  return r;
}

// The SwiGLU GEMV's ticket counters (kernels.h) for every launch of this module: zeroed once, and
// each launch leaves them zeroed. Never freed (a static's destructor could run after the driver).
inline unsigned* gemv_tickets() {
  static unsigned* const t = [] {
    auto* b = new DeviceBuffer(k::kGemvTicketBytes);
    b->fill(0);
    return b->get<unsigned>();
  }();
  return t;
}

// Scale groups of a K-column weight row: 128 columns each, a last one of 64 when K % 128 == 64.
inline py::ssize_t scale_groups(int K) { return (K + 127) / 128; }

// Operand values for the compute-bound timers, from a fixed-seed xorshift64*: e4m3 weight bytes of every
// finite value (never NaN), and 16-bit x as fp16 bits of +-[1, 2) with random mantissas (read as bf16,
// +-[2^-7, 2^-6)). Not zeros or one repeated value: the sm90 GEMM ran up to 13% faster on zero x than on these
// (its Store over the 3B / 8B gate_up weights at 512..4096 rows, H100), and its two ways of running SwiGLU
// ranked otherwise than in the engine (docs/design/gemm_w8a16_sm90.md, "SwiGLU").
inline uint64_t xorshift_star(uint64_t& state) {
  state ^= state >> 12, state ^= state << 25, state ^= state >> 27;
  return state * 0x2545F4914F6CDD1DULL;
}
inline std::vector<uint8_t> random_fp8_bytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  uint64_t st = seed | 1;
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t r = xorshift_star(st);
    for (size_t j = 0; j < 8 && i + j < n; ++j) {
      const uint8_t b = static_cast<uint8_t>(r >> (8 * j));
      v[i + j] = (b & 0x7F) == 0x7F ? b ^ 0x01 : b;  // 0x7F / 0xFF are e4m3's NaNs
    }
  }
  return v;
}
inline std::vector<uint16_t> random_x_bits(size_t n, uint64_t seed) {
  std::vector<uint16_t> v(n);
  uint64_t st = seed | 1;
  for (size_t i = 0; i < n; i += 4) {
    const uint64_t r = xorshift_star(st);
    for (size_t j = 0; j < 4 && i + j < n; ++j) {
      const uint16_t b = static_cast<uint16_t>(r >> (16 * j));
      v[i + j] = static_cast<uint16_t>(0x3C00 | (b & 0x83FF));  // sign, exponent of 1, 10 random mantissa bits
    }
  }
  return v;
}
constexpr float kTimerScale = 1.f / 256;  // every weight scale: |w| <= 448 / 256

// What a GEMM timer launches on: w fp8 [N, K] and x 16-bit [M, K] pseudo-random (above), scales [N, groups]
// all kTimerScale, out fp32 [M, N] zeroed. Compute-bound: no rotation.
struct GemmOperands {
  DeviceBuffer w, s, x, out;
  GemmOperands(int M, int N, int K)
      : w(static_cast<size_t>(N) * K),
        s(sizeof(float) * static_cast<size_t>(N) * scale_groups(K)),
        x(sizeof(bf16) * static_cast<size_t>(M) * K),
        out(sizeof(float) * static_cast<size_t>(M) * N) {
    const std::vector<uint8_t> wb = random_fp8_bytes(static_cast<size_t>(N) * K, 1);
    const std::vector<uint16_t> xb = random_x_bits(static_cast<size_t>(M) * K, 2);
    const std::vector<float> sc(static_cast<size_t>(N) * scale_groups(K), kTimerScale);
    w.upload(wb.data(), wb.size());
    x.upload(xb.data(), sizeof(uint16_t) * xb.size());
    s.upload(sc.data(), sizeof(float) * sc.size());
    out.fill(0);
  }
};

inline void sync() {
  AF_CUDA_CHECK(cudaGetLastError());
  AF_CUDA_CHECK(cudaDeviceSynchronize());
}

template <class T>
inline py::array_t<T> to_host(const DeviceBuffer& d, const std::vector<py::ssize_t>& shape) {
  py::array_t<T> out(shape);
  d.download(out.mutable_data(), static_cast<size_t>(out.nbytes()));
  return out;
}

// ------------------------------------------------------------------ timing

// Copies of a working set, carved out of one allocation, so that consecutive launches never find
// their data in L2 (60 MB on an H200): at least 256 MB in all and at least 2 copies.
struct Rotating {
  size_t stride = 0;
  int copies = 0;
  DeviceBuffer buf;
  explicit Rotating(size_t bytes_per_copy) : stride((std::max<size_t>(bytes_per_copy, 1) + 255) / 256 * 256) {
    copies = static_cast<int>(std::max<size_t>(2, (size_t{256} << 20) / stride + 1));
    buf = DeviceBuffer(stride * copies);
  }
  template <class T>
  T* at(int i, size_t offset = 0) const {
    return reinterpret_cast<T*>(buf.get<uint8_t>() + stride * static_cast<size_t>(i % copies) + offset);
  }
};

// What the timers of the kernels that stream their weights launch on: Rotating copies of an FP8 [N, K]
// weight and its scales, so each launch reads them from DRAM. For a bandwidth-bound kernel random-looking
// bytes are not needed (no DRAM compression on cudaMalloc memory): every byte 0x38 (1.0 in e4m3, and a finite
// fp32 scale) keeps every value finite. random: every copy GemmOperands' pseudo-random weight and kTimerScale
// scales instead, for a compute-bound kernel read from DRAM (time_gemm_sm90's rotate). Launch i takes w(i),
// s(i); batches(): median_us's rotation.
struct RotatingWeights {
  size_t wbytes;
  Rotating copies;
  RotatingWeights(int N, int K, bool random = false)
      : wbytes(static_cast<size_t>(N) * K), copies(wbytes + static_cast<size_t>(N) * scale_groups(K) * sizeof(float)) {
    if (!random) {
      copies.buf.fill(0x38);
      return;
    }
    const std::vector<uint8_t> wb = random_fp8_bytes(wbytes, 1);
    const std::vector<float> sc(static_cast<size_t>(N) * scale_groups(K), kTimerScale);
    for (int i = 0; i < copies.copies; ++i) {
      AF_CUDA_CHECK(cudaMemcpy(w(i), wb.data(), wb.size(), cudaMemcpyHostToDevice));
      AF_CUDA_CHECK(cudaMemcpy(s(i), sc.data(), sizeof(float) * sc.size(), cudaMemcpyHostToDevice));
    }
  }
  uint8_t* w(int i) const { return copies.at<uint8_t>(i); }
  float* s(int i) const { return copies.at<float>(i, wbytes); }
  int batches() const { return std::min(copies.copies, 32); }
};

// A 16-bit activation output's type (out_dtype): "bf16", or "f16" with an overflow flag (kernels.h)
// on the device, zeroed; the call then returns (out, flag).
struct Out16 {
  DeviceBuffer flag;
  bool f16;
  explicit Out16(const std::string& out_dtype) : f16(out_dtype == "f16") {
    require(out_dtype == "bf16" || f16, "out_dtype must be 'bf16' or 'f16', got '" + out_dtype + "'");
    if (f16) {
      flag = DeviceBuffer(sizeof(int32_t));
      flag.fill(0);
    }
  }
  int* ptr() { return f16 ? flag.get<int>() : nullptr; }
  py::object result(py::array out) const {
    if (!f16) return std::move(out);
    return py::make_tuple(out, to_host<int32_t>(flag, {1}).at(0));
  }
};

// One attention call's arguments as every attention harness takes them: q bf16 [M, H, D] at positions
// pos .. pos + M - 1 of the caches bf16 [C, Hkv, D], checked and copied to the device; scale
// 1 / sqrt(D) unless given.
struct AttnArgs {
  int M, H, D, C, Hkv;
  float scale;
  DeviceBuffer q, k_cache, v_cache, pos;
  AttnArgs(const py::array& q_, const py::array& k_cache_, const py::array& v_cache_, int position,
           const py::object& scale_) {
    auto qa = arg<uint16_t>(q_, "q", {-1, -1, -1});
    M = static_cast<int>(qa.shape(0)), H = static_cast<int>(qa.shape(1)), D = static_cast<int>(qa.shape(2));
    auto kc = arg<uint16_t>(k_cache_, "k_cache", {-1, -1, D});
    C = static_cast<int>(kc.shape(0)), Hkv = static_cast<int>(kc.shape(1));
    auto vc = arg<uint16_t>(v_cache_, "v_cache", {C, Hkv, D});
    require(M >= 1 && position >= 0 && position + M <= C, "need M >= 1, pos >= 0 and pos + M <= cache rows");
    scale = scale_.is_none() ? 1.0f / std::sqrt(static_cast<float>(D)) : scale_.cast<float>();
    q = to_device(qa), k_cache = to_device(kc), v_cache = to_device(vc), pos = device_int(position);
  }
};

// The optional extras (kernels.h, QkvExtras) on the device: bias f32 [W], q_norm / k_norm u16 [D] (bf16).
struct DeviceExtras {
  DeviceBuffer bias, q_norm, k_norm;
  k::QkvExtras ex;
  DeviceExtras(const py::object& bias_, const py::object& q_norm_, const py::object& k_norm_, float eps, int W, int D) {
    require(q_norm_.is_none() == k_norm_.is_none(), "q_norm and k_norm come together");
    if (!bias_.is_none()) {
      bias = to_device(arg<float>(bias_.cast<py::array>(), "bias", {W}));
      ex.bias = bias.get<float>();
    }
    if (!q_norm_.is_none()) {
      q_norm = to_device(arg<uint16_t>(q_norm_.cast<py::array>(), "q_norm", {D}));
      k_norm = to_device(arg<uint16_t>(k_norm_.cast<py::array>(), "k_norm", {D}));
      ex.q_norm = q_norm.get<bf16>();
      ex.k_norm = k_norm.get<bf16>();
    }
    ex.eps = eps;
  }
};

// Registration of each harness file (ops.cpp calls them in turn).
void register_gemv(py::module_& m);
void register_gemv_m(py::module_& m);
void register_gemm_sm90(py::module_& m);
void register_gemm_skinny(py::module_& m);
void register_attention(py::module_& m);
void register_attention_prefill(py::module_& m);
void register_small(py::module_& m);
void register_sampling(py::module_& m);
void register_trace(py::module_& m);

}  // namespace atomflow::bindings::ops

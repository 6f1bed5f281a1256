// _core.ops: decode / prefill attention over a contiguous cache (attention_decode.cu), its plan, its timer.
// cluster_merge is the step plan's override (the scratch merge for every shape, the same bits).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>
#include "atomflow/attention_scratch.h"
#include "atomflow/timing.h"
#include "ops_common.h"

namespace atomflow::bindings::ops {

namespace {

using atomflow::attention_scratch;
using atomflow::median_us;

py::object attention(const py::array& q_, const py::array& k_cache_, const py::array& v_cache_, int pos,
                     const py::object& scale_, bool early, const std::string& out_dtype, bool cluster_merge,
                     bool rows_as_steps, bool halved) {
  Out16 o16(out_dtype);
  AttnArgs a(q_, k_cache_, v_cache_, pos, scale_);
  DeviceBuffer scratch = attention_scratch(k::attention_scratch_bytes(a.M, a.H, a.D, a.C));
  DeviceBuffer out = DeviceBuffer::poisoned(sizeof(bf16) * a.M * a.H * a.D);
  const k::AttnPlan plan = k::plan_attention(a.M, a.H, a.Hkv, a.D, a.C, cluster_merge, rows_as_steps, false, halved);
  k::attention(plan, a.q.get<bf16>(), a.k_cache.get<bf16>(), a.v_cache.get<bf16>(), a.pos.get<int32_t>(), a.M, a.H,
               a.Hkv, a.D, a.C, a.scale, scratch.get(), out.get(), nullptr, early, o16.ptr());
  sync();
  return o16.result(to_host<uint16_t>(out, {a.M, a.H, a.D}));
}

// The decode step's attention on the QKV product's raw row (attention_qkv): qkv f32 [(H + 2 Hkv) D] of the
// token at pos, caches u16 [C, Hkv, D] (initial contents) -> (out u16 [1, H, D], k_cache, v_cache).
py::tuple attention_qkv(const py::array& qkv_, const py::array& inv_freq_, int pos, int H, int Hkv,
                        const py::array& k_cache_, const py::array& v_cache_, const py::object& bias_,
                        const py::object& q_norm_, const py::object& k_norm_, float eps, const py::object& scale_,
                        const std::string& out_dtype, bool cluster_merge, bool early, bool halved) {
  require(H >= 1 && Hkv >= 1 && H % Hkv == 0, "need H, Hkv >= 1 and H a multiple of Hkv");
  auto kc = arg<uint16_t>(k_cache_, "k_cache", {-1, Hkv, -1});
  const int C = static_cast<int>(kc.shape(0)), D = static_cast<int>(kc.shape(2));
  auto vc = arg<uint16_t>(v_cache_, "v_cache", {C, Hkv, D});
  const int W = (H + 2 * Hkv) * D;
  auto qkv = arg<float>(qkv_, "qkv", {W});
  auto inv_freq = arg<float>(inv_freq_, "inv_freq", {D / 2});
  require(pos >= 0 && pos < C, "need 0 <= pos < cache rows");
  Out16 o16(out_dtype);
  const float scale = scale_.is_none() ? 1.0f / std::sqrt(static_cast<float>(D)) : scale_.cast<float>();
  DeviceBuffer dqkv = to_device(qkv), dfreq = to_device(inv_freq), dk = to_device(kc), dv = to_device(vc);
  DeviceBuffer dpos = device_int(pos);
  const DeviceExtras extras(bias_, q_norm_, k_norm_, eps, W, D);
  DeviceBuffer scratch = attention_scratch(k::attention_scratch_bytes(1, H, D, C));
  DeviceBuffer out = DeviceBuffer::poisoned(sizeof(bf16) * H * D);
  const k::AttnPlan plan = k::plan_attention(1, H, Hkv, D, C, cluster_merge, false, /*qkv_in=*/true, halved);
  k::attention_qkv(plan, k::AttnQkvIn{dqkv.get<float>(), dfreq.get<float>(), extras.ex}, dk.get<bf16>(), dv.get<bf16>(),
                   dpos.get<int32_t>(), H, Hkv, D, C, scale, scratch.get(), out.get(), nullptr, early, o16.ptr());
  sync();
  return py::make_tuple(o16.result(to_host<uint16_t>(out, {1, H, D})), to_host<uint16_t>(dk, {C, Hkv, D}),
                        to_host<uint16_t>(dv, {C, Hkv, D}));
}

int attention_cluster_size(int M, int H, int Hkv, int D, int max_context, bool cluster_merge) {
  return k::plan_attention(M, H, Hkv, D, max_context, cluster_merge).cluster;
}

// Attention of M query tokens whose last one sees `context` keys (pos = context - M).
double time_attention(int context, int H, int Hkv, int D, int M, int iters, bool early, bool rows_as_steps) {
  require(context >= M && M >= 1, "need context >= M >= 1");
  const int C = context;
  const size_t cache = static_cast<size_t>(C) * Hkv * D * sizeof(bf16);
  Rotating kv(2 * cache);  // K then V of one copy
  kv.buf.fill(0);
  DeviceBuffer q(sizeof(bf16) * M * H * D), out(sizeof(bf16) * M * H * D), pos = device_int(context - M);
  DeviceBuffer scratch = attention_scratch(k::attention_scratch_bytes(M, H, D, C));
  q.fill(0);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const k::AttnPlan plan = k::plan_attention(M, H, Hkv, D, C, true, rows_as_steps);
  return median_us(
      [&](int i) {
        k::attention(plan, q.get<bf16>(), kv.at<bf16>(i), kv.at<bf16>(i, cache), pos.get<int32_t>(), M, H, Hkv, D, C,
                     scale, scratch.get(), out.get<bf16>(), nullptr, early);
      },
      iters, std::min(kv.copies, 32));
}

// The decode step's attention_qkv (the QKV product's raw row in, early) at a position whose step sees
// `context` keys, the plan's grid for those keys; qk_norm: per-head q/k RMSNorm in the prologue (Qwen3);
// halved: AttnPlan::halved. Caches rotated past L2.
double time_attention_qkv(int context, int H, int Hkv, int D, bool qk_norm, bool halved, int iters) {
  require(context >= 1 && H >= 1 && Hkv >= 1 && H % Hkv == 0, "need context >= 1 and H a multiple of Hkv");
  const int C = context, W = (H + 2 * Hkv) * D;
  const size_t cache = static_cast<size_t>(C) * Hkv * D * sizeof(bf16);
  Rotating kv(2 * cache);
  kv.buf.fill(0);
  DeviceBuffer qkv(sizeof(float) * W), freq(sizeof(float) * D / 2), norms(sizeof(bf16) * 2 * D);
  qkv.fill(0x3F), freq.fill(0x3F), norms.fill(0x3F);  // ~0.75 each
  DeviceBuffer out(sizeof(bf16) * H * D), pos = device_int(context - 1);
  DeviceBuffer scratch = attention_scratch(k::attention_scratch_bytes(1, H, D, C));
  k::QkvExtras extras{};
  extras.eps = 1e-6f;
  if (qk_norm) extras.q_norm = norms.get<bf16>(), extras.k_norm = norms.get<bf16>() + D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const k::AttnPlan plan = k::plan_attention(1, H, Hkv, D, C, true, false, /*qkv_in=*/true, halved);
  const k::AttnQkvIn in{qkv.get<float>(), freq.get<float>(), extras};
  return median_us(
      [&](int i) {
        k::attention_qkv(plan, in, kv.at<bf16>(i), kv.at<bf16>(i, cache), pos.get<int32_t>(), H, Hkv, D, C, scale,
                         scratch.get(), out.get(), nullptr, /*early=*/true);
      },
      iters, std::min(kv.copies, 32));
}

}  // namespace

void register_attention(py::module_& m) {
  m.def("attention", &attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("pos"),
        py::arg("scale") = py::none(), py::arg("early") = false, py::arg("out_dtype") = "bf16",
        py::arg("cluster_merge") = true, py::arg("rows_as_steps") = false, py::arg("halved") = false,
        "q u16 [M, H, D], caches u16 [C, Hkv, D], pos -> u16 [M, H, D] (bf16; out_dtype 'f16': (f16 bits, overflow "
        "flag)); early: the cached rows read before the PDL wait (the decode path's mode); rows_as_steps: each row "
        "split as a decode step at its position (M <= 16); halved: ratios 4..8 on two blocks per kv head "
        "(AttnPlan::halved)");
  m.def("attention_qkv", &attention_qkv, py::arg("qkv"), py::arg("inv_freq"), py::arg("pos"), py::arg("H"),
        py::arg("Hkv"), py::arg("k_cache"), py::arg("v_cache"), py::arg("bias") = py::none(),
        py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(), py::arg("eps") = 1e-6f,
        py::arg("scale") = py::none(), py::arg("out_dtype") = "bf16", py::arg("cluster_merge") = true,
        py::arg("early") = false, py::arg("halved") = false,
        "the decode step's attention on the QKV product's raw row: qkv f32 [(H + 2 Hkv) D] of the token at pos, "
        "inv_freq f32 [D/2], caches u16 [C, Hkv, D] (initial contents), optional bias / q_norm / k_norm as "
        "rope_kv_append takes them -> (out u16 [1, H, D] (or (f16 bits, overflow flag)), k_cache, v_cache); "
        "early: the decode step's mode (the position, its angles and the cached rows before the PDL wait); halved: "
        "as attention()'s");
  m.def("attention_cluster_size", &attention_cluster_size, py::arg("M"), py::arg("H"), py::arg("Hkv"), py::arg("D"),
        py::arg("max_context"), py::arg("cluster_merge") = true,
        "blocks per thread-block cluster of an attention call of this shape (1: a plain launch, merged through the "
        "scratch)");
  m.def("time_attention_qkv", &time_attention_qkv, py::arg("context"), py::arg("H"), py::arg("Hkv"), py::arg("D"),
        py::arg("qk_norm") = false, py::arg("halved") = false, py::arg("iters") = 50,
        "us per decode-step attention_qkv call (the raw QKV row in, early; split + merge) seeing `context` keys, "
        "caches rotated past L2; qk_norm: per-head q/k RMSNorm in the prologue; halved: AttnPlan::halved");
  m.def("time_attention", &time_attention, py::arg("context"), py::arg("H"), py::arg("Hkv"), py::arg("D"),
        py::arg("M") = 1, py::arg("iters") = 50, py::arg("early") = false, py::arg("rows_as_steps") = false,
        "us per attention call (split + merge) for M queries, the last seeing `context` keys; caches rotated past L2; "
        "early: the decode step's mode (cached rows read before the PDL wait); rows_as_steps: the verify's plan");
}

}  // namespace atomflow::bindings::ops

// _core.ops: the small kernels: embedding, rmsnorm, add_inplace, all_finite, rope_kv_append, and the
// streaming-read ceiling.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>
#include "atomflow/timing.h"
#include "ops_common.h"

namespace atomflow::bindings::ops {

namespace {

using atomflow::median_us;

py::array_t<float> embedding(const py::array& table_, const py::array& tokens_) {
  auto table = arg<uint16_t>(table_, "table", {-1, -1});
  auto tokens = arg<int32_t>(tokens_, "tokens", {-1});
  const int vocab = static_cast<int>(table.shape(0)), d = static_cast<int>(table.shape(1));
  const int M = static_cast<int>(tokens.shape(0));
  require(M >= 1, "tokens must not be empty");
  DeviceBuffer dt = to_device(table), dtok = to_device(tokens);
  DeviceBuffer out = DeviceBuffer::poisoned(sizeof(float) * M * d);
  k::embedding(dt.get<bf16>(), dtok.get<int32_t>(), M, d, vocab, out.get<float>(), nullptr);
  sync();
  return to_host<float>(out, {M, d});
}

py::array_t<uint16_t> rmsnorm(const py::array& x_, const py::array& w_, float eps) {
  auto x = arg<float>(x_, "x", {-1, -1});
  const int M = static_cast<int>(x.shape(0)), d = static_cast<int>(x.shape(1));
  auto w = arg<uint16_t>(w_, "w", {d});
  DeviceBuffer dx = to_device(x), dw = to_device(w);
  DeviceBuffer out = DeviceBuffer::poisoned(sizeof(f16) * M * d);
  k::rmsnorm(dx.get<float>(), dw.get<bf16>(), M, d, eps, out.get<f16>(), nullptr);
  sync();
  return to_host<uint16_t>(out, {M, d});
}

py::array_t<float> add_inplace(const py::array& x_, const py::array& y_) {
  auto x = arg<float>(x_, "x", {-1});
  const int n = static_cast<int>(x.shape(0));
  auto y = arg<float>(y_, "y", {n});
  DeviceBuffer dx = to_device(x), dy = to_device(y);
  k::add_inplace(dx.get<float>(), dy.get<float>(), n, nullptr);
  sync();
  return to_host<float>(dx, {n});
}

// x[offset:] holds no NaN and no infinity: the kernel's flag (poisoned with 7 before the launch).
int all_finite(const py::array& x_, int offset) {
  auto x = arg<float>(x_, "x", {-1});
  const int n = static_cast<int>(x.shape(0));
  require(offset >= 0 && offset < n, "offset must be in [0, len(x))");
  DeviceBuffer dx = to_device(x), flag(sizeof(int32_t));
  const int32_t seven = 7;
  AF_CUDA_CHECK(cudaMemcpy(flag.get<int32_t>(), &seven, sizeof(seven), cudaMemcpyHostToDevice));
  k::all_finite(dx.get<float>() + offset, n - offset, flag.get<int32_t>(), nullptr);
  sync();
  int32_t got = 0;
  AF_CUDA_CHECK(cudaMemcpy(&got, flag.get<int32_t>(), sizeof(got), cudaMemcpyDeviceToHost));
  return got;
}

py::tuple rope_kv_append(const py::array& qkv_, const py::array& inv_freq_, int pos, int H, int Hkv, int D,
                         const py::array& k_cache_, const py::array& v_cache_, const py::object& bias_,
                         const py::object& q_norm_, const py::object& k_norm_, float eps) {
  require(H >= 1 && Hkv >= 1 && D >= 2 && D % 2 == 0, "need H, Hkv >= 1 and an even D");
  auto qkv = arg<float>(qkv_, "qkv", {-1, static_cast<py::ssize_t>(H + 2 * Hkv) * D});
  const int M = static_cast<int>(qkv.shape(0));
  auto inv_freq = arg<float>(inv_freq_, "inv_freq", {D / 2});
  auto kc = arg<uint16_t>(k_cache_, "k_cache", {-1, Hkv, D});
  const int C = static_cast<int>(kc.shape(0));
  auto vc = arg<uint16_t>(v_cache_, "v_cache", {C, Hkv, D});
  require(M >= 1 && pos >= 0, "need at least one token and pos >= 0");
  DeviceBuffer dqkv = to_device(qkv), dfreq = to_device(inv_freq), dk = to_device(kc), dv = to_device(vc);
  DeviceBuffer dpos = device_int(pos);
  const DeviceExtras extras(bias_, q_norm_, k_norm_, eps, (H + 2 * Hkv) * D, D);
  DeviceBuffer q = DeviceBuffer::poisoned(sizeof(bf16) * M * H * D);
  k::rope_kv_append(dqkv.get<float>(), dfreq.get<float>(), dpos.get<int32_t>(), M, H, Hkv, D, C, q.get<bf16>(),
                    dk.get<bf16>(), dv.get<bf16>(), nullptr, extras.ex);
  sync();
  return py::make_tuple(to_host<uint16_t>(q, {M, H, D}), to_host<uint16_t>(dk, {C, Hkv, D}),
                        to_host<uint16_t>(dv, {C, Hkv, D}));
}

double stream_read_bandwidth(size_t n_bytes, int iters) {
  require(n_bytes >= 16 && n_bytes % 16 == 0, "n_bytes must be a positive multiple of 16");
  DeviceBuffer data(n_bytes), sink(sizeof(uint32_t));
  data.fill(0x5A);
  sink.fill(0);
  const double us =
      median_us([&](int) { k::stream_read(data.get(), n_bytes, sink.get<uint32_t>(), nullptr); }, iters, 3);
  return static_cast<double>(n_bytes) / (us * 1e3);  // bytes / ns = GB/s
}

}  // namespace

void register_small(py::module_& m) {
  m.def("embedding", &embedding, py::arg("table"), py::arg("tokens"),
        "table u16 [vocab, d], tokens i32 [M] -> f32 [M, d]");
  m.def("rmsnorm", &rmsnorm, py::arg("x"), py::arg("w"), py::arg("eps"),
        "x f32 [M, d], w u16 [d] (bf16) -> u16 [M, d] (f16)");
  m.def("add_inplace", &add_inplace, py::arg("x"), py::arg("y"), "x, y f32 [n] -> x + y");
  m.def("all_finite", &all_finite, py::arg("x"), py::arg("offset") = 0,
        "x f32 [n] -> the kernel's flag for x[offset:]: 1 when no value is a NaN or an infinity, else 0");
  m.def("rope_kv_append", &rope_kv_append, py::arg("qkv"), py::arg("inv_freq"), py::arg("pos"), py::arg("H"),
        py::arg("Hkv"), py::arg("D"), py::arg("k_cache"), py::arg("v_cache"), py::arg("bias") = py::none(),
        py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(), py::arg("eps") = 1e-6f,
        "qkv f32 [M, (H + 2 Hkv) D], inv_freq f32 [D/2], caches u16 [C, Hkv, D] (initial contents) -> "
        "(q u16 [M, H, D], k_cache, v_cache); optional bias f32 [(H + 2 Hkv) D] and per-head q_norm / k_norm "
        "u16 [D] (bf16) with eps, applied before RoPE");
  m.def("stream_read_bandwidth", &stream_read_bandwidth, py::arg("n_bytes"), py::arg("iters") = 20,
        "GB/s of the streaming-read kernel (median of iters batches)");
}

}  // namespace atomflow::bindings::ops

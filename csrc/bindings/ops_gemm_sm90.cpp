// _core.ops: the Hopper prefill GEMM (gemm_w8a16_sm90.cu), whether this build has it, and its timer.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "atomflow/timing.h"
#include "ops_common.h"

namespace atomflow::bindings::ops {

namespace {

k::Act act_arg(const std::string& x_dtype) {
  require(x_dtype == "bf16" || x_dtype == "f16", "x_dtype must be 'bf16' or 'f16', got '" + x_dtype + "'");
  return x_dtype == "f16" ? k::Act::F16 : k::Act::BF16;
}

k::Sm90Tile tile_arg(const std::string& tile) {
  for (k::Sm90Tile t : {k::Sm90Tile::Auto, k::Sm90Tile::Wide, k::Sm90Tile::Narrow, k::Sm90Tile::WideStreamK,
                        k::Sm90Tile::NarrowStreamK})
    if (tile == k::sm90_tile_name(t)) return t;
  throw py::value_error("tile must be 'auto', 'wide', 'narrow', 'wide-streamk' or 'narrow-streamk', got '" + tile +
                        "'");
}

// w u8 [N, K], scales f32 [N, ceil(K / 128)], x u16 [M, K]; out_init: AddResidual's starting values.
// Outputs poisoned (NaN) before the launch; the workspace poisoned too, so nothing may rely on it.
py::object gemm_sm90(const py::array& w_, const py::array& s_, const py::array& x_, int ep_,
                     const py::object& out_init_, const std::string& x_dtype, const std::string& tile,
                     bool pretransposed) {
  const k::Act xt = act_arg(x_dtype);
  const k::Epilogue ep = epilogue_arg(ep_);
  auto w = arg<uint8_t>(w_, "w", {-1, -1});
  const int N = static_cast<int>(w.shape(0)), K = static_cast<int>(w.shape(1));
  auto s = arg<float>(s_, "scales", {N, scale_groups(K)});
  auto x = arg<uint16_t>(x_, "x", {-1, K});
  const int M = static_cast<int>(x.shape(0));
  require(k::gemm_w8a16_sm90_supported(ep, M, N, K),
          "gemm_sm90: unsupported shape (needs M >= 1, N % 8 == 0, K % 64 == 0) or a build without it");
  if (ep == k::Epilogue::SwiGLU) require(N % 16 == 0, "SwiGLU needs N = 2F with F % 8 == 0");
  const bool add = ep == k::Epilogue::AddResidual;
  require(add == !out_init_.is_none(), "out_init is required with AddResidual and only with it");
  DeviceBuffer dw = to_device(w), ds = to_device(s), dx = to_device(x);
  const std::vector<py::ssize_t> fp32_shape{M, N};
  DeviceBuffer out =
      add ? to_device(arg<float>(out_init_.cast<py::array>(), "out_init", fp32_shape))
          : DeviceBuffer::poisoned(ep == k::Epilogue::SwiGLU ? sizeof(bf16) * M * (N / 2) : sizeof(float) * M * N);
  const k::Sm90Tile kind = tile_arg(tile);
  const size_t ws_bytes = k::gemm_w8a16_sm90_workspace_bytes(ep, M, N, K, kind);
  DeviceBuffer ws = DeviceBuffer::poisoned(ws_bytes);
  DeviceBuffer scales_gn = DeviceBuffer::poisoned(pretransposed ? sizeof(float) * s.size() : 16);
  if (pretransposed) k::gemm_w8a16_sm90_transpose_scales(ds.get<float>(), N, K, scales_gn.get<float>(), nullptr);
  k::gemm_w8a16_sm90(dw.get<uint8_t>(), ds.get<float>(), dx.get(), xt, M, N, K, ep, out.get(), ws.get(), ws_bytes,
                     nullptr, kind, pretransposed ? scales_gn.get<float>() : nullptr);
  sync();
  if (ep == k::Epilogue::SwiGLU) return to_host<uint16_t>(out, {M, N / 2});
  return to_host<float>(out, fp32_shape);
}

// us per launch (scale transpose + GEMM (+ SwiGLU)), median of iters batches; compute-bound, so the
// weights are not rotated (as time_gemm).
double time_gemm_sm90(int M, int N, int K, int iters, int ep_, const std::string& x_dtype, const std::string& tile) {
  const k::Act xt = act_arg(x_dtype);
  const k::Epilogue ep = epilogue_arg(ep_);
  const k::Sm90Tile kind = tile_arg(tile);
  require(k::gemm_w8a16_sm90_supported(ep, M, N, K), "time_gemm_sm90: unsupported shape or a build without it");
  const size_t ws_bytes = k::gemm_w8a16_sm90_workspace_bytes(ep, M, N, K, kind);
  GemmOperands o(M, N, K);
  DeviceBuffer ws(ws_bytes);
  return median_us(
      [&](int) {
        k::gemm_w8a16_sm90(o.w.get<uint8_t>(), o.s.get<float>(), o.x.get(), xt, M, N, K, ep, o.out.get(), ws.get(),
                           ws_bytes, nullptr, kind);
      },
      iters, 2);
}

// The FP8 recipe (gemm_w8a8_sm90) on the same arguments; outputs and workspace poisoned.
py::object gemm_sm90_w8a8(const py::array& w_, const py::array& s_, const py::array& x_, int ep_,
                          const py::object& out_init_, const std::string& x_dtype) {
  const k::Act xt = act_arg(x_dtype);
  const k::Epilogue ep = epilogue_arg(ep_);
  auto w = arg<uint8_t>(w_, "w", {-1, -1});
  const int N = static_cast<int>(w.shape(0)), K = static_cast<int>(w.shape(1));
  auto s = arg<float>(s_, "scales", {N, (K + 127) / 128});
  auto x = arg<uint16_t>(x_, "x", {-1, K});
  const int M = static_cast<int>(x.shape(0));
  require(k::gemm_w8a16_sm90_built() && k::gemm_w8a16_sm90_supported(ep, M, N, K),
          "gemm_sm90_w8a8: unsupported shape (needs M >= 1, N % 8 == 0, K % 64 == 0) or a build without it");
  if (ep == k::Epilogue::SwiGLU) require(N % 16 == 0, "SwiGLU needs N = 2F with F % 8 == 0");
  const bool add = ep == k::Epilogue::AddResidual;
  require(add == !out_init_.is_none(), "out_init is required with AddResidual and only with it");
  DeviceBuffer dw = to_device(w), ds = to_device(s), dx = to_device(x);
  const std::vector<py::ssize_t> fp32_shape{M, N};
  DeviceBuffer out =
      add ? to_device(arg<float>(out_init_.cast<py::array>(), "out_init", fp32_shape))
          : DeviceBuffer::poisoned(ep == k::Epilogue::SwiGLU ? sizeof(bf16) * M * (N / 2) : sizeof(float) * M * N);
  const size_t ws_bytes = k::gemm_w8a8_sm90_workspace_bytes(ep, M, N, K);
  DeviceBuffer ws = DeviceBuffer::poisoned(ws_bytes);
  k::gemm_w8a8_sm90(dw.get<uint8_t>(), ds.get<float>(), dx.get(), xt, M, N, K, ep, out.get(), ws.get(), ws_bytes,
                    nullptr);
  sync();
  if (ep == k::Epilogue::SwiGLU) return to_host<uint16_t>(out, {M, N / 2});
  return to_host<float>(out, fp32_shape);
}

double time_gemm_sm90_w8a8(int M, int N, int K, int iters, int ep_) {
  const k::Epilogue ep = epilogue_arg(ep_);
  require(k::gemm_w8a16_sm90_built() && k::gemm_w8a16_sm90_supported(ep, M, N, K),
          "time_gemm_sm90_w8a8: unsupported shape or a build without it");
  const size_t wbytes = static_cast<size_t>(N) * K, sbytes = static_cast<size_t>(N) * ((K + 127) / 128) * sizeof(float);
  const size_t ws_bytes = k::gemm_w8a8_sm90_workspace_bytes(ep, M, N, K);
  DeviceBuffer w(wbytes), s(sbytes), x(sizeof(bf16) * M * K), out(sizeof(float) * M * N), ws(ws_bytes);
  w.fill(0x38);
  s.fill(0);
  x.fill(0);
  out.fill(0);
  return median_us(
      [&](int) {
        k::gemm_w8a8_sm90(w.get<uint8_t>(), s.get<float>(), x.get(), k::Act::BF16, M, N, K, ep, out.get(), ws.get(),
                          ws_bytes, nullptr);
      },
      iters, 2);
}

}  // namespace

void register_gemm_sm90(py::module_& m) {
  m.def("gemm_sm90_w8a8", &gemm_sm90_w8a8, py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("epilogue") = 0,
        py::arg("out_init") = py::none(), py::arg("x_dtype") = "bf16",
        "gemm_w8a8_sm90 (the FP8 recipe: x quantized per token per 128 columns) on gemm_sm90's arguments");
  m.def("time_gemm_sm90_w8a8", &time_gemm_sm90_w8a8, py::arg("M"), py::arg("N"), py::arg("K"), py::arg("iters") = 20,
        py::arg("epilogue") = 0, "us per gemm_w8a8_sm90 launch (quantize + GEMM (+ SwiGLU)), bf16 x");
  m.def("gemm_sm90_built", &k::gemm_w8a16_sm90_built,
        "whether this build has gemm_w8a16_sm90 (nvidia-cutlass's headers were found at build time)");
  m.def("gemm_sm90", &gemm_sm90, py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("epilogue") = 0,
        py::arg("out_init") = py::none(), py::arg("x_dtype") = "bf16", py::arg("tile") = "auto",
        py::arg("pretransposed") = false,
        "gemm_w8a16_sm90: w u8 [N, K] (N % 8 == 0, K % 64 == 0), scales f32 [N, ceil(K/128)], x u16 [M, K] (bf16 or "
        "f16 bits); epilogue 0 Store -> f32 [M, N], 1 AddResidual (out_init f32 [M, N]) -> f32 [M, N], 2 SwiGLU -> "
        "u16 [M, N/2] (bf16); tile auto (by M), wide (128 tokens per tile) or narrow (64), -streamk; pretransposed: "
        "the scales transposed first by gemm_w8a16_sm90_transpose_scales and passed as the engine passes them");
  m.def(
      "gemm_sm90_workspace_bytes",
      [](int ep, int M, int N, int K) { return k::gemm_w8a16_sm90_workspace_bytes(epilogue_arg(ep), M, N, K); },
      py::arg("epilogue"), py::arg("M"), py::arg("N"), py::arg("K"));
  m.def("time_gemm_sm90", &time_gemm_sm90, py::arg("M"), py::arg("N"), py::arg("K"), py::arg("iters") = 20,
        py::arg("epilogue") = 0, py::arg("x_dtype") = "bf16", py::arg("tile") = "auto",
        "us per gemm_w8a16_sm90 launch (median of iters batches)");
}

}  // namespace atomflow::bindings::ops

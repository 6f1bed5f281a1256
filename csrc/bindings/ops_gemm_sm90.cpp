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

k::Sm90Tile tile_arg(const std::string& tile) {
  for (k::Sm90Tile t : {k::Sm90Tile::Auto, k::Sm90Tile::Wide, k::Sm90Tile::Narrow, k::Sm90Tile::WideStreamK,
                        k::Sm90Tile::NarrowStreamK, k::Sm90Tile::XWide})
    if (tile == k::sm90_tile_name(t)) return t;
  throw py::value_error("tile must be 'auto', 'xwide', 'wide', 'narrow', 'wide-streamk' or 'narrow-streamk', got '" +
                        tile + "'");
}

k::Sm90Swiglu swiglu_arg(const std::string& swiglu) {
  if (swiglu == "auto") return k::Sm90Swiglu::Auto;
  if (swiglu == "halves") return k::Sm90Swiglu::Halves;
  if (swiglu == "one") return k::Sm90Swiglu::OneLaunch;
  throw py::value_error("swiglu must be 'auto', 'halves' or 'one', got '" + swiglu + "'");
}

// One call of either sm90 GEMM on host arrays: w u8 [N, K], scales f32 [N, ceil(K / 128)], x u16 [M, K];
// out_init: AddResidual's starting values. The operands on the device, the output poisoned (NaN) before
// the launch (or out_init), the workspace poisoned too, so nothing may rely on it.
struct Sm90Call {
  k::Act xt;
  k::Epilogue ep;
  int M = 0, N = 0, K = 0;
  DeviceBuffer dw, ds, dx, out;
  Sm90Call(const char* what, const py::array& w_, const py::array& s_, const py::array& x_, int ep_,
           const py::object& out_init_, const std::string& x_dtype)
      : xt(act_arg(x_dtype)), ep(epilogue_arg(ep_)) {
    auto w = arg<uint8_t>(w_, "w", {-1, -1});
    N = static_cast<int>(w.shape(0)), K = static_cast<int>(w.shape(1));
    auto s = arg<float>(s_, "scales", {N, scale_groups(K)});
    auto x = arg<uint16_t>(x_, "x", {-1, K});
    M = static_cast<int>(x.shape(0));
    require(k::gemm_w8a16_sm90_built() && k::gemm_w8a16_sm90_supported(ep, M, N, K),
            std::string(what) + ": unsupported shape (needs M >= 1, N % 8 == 0, K % 64 == 0) or a build without it");
    if (ep == k::Epilogue::SwiGLU) require(N % 16 == 0, "SwiGLU needs N = 2F with F % 8 == 0");
    const bool add = ep == k::Epilogue::AddResidual;
    require(add == !out_init_.is_none(), "out_init is required with AddResidual and only with it");
    dw = to_device(w), ds = to_device(s), dx = to_device(x);
    out = add ? to_device(arg<float>(out_init_.cast<py::array>(), "out_init", {M, N}))
              : DeviceBuffer::poisoned(ep == k::Epilogue::SwiGLU ? sizeof(bf16) * M * (N / 2) : sizeof(float) * M * N);
  }
  // After the launch: fp32 [M, N], or SwiGLU's bf16 bits [M, N / 2].
  py::object result() {
    sync();
    if (ep == k::Epilogue::SwiGLU) return to_host<uint16_t>(out, {M, N / 2});
    return to_host<float>(out, {M, N});
  }
};

py::object gemm_sm90(const py::array& w_, const py::array& s_, const py::array& x_, int ep_,
                     const py::object& out_init_, const std::string& x_dtype, const std::string& tile,
                     bool pretransposed, const std::string& swiglu) {
  Sm90Call c("gemm_sm90", w_, s_, x_, ep_, out_init_, x_dtype);
  const k::Sm90Tile kind = tile_arg(tile);
  const k::Sm90Swiglu path = swiglu_arg(swiglu);
  const size_t ws_bytes = k::gemm_w8a16_sm90_workspace_bytes(c.ep, c.M, c.N, c.K, kind);
  DeviceBuffer ws = DeviceBuffer::poisoned(ws_bytes);
  DeviceBuffer scales_gn =
      DeviceBuffer::poisoned(pretransposed ? sizeof(float) * static_cast<size_t>(c.N) * scale_groups(c.K) : 16);
  if (pretransposed) k::gemm_w8a16_sm90_transpose_scales(c.ds.get<float>(), c.N, c.K, scales_gn.get<float>(), nullptr);
  k::gemm_w8a16_sm90(c.dw.get<uint8_t>(), c.ds.get<float>(), c.dx.get(), c.xt, c.M, c.N, c.K, c.ep, c.out.get(),
                     ws.get(), ws_bytes, nullptr, kind, pretransposed ? scales_gn.get<float>() : nullptr, true, path);
  return c.result();
}

// us per launch (scale transpose + GEMM (+ SwiGLU)), median of iters batches; compute-bound, so the
// weights are not rotated (as time_gemm), unless rotate: then each launch reads its weights and scales from
// DRAM (a short chunk, bound by the weight stream; as time_gemv_m).
double time_gemm_sm90(int M, int N, int K, int iters, int ep_, const std::string& x_dtype, const std::string& tile,
                      bool rotate, const std::string& swiglu) {
  const k::Act xt = act_arg(x_dtype);
  const k::Epilogue ep = epilogue_arg(ep_);
  const k::Sm90Tile kind = tile_arg(tile);
  const k::Sm90Swiglu path = swiglu_arg(swiglu);
  require(k::gemm_w8a16_sm90_supported(ep, M, N, K), "time_gemm_sm90: unsupported shape or a build without it");
  const size_t ws_bytes = k::gemm_w8a16_sm90_workspace_bytes(ep, M, N, K, kind);
  GemmOperands o(M, N, K);
  DeviceBuffer ws(ws_bytes);
  if (rotate) {
    RotatingWeights r(N, K, /*random=*/true);
    return median_us(
        [&](int i) {
          k::gemm_w8a16_sm90(r.w(i), r.s(i), o.x.get(), xt, M, N, K, ep, o.out.get(), ws.get(), ws_bytes, nullptr, kind,
                             nullptr, true, path);
        },
        iters, r.batches());
  }
  return median_us(
      [&](int) {
        k::gemm_w8a16_sm90(o.w.get<uint8_t>(), o.s.get<float>(), o.x.get(), xt, M, N, K, ep, o.out.get(), ws.get(),
                           ws_bytes, nullptr, kind, nullptr, true, path);
      },
      iters, 2);
}

// The FP8 recipe (gemm_w8a8_sm90) on the same arguments; outputs and workspace poisoned.
py::object gemm_sm90_w8a8(const py::array& w_, const py::array& s_, const py::array& x_, int ep_,
                          const py::object& out_init_, const std::string& x_dtype, bool streamk) {
  Sm90Call c("gemm_sm90_w8a8", w_, s_, x_, ep_, out_init_, x_dtype);
  const size_t ws_bytes = k::gemm_w8a8_sm90_workspace_bytes(c.ep, c.M, c.N, c.K, streamk);
  DeviceBuffer ws = DeviceBuffer::poisoned(ws_bytes);
  k::gemm_w8a8_sm90(c.dw.get<uint8_t>(), c.ds.get<float>(), c.dx.get(), c.xt, c.M, c.N, c.K, c.ep, c.out.get(),
                    ws.get(), ws_bytes, nullptr, streamk);
  return c.result();
}

// us per launch (quantize + GEMM (+ SwiGLU)), bf16 x, median of iters batches (as time_gemm_sm90).
double time_gemm_sm90_w8a8(int M, int N, int K, int iters, int ep_, bool streamk) {
  const k::Epilogue ep = epilogue_arg(ep_);
  require(k::gemm_w8a16_sm90_built() && k::gemm_w8a16_sm90_supported(ep, M, N, K),
          "time_gemm_sm90_w8a8: unsupported shape or a build without it");
  const size_t ws_bytes = k::gemm_w8a8_sm90_workspace_bytes(ep, M, N, K, streamk);
  GemmOperands o(M, N, K);
  DeviceBuffer ws(ws_bytes);
  return median_us(
      [&](int) {
        k::gemm_w8a8_sm90(o.w.get<uint8_t>(), o.s.get<float>(), o.x.get(), k::Act::BF16, M, N, K, ep, o.out.get(),
                          ws.get(), ws_bytes, nullptr, streamk);
      },
      iters, 2);
}

}  // namespace

void register_gemm_sm90(py::module_& m) {
  m.def("gemm_sm90_w8a8", &gemm_sm90_w8a8, py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("epilogue") = 0,
        py::arg("out_init") = py::none(), py::arg("x_dtype") = "bf16", py::arg("streamk") = false,
        "gemm_w8a8_sm90 (the FP8 recipe: x quantized per token per 128 columns) on gemm_sm90's arguments; streamk: "
        "the stream-K scheduler");
  m.def("time_gemm_sm90_w8a8", &time_gemm_sm90_w8a8, py::arg("M"), py::arg("N"), py::arg("K"), py::arg("iters") = 20,
        py::arg("epilogue") = 0, py::arg("streamk") = false,
        "us per gemm_w8a8_sm90 launch (quantize + GEMM (+ SwiGLU)), bf16 x");
  m.def("gemm_sm90_built", &k::gemm_w8a16_sm90_built,
        "whether this build has gemm_w8a16_sm90 (nvidia-cutlass's headers were found at build time)");
  m.def("gemm_sm90", &gemm_sm90, py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("epilogue") = 0,
        py::arg("out_init") = py::none(), py::arg("x_dtype") = "bf16", py::arg("tile") = "auto",
        py::arg("pretransposed") = false, py::arg("swiglu") = "auto",
        "gemm_w8a16_sm90: w u8 [N, K] (N % 8 == 0, K % 64 == 0), scales f32 [N, ceil(K/128)], x u16 [M, K] (bf16 or "
        "f16 bits); epilogue 0 Store -> f32 [M, N], 1 AddResidual (out_init f32 [M, N]) -> f32 [M, N], 2 SwiGLU -> "
        "u16 [M, N/2] (bf16); tile auto (sm90_tile_for), xwide (256 tokens per tile), wide (128) or narrow (64), "
        "-streamk; pretransposed: the scales transposed first by gemm_w8a16_sm90_transpose_scales and passed as the "
        "engine passes them; swiglu: auto (sm90_swiglu_halves), halves (two launches of N/2 rows, the activation in "
        "the up half's epilogue) or one (one launch, then swiglu_rows)");
  m.def(
      "sm90_swiglu_halves",
      [](int M, int F, int sms) {
        require(M >= 1 && F >= 1 && sms >= 1, "sm90_swiglu_halves: M, F and sms must be >= 1");
        return k::sm90_swiglu_halves(M, F, sms);
      },
      py::arg("M"), py::arg("F"), py::arg("sms"),
      "whether gemm_w8a16_sm90's auto runs SwiGLU (N = 2F) as two launches of F rows on a GPU of sms SMs "
      "(kernels.h)");
  m.def(
      "sm90_tile_for",
      [](int M, int N, int sms) {
        require(M >= 1 && N >= 1 && sms >= 1, "sm90_tile_for: M, N and sms must be >= 1");
        return std::string(k::sm90_tile_name(k::sm90_tile_for(M, N, sms)));
      },
      py::arg("M"), py::arg("N"), py::arg("sms"),
      "the tile kind gemm_w8a16_sm90's auto takes for an M x N product on a GPU of sms SMs (kernels.h)");
  m.def(
      "gemm_sm90_workspace_bytes",
      [](int ep, int M, int N, int K) { return k::gemm_w8a16_sm90_workspace_bytes(epilogue_arg(ep), M, N, K); },
      py::arg("epilogue"), py::arg("M"), py::arg("N"), py::arg("K"));
  m.def("time_gemm_sm90", &time_gemm_sm90, py::arg("M"), py::arg("N"), py::arg("K"), py::arg("iters") = 20,
        py::arg("epilogue") = 0, py::arg("x_dtype") = "bf16", py::arg("tile") = "auto", py::arg("rotate") = false,
        py::arg("swiglu") = "auto",
        "us per gemm_w8a16_sm90 launch (median of iters batches); rotate: weights and scales rotated past L2; swiglu "
        "as gemm_sm90's");
}

}  // namespace atomflow::bindings::ops

// _core.ops: the small-M W8A16 GEMV (gemv_w8a16_m.cu), its plan, and its timer. The knobs (nc, slab)
// override the plan table so the tests can run every kernel instance and the benches sweep them.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "atomflow/timing.h"
#include "ops_common.h"

namespace atomflow::bindings::ops {

namespace {

using atomflow::median_us;

// kernel: "auto" (the table's), "tiles" (the tile kernel; implied by nc or slab, its overrides) or "cols"
// (the decode GEMV with token columns wherever it fits, M <= 4; an error where it does not).
k::GemvMPlan plan_of(k::Epilogue ep, k::GemvIn in, int M, int N, int K, int nc, int slab,
                     const std::string& kernel = "auto") {
  require(kernel == "auto" || kernel == "tiles" || kernel == "cols",
          "kernel must be 'auto', 'tiles' or 'cols', got '" + kernel + "'");
  k::GemvMKnobs knobs;
  knobs.nc = nc;
  knobs.slab = slab;
  knobs.tiles = kernel == "tiles" || nc != 0 || slab != 0;
  knobs.cols = kernel == "cols";
  const k::GemvMPlan plan = k::plan_gemv_m(ep, in, M, N, K, knobs);
  require(kernel != "cols" || plan.cols.blocks > 0,
          "kernel 'cols': no token-column plan for M = " + std::to_string(M) + ", K = " + std::to_string(K));
  return plan;
}

// x [M, K]: u16 (bf16 or f16 bits, x_dtype) or, with norm_w, f32 (the residual stream, RMSNorm fused).
py::object gemv_m(const py::array& w_, const py::array& s_, const py::array& x_, int ep_, const py::object& out_init_,
                  const std::string& x_dtype, const py::object& norm_w_, float eps, const std::string& out_dtype,
                  int nc, int slab, const std::string& kernel) {
  const k::Epilogue ep = epilogue_arg(ep_);
  auto w = arg<uint8_t>(w_, "w", {-1, -1});
  const int N = static_cast<int>(w.shape(0)), K = static_cast<int>(w.shape(1));
  require(K % 64 == 0, "w: K = " + std::to_string(K) + " must be a multiple of 64");
  auto s = arg<float>(s_, "scales", {N, scale_groups(K)});
  const bool norm = !norm_w_.is_none();
  k::GemvIn in = k::GemvIn::NORM;
  DeviceBuffer dx, dnw;
  int M = 0;
  if (norm) {
    auto x = arg<float>(x_, "x", {-1, K});
    M = static_cast<int>(x.shape(0));
    dx = to_device(x);
    dnw = to_device(arg<uint16_t>(norm_w_.cast<py::array>(), "norm_w", {K}));
  } else {
    require(x_dtype == "bf16" || x_dtype == "f16", "x_dtype must be 'bf16' or 'f16', got '" + x_dtype + "'");
    in = x_dtype == "f16" ? k::GemvIn::F16 : k::GemvIn::BF16;
    auto x = arg<uint16_t>(x_, "x", {-1, K});
    M = static_cast<int>(x.shape(0));
    dx = to_device(x);
  }
  require(M >= 1 && M <= 64, "x must have 1 to 64 rows, got " + std::to_string(M));
  if (ep == k::Epilogue::SwiGLU) require(N % 2 == 0, "SwiGLU needs an even N (gate rows, then up rows)");
  const bool add = ep == k::Epilogue::AddResidual;
  require(add == !out_init_.is_none(), "out_init is required with AddResidual and only with it");
  Out16 o16(out_dtype);
  require(!o16.f16 || ep == k::Epilogue::SwiGLU, "out_dtype 'f16' is SwiGLU's only");
  DeviceBuffer dw = to_device(w), ds = to_device(s);
  DeviceBuffer out =
      add ? to_device(arg<float>(out_init_.cast<py::array>(), "out_init", {M, N}))
          : DeviceBuffer::poisoned(ep == k::Epilogue::SwiGLU ? sizeof(bf16) * M * (N / 2) : sizeof(float) * M * N);
  const k::GemvMPlan plan = plan_of(ep, in, M, N, K, nc, slab, kernel);
  if (norm)
    k::gemv_w8a16_m_rmsnorm(plan, dw.get<uint8_t>(), ds.get<float>(), dx.get<float>(), dnw.get<bf16>(), eps, M, N, K,
                            ep, out.get(), nullptr, o16.ptr());
  else
    k::gemv_w8a16_m(plan, dw.get<uint8_t>(), ds.get<float>(), dx.get(), static_cast<k::Act>(in), M, N, K, ep, out.get(),
                    nullptr, o16.ptr());
  sync();
  if (ep == k::Epilogue::SwiGLU) return o16.result(to_host<uint16_t>(out, {M, N / 2}));
  return to_host<float>(out, {M, N});
}

// The small-M QKV product with RMSNorm and RoPE + KV append fused: w u8 [(H + 2 Hkv) D, K], scales,
// x f32 [M, K] (the residual stream), norm_w u16 [K], tokens at positions pos .. pos + M - 1, caches
// u16 [C, Hkv, D] (initial contents), bias f32 [(H + 2 Hkv) D] or None -> (q u16 [M, H, D], k_cache,
// v_cache).
py::tuple gemv_m_rmsnorm_rope(const py::array& w_, const py::array& s_, const py::array& x_, const py::array& nw_,
                              float eps, const py::array& inv_freq_, int pos, int H, int Hkv, int D,
                              const py::array& k_cache_, const py::array& v_cache_, const py::object& bias_, int nc,
                              const std::string& kernel) {
  require(H >= 1 && Hkv >= 1 && D >= 2 && D % 2 == 0, "need H, Hkv >= 1 and an even D");
  const int N = (H + 2 * Hkv) * D;
  auto w = arg<uint8_t>(w_, "w", {N, -1});
  const int K = static_cast<int>(w.shape(1));
  require(K % 64 == 0, "w: K = " + std::to_string(K) + " must be a multiple of 64");
  auto s = arg<float>(s_, "scales", {N, scale_groups(K)});
  auto x = arg<float>(x_, "x", {-1, K});
  const int M = static_cast<int>(x.shape(0));
  require(M >= 1 && M <= 64, "x must have 1 to 64 rows, got " + std::to_string(M));
  auto nw = arg<uint16_t>(nw_, "norm_w", {K});
  const RopeInputs r =
      rope_inputs(inv_freq_, pos, Hkv, D, k_cache_, v_cache_, bias_, N, static_cast<size_t>(M) * H * D);
  DeviceBuffer dw = to_device(w), ds = to_device(s), dx = to_device(x), dnw = to_device(nw);
  const k::RopeKVArgs rope = r.args(H, Hkv, D);
  const k::GemvMPlan plan = plan_of(k::Epilogue::RopeKV, k::GemvIn::NORM, M, N, K, nc, 0, kernel);
  k::gemv_w8a16_m_rmsnorm_rope(plan, dw.get<uint8_t>(), ds.get<float>(), dx.get<float>(), dnw.get<bf16>(), eps, M, K,
                               rope, nullptr);
  sync();
  return py::make_tuple(to_host<uint16_t>(r.q, {M, H, D}), to_host<uint16_t>(r.kc, {r.C, Hkv, D}),
                        to_host<uint16_t>(r.vc, {r.C, Hkv, D}));
}

// The plan's choices for a shape, as the tests and `bench_kernels.py` print them.
k::GemvIn in_arg(const std::string& x_in) {
  require(x_in == "bf16" || x_in == "f16" || x_in == "norm", "x_in must be 'bf16', 'f16' or 'norm'");
  return x_in == "norm" ? k::GemvIn::NORM : x_in == "f16" ? k::GemvIn::F16 : k::GemvIn::BF16;
}

py::dict gemv_m_plan(int M, int N, int K, int ep_, const std::string& x_in, int nc, int slab,
                     const std::string& kernel) {
  const k::GemvMPlan p = plan_of(epilogue_arg(ep_), in_arg(x_in), M, N, K, nc, slab, kernel);
  py::dict d;
  d["variant"] = k::gemv_m_variant_name(p);
  d["cols"] = p.cols.blocks > 0;
  d["cols_blocks"] = p.cols.blocks;
  d["cols_smem"] = p.cols.smem;
  d["cols_mt"] = p.cols.mt;
  d["cols_raw_rows"] = p.cols.raw_rows;
  d["nt"] = p.nt;
  d["nc"] = p.nc;
  d["slab"] = p.slab;
  d["keep"] = p.keep;
  d["blocks"] = p.blocks;
  d["smem"] = p.smem;
  return d;
}

// us per launch on x [M, K] (bf16, f16, or the fp32 residual stream normalized in the prologue: x_in),
// weights rotated so L2 cannot serve them (time_gemv's method).
double time_gemv_m(int M, int N, int K, int iters, int ep_, int nc, int slab, const std::string& x_in,
                   const std::string& kernel) {
  const k::Epilogue ep = epilogue_arg(ep_);
  require(K % 64 == 0, "K must be a multiple of 64");
  require(ep != k::Epilogue::RopeKV, "time_gemv_m: the Store, AddResidual and SwiGLU epilogues");
  const k::GemvIn in = in_arg(x_in);
  RotatingWeights ws(N, K);
  DeviceBuffer x((in == k::GemvIn::NORM ? sizeof(float) : sizeof(bf16)) * M * K), out(sizeof(float) * M * N),
      nw(sizeof(bf16) * K);
  x.fill(0);
  out.fill(0);
  nw.fill(0);
  const k::GemvMPlan plan = plan_of(ep, in, M, N, K, nc, slab, kernel);
  return median_us(
      [&](int i) {
        if (in == k::GemvIn::NORM)
          k::gemv_w8a16_m_rmsnorm(plan, ws.w(i), ws.s(i), x.get<float>(), nw.get<bf16>(), 1e-5f, M, N, K, ep, out.get(),
                                  nullptr);
        else
          k::gemv_w8a16_m(plan, ws.w(i), ws.s(i), x.get(), static_cast<k::Act>(in), M, N, K, ep, out.get(), nullptr);
      },
      iters, ws.batches());
}

}  // namespace

void register_gemv_m(py::module_& m) {
  m.def("gemv_m", &gemv_m, py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("epilogue") = 0,
        py::arg("out_init") = py::none(), py::arg("x_dtype") = "bf16", py::arg("norm_w") = py::none(),
        py::arg("eps") = 1e-5f, py::arg("out_dtype") = "bf16", py::arg("nc") = 0, py::arg("slab") = 0,
        py::arg("kernel") = "auto",
        "small-M gemv: w u8 [N, K] (K % 64 == 0), scales f32 [N, ceil(K/128)], x u16 [M, K] (bf16 or f16 bits, "
        "x_dtype) or, given norm_w u16 [K], f32 [M, K] normalized in the prologue; epilogue 0 Store -> f32 [M, N], "
        "1 AddResidual (out_init f32 [M, N]) -> f32 [M, N], 2 SwiGLU -> u16 [M, N/2] (out_dtype 'f16': (bits, flag)); "
        "nc, slab: plan overrides (0: the table's); kernel: 'auto' (the table's), 'tiles' (implied by nc or slab) "
        "or 'cols' (the decode GEMV with token columns)");
  m.def("gemv_m_rmsnorm_rope", &gemv_m_rmsnorm_rope, py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("norm_w"),
        py::arg("eps"), py::arg("inv_freq"), py::arg("pos"), py::arg("H"), py::arg("Hkv"), py::arg("D"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("bias") = py::none(), py::arg("nc") = 0,
        py::arg("kernel") = "auto",
        "small-M QKV gemv with RMSNorm and RoPE + KV append fused: x f32 [M, K] at positions pos.. -> (q u16 "
        "[M, H, D], k_cache, v_cache); the same bits as gemv_m(norm_w=..., Store) then rope_kv_append");
  m.def("gemv_m_plan", &gemv_m_plan, py::arg("M"), py::arg("N"), py::arg("K"), py::arg("epilogue") = 0,
        py::arg("x_in") = "bf16", py::arg("nc") = 0, py::arg("slab") = 0, py::arg("kernel") = "auto",
        "plan_gemv_m's choices for a shape: {variant, cols, cols_blocks, cols_smem, cols_mt, cols_raw_rows, nt, nc, "
        "slab, keep, blocks, smem}");
  m.def("time_gemv_m", &time_gemv_m, py::arg("M"), py::arg("N"), py::arg("K"), py::arg("iters") = 50,
        py::arg("epilogue") = 0, py::arg("nc") = 0, py::arg("slab") = 0, py::arg("x_in") = "bf16",
        py::arg("kernel") = "auto",
        "us per gemv_w8a16_m launch on x [M, K] (x_in 'bf16', 'f16' or 'norm': f32 rows normalized in the prologue; "
        "median of iters batches), weights rotated past L2");
}

}  // namespace atomflow::bindings::ops

// _core.ops: the W8A16 GEMV and GEMM kernels (gemv_w8a16.cu, gemm_w8a16.cu), their plans, and their timers.
// Each GEMV runs with the plan plan_gemv gives its shape; the knobs (tickets, staged_pair) are the
// step plan's overrides, for the tests that compare both schedules in one process.
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

// Scales per row of a [N, K] weight: ceil(K / 128), the last group 64 wide where K % 128 == 64.

// Shared by gemv (M = 1, x [K]) and gemm (x [M, K]). out_init: the AddResidual starting values.
// out_dtype: SwiGLU's output of the gemv (Out16).
py::object linear(const py::array& w_, const py::array& s_, const py::array& x_, int ep_, const py::object& out_init_,
                  bool gemm, const std::string& x_dtype, const std::string& out_dtype = "bf16", bool tickets = true) {
  require(x_dtype == "bf16" || x_dtype == "f16", "x_dtype must be 'bf16' or 'f16', got '" + x_dtype + "'");
  const k::Act xt = x_dtype == "f16" ? k::Act::F16 : k::Act::BF16;
  const k::Epilogue ep = epilogue_arg(ep_);
  auto w = arg<uint8_t>(w_, "w", {-1, -1});
  const int N = static_cast<int>(w.shape(0)), K = static_cast<int>(w.shape(1));
  require(K % 64 == 0, "w: K = " + std::to_string(K) + " must be a multiple of 64");
  auto s = arg<float>(s_, "scales", {N, scale_groups(K)});
  auto x = gemm ? arg<uint16_t>(x_, "x", {-1, K}) : arg<uint16_t>(x_, "x", {K});
  const int M = gemm ? static_cast<int>(x.shape(0)) : 1;
  require(M >= 1, "x must have at least one row");
  if (ep == k::Epilogue::SwiGLU) require(N % 2 == 0, "SwiGLU needs an even N (gate rows, then up rows)");
  const bool add = ep == k::Epilogue::AddResidual;
  require(add == !out_init_.is_none(), "out_init is required with AddResidual and only with it");
  Out16 o16(out_dtype);
  require(!o16.f16 || (ep == k::Epilogue::SwiGLU && !gemm), "out_dtype 'f16' is the SwiGLU gemv's only");

  DeviceBuffer dw = to_device(w), ds = to_device(s), dx = to_device(x);
  const std::vector<py::ssize_t> fp32_shape = gemm ? std::vector<py::ssize_t>{M, N} : std::vector<py::ssize_t>{N};
  DeviceBuffer out;
  if (add) {
    out = to_device(arg<float>(out_init_.cast<py::array>(), "out_init", fp32_shape));
  } else {
    const size_t elem = ep == k::Epilogue::SwiGLU ? sizeof(bf16) : sizeof(float);
    const size_t cols = ep == k::Epilogue::SwiGLU ? N / 2 : N;
    out = DeviceBuffer::poisoned(elem * M * cols);
  }
  if (gemm)
    k::gemm_w8a16(dw.get<uint8_t>(), ds.get<float>(), dx.get(), xt, M, N, K, ep, out.get(), nullptr);
  else
    k::gemv_w8a16(k::plan_gemv(ep, static_cast<k::GemvIn>(xt), N, K, {true, tickets}), dw.get<uint8_t>(),
                  ds.get<float>(), dx.get(), xt, N, K, ep, out.get(), nullptr, gemv_tickets(), o16.ptr());
  sync();
  if (ep != k::Epilogue::SwiGLU) return to_host<float>(out, fp32_shape);
  return o16.result(gemm ? to_host<uint16_t>(out, {M, N / 2}) : to_host<uint16_t>(out, {N / 2}));
}

// The inputs of a GEMV with RMSNorm fused into its prologue, checked and on the device: w u8 [N, K]
// (N: any with -1), scales f32 [N, ceil(K / 128)], x f32 [K] (the residual stream), norm_w u16 [K].
struct NormedGemvInputs {
  int N, K;
  DeviceBuffer w, scales, x, norm_w;
};

NormedGemvInputs normed_gemv_inputs(const py::array& w_, const py::array& s_, const py::array& x_, const py::array& nw_,
                                    py::ssize_t rows = -1) {
  auto w = arg<uint8_t>(w_, "w", {rows, -1});
  const int N = static_cast<int>(w.shape(0)), K = static_cast<int>(w.shape(1));
  require(K % 64 == 0, "w: K = " + std::to_string(K) + " must be a multiple of 64");
  auto s = arg<float>(s_, "scales", {N, scale_groups(K)});
  auto x = arg<float>(x_, "x", {K});
  auto nw = arg<uint16_t>(nw_, "norm_w", {K});
  return NormedGemvInputs{N, K, to_device(w), to_device(s), to_device(x), to_device(nw)};
}

py::object gemv_rmsnorm(const py::array& w_, const py::array& s_, const py::array& x_, const py::array& nw_, float eps,
                        int ep_, const py::object& out_init_, const std::string& out_dtype, bool tickets) {
  const k::Epilogue ep = epilogue_arg(ep_);
  NormedGemvInputs in = normed_gemv_inputs(w_, s_, x_, nw_);
  const int N = in.N, K = in.K;
  if (ep == k::Epilogue::SwiGLU) require(N % 2 == 0, "SwiGLU needs an even N (gate rows, then up rows)");
  const bool add = ep == k::Epilogue::AddResidual;
  require(add == !out_init_.is_none(), "out_init is required with AddResidual and only with it");
  Out16 o16(out_dtype);
  require(!o16.f16 || ep == k::Epilogue::SwiGLU, "out_dtype 'f16' is SwiGLU's only");
  DeviceBuffer out =
      add ? to_device(arg<float>(out_init_.cast<py::array>(), "out_init", {N}))
          : DeviceBuffer::poisoned(ep == k::Epilogue::SwiGLU ? sizeof(bf16) * (N / 2) : sizeof(float) * N);
  k::gemv_w8a16_rmsnorm(k::plan_gemv(ep, k::GemvIn::NORM, N, K, {true, tickets}), in.w.get<uint8_t>(),
                        in.scales.get<float>(), in.x.get<float>(), in.norm_w.get<bf16>(), eps, N, K, ep, out.get(),
                        nullptr, gemv_tickets(), o16.ptr());
  sync();
  if (ep == k::Epilogue::SwiGLU) return o16.result(to_host<uint16_t>(out, {N / 2}));
  return to_host<float>(out, {N});
}

// The head's launch: gemv_rmsnorm(Store) that also leaves each block's argmax key.
py::tuple gemv_rmsnorm_argmax(const py::array& w_, const py::array& s_, const py::array& x_, const py::array& nw_,
                              float eps) {
  NormedGemvInputs in = normed_gemv_inputs(w_, s_, x_, nw_);
  const int N = in.N, K = in.K;
  const k::GemvPlan plan = k::plan_gemv(k::Epilogue::Store, k::GemvIn::NORM, N, K);
  const int blocks = plan.blocks;
  DeviceBuffer out = DeviceBuffer::poisoned(sizeof(float) * N),
               best = DeviceBuffer::poisoned(sizeof(uint64_t) * blocks);
  k::gemv_w8a16_rmsnorm_argmax(plan, in.w.get<uint8_t>(), in.scales.get<float>(), in.x.get<float>(),
                               in.norm_w.get<bf16>(), eps, N, K, out.get<float>(), best.get<uint64_t>(), nullptr);
  sync();
  return py::make_tuple(to_host<float>(out, {N}), to_host<uint64_t>(best, {blocks}));
}

// The decode QKV product with RMSNorm and RoPE + KV append fused: w u8 [(H + 2 Hkv) D, K], scales,
// x f32 [K] (the residual stream), norm_w u16 [K], caches u16 [C, Hkv, D] (initial contents).
py::tuple gemv_rmsnorm_rope(const py::array& w_, const py::array& s_, const py::array& x_, const py::array& nw_,
                            float eps, const py::array& inv_freq_, int pos, int H, int Hkv, int D,
                            const py::array& k_cache_, const py::array& v_cache_, bool staged_pair,
                            const py::object& bias_) {
  require(H >= 1 && Hkv >= 1 && D >= 2 && D % 2 == 0, "need H, Hkv >= 1 and an even D");
  NormedGemvInputs in = normed_gemv_inputs(w_, s_, x_, nw_, (H + 2 * Hkv) * D);
  const int K = in.K;
  const RopeInputs r = rope_inputs(inv_freq_, pos, Hkv, D, k_cache_, v_cache_, bias_, in.N, static_cast<size_t>(H) * D);
  const k::RopeKVArgs rope = r.args(H, Hkv, D);
  const k::GemvPlan plan =
      k::plan_gemv(k::Epilogue::RopeKV, k::GemvIn::NORM, in.N, K, {staged_pair, true}, rope.bias != nullptr);
  k::gemv_w8a16_rmsnorm_rope(plan, in.w.get<uint8_t>(), in.scales.get<float>(), in.x.get<float>(),
                             in.norm_w.get<bf16>(), eps, K, rope, nullptr);
  sync();
  return py::make_tuple(to_host<uint16_t>(r.q, {H, D}), to_host<uint16_t>(r.kc, {r.C, Hkv, D}),
                        to_host<uint16_t>(r.vc, {r.C, Hkv, D}));
}

// The plan's answers the tests check (gemv_w8a16_plan.cpp).
int gemv_qkv_staged_warps(int H, int Hkv, int D, int K, bool staged_pair) {
  require(H >= 1 && Hkv >= 1 && D >= 2 && D % 2 == 0, "need H, Hkv >= 1 and an even D");
  return k::plan_gemv(k::Epilogue::RopeKV, k::GemvIn::NORM, (H + 2 * Hkv) * D, K, {staged_pair, true}).staged_warps;
}

bool gemv_swiglu_ticketed(int N, int K, bool norm, bool tickets) {
  return k::plan_gemv(k::Epilogue::SwiGLU, norm ? k::GemvIn::NORM : k::GemvIn::F16, N, K, {true, tickets}).ticketed;
}

int gemv_argmax_blocks(int N, int K) { return k::plan_gemv(k::Epilogue::Store, k::GemvIn::NORM, N, K).blocks; }

double time_gemv(int N, int K, int iters, int ep_) {
  const k::Epilogue ep = epilogue_arg(ep_);
  RotatingWeights ws(N, K);
  DeviceBuffer x(sizeof(bf16) * K), out(sizeof(float) * N);
  x.fill(0);
  out.fill(0);
  const k::GemvPlan plan = k::plan_gemv(ep, k::GemvIn::BF16, N, K);
  return median_us(
      [&](int i) {
        k::gemv_w8a16(plan, ws.w(i), ws.s(i), x.get(), k::Act::BF16, N, K, ep, out.get(), nullptr, gemv_tickets());
      },
      iters, ws.batches());
}

double time_gemm(int M, int N, int K, int iters, int ep_) {
  const k::Epilogue ep = epilogue_arg(ep_);
  GemmOperands o(M, N, K);
  return median_us(
      [&](int) {
        k::gemm_w8a16(o.w.get<uint8_t>(), o.s.get<float>(), o.x.get(), k::Act::BF16, M, N, K, ep, o.out.get(), nullptr);
      },
      iters, 2);
}

}  // namespace

void register_gemv(py::module_& m) {
  m.def(
      "gemv",
      [](const py::array& w, const py::array& s, const py::array& x, int ep, const py::object& out_init,
         const std::string& x_dtype, const std::string& out_dtype,
         bool tickets) { return linear(w, s, x, ep, out_init, false, x_dtype, out_dtype, tickets); },
      py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("epilogue") = 0, py::arg("out_init") = py::none(),
      py::arg("x_dtype") = "bf16", py::arg("out_dtype") = "bf16", py::arg("tickets") = true,
      "w u8 [N, K] (K % 64 == 0), scales f32 [N, ceil(K/128)], x u16 [K] (bf16 or f16 bits, x_dtype); "
      "epilogue 0 Store -> f32 [N], 1 AddResidual (out_init f32 [N]) -> f32 [N], 2 SwiGLU -> u16 [N/2] (bf16; "
      "out_dtype 'f16': (f16 bits, overflow flag))");
  m.def("gemv_qkv_staged_warps", &gemv_qkv_staged_warps, py::arg("H"), py::arg("Hkv"), py::arg("D"), py::arg("K"),
        py::arg("staged_pair") = true,
        "warps per block of the decode QKV launch of this shape that copy their second row pair into shared memory "
        "early (0: none)");
  m.def("gemv_swiglu_ticketed", &gemv_swiglu_ticketed, py::arg("N"), py::arg("K"), py::arg("norm") = false,
        py::arg("tickets") = true,
        "whether a SwiGLU gemv of w [N, K] (norm: with the fused RMSNorm) hands its row pairs past the first round "
        "out by ticket");
  m.def("gemv_rmsnorm", &gemv_rmsnorm, py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("norm_w"), py::arg("eps"),
        py::arg("epilogue") = 0, py::arg("out_init") = py::none(), py::arg("out_dtype") = "bf16",
        py::arg("tickets") = true,
        "gemv of bf16(rmsnorm(x f32 [K]) * norm_w u16 [K]); epilogues and out_dtype as gemv");
  m.def("gemv_rmsnorm_argmax", &gemv_rmsnorm_argmax, py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("norm_w"),
        py::arg("eps"),
        "the head's launch: gemv_rmsnorm Store -> (f32 [N], u64 [blocks]: each block's max of order key << 32 | ~row "
        "over the rows it wrote)");
  m.def("gemv_argmax_blocks", &gemv_argmax_blocks, py::arg("N"), py::arg("K"),
        "entries of gemv_rmsnorm_argmax's block maxima (its grid)");
  m.def(
      "gemm",
      [](const py::array& w, const py::array& s, const py::array& x, int ep, const py::object& out_init,
         const std::string& x_dtype) { return linear(w, s, x, ep, out_init, true, x_dtype); },
      py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("epilogue") = 0, py::arg("out_init") = py::none(),
      py::arg("x_dtype") = "bf16", "like gemv with x u16 [M, K] and outputs [M, ...]");
  m.def("gemv_rmsnorm_rope", &gemv_rmsnorm_rope, py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("norm_w"),
        py::arg("eps"), py::arg("inv_freq"), py::arg("pos"), py::arg("H"), py::arg("Hkv"), py::arg("D"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("staged_pair") = true, py::arg("bias") = py::none(),
        "RMSNorm -> QKV GEMV (+ bias f32 [N]) -> RoPE + KV append in one launch -> (q u16 [H, D], k_cache, v_cache)");
  m.def("time_gemv", &time_gemv, py::arg("N"), py::arg("K"), py::arg("iters") = 50, py::arg("epilogue") = 0,
        "us per gemv_w8a16 launch (median of iters batches), weights rotated so L2 cannot serve them");
  m.def("time_gemm", &time_gemm, py::arg("M"), py::arg("N"), py::arg("K"), py::arg("iters") = 20,
        py::arg("epilogue") = 0, "us per gemm_w8a16 launch (median of iters batches)");
}

}  // namespace atomflow::bindings::ops

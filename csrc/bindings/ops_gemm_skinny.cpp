// _core.ops: the skinny W8A16 GEMM for prompt chunks of up to 64 rows (gemm_w8a16_skinny.cu), its QKV
// product with RoPE + KV append, its plan, and its timer. splits overrides the plan's split of the scale
// groups (0: the plan's choice), so the tests can run every cluster size and the benches sweep them.
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

// The shape checks every entry point shares, then plan_gemm_skinny: the shape within the kernel's
// contract (kernels.h); splits 0 (the plan's) or enough splits of at most kSkinnyMaxGroups scale groups
// each to cover K, at most kSkinnyMaxSplits and at most the scale groups.
k::SkinnyPlan plan_of(const char* what, k::Epilogue ep, k::Act xt, int M, int N, int K, int splits) {
  require(k::gemm_w8a16_skinny_supported(ep, M, N, K),
          std::string(what) + ": unsupported shape M = " + std::to_string(M) + ", N = " + std::to_string(N) +
              ", K = " + std::to_string(K) + " (needs 1 <= M <= " + std::to_string(k::kSkinnyMaxRows) +
              ", N % 16 == 0 (SwiGLU: N % 32 == 0), K % 64 == 0, at most " +
              std::to_string(k::kSkinnyMaxSplits * k::kSkinnyMaxGroups) + " scale groups)");
  const int groups = static_cast<int>(scale_groups(K));
  const int least = (groups + k::kSkinnyMaxGroups - 1) / k::kSkinnyMaxGroups;
  const int most = std::min(k::kSkinnyMaxSplits, groups);
  require(splits == 0 || (splits >= least && splits <= most),
          std::string(what) + ": splits must be 0 (the plan's) or " + std::to_string(least) + ".." +
              std::to_string(most) + " for K = " + std::to_string(K) + ", got " + std::to_string(splits));
  return k::plan_gemm_skinny(ep, xt, M, N, K, splits);
}

// The operands every product entry point takes: w u8 [N, K] (N fixed when n >= 0), scales f32 [N, ceil(K /
// 128)], x u16 [M, K]; checked in that order, then on the device.
struct Operands {
  int N = 0, K = 0, M = 0;
  DeviceBuffer w, s, x;
  Operands(const py::array& w_, const py::array& s_, const py::array& x_, py::ssize_t n = -1) {
    auto wa = arg<uint8_t>(w_, "w", {n, -1});
    N = static_cast<int>(wa.shape(0)), K = static_cast<int>(wa.shape(1));
    auto sa = arg<float>(s_, "scales", {N, scale_groups(K)});
    auto xa = arg<uint16_t>(x_, "x", {-1, K});
    M = static_cast<int>(xa.shape(0));
    w = to_device(wa), s = to_device(sa), x = to_device(xa);
  }
};

// A split RMSNorm's second half (kernels.h, SkinnyNormIn): norm_ss f32 [M, P] on the device, or nothing for None.
struct NormIn {
  DeviceBuffer ss;
  k::SkinnyNormIn in;
  bool on = false;
  NormIn(const py::object& ss_, int M, int d, float eps) {
    if (ss_.is_none()) return;
    auto a = arg<float>(ss_.cast<py::array>(), "norm_ss", {M, -1});
    require(a.shape(1) >= 1 && d >= 1 && eps > 0.f, "norm_ss needs a column, norm_d >= 1 and norm_eps > 0");
    ss = to_device(a);
    in = k::SkinnyNormIn{ss.get<float>(), static_cast<int>(a.shape(1)), d, eps};
    on = true;
  }
  const k::SkinnyNormIn* get() const { return on ? &in : nullptr; }
};

// w u8 [N, K], scales f32 [N, ceil(K / 128)], x u16 [M, K] (x_dtype bits); out_init: AddResidual's
// starting values. The output poisoned (NaN) before the launch unless AddResidual. norm_ss (not AddResidual;
// x bf16): a split RMSNorm's sums of squares [M, P], the rows' sums scaled by rsqrt(sum / norm_d + norm_eps).
py::object gemm_skinny(const py::array& w_, const py::array& s_, const py::array& x_, int ep_,
                       const py::object& out_init_, const std::string& x_dtype, int splits, const py::object& norm_ss,
                       int norm_d, float norm_eps) {
  const k::Act xt = act_arg(x_dtype);
  const k::Epilogue ep = epilogue_arg(ep_);
  const Operands op(w_, s_, x_);
  const int N = op.N, K = op.K, M = op.M;
  const k::SkinnyPlan plan = plan_of("gemm_skinny", ep, xt, M, N, K, splits);
  const bool add = ep == k::Epilogue::AddResidual;
  require(add == !out_init_.is_none(), "out_init is required with AddResidual and only with it");
  DeviceBuffer out =
      add ? to_device(arg<float>(out_init_.cast<py::array>(), "out_init", {M, N}))
          : DeviceBuffer::poisoned(ep == k::Epilogue::SwiGLU ? sizeof(bf16) * M * (N / 2) : sizeof(float) * M * N);
  const NormIn nin(norm_ss, M, norm_d, norm_eps);
  k::gemm_w8a16_skinny(plan, op.w.get<uint8_t>(), op.s.get<float>(), op.x.get(), out.get(), nullptr, nullptr,
                       nin.get());
  sync();
  if (ep == k::Epilogue::SwiGLU) return to_host<uint16_t>(out, {M, N / 2});
  return to_host<float>(out, {M, N});
}

// A split RMSNorm's first half: the AddResidual product out_init + x w^T that also leaves, for the norm of
// weight norm_w u16 [N] (bf16), xw u16 [M, N] = bf16(out * norm_w) and each row group's sums of squares ->
// (out f32 [M, N], xw u16 [M, N], ss f32 [M, row_groups]); xw and ss poisoned before the launch.
py::tuple gemm_skinny_norm_out(const py::array& w_, const py::array& s_, const py::array& x_,
                               const py::array& out_init_, const py::array& nw_, const std::string& x_dtype,
                               int splits) {
  const k::Act xt = act_arg(x_dtype);
  const Operands op(w_, s_, x_);
  const int N = op.N, K = op.K, M = op.M;
  auto nw = arg<uint16_t>(nw_, "norm_w", {N});
  const k::SkinnyPlan plan = plan_of("gemm_skinny_norm_out", k::Epilogue::AddResidual, xt, M, N, K, splits);
  const int parts = k::skinny_norm_parts(N);
  DeviceBuffer dnw = to_device(nw);
  DeviceBuffer out = to_device(arg<float>(out_init_, "out_init", {M, N}));
  DeviceBuffer xw = DeviceBuffer::poisoned(sizeof(bf16) * M * N),
               ss = DeviceBuffer::poisoned(sizeof(float) * M * parts);
  const k::SkinnyNormOut nout{dnw.get<bf16>(), xw.get<bf16>(), ss.get<float>()};
  k::gemm_w8a16_skinny(plan, op.w.get<uint8_t>(), op.s.get<float>(), op.x.get(), out.get(), nullptr, &nout);
  sync();
  return py::make_tuple(to_host<float>(out, {M, N}), to_host<uint16_t>(xw, {M, N}), to_host<float>(ss, {M, parts}));
}

// The QKV product with RoPE + KV append in its epilogue: w u8 [(H + 2 Hkv) D, K], scales, x u16 [M, K]
// (x_dtype bits), tokens at positions pos .. pos + M - 1, caches u16 [C, Hkv, D] (initial contents), bias f32
// [(H + 2 Hkv) D] or None -> (q u16 [M, H, D] (poisoned before the launch), k_cache, v_cache).
py::tuple gemm_skinny_rope(const py::array& w_, const py::array& s_, const py::array& x_, const py::array& inv_freq_,
                           int pos, int H, int Hkv, int D, const py::array& k_cache_, const py::array& v_cache_,
                           const py::object& bias_, const std::string& x_dtype, int splits, const py::object& norm_ss,
                           int norm_d, float norm_eps) {
  const k::Act xt = act_arg(x_dtype);
  require(H >= 1 && Hkv >= 1 && D >= 2 && D % 2 == 0, "need H, Hkv >= 1 and an even D");
  const Operands op(w_, s_, x_, (H + 2 * Hkv) * D);
  const int N = op.N, K = op.K, M = op.M;
  require(k::gemm_w8a16_skinny_rope_supported(N, H, Hkv, D),
          "gemm_skinny_rope: head_dim must be a multiple of 8 that divides 128, got " + std::to_string(D));
  const k::SkinnyPlan plan = plan_of("gemm_skinny_rope", k::Epilogue::RopeKV, xt, M, N, K, splits);
  const RopeInputs r =
      rope_inputs(inv_freq_, pos, Hkv, D, k_cache_, v_cache_, bias_, N, static_cast<size_t>(M) * H * D);
  const NormIn nin(norm_ss, M, norm_d, norm_eps);
  k::gemm_w8a16_skinny_rope(plan, op.w.get<uint8_t>(), op.s.get<float>(), op.x.get(), r.args(H, Hkv, D), nullptr,
                            nin.get());
  sync();
  return py::make_tuple(to_host<uint16_t>(r.q, {M, H, D}), to_host<uint16_t>(r.kc, {r.C, Hkv, D}),
                        to_host<uint16_t>(r.vc, {r.C, Hkv, D}));
}

// The plan's fields for a shape, as the tests and `bench_kernels.py` print them.
py::dict gemm_skinny_plan(int M, int N, int K, int ep_, const std::string& x_dtype, int splits) {
  const k::SkinnyPlan p = plan_of("gemm_skinny_plan", epilogue_arg(ep_), act_arg(x_dtype), M, N, K, splits);
  py::dict d;
  d["nt"] = p.nt;
  d["splits"] = p.splits;
  d["kg"] = p.kg;
  d["row_groups"] = p.row_groups;
  d["threads"] = p.threads;
  d["smem"] = p.smem;
  return d;
}

// us per launch on x [M, K] of x_dtype, weights and scales rotated so L2 cannot serve them (time_gemv_m's
// method: the kernel streams its weights, so an L2-resident copy would time another kernel).
double time_gemm_skinny(int M, int N, int K, int iters, int ep_, const std::string& x_dtype, int splits) {
  const k::Act xt = act_arg(x_dtype);
  const k::Epilogue ep = epilogue_arg(ep_);
  const k::SkinnyPlan plan = plan_of("time_gemm_skinny", ep, xt, M, N, K, splits);
  RotatingWeights ws(N, K);
  DeviceBuffer x(sizeof(bf16) * M * K), out(sizeof(float) * M * N);
  x.fill(0);
  out.fill(0);
  return median_us([&](int i) { k::gemm_w8a16_skinny(plan, ws.w(i), ws.s(i), x.get(), out.get(), nullptr); }, iters,
                   ws.batches());
}

}  // namespace

void register_gemm_skinny(py::module_& m) {
  m.def("gemm_skinny", &gemm_skinny, py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("epilogue") = 0,
        py::arg("out_init") = py::none(), py::arg("x_dtype") = "bf16", py::arg("splits") = 0,
        py::arg("norm_ss") = py::none(), py::arg("norm_d") = 0, py::arg("norm_eps") = 1e-5f,
        "gemm_w8a16_skinny: w u8 [N, K] (N % 16 == 0, K % 64 == 0), scales f32 [N, ceil(K/128)], x u16 [M, K] "
        "(1 <= M <= 64; bf16 or f16 bits, x_dtype); epilogue 0 Store -> f32 [M, N], 1 AddResidual (out_init f32 "
        "[M, N]) -> f32 [M, N], 2 SwiGLU (N % 32 == 0) -> u16 [M, N/2] (bf16); splits: the cluster's split of the "
        "scale groups (0: the plan's); norm_ss f32 [M, P] (not AddResidual, bf16 x): each row's sums times "
        "rsqrt(sum(norm_ss[m]) / norm_d + norm_eps)");
  m.def("gemm_skinny_norm_out", &gemm_skinny_norm_out, py::arg("w"), py::arg("scales"), py::arg("x"),
        py::arg("out_init"), py::arg("norm_w"), py::arg("x_dtype") = "bf16", py::arg("splits") = 0,
        "gemm_w8a16_skinny's AddResidual with a split RMSNorm's first half -> (out f32 [M, N], xw u16 [M, N] = "
        "bf16(out * norm_w), ss f32 [M, row_groups]: each row's sum of squares over each 128 columns of out)");
  m.def("gemm_skinny_rope", &gemm_skinny_rope, py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("inv_freq"),
        py::arg("pos"), py::arg("H"), py::arg("Hkv"), py::arg("D"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("bias") = py::none(), py::arg("x_dtype") = "bf16", py::arg("splits") = 0,
        py::arg("norm_ss") = py::none(), py::arg("norm_d") = 0, py::arg("norm_eps") = 1e-5f,
        "gemm_w8a16_skinny_rope: the QKV product of x u16 [M, K] at positions pos.. with RoPE + KV append in its "
        "epilogue -> (q u16 [M, H, D], k_cache, v_cache); the same bits as gemm_skinny (Store) then rope_kv_append");
  m.def("gemm_skinny_plan", &gemm_skinny_plan, py::arg("M"), py::arg("N"), py::arg("K"), py::arg("epilogue") = 0,
        py::arg("x_dtype") = "bf16", py::arg("splits") = 0,
        "plan_gemm_skinny's choices for a shape: {nt, splits, kg, row_groups, threads, smem}");
  m.def("time_gemm_skinny", &time_gemm_skinny, py::arg("M"), py::arg("N"), py::arg("K"), py::arg("iters") = 50,
        py::arg("epilogue") = 0, py::arg("x_dtype") = "bf16", py::arg("splits") = 0,
        "us per gemm_w8a16_skinny launch on x [M, K] (median of iters batches), weights and scales rotated past L2");
}

}  // namespace atomflow::bindings::ops

// _core.ops: prefill attention on tensor cores (attention_prefill.cu), its plan, its timer.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "atomflow/timing.h"
#include "ops_common.h"

namespace atomflow::bindings::ops {

namespace {

using atomflow::median_us;

// The plan on this GPU for a chunk after `prior` cached keys; kernel "auto" | "mma" | "wgmma" and key_groups 1 or
// 2 (the mma kernel's) override the plan's kernel, splits (the wgmma kernel's, >= 1) its splits.
// sm_count: the plan for a GPU of that many SMs (None: this one's).
k::PrefillAttnPlan prefill_plan(int M, int H, int Hkv, int D, const py::object& key_groups, const std::string& kernel,
                                int prior, const py::object& splits, const py::object& sm_count = py::none()) {
  int sms = 0;
  if (sm_count.is_none())
    AF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  else
    sms = sm_count.cast<int>();
  require(sms >= 1, "sm_count must be >= 1");
  require(kernel == "auto" || kernel == "mma" || kernel == "wgmma", "kernel must be 'auto', 'mma' or 'wgmma'");
  // key_groups is the Mma kernel's: given, it picks that kernel.
  const k::PrefillAttnKernel kind = kernel == "mma" || (kernel == "auto" && !key_groups.is_none())
                                        ? k::PrefillAttnKernel::Mma
                                    : kernel == "wgmma" ? k::PrefillAttnKernel::Wgmma
                                                        : k::PrefillAttnKernel::Auto;
  if (!key_groups.is_none()) {
    const int kg = key_groups.cast<int>();
    require(kg == 1 || kg == 2, "key_groups must be 1 or 2");
    require(kind == k::PrefillAttnKernel::Mma, "key_groups is the mma kernel's");
    sms = kg == 2 ? INT_MAX : 0;  // plan_attention_prefill: two groups when blocks <= sm_count, one for 0
  }
  k::PrefillAttnPlan p = k::plan_attention_prefill(M, H, Hkv, D, sms, kind, prior);
  if (!splits.is_none()) {
    const int n = splits.cast<int>();
    require(p.kernel == k::PrefillAttnKernel::Wgmma, "splits is the wgmma kernel's");
    require(n >= 1 && n <= k::kPrefillAttnMaxSplits,
            "splits must be in 1.." + std::to_string(k::kPrefillAttnMaxSplits));
    p.splits = n;
  }
  return p;
}

py::array_t<uint16_t> attention_prefill(const py::array& q_, const py::array& k_cache_, const py::array& v_cache_,
                                        int pos, const py::object& scale_, const py::object& key_groups,
                                        const std::string& kernel, const py::object& splits) {
  AttnArgs a(q_, k_cache_, v_cache_, pos, scale_);
  const k::PrefillAttnPlan plan = prefill_plan(a.M, a.H, a.Hkv, a.D, key_groups, kernel, pos, splits);
  DeviceBuffer out = DeviceBuffer::poisoned(sizeof(bf16) * a.M * a.H * a.D);
  DeviceBuffer scratch = DeviceBuffer::poisoned(std::max<size_t>(k::attention_prefill_scratch_bytes(plan), 16));
  k::attention_prefill(plan, a.q.get<bf16>(), a.k_cache.get<bf16>(), a.v_cache.get<bf16>(), a.pos.get<int32_t>(), a.M,
                       a.H, a.Hkv, a.D, a.C, a.scale, out.get<bf16>(), nullptr, scratch.get<void>());
  sync();
  return to_host<uint16_t>(out, {a.M, a.H, a.D});
}

py::dict attention_prefill_plan(int M, int H, int Hkv, int D, const py::object& key_groups, const std::string& kernel,
                                int prior, const py::object& sm_count) {
  const k::PrefillAttnPlan p = prefill_plan(M, H, Hkv, D, key_groups, kernel, prior, py::none(), sm_count);
  py::dict d;
  d["kernel"] = k::attention_prefill_name(p);
  d["tiles"] = p.tiles;
  d["blocks"] = p.tiles * p.Hkv;
  d["key_groups"] = p.key_groups;
  d["threads"] = p.threads;
  d["smem"] = p.smem;
  d["splits"] = p.splits;
  d["scratch_bytes"] = k::attention_prefill_scratch_bytes(p);
  return d;
}

// A chunk of M query tokens after `prior` cached ones (pos = prior); caches rotated past L2.
double time_attention_prefill(int M, int prior, int H, int Hkv, int D, int iters, const py::object& key_groups,
                              const std::string& kernel, const py::object& splits) {
  require(M >= 1 && prior >= 0, "need M >= 1 and prior >= 0");
  const int C = prior + M;
  const size_t cache = static_cast<size_t>(C) * Hkv * D * sizeof(bf16);
  Rotating kv(2 * cache);  // K then V of one copy
  kv.buf.fill(0);
  DeviceBuffer q(sizeof(bf16) * M * H * D), out(sizeof(bf16) * M * H * D), pos = device_int(prior);
  q.fill(0);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const k::PrefillAttnPlan plan = prefill_plan(M, H, Hkv, D, key_groups, kernel, prior, splits);
  DeviceBuffer scratch(std::max<size_t>(k::attention_prefill_scratch_bytes(plan), 16));
  return median_us(
      [&](int i) {
        k::attention_prefill(plan, q.get<bf16>(), kv.at<bf16>(i), kv.at<bf16>(i, cache), pos.get<int32_t>(), M, H, Hkv,
                             D, C, scale, out.get<bf16>(), nullptr, scratch.get<void>());
      },
      iters, std::min(kv.copies, 8));
}

}  // namespace

void register_attention_prefill(py::module_& m) {
  m.def("attention_prefill", &attention_prefill, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("pos"),
        py::arg("scale") = py::none(), py::arg("key_groups") = py::none(), py::arg("kernel") = "auto",
        py::arg("splits") = py::none(),
        "q u16 [M, H, D], caches u16 [C, Hkv, D], pos -> u16 [M, H, D] (bf16): causal GQA attention of a prefill "
        "chunk on tensor cores, planned for pos cached keys; kernel 'mma' | 'wgmma', key_groups 1 or 2 (mma) and "
        "splits (wgmma; the scratch comes poisoned) override the plan's");
  m.def("attention_prefill_plan", &attention_prefill_plan, py::arg("M"), py::arg("H"), py::arg("Hkv"), py::arg("D"),
        py::arg("key_groups") = py::none(), py::arg("kernel") = "auto", py::arg("prior") = 0,
        py::arg("sm_count") = py::none(),
        "the launch plan of attention_prefill for this shape after `prior` cached keys on this GPU (or one of "
        "sm_count SMs: no GPU needed)");
  m.def(
      "attention_prefill_scratch_max",
      [](int D, int sm_count) {
        require(sm_count >= 1, "sm_count must be >= 1");
        return k::attention_prefill_scratch_max(D, sm_count);
      },
      py::arg("D"), py::arg("sm_count"),
      "the scratch bytes the engine reserves for the prefill attention's split partials (kernels.h)");
  m.def("time_attention_prefill", &time_attention_prefill, py::arg("M"), py::arg("prior"), py::arg("H"), py::arg("Hkv"),
        py::arg("D"), py::arg("iters") = 20, py::arg("key_groups") = py::none(), py::arg("kernel") = "auto",
        py::arg("splits") = py::none(),
        "us per attention_prefill call: M query tokens after `prior` cached keys; caches rotated past L2");
}

}  // namespace atomflow::bindings::ops

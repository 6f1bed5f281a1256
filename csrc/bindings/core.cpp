// _core: the CUDA engine for Python. Argument checks and conversions only; the engine lives in
// csrc/core and knows nothing of Python. C++ std::invalid_argument surfaces as ValueError,
// std::runtime_error (CUDA errors included) as RuntimeError.
#include <cuda_profiler_api.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <cstdint>
#include <memory>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "atomflow/device.h"
#include "atomflow/engine.h"
#include "plan.h"

namespace py = pybind11;
using namespace atomflow;

void register_ops(pybind11::module_& m);  // csrc/bindings/ops.cpp: the kernel test harness

namespace atomflow::bindings {

namespace {

template <class T>
T field(const py::dict& d, const char* what, const char* key) {
  if (!d.contains(key)) throw py::value_error(std::string(what) + " is missing '" + key + "'");
  const py::object value = d[key];
  try {
    return value.cast<T>();
  } catch (const py::cast_error&) {
    throw py::value_error(std::string(what) + "['" + key +
                          "'] has the wrong type: " + std::string(py::str(py::type::of(value).attr("__name__"))));
  }
}

}  // namespace

// The dict of atomflow.model.spec.ModelSpec.to_dict(); keys the engine does not use are ignored.
// (Also plan.cpp's.)
ModelSpec spec_from_dict(const py::dict& d) {
  ModelSpec s;
  s.vocab_size = field<int32_t>(d, "spec", "vocab_size");
  s.hidden_size = field<int32_t>(d, "spec", "hidden_size");
  s.intermediate_size = field<int32_t>(d, "spec", "intermediate_size");
  s.num_layers = field<int32_t>(d, "spec", "num_layers");
  s.num_heads = field<int32_t>(d, "spec", "num_heads");
  s.num_kv_heads = field<int32_t>(d, "spec", "num_kv_heads");
  s.head_dim = field<int32_t>(d, "spec", "head_dim");
  s.rms_norm_eps = field<float>(d, "spec", "rms_norm_eps");
  s.rope_theta = field<float>(d, "spec", "rope_theta");
  const std::string rope = field<std::string>(d, "spec", "rope_type");
  if (rope == "default")
    s.rope_type = RopeType::Default;
  else if (rope == "llama3")
    s.rope_type = RopeType::Llama3;
  else if (rope == "linear")
    s.rope_type = RopeType::Linear;
  else
    throw py::value_error("spec['rope_type'] must be 'default', 'llama3' or 'linear', got '" + rope + "'");
  s.rope_factor = field<float>(d, "spec", "rope_factor");
  s.rope_low_freq_factor = field<float>(d, "spec", "rope_low_freq_factor");
  s.rope_high_freq_factor = field<float>(d, "spec", "rope_high_freq_factor");
  s.rope_original_max_position_embeddings = field<int32_t>(d, "spec", "rope_original_max_position_embeddings");
  s.max_position_embeddings = field<int32_t>(d, "spec", "max_position_embeddings");
  s.tie_word_embeddings = field<bool>(d, "spec", "tie_word_embeddings");
  s.lm_head_fp8 = d.contains("lm_head_fp8") ? field<bool>(d, "spec", "lm_head_fp8") : true;
  // Format version 2's fields; a version-1 spec lacks them, and their defaults describe it (a Llama).
  const std::string arch = d.contains("arch") ? field<std::string>(d, "spec", "arch") : "llama";
  if (arch == "llama")
    s.arch = Arch::Llama;
  else if (arch == "mistral")
    s.arch = Arch::Mistral;
  else if (arch == "qwen2")
    s.arch = Arch::Qwen2;
  else if (arch == "qwen3")
    s.arch = Arch::Qwen3;
  else
    throw py::value_error("spec['arch'] must be 'llama', 'mistral', 'qwen2' or 'qwen3', got '" + arch + "'");
  s.attention_bias = d.contains("attention_bias") ? field<bool>(d, "spec", "attention_bias") : false;
  s.qk_norm = d.contains("qk_norm") ? field<bool>(d, "spec", "qk_norm") : false;
  s.sliding_window = d.contains("sliding_window") ? field<int32_t>(d, "spec", "sliding_window") : 0;
  return s;
}

}  // namespace atomflow::bindings

namespace {

using atomflow::bindings::field;
using atomflow::bindings::spec_from_dict;

std::vector<TensorInfo> tensors_from_list(const py::list& list) {
  std::vector<TensorInfo> out;
  out.reserve(list.size());
  for (const py::handle& item : list) {
    if (!py::isinstance<py::dict>(item)) throw py::value_error("tensors must be a list of dicts");
    const py::dict d = py::reinterpret_borrow<py::dict>(item);
    TensorInfo t;
    t.name = field<std::string>(d, "tensor", "name");
    t.dtype = field<std::string>(d, "tensor", "dtype");
    t.shape = field<std::vector<int64_t>>(d, "tensor", "shape");
    const long long offset = field<long long>(d, "tensor", "offset");
    const long long nbytes = field<long long>(d, "tensor", "nbytes");
    if (offset < 0 || nbytes < 0) throw py::value_error("tensor '" + t.name + "': negative offset or nbytes");
    t.offset = static_cast<uint64_t>(offset);
    t.nbytes = static_cast<uint64_t>(nbytes);
    out.push_back(std::move(t));
  }
  return out;
}

std::string out_of_range(long long id, int vocab) {
  return "token id " + std::to_string(id) + " is out of range [0, " + std::to_string(vocab) + ")";
}

int32_t token_arg(long long token, int vocab) {
  if (token < 0 || token >= vocab) throw py::value_error(out_of_range(token, vocab));
  return static_cast<int32_t>(token);
}

// Any 1-D integer array (or list) -> int32 ids, each checked to be in [0, vocab).
std::vector<int32_t> ids_arg(const py::array& ids, int vocab) {
  if (ids.ndim() != 1) throw py::value_error("ids must be a 1-D array, got " + std::to_string(ids.ndim()) + " dims");
  if (ids.size() == 0) throw py::value_error("prefill: the prompt is empty");
  const char kind = ids.dtype().kind();
  if (kind != 'i' && kind != 'u')
    throw py::value_error("ids must be integers, got dtype " + std::string(py::str(ids.dtype())));
  if (ids.size() > INT_MAX) throw py::value_error("ids: too many tokens");
  auto wide = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(ids);
  if (!wide) throw py::error_already_set();
  std::vector<int32_t> out(static_cast<size_t>(wide.size()));
  const int64_t* p = wide.data();
  for (size_t i = 0; i < out.size(); ++i) {
    if (p[i] < 0 || p[i] >= vocab)
      throw py::value_error(out_of_range(p[i], vocab) + " (at index " + std::to_string(i) + ")");
    out[i] = static_cast<int32_t>(p[i]);
  }
  return out;
}

py::array_t<float> new_logits(const Engine& e) { return py::array_t<float>(e.spec().vocab_size); }

}  // namespace

// Collects probe rows (C++ side, no GIL needed) and hands them to Python as
// {"attn_norm.3": fp32 [rows, dim], ..., "final_norm": [1, d], "logits": [1, vocab]};
// a prompt prefilled in several chunks appends each chunk's rows.
struct ProbeRows {
  std::map<std::string, std::pair<std::vector<float>, int>> data;
  atomflow::Engine::ProbeSink sink() {
    return [this](const std::string& name, int layer, const std::vector<float>& rows, int dim) {
      auto& slot = data[layer < 0 ? name : name + "." + std::to_string(layer)];
      if (layer < 0) slot.first.clear();  // final_norm/logits: only the last chunk's last row counts
      slot.first.insert(slot.first.end(), rows.begin(), rows.end());
      slot.second = dim;
    };
  }
  py::dict to_dict() const {
    py::dict d;
    for (const auto& [name, v] : data) {
      const py::ssize_t dim = v.second, n = static_cast<py::ssize_t>(v.first.size()) / dim;
      py::array_t<float> a({n, dim});
      std::memcpy(a.mutable_data(), v.first.data(), v.first.size() * sizeof(float));
      d[py::str(name)] = a;
    }
    return d;
  }
};

PYBIND11_MODULE(_core, m) {
  m.doc() = "atomflow CUDA core: the single-stream FP8 decode engine";

  m.def(
      "cuda_available",
      [] {
        Availability a = cuda_available();
        return py::make_tuple(a.ok, a.reason);
      },
      "(ok, reason): whether a usable GPU of compute capability >= 8.9 is present, and why not");

  m.def(
      "device_info",
      [] {
        DeviceInfo i = device_info();
        py::dict d;
        d["index"] = i.index;
        d["name"] = i.name;
        d["capability"] = py::make_tuple(i.major, i.minor);
        d["total_memory"] = i.total_memory;
        d["free_memory"] = i.free_memory;
        d["sm_count"] = i.sm_count;
        d["l2_bytes"] = i.l2_bytes;
        return d;
      },
      "the current GPU: name, capability (major, minor), total/free memory, SM count, L2 bytes");

  m.def(
      "build_info",
      [] {
        BuildInfo b = build_info();
        py::dict d;
        d["cuda_arch"] = b.cuda_arch;
        d["cuda_runtime_version"] = b.runtime_version;
        d["cuda_driver_version"] = b.driver_version;
        return d;
      },
      "the CUDA architectures this build targets and the runtime/driver versions");

  // Nsight capture range (scripts/profile.sh: ncu --profile-from-start off, nsys
  // --capture-range=cudaProfilerApi): only the steps between the two calls are recorded.
  m.def("profiler_start", [] { AF_CUDA_CHECK(cudaProfilerStart()); }, "start an Nsight capture range");
  m.def("profiler_stop", [] { AF_CUDA_CHECK(cudaProfilerStop()); }, "end an Nsight capture range");

  py::class_<Engine>(m, "Engine")
      .def(py::init([](const std::string& path, const py::dict& spec, const py::list& tensors,
                       const py::array_t<float, py::array::c_style | py::array::forcecast>& inv_freq, int max_context,
                       int prefill_chunk, bool eager, bool verbose, bool f16_activations, bool fused_tail,
                       bool short_steps, bool cluster_merge, bool staged_pair, bool tickets, bool prefill_fp8,
                       bool gemm_pdl, bool skinny_gemm, bool skinny_rope, bool skinny_norm) {
             ModelSpec s = spec_from_dict(spec);
             std::vector<TensorInfo> table = tensors_from_list(tensors);
             if (inv_freq.ndim() != 1) throw py::value_error("inv_freq must be a 1-D float32 array");
             std::vector<float> freq(inv_freq.data(), inv_freq.data() + inv_freq.size());
             EngineOptions opt;
             opt.max_context = max_context;
             opt.prefill_chunk = prefill_chunk;
             opt.verbose = verbose;
             opt.plan = PlanOptions{eager,   f16_activations, fused_tail, short_steps, cluster_merge, staged_pair,
                                    tickets, prefill_fp8,     gemm_pdl,   skinny_gemm, skinny_rope,   skinny_norm};
             py::gil_scoped_release nogil;
             return std::make_unique<Engine>(path, s, table, freq, opt);
           }),
           py::arg("path"), py::arg("spec"), py::arg("tensors"), py::arg("inv_freq"), py::arg("max_context"),
           py::arg("prefill_chunk") = EngineOptions{}.prefill_chunk, py::arg("eager") = false,
           py::arg("verbose") = true, py::arg("f16_activations") = true, py::arg("fused_tail") = true,
           py::arg("short_steps") = true, py::arg("cluster_merge") = true, py::arg("staged_pair") = true,
           py::arg("tickets") = true, py::arg("prefill_fp8") = false, py::arg("gemm_pdl") = true,
           py::arg("skinny_gemm") = true, py::arg("skinny_rope") = true, py::arg("skinny_norm") = true,
           "load the model and plan its decode step; eager and f16_activations are user settings, prefill_fp8, "
           "skinny_gemm and skinny_norm a prompt's rounding, the other options override the schedule (same bits) for "
           "comparisons (include/atomflow/step_plan.h)")
      .def(
          "prefill",
          [](Engine& e, const py::array& ids) {
            std::vector<int32_t> v = ids_arg(ids, e.spec().vocab_size);
            py::array_t<float> logits = new_logits(e);
            float* out = logits.mutable_data();
            py::gil_scoped_release nogil;
            e.prefill(v.data(), static_cast<int>(v.size()), out);
            return logits;
          },
          py::arg("ids"), "append ids at the current position; fp32 logits [vocab] of the last one")
      .def(
          "prefill_rows",
          [](Engine& e, const py::array& ids) {
            std::vector<int32_t> v = ids_arg(ids, e.spec().vocab_size);
            py::array_t<float> logits(
                {static_cast<py::ssize_t>(v.size()), static_cast<py::ssize_t>(e.spec().vocab_size)});
            float* out = logits.mutable_data();
            py::gil_scoped_release nogil;
            e.prefill_rows(v.data(), static_cast<int>(v.size()), out);
            return logits;
          },
          py::arg("ids"),
          "append ids (one prefill chunk) at the current position; fp32 logits [len(ids), vocab] of every one (a chunk "
          "of up to 16 rows: each row a decode step's bits in the engine's activations; one that passes fp16's "
          "range moves the engine to bf16 and the chunk runs again)")
      .def(
          "verify_greedy",
          [](Engine& e, const py::array& ids) {
            std::vector<int32_t> v = ids_arg(ids, e.spec().vocab_size);
            py::array_t<int32_t> tokens(static_cast<py::ssize_t>(v.size()));
            int32_t* out = tokens.mutable_data();
            bool ok = false;
            {
              py::gil_scoped_release nogil;
              ok = e.verify_greedy(v.data(), static_cast<int>(v.size()), out);
            }
            return ok ? py::object(tokens) : py::object(py::none());
          },
          py::arg("ids"),
          "append ids (at most logit_rows) at the current position; int32 [len(ids)]: each row's greedy token "
          "(-1 where its logits are not finite), or None (nothing appended) where an fp16 activation passed "
          "fp16's range: decode steps go on from there")
      .def_property_readonly_static("logit_rows", [](const py::object&) { return Engine::kLogitRows; })
      .def(
          "decode",
          [](Engine& e, long long token) {
            const int32_t t = token_arg(token, e.spec().vocab_size);
            py::array_t<float> logits = new_logits(e);
            float* out = logits.mutable_data();
            py::gil_scoped_release nogil;
            e.decode(t, out);
            return logits;
          },
          py::arg("token"), "feed one token at the current position; its fp32 logits [vocab]")
      .def(
          "prefill_probed",
          [](Engine& e, const py::array& ids) {
            std::vector<int32_t> v = ids_arg(ids, e.spec().vocab_size);
            ProbeRows rows;
            py::array_t<float> logits = new_logits(e);
            float* out = logits.mutable_data();
            {
              py::gil_scoped_release nogil;
              e.prefill_probed(v.data(), static_cast<int>(v.size()), out, rows.sink());
            }
            return rows.to_dict();
          },
          py::arg("ids"), "prefill (eager) returning the validator's probes: name -> fp32 [rows, dim]")
      .def(
          "decode_probed",
          [](Engine& e, long long token) {
            const int32_t t = token_arg(token, e.spec().vocab_size);
            ProbeRows rows;
            py::array_t<float> logits = new_logits(e);
            float* out = logits.mutable_data();
            {
              py::gil_scoped_release nogil;
              e.decode_probed(t, out, rows.sink());
            }
            return rows.to_dict();
          },
          py::arg("token"), "one eager decode step returning the validator's probes")
      .def(
          "profile_decode",
          [](Engine& e, long long token, int steps, const std::string& mode) {
            const int32_t t = token_arg(token, e.spec().vocab_size);
            Engine::ProfileMode m;
            if (mode == "kernels")
              m = Engine::ProfileMode::Kernels;
            else if (mode == "eager")
              m = Engine::ProfileMode::EagerStep;
            else if (mode == "graph")
              m = Engine::ProfileMode::GraphStep;
            else
              throw py::value_error("mode must be 'kernels', 'eager' or 'graph', got '" + mode + "'");
            std::vector<Engine::ProfileEntry> entries;
            {
              py::gil_scoped_release nogil;
              entries = e.profile_decode(t, steps, m);
            }
            py::list out;
            for (const auto& x : entries) out.append(py::make_tuple(std::string(x.label), x.layer, x.us));
            return out;
          },
          py::arg("token"), py::arg("steps"), py::arg("mode") = "kernels",
          "steps decode steps from token (they advance the position), timed on the device: "
          "[(label, layer, microseconds)]; mode 'kernels' = eager, one entry per launch group; "
          "'eager' / 'graph' = one ('step', -1, us) per step")
      .def(
          "set_position", [](Engine& e, int position) { e.set_position(position); }, py::arg("position"),
          "roll back to 0 <= position <= current position")
      .def("reset", [](Engine& e) { e.reset(); })
      .def(
          "set_sampling",
          [](Engine& e, float temperature, int top_k, float top_p, const py::int_& seed) {
            uint64_t s = 0;
            try {
              s = seed.cast<uint64_t>();
            } catch (const py::cast_error&) {
              throw py::value_error("seed must be an integer in [0, 2**64)");
            }
            e.set_sampling(temperature, top_k, top_p, s);
          },
          py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("seed"),
          "device sampling settings: temperature 0 = greedy, top_k 0 = off, top_p 1 = off")
      .def(
          "begin", [](Engine& e, long long token) { e.begin(token_arg(token, e.spec().vocab_size)); }, py::arg("token"),
          "set the input token of the next enqueued step")
      .def(
          "begin_prompt",
          [](Engine& e, const py::array& ids) {
            std::vector<int32_t> v = ids_arg(ids, e.spec().vocab_size);
            py::gil_scoped_release nogil;
            e.begin_prompt(v.data(), static_cast<int>(v.size()));
          },
          py::arg("ids"), "prefill ids (at least 2) and enqueue the sample of the last one as the first step in flight")
      .def(
          "prompt_logits",
          [](Engine& e) {
            py::array_t<float> logits = new_logits(e);
            e.prompt_logits(logits.mutable_data());
            return logits;
          },
          "fp32 logits [vocab] of begin_prompt's last row, once its token was waited for and before a later "
          "step overwrites them")
      .def("prompt_finite", &Engine::prompt_finite,
           "whether begin_prompt's last row holds no NaN or infinity (checked on the device), once its token was "
           "waited for")
      .def(
          "enqueue",
          [](Engine& e, int n) {
            py::gil_scoped_release nogil;
            e.enqueue(n);
          },
          py::arg("n"), "enqueue n decode steps without waiting")
      .def(
          "wait",
          [](Engine& e, int n) {
            std::vector<int32_t> tokens;
            {
              py::gil_scoped_release nogil;
              tokens = e.wait(n);
            }
            return tokens;
          },
          py::arg("n"), "block until the oldest n enqueued steps are done; their sampled tokens")
      .def(
          "synchronize",
          [](Engine& e) {
            py::gil_scoped_release nogil;
            e.synchronize();
          },
          "wait for all device work; enqueued steps not yet waited for are dropped")
      .def_property_readonly("position", &Engine::position)
      .def_property_readonly("max_context", &Engine::max_context)
      .def_property_readonly("prefill_chunk", &Engine::prefill_chunk)
      .def_property_readonly("vocab_size", [](const Engine& e) { return e.spec().vocab_size; })
      .def_property_readonly("in_flight", &Engine::in_flight)
      .def_property_readonly("short_grid_steps", &Engine::short_grid_steps,
                             "decode steps launched with the attention grid planned for 512 keys")
      .def_property_readonly("long_grid_steps", &Engine::long_grid_steps,
                             "decode steps launched with the attention grid planned for max_context")
      .def_property_readonly("ring_size", [](const Engine&) { return Engine::kRingSize; })
      .def_property_readonly("device_allocations", &Engine::device_allocations)
      .def_property_readonly("load_seconds", &Engine::load_seconds)
      .def_property_readonly("graph_enabled", &Engine::graph_enabled)
      .def_property_readonly("verify_graphs", &Engine::verify_graphs,
                             "verify chunks captured as CUDA graphs (row counts 2..16; the exact mode with graphs on)")
      .def_property_readonly("f16_activations", &Engine::f16_activations,
                             "whether decode steps write attention's and SwiGLU's outputs in fp16 (false when loaded "
                             "with f16_activations=False, or once a step passed fp16's range and ran again in bf16)")
      .def_property_readonly(
          "step_plan", [](const Engine& e) { return atomflow::bindings::plan_to_dict(e.step_plan()); },
          "every launch decision of the decode step, made at load (atomflow info --plan)")
      .def_property_readonly("plan", [](const Engine& e) {
        py::dict d;
        for (const auto& [group, bytes] : e.plan()) d[py::str(group)] = bytes;
        return d;
      });

  atomflow::bindings::register_plan(m);

  py::module_ ops = m.def_submodule("ops", "kernel test harness");
  register_ops(ops);
}

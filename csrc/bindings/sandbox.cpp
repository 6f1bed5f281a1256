// _sandbox: the paged-KV / batching sandbox for Python (docs/SANDBOX.md). Argument checks and
// conversions only; the work lives in csrc/sandbox and csrc/kernels. Importing the module touches
// no CUDA: the block manager works on a machine without a GPU, and every GPU function first checks
// for one and raises RuntimeError saying why not.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "args.h"
#include "../sandbox/block_manager.h"
#include "../sandbox/harness.h"
#include "../sandbox/paged_model.h"

namespace py = pybind11;
namespace sb = atomflow::sandbox;

namespace {

// ------------------------------------------------------------------ argument checks (args.h)

using atomflow::bindings::arg;
using atomflow::bindings::require;

void require_gpu() {
  const auto [ok, why] = sb::cuda_available();
  if (!ok) throw std::runtime_error("atomflow._sandbox: this function needs a GPU (" + why + ")");
}

py::ssize_t dim(const py::array& a, int i) { return a.shape(i); }

// ------------------------------------------------------------------ block manager

py::object append_result(const sb::AppendResult& r) {
  return py::make_tuple(r.slot, r.copied ? py::object(py::make_tuple(r.copy.src, r.copy.dst)) : py::object(py::none()));
}

py::dict stats_dict(const sb::BlockStats& s) {
  py::dict d;
  d["prompt_tokens"] = s.prompt_tokens;
  d["cached_tokens"] = s.cached_tokens;
  d["evictions"] = s.evictions;
  d["cow_copies"] = s.cow_copies;
  return d;
}

py::array_t<int32_t> table_array(const sb::BlockManager& bm, const std::vector<int64_t>& seqs, int max_blocks) {
  const std::vector<int32_t> flat = bm.table_array(seqs, max_blocks);
  py::array_t<int32_t> out({static_cast<py::ssize_t>(seqs.size()), static_cast<py::ssize_t>(max_blocks)});
  std::copy(flat.begin(), flat.end(), out.mutable_data());
  return out;
}

void bind_block_manager(py::module_& m) {
  py::class_<sb::BlockManager>(m, "BlockManager",
                               "Fixed pool of KV blocks: free list, block tables, refcounts, copy-on-write fork, "
                               "prefix caching with LRU eviction. Pure C++: needs no GPU.")
      .def(py::init<int, int, bool>(), py::arg("num_blocks"), py::arg("block_size"), py::arg("prefix_caching") = true)
      .def_property_readonly("num_blocks", &sb::BlockManager::num_blocks)
      .def_property_readonly("block_size", &sb::BlockManager::block_size)
      .def_property_readonly("prefix_caching", &sb::BlockManager::prefix_caching)
      .def_property_readonly("num_available", &sb::BlockManager::num_available,
                             "free + cached blocks no sequence holds")
      .def_property_readonly("num_cached_idle", &sb::BlockManager::num_cached_idle)
      .def_property_readonly("num_used", &sb::BlockManager::num_used)
      .def_property_readonly("stats", [](const sb::BlockManager& b) { return stats_dict(b.stats()); })
      .def("allocate", &sb::BlockManager::allocate, py::arg("seq"), py::arg("tokens"),
           "new sequence holding `tokens`; returns how many leading tokens were found in the prefix cache")
      .def("blocks_needed", &sb::BlockManager::blocks_needed, py::arg("tokens"))
      .def("can_allocate", &sb::BlockManager::can_allocate, py::arg("tokens"))
      .def(
          "append", [](sb::BlockManager& b, int64_t seq, int32_t token) { return append_result(b.append(seq, token)); },
          py::arg("seq"), py::arg("token"), "reserve the next token's slot -> (slot, (src, dst) copy or None)")
      .def("append_cost", &sb::BlockManager::append_cost, py::arg("seq"))
      .def("fork", &sb::BlockManager::fork, py::arg("parent"), py::arg("child"))
      .def("free", &sb::BlockManager::free, py::arg("seq"))
      .def("commit", &sb::BlockManager::commit, py::arg("seq"), py::arg("n"))
      .def("preemption_victims", &sb::BlockManager::preemption_victims, py::arg("running"))
      .def("has", &sb::BlockManager::has, py::arg("seq"))
      .def("sequences", &sb::BlockManager::sequences)
      .def("block_table", &sb::BlockManager::block_table, py::arg("seq"))
      .def("tokens", &sb::BlockManager::tokens, py::arg("seq"))
      .def("num_tokens", &sb::BlockManager::num_tokens, py::arg("seq"))
      .def("num_computed", &sb::BlockManager::num_computed, py::arg("seq"))
      .def("slot", &sb::BlockManager::slot, py::arg("seq"), py::arg("position"))
      .def("refcount", &sb::BlockManager::refcount, py::arg("block"))
      .def("is_cached", &sb::BlockManager::is_cached, py::arg("block"))
      .def("table_array", &table_array, py::arg("seqs"), py::arg("max_blocks"),
           "block tables of `seqs` as int32 [len(seqs), max_blocks] (unused entries 0)")
      .def("check", &sb::BlockManager::check, "verify every invariant; raises RuntimeError on a violation");
}

// ------------------------------------------------------------------ paged model

sb::ModelDims dims_from_dict(const py::dict& d) {
  auto get = [&](const char* key) {
    if (!d.contains(key)) throw py::value_error(std::string("dims is missing '") + key + "'");
    return d[key];
  };
  sb::ModelDims m{};
  m.vocab = get("vocab_size").cast<int>();
  m.d = get("hidden_size").cast<int>();
  m.f = get("intermediate_size").cast<int>();
  m.layers = get("num_layers").cast<int>();
  m.H = get("num_heads").cast<int>();
  m.Hkv = get("num_kv_heads").cast<int>();
  m.D = get("head_dim").cast<int>();
  m.eps = get("rms_norm_eps").cast<float>();
  // The paged model is Llama's forward pass: it loads no bqkv / q_norm / k_norm (atomflow/sandbox/model.py
  // refuses such files first).
  for (const char* key : {"attention_bias", "qk_norm"})
    if (d.contains(key) && d[key].cast<bool>())
      throw py::value_error(std::string("the sandbox's paged model does not run ") + key +
                            " models (Qwen2 / Qwen3); the core engine does");
  return m;
}

std::unique_ptr<sb::PagedModel> make_model(const py::dict& dims, int num_blocks, int block_size, int max_rows,
                                           int max_seqs, int max_blocks_per_seq, bool f16_activations) {
  require_gpu();
  return std::make_unique<sb::PagedModel>(
      dims_from_dict(dims), sb::PoolConfig{num_blocks, block_size, max_rows, max_seqs, max_blocks_per_seq},
      f16_activations);
}

void upload(sb::PagedModel& model, const std::string& name, const py::array& a) {
  require(a.flags() & py::array::c_style, name + " must be C-contiguous");
  model.upload(name, a.data(), static_cast<size_t>(a.nbytes()));
}

void copy_blocks(sb::PagedModel& model, const py::array& pairs_) {
  auto pairs = arg<int32_t>(pairs_, "copies", {-1, 2});
  std::vector<sb::BlockCopy> c(static_cast<size_t>(pairs.shape(0)));
  for (size_t i = 0; i < c.size(); ++i) c[i] = {pairs.at(i, 0), pairs.at(i, 1)};
  model.copy_blocks(c.data(), static_cast<int>(c.size()));
}

py::object step(sb::PagedModel& model, const py::array& tokens_, const py::array& positions_, const py::array& slots_,
                int n_decode, const py::object& decode_tables_, const py::object& decode_lens_,
                const py::object& prefill_table_, int prefill_len, const py::array& logit_rows_, bool want_logits) {
  auto tokens = arg<int32_t>(tokens_, "tokens", {-1});
  const py::ssize_t R = tokens.shape(0);
  auto positions = arg<int32_t>(positions_, "positions", {R});
  auto slots = arg<int32_t>(slots_, "slots", {R});
  auto logit_rows = arg<int32_t>(logit_rows_, "logit_rows", {-1});
  require(n_decode >= 0 && n_decode <= R, "n_decode must be in [0, rows]");
  sb::StepInput in;
  in.rows = static_cast<int>(R);
  in.tokens = tokens.data();
  in.positions = positions.data();
  in.slots = slots.data();
  in.n_decode = n_decode;
  py::array_t<int32_t> dt, dl, pt;  // keep the arrays alive for the call
  if (n_decode > 0) {
    require(!decode_tables_.is_none() && !decode_lens_.is_none(), "decode rows need decode_tables and decode_lens");
    dt = arg<int32_t>(decode_tables_.cast<py::array>(), "decode_tables", {n_decode, -1});
    dl = arg<int32_t>(decode_lens_.cast<py::array>(), "decode_lens", {n_decode});
    in.decode_tables = dt.data();
    in.decode_lens = dl.data();
    in.decode_stride = static_cast<int>(dt.shape(1));
  }
  if (n_decode < R) {
    require(!prefill_table_.is_none(), "prefill rows need prefill_table");
    pt = arg<int32_t>(prefill_table_.cast<py::array>(), "prefill_table", {-1});
    in.prefill_table = pt.data();
    in.prefill_stride = static_cast<int>(pt.shape(0));
    in.prefill_len = prefill_len;
  }
  in.n_logits = static_cast<int>(logit_rows.shape(0));
  in.logit_rows = logit_rows.data();
  const int L = in.n_logits, vocab = model.dims().vocab;
  py::array_t<int32_t> next(L);
  py::array_t<float> logits;
  if (want_logits) logits = py::array_t<float>({static_cast<py::ssize_t>(L), static_cast<py::ssize_t>(vocab)});
  model.step(in, next.mutable_data(), want_logits ? logits.mutable_data() : nullptr);
  if (want_logits) return py::make_tuple(next, logits);
  return next;
}

void bind_model(py::module_& m) {
  py::class_<sb::PagedModel>(m, "PagedModel",
                             "The Llama forward pass over a paged KV pool for a batch of sequences (greedy). "
                             "Needs a GPU.")
      .def(py::init(&make_model), py::arg("dims"), py::arg("num_blocks"), py::arg("block_size"), py::arg("max_rows"),
           py::arg("max_seqs"), py::arg("max_blocks_per_seq"), py::arg("f16_activations") = true,
           "dims: ModelSpec.to_dict(); the pool holds num_blocks blocks of block_size tokens, all layers; "
           "f16_activations: steps of one row write attention's and SwiGLU's outputs in fp16 (bf16 after an overflow)")
      .def("upload", &upload, py::arg("name"), py::arg("array"), "one tensor of the .atomflow file, by name")
      .def(
          "upload_inv_freq",
          [](sb::PagedModel& mdl, const py::array& f) {
            auto a = arg<float>(f, "inv_freq", {-1});
            mdl.upload_inv_freq(a.data(), static_cast<int>(a.shape(0)));
          },
          py::arg("inv_freq"))
      .def_property_readonly("ready", &sb::PagedModel::ready)
      .def("copy_blocks", &copy_blocks, py::arg("copies"), "int32 [n, 2] (src, dst) block copies, run in order")
      .def("step", &step, py::arg("tokens"), py::arg("positions"), py::arg("slots"), py::arg("n_decode"),
           py::arg("decode_tables") = py::none(), py::arg("decode_lens") = py::none(),
           py::arg("prefill_table") = py::none(), py::arg("prefill_len") = 0, py::arg("logit_rows"),
           py::arg("want_logits") = false,
           "one iteration -> greedy tokens int32 [len(logit_rows)] (and logits f32 [len(logit_rows), vocab])")
      .def("clear_pool", &sb::PagedModel::clear_pool)
      .def_property_readonly("last_step_ms", &sb::PagedModel::last_step_ms)
      .def_property_readonly("pool_bytes", &sb::PagedModel::pool_bytes)
      .def_property_readonly("weight_bytes", &sb::PagedModel::weight_bytes)
      .def_property_readonly("block_bytes", &sb::PagedModel::block_bytes);
}

// ------------------------------------------------------------------ kernel harness

py::array_t<uint16_t> attention_paged(const py::array& q_, const py::array& k_, const py::array& v_,
                                      const py::array& tables_, const py::array& lens_, const py::object& scale_) {
  require_gpu();
  auto q = arg<uint16_t>(q_, "q", {-1, -1, -1, -1});
  const int B = static_cast<int>(dim(q, 0)), M = static_cast<int>(dim(q, 1)), H = static_cast<int>(dim(q, 2)),
            D = static_cast<int>(dim(q, 3));
  auto kp = arg<uint16_t>(k_, "k_pool", {-1, -1, -1, D});
  const int nb = static_cast<int>(dim(kp, 0)), bs = static_cast<int>(dim(kp, 1)), Hkv = static_cast<int>(dim(kp, 2));
  auto vp = arg<uint16_t>(v_, "v_pool", {nb, bs, Hkv, D});
  auto tables = arg<int32_t>(tables_, "block_tables", {B, -1});
  auto lens = arg<int32_t>(lens_, "lens", {B});
  require(B >= 1 && M >= 1 && nb >= 1 && tables.shape(1) >= 1, "need B, M, num_blocks and max_blocks >= 1");
  for (int b = 0; b < B; ++b)
    require(lens.at(b) >= M && lens.at(b) <= tables.shape(1) * bs, "lens[b] must be in [M, max_blocks * block_size]");
  const float scale = scale_.is_none() ? 1.0f / std::sqrt(static_cast<float>(D)) : scale_.cast<float>();
  py::array_t<uint16_t> out({B * M, H, D});
  sb::run_attention_paged(q.data(), kp.data(), vp.data(), tables.data(), lens.data(), B, M, H, Hkv, D, bs, nb,
                          static_cast<int>(tables.shape(1)), scale, out.mutable_data());
  return out;
}

py::array_t<uint16_t> attention_batched(const py::array& q_, const py::array& k_, const py::array& v_,
                                        const py::array& lens_, const py::object& scale_) {
  require_gpu();
  auto q = arg<uint16_t>(q_, "q", {-1, -1, -1, -1});
  const int B = static_cast<int>(dim(q, 0)), M = static_cast<int>(dim(q, 1)), H = static_cast<int>(dim(q, 2)),
            D = static_cast<int>(dim(q, 3));
  auto kc = arg<uint16_t>(k_, "k_cache", {B, -1, -1, D});
  const int C = static_cast<int>(dim(kc, 1)), Hkv = static_cast<int>(dim(kc, 2));
  auto vc = arg<uint16_t>(v_, "v_cache", {B, C, Hkv, D});
  auto lens = arg<int32_t>(lens_, "lens", {B});
  require(B >= 1 && M >= 1 && C >= 1, "need B, M and capacity >= 1");
  for (int b = 0; b < B; ++b) require(lens.at(b) >= M && lens.at(b) <= C, "lens[b] must be in [M, capacity]");
  const float scale = scale_.is_none() ? 1.0f / std::sqrt(static_cast<float>(D)) : scale_.cast<float>();
  py::array_t<uint16_t> out({B * M, H, D});
  sb::run_attention_batched(q.data(), kc.data(), vc.data(), lens.data(), B, M, H, Hkv, D, C, scale, out.mutable_data());
  return out;
}

// Each call (q, k_cache, v_cache, lens) as attention_batched; all on one scratch, in order.
py::list attention_batched_calls(const std::vector<py::tuple>& calls_, const py::object& scale_) {
  require_gpu();
  require(!calls_.empty(), "need at least one call");
  std::vector<sb::BatchedAttentionCall> calls;  // pointers into the arrays calls_ holds (checked, not copied)
  py::list outs;
  int H = 0, Hkv = 0, D = 0;
  for (const py::tuple& t : calls_) {
    require(t.size() == 4, "each call is (q, k_cache, v_cache, lens)");
    auto q = arg<uint16_t>(t[0].cast<py::array>(), "q", {-1, -1, -1, -1});
    const int B = static_cast<int>(dim(q, 0)), M = static_cast<int>(dim(q, 1));
    if (calls.empty()) {
      H = static_cast<int>(dim(q, 2));
      D = static_cast<int>(dim(q, 3));
    }
    require(dim(q, 2) == H && dim(q, 3) == D, "every call must have the same H and D");
    auto kc = arg<uint16_t>(t[1].cast<py::array>(), "k_cache", {B, -1, -1, D});
    const int C = static_cast<int>(dim(kc, 1));
    if (calls.empty()) Hkv = static_cast<int>(dim(kc, 2));
    require(dim(kc, 2) == Hkv, "every call must have the same Hkv");
    auto vc = arg<uint16_t>(t[2].cast<py::array>(), "v_cache", {B, C, Hkv, D});
    auto lens = arg<int32_t>(t[3].cast<py::array>(), "lens", {B});
    require(B >= 1 && M >= 1 && C >= 1, "need B, M and capacity >= 1");
    for (int b = 0; b < B; ++b) require(lens.at(b) >= M && lens.at(b) <= C, "lens[b] must be in [M, capacity]");
    py::array_t<uint16_t> out({B * M, H, D});
    calls.push_back({q.data(), kc.data(), vc.data(), lens.data(), B, M, C, out.mutable_data()});
    outs.append(out);
  }
  const float scale = scale_.is_none() ? 1.0f / std::sqrt(static_cast<float>(D)) : scale_.cast<float>();
  sb::run_attention_batched_calls(calls, H, Hkv, D, scale);
  return outs;
}

py::array_t<uint16_t> attention_contiguous(const py::array& q_, const py::array& k_, const py::array& v_, int pos,
                                           const py::object& scale_) {
  require_gpu();
  auto q = arg<uint16_t>(q_, "q", {-1, -1, -1});
  const int M = static_cast<int>(dim(q, 0)), H = static_cast<int>(dim(q, 1)), D = static_cast<int>(dim(q, 2));
  auto kc = arg<uint16_t>(k_, "k_cache", {-1, -1, D});
  const int C = static_cast<int>(dim(kc, 0)), Hkv = static_cast<int>(dim(kc, 1));
  auto vc = arg<uint16_t>(v_, "v_cache", {C, Hkv, D});
  require(M >= 1 && pos >= 0 && pos + M <= C, "need M >= 1, pos >= 0 and pos + M <= cache rows");
  const float scale = scale_.is_none() ? 1.0f / std::sqrt(static_cast<float>(D)) : scale_.cast<float>();
  py::array_t<uint16_t> out({M, H, D});
  sb::run_attention_contiguous(q.data(), kc.data(), vc.data(), pos, M, H, Hkv, D, C, scale, out.mutable_data());
  return out;
}

py::tuple rope_slots(const py::array& qkv_, const py::array& inv_freq_, const py::array& positions_,
                     const py::array& slots_, int H, int Hkv, int D, const py::array& k_, const py::array& v_) {
  require_gpu();
  require(H >= 1 && Hkv >= 1 && D >= 2 && D % 2 == 0, "need H, Hkv >= 1 and an even D");
  auto qkv = arg<float>(qkv_, "qkv", {-1, static_cast<py::ssize_t>(H + 2 * Hkv) * D});
  const int M = static_cast<int>(qkv.shape(0));
  require(M >= 1, "need at least one token");
  auto inv_freq = arg<float>(inv_freq_, "inv_freq", {D / 2});
  auto positions = arg<int32_t>(positions_, "positions", {M});
  auto slots = arg<int32_t>(slots_, "slots", {M});
  auto kp = arg<uint16_t>(k_, "k_pool", {-1, Hkv, D});
  const py::ssize_t S = kp.shape(0);
  auto vp = arg<uint16_t>(v_, "v_pool", {S, Hkv, D});
  py::array_t<uint16_t> q({M, H, D});
  py::array_t<uint16_t> ko({S, static_cast<py::ssize_t>(Hkv), static_cast<py::ssize_t>(D)}), vo(ko.request().shape);
  std::copy(kp.data(), kp.data() + kp.size(), ko.mutable_data());
  std::copy(vp.data(), vp.data() + vp.size(), vo.mutable_data());
  sb::run_rope_slots(qkv.data(), inv_freq.data(), positions.data(), slots.data(), M, H, Hkv, D, S, q.mutable_data(),
                     ko.mutable_data(), vo.mutable_data());
  return py::make_tuple(q, ko, vo);
}

py::array_t<int32_t> argmax_rows(const py::array& logits_) {
  require_gpu();
  auto logits = arg<float>(logits_, "logits", {-1, -1});
  const int L = static_cast<int>(logits.shape(0)), vocab = static_cast<int>(logits.shape(1));
  require(L >= 1 && vocab >= 1, "logits must not be empty");
  py::array_t<int32_t> out(L);
  sb::run_argmax_rows(logits.data(), L, vocab, out.mutable_data());
  return out;
}

}  // namespace

PYBIND11_MODULE(_sandbox, m) {
  m.doc() = "atomflow sandbox: paged KV attention, block manager, batched forward (docs/SANDBOX.md)";
  py::register_exception<sb::OutOfBlocks>(m, "OutOfBlocks", PyExc_RuntimeError);
  m.def("cuda_available", &sb::cuda_available, "(ok, reason): a usable GPU of compute capability >= 8.9");
  m.def(
      "device_info",
      [] {
        require_gpu();
        return sb::device_info();
      },
      "(name, total bytes, free bytes) of the current GPU");
  bind_block_manager(m);
  bind_model(m);
  m.def("attention_paged", &attention_paged, py::arg("q"), py::arg("k_pool"), py::arg("v_pool"),
        py::arg("block_tables"), py::arg("lens"), py::arg("scale") = py::none(),
        "q u16 [B, M, H, D], pools u16 [num_blocks, block_size, Hkv, D], block_tables i32 [B, max_blocks], "
        "lens i32 [B] (keys including the M queries) -> u16 [B * M, H, D]");
  m.def("attention_batched", &attention_batched, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("lens"),
        py::arg("scale") = py::none(),
        "q u16 [B, M, H, D], caches u16 [B, capacity, Hkv, D], lens i32 [B] -> u16 [B * M, H, D]");
  m.def("attention_batched_calls", &attention_batched_calls, py::arg("calls"), py::arg("scale") = py::none(),
        "[(q, k_cache, v_cache, lens), ...] as attention_batched, in order on ONE scratch -> [out, ...]");
  m.def("attention_contiguous", &attention_contiguous, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("pos"), py::arg("scale") = py::none(), "the core's attention(): q u16 [M, H, D], caches [C, Hkv, D]");
  m.def("rope_kv_append_slots", &rope_slots, py::arg("qkv"), py::arg("inv_freq"), py::arg("positions"),
        py::arg("slots"), py::arg("H"), py::arg("Hkv"), py::arg("D"), py::arg("k_pool"), py::arg("v_pool"),
        "qkv f32 [M, (H + 2 Hkv) D], pools u16 [num_slots, Hkv, D] -> (q u16 [M, H, D], k_pool, v_pool)");
  m.def("argmax_rows", &argmax_rows, py::arg("logits"), "f32 [L, vocab] -> i32 [L] (lowest index on ties)");
  m.def(
      "time_attention",
      [](const std::string& layout, const std::vector<int32_t>& lens, int H, int Hkv, int D, int block_size,
         bool scatter, int iters, uint64_t seed) {
        require_gpu();
        return sb::time_attention(layout, lens, H, Hkv, D, block_size, scatter, iters, seed);
      },
      py::arg("layout"), py::arg("lens"), py::arg("H"), py::arg("Hkv"), py::arg("D"), py::arg("block_size") = 16,
      py::arg("scatter") = true, py::arg("iters") = 20, py::arg("seed") = 0,
      "us per decode-attention call for sequences of lengths `lens`, layout 'contiguous' or 'paged'");
  m.def(
      "stream_read_gbs",
      [](size_t n, int iters) {
        require_gpu();
        return sb::stream_read_gbs(n, iters);
      },
      py::arg("n_bytes") = size_t{1} << 30, py::arg("iters") = 10, "GB/s of the streaming-read kernel");
}

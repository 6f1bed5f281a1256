// _core.ops: the device sampler (sampling.cu): one draw, one per seed, the step-ending sampler, its timer.
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

// One draw per seed (same logits and position): device configs uploaded once, one launch each.
// Token outputs filled with 0x7F7F7F7F before the launch: neither a token nor the sampler's -1, so a
// launch that writes nothing shows.
DeviceBuffer unwritten_tokens(int n) {
  DeviceBuffer d(sizeof(int32_t) * n);
  d.fill(0x7F);
  return d;
}

py::array_t<int32_t> sample_seeds(const py::array& logits_, float temperature, int top_k, float top_p,
                                  const py::array& seeds_, int pos) {
  auto logits = arg<float>(logits_, "logits", {-1});
  auto seeds = arg<uint64_t>(seeds_, "seeds", {-1});
  const int vocab = static_cast<int>(logits.shape(0)), n = static_cast<int>(seeds.shape(0));
  require(vocab >= 1 && n >= 1, "logits and seeds must not be empty");
  std::vector<k::SamplingConfig> cfg(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) cfg[static_cast<size_t>(i)] = {temperature, top_k, top_p, 0u, seeds.at(i)};
  DeviceBuffer dl = to_device(logits), dpos = device_int(pos);
  DeviceBuffer dcfg(sizeof(k::SamplingConfig) * n);
  dcfg.upload(cfg.data(), dcfg.bytes());
  DeviceBuffer scratch(k::sampling_scratch_bytes(vocab));
  DeviceBuffer out = unwritten_tokens(n);
  for (int i = 0; i < n; ++i)
    k::sample(dl.get<float>(), vocab, dcfg.get<k::SamplingConfig>() + i, dpos.get<int32_t>(), scratch.get(),
              out.get<int32_t>() + i, nullptr);
  sync();
  return to_host<int32_t>(out, {n});
}

// kernels::argmax_rows (a verify's greedy tokens): logits f32 [rows, vocab] -> i32 [rows].
py::array_t<int32_t> argmax_rows(const py::array& logits_) {
  auto logits = arg<float>(logits_, "logits", {-1, -1});
  const int rows = static_cast<int>(logits.shape(0)), vocab = static_cast<int>(logits.shape(1));
  require(rows >= 1 && vocab >= 1, "logits must not be empty");
  DeviceBuffer dl = to_device(logits), out = unwritten_tokens(rows);
  k::argmax_rows(dl.get<float>(), rows, vocab, out.get<int32_t>(), nullptr);
  sync();
  return to_host<int32_t>(out, {rows});
}

int sample(const py::array& logits, float temperature, int top_k, float top_p, uint64_t seed, int pos) {
  py::array_t<uint64_t> seeds(1);
  seeds.mutable_at(0) = seed;
  return sample_seeds(logits, temperature, top_k, top_p, seeds, pos).at(0);
}

// The sampler ending a decode step (kernels::sample_step): the token, pos[0..1] after it, the ring
// (a device buffer here: ring_size tokens, then ring_size overflow flags), the next input row x and
// the overflow flag after it. block_best: the head's per-block keys, or None; f16_overflow: the
// flag's value before the step ends.
py::tuple sample_step(const py::array& logits_, float temperature, int top_k, float top_p, uint64_t seed, int pos,
                      const py::array& embed_, const py::object& block_best_, int ring_size, int f16_overflow) {
  auto logits = arg<float>(logits_, "logits", {-1});
  const int vocab = static_cast<int>(logits.shape(0));
  auto embed = arg<uint16_t>(embed_, "embed", {vocab, -1});
  const int d = static_cast<int>(embed.shape(1));
  require(vocab >= 1 && d >= 1 && ring_size >= 1 && pos >= 0, "need vocab, d, ring_size >= 1 and pos >= 0");
  DeviceBuffer dl = to_device(logits), de = to_device(embed);
  DeviceBuffer dbest(sizeof(uint64_t));
  int n_best = 0;
  if (!block_best_.is_none()) {
    auto bb = arg<uint64_t>(block_best_.cast<py::array>(), "block_best", {-1});
    n_best = static_cast<int>(bb.shape(0));
    require(n_best >= 1, "block_best must not be empty");
    dbest = to_device(bb);
  }
  const k::SamplingConfig cfg{temperature, top_k, top_p, 0u, seed};
  DeviceBuffer dcfg(sizeof(cfg));
  dcfg.upload(&cfg, sizeof(cfg));
  const int32_t p[2] = {pos, pos + 1};
  DeviceBuffer dpos(sizeof(p));
  dpos.upload(p, sizeof(p));
  DeviceBuffer ring = DeviceBuffer::poisoned(2 * sizeof(int32_t) * ring_size),
               x = DeviceBuffer::poisoned(sizeof(float) * d);
  DeviceBuffer flag(sizeof(int32_t));
  flag.upload(&f16_overflow, sizeof(int32_t));
  DeviceBuffer token = unwritten_tokens(1);
  k::sample_step(dl.get<float>(), vocab, n_best ? dbest.get<uint64_t>() : nullptr, n_best,
                 dcfg.get<k::SamplingConfig>(), token.get<int32_t>(),
                 k::StepEnd{dpos.get<int32_t>(), ring.get<int32_t>(), ring_size, flag.get<int32_t>(), de.get<bf16>(), d,
                            x.get<float>()},
                 nullptr);
  sync();
  return py::make_tuple(to_host<int32_t>(token, {1}).at(0), to_host<int32_t>(dpos, {2}),
                        to_host<int32_t>(ring, {2 * ring_size}), to_host<float>(x, {d}),
                        to_host<int32_t>(flag, {1}).at(0));
}

double time_sample(int vocab, float temperature, int top_k, float top_p, int iters) {
  require(vocab >= 1, "vocab must be >= 1");
  std::vector<float> host(static_cast<size_t>(vocab));
  for (int i = 0; i < vocab; ++i) host[static_cast<size_t>(i)] = std::sin(0.37f * i) * 8.0f;  // spread, distinct
  DeviceBuffer logits(sizeof(float) * vocab), pos = device_int(100), token(sizeof(int32_t));
  logits.upload(host.data(), logits.bytes());
  const k::SamplingConfig cfg{temperature, top_k, top_p, 0u, 1234u};
  DeviceBuffer dcfg(sizeof(cfg));
  dcfg.upload(&cfg, sizeof(cfg));
  DeviceBuffer scratch(k::sampling_scratch_bytes(vocab));
  return median_us(
      [&](int) {
        k::sample(logits.get<float>(), vocab, dcfg.get<k::SamplingConfig>(), pos.get<int32_t>(), scratch.get(),
                  token.get<int32_t>(), nullptr);
      },
      iters, 3);
}

}  // namespace

void register_sampling(py::module_& m) {
  m.def("argmax_rows", &argmax_rows, py::arg("logits"),
        "greedy token per row of f32 [rows, vocab] (the lower index on ties; -1 as the sampler's)");
  m.def("sample", &sample, py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("seed"), py::arg("pos"), "one token from f32 logits [vocab]");
  m.def("sample_step", &sample_step, py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("seed"), py::arg("pos"), py::arg("embed"), py::arg("block_best") = py::none(), py::arg("ring_size") = 4,
        py::arg("f16_overflow") = 0,
        "the sampler ending a step: logits f32 [vocab], embed u16 [vocab, d] -> (token, pos i32 [2] after, ring i32 "
        "[2 ring_size]: tokens then overflow flags, x f32 [d], the overflow flag after)");
  m.def("sample_seeds", &sample_seeds, py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("seeds"), py::arg("pos"), "one token per seed (u64 [n]) -> i32 [n]");
  m.def("time_sample", &time_sample, py::arg("vocab"), py::arg("temperature") = 0.0f, py::arg("top_k") = 0,
        py::arg("top_p") = 1.0f, py::arg("iters") = 50, "us per sample launch (median of iters batches)");
}

}  // namespace atomflow::bindings::ops

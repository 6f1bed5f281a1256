// _core.ops: each kernel exposed to Python for testing and benchmarking. numpy in (bf16 as uint16
// bit patterns, fp8 as uint8 bytes), device copies, outputs poisoned with 0xFF bytes (NaN for
// floats, -1 for ints) so an unwritten element cannot pass, one launch, synchronize, numpy out.
// The time_* helpers return microseconds per launch (CUDA events around batches of back-to-back
// launches, median over batches), rotating over enough weight / cache copies that the L2 cannot
// serve them.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "args.h"
#include "atomflow/attention_scratch.h"
#include "atomflow/device_buffer.h"
#include "atomflow/timing.h"
#include "atomflow/kernels.h"

namespace py = pybind11;
using atomflow::DeviceBuffer;
using atomflow::attention_scratch;
using atomflow::bf16;
using atomflow::f16;
namespace k = atomflow::kernels;
using atomflow::median_us;

namespace {

// ------------------------------------------------------------------ argument checks (args.h)

using atomflow::bindings::arg;
using atomflow::bindings::require;

k::Epilogue epilogue_arg(int ep) {
  require(ep >= 0 && ep <= 2, "epilogue must be 0 (Store), 1 (AddResidual) or 2 (SwiGLU), got " + std::to_string(ep));
  return static_cast<k::Epilogue>(ep);
}

// ------------------------------------------------------------------ device copies

template <class T>
DeviceBuffer to_device(const py::array_t<T>& a) {
  DeviceBuffer d(static_cast<size_t>(a.nbytes()));
  d.upload(a.data(), static_cast<size_t>(a.nbytes()));
  return d;
}

DeviceBuffer device_int(int32_t v) {
  DeviceBuffer d(sizeof(int32_t));
  d.upload(&v, sizeof(v));
  return d;
}

// The SwiGLU GEMV's ticket counters (kernels.h) for every launch of this module: zeroed once, and
// each launch leaves them zeroed. Never freed (a static's destructor could run after the driver).
unsigned* gemv_tickets() {
  static unsigned* const t = [] {
    auto* b = new DeviceBuffer(k::kGemvTicketBytes);
    b->fill(0);
    return b->get<unsigned>();
  }();
  return t;
}

void sync() {
  AF_CUDA_CHECK(cudaGetLastError());
  AF_CUDA_CHECK(cudaDeviceSynchronize());
}

template <class T>
py::array_t<T> to_host(const DeviceBuffer& d, const std::vector<py::ssize_t>& shape) {
  py::array_t<T> out(shape);
  d.download(out.mutable_data(), static_cast<size_t>(out.nbytes()));
  return out;
}

// ------------------------------------------------------------------ timing

// Copies of a working set, carved out of one allocation, so that consecutive launches never find
// their data in L2 (60 MB on an H200): at least 256 MB in all and at least 2 copies.
struct Rotating {
  size_t stride = 0;
  int copies = 0;
  DeviceBuffer buf;
  explicit Rotating(size_t bytes_per_copy) : stride((std::max<size_t>(bytes_per_copy, 1) + 255) / 256 * 256) {
    copies = static_cast<int>(std::max<size_t>(2, (size_t{256} << 20) / stride + 1));
    buf = DeviceBuffer(stride * copies);
  }
  template <class T>
  T* at(int i, size_t offset = 0) const {
    return reinterpret_cast<T*>(buf.get<uint8_t>() + stride * static_cast<size_t>(i % copies) + offset);
  }
};

// ------------------------------------------------------------------ ops

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

// A 16-bit activation output's type (out_dtype): "bf16", or "f16" with an overflow flag (kernels.h)
// on the device, zeroed; the call then returns (out, flag).
struct Out16 {
  DeviceBuffer flag;
  bool f16;
  explicit Out16(const std::string& out_dtype) : f16(out_dtype == "f16") {
    require(out_dtype == "bf16" || f16, "out_dtype must be 'bf16' or 'f16', got '" + out_dtype + "'");
    if (f16) {
      flag = DeviceBuffer(sizeof(int32_t));
      flag.fill(0);
    }
  }
  int* ptr() { return f16 ? flag.get<int>() : nullptr; }
  py::object result(py::array out) const {
    if (!f16) return std::move(out);
    return py::make_tuple(out, to_host<int32_t>(flag, {1}).at(0));
  }
};

// Shared by gemv (M = 1, x [K]) and gemm (x [M, K]). out_init: the AddResidual starting values.
// out_dtype: SwiGLU's output of the gemv (Out16).
py::object linear(const py::array& w_, const py::array& s_, const py::array& x_, int ep_, const py::object& out_init_,
                  bool gemm, const std::string& x_dtype, const std::string& out_dtype = "bf16") {
  require(x_dtype == "bf16" || x_dtype == "f16", "x_dtype must be 'bf16' or 'f16', got '" + x_dtype + "'");
  const k::Act xt = x_dtype == "f16" ? k::Act::F16 : k::Act::BF16;
  const k::Epilogue ep = epilogue_arg(ep_);
  auto w = arg<uint8_t>(w_, "w", {-1, -1});
  const int N = static_cast<int>(w.shape(0)), K = static_cast<int>(w.shape(1));
  require(K % 128 == 0, "w: K = " + std::to_string(K) + " must be a multiple of 128");
  auto s = arg<float>(s_, "scales", {N, K / 128});
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
    k::gemv_w8a16(dw.get<uint8_t>(), ds.get<float>(), dx.get(), xt, N, K, ep, out.get(), nullptr, gemv_tickets(),
                  o16.ptr());
  sync();
  if (ep != k::Epilogue::SwiGLU) return to_host<float>(out, fp32_shape);
  return o16.result(gemm ? to_host<uint16_t>(out, {M, N / 2}) : to_host<uint16_t>(out, {N / 2}));
}

// The inputs of a GEMV with RMSNorm fused into its prologue, checked and on the device: w u8 [N, K]
// (N: any with -1), scales f32 [N, K / 128], x f32 [K] (the residual stream), norm_w u16 [K].
struct NormedGemvInputs {
  int N, K;
  DeviceBuffer w, scales, x, norm_w;
};

NormedGemvInputs normed_gemv_inputs(const py::array& w_, const py::array& s_, const py::array& x_,
                                    const py::array& nw_, py::ssize_t rows = -1) {
  auto w = arg<uint8_t>(w_, "w", {rows, -1});
  const int N = static_cast<int>(w.shape(0)), K = static_cast<int>(w.shape(1));
  require(K % 128 == 0, "w: K = " + std::to_string(K) + " must be a multiple of 128");
  auto s = arg<float>(s_, "scales", {N, K / 128});
  auto x = arg<float>(x_, "x", {K});
  auto nw = arg<uint16_t>(nw_, "norm_w", {K});
  return NormedGemvInputs{N, K, to_device(w), to_device(s), to_device(x), to_device(nw)};
}

py::object gemv_rmsnorm(const py::array& w_, const py::array& s_, const py::array& x_, const py::array& nw_, float eps,
                        int ep_, const py::object& out_init_, const std::string& out_dtype) {
  const k::Epilogue ep = epilogue_arg(ep_);
  NormedGemvInputs in = normed_gemv_inputs(w_, s_, x_, nw_);
  const int N = in.N, K = in.K;
  if (ep == k::Epilogue::SwiGLU) require(N % 2 == 0, "SwiGLU needs an even N (gate rows, then up rows)");
  const bool add = ep == k::Epilogue::AddResidual;
  require(add == !out_init_.is_none(), "out_init is required with AddResidual and only with it");
  Out16 o16(out_dtype);
  require(!o16.f16 || ep == k::Epilogue::SwiGLU, "out_dtype 'f16' is SwiGLU's only");
  DeviceBuffer out = add ? to_device(arg<float>(out_init_.cast<py::array>(), "out_init", {N}))
                         : DeviceBuffer::poisoned(ep == k::Epilogue::SwiGLU ? sizeof(bf16) * (N / 2)
                                                                           : sizeof(float) * N);
  k::gemv_w8a16_rmsnorm(in.w.get<uint8_t>(), in.scales.get<float>(), in.x.get<float>(), in.norm_w.get<bf16>(), eps, N,
                        K, ep, out.get(), nullptr, gemv_tickets(), o16.ptr());
  sync();
  if (ep == k::Epilogue::SwiGLU) return o16.result(to_host<uint16_t>(out, {N / 2}));
  return to_host<float>(out, {N});
}

// The head's launch: gemv_rmsnorm(Store) that also leaves each block's argmax key.
py::tuple gemv_rmsnorm_argmax(const py::array& w_, const py::array& s_, const py::array& x_, const py::array& nw_,
                              float eps) {
  NormedGemvInputs in = normed_gemv_inputs(w_, s_, x_, nw_);
  const int N = in.N, K = in.K, blocks = k::gemv_argmax_blocks(N, K);
  DeviceBuffer out = DeviceBuffer::poisoned(sizeof(float) * N), best = DeviceBuffer::poisoned(sizeof(uint64_t) * blocks);
  k::gemv_w8a16_rmsnorm_argmax(in.w.get<uint8_t>(), in.scales.get<float>(), in.x.get<float>(), in.norm_w.get<bf16>(),
                               eps, N, K, out.get<float>(), best.get<uint64_t>(), nullptr);
  sync();
  return py::make_tuple(to_host<float>(out, {N}), to_host<uint64_t>(best, {blocks}));
}

py::tuple rope_kv_append(const py::array& qkv_, const py::array& inv_freq_, int pos, int H, int Hkv, int D,
                         const py::array& k_cache_, const py::array& v_cache_) {
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
  DeviceBuffer q = DeviceBuffer::poisoned(sizeof(bf16) * M * H * D);
  k::rope_kv_append(dqkv.get<float>(), dfreq.get<float>(), dpos.get<int32_t>(), M, H, Hkv, D, C, q.get<bf16>(),
                    dk.get<bf16>(), dv.get<bf16>(), nullptr);
  sync();
  return py::make_tuple(to_host<uint16_t>(q, {M, H, D}), to_host<uint16_t>(dk, {C, Hkv, D}),
                        to_host<uint16_t>(dv, {C, Hkv, D}));
}

// The decode QKV product with RMSNorm and RoPE + KV append fused: w u8 [(H + 2 Hkv) D, K], scales,
// x f32 [K] (the residual stream), norm_w u16 [K], caches u16 [C, Hkv, D] (initial contents).
py::tuple gemv_rmsnorm_rope(const py::array& w_, const py::array& s_, const py::array& x_, const py::array& nw_,
                            float eps, const py::array& inv_freq_, int pos, int H, int Hkv, int D,
                            const py::array& k_cache_, const py::array& v_cache_) {
  require(H >= 1 && Hkv >= 1 && D >= 2 && D % 2 == 0, "need H, Hkv >= 1 and an even D");
  NormedGemvInputs in = normed_gemv_inputs(w_, s_, x_, nw_, (H + 2 * Hkv) * D);
  const int K = in.K;
  auto inv_freq = arg<float>(inv_freq_, "inv_freq", {D / 2});
  auto kc = arg<uint16_t>(k_cache_, "k_cache", {-1, Hkv, D});
  const int C = static_cast<int>(kc.shape(0));
  auto vc = arg<uint16_t>(v_cache_, "v_cache", {C, Hkv, D});
  require(pos >= 0, "need pos >= 0");
  DeviceBuffer dfreq = to_device(inv_freq), dk = to_device(kc), dv = to_device(vc), dpos = device_int(pos);
  DeviceBuffer q = DeviceBuffer::poisoned(sizeof(bf16) * H * D);
  const k::RopeKVArgs rope{dfreq.get<float>(), dpos.get<int32_t>(), H, Hkv, D, C, q.get<bf16>(), dk.get<bf16>(),
                           dv.get<bf16>()};
  k::gemv_w8a16_rmsnorm_rope(in.w.get<uint8_t>(), in.scales.get<float>(), in.x.get<float>(), in.norm_w.get<bf16>(), eps,
                             K, rope, nullptr);
  sync();
  return py::make_tuple(to_host<uint16_t>(q, {H, D}), to_host<uint16_t>(dk, {C, Hkv, D}),
                        to_host<uint16_t>(dv, {C, Hkv, D}));
}

py::object attention(const py::array& q_, const py::array& k_cache_, const py::array& v_cache_, int pos,
                     const py::object& scale_, bool early, const std::string& out_dtype) {
  Out16 o16(out_dtype);
  auto q = arg<uint16_t>(q_, "q", {-1, -1, -1});
  const int M = static_cast<int>(q.shape(0)), H = static_cast<int>(q.shape(1)), D = static_cast<int>(q.shape(2));
  auto kc = arg<uint16_t>(k_cache_, "k_cache", {-1, -1, D});
  const int C = static_cast<int>(kc.shape(0)), Hkv = static_cast<int>(kc.shape(1));
  auto vc = arg<uint16_t>(v_cache_, "v_cache", {C, Hkv, D});
  require(M >= 1 && pos >= 0 && pos + M <= C, "need M >= 1, pos >= 0 and pos + M <= cache rows");
  const float scale = scale_.is_none() ? 1.0f / std::sqrt(static_cast<float>(D)) : scale_.cast<float>();
  DeviceBuffer dq = to_device(q), dk = to_device(kc), dv = to_device(vc), dpos = device_int(pos);
  DeviceBuffer scratch = attention_scratch(k::attention_scratch_bytes(M, H, D, C));
  DeviceBuffer out = DeviceBuffer::poisoned(sizeof(bf16) * M * H * D);
  k::attention(dq.get<bf16>(), dk.get<bf16>(), dv.get<bf16>(), dpos.get<int32_t>(), M, H, Hkv, D, C, scale, scratch.get(),
               out.get(), nullptr, early, o16.ptr());
  sync();
  return o16.result(to_host<uint16_t>(out, {M, H, D}));
}

// One draw per seed (same logits and position): device configs uploaded once, one launch each.
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
  DeviceBuffer out = DeviceBuffer::poisoned(sizeof(int32_t) * n);
  for (int i = 0; i < n; ++i)
    k::sample(dl.get<float>(), vocab, dcfg.get<k::SamplingConfig>() + i, dpos.get<int32_t>(), scratch.get(),
              out.get<int32_t>() + i, nullptr);
  sync();
  return to_host<int32_t>(out, {n});
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
  DeviceBuffer ring = DeviceBuffer::poisoned(2 * sizeof(int32_t) * ring_size), x = DeviceBuffer::poisoned(sizeof(float) * d);
  DeviceBuffer flag(sizeof(int32_t));
  flag.upload(&f16_overflow, sizeof(int32_t));
  DeviceBuffer token = DeviceBuffer::poisoned(sizeof(int32_t));
  k::sample_step(dl.get<float>(), vocab, n_best ? dbest.get<uint64_t>() : nullptr, n_best, dcfg.get<k::SamplingConfig>(),
                 token.get<int32_t>(), k::StepEnd{dpos.get<int32_t>(), ring.get<int32_t>(), ring_size, flag.get<int32_t>(),
                                                  de.get<bf16>(), d, x.get<float>()},
                 nullptr);
  sync();
  return py::make_tuple(to_host<int32_t>(token, {1}).at(0), to_host<int32_t>(dpos, {2}),
                        to_host<int32_t>(ring, {2 * ring_size}), to_host<float>(x, {d}), to_host<int32_t>(flag, {1}).at(0));
}

// ------------------------------------------------------------------ micro-benchmarks

double stream_read_bandwidth(size_t n_bytes, int iters) {
  require(n_bytes >= 16 && n_bytes % 16 == 0, "n_bytes must be a positive multiple of 16");
  DeviceBuffer data(n_bytes), sink(sizeof(uint32_t));
  data.fill(0x5A);
  sink.fill(0);
  const double us = median_us([&](int) { k::stream_read(data.get(), n_bytes, sink.get<uint32_t>(), nullptr); }, iters, 3);
  return static_cast<double>(n_bytes) / (us * 1e3);  // bytes / ns = GB/s
}

// Random-looking weight bytes are not needed for timing (no DRAM compression on cudaMalloc memory):
// every byte 0x38 (1.0 in e4m3, and a finite fp32 scale) keeps every value finite.
double time_gemv(int N, int K, int iters, int ep_) {
  const k::Epilogue ep = epilogue_arg(ep_);
  const size_t wbytes = static_cast<size_t>(N) * K, sbytes = static_cast<size_t>(N) * (K / 128) * sizeof(float);
  Rotating ws(wbytes + sbytes);
  ws.buf.fill(0x38);
  DeviceBuffer x(sizeof(bf16) * K), out(sizeof(float) * N);
  x.fill(0);
  out.fill(0);
  return median_us([&](int i) {
    k::gemv_w8a16(ws.at<uint8_t>(i), ws.at<float>(i, wbytes), x.get(), k::Act::BF16, N, K, ep, out.get(), nullptr,
                  gemv_tickets());
  }, iters, std::min(ws.copies, 32));
}

double time_gemm(int M, int N, int K, int iters, int ep_) {
  const k::Epilogue ep = epilogue_arg(ep_);
  const size_t wbytes = static_cast<size_t>(N) * K, sbytes = static_cast<size_t>(N) * (K / 128) * sizeof(float);
  DeviceBuffer w(wbytes), s(sbytes), x(sizeof(bf16) * M * K), out(sizeof(float) * M * N);
  w.fill(0x38);
  s.fill(0);
  x.fill(0);
  out.fill(0);
  return median_us([&](int) {
    k::gemm_w8a16(w.get<uint8_t>(), s.get<float>(), x.get(), k::Act::BF16, M, N, K, ep, out.get(), nullptr);
  }, iters, 2);
}

// Attention of M query tokens whose last one sees `context` keys (pos = context - M).
double time_attention(int context, int H, int Hkv, int D, int M, int iters, bool early) {
  require(context >= M && M >= 1, "need context >= M >= 1");
  const int C = context;
  const size_t cache = static_cast<size_t>(C) * Hkv * D * sizeof(bf16);
  Rotating kv(2 * cache);  // K then V of one copy
  kv.buf.fill(0);
  DeviceBuffer q(sizeof(bf16) * M * H * D), out(sizeof(bf16) * M * H * D), pos = device_int(context - M);
  DeviceBuffer scratch = attention_scratch(k::attention_scratch_bytes(M, H, D, C));
  q.fill(0);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  return median_us([&](int i) {
    k::attention(q.get<bf16>(), kv.at<bf16>(i), kv.at<bf16>(i, cache), pos.get<int32_t>(), M, H, Hkv, D, C, scale,
                 scratch.get(), out.get<bf16>(), nullptr, early);
  }, iters, std::min(kv.copies, 32));
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
  return median_us([&](int) {
    k::sample(logits.get<float>(), vocab, dcfg.get<k::SamplingConfig>(), pos.get<int32_t>(), scratch.get(),
              token.get<int32_t>(), nullptr);
  }, iters, 3);
}

// ------------------------------------------------------------------ in-kernel trace (trace.cuh)

struct TraceState {
  DeviceBuffer recs, counts;
  unsigned per_sm = 0;
};
TraceState& trace_state() {
  static TraceState t;
  return t;
}

// Allocates per_sm records per SM region and points the recording kernels at them (0: off).
void trace_arm(unsigned per_sm) {
  TraceState& t = trace_state();
  if (per_sm == 0) {
    k::trace_arm(nullptr, nullptr, 0);
    t = TraceState{};
    return;
  }
  const size_t sms = k::trace_max_sms();
  t.recs = DeviceBuffer(k::trace_record_bytes() * sms * per_sm);
  t.counts = DeviceBuffer(sizeof(unsigned) * sms);
  t.per_sm = per_sm;
  AF_CUDA_CHECK(cudaMemset(t.counts.get(), 0, t.counts.bytes()));
  k::trace_arm(t.recs.get(), t.counts.get<unsigned>(), per_sm);
  sync();
}

void trace_reset() {
  TraceState& t = trace_state();
  require(t.per_sm > 0, "trace: not armed (ops.trace_arm first)");
  sync();
  AF_CUDA_CHECK(cudaMemset(t.counts.get(), 0, t.counts.bytes()));
  sync();
}

// The records written since the last reset, as raw bytes (trace::Rec, 160 each), and how many were dropped.
py::tuple trace_read() {
  TraceState& t = trace_state();
  require(t.per_sm > 0, "trace: not armed (ops.trace_arm first)");
  sync();
  const size_t sms = k::trace_max_sms();
  std::vector<unsigned> counts(sms);
  t.counts.download(counts.data(), sizeof(unsigned) * sms);
  const size_t rec = k::trace_record_bytes();
  std::vector<uint8_t> all(rec * sms * t.per_sm);
  t.recs.download(all.data(), all.size());
  std::string out;
  size_t dropped = 0;
  for (size_t s = 0; s < sms; ++s) {
    const size_t n = std::min<size_t>(counts[s], t.per_sm);
    dropped += counts[s] - n;
    out.append(reinterpret_cast<const char*>(all.data() + rec * s * t.per_sm), rec * n);
  }
  return py::make_tuple(py::bytes(out), dropped);
}

}  // namespace

void register_ops(pybind11::module_& m) {
  m.doc() = "Kernel test harness: each kernel on numpy inputs (bf16 = uint16, fp8 = uint8), and timers";
  m.def("embedding", &embedding, py::arg("table"), py::arg("tokens"), "table u16 [vocab, d], tokens i32 [M] -> f32 [M, d]");
  m.def("rmsnorm", &rmsnorm, py::arg("x"), py::arg("w"), py::arg("eps"), "x f32 [M, d], w u16 [d] (bf16) -> u16 [M, d] (f16)");
  m.def("add_inplace", &add_inplace, py::arg("x"), py::arg("y"), "x, y f32 [n] -> x + y");
  m.def(
      "gemv",
      [](const py::array& w, const py::array& s, const py::array& x, int ep, const py::object& out_init,
         const std::string& x_dtype, const std::string& out_dtype) {
        return linear(w, s, x, ep, out_init, false, x_dtype, out_dtype);
      },
      py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("epilogue") = 0, py::arg("out_init") = py::none(),
      py::arg("x_dtype") = "bf16", py::arg("out_dtype") = "bf16",
      "w u8 [N, K], scales f32 [N, K/128], x u16 [K] (bf16 or f16 bits, x_dtype); epilogue 0 Store -> f32 [N], "
      "1 AddResidual (out_init f32 [N]) -> f32 [N], 2 SwiGLU -> u16 [N/2] (bf16; out_dtype 'f16': (f16 bits, "
      "overflow flag))");
  m.def("gemv_qkv_staged_warps", &k::gemv_qkv_staged_warps, py::arg("H"), py::arg("Hkv"), py::arg("D"), py::arg("K"),
        "warps per block of the decode QKV launch of this shape that copy their second row pair into shared memory "
        "early (0: none)");
  m.def("gemv_swiglu_ticketed", &k::gemv_swiglu_ticketed, py::arg("N"), py::arg("K"), py::arg("norm") = false,
        "whether a SwiGLU gemv of w [N, K] (norm: with the fused RMSNorm) hands its row pairs past the first round "
        "out by ticket");
  m.def("gemv_rmsnorm", &gemv_rmsnorm, py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("norm_w"),
        py::arg("eps"), py::arg("epilogue") = 0, py::arg("out_init") = py::none(), py::arg("out_dtype") = "bf16",
        "gemv of bf16(rmsnorm(x f32 [K]) * norm_w u16 [K]); epilogues and out_dtype as gemv");
  m.def("gemv_rmsnorm_argmax", &gemv_rmsnorm_argmax, py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("norm_w"),
        py::arg("eps"),
        "the head's launch: gemv_rmsnorm Store -> (f32 [N], u64 [blocks]: each block's max of order key << 32 | ~row "
        "over the rows it wrote)");
  m.def("gemv_argmax_blocks", &k::gemv_argmax_blocks, py::arg("N"), py::arg("K"),
        "entries of gemv_rmsnorm_argmax's block maxima (its grid)");
  m.def(
      "gemm",
      [](const py::array& w, const py::array& s, const py::array& x, int ep, const py::object& out_init,
         const std::string& x_dtype) { return linear(w, s, x, ep, out_init, true, x_dtype); },
      py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("epilogue") = 0, py::arg("out_init") = py::none(),
      py::arg("x_dtype") = "bf16",
      "like gemv with x u16 [M, K] and outputs [M, ...]");
  m.def("rope_kv_append", &rope_kv_append, py::arg("qkv"), py::arg("inv_freq"), py::arg("pos"), py::arg("H"),
        py::arg("Hkv"), py::arg("D"), py::arg("k_cache"), py::arg("v_cache"),
        "qkv f32 [M, (H + 2 Hkv) D], inv_freq f32 [D/2], caches u16 [C, Hkv, D] (initial contents) -> "
        "(q u16 [M, H, D], k_cache, v_cache)");
  m.def("gemv_rmsnorm_rope", &gemv_rmsnorm_rope, py::arg("w"), py::arg("scales"), py::arg("x"), py::arg("norm_w"),
        py::arg("eps"), py::arg("inv_freq"), py::arg("pos"), py::arg("H"), py::arg("Hkv"), py::arg("D"),
        py::arg("k_cache"), py::arg("v_cache"),
        "RMSNorm -> QKV GEMV -> RoPE + KV append in one launch -> (q u16 [H, D], k_cache, v_cache)");
  m.def("attention", &attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("pos"),
        py::arg("scale") = py::none(), py::arg("early") = false, py::arg("out_dtype") = "bf16",
        "q u16 [M, H, D], caches u16 [C, Hkv, D], pos -> u16 [M, H, D] (bf16; out_dtype 'f16': (f16 bits, overflow "
        "flag)); early: the cached rows read before the PDL wait (the decode path's mode)");
  m.def("attention_cluster_size", &k::attention_cluster_size, py::arg("M"), py::arg("H"), py::arg("Hkv"), py::arg("D"),
        py::arg("max_context"),
        "blocks per thread-block cluster of an attention call of this shape (1: a plain launch, merged through the "
        "scratch)");
  m.def("sample", &sample, py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("seed"), py::arg("pos"), "one token from f32 logits [vocab]");
  m.def("sample_step", &sample_step, py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("seed"), py::arg("pos"), py::arg("embed"), py::arg("block_best") = py::none(), py::arg("ring_size") = 4,
        py::arg("f16_overflow") = 0,
        "the sampler ending a step: logits f32 [vocab], embed u16 [vocab, d] -> (token, pos i32 [2] after, ring i32 "
        "[2 ring_size]: tokens then overflow flags, x f32 [d], the overflow flag after)");
  m.def("sample_seeds", &sample_seeds, py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("seeds"), py::arg("pos"), "one token per seed (u64 [n]) -> i32 [n]");
  m.def("stream_read_bandwidth", &stream_read_bandwidth, py::arg("n_bytes"), py::arg("iters") = 20,
        "GB/s of the streaming-read kernel (median of iters batches)");
  m.def("time_gemv", &time_gemv, py::arg("N"), py::arg("K"), py::arg("iters") = 50, py::arg("epilogue") = 0,
        "us per gemv_w8a16 launch (median of iters batches), weights rotated so L2 cannot serve them");
  m.def("time_gemm", &time_gemm, py::arg("M"), py::arg("N"), py::arg("K"), py::arg("iters") = 20,
        py::arg("epilogue") = 0, "us per gemm_w8a16 launch (median of iters batches)");
  m.def("time_attention", &time_attention, py::arg("context"), py::arg("H"), py::arg("Hkv"), py::arg("D"),
        py::arg("M") = 1, py::arg("iters") = 50, py::arg("early") = false,
        "us per attention call (split + merge) for M queries, the last seeing `context` keys; caches rotated past L2; "
        "early: the decode step's mode (cached rows read before the PDL wait)");
  m.def("trace_built", &k::trace_built, "whether this build records the in-kernel trace (ATOMFLOW_TRACE)");
  m.def("trace_arm", &trace_arm, py::arg("per_sm"), "point the decode kernels at a trace buffer of per_sm records "
        "per SM (0: off)");
  m.def("trace_reset", &trace_reset, "forget the records written so far");
  m.def("trace_read", &trace_read, "(bytes of 160-byte records since the last reset, records dropped)");
  m.def("time_sample", &time_sample, py::arg("vocab"), py::arg("temperature") = 0.0f, py::arg("top_k") = 0,
        py::arg("top_p") = 1.0f, py::arg("iters") = 50, "us per sample launch (median of iters batches)");
}

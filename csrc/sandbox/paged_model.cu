// PagedModel (paged_model.h): weights, the paged KV pool, and one batched iteration of the forward pass.
#include "paged_model.h"

#include "atomflow/step_plan.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "atomflow/kernels.h"
#include "batch_kernels.h"

namespace atomflow::sandbox {

namespace k = atomflow::kernels;

namespace {

// The tensor table the dims imply: name -> bytes (fileformat.expected_tensors with an fp8 lm_head).
std::map<std::string, size_t> expected_bytes(const ModelDims& m) {
  std::map<std::string, size_t> t;
  auto fp8 = [&](const std::string& name, size_t n, size_t kk) {
    t[name] = n * kk;
    t[name + ".scale"] = n * CEIL_DIV(kk, 128) * sizeof(float);  // the last group may be 64 wide
  };
  const size_t d = m.d, f = m.f;
  t["embed"] = static_cast<size_t>(m.vocab) * d * 2;
  for (int i = 0; i < m.layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    t[p + "attn_norm"] = d * 2;
    fp8(p + "wqkv", m.qkv_dim(), d);
    fp8(p + "wo", d, m.q_dim());
    t[p + "mlp_norm"] = d * 2;
    fp8(p + "w13", 2 * f, d);
    fp8(p + "w2", d, f);
  }
  t["final_norm"] = d * 2;
  fp8("lm_head", m.vocab, d);
  return t;
}

}  // namespace

PagedModel::PagedModel(const ModelDims& dims, const PoolConfig& pool, bool f16_activations)
    : dims_(dims), pool_cfg_(pool), f16_acts_(f16_activations) {
  const ModelDims& m = dims_;
  AF_CHECK(m.vocab >= 1 && m.d >= 64 && m.f >= 64 && m.layers >= 1 && m.H >= 1 && m.Hkv >= 1,
           "PagedModel: bad model dims");
  AF_CHECK(m.d % 64 == 0 && m.f % 64 == 0 && m.q_dim() % 64 == 0, "PagedModel: d, f and H * D must be multiples of 64");
  AF_CHECK(m.D == 64 || m.D == 128, "PagedModel: head_dim must be 64 or 128");
  AF_CHECK(pool.num_blocks >= 1 && pool.max_rows >= 1 && pool.max_seqs >= 1 && pool.max_blocks_per_seq >= 1,
           "PagedModel: pool sizes must be >= 1");
  AF_CHECK(pool.max_seqs <= pool.max_rows, "PagedModel: max_seqs must be <= max_rows");
  AF_CHECK(static_cast<long long>(pool.num_blocks) * pool.block_size < (1LL << 31),
           "PagedModel: num_blocks * block_size must fit int32 slots");
  for (const auto& [name, bytes] : expected_bytes(m)) tensors_.emplace(name, Tensor{bytes, DeviceBuffer()});

  pool_ = DeviceBuffer(static_cast<size_t>(pool.num_blocks) * block_bytes());
  clear_pool();
  const size_t R = pool.max_rows, L = pool.max_seqs + 1;
  inv_freq_ = DeviceBuffer(sizeof(float) * m.D / 2);
  x_ = DeviceBuffer(sizeof(float) * R * m.d);
  xn_ = DeviceBuffer(sizeof(f16) * std::max(R, L) * m.d);  // also the head's normed rows
  qkv_ = DeviceBuffer(sizeof(float) * R * m.qkv_dim());
  q_ = DeviceBuffer(sizeof(bf16) * R * m.q_dim());
  attn_ = DeviceBuffer(sizeof(bf16) * R * m.q_dim());
  ffn_ = DeviceBuffer(sizeof(bf16) * R * m.f);
  xg_ = DeviceBuffer(sizeof(float) * L * m.d);
  logits_ = DeviceBuffer(sizeof(float) * L * m.vocab);
  next_ = DeviceBuffer(sizeof(int32_t) * L);
  // Scratch for the largest decode batch and the largest prefill chunk (B * s_max is not monotone in B).
  size_t scratch = 0;
  for (int b = 1; b <= pool.max_seqs; ++b)
    scratch =
        std::max(scratch, k::attention_paged_scratch_bytes(b, 1, m.H, m.D, pool.max_blocks_per_seq, pool.block_size));
  for (int r = 1; r <= pool.max_rows; ++r)
    scratch =
        std::max(scratch, k::attention_paged_scratch_bytes(1, r, m.H, m.D, pool.max_blocks_per_seq, pool.block_size));
  scratch_ = DeviceBuffer(scratch);
  tickets_ = DeviceBuffer(k::kGemvTicketBytes);
  tickets_.fill(0);
  int dev = 0, major = 0;
  AF_CUDA_CHECK(cudaGetDevice(&dev));
  AF_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  const k::Sm90Layer layer{m.d, m.f, m.q_dim(), m.qkv_dim()};
  sm90_ = major == 9 && pool.max_rows >= StepPlan::kSm90GemmMinRows && k::gemm_w8a16_sm90_takes_layer(layer);
  if (sm90_)
    gemm_ws_bytes_ = k::gemm_w8a16_sm90_layer_workspace_bytes(layer, StepPlan::kSm90GemmMinRows, pool.max_rows);
  if (sm90_) gemm_ws_ = DeviceBuffer(gemm_ws_bytes_);
  f16_overflow_ = DeviceBuffer(sizeof(int32_t));
  f16_overflow_.fill(0);
  input_ints_ = 3 * R + L + pool.max_seqs + 1 + static_cast<size_t>(pool.max_seqs + 1) * pool.max_blocks_per_seq;
  inputs_ = DeviceBuffer(sizeof(int32_t) * input_ints_);
  AF_CUDA_CHECK(cudaMallocHost(&host_inputs_, sizeof(int32_t) * input_ints_));
  AF_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  k::attention_scratch_clear(scratch_.get(), scratch_.bytes(), stream_);  // on stream_: before any step's attention
  AF_CUDA_CHECK(cudaEventCreate(&ev_start_));
  AF_CUDA_CHECK(cudaEventCreate(&ev_stop_));
}

PagedModel::~PagedModel() {
  // No checks: destructors must not throw.
  if (host_inputs_) cudaFreeHost(host_inputs_);
  if (ev_start_) cudaEventDestroy(ev_start_);
  if (ev_stop_) cudaEventDestroy(ev_stop_);
  if (stream_) cudaStreamDestroy(stream_);
}

size_t PagedModel::block_bytes() const {
  return static_cast<size_t>(dims_.layers) * 2 * pool_cfg_.block_size * dims_.Hkv * dims_.D * sizeof(bf16);
}

size_t PagedModel::weight_bytes() const {
  size_t total = 0;
  for (const auto& [name, t] : tensors_) total += t.bytes;
  return total;
}

// Pool layout [layers][K, V][num_blocks * block_size rows][Hkv][D].
bf16* PagedModel::k_pool(int layer) const {
  const size_t per = static_cast<size_t>(pool_cfg_.num_blocks) * pool_cfg_.block_size * dims_.Hkv * dims_.D;
  return pool_.get<bf16>() + (2 * static_cast<size_t>(layer)) * per;
}
bf16* PagedModel::v_pool(int layer) const {
  const size_t per = static_cast<size_t>(pool_cfg_.num_blocks) * pool_cfg_.block_size * dims_.Hkv * dims_.D;
  return pool_.get<bf16>() + (2 * static_cast<size_t>(layer) + 1) * per;
}

void PagedModel::clear_pool() { pool_.fill(0); }

void PagedModel::upload(const std::string& name, const void* data, size_t bytes) {
  const auto it = tensors_.find(name);
  AF_CHECK(it != tensors_.end(), "PagedModel: unexpected tensor '" + name + "' (the sandbox needs an fp8 lm_head)");
  AF_CHECK(bytes == it->second.bytes, "PagedModel: tensor '" + name + "' has " + std::to_string(bytes) +
                                          " bytes, the dims imply " + std::to_string(it->second.bytes));
  DeviceBuffer buf(bytes);
  buf.upload(data, bytes);
  it->second.buf = std::move(buf);
  layers_.clear();  // pointers resolved before this upload are stale
}

void PagedModel::upload_inv_freq(const float* inv_freq, int n) {
  AF_CHECK(n == dims_.D / 2, "PagedModel: inv_freq must have head_dim / 2 entries");
  inv_freq_.upload(inv_freq, sizeof(float) * n);
  have_inv_freq_ = true;
}

bool PagedModel::ready() const {
  if (!have_inv_freq_) return false;
  for (const auto& [name, t] : tensors_)
    if (t.buf.get() == nullptr) return false;
  return true;
}

template <class T>
const T* PagedModel::ptr(const std::string& name) const {
  return tensors_.at(name).buf.get<T>();
}

void PagedModel::resolve() {
  embed_ = ptr<bf16>("embed");
  final_norm_ = ptr<bf16>("final_norm");
  lm_head_ = linear_of("lm_head");
  std::vector<Layer> layers;
  for (int l = 0; l < dims_.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    layers.push_back(Layer{ptr<bf16>(p + "attn_norm"), linear_of(p + "wqkv"), linear_of(p + "wo"),
                           ptr<bf16>(p + "mlp_norm"), linear_of(p + "w13"), linear_of(p + "w2")});
  }
  layers_ = std::move(layers);
}

void PagedModel::copy_blocks(const BlockCopy* copies, int n) {
  const size_t per_layer = static_cast<size_t>(pool_cfg_.block_size) * dims_.Hkv * dims_.D;  // elements
  for (int i = 0; i < n; ++i) {
    const BlockCopy c = copies[i];
    AF_CHECK(c.src >= 0 && c.src < pool_cfg_.num_blocks && c.dst >= 0 && c.dst < pool_cfg_.num_blocks && c.src != c.dst,
             "copy_blocks: block out of range");
    for (int l = 0; l < dims_.layers; ++l)
      for (bf16* base : {k_pool(l), v_pool(l)})
        AF_CUDA_CHECK(cudaMemcpyAsync(base + c.dst * per_layer, base + c.src * per_layer, per_layer * sizeof(bf16),
                                      cudaMemcpyDeviceToDevice, stream_));
  }
  AF_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// ---- one iteration ----

void PagedModel::check_step(const StepInput& in) const {
  const PoolConfig& p = pool_cfg_;
  const int n_prefill = in.rows - in.n_decode;
  AF_CHECK(in.rows >= 1 && in.rows <= p.max_rows, "step: rows must be in [1, max_rows]");
  AF_CHECK(in.n_decode >= 0 && in.n_decode <= p.max_seqs && in.n_decode <= in.rows, "step: n_decode out of range");
  AF_CHECK(in.n_logits >= 0 && in.n_logits <= p.max_seqs + 1, "step: n_logits out of range");
  const long long slots = static_cast<long long>(p.num_blocks) * p.block_size;
  for (int r = 0; r < in.rows; ++r) {
    AF_CHECK(in.tokens[r] >= 0 && in.tokens[r] < dims_.vocab, "step: token id out of range");
    AF_CHECK(in.positions[r] >= 0, "step: negative position");
    AF_CHECK(in.slots[r] >= 0 && in.slots[r] < slots, "step: slot outside the pool");
  }
  auto check_table = [&](const int32_t* t, int n) {
    for (int i = 0; i < n; ++i) AF_CHECK(t[i] >= 0 && t[i] < p.num_blocks, "step: block table entry outside the pool");
  };
  if (in.n_decode > 0) {
    AF_CHECK(in.decode_stride >= 1 && in.decode_stride <= p.max_blocks_per_seq,
             "step: decode table stride out of range");
    for (int b = 0; b < in.n_decode; ++b) {
      const int len = in.decode_lens[b];
      AF_CHECK(len >= 1 && len <= in.decode_stride * p.block_size, "step: decode length outside its table");
      AF_CHECK(in.positions[b] == len - 1, "step: a decode token must sit at position len - 1");
      check_table(in.decode_tables + static_cast<size_t>(b) * in.decode_stride, CEIL_DIV(len, p.block_size));
    }
  }
  if (n_prefill > 0) {
    AF_CHECK(in.prefill_stride >= 1 && in.prefill_stride <= p.max_blocks_per_seq,
             "step: prefill table stride out of range");
    AF_CHECK(in.prefill_len >= n_prefill && in.prefill_len <= in.prefill_stride * p.block_size,
             "step: prefill length must cover the chunk and fit its table");
    check_table(in.prefill_table, CEIL_DIV(in.prefill_len, p.block_size));
  }
  for (int i = 0; i < in.n_logits; ++i)
    AF_CHECK(in.logit_rows[i] >= 0 && in.logit_rows[i] < in.rows, "step: logit row out of range");
}

// As the core: one row streams the weights through the GEMV, prefill-sized steps (StepPlan's
// kSm90GemmMinRows rows on) go to the Hopper GEMM (the core's bits for a chunk of the same rows); the
// rows between (batched decode) stay on gemm_w8a16, whose crossover docs/SANDBOX.md measured.
void PagedModel::linear(const Linear& w, const void* x, bool x_f16, int rows, int N, int K, k::Epilogue ep, void* out) {
  const k::Act xt = x_f16 ? k::Act::F16 : k::Act::BF16;
  if (rows == 1)
    k::gemv_w8a16(k::plan_gemv(ep, static_cast<k::GemvIn>(xt), N, K), w.w, w.scales, x, xt, N, K, ep, out, stream_,
                  tickets_.get<unsigned>());
  else if (sm90_ && rows >= StepPlan::kSm90GemmMinRows)
    k::gemm_w8a16_sm90(w.w, w.scales, x, xt, rows, N, K, ep, out, gemm_ws_.get(), gemm_ws_bytes_, stream_);
  else
    k::gemm_w8a16(w.w, w.scales, x, xt, rows, N, K, ep, out, stream_);
}

// As the core: one row takes the fused RMSNorm + GEMV (bit-identical to the two kernels).
void PagedModel::normed_linear(const bf16* norm, const Linear& w, int rows, int N, k::Epilogue ep, void* out,
                               int* f16_overflow) {
  if (rows == 1) {
    k::gemv_w8a16_rmsnorm(k::plan_gemv(ep, k::GemvIn::NORM, N, dims_.d), w.w, w.scales, x_.get<float>(), norm,
                          dims_.eps, N, dims_.d, ep, out, stream_, tickets_.get<unsigned>(), f16_overflow);
    return;
  }
  k::rmsnorm(x_.get<float>(), norm, rows, dims_.d, dims_.eps, xn_.get<f16>(), stream_);
  linear(w, xn_.get(), true, rows, N, dims_.d, ep, out);
}

void PagedModel::step(const StepInput& in, int32_t* next_tokens, float* logits) {
  if (layers_.empty()) {
    AF_CHECK(ready(), "PagedModel: weights or inv_freq not uploaded");
    resolve();
  }
  check_step(in);
  const ModelDims& m = dims_;
  const PoolConfig& p = pool_cfg_;
  const int R = in.rows, n_prefill = in.rows - in.n_decode, L = in.n_logits;

  // Pack the step's inputs tightly into the pinned mirror: one host-to-device copy.
  int32_t* h = host_inputs_;
  size_t off = 0;
  auto put = [&](const int32_t* src, size_t n) {
    const size_t at = off;
    if (n) std::memcpy(h + off, src, n * sizeof(int32_t));
    off += n;
    return at;
  };
  const size_t o_tok = put(in.tokens, R), o_pos = put(in.positions, R), o_slot = put(in.slots, R);
  const size_t o_logit = put(in.logit_rows, L);
  const size_t o_dlen = put(in.decode_lens, in.n_decode);
  const size_t o_dtab = put(in.decode_tables, static_cast<size_t>(in.n_decode) * in.decode_stride);
  const size_t o_plen = put(&in.prefill_len, n_prefill > 0 ? 1 : 0);
  const size_t o_ptab = put(in.prefill_table, n_prefill > 0 ? in.prefill_stride : 0);
  AF_CHECK(off <= input_ints_, "step: inputs exceed the staging buffer");
  const int32_t* d = inputs_.get<int32_t>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(m.D));
  const long long num_slots = static_cast<long long>(p.num_blocks) * p.block_size;
  const size_t qrow = static_cast<size_t>(m.q_dim());
  for (;;) {
    // One row hands attention's and SwiGLU's outputs on in fp16, as the core's decode step; a run
    // whose flag comes back set runs again in bf16 (it rewrites the same K/V slots with the same
    // values) and the model stays in bf16.
    const bool half = R == 1 && f16_acts_;
    int* const overflow = half ? f16_overflow_.get<int>() : nullptr;
    AF_CUDA_CHECK(cudaEventRecord(ev_start_, stream_));
    AF_CUDA_CHECK(cudaMemcpyAsync(inputs_.get(), h, off * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    k::embedding(embed_, d + o_tok, R, m.d, m.vocab, x_.get<float>(), stream_);
    for (int l = 0; l < m.layers; ++l) {
      const Layer& lw = layers_[static_cast<size_t>(l)];
      normed_linear(lw.attn_norm, lw.wqkv, R, m.qkv_dim(), k::Epilogue::Store, qkv_.get());
      k::rope_kv_append_slots(qkv_.get<float>(), inv_freq_.get<float>(), d + o_pos, d + o_slot, R, m.H, m.Hkv, m.D,
                              num_slots, q_.get<bf16>(), k_pool(l), v_pool(l), stream_);
      if (in.n_decode > 0)
        k::attention_paged(q_.get<bf16>(), k_pool(l), v_pool(l), d + o_dtab, d + o_dlen, in.n_decode, 1, m.H, m.Hkv,
                           m.D, p.block_size, p.num_blocks, in.decode_stride, scale, scratch_.get(), attn_.get(),
                           stream_, overflow);
      if (n_prefill > 0)
        k::attention_paged(q_.get<bf16>() + in.n_decode * qrow, k_pool(l), v_pool(l), d + o_ptab, d + o_plen, 1,
                           n_prefill, m.H, m.Hkv, m.D, p.block_size, p.num_blocks, in.prefill_stride, scale,
                           scratch_.get(), attn_.get<bf16>() + in.n_decode * qrow, stream_, overflow);
      linear(lw.wo, attn_.get(), half, R, m.d, m.q_dim(), k::Epilogue::AddResidual, x_.get());
      normed_linear(lw.mlp_norm, lw.w13, R, 2 * m.f, k::Epilogue::SwiGLU, ffn_.get(), overflow);
      linear(lw.w2, ffn_.get(), half, R, m.d, m.f, k::Epilogue::AddResidual, x_.get());
    }
    if (L == 1) {  // the core's head: fused final norm + lm_head GEMV on the one row
      k::gemv_w8a16_rmsnorm(k::plan_gemv(k::Epilogue::Store, k::GemvIn::NORM, m.vocab, m.d), lm_head_.w,
                            lm_head_.scales, x_.get<float>() + static_cast<size_t>(in.logit_rows[0]) * m.d, final_norm_,
                            m.eps, m.vocab, m.d, k::Epilogue::Store, logits_.get(), stream_);
    } else if (L > 1) {
      gather_rows(x_.get<float>(), d + o_logit, L, m.d, xg_.get<float>(), stream_);
      k::rmsnorm(xg_.get<float>(), final_norm_, L, m.d, m.eps, xn_.get<f16>(), stream_);
      k::gemm_w8a16(lm_head_.w, lm_head_.scales, xn_.get(), k::Act::F16, L, m.vocab, m.d, k::Epilogue::Store,
                    logits_.get(), stream_);
    }
    if (L > 0) argmax_rows(logits_.get<float>(), L, m.vocab, next_.get<int32_t>(), stream_);
    AF_CUDA_CHECK(cudaEventRecord(ev_stop_, stream_));
    AF_CUDA_CHECK(cudaStreamSynchronize(stream_));
    int32_t overflowed = 0;
    if (half) AF_CUDA_CHECK(cudaMemcpy(&overflowed, overflow, sizeof(int32_t), cudaMemcpyDeviceToHost));
    if (!overflowed) break;
    f16_acts_ = false;
    f16_overflow_.fill(0);
  }
  if (L > 0) {
    AF_CUDA_CHECK(cudaMemcpyAsync(next_tokens, next_.get(), sizeof(int32_t) * L, cudaMemcpyDeviceToHost, stream_));
    if (logits)
      AF_CUDA_CHECK(
          cudaMemcpyAsync(logits, logits_.get(), sizeof(float) * L * m.vocab, cudaMemcpyDeviceToHost, stream_));
  }
  AF_CUDA_CHECK(cudaStreamSynchronize(stream_));
  AF_CUDA_CHECK(cudaEventElapsedTime(&last_ms_, ev_start_, ev_stop_));
}

}  // namespace atomflow::sandbox

// The sandbox's kernel harness and timers (harness.h).
#include "harness.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>

#include "atomflow/attention_scratch.h"
#include "atomflow/device_buffer.h"
#include "atomflow/timing.h"
#include "atomflow/kernels.h"
#include "batch_kernels.h"

namespace atomflow::sandbox {

namespace k = atomflow::kernels;

namespace {

DeviceBuffer to_device(const void* src, size_t bytes) {
  DeviceBuffer d(bytes);
  d.upload(src, bytes);
  return d;
}

void sync() {
  AF_CUDA_CHECK(cudaGetLastError());
  AF_CUDA_CHECK(cudaDeviceSynchronize());
}

// Copies of a working set so consecutive launches never find it in L2 (tens of MB on Hopper):
// at least 256 MB in all, at most 64 copies, one copy when a single one is already that large.
int rotation_copies(size_t bytes_per_copy) {
  const size_t target = size_t{256} << 20;
  return static_cast<int>(
      std::min<size_t>(64, std::max<size_t>(1, CEIL_DIV(target, std::max<size_t>(bytes_per_copy, 1)))));
}

}  // namespace

// ---- kernels on host arrays ----

void run_attention_paged(const uint16_t* q, const uint16_t* k_pool, const uint16_t* v_pool, const int32_t* tables,
                         const int32_t* lens, int B, int M, int H, int Hkv, int D, int block_size, int num_blocks,
                         int max_blocks, float scale, uint16_t* out) {
  const size_t pool = static_cast<size_t>(num_blocks) * block_size * Hkv * D * sizeof(bf16);
  const size_t qbytes = static_cast<size_t>(B) * M * H * D * sizeof(bf16);
  DeviceBuffer dq = to_device(q, qbytes), dk = to_device(k_pool, pool), dv = to_device(v_pool, pool);
  DeviceBuffer dt = to_device(tables, sizeof(int32_t) * B * max_blocks), dl = to_device(lens, sizeof(int32_t) * B);
  DeviceBuffer scratch = attention_scratch(k::attention_paged_scratch_bytes(B, M, H, D, max_blocks, block_size));
  DeviceBuffer dout = DeviceBuffer::poisoned(qbytes);
  k::attention_paged(dq.get<bf16>(), dk.get<bf16>(), dv.get<bf16>(), dt.get<int32_t>(), dl.get<int32_t>(), B, M, H, Hkv,
                     D, block_size, num_blocks, max_blocks, scale, scratch.get(), dout.get<bf16>(), nullptr);
  sync();
  dout.download(out, qbytes);
}

void run_attention_batched_calls(const std::vector<BatchedAttentionCall>& calls, int H, int Hkv, int D, float scale) {
  size_t bytes = 0;
  for (const BatchedAttentionCall& c : calls)
    bytes = std::max(bytes, k::attention_batched_scratch_bytes(c.B, c.M, H, D, c.capacity));
  DeviceBuffer scratch = attention_scratch(bytes);
  for (const BatchedAttentionCall& c : calls) {
    const size_t cache = static_cast<size_t>(c.B) * c.capacity * Hkv * D * sizeof(bf16);
    const size_t qbytes = static_cast<size_t>(c.B) * c.M * H * D * sizeof(bf16);
    DeviceBuffer dq = to_device(c.q, qbytes), dk = to_device(c.k_cache, cache), dv = to_device(c.v_cache, cache);
    DeviceBuffer dl = to_device(c.lens, sizeof(int32_t) * c.B);
    DeviceBuffer dout = DeviceBuffer::poisoned(qbytes);
    k::attention_batched(dq.get<bf16>(), dk.get<bf16>(), dv.get<bf16>(), dl.get<int32_t>(), c.B, c.M, H, Hkv, D,
                         c.capacity, scale, scratch.get(), dout.get<bf16>(), nullptr);
    sync();
    dout.download(c.out, qbytes);
  }
}

void run_attention_batched(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* lens,
                           int B, int M, int H, int Hkv, int D, int capacity, float scale, uint16_t* out) {
  run_attention_batched_calls({BatchedAttentionCall{q, k_cache, v_cache, lens, B, M, capacity, out}}, H, Hkv, D, scale);
}

void run_attention_contiguous(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, int pos, int M,
                              int H, int Hkv, int D, int capacity, float scale, uint16_t* out) {
  const size_t cache = static_cast<size_t>(capacity) * Hkv * D * sizeof(bf16);
  const size_t qbytes = static_cast<size_t>(M) * H * D * sizeof(bf16);
  DeviceBuffer dq = to_device(q, qbytes), dk = to_device(k_cache, cache), dv = to_device(v_cache, cache);
  DeviceBuffer dpos = to_device(&pos, sizeof(int32_t));
  DeviceBuffer scratch = attention_scratch(k::attention_scratch_bytes(M, H, D, capacity));
  DeviceBuffer dout = DeviceBuffer::poisoned(qbytes);
  k::attention(k::plan_attention(M, H, Hkv, D, capacity), dq.get<bf16>(), dk.get<bf16>(), dv.get<bf16>(),
               dpos.get<int32_t>(), M, H, Hkv, D, capacity, scale, scratch.get(), dout.get<bf16>(), nullptr);
  sync();
  dout.download(out, qbytes);
}

void run_rope_slots(const float* qkv, const float* inv_freq, const int32_t* positions, const int32_t* slots, int M,
                    int H, int Hkv, int D, long long num_slots, uint16_t* q_out, uint16_t* k_pool, uint16_t* v_pool) {
  const size_t pool = static_cast<size_t>(num_slots) * Hkv * D * sizeof(bf16);
  DeviceBuffer dqkv = to_device(qkv, sizeof(float) * M * (H + 2 * Hkv) * D);
  DeviceBuffer df = to_device(inv_freq, sizeof(float) * D / 2);
  DeviceBuffer dp = to_device(positions, sizeof(int32_t) * M), ds = to_device(slots, sizeof(int32_t) * M);
  DeviceBuffer dk = to_device(k_pool, pool), dv = to_device(v_pool, pool);
  DeviceBuffer dq = DeviceBuffer::poisoned(sizeof(bf16) * M * H * D);
  k::rope_kv_append_slots(dqkv.get<float>(), df.get<float>(), dp.get<int32_t>(), ds.get<int32_t>(), M, H, Hkv, D,
                          num_slots, dq.get<bf16>(), dk.get<bf16>(), dv.get<bf16>(), nullptr);
  sync();
  dq.download(q_out, dq.bytes());
  dk.download(k_pool, pool);
  dv.download(v_pool, pool);
}

void run_argmax_rows(const float* logits, int L, int vocab, int32_t* tokens) {
  DeviceBuffer dl = to_device(logits, sizeof(float) * L * vocab);
  DeviceBuffer dt = DeviceBuffer::poisoned(sizeof(int32_t) * L);
  argmax_rows(dl.get<float>(), L, vocab, dt.get<int32_t>(), nullptr);
  sync();
  dt.download(tokens, sizeof(int32_t) * L);
}

// ---- timers ----

double time_attention(const std::string& layout, const std::vector<int32_t>& lens, int H, int Hkv, int D,
                      int block_size, bool scatter, int iters, uint64_t seed) {
  AF_CHECK(layout == "contiguous" || layout == "paged", "time_attention: layout must be 'contiguous' or 'paged'");
  AF_CHECK(!lens.empty(), "time_attention: need at least one sequence");
  for (int32_t n : lens) AF_CHECK(n >= 1, "time_attention: lengths must be >= 1");
  const int B = static_cast<int>(lens.size());
  const int max_len = *std::max_element(lens.begin(), lens.end());
  const size_t row = static_cast<size_t>(Hkv) * D;  // elements per cache row
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  DeviceBuffer q(sizeof(bf16) * B * H * D), out(sizeof(bf16) * B * H * D),
      dlens = to_device(lens.data(), sizeof(int32_t) * B);
  q.fill(0x3C);  // bf16 0x3C3C ~ 0.0115: finite; the values do not change the time
  const int warmup = 3;

  if (layout == "contiguous") {
    const size_t per_copy = 2 * static_cast<size_t>(B) * max_len * row;  // K then V, elements
    const int copies = rotation_copies(per_copy * sizeof(bf16));
    DeviceBuffer kv(per_copy * sizeof(bf16) * copies);
    kv.fill(0x3C);
    auto k_at = [&](int i) { return kv.get<bf16>() + static_cast<size_t>(i % copies) * per_copy; };
    if (B == 1) {  // the core's own launcher, at position len - 1
      const int32_t pos = lens[0] - 1;
      DeviceBuffer dpos = to_device(&pos, sizeof(pos));
      DeviceBuffer scratch = attention_scratch(k::attention_scratch_bytes(1, H, D, max_len));
      const k::AttnPlan plan = k::plan_attention(1, H, Hkv, D, max_len);
      return median_us(
          [&](int i) {
            k::attention(plan, q.get<bf16>(), k_at(i), k_at(i) + per_copy / 2, dpos.get<int32_t>(), 1, H, Hkv, D,
                         max_len, scale, scratch.get(), out.get<bf16>(), nullptr);
          },
          iters, warmup);
    }
    DeviceBuffer scratch = attention_scratch(k::attention_batched_scratch_bytes(B, 1, H, D, max_len));
    return median_us(
        [&](int i) {
          k::attention_batched(q.get<bf16>(), k_at(i), k_at(i) + per_copy / 2, dlens.get<int32_t>(), B, 1, H, Hkv, D,
                               max_len, scale, scratch.get(), out.get<bf16>(), nullptr);
        },
        iters, warmup);
  }

  // Paged: every copy has its own blocks and tables; scatter = blocks in a random order of the pool.
  const int max_blocks = CEIL_DIV(max_len, block_size);
  int per_copy_blocks = 0;
  for (int32_t n : lens) per_copy_blocks += CEIL_DIV(n, block_size);
  const size_t block_elems = static_cast<size_t>(block_size) * row;
  const int copies = rotation_copies(2 * per_copy_blocks * block_elems * sizeof(bf16));
  const int num_blocks = per_copy_blocks * copies;
  std::vector<int32_t> order(static_cast<size_t>(num_blocks));
  std::iota(order.begin(), order.end(), 0);
  if (scatter) std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
  std::vector<int32_t> tables(static_cast<size_t>(copies) * B * max_blocks, 0);
  size_t next = 0;
  for (int c = 0; c < copies; ++c)
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < CEIL_DIV(lens[static_cast<size_t>(b)], block_size); ++j)
        tables[(static_cast<size_t>(c) * B + b) * max_blocks + j] = order[next++];
  DeviceBuffer dtables = to_device(tables.data(), sizeof(int32_t) * tables.size());
  DeviceBuffer kv(2 * static_cast<size_t>(num_blocks) * block_elems * sizeof(bf16));
  kv.fill(0x3C);
  const bf16* k_pool = kv.get<bf16>();
  const bf16* v_pool = k_pool + static_cast<size_t>(num_blocks) * block_elems;
  DeviceBuffer scratch = attention_scratch(k::attention_paged_scratch_bytes(B, 1, H, D, max_blocks, block_size));
  return median_us(
      [&](int i) {
        k::attention_paged(q.get<bf16>(), k_pool, v_pool,
                           dtables.get<int32_t>() + static_cast<size_t>(i % copies) * B * max_blocks,
                           dlens.get<int32_t>(), B, 1, H, Hkv, D, block_size, num_blocks, max_blocks, scale,
                           scratch.get(), out.get<bf16>(), nullptr);
      },
      iters, warmup);
}

double stream_read_gbs(size_t n_bytes, int iters) {
  AF_CHECK(n_bytes >= 16 && n_bytes % 16 == 0, "stream_read_gbs: n_bytes must be a positive multiple of 16");
  DeviceBuffer data(n_bytes), sink(sizeof(uint32_t));
  data.fill(0x5A);
  sink.fill(0);
  const double us =
      median_us([&](int) { k::stream_read(data.get(), n_bytes, sink.get<uint32_t>(), nullptr); }, iters, 3);
  return static_cast<double>(n_bytes) / (us * 1e3);
}

std::pair<bool, std::string> cuda_available() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return {false, std::string("no CUDA device: ") + cudaGetErrorString(err)};
  }
  if (count == 0) return {false, "no CUDA device: none found"};
  cudaDeviceProp p{};
  int dev = 0;
  if ((err = cudaGetDevice(&dev)) != cudaSuccess || (err = cudaGetDeviceProperties(&p, dev)) != cudaSuccess ||
      (err = cudaFree(nullptr)) != cudaSuccess) {
    cudaGetLastError();
    return {false, std::string("no CUDA device: ") + cudaGetErrorString(err)};
  }
  if (p.major * 10 + p.minor < 89)
    return {false, "GPU " + std::string(p.name) + " has compute capability " + std::to_string(p.major) + "." +
                       std::to_string(p.minor) + "; the sandbox needs >= 8.9 (FP8)"};
  return {true, ""};
}

std::tuple<std::string, size_t, size_t> device_info() {
  int dev = 0;
  cudaDeviceProp p{};
  AF_CUDA_CHECK(cudaGetDevice(&dev));
  AF_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  size_t free_b = 0, total_b = 0;
  AF_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return {std::string(p.name), total_b, free_b};
}

}  // namespace atomflow::sandbox

// PagedModel: the Llama forward pass over a paged KV pool, for a batch of sequences per call,
// built only from the shared kernels (include/atomflow/kernels.h) and two small batch kernels.
// The sandbox's counterpart of csrc/core/forward.cu, with these differences, all deliberate:
//  - weights live in one device buffer per tensor (the core's single-arena rule is its own);
//  - the KV cache is a pool [layers][K|V][num_blocks, block_size, Hkv, D] bf16 addressed through
//    block tables (attention_paged) and per-token slots (rope_kv_append_slots);
//  - one call = one scheduler iteration: rows [0, n_decode) are one decode token of each of
//    n_decode sequences, rows [n_decode, rows) one prefill chunk of one sequence (chunked prefill
//    rides along with decode); every linear layer runs once over all rows (gemm, M = rows);
//  - greedy sampling only (argmax per row), no CUDA graph (the host rebuilds the batch each step).
// With one row it takes the core's M = 1 path (RMSNorm fused into the GEMV), and paged attention
// with the same split count as the contiguous one, so B = 1 reproduces the core's logits bit for bit.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "atomflow/device_buffer.h"
#include "atomflow/kernels.h"
#include "block_manager.h"

namespace atomflow::sandbox {

struct ModelDims {
  int vocab, d, f, layers, H, Hkv, D;
  float eps;
  int q_dim() const { return H * D; }
  int qkv_dim() const { return (H + 2 * Hkv) * D; }
};

struct PoolConfig {
  int num_blocks;          // KV blocks in the pool
  int block_size;          // token slots per block (power of two, 8..256)
  int max_rows;            // token rows per step (decode batch + prefill chunk)
  int max_seqs;            // decode sequences per step
  int max_blocks_per_seq;  // block-table length limit (max_context / block_size, rounded up)
};

// One iteration, all arrays on the host. Tables are row-major [n, table_stride] / [table_stride].
struct StepInput {
  int rows = 0;                            // tokens this step
  const int32_t* tokens = nullptr;         // [rows] token ids
  const int32_t* positions = nullptr;      // [rows] position of each token in its sequence
  const int32_t* slots = nullptr;          // [rows] pool row (block * block_size + offset) its K/V go to
  int n_decode = 0;                        // rows [0, n_decode): one token of each decode sequence
  const int32_t* decode_tables = nullptr;  // [n_decode, decode_stride]
  const int32_t* decode_lens = nullptr;    // [n_decode] keys including this step's token
  int decode_stride = 0;
  const int32_t* prefill_table = nullptr;  // [prefill_stride]: the chunk's sequence
  int prefill_len = 0;                     // its keys including this chunk
  int prefill_stride = 0;
  int n_logits = 0;                     // rows whose next token is wanted
  const int32_t* logit_rows = nullptr;  // [n_logits]
};

class PagedModel {
 public:
  // f16_activations: steps of one row hand attention's and SwiGLU's outputs on in fp16 (below).
  PagedModel(const ModelDims& dims, const PoolConfig& pool, bool f16_activations = true);
  ~PagedModel();
  PagedModel(const PagedModel&) = delete;
  PagedModel& operator=(const PagedModel&) = delete;

  // Named tensors of the .atomflow file (fileformat.py names, fp8 lm_head required); the byte
  // count must match the shape the dims imply.
  void upload(const std::string& name, const void* data, size_t bytes);
  void upload_inv_freq(const float* inv_freq, int n);  // [D / 2], from spec.rope_inv_freq()
  bool ready() const;

  // Device-side block copies (copy-on-write), every layer's K and V, in order, before the next step.
  void copy_blocks(const BlockCopy* copies, int n);
  // Runs one iteration; writes the greedy next token of each logit row to next_tokens[n_logits]
  // and, when logits != nullptr, the fp32 logits [n_logits, vocab]. Synchronizes.
  void step(const StepInput& in, int32_t* next_tokens, float* logits);
  // Zeroes the pool (K and V of every block).
  void clear_pool();

  float last_step_ms() const { return last_ms_; }  // device time of the last step (CUDA events)
  size_t pool_bytes() const { return pool_.bytes(); }
  size_t weight_bytes() const;
  size_t block_bytes() const;  // one block, all layers, K and V
  const ModelDims& dims() const { return dims_; }
  const PoolConfig& pool() const { return pool_cfg_; }

 private:
  struct Tensor {
    size_t bytes;
    DeviceBuffer buf;
  };
  struct Linear {
    const uint8_t* w;
    const float* scales;
  };
  struct Layer {
    const bf16* attn_norm;
    Linear wqkv, wo;
    const bf16* mlp_norm;
    Linear w13, w2;
  };
  template <class T>
  const T* ptr(const std::string& name) const;
  Linear linear_of(const std::string& name) const { return {ptr<uint8_t>(name), ptr<float>(name + ".scale")}; }
  void resolve();  // tensor names -> the pointers the forward pass uses, once
  bf16* k_pool(int layer) const;
  bf16* v_pool(int layer) const;
  void check_step(const StepInput& in) const;
  void linear(const Linear& w, const void* x, bool x_f16, int rows, int N, int K, kernels::Epilogue ep, void* out);
  void normed_linear(const bf16* norm, const Linear& w, int rows, int N, kernels::Epilogue ep, void* out,
                     int* f16_overflow = nullptr);

  ModelDims dims_;
  PoolConfig pool_cfg_;
  std::map<std::string, Tensor> tensors_;
  std::vector<Layer> layers_;  // empty until resolve()
  const bf16* embed_ = nullptr;
  const bf16* final_norm_ = nullptr;
  Linear lm_head_{};
  DeviceBuffer inv_freq_, pool_;
  DeviceBuffer x_, xn_, qkv_, q_, attn_, ffn_, xg_, logits_, next_, scratch_, inputs_;
  DeviceBuffer tickets_;  // the gate/up GEMV's counters (kernels.h), zeroed once
  // The core's Hopper GEMM for steps of at least StepPlan::kSm90GemmMinRows rows, where it is built and
  // the device is sm_90 (else gemm_w8a16), with its workspace.
  bool sm90_ = false;
  DeviceBuffer gemm_ws_;
  size_t gemm_ws_bytes_ = 0;
  // As the core's decode step: a step of one row hands attention's and SwiGLU's outputs on in fp16
  // (kernels.h) and, if they overflow, runs again in bf16, which it keeps (f16_activations = false:
  // bf16 from the start).
  DeviceBuffer f16_overflow_;
  bool f16_acts_ = true;
  int32_t* host_inputs_ = nullptr;  // pinned mirror of inputs_
  size_t input_ints_ = 0;
  bool have_inv_freq_ = false;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ev_start_ = nullptr, ev_stop_ = nullptr;
  float last_ms_ = 0.f;
};

}  // namespace atomflow::sandbox

// Engine-private tiny kernels: they write and advance the device state the decode graph reads
// (position, input token, sampling settings) in stream order, so the host never races the GPU.
//
// The position lives in a pair int32[2] = {pos, pos + 1}: kernels that place tokens read
// pos[0] (tokens already in the cache); the sampler reads pos[1] as its RNG counter, the
// position *after* the token just fed, which is what atomflow.sampling.sample_numpy uses on
// the CPU (the backend's position after prefill/decode), so seeded draws agree.
#pragma once
#include <cstdint>

#include "atomflow/common.h"
#include "atomflow/kernels.h"

namespace atomflow::step {

// *dst = value (the input-token slot).
void write_int(int32_t* dst, int32_t value, cudaStream_t stream);

// *dst = *src, then *src = 0 (a verify's overflow flag into mapped host memory).
void take_int(int32_t* src, int32_t* dst, cudaStream_t stream);

// pos = {p, p + 1}.
void write_pos(int32_t* pos, int32_t p, cudaStream_t stream);

// *dst = cfg.
void write_sampling(kernels::SamplingConfig* dst, const kernels::SamplingConfig& cfg, cudaStream_t stream);

// pos = {pos[0] + n, pos[0] + n + 1} (after a prefill chunk).
void advance_pos(int32_t* pos, int32_t n, cudaStream_t stream);

// The end of a decode step: ring[pos[0] % ring_size] = *token and ring[ring_size + pos[0] %
// ring_size] = *f16_overflow, cleared (ring: mapped pinned host memory, 2 ring_size entries), then
// pos = {pos[0] + 1, pos[0] + 2}. The sampled token already sits in *token, the next step's input.
void finish_step(const int32_t* token, int32_t* pos, int32_t* ring, int ring_size, int32_t* f16_overflow,
                 cudaStream_t stream);

// Holds the stream until the host writes `ticket` to *flag (mapped pinned memory) or timeout_ns
// passes, so the launches queued behind it run back to back, at the GPU's pace, not the host's
// (the profiler). The timeout keeps a host that cannot open the gate (a full launch queue) from
// hanging the GPU; the timing is then host-paced again, never wrong.
void gate(const int32_t* flag, int32_t ticket, uint64_t timeout_ns, cudaStream_t stream);

}  // namespace atomflow::step

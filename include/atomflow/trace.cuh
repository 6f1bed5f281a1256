// In-kernel event trace of the decode kernels: per GEMV warp and per attention block, the
// %globaltimer times of the events that decide a step's length (entry, early loads issued, PDL
// wait passed, input staged, each weight iteration summed, exit). Compiled in only when the build
// defines ATOMFLOW_TRACE (pip install -e . -C cmake.define.ATOMFLOW_TRACE=ON); otherwise every
// call below is an empty inline function and the kernels are unchanged. tools/trace_step.py arms
// it (ops.trace_arm), runs decode steps and turns the records into a per-layer timeline and the
// rate at which weight bytes arrive.
//
// Records go to one region per SM (a counter each), so a warp claims its slot with an atomic that
// at most the 16-odd warps of its SM contend for, and only at its exit. Stamps are kept in shared
// memory until then: no registers, no extra global traffic while the kernel streams.
#pragma once
#include <cstdint>

namespace atomflow::trace {

#ifdef ATOMFLOW_TRACE
constexpr bool kOn = true;
#else
constexpr bool kOn = false;
#endif

constexpr int kStamps = 16;
constexpr unsigned kMaxSms = 256;

// One warp (GEMV) or one block (attention). Stamps not taken are 0.
struct Rec {
  uint64_t id;     // which launch: the weight matrix (GEMV) or the layer's K cache (attention)
  uint32_t kind;   // GEMV: Ep | In << 4; attention: 0x100 | merged << 4 (this block merged its group)
  uint32_t block;  // blockIdx.x | blockIdx.y << 16
  uint32_t warp;   // GEMV: warp in the block; attention: n_active
  uint32_t smid;
  uint32_t K;  // GEMV: K; attention: keys of the call
  uint32_t n;  // GEMV: iterations summed (their stamps: GemvStamp below)
  uint64_t t[kStamps];
};
static_assert(sizeof(Rec) == 160, "Rec layout is read by tools/trace_step.py");

struct Buf {
  Rec* recs;         // [kMaxSms][per_sm]
  unsigned* counts;  // [kMaxSms]
  unsigned per_sm;
};

// GEMV stamp slots (attention's are named in attention_decode.cu). kLanded: this warp's share of
// the input has arrived (bf16 x: and its largest magnitude is found); kBarrier: bf16 x only, the
// block's scale is known (past its barrier; the norm path has no barrier there, its reduction's own
// comes next); kReduced: the norm's reduction is done; kConverted: this warp has written its share of x. The
// first kIterSlots iterations summed get a slot each from kIter0 on, the later ones share kIterLast.
enum GemvStamp {
  kEntry = 0,
  kLanded = 1,
  kWaited = 2,
  kStaged = 3,
  kIter0 = 4,
  kBarrier = 10,
  kReduced = 11,
  kConverted = 12,
  kIterLast = 13,
  kExit = 15
};
constexpr int kIterSlots = kBarrier - kIter0;

__device__ __forceinline__ uint64_t now() {
  uint64_t t = 0;
#ifdef ATOMFLOW_TRACE
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
#endif
  return t;
}

__device__ __forceinline__ unsigned smid() {
  unsigned s = 0;
#ifdef ATOMFLOW_TRACE
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
#endif
  return s;
}

// Claims a slot on this SM and writes the record (one thread).
__device__ __forceinline__ void write(const Buf& b, Rec r, const uint64_t* stamps) {
  if constexpr (kOn) {
    if (b.recs == nullptr) return;
    r.smid = smid();
    if (r.smid >= kMaxSms) return;
    const unsigned slot = atomicAdd(b.counts + r.smid, 1u);
    if (slot >= b.per_sm) return;
    for (int i = 0; i < kStamps; ++i) r.t[i] = stamps[i];
    b.recs[static_cast<size_t>(r.smid) * b.per_sm + slot] = r;
  }
}

}  // namespace atomflow::trace

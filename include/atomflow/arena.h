// One arena: every device buffer the engine uses, planned up front and carved out of a single
// cudaMalloc, so nothing is allocated after load and the decode step can be a CUDA graph.
#pragma once
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace atomflow {

constexpr size_t kArenaAlign = 256;  // every slot starts on this boundary (16-byte loads, coalescing)

// The plan: slots reserved one after another, each tagged with a group ("weights", "kv",
// "activations", "scratch") so the load-time printout can say where the bytes go.
class ArenaPlan {
 public:
  // Reserves `bytes` (rounded up to kArenaAlign) in `group`; returns the slot's byte offset.
  size_t reserve(const std::string& group, size_t bytes);
  size_t total() const { return total_; }
  size_t group_bytes(const std::string& group) const;
  // (group, bytes) in the order the groups were first used.
  const std::vector<std::pair<std::string, size_t>>& groups() const { return groups_; }
  // "arena 3.61 GiB = weights 3.25 GiB | kv 0.34 GiB | activations 12.0 MiB | scratch 4.1 MiB"
  std::string summary() const;

 private:
  size_t total_ = 0;
  std::vector<std::pair<std::string, size_t>> groups_;
};

// The allocation: one cudaMalloc, freed on destruction. Pointers are base + a planned offset.
class Arena {
 public:
  Arena() = default;
  explicit Arena(size_t bytes);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  Arena(Arena&& other) noexcept;
  Arena& operator=(Arena&& other) noexcept;

  template <class T>
  T* at(size_t offset) const {
    return reinterpret_cast<T*>(base_ + offset);
  }
  size_t bytes() const { return bytes_; }

 private:
  char* base_ = nullptr;
  size_t bytes_ = 0;
};

// 3.25 GiB, 12.0 MiB, 512 B: the unit that keeps the number readable.
std::string format_bytes(size_t bytes);

}  // namespace atomflow

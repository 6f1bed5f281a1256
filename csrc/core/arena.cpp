// The arena: planning (offsets, groups, the printout) and the one cudaMalloc.
#include "atomflow/arena.h"

#include <cstdio>

#include "atomflow/common.h"

namespace atomflow {

size_t ArenaPlan::reserve(const std::string& group, size_t bytes) {
  size_t offset = total_;
  size_t padded = CEIL_DIV(bytes, kArenaAlign) * kArenaAlign;
  total_ += padded;
  for (auto& g : groups_) {
    if (g.first == group) {
      g.second += padded;
      return offset;
    }
  }
  groups_.emplace_back(group, padded);
  return offset;
}

size_t ArenaPlan::group_bytes(const std::string& group) const {
  for (const auto& g : groups_)
    if (g.first == group) return g.second;
  return 0;
}

std::string ArenaPlan::summary() const {
  std::string s = "arena " + format_bytes(total_) + " =";
  for (size_t i = 0; i < groups_.size(); ++i)
    s += (i ? " | " : " ") + groups_[i].first + " " + format_bytes(groups_[i].second);
  return s;
}

std::string format_bytes(size_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (bytes >= (size_t(1) << 30))
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / double(1 << 30));
  else if (bytes >= (size_t(1) << 20))
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / double(1 << 20));
  else if (bytes >= (size_t(1) << 10))
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / double(1 << 10));
  else
    std::snprintf(buf, sizeof buf, "%zu B", bytes);
  return buf;
}

Arena::Arena(size_t bytes) : bytes_(bytes) {
  void* p = nullptr;
  AF_CUDA_CHECK(cudaMalloc(&p, bytes));
  base_ = static_cast<char*>(p);
}

Arena::~Arena() {
  if (base_) cudaFree(base_);  // no throw from a destructor; a failure here has nowhere to go
}

Arena::Arena(Arena&& other) noexcept : base_(other.base_), bytes_(other.bytes_) {
  other.base_ = nullptr;
  other.bytes_ = 0;
}

Arena& Arena::operator=(Arena&& other) noexcept {
  if (this != &other) {
    if (base_) cudaFree(base_);
    base_ = other.base_;
    bytes_ = other.bytes_;
    other.base_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

}  // namespace atomflow

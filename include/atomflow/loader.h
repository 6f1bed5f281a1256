// The weight loader: the .atomflow file mmapped read-only, its tensors copied into their arena
// slots through pinned staging buffers, host memcpy into one overlapping the DMA of the other.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace atomflow {

// One entry of the file's tensor table, as Python's reader hands it over.
struct TensorInfo {
  std::string name;
  std::string dtype;  // "F8_E4M3", "BF16", "F32"
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // ABSOLUTE byte offset in the file
  uint64_t nbytes = 0;
};

// The file, mapped read-only for the duration of the load (MADV_SEQUENTIAL: read front to back).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// Bytes [file_offset, file_offset + nbytes) of the file go to device address dst.
struct CopyJob {
  uint64_t file_offset;
  uint64_t nbytes;
  void* dst;
};

struct LoadOptions {
  size_t staging_bytes = size_t(64) << 20;  // per staging buffer
  int staging_buffers = 2;                  // >= 2 so filling one overlaps the DMA of another
  int memcpy_threads = 0;                   // 0: pick from the core count
};

// Copies every job (checked against the file size) and returns when the last byte is on the
// device. The pinned staging buffers are allocated here and freed before returning;
// `allocations` is incremented once per buffer. Throws on a job past the end of the file.
void copy_to_device(const MappedFile& file, const std::vector<CopyJob>& jobs, const LoadOptions& opt, int& allocations);

}  // namespace atomflow

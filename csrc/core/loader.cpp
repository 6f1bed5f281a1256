// The weight loader: mmap the file, then stream each tensor to its device slot through pinned
// staging buffers. The CPU copy (page cache -> pinned) is the slow half, so it is split across
// threads, and the DMA of one staging buffer runs while the next one is being filled.
#include "atomflow/loader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "atomflow/common.h"

namespace atomflow {

MappedFile::MappedFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
  struct stat st{};
  if (::fstat(fd_, &st) != 0) {
    int e = errno;
    ::close(fd_);
    throw std::runtime_error("cannot stat " + path + ": " + std::strerror(e));
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ == 0) {
    ::close(fd_);
    throw std::runtime_error(path + " is empty");
  }
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    ::close(fd_);
    throw std::runtime_error("cannot mmap " + path + ": " + std::strerror(e));
  }
  data_ = static_cast<const uint8_t*>(p);
  // A hint only: more readahead when the file is cold; failure changes nothing.
  ::madvise(p, size_, MADV_SEQUENTIAL);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  if (fd_ >= 0) ::close(fd_);
}

namespace {

// A pinned host buffer and the event marking the end of the last DMA out of it.
struct Staging {
  uint8_t* host = nullptr;
  cudaEvent_t drained = nullptr;
  Staging() = default;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    if (drained) cudaEventDestroy(drained);
    if (host) cudaFreeHost(host);
  }
};

struct CopyStream {
  cudaStream_t s = nullptr;
  ~CopyStream() {
    if (s) {
      cudaStreamSynchronize(s);  // never free staging memory a DMA may still read
      cudaStreamDestroy(s);
    }
  }
};

// memcpy split across `threads` (page-cache reads through mmap run ~2-5 GB/s per core).
void parallel_memcpy(uint8_t* dst, const uint8_t* src, size_t n, int threads) {
  constexpr size_t kMinPerThread = size_t(1) << 20;
  int t = static_cast<int>(std::min<size_t>(threads, std::max<size_t>(1, n / kMinPerThread)));
  if (t <= 1) {
    std::memcpy(dst, src, n);
    return;
  }
  size_t per = CEIL_DIV(n, static_cast<size_t>(t));
  per = CEIL_DIV(per, size_t(4096)) * 4096;  // whole pages per thread: few pages faulted by two threads
  std::vector<std::thread> pool;
  for (size_t begin = per; begin < n; begin += per) {
    size_t len = std::min(per, n - begin);
    pool.emplace_back([=] { std::memcpy(dst + begin, src + begin, len); });
  }
  std::memcpy(dst, src, std::min(per, n));
  for (auto& th : pool) th.join();
}

}  // namespace

void copy_to_device(const MappedFile& file, const std::vector<CopyJob>& jobs, const LoadOptions& opt,
                    int& allocations) {
  AF_CHECK(opt.staging_buffers >= 2, "the loader needs two or more staging buffers to overlap copies");
  AF_CHECK(opt.staging_bytes >= (size_t(1) << 20), "staging buffers must be at least 1 MiB");
  for (const CopyJob& j : jobs) {
    if (j.file_offset > file.size() || j.nbytes > file.size() - j.file_offset)
      throw std::runtime_error(file.path() + ": truncated: a tensor at bytes " + std::to_string(j.file_offset) + ".." +
                               std::to_string(j.file_offset + j.nbytes) + " lies past the end of the " +
                               std::to_string(file.size()) + "-byte file");
  }
  int threads = opt.memcpy_threads;
  if (threads <= 0) threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()) / 2, 1, 8);

  // Declared before the stream so it is destroyed after it: the stream's destructor waits for
  // the DMAs that read the staging memory.
  std::vector<Staging> staging(opt.staging_buffers);
  CopyStream stream;
  AF_CUDA_CHECK(cudaStreamCreateWithFlags(&stream.s, cudaStreamNonBlocking));
  for (Staging& b : staging) {
    AF_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&b.host), opt.staging_bytes, cudaHostAllocDefault));
    ++allocations;
    AF_CUDA_CHECK(cudaEventCreateWithFlags(&b.drained, cudaEventDisableTiming));
  }

  // Read the file front to back whatever order the slots are in.
  std::vector<CopyJob> order = jobs;
  std::sort(order.begin(), order.end(),
            [](const CopyJob& a, const CopyJob& b) { return a.file_offset < b.file_offset; });

  // DMA in pieces of at most this much, so the transfer of a buffer starts before it is full.
  const size_t piece_max = std::max<size_t>(opt.staging_bytes / 4, size_t(1) << 20);
  size_t cur = 0, used = 0;
  for (const CopyJob& j : order) {
    uint64_t done = 0;
    while (done < j.nbytes) {
      if (used == opt.staging_bytes) {  // this buffer is full: hand it over, take the next one
        AF_CUDA_CHECK(cudaEventRecord(staging[cur].drained, stream.s));
        cur = (cur + 1) % staging.size();
        AF_CUDA_CHECK(cudaEventSynchronize(staging[cur].drained));  // its previous DMA is done
        used = 0;
      }
      size_t n = std::min<uint64_t>({j.nbytes - done, opt.staging_bytes - used, piece_max});
      uint8_t* host = staging[cur].host + used;
      parallel_memcpy(host, file.data() + j.file_offset + done, n, threads);
      AF_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(j.dst) + done, host, n, cudaMemcpyHostToDevice, stream.s));
      used += n;
      done += n;
    }
  }
  AF_CUDA_CHECK(cudaStreamSynchronize(stream.s));
}

}  // namespace atomflow

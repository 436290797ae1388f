#include "fastpersist/buffer.hpp"

#include <sys/mman.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>

#include "fastpersist/error.hpp"

namespace fastpersist {

namespace {
constexpr size_t kPage = 4096;
constexpr size_t kHugePage = 2u << 20;
// A zero-byte buffer still needs a valid, aligned, non-null address for the
// buffer protocol and for torch.
alignas(4096) unsigned char empty_region[1];
}  // namespace

AlignedBuffer::AlignedBuffer(size_t nbytes, bool lock, bool huge_pages) : nbytes_(nbytes) {
  if (nbytes == 0) {
    data_ = empty_region;
    return;
  }
  const bool huge = huge_pages && nbytes >= kHugePage;
  const size_t rounded = (nbytes + kPage - 1) / kPage * kPage;
  // Over-map by one huge page so the start can be 2 MiB aligned; trim the rest.
  mapping_size_ = huge ? rounded + kHugePage : rounded;
  void* mapping = ::mmap(nullptr, mapping_size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapping == MAP_FAILED) {
    mapping_size_ = 0;
    FP_CHECK(-1, "mmap of an aligned buffer", "");
  }
  mapping_ = mapping;
  data_ = mapping;
  if (huge) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(mapping);
    const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
    const size_t front = aligned - start;
    const size_t back = mapping_size_ - front - rounded;
    if (front) ::munmap(mapping, front);
    if (back) ::munmap(reinterpret_cast<void*>(aligned + rounded), back);
    mapping_ = reinterpret_cast<void*>(aligned);
    mapping_size_ = rounded;
    data_ = mapping_;
    // Best effort: without THP support the memory just uses 4 KiB pages.
    huge_pages_ = ::madvise(mapping_, mapping_size_, MADV_HUGEPAGE) == 0;
  }
  if (lock) {
    if (::mlock(mapping_, mapping_size_) == 0) {
      locked_ = true;
    } else {
      const int err = errno;
      lock_error_ = std::string("mlock of ") + std::to_string(mapping_size_) + " bytes failed: " + std::strerror(err) +
                    " (raise 'ulimit -l' / RLIMIT_MEMLOCK, or run with CAP_IPC_LOCK); using unlocked memory";
    }
  }
}

AlignedBuffer::~AlignedBuffer() { release(); }

void AlignedBuffer::release() noexcept {
  if (mapping_ != nullptr) {
    if (locked_) ::munlock(mapping_, mapping_size_);
    ::munmap(mapping_, mapping_size_);
    mapping_ = nullptr;
    mapping_size_ = 0;
    locked_ = false;
  }
  data_ = empty_region;
  nbytes_ = 0;
}

void memlock_limit(uint64_t& soft, uint64_t& hard) {
  struct rlimit limit;
  FP_CHECK(::getrlimit(RLIMIT_MEMLOCK, &limit), "getrlimit(RLIMIT_MEMLOCK)", "");
  soft = limit.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(limit.rlim_cur);
  hard = limit.rlim_max == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(limit.rlim_max);
}

}  // namespace fastpersist

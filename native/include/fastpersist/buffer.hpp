/**
 * @file buffer.hpp
 * @brief Page-aligned anonymous memory, optionally locked (mlock) and backed
 *        by transparent huge pages; the staging and destination memory of the
 *        I/O paths.
 */
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fastpersist {

/**
 * @brief An anonymous, page-aligned mapping of @c nbytes bytes.
 *
 * Locking is best effort: when mlock fails (RLIMIT_MEMLOCK, ENOMEM) the memory
 * stays usable but unlocked, locked() is false and lock_error() says why.
 */
class AlignedBuffer {
 public:
  /**
   * @brief Maps the memory.
   * @param nbytes     size in bytes (0 allowed: no mapping, data() is a non-null dummy).
   * @param lock       mlock the pages (this also faults them in).
   * @param huge_pages align to 2 MiB and madvise(MADV_HUGEPAGE) (sizes >= 2 MiB).
   * @throws IoError when mmap fails (ENOMEM).
   */
  explicit AlignedBuffer(size_t nbytes, bool lock = true, bool huge_pages = false);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  /** @brief Start of the memory (page aligned; 2 MiB aligned with huge pages). */
  void* data() const noexcept { return data_; }
  /** @brief Address of the memory as an integer. */
  uintptr_t address() const noexcept { return reinterpret_cast<uintptr_t>(data_); }
  /** @brief Usable size in bytes. */
  size_t size() const noexcept { return nbytes_; }
  /** @brief Whether the pages are locked in RAM. */
  bool locked() const noexcept { return locked_; }
  /** @brief Why locking failed ("" when locked or not asked for). */
  const std::string& lock_error() const noexcept { return lock_error_; }
  /** @brief Whether MADV_HUGEPAGE was applied. */
  bool huge_pages() const noexcept { return huge_pages_; }

  /** @brief Unlocks and unmaps now; idempotent (the destructor calls it). */
  void release() noexcept;

 private:
  void* data_ = nullptr;
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
  size_t nbytes_ = 0;
  bool locked_ = false;
  bool huge_pages_ = false;
  std::string lock_error_;
};

/**
 * @brief The RLIMIT_MEMLOCK limits.
 * @param soft receives the soft limit in bytes (UINT64_MAX: unlimited).
 * @param hard receives the hard limit in bytes (UINT64_MAX: unlimited).
 * @throws IoError if getrlimit fails.
 */
void memlock_limit(uint64_t& soft, uint64_t& hard);

}  // namespace fastpersist

/**
 * @file file.hpp
 * @brief A file opened twice: a buffered descriptor for unaligned heads and
 *        tails, and (when the filesystem accepts it) an O_DIRECT descriptor for
 *        the aligned middle of each request.
 */
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace fastpersist {

/** @brief How a File is opened. */
enum class OpenMode { kRead, kWrite, kReadWrite };

/**
 * @brief Parses "r", "w" or "rw".
 * @param text the mode string.
 * @return the mode.
 * @throws std::invalid_argument for anything else.
 */
OpenMode parse_open_mode(const std::string& text);

/** @brief Direct I/O constraints of one open file. */
struct DirectIoAlignment {
  uint32_t offset = 4096;  ///< file offsets and lengths of direct requests are multiples of this (>= page size)
  uint32_t memory = 4096;  ///< buffer addresses of direct requests are multiples of this
  std::string source;      ///< where the values came from ("statx", "sysfs", "default")
};

/**
 * @brief Direct I/O alignment of an open descriptor.
 *
 * statx(STATX_DIOALIGN) first, then the block device's logical block size from
 * sysfs, else 4096. The offset alignment is never below the page size, so a
 * direct write and a buffered write never touch the same page.
 * @param fd   an open descriptor.
 * @param path its path (for messages).
 * @return the alignment.
 */
DirectIoAlignment query_alignment(int fd, const std::string& path);

/**
 * @brief Name of the filesystem holding @p fd ("ext4", "tmpfs", "xfs", ... or "0x<magic>").
 * @param fd   an open descriptor.
 * @param path its path (for messages).
 * @return the name.
 * @throws IoError if fstatfs fails.
 */
std::string filesystem_type(int fd, const std::string& path);

/**
 * @brief An open file with a buffered and an optional O_DIRECT descriptor.
 *
 * Thread-safe for I/O on the descriptors; close() waits until no request is
 * using the file (see acquire()/release()).
 */
class File {
 public:
  /**
   * @brief Opens @p path.
   * @param path        file path.
   * @param mode        read, write or read-write.
   * @param direct      also open an O_DIRECT descriptor if the filesystem accepts it.
   * @param truncate    O_TRUNC on open.
   * @param create      O_CREAT on open.
   * @param permissions mode bits for a created file.
   * @throws IoError when the buffered open fails (ENOENT, EACCES, ...). A refused
   *         O_DIRECT open is not an error: direct() is false and fallback_reason() says why.
   */
  File(const std::string& path, OpenMode mode, bool direct = true, bool truncate = false, bool create = false,
       unsigned permissions = 0644);

  /**
   * @brief Wraps a descriptor the caller owns (never closed here).
   *
   * When @p direct, tries to reopen /proc/self/fd/N with O_DIRECT (that
   * descriptor is owned and closed here); else all I/O is buffered.
   * @param fd     an open descriptor.
   * @param direct try to add a direct descriptor.
   * @return the wrapper.
   * @throws IoError with EBADF when @p fd is not open.
   */
  static std::shared_ptr<File> borrow(int fd, bool direct);

  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  /** @brief The path (or "<fd N>" for a borrowed descriptor without a resolvable path). */
  const std::string& path() const noexcept { return path_; }
  /** @brief The buffered descriptor (-1 after close()). */
  int fd() const noexcept { return fd_; }
  /** @brief The O_DIRECT descriptor, or -1 when direct I/O is not in use. */
  int direct_fd() const noexcept { return direct_fd_; }
  /** @brief Whether direct I/O is in use. */
  bool direct() const noexcept { return direct_fd_ >= 0; }
  /** @brief Offset/length alignment for direct I/O (>= 4096). */
  uint32_t alignment() const noexcept { return alignment_.offset; }
  /** @brief Buffer address alignment for direct I/O. */
  uint32_t memory_alignment() const noexcept { return alignment_.memory; }
  /** @brief Why direct I/O is not in use ("" when it is, or was not asked for). */
  const std::string& fallback_reason() const noexcept { return fallback_reason_; }
  /** @brief The mode the file was opened with. */
  OpenMode mode() const noexcept { return mode_; }
  /** @brief Whether close() has run. */
  bool closed() const noexcept { return fd_ < 0; }

  /**
   * @brief Makes data and metadata durable (fsync).
   * @throws IoError on failure.
   */
  void fsync();
  /**
   * @brief Sets the file size (ftruncate).
   * @param size new size in bytes.
   * @throws IoError on failure.
   */
  void truncate(uint64_t size);
  /**
   * @brief Reserves blocks (fallocate, mode 0: the size grows to cover the range).
   * @param offset start of the range.
   * @param length bytes in the range.
   * @return true if allocated, false when the filesystem does not support it.
   * @throws IoError on other failures (ENOSPC, ...).
   */
  bool allocate(uint64_t offset, uint64_t length);
  /**
   * @brief Current size in bytes (fstat).
   * @throws IoError on failure.
   */
  uint64_t size() const;
  /**
   * @brief Closes both descriptors; idempotent. Waits first until no request uses the file.
   * @throws IoError if close(2) reports an error (the descriptors are closed anyway).
   */
  void close();

  /** @brief Marks one more request using the file. @throws IoError (EBADF) if already closed. */
  void acquire();
  /** @brief Marks one request done with the file. */
  void release() noexcept;

 private:
  File() = default;
  void open_direct(int access_flags, const std::string& open_path);

  std::string path_;
  OpenMode mode_ = OpenMode::kRead;
  int fd_ = -1;
  int direct_fd_ = -1;
  bool owns_fd_ = true;
  bool borrowed_direct_ = false;  ///< direct_fd_ belongs to the caller (they passed an O_DIRECT fd)
  DirectIoAlignment alignment_;
  std::string fallback_reason_;

  std::mutex mutex_;
  std::condition_variable idle_;
  int users_ = 0;
};

}  // namespace fastpersist

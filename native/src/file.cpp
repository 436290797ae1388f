#include "fastpersist/file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <stdexcept>

#include "fastpersist/error.hpp"

namespace fastpersist {

namespace {

constexpr uint32_t kPageSize = 4096;

// Our own copy of the statx layout (linux/stat.h, kernel >= 6.1) so the build
// does not depend on the C library knowing STATX_DIOALIGN.
struct StatxTimestamp {
  int64_t tv_sec;
  uint32_t tv_nsec;
  int32_t reserved;
};
struct StatxBuffer {
  uint32_t stx_mask;
  uint32_t stx_blksize;
  uint64_t stx_attributes;
  uint32_t stx_nlink;
  uint32_t stx_uid;
  uint32_t stx_gid;
  uint16_t stx_mode;
  uint16_t spare0;
  uint64_t stx_ino;
  uint64_t stx_size;
  uint64_t stx_blocks;
  uint64_t stx_attributes_mask;
  StatxTimestamp stx_atime, stx_btime, stx_ctime, stx_mtime;
  uint32_t stx_rdev_major;
  uint32_t stx_rdev_minor;
  uint32_t stx_dev_major;
  uint32_t stx_dev_minor;
  uint64_t stx_mnt_id;
  uint32_t stx_dio_mem_align;
  uint32_t stx_dio_offset_align;
  uint64_t spare3[12];
};
static_assert(sizeof(StatxBuffer) == 0x100, "statx layout");
constexpr unsigned kStatxDioAlign = 0x00002000U;
#ifndef AT_EMPTY_PATH
#define AT_EMPTY_PATH 0x1000
#endif

bool read_uint(const std::string& file, uint32_t& value) {
  std::string text;
  if (!read_small_file(file, text)) return false;
  const unsigned long v = std::strtoul(text.c_str(), nullptr, 10);
  if (v == 0) return false;
  value = static_cast<uint32_t>(v);
  return true;
}

int access_flags(OpenMode mode) {
  switch (mode) {
    case OpenMode::kRead:
      return O_RDONLY;
    case OpenMode::kWrite:
      return O_WRONLY;
    case OpenMode::kReadWrite:
      return O_RDWR;
  }
  return O_RDONLY;
}

const char* open_operation(OpenMode mode) {
  switch (mode) {
    case OpenMode::kRead:
      return "open for reading";
    case OpenMode::kWrite:
      return "open for writing";
    case OpenMode::kReadWrite:
      return "open for reading and writing";
  }
  return "open";
}

// Memory-backed filesystems accept O_DIRECT on recent kernels but gain nothing
// from it; treat them as buffered so tmpfs stays the buffered fallback path.
bool memory_backed(const std::string& fs) { return fs == "tmpfs" || fs == "ramfs"; }

}  // namespace

OpenMode parse_open_mode(const std::string& text) {
  if (text == "r") return OpenMode::kRead;
  if (text == "w") return OpenMode::kWrite;
  if (text == "rw" || text == "r+" || text == "w+") return OpenMode::kReadWrite;
  throw std::invalid_argument("mode must be 'r', 'w' or 'rw', got '" + text + "'");
}

DirectIoAlignment query_alignment(int fd, const std::string& path) {
  (void)path;
  DirectIoAlignment result;
  StatxBuffer sx;
  std::memset(&sx, 0, sizeof sx);
  long rc = syscall(SYS_statx, fd, "", AT_EMPTY_PATH, kStatxDioAlign, &sx);
  if (rc == 0 && (sx.stx_mask & kStatxDioAlign) && sx.stx_dio_offset_align > 0) {
    result.offset = sx.stx_dio_offset_align;
    result.memory = sx.stx_dio_mem_align ? sx.stx_dio_mem_align : sx.stx_dio_offset_align;
    result.source = "statx";
  } else {
    // Older kernels: the logical block size of the device holding the file
    // (a partition's queue/ lives in its parent's directory).
    struct stat st;
    uint32_t block = 0;
    if (::fstat(fd, &st) == 0) {
      const std::string base =
          "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev));
      if (read_uint(base + "/queue/logical_block_size", block) ||
          read_uint(base + "/../queue/logical_block_size", block)) {
        result.offset = block;
        result.memory = block;
        result.source = "sysfs";
      }
    }
    if (result.source.empty()) result.source = "default";
  }
  if (result.offset < kPageSize) result.offset = kPageSize;
  if (result.memory == 0) result.memory = result.offset;
  return result;
}

std::string filesystem_type(int fd, const std::string& path) {
  struct statfs sf;
  FP_CHECK(::fstatfs(fd, &sf), "fstatfs", path);
  switch (static_cast<unsigned long>(sf.f_type)) {
    case 0xEF53UL:
      return "ext4";
    case 0x58465342UL:
      return "xfs";
    case 0x9123683EUL:
      return "btrfs";
    case 0x01021994UL:
      return "tmpfs";
    case 0x858458F6UL:
      return "ramfs";
    case 0x794C7630UL:
      return "overlayfs";
    case 0x6969UL:
      return "nfs";
    case 0x2FC12FC1UL:
      return "zfs";
    case 0x65735546UL:
      return "fuse";
    case 0xF2F52010UL:
      return "f2fs";
    case 0xFF534D42UL:
      return "cifs";
    case 0xFE534D42UL:
      return "smb2";
    case 0x00C36400UL:
      return "ceph";
    case 0x0BD00BD0UL:
      return "lustre";
    case 0x01021997UL:
      return "9p";
    case 0x47504653UL:
      return "gpfs";
    default: {
      char buffer[32];
      std::snprintf(buffer, sizeof buffer, "0x%lx", static_cast<unsigned long>(sf.f_type));
      return buffer;
    }
  }
}

File::File(const std::string& path, OpenMode mode, bool direct, bool truncate, bool create, unsigned permissions)
    : path_(path), mode_(mode) {
  int flags = access_flags(mode) | O_CLOEXEC;
  if (create) flags |= O_CREAT;
  if (truncate) flags |= O_TRUNC;
  fd_ = static_cast<int>(FP_CHECK(::open(path.c_str(), flags, permissions), open_operation(mode), path));
  try {
    alignment_ = query_alignment(fd_, path_);
    if (direct) open_direct(access_flags(mode), path_);
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

void File::open_direct(int flags, const std::string& open_path) {
  std::string fs;
  try {
    fs = filesystem_type(fd_, path_);
  } catch (const IoError&) {
    fs = "unknown";
  }
  if (memory_backed(fs)) {
    fallback_reason_ = "memory-backed filesystem (" + fs + "): O_DIRECT brings no benefit, using buffered I/O";
    return;
  }
  struct stat st;
  if (::fstat(fd_, &st) == 0 && !S_ISREG(st.st_mode)) {
    fallback_reason_ = "not a regular file: using buffered I/O";
    return;
  }
  int dfd = ::open(open_path.c_str(), flags | O_DIRECT | O_CLOEXEC);
  if (dfd < 0) {
    const int err = errno;
    if (err == EINVAL) {
      fallback_reason_ = "filesystem refused O_DIRECT (" + fs + "): using buffered I/O";
    } else {
      fallback_reason_ = std::string("could not open with O_DIRECT (") + std::strerror(err) + "): using buffered I/O";
    }
    return;
  }
  direct_fd_ = dfd;
}

std::shared_ptr<File> File::borrow(int fd, bool direct) {
  std::shared_ptr<File> file(new File());
  file->owns_fd_ = false;
  const std::string label = "<fd " + std::to_string(fd) + ">";
  file->path_ = label;
  const int flags = static_cast<int>(FP_CHECK(::fcntl(fd, F_GETFL), "fcntl(F_GETFL) on file descriptor", label));
  const int access = flags & O_ACCMODE;
  file->mode_ = access == O_WRONLY ? OpenMode::kWrite : access == O_RDWR ? OpenMode::kReadWrite : OpenMode::kRead;
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  char target[4096];
  ssize_t n = ::readlink(proc.c_str(), target, sizeof target - 1);
  if (n > 0 && target[0] == '/') file->path_.assign(target, static_cast<size_t>(n));
  file->fd_ = fd;
  file->alignment_ = query_alignment(fd, file->path_);
  if (flags & O_DIRECT) {
    // The caller's descriptor is already direct; it cannot serve unaligned
    // heads and tails, so open a buffered twin and use theirs for the middle.
    int bfd = ::open(proc.c_str(), access | O_CLOEXEC);
    if (bfd >= 0) {
      file->direct_fd_ = -1;
      // Swap roles: our buffered twin is owned, their direct fd is borrowed.
      file->fd_ = bfd;
      file->owns_fd_ = true;
      file->direct_fd_ = fd;
      file->borrowed_direct_ = true;
      return file;
    }
  }
  if (direct && !(flags & O_APPEND)) file->open_direct(access, proc);
  return file;
}

File::~File() {
  try {
    close();
  } catch (...) {
  }
}

void File::fsync() { FP_CHECK(::fsync(fd_), "fsync", path_); }

void File::truncate(uint64_t size) {
  FP_CHECK(::ftruncate(fd_, static_cast<off_t>(size)), "ftruncate", path_);
}

bool File::allocate(uint64_t offset, uint64_t length) {
  if (length == 0) return true;
  int rc = ::fallocate(fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(length));
  if (rc != 0 && (errno == EOPNOTSUPP || errno == ENOSYS)) return false;
  FP_CHECK(rc, "fallocate", path_);
  return true;
}

uint64_t File::size() const {
  struct stat st;
  FP_CHECK(::fstat(fd_, &st), "fstat", path_);
  return static_cast<uint64_t>(st.st_size);
}

void File::close() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [this] { return users_ == 0; });
  int first_error = 0;
  if (direct_fd_ >= 0) {
    if (!borrowed_direct_ && ::close(direct_fd_) != 0) first_error = errno;
    direct_fd_ = -1;
  }
  if (fd_ >= 0) {
    if (owns_fd_ && ::close(fd_) != 0 && first_error == 0) first_error = errno;
    fd_ = -1;
  }
  if (first_error != 0) {
    errno = first_error;
    FP_CHECK(-1, "close", path_);
  }
}

void File::acquire() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fd_ < 0) {
    errno = EBADF;
    FP_CHECK(-1, "use of closed fastpersist File", path_);
  }
  ++users_;
}

void File::release() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  if (--users_ == 0) idle_.notify_all();
}

}  // namespace fastpersist

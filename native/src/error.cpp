#include "fastpersist/error.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace fastpersist {

namespace {

std::string basename_of(const char* file) {
  const char* slash = std::strrchr(file, '/');
  return slash ? slash + 1 : file;
}

std::string strerror_text(int err) {
  char buffer[256];
  // GNU strerror_r returns the message pointer (which may not be buffer).
  const char* text = strerror_r(err, buffer, sizeof buffer);
  return text;
}

}  // namespace

std::string errno_advice(int err) {
  switch (err) {
    case ENOENT:
      return "check that the directory exists (fastpersist does not create parent directories)";
    case EACCES:
    case EPERM:
      return "check the permissions of the file and its directory";
    case EROFS:
      return "the filesystem is mounted read-only; save somewhere writable";
    case ENOSPC:
      return "the filesystem is full; free space or save to another filesystem";
    case EDQUOT:
      return "the disk quota is exhausted; free space or save elsewhere";
    case EBADF:
      return "the file descriptor is not open (or not open for this kind of access)";
    case EINVAL:
      return "the filesystem may not support this operation (e.g. O_DIRECT); try direct=False";
    case EIO:
      return "the device reported an I/O error; check the disk (dmesg) and retry";
    case EISDIR:
      return "the path names a directory; pass a file path";
    case ENOTDIR:
      return "a component of the path is not a directory";
    case EMFILE:
    case ENFILE:
      return "too many open files; raise 'ulimit -n' or close files";
    case ENOMEM:
      return "out of memory (or over RLIMIT_MEMLOCK for locked memory)";
    case EFBIG:
      return "the file would exceed the filesystem's maximum file size";
    default:
      return "";
  }
}

IoError make_io_error(int err, const std::string& operation, const std::string& path, const std::string& detail,
                      const char* file, int line) {
  std::string message = operation;
  if (!path.empty()) message += " '" + path + "'";
  message += " failed: " + strerror_text(err);
  if (!detail.empty()) message += " (" + detail + ")";
  const std::string advice = errno_advice(err);
  if (!advice.empty()) message += "; " + advice;
  return IoError(err, operation, path, message, basename_of(file) + ":" + std::to_string(line));
}

long check_syscall(long result, ResultConvention convention, const char* operation, const std::string& path,
                   const std::string& detail, const char* file, int line) {
  int err = 0;
  if (convention == ResultConvention::kMinusOneErrno) {
    if (result != -1) return result;
    err = errno;
  } else {
    if (result >= 0) return result;
    err = static_cast<int>(-result);
  }
  throw make_io_error(err, operation, path, detail, file, line);
}

UnexpectedEndOfFile::UnexpectedEndOfFile(const std::string& path, uint64_t offset, uint64_t wanted, uint64_t got,
                                         const std::string& where)
    : IoError(0, "read", path,
              "unexpected end of file '" + path + "' at offset " + std::to_string(offset) + ": the request wanted " +
                  std::to_string(wanted) + " bytes but only " + std::to_string(got) +
                  " could be read; the file is truncated or the offset/size is wrong",
              where) {}

bool read_small_file(const std::string& path, std::string& out) {
  out.clear();
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buffer[4096];
  ssize_t n;
  do {
    n = ::read(fd, buffer, sizeof buffer);
  } while (n < 0 && errno == EINTR);
  ::close(fd);
  if (n < 0) return false;
  out.assign(buffer, static_cast<size_t>(n));
  return true;
}

}  // namespace fastpersist

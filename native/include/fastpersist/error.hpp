/**
 * @file error.hpp
 * @brief The one way the native core reports failures: IoError, and the one
 *        helper that checks every system call result.
 *
 * Every system call in the core goes through check_syscall() (via the
 * FP_CHECK / FP_CHECK_RES macros that add file:line), so each error carries
 * the errno, the call that failed, the path it concerned and where in the
 * source it was detected.
 */
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace fastpersist {

/**
 * @brief A failed system call or asynchronous I/O completion.
 *
 * Mirrors Python's OSError: the binding turns it into
 * OSError(errno, message, filename), which Python maps to the right subclass
 * (FileNotFoundError, PermissionError, ...).
 */
class IoError : public std::runtime_error {
 public:
  /**
   * @brief Builds an error.
   * @param err       errno value (positive); 0 for errors that are not system call failures.
   * @param operation what was attempted, e.g. "open for writing", "io_uring write".
   * @param path      the file concerned ("" if none).
   * @param message   full human readable message (what failed and what to do).
   * @param where     source location "file.cpp:123" (debug text).
   */
  IoError(int err, std::string operation, std::string path, const std::string& message, std::string where)
      : std::runtime_error(message),
        errno_(err),
        operation_(std::move(operation)),
        path_(std::move(path)),
        where_(std::move(where)) {}

  /** @brief The errno value (0 when not a system error). */
  int error_number() const noexcept { return errno_; }
  /** @brief The operation that failed. */
  const std::string& operation() const noexcept { return operation_; }
  /** @brief The path concerned, or "". */
  const std::string& path() const noexcept { return path_; }
  /** @brief Source location where the failure was detected (file:line). */
  const std::string& where() const noexcept { return where_; }

 private:
  int errno_;
  std::string operation_;
  std::string path_;
  std::string where_;
};

/**
 * @brief A read reached the end of the file before the requested byte count.
 *
 * Not an errno condition: the file is shorter than the caller expected
 * (truncated checkpoint, wrong offset or size).
 */
class UnexpectedEndOfFile : public IoError {
 public:
  /**
   * @param path    file that was read.
   * @param offset  file offset where the data ran out.
   * @param wanted  bytes the request asked for in total.
   * @param got     bytes actually read for that request.
   * @param where   source location.
   */
  UnexpectedEndOfFile(const std::string& path, uint64_t offset, uint64_t wanted, uint64_t got,
                      const std::string& where);
};

/** @brief An I/O engine that was named explicitly cannot start here. */
class EngineUnavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/** @brief How a checked result encodes failure. */
enum class ResultConvention {
  kMinusOneErrno,  ///< classic system call: -1 and errno (open, pwrite, ...)
  kNegativeErrno,  ///< -errno in the result itself (io_uring CQE res, raw syscall wrappers)
};

/**
 * @brief Short advice on what to do about an errno, appended to messages.
 * @param err errno value.
 * @return advice text (may be empty).
 */
std::string errno_advice(int err);

/**
 * @brief Builds an IoError for errno @p err without throwing it.
 * @param err       errno.
 * @param operation the call that failed.
 * @param path      the file concerned.
 * @param detail    extra context (offsets, sizes); may be empty.
 * @param file      source file (__FILE__).
 * @param line      source line (__LINE__).
 * @return the error.
 */
IoError make_io_error(int err, const std::string& operation, const std::string& path, const std::string& detail,
                      const char* file, int line);

/**
 * @brief THE check for system call results.
 *
 * @param result     the value the call returned.
 * @param convention how failure is encoded in @p result.
 * @param operation  the call, e.g. "pwrite".
 * @param path       the file concerned ("" if none).
 * @param detail     extra context for the message (offsets, sizes, engine); may be "".
 * @param file       source file (__FILE__).
 * @param line       source line (__LINE__).
 * @return @p result when it signals success.
 * @throws IoError carrying errno, @p operation, @p path and file:line on failure.
 */
long check_syscall(long result, ResultConvention convention, const char* operation, const std::string& path,
                   const std::string& detail, const char* file, int line);

/**
 * @brief Reads a small text file such as a sysfs or procfs entry.
 *
 * Uses plain open/read (no iostreams: the core stays free of locale state).
 * @param path the file.
 * @param out  receives the contents (at most 4 KiB).
 * @return false when the file cannot be read (not an error for callers that probe).
 */
bool read_small_file(const std::string& path, std::string& out);

}  // namespace fastpersist

/** Checks a -1/errno style call. */
#define FP_CHECK(expr, operation, path)                                                                  \
  ::fastpersist::check_syscall(static_cast<long>(expr), ::fastpersist::ResultConvention::kMinusOneErrno, \
                               (operation), (path), std::string(), __FILE__, __LINE__)
/** Checks a -errno style result (io_uring completions, raw syscalls). */
#define FP_CHECK_RES(expr, operation, path)                                                              \
  ::fastpersist::check_syscall(static_cast<long>(expr), ::fastpersist::ResultConvention::kNegativeErrno, \
                               (operation), (path), std::string(), __FILE__, __LINE__)
/** Checks an asynchronous completion (-errno), with context for the message. */
#define FP_CHECK_COMPLETION(expr, operation, path, detail)                                              \
  ::fastpersist::check_syscall(static_cast<long>(expr), ::fastpersist::ResultConvention::kNegativeErrno, \
                               (operation), (path), (detail), __FILE__, __LINE__)

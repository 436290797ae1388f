/**
 * @file handle.hpp
 * @brief IoHandle: asynchronous reads and writes of memory ranges to files,
 *        split into block-sized chunks spread over lanes (threads each owning
 *        an engine instance).
 *
 * Order of calls: submit_write()/submit_read() any number of times (each
 * returns at once), then wait(), which blocks until every request is done and
 * throws the first error. The memory of a request must stay valid until wait()
 * returns (or the request reports done()).
 */
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fastpersist/engine.hpp"
#include "fastpersist/file.hpp"

namespace fastpersist {

/** @brief Settings of an IoHandle. */
struct HandleOptions {
  size_t block_size = 1u << 20;       ///< bytes per chunk (multiple of 512, <= 1 GiB); direct chunks are
                                      ///< rounded up to the file's O_DIRECT alignment
  size_t queue_depth = 32;            ///< chunks each lane keeps in flight (1..32768; engines cap it at 4096)
  bool single_submit = false;         ///< one submission system call per chunk
  bool overlap_events = true;         ///< reap while submitting (sliding window) instead of batch by batch
  size_t intra_op_parallelism = 1;    ///< lanes
  std::string engine = "auto";        ///< "auto", "io_uring" or "threads"
  bool direct = true;                 ///< use O_DIRECT for aligned middles when the file has a direct descriptor
  FaultSpec fault;                    ///< tests: fail or shorten chosen submissions
};

class IoHandle;

/**
 * @brief One submitted read or write. Shared between the caller and the lanes.
 */
class Request {
 public:
  /** @brief Handle-unique id (1, 2, ...). */
  uint64_t id() const noexcept { return id_; }
  /** @brief Write (true) or read. */
  bool is_write() const noexcept { return write_; }
  /** @brief Bytes asked for. */
  uint64_t nbytes() const noexcept { return nbytes_; }
  /** @brief File offset of the first byte. */
  uint64_t file_offset() const noexcept { return file_offset_; }
  /** @brief Path of the file. */
  const std::string& path() const noexcept { return path_; }
  /** @brief Whether every chunk has completed (successfully or not). */
  bool done() const noexcept { return done_.load(std::memory_order_acquire); }
  /** @brief Bytes transferred so far (for allow_short reads: the bytes before end of file). */
  uint64_t bytes_transferred() const noexcept { return bytes_.load(std::memory_order_acquire); }
  /** @brief Whether the request failed (the error is raised by IoHandle::wait()). */
  bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }

 private:
  friend class IoHandle;
  friend class Lane;
  uint64_t id_ = 0;
  bool write_ = false;
  uint64_t nbytes_ = 0;
  uint64_t file_offset_ = 0;
  std::string path_;
  std::shared_ptr<File> file_;
  bool owns_file_ = false;
  bool truncate_ = false;
  bool allow_short_ = false;
  bool detached_ = false;        // waited for by wait_request(), not by wait()
  std::exception_ptr error_;     // first error of a detached request (guarded by IoHandle::mutex_)
  std::atomic<size_t> chunks_left_{0};
  std::atomic<bool> failed_{false};
  std::atomic<bool> done_{false};
  std::atomic<uint64_t> bytes_{0};
  std::atomic<uint64_t> eof_offset_{UINT64_MAX};
};

/** @brief A piece of a request handed to one lane. */
struct Chunk {
  std::shared_ptr<Request> request;
  unsigned char* buffer = nullptr;
  size_t length = 0;
  uint64_t offset = 0;
  bool direct = false;
  unsigned retries = 0;
};

class Lane;

/** @brief Counters since the handle was created. */
struct HandleStats {
  uint64_t bytes_direct = 0;
  uint64_t bytes_buffered = 0;
  uint64_t requests = 0;
};

/**
 * @brief Asynchronous positional I/O on files through lanes of an engine.
 *
 * Thread-safe: several threads may submit; wait() waits for all requests of
 * the handle.
 */
class IoHandle {
 public:
  /**
   * @brief Starts the lanes.
   * @param options settings (validated).
   * @throws std::invalid_argument for invalid settings.
   * @throws EngineUnavailable when a named engine cannot start.
   */
  explicit IoHandle(const HandleOptions& options);
  /** @brief Waits for all in-flight I/O (errors are dropped), then stops the lanes. */
  ~IoHandle();
  IoHandle(const IoHandle&) = delete;
  IoHandle& operator=(const IoHandle&) = delete;

  /** @brief The settings in use (engine is the resolved name). */
  const HandleOptions& options() const noexcept { return options_; }
  /** @brief The resolved engine name ("io_uring" or "threads"). */
  const std::string& engine() const noexcept { return options_.engine; }
  /** @brief Why 'auto' did not pick io_uring ("" otherwise). */
  const std::string& fallback_reason() const noexcept { return fallback_reason_; }

  /**
   * @brief Opens @p path for a request (write: created, never O_TRUNC; read: read-only).
   * @throws IoError when the open fails.
   */
  std::shared_ptr<File> open_for(const std::string& path, bool write) const;

  /**
   * @brief Starts writing @p nbytes from @p buffer to @p file at @p file_offset.
   * @param buffer      source memory (valid until the request is done).
   * @param nbytes      bytes to write.
   * @param file        destination.
   * @param file_offset where the first byte goes.
   * @param owns_file   close @p file when the request completes.
   * @param truncate    after success, set the file size to file_offset + nbytes.
   * @param detached    the request is waited for with wait_request() only: wait()
   *                    neither counts it nor raises its error.
   * @return the request.
   * @throws IoError (EBADF) when @p file is closed or read-only.
   */
  std::shared_ptr<Request> submit_write(const void* buffer, uint64_t nbytes, std::shared_ptr<File> file,
                                        uint64_t file_offset, bool owns_file, bool truncate,
                                        bool detached = false);
  /**
   * @brief Starts reading @p nbytes at @p file_offset of @p file into @p buffer.
   * @param allow_short end of file before @p nbytes is not an error; see Request::bytes_transferred().
   * @param detached    see submit_write().
   * @return the request.
   * @throws IoError (EBADF) when @p file is closed or write-only.
   */
  std::shared_ptr<Request> submit_read(void* buffer, uint64_t nbytes, std::shared_ptr<File> file,
                                       uint64_t file_offset, bool owns_file, bool allow_short,
                                       bool detached = false);

  /**
   * @brief Blocks until no request is in flight.
   * @return requests completed since the previous wait().
   * @throws IoError (or UnexpectedEndOfFile) the first error since the previous
   *         wait(), only after everything in flight has completed; the handle
   *         is reusable afterwards.
   */
  size_t wait();
  /**
   * @brief Blocks until @p request (submitted with detached=true) is done.
   *
   * Several threads may each wait for their own request on one handle: each
   * sees only its own completion and error.
   * @return 1.
   * @throws IoError (or UnexpectedEndOfFile) the request's error.
   */
  size_t wait_request(const std::shared_ptr<Request>& request);
  /** @brief Requests submitted and not yet completed (detached ones excluded). */
  size_t pending() const;
  /** @brief Ids of requests completed since the previous call (for releasing buffers early). */
  std::vector<uint64_t> take_finished_ids();
  /** @brief Byte counters. */
  HandleStats stats() const;

 private:
  friend class Lane;
  std::shared_ptr<Request> submit(bool write, void* buffer, uint64_t nbytes, std::shared_ptr<File> file,
                                  uint64_t file_offset, bool owns_file, bool truncate, bool allow_short,
                                  bool detached);
  void record_error(const std::shared_ptr<Request>& request, std::exception_ptr error);
  void finish_chunk(const std::shared_ptr<Request>& request);
  void finalize(const std::shared_ptr<Request>& request);
  void stop_lanes() noexcept;

  HandleOptions options_;
  std::string fallback_reason_;
  std::shared_ptr<std::atomic<uint64_t>> fault_counter_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::atomic<size_t> next_lane_{0};

  mutable std::mutex mutex_;
  std::condition_variable idle_;
  size_t pending_ = 0;
  size_t detached_pending_ = 0;
  size_t completed_since_wait_ = 0;
  uint64_t next_id_ = 1;
  std::exception_ptr first_error_;
  std::vector<uint64_t> finished_ids_;

  std::atomic<uint64_t> bytes_direct_{0};
  std::atomic<uint64_t> bytes_buffered_{0};
  std::atomic<uint64_t> requests_{0};
};

/**
 * @brief Directory capabilities, found by creating and deleting a probe file.
 */
struct DirectoryProbe {
  bool direct = false;      ///< O_DIRECT open and an aligned direct write+read succeeded
  std::string reason;       ///< why not (when !direct)
  uint32_t alignment = 4096;
  uint32_t memory_alignment = 4096;
  std::string fs_type;
};

/**
 * @brief Probes @p directory for direct I/O support.
 * @param directory an existing directory.
 * @return the findings.
 * @throws IoError when the probe file cannot be created (missing directory, permissions).
 */
DirectoryProbe probe_directory(const std::string& directory);

}  // namespace fastpersist

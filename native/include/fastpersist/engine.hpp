/**
 * @file engine.hpp
 * @brief The engine interface a lane drives, the engines (io_uring, threads),
 *        and the fault-injecting wrapper used by tests.
 *
 * An engine is owned and driven by exactly one lane thread: prepare() queues
 * operations, submit() hands them to the kernel (or to worker threads), and
 * reap() collects completions. Results follow the io_uring convention: bytes
 * transferred, or -errno.
 */
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fastpersist {

/** @brief One positional read or write. */
struct IoOp {
  int fd = -1;           ///< descriptor to use
  bool write = false;    ///< pwrite (true) or pread (false)
  void* buffer = nullptr;
  size_t length = 0;     ///< bytes (<= 1 GiB)
  uint64_t offset = 0;   ///< file offset
  uint64_t tag = 0;      ///< returned unchanged in the completion
  bool buffered = false;  ///< through the page cache (fd opened without O_DIRECT)
};

/** @brief The result of one IoOp. */
struct IoCompletion {
  uint64_t tag = 0;
  long result = 0;  ///< bytes transferred (may be short), or -errno
};

/** @brief Interface of an I/O engine instance (one per lane; single threaded use). */
class Engine {
 public:
  virtual ~Engine() = default;
  /** @brief Engine name ("io_uring", "threads"). */
  virtual const char* name() const noexcept = 0;
  /** @brief Maximum operations in flight (prepared + submitted + not reaped). */
  virtual size_t capacity() const noexcept = 0;
  /** @brief Operations prepared or submitted and not yet reaped. */
  virtual size_t in_flight() const noexcept = 0;
  /**
   * @brief Queues @p op; it starts at the next submit().
   * @param op the operation; in_flight() must be below capacity().
   */
  virtual void prepare(const IoOp& op) = 0;
  /**
   * @brief Starts every prepared operation.
   * @throws IoError if the kernel refuses the submission.
   */
  virtual void submit() = 0;
  /**
   * @brief Appends completions to @p out, blocking until at least
   *        min(@p min_complete, in_flight()) are available.
   * @param out          receives completions.
   * @param min_complete completions to wait for (0: only those already done).
   * @return completions appended.
   * @throws IoError if waiting fails.
   */
  virtual size_t reap(std::vector<IoCompletion>& out, size_t min_complete) = 0;
};

/** @brief Settings an engine instance is created with. */
struct EngineOptions {
  size_t queue_depth = 32;     ///< capacity
  bool single_submit = false;  ///< io_uring: one io_uring_enter per operation
};

/** @brief Which operations a fault applies to. */
enum class FaultOp { kWrite, kRead, kAny };

/** @brief A fault to inject (tests): the nth matching submission fails or is cut short. */
struct FaultSpec {
  bool enabled = false;
  uint64_t nth = 1;        ///< 1-based index of the first faulty submission (counted per handle)
  int error = 5;           ///< errno to complete with (EIO)
  FaultOp op = FaultOp::kWrite;
  bool short_io = false;   ///< instead of failing, submit only half the bytes
  uint64_t count = 1;      ///< consecutive faulty submissions from nth on (0: all)
};

/**
 * @brief Creates an engine instance.
 * @param name    "io_uring" or "threads".
 * @param options queue depth etc.
 * @return the engine.
 * @throws EngineUnavailable when the engine cannot start (with the reason).
 */
std::unique_ptr<Engine> make_engine(const std::string& name, const EngineOptions& options);

/**
 * @brief Wraps @p inner so that submissions matching @p spec fail or are cut short.
 * @param inner   the real engine.
 * @param spec    which submissions to break.
 * @param counter submission counter shared by every lane of one handle.
 * @return the wrapper.
 */
std::unique_ptr<Engine> make_faulty_engine(std::unique_ptr<Engine> inner, const FaultSpec& spec,
                                           std::shared_ptr<std::atomic<uint64_t>> counter);

/** @brief Engines built into this library, best first. */
std::vector<std::string> engines_compiled();

/**
 * @brief Whether engine @p name can start here, and why not.
 *
 * io_uring: io_uring_setup, opcode probe for READ/WRITE, a NOP round trip.
 * @param name engine name.
 * @return (usable, reason); reason is "" when usable.
 */
std::pair<bool, std::string> probe_engine(const std::string& name);

}  // namespace fastpersist

#pragma once
/**
 * @file crc_pool.hpp
 * @brief CRC-32s of many memory ranges on a fixed set of native threads: no interpreter in the loop.
 *
 * A load verifies every window it reads while it reads and copies the next ones. With a pool of
 * Python threads each task took the interpreter lock to start and to finish, and the loading
 * thread queued behind them for it. Here a submission is one call that queues one task per range
 * and returns a CrcJob at once; the pool's threads only ever run crc32_update() on raw memory
 * (which the caller keeps alive until the job is done). A pool made before fork() belongs to the
 * parent: in the child it computes on the calling thread and is never joined.
 */

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace fastpersist {

/** @brief The CRC-32 of each range of one submission, filled in by the pool's threads. */
class CrcJob {
 public:
  explicit CrcJob(size_t count);

  /** @brief Whether every range's CRC-32 is known (never blocks). */
  bool done() const noexcept;

  /** @brief Blocks until done(). */
  void wait() const;

  /** @brief Range @p index's CRC-32 (from 0); valid once done(). */
  uint32_t crc(size_t index) const noexcept { return results_[index]; }

  size_t size() const noexcept { return results_.size(); }

 private:
  friend class CrcPool;
  void set(size_t index, uint32_t crc) noexcept;

  std::vector<uint32_t> results_;
  std::atomic<size_t> remaining_;
  mutable std::mutex mutex_;
  mutable std::condition_variable finished_;
};

/** @brief A fixed set of threads computing CRC-32s of submitted ranges, in submission order. */
class CrcPool {
 public:
  /** @brief Starts @p threads threads (0: every submission runs on the caller's thread). */
  explicit CrcPool(size_t threads);
  /** @brief shutdown(). */
  ~CrcPool();
  CrcPool(const CrcPool&) = delete;
  CrcPool& operator=(const CrcPool&) = delete;

  /**
   * @brief Queues the CRC-32 of each range (@p addresses[i], @p lengths[i]); returns their job at once.
   * After shutdown(), or in a child process forked after the pool started, the CRC-32s are computed
   * here before returning (the job is done).
   * @throws std::invalid_argument when the two lists differ in length.
   */
  std::shared_ptr<CrcJob> submit(const std::vector<uintptr_t>& addresses, const std::vector<size_t>& lengths);
  /**
   * @brief Queues a copy of each range (@p sources[i], @p lengths[i]) to @p destinations[i] (non-overlapping);
   * returns their job at once. Each range's value is 0 once copied, or, with @p populate, the errno of the
   * page-table fill that failed, in which case nothing of the range was copied (EFAULT: a page could not be
   * had, where the copy would have raised SIGBUS; EINVAL: a kernel before Linux 5.14). Same rules as submit():
   * the caller keeps both sides alive until the job is done; after shutdown() or in a forked child the copies
   * run here.
   * @param populate the destinations are a file mapping, whose page-table entries each task fills in one call
   *                 (madvise MADV_POPULATE_WRITE) before its copy instead of taking a fault per page.
   * @param checksum each range's value is the CRC-32 of its bytes, computed in the same pass as the copy
   *                 (copy_with_crc32: the source is read once).
   * @throws std::invalid_argument when the lists differ in length.
   */
  std::shared_ptr<CrcJob> submit_copies(const std::vector<uintptr_t>& destinations,
                                        const std::vector<uintptr_t>& sources, const std::vector<size_t>& lengths,
                                        bool populate = false, bool checksum = false);

  /** @brief Runs what is queued, then stops and joins the threads. Idempotent. */
  void shutdown();

  /** @brief Threads running (0 after shutdown(), and in a forked child). */
  size_t threads() const;

 private:
  struct Task {
    std::shared_ptr<CrcJob> job;
    size_t index;
    const void* data;
    size_t length;
    void* destination;  // copy data here instead of computing its CRC-32
    bool populate;  // destination is a file mapping: fill its page tables first
    bool checksum;  // with a destination: copy and compute the CRC-32 in one pass
  };
  std::shared_ptr<CrcJob> queue(const std::vector<uintptr_t>& addresses, const std::vector<size_t>& lengths,
                                const std::vector<uintptr_t>* destinations, bool populate, bool checksum);
  static void run(const Task& task) noexcept;
  void work();
  bool inline_here() const;

  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Task> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
  pid_t owner_;
};

}  // namespace fastpersist

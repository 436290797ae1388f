// CrcPool: see crc_pool.hpp.
#include "fastpersist/crc_pool.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "fastpersist/checksum.hpp"

namespace fastpersist {

CrcJob::CrcJob(size_t count) : results_(count, 0), remaining_(count) {}

bool CrcJob::done() const noexcept { return remaining_.load(std::memory_order_acquire) == 0; }

void CrcJob::wait() const {
  if (done()) return;
  std::unique_lock<std::mutex> lock(mutex_);
  finished_.wait(lock, [this] { return done(); });
}

void CrcJob::set(size_t index, uint32_t crc) noexcept {
  results_[index] = crc;
  if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    // Taking the lock orders this wake-up after a waiter's check of done() (no lost wake-up).
    std::lock_guard<std::mutex> lock(mutex_);
    finished_.notify_all();
  }
}

CrcPool::CrcPool(size_t threads) : owner_(::getpid()) {
  workers_.reserve(threads);
  try {
    for (size_t i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
  } catch (...) {
    shutdown();  // the threads already started are joined
    throw;
  }
}

CrcPool::~CrcPool() { shutdown(); }

bool CrcPool::inline_here() const { return stopping_ || workers_.empty(); }

std::shared_ptr<CrcJob> CrcPool::submit(const std::vector<uintptr_t>& addresses, const std::vector<size_t>& lengths) {
  if (addresses.size() != lengths.size()) {
    throw std::invalid_argument("CrcPool.submit: addresses and lengths differ in length");
  }
  return queue(addresses, lengths, nullptr, false, false);
}

std::shared_ptr<CrcJob> CrcPool::submit_copies(const std::vector<uintptr_t>& destinations,
                                               const std::vector<uintptr_t>& sources,
                                               const std::vector<size_t>& lengths, bool populate, bool checksum) {
  if (destinations.size() != sources.size() || sources.size() != lengths.size()) {
    throw std::invalid_argument("CrcPool.submit_copies: destinations, sources and lengths differ in length");
  }
  return queue(sources, lengths, &destinations, populate, checksum);
}

namespace {

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

// Fills the page-table entries of a file mapping's [address, address + length) in one call, for writing;
// 0, or the errno: EFAULT where an access would raise SIGBUS (no page to be had), EINVAL before Linux 5.14.
int populate_range(void* address, size_t length) noexcept {
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t start = reinterpret_cast<uintptr_t>(address) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(address) + length;
  if (length == 0 || ::madvise(reinterpret_cast<void*>(start), end - start, MADV_POPULATE_WRITE) == 0) return 0;
  return errno;
}

}  // namespace

void CrcPool::run(const Task& task) noexcept {
  if (task.populate) {
    // A page that cannot be had is reported instead of copied into (which would raise SIGBUS).
    const int error = populate_range(task.destination, task.length);
    if (error != 0) {
      task.job->set(task.index, static_cast<uint32_t>(error));
      return;
    }
  }
  if (task.destination == nullptr) {
    task.job->set(task.index, crc32_update(0, task.data, task.length));
  } else if (task.checksum) {
    task.job->set(task.index, copy_with_crc32(task.destination, task.data, task.length, 0));
  } else {
    std::memcpy(task.destination, task.data, task.length);
    task.job->set(task.index, 0);
  }
}

std::shared_ptr<CrcJob> CrcPool::queue(const std::vector<uintptr_t>& addresses, const std::vector<size_t>& lengths,
                                       const std::vector<uintptr_t>* destinations, bool populate, bool checksum) {
  auto job = std::make_shared<CrcJob>(addresses.size());
  auto task = [&](size_t i) {
    void* destination = destinations == nullptr ? nullptr : reinterpret_cast<void*>((*destinations)[i]);
    return Task{job, i, reinterpret_cast<const void*>(addresses[i]), lengths[i], destination, populate, checksum};
  };
  // In a forked child the pool's lock may have been held by a thread that is gone: do not touch it.
  bool here = ::getpid() != owner_;
  if (!here) {
    std::lock_guard<std::mutex> lock(mutex_);
    here = inline_here();
    if (!here) {
      for (size_t i = 0; i < addresses.size(); ++i) tasks_.push_back(task(i));
    }
  }
  if (here) {
    for (size_t i = 0; i < addresses.size(); ++i) run(task(i));
  } else if (addresses.size() == 1) {
    ready_.notify_one();
  } else {
    ready_.notify_all();
  }
  return job;
}

void CrcPool::work() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, and nothing left to run
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    run(task);
  }
}

void CrcPool::shutdown() {
  if (::getpid() != owner_) {
    // A forked child: the threads ran in the parent and do not exist here (nor does whoever held the
    // lock). Joining would wait forever and destroying a joinable std::thread aborts: leave the handles.
    new std::vector<std::thread>(std::move(workers_));
    return;
  }
  std::vector<std::thread> workers;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    workers.swap(workers_);
  }
  ready_.notify_all();
  for (auto& worker : workers) worker.join();
}

size_t CrcPool::threads() const {
  if (::getpid() != owner_) return 0;
  std::lock_guard<std::mutex> lock(mutex_);
  return workers_.size();
}

}  // namespace fastpersist

// CrcPool: see crc_pool.hpp.
#include "fastpersist/crc_pool.hpp"

#include <unistd.h>

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
  auto job = std::make_shared<CrcJob>(addresses.size());
  // In a forked child the pool's lock may have been held by a thread that is gone: do not touch it.
  bool here = ::getpid() != owner_;
  if (!here) {
    std::lock_guard<std::mutex> lock(mutex_);
    here = inline_here();
    if (!here) {
      for (size_t i = 0; i < addresses.size(); ++i) {
        tasks_.push_back(Task{job, i, reinterpret_cast<const void*>(addresses[i]), lengths[i]});
      }
    }
  }
  if (here) {
    for (size_t i = 0; i < addresses.size(); ++i) {
      job->set(i, crc32_update(0, reinterpret_cast<const void*>(addresses[i]), lengths[i]));
    }
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
    task.job->set(task.index, crc32_update(0, task.data, task.length));
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

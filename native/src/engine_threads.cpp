// The portable engine: a pool of blocking worker threads doing pread/pwrite.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "engine_internal.hpp"
#include "fastpersist/error.hpp"

namespace fastpersist {

namespace {

class ThreadPoolEngine final : public Engine {
 public:
  explicit ThreadPoolEngine(const EngineOptions& options) : capacity_(options.queue_depth ? options.queue_depth : 1) {
    const size_t workers = capacity_ < kMaxWorkers ? capacity_ : kMaxWorkers;
    workers_.reserve(workers);
    try {
      for (size_t i = 0; i < workers; ++i) workers_.emplace_back([this] { run(); });
    } catch (const std::system_error& e) {
      stop_workers();
      throw EngineUnavailable(std::string("threads engine: cannot start worker threads: ") + e.what());
    }
  }

  ~ThreadPoolEngine() override { stop_workers(); }

  const char* name() const noexcept override { return "threads"; }
  size_t capacity() const noexcept override { return capacity_; }
  size_t in_flight() const noexcept override { return in_flight_; }

  void prepare(const IoOp& op) override {
    prepared_.push_back(op);
    ++in_flight_;
  }

  void submit() override {
    if (prepared_.empty()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const IoOp& op : prepared_) work_.push_back(op);
    }
    if (prepared_.size() == 1) {
      work_ready_.notify_one();
    } else {
      work_ready_.notify_all();
    }
    prepared_.clear();
  }

  size_t reap(std::vector<IoCompletion>& out, size_t min_complete) override {
    if (min_complete > in_flight_) min_complete = in_flight_;
    std::unique_lock<std::mutex> lock(mutex_);
    done_ready_.wait(lock, [&] { return done_.size() >= min_complete; });
    const size_t n = done_.size();
    out.insert(out.end(), done_.begin(), done_.end());
    done_.clear();
    in_flight_ -= n;
    return n;
  }

 private:
  static constexpr size_t kMaxWorkers = 16;

  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      work_ready_.wait(lock, [&] { return stopping_ || !work_.empty(); });
      if (work_.empty()) return;  // stopping
      const IoOp op = work_.front();
      work_.pop_front();
      lock.unlock();
      long result;
      do {
        result = op.write ? ::pwrite(op.fd, op.buffer, op.length, static_cast<off_t>(op.offset))
                          : ::pread(op.fd, op.buffer, op.length, static_cast<off_t>(op.offset));
      } while (result < 0 && errno == EINTR);
      if (result < 0) result = -errno;  // the lane checks results with FP_CHECK_RES
      lock.lock();
      done_.push_back(IoCompletion{op.tag, result});
      done_ready_.notify_one();
    }
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    work_ready_.notify_all();
    for (std::thread& t : workers_) {
      if (t.joinable()) t.join();
    }
    workers_.clear();
  }

  const size_t capacity_;
  size_t in_flight_ = 0;  // touched only by the owning lane thread
  std::vector<IoOp> prepared_;
  std::vector<std::thread> workers_;

  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable done_ready_;
  std::deque<IoOp> work_;
  std::vector<IoCompletion> done_;
  bool stopping_ = false;
};

}  // namespace

std::unique_ptr<Engine> make_thread_pool_engine(const EngineOptions& options) {
  return std::unique_ptr<Engine>(new ThreadPoolEngine(options));
}

}  // namespace fastpersist

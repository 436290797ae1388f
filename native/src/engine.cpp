// Engine factory, probing, and the fault-injecting wrapper.
#include <cerrno>
#include <deque>
#include <mutex>
#include <vector>

#include "engine_internal.hpp"
#include "fastpersist/error.hpp"

namespace fastpersist {

namespace {

/**
 * Test double implementing the real interface: selected submissions complete
 * with -errno without reaching the kernel, or are submitted with half their
 * length (a short read/write the lane must resubmit).
 */
class FaultyEngine final : public Engine {
 public:
  FaultyEngine(std::unique_ptr<Engine> inner, const FaultSpec& spec, std::shared_ptr<std::atomic<uint64_t>> counter)
      : inner_(std::move(inner)), spec_(spec), counter_(std::move(counter)) {}

  const char* name() const noexcept override { return inner_->name(); }
  size_t capacity() const noexcept override { return inner_->capacity(); }
  size_t in_flight() const noexcept override { return inner_->in_flight() + synthetic_.size(); }

  void prepare(const IoOp& op) override {
    const bool matches = spec_.op == FaultOp::kAny || (spec_.op == FaultOp::kWrite) == op.write;
    if (matches) {
      const uint64_t n = counter_->fetch_add(1) + 1;
      const bool faulty = n >= spec_.nth && (spec_.count == 0 || n < spec_.nth + spec_.count);
      if (faulty && !spec_.short_io) {
        synthetic_.push_back(IoCompletion{op.tag, -static_cast<long>(spec_.error)});
        return;
      }
      if (faulty && op.length >= 2) {
        IoOp half = op;
        // Keep the first part direct-I/O aligned when it can be, as a real
        // device would; the remainder is what the lane must finish.
        half.length = op.length >= 8192 ? (op.length / 2) / 4096 * 4096 : op.length / 2;
        inner_->prepare(half);
        return;
      }
    }
    inner_->prepare(op);
  }

  void submit() override { inner_->submit(); }

  size_t reap(std::vector<IoCompletion>& out, size_t min_complete) override {
    size_t got = synthetic_.size();
    out.insert(out.end(), synthetic_.begin(), synthetic_.end());
    synthetic_.clear();
    const size_t want = min_complete > got ? min_complete - got : 0;
    return got + inner_->reap(out, want);
  }

 private:
  std::unique_ptr<Engine> inner_;
  FaultSpec spec_;
  std::shared_ptr<std::atomic<uint64_t>> counter_;
  std::vector<IoCompletion> synthetic_;
};

}  // namespace

std::unique_ptr<Engine> make_engine(const std::string& name, const EngineOptions& options) {
  if (name == "threads") return make_thread_pool_engine(options);
#if FASTPERSIST_HAVE_IO_URING
  if (name == "io_uring") return make_uring_engine(options);
#else
  if (name == "io_uring") throw EngineUnavailable("io_uring: this build of fastpersist was compiled without it");
#endif
  throw EngineUnavailable("unknown I/O engine '" + name + "'; choose 'auto', 'io_uring' or 'threads'");
}

std::unique_ptr<Engine> make_faulty_engine(std::unique_ptr<Engine> inner, const FaultSpec& spec,
                                           std::shared_ptr<std::atomic<uint64_t>> counter) {
  return std::unique_ptr<Engine>(new FaultyEngine(std::move(inner), spec, std::move(counter)));
}

std::vector<std::string> engines_compiled() {
#if FASTPERSIST_HAVE_IO_URING
  return {"io_uring", "threads"};
#else
  return {"threads"};
#endif
}

std::pair<bool, std::string> probe_engine(const std::string& name) {
  if (name == "threads") return {true, ""};
  if (name == "io_uring") {
#if FASTPERSIST_HAVE_IO_URING
    return probe_uring();
#else
    return {false, "io_uring: this build of fastpersist was compiled without it"};
#endif
  }
  return {false, "unknown I/O engine '" + name + "'; choose 'auto', 'io_uring' or 'threads'"};
}

}  // namespace fastpersist

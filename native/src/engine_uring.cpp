// io_uring through raw system calls over the kernel's uapi header (no liburing).
#include "engine_internal.hpp"

#if FASTPERSIST_HAVE_IO_URING

#include <linux/io_uring.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "fastpersist/error.hpp"

namespace fastpersist {

namespace {

long sys_io_uring_setup(unsigned entries, io_uring_params* params) {
  long rc = syscall(__NR_io_uring_setup, entries, params);
  return rc < 0 ? -errno : rc;
}

long sys_io_uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  long rc = syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0);
  return rc < 0 ? -errno : rc;
}

long sys_io_uring_register(int fd, unsigned opcode, void* arg, unsigned nr_args) {
  long rc = syscall(__NR_io_uring_register, fd, opcode, arg, nr_args);
  return rc < 0 ? -errno : rc;
}

template <typename T>
T load_acquire(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <typename T>
void store_release(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

unsigned round_up_pow2(size_t n) {
  unsigned v = 1;
  while (v < n && v < (1u << 15)) v <<= 1;
  return v;
}

std::string uring_setup_reason(long err) {
  switch (-err) {
    case ENOSYS:
      return "io_uring_setup: the kernel was built without io_uring (ENOSYS)";
    case EPERM:
      return "io_uring_setup: not permitted (kernel.io_uring_disabled, seccomp or a container policy)";
    case ENOMEM:
      return "io_uring_setup: out of memory (or RLIMIT_MEMLOCK too low on kernels < 5.12)";
    case EMFILE:
    case ENFILE:
      return "io_uring_setup: too many open files";
    default:
      return std::string("io_uring_setup failed: ") + std::strerror(static_cast<int>(-err));
  }
}

/** One ring: the submission and completion queues mapped into our memory. */
class UringEngine final : public Engine {
 public:
  explicit UringEngine(const EngineOptions& options) : single_submit_(options.single_submit) {
    const unsigned entries = round_up_pow2(options.queue_depth ? options.queue_depth : 1);
    // Fastest first: a single issuer whose completions run only when we ask
    // for them (kernel >= 6.1), then plain rings for older kernels.
    const unsigned flag_sets[] = {IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_CQSIZE,
                                  IORING_SETUP_CQSIZE, 0};
    long fd = -ENOSYS;
    for (unsigned flags : flag_sets) {
      std::memset(&params_, 0, sizeof params_);
      params_.flags = flags;
      params_.cq_entries = entries * 2;
      fd = sys_io_uring_setup(entries, &params_);
      if (fd >= 0 || fd != -EINVAL) break;
    }
    if (fd < 0) throw EngineUnavailable(uring_setup_reason(fd));
    ring_fd_ = static_cast<int>(fd);
    defer_taskrun_ = params_.flags & IORING_SETUP_DEFER_TASKRUN;
    // IOSQE_ASYNC came with kernel 5.6, as did this feature bit; an older kernel fails such SQEs.
    async_buffered_reads_ = params_.features & IORING_FEAT_RW_CUR_POS;
    capacity_ = params_.sq_entries;
    if (options.queue_depth && options.queue_depth < capacity_) capacity_ = options.queue_depth;
    try {
      map_rings();
    } catch (const IoError& e) {
      unmap();
      throw EngineUnavailable(std::string("io_uring: cannot map the rings: ") + e.what());
    }
  }

  ~UringEngine() override {
    // The owning lane reaps everything before destroying the engine; if it
    // could not, wait here so the kernel never writes into freed memory.
    try {
      std::vector<IoCompletion> sink;
      while (in_flight_ > 0) reap(sink, in_flight_);
    } catch (...) {
    }
    unmap();
  }

  const char* name() const noexcept override { return "io_uring"; }
  size_t capacity() const noexcept override { return capacity_; }
  size_t in_flight() const noexcept override { return in_flight_; }

  void prepare(const IoOp& op) override {
    const unsigned tail = local_tail_;
    const unsigned index = tail & sq_mask_;
    io_uring_sqe* sqe = &sqes_[index];
    std::memset(sqe, 0, sizeof *sqe);
    sqe->opcode = op.write ? IORING_OP_WRITE : IORING_OP_READ;
    sqe->fd = op.fd;
    sqe->addr = reinterpret_cast<uint64_t>(op.buffer);
    sqe->len = static_cast<uint32_t>(op.length);
    sqe->off = op.offset;
    sqe->user_data = op.tag;
    // A buffered read of cached pages completes inline, in io_uring_enter on this lane's thread: one
    // memcpy at a time. Forced async, the kernel's workers copy the blocks in flight side by side.
    if (op.buffered && !op.write && async_buffered_reads_) sqe->flags |= IOSQE_ASYNC;
    sq_array_[index] = index;
    local_tail_ = tail + 1;
    ++unsubmitted_;
    ++in_flight_;
    if (single_submit_) submit();
  }

  void submit() override {
    if (unsubmitted_ == 0) return;
    store_release(sq_tail_, local_tail_);
    while (unsubmitted_ > 0) {
      long rc = sys_io_uring_enter(ring_fd_, unsubmitted_, 0, 0);
      if (rc == -EINTR || rc == -EAGAIN || rc == -EBUSY) {
        std::this_thread::yield();
        continue;
      }
      FP_CHECK_RES(rc, "io_uring_enter (submit)", "");
      unsubmitted_ -= static_cast<unsigned>(rc);
    }
  }

  size_t reap(std::vector<IoCompletion>& out, size_t min_complete) override {
    if (min_complete > in_flight_) min_complete = in_flight_;
    size_t got = drain(out);
    if (got == 0 && min_complete == 0 && defer_taskrun_ && in_flight_ > 0) {
      // Deferred completions only reach the ring when we enter the kernel.
      long rc = sys_io_uring_enter(ring_fd_, 0, 0, IORING_ENTER_GETEVENTS);
      if (rc != -EINTR && rc != -EAGAIN) FP_CHECK_RES(rc, "io_uring_enter (peek)", "");
      got += drain(out);
    }
    while (got < min_complete) {
      long rc = sys_io_uring_enter(ring_fd_, 0, static_cast<unsigned>(min_complete - got), IORING_ENTER_GETEVENTS);
      if (rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) FP_CHECK_RES(rc, "io_uring_enter (wait)", "");
      got += drain(out);
    }
    return got;
  }

 private:
  size_t drain(std::vector<IoCompletion>& out) {
    unsigned head = *cq_head_;
    const unsigned tail = load_acquire(cq_tail_);
    size_t n = 0;
    while (head != tail) {
      const io_uring_cqe& cqe = cqes_[head & cq_mask_];
      out.push_back(IoCompletion{cqe.user_data, static_cast<long>(cqe.res)});
      ++head;
      ++n;
    }
    if (n) store_release(cq_head_, head);
    in_flight_ -= n;
    return n;
  }

  void map_rings() {
    sq_size_ = params_.sq_off.array + params_.sq_entries * sizeof(unsigned);
    cq_size_ = params_.cq_off.cqes + params_.cq_entries * sizeof(io_uring_cqe);
    const bool single_mmap = params_.features & IORING_FEAT_SINGLE_MMAP;
    if (single_mmap) sq_size_ = cq_size_ = (sq_size_ > cq_size_ ? sq_size_ : cq_size_);
    void* sq = ::mmap(nullptr, sq_size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd_,
                      IORING_OFF_SQ_RING);
    if (sq == MAP_FAILED) FP_CHECK(-1, "mmap io_uring SQ ring", "");
    sq_ring_ = sq;
    if (single_mmap) {
      cq_ring_ = sq;
    } else {
      void* cq = ::mmap(nullptr, cq_size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd_,
                        IORING_OFF_CQ_RING);
      if (cq == MAP_FAILED) FP_CHECK(-1, "mmap io_uring CQ ring", "");
      cq_ring_ = cq;
    }
    sqes_size_ = params_.sq_entries * sizeof(io_uring_sqe);
    void* sqes = ::mmap(nullptr, sqes_size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd_,
                        IORING_OFF_SQES);
    if (sqes == MAP_FAILED) FP_CHECK(-1, "mmap io_uring SQEs", "");
    sqes_ = static_cast<io_uring_sqe*>(sqes);

    char* sqb = static_cast<char*>(sq_ring_);
    sq_tail_ = reinterpret_cast<unsigned*>(sqb + params_.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(sqb + params_.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(sqb + params_.sq_off.array);
    local_tail_ = *sq_tail_;
    char* cqb = static_cast<char*>(cq_ring_);
    cq_head_ = reinterpret_cast<unsigned*>(cqb + params_.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cqb + params_.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cqb + params_.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cqb + params_.cq_off.cqes);
  }

  void unmap() noexcept {
    if (sqes_) ::munmap(sqes_, sqes_size_);
    if (cq_ring_ && cq_ring_ != sq_ring_) ::munmap(cq_ring_, cq_size_);
    if (sq_ring_) ::munmap(sq_ring_, sq_size_);
    sqes_ = nullptr;
    cq_ring_ = sq_ring_ = nullptr;
    if (ring_fd_ >= 0) ::close(ring_fd_);
    ring_fd_ = -1;
  }

  io_uring_params params_{};
  int ring_fd_ = -1;
  bool single_submit_;
  bool defer_taskrun_ = false;
  bool async_buffered_reads_ = false;
  size_t capacity_ = 0;
  size_t in_flight_ = 0;
  unsigned unsubmitted_ = 0;
  unsigned local_tail_ = 0;

  void* sq_ring_ = nullptr;
  void* cq_ring_ = nullptr;
  size_t sq_size_ = 0, cq_size_ = 0, sqes_size_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  unsigned* sq_tail_ = nullptr;
  unsigned sq_mask_ = 0;
  unsigned* sq_array_ = nullptr;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
};

}  // namespace

std::unique_ptr<Engine> make_uring_engine(const EngineOptions& options) {
  return std::unique_ptr<Engine>(new UringEngine(options));
}

std::pair<bool, std::string> probe_uring() {
  {
    std::string disabled;
    if (read_small_file("/proc/sys/kernel/io_uring_disabled", disabled) && !disabled.empty() && disabled[0] == '2') {
      return {false, "io_uring is disabled (kernel.io_uring_disabled=2)"};
    }
  }
  io_uring_params params;
  std::memset(&params, 0, sizeof params);
  long fd = sys_io_uring_setup(4, &params);
  if (fd < 0) return {false, uring_setup_reason(fd)};
  std::pair<bool, std::string> result{true, ""};
  // Opcode probe: IORING_OP_READ/WRITE need kernel >= 5.6.
  const size_t probe_size = sizeof(io_uring_probe) + 256 * sizeof(io_uring_probe_op);
  std::vector<unsigned char> storage(probe_size, 0);
  auto* probe = reinterpret_cast<io_uring_probe*>(storage.data());
  long rc = sys_io_uring_register(static_cast<int>(fd), IORING_REGISTER_PROBE, probe, 256);
  if (rc < 0) {
    result = {false, "io_uring: kernel too old (no IORING_REGISTER_PROBE; need >= 5.6)"};
  } else {
    for (unsigned op : {unsigned(IORING_OP_READ), unsigned(IORING_OP_WRITE)}) {
      if (op > probe->last_op || !(probe->ops[op].flags & IO_URING_OP_SUPPORTED)) {
        result = {false, "io_uring: kernel lacks IORING_OP_READ/WRITE (need >= 5.6)"};
      }
    }
  }
  ::close(static_cast<int>(fd));
  if (!result.first) return result;
  // A real round trip through the ring we would use.
  try {
    EngineOptions options;
    options.queue_depth = 2;
    UringEngine engine(options);
    int zero = ::open("/dev/zero", O_RDONLY | O_CLOEXEC);
    if (zero < 0) return result;  // nothing to read from; setup and probe passed
    unsigned char byte = 1;
    engine.prepare(IoOp{zero, false, &byte, 1, 0, 7});
    engine.submit();
    std::vector<IoCompletion> done;
    engine.reap(done, 1);
    ::close(zero);
    if (done.size() != 1 || done[0].tag != 7 || done[0].result != 1 || byte != 0) {
      return {false, "io_uring: a test read through the ring returned a wrong result"};
    }
  } catch (const std::exception& e) {
    return {false, e.what()};
  }
  return result;
}

}  // namespace fastpersist

#endif  // FASTPERSIST_HAVE_IO_URING

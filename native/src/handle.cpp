#include "fastpersist/handle.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <future>
#include <random>
#include <stdexcept>

#include "fastpersist/buffer.hpp"
#include "fastpersist/error.hpp"

namespace fastpersist {

namespace {

constexpr size_t kMaxBlock = 1u << 30;
constexpr size_t kMinBlock = 512;         // DeepNVMe accepts any multiple of the logical block
constexpr size_t kMaxQueueDepth = 32768;  // io_uring's IORING_MAX_ENTRIES; libaio's usual aio-max-nr share
constexpr size_t kEngineDepthCap = 4096;  // slots per lane actually allocated (more never helps one lane)
constexpr unsigned kMaxRetries = 1000;  // EAGAIN/EINTR or zero-progress writes before giving up

uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
uint64_t round_down(uint64_t v, uint64_t a) { return v / a * a; }

std::string describe_chunk(const Chunk& c) {
  return std::string(c.direct ? "direct " : "buffered ") + std::to_string(c.length) + " bytes at offset " +
         std::to_string(c.offset);
}

}  // namespace

/**
 * A thread owning one engine instance: takes chunks from its queue, keeps up
 * to queue_depth in flight, checks each completion and resubmits remainders.
 */
class Lane {
 public:
  Lane(IoHandle& owner, const std::string& engine_name) : owner_(owner) {
    std::promise<void> started;
    std::future<void> ready = started.get_future();
    thread_ = std::thread([this, engine_name, &started] {
      try {
        EngineOptions options;
        options.queue_depth = std::min(owner_.options_.queue_depth, kEngineDepthCap);
        options.single_submit = owner_.options_.single_submit;
        engine_ = make_engine(engine_name, options);
        if (owner_.options_.fault.enabled) {
          engine_ = make_faulty_engine(std::move(engine_), owner_.options_.fault, owner_.fault_counter_);
        }
      } catch (...) {
        started.set_exception(std::current_exception());
        return;
      }
      started.set_value();
      run();
    });
    try {
      ready.get();
    } catch (...) {
      thread_.join();
      throw;
    }
  }

  ~Lane() { stop(); }

  void enqueue(std::vector<Chunk>& chunks) {
    if (chunks.empty()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (Chunk& c : chunks) queue_.push_back(std::move(c));
    }
    wake_.notify_one();
  }

  void stop() noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    const size_t capacity = engine_->capacity();
    slots_.resize(capacity);
    free_slots_.reserve(capacity);
    for (size_t i = capacity; i-- > 0;) free_slots_.push_back(i);
    std::vector<Chunk> taken;
    std::vector<IoCompletion> completions;
    completions.reserve(capacity);
    for (;;) {
      taken.clear();
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (retry_.empty() && engine_->in_flight() == 0) {
          wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
          if (queue_.empty()) break;  // stopping, nothing left
        }
        size_t room = capacity - engine_->in_flight();
        while (room > 0 && !retry_.empty()) {
          taken.push_back(std::move(retry_.front()));
          retry_.pop_front();
          --room;
        }
        while (room > 0 && !queue_.empty()) {
          taken.push_back(std::move(queue_.front()));
          queue_.pop_front();
          --room;
        }
      }
      size_t started = 0;
      try {
        for (; started < taken.size(); ++started) start(taken[started]);
        engine_->submit();
        if (engine_->in_flight() == 0) continue;
        completions.clear();
        const size_t wanted = owner_.options_.overlap_events ? 1 : engine_->in_flight();
        engine_->reap(completions, wanted);
      } catch (...) {
        // Chunks taken but never handed to the engine fail with the same error.
        const std::exception_ptr error = std::current_exception();
        for (size_t i = started + 1; i < taken.size(); ++i) {
          owner_.record_error(taken[i].request, error);
          owner_.finish_chunk(taken[i].request);
        }
        fail_everything_in_flight(error);
        continue;
      }
      for (const IoCompletion& c : completions) complete(c);
    }
    // A single-issuer ring belongs to this thread: tear it down here.
    engine_.reset();
  }

  // Hands a chunk to the engine, or drops it when its request already failed.
  void start(Chunk& chunk) {
    if (chunk.request->failed()) {
      owner_.finish_chunk(chunk.request);
      return;
    }
    const File& file = *chunk.request->file_;
    const size_t slot = free_slots_.back();
    free_slots_.pop_back();
    IoOp op;
    op.fd = chunk.direct ? file.direct_fd() : file.fd();
    op.buffered = !chunk.direct;
    op.write = chunk.request->is_write();
    op.buffer = chunk.buffer;
    op.length = chunk.length;
    op.offset = chunk.offset;
    op.tag = slot;
    slots_[slot] = std::move(chunk);
    engine_->prepare(op);
  }

  void complete(const IoCompletion& c) {
    const size_t slot = static_cast<size_t>(c.tag);
    Chunk chunk = std::move(slots_[slot]);
    slots_[slot] = Chunk();
    free_slots_.push_back(slot);
    const std::shared_ptr<Request>& request = chunk.request;
    const bool write = request->is_write();
    if (c.result < 0) {
      const int err = static_cast<int>(-c.result);
      if ((err == EAGAIN || err == EINTR) && chunk.retries < kMaxRetries) {
        ++chunk.retries;
        retry_.push_back(std::move(chunk));
        return;
      }
      if (err == EINVAL && chunk.direct) {
        // The filesystem refused this direct request at run time (some network
        // and FUSE filesystems do); the buffered descriptor can still do it.
        chunk.direct = false;
        retry_.push_back(std::move(chunk));
        return;
      }
      try {
        FP_CHECK_COMPLETION(c.result, write ? "write" : "read", request->path(),
                            describe_chunk(chunk) + ", engine " + engine_->name());
      } catch (...) {
        owner_.record_error(request, std::current_exception());
      }
      owner_.finish_chunk(request);
      return;
    }
    const size_t done = static_cast<size_t>(c.result);
    (chunk.direct ? owner_.bytes_direct_ : owner_.bytes_buffered_).fetch_add(done, std::memory_order_relaxed);
    request->bytes_.fetch_add(done, std::memory_order_acq_rel);
    if (done >= chunk.length) {
      owner_.finish_chunk(request);
      return;
    }
    if (done == 0) {
      if (!write) {
        // End of file: remember where the data ran out; finalize() decides.
        uint64_t previous = request->eof_offset_.load();
        while (chunk.offset < previous && !request->eof_offset_.compare_exchange_weak(previous, chunk.offset)) {
        }
        owner_.finish_chunk(request);
        return;
      }
      if (++chunk.retries >= kMaxRetries) {
        owner_.record_error(request, std::make_exception_ptr(make_io_error(
                                         EIO, "write", request->path(),
                                         "no progress after repeated attempts, " + describe_chunk(chunk), __FILE__,
                                         __LINE__)));
        owner_.finish_chunk(request);
        return;
      }
      retry_.push_back(std::move(chunk));
      return;
    }
    // Short transfer: resubmit the remainder; if it is no longer aligned for
    // direct I/O, finish it through the buffered descriptor.
    chunk.buffer += done;
    chunk.offset += done;
    chunk.length -= done;
    if (chunk.direct) {
      const File& file = *request->file_;
      const bool aligned = chunk.offset % file.alignment() == 0 && chunk.length % file.alignment() == 0 &&
                           reinterpret_cast<uintptr_t>(chunk.buffer) % file.memory_alignment() == 0;
      if (!aligned) chunk.direct = false;
    }
    retry_.push_back(std::move(chunk));
  }

  void fail_everything_in_flight(std::exception_ptr error) {
    // The engine itself failed (should not happen); every chunk it held is lost.
    for (Chunk& chunk : slots_) {
      if (!chunk.request) continue;
      owner_.record_error(chunk.request, error);
      owner_.finish_chunk(chunk.request);
      chunk = Chunk();
    }
    free_slots_.clear();
    for (size_t i = slots_.size(); i-- > 0;) free_slots_.push_back(i);
    std::unique_ptr<Engine> replacement;
    try {
      EngineOptions options;
      options.queue_depth = std::min(owner_.options_.queue_depth, kEngineDepthCap);
      options.single_submit = owner_.options_.single_submit;
      replacement = make_engine(engine_->name(), options);
    } catch (...) {
      replacement = make_engine("threads", EngineOptions{std::min(owner_.options_.queue_depth, kEngineDepthCap), false});
    }
    engine_.release();  // cannot be trusted to unmap safely after a failure
    engine_ = std::move(replacement);
  }

  IoHandle& owner_;
  std::unique_ptr<Engine> engine_;
  std::thread thread_;
  std::vector<Chunk> slots_;
  std::vector<size_t> free_slots_;
  std::deque<Chunk> retry_;  // touched only by the lane thread

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Chunk> queue_;
  bool stopping_ = false;
};

namespace {

std::pair<bool, std::string> cached_uring_probe() {
  static std::once_flag once;
  static std::pair<bool, std::string> result;
  std::call_once(once, [] { result = probe_engine("io_uring"); });
  return result;
}

}  // namespace

IoHandle::IoHandle(const HandleOptions& options) : options_(options) {
  if (options_.block_size < kMinBlock || options_.block_size % kMinBlock != 0 || options_.block_size > kMaxBlock) {
    throw std::invalid_argument("block_size must be a multiple of 512 between 512 and 1 GiB, got " +
                                std::to_string(options_.block_size));
  }
  if (options_.queue_depth < 1 || options_.queue_depth > kMaxQueueDepth) {
    throw std::invalid_argument("queue_depth must be between 1 and " + std::to_string(kMaxQueueDepth) + ", got " +
                                std::to_string(options_.queue_depth));
  }
  if (options_.intra_op_parallelism < 1 || options_.intra_op_parallelism > 256) {
    throw std::invalid_argument("intra_op_parallelism must be between 1 and 256, got " +
                                std::to_string(options_.intra_op_parallelism));
  }
  if (options_.fault.enabled && options_.fault.nth < 1) {
    throw std::invalid_argument("fault nth is 1-based and must be >= 1");
  }
  fault_counter_ = std::make_shared<std::atomic<uint64_t>>(0);
  std::string name = options_.engine;
  if (name == "auto") {
    const auto probe = cached_uring_probe();
    if (probe.first) {
      name = "io_uring";
    } else {
      name = "threads";
      fallback_reason_ = probe.second;
    }
  } else if (name != "io_uring" && name != "threads") {
    throw EngineUnavailable("unknown I/O engine '" + name + "'; choose 'auto', 'io_uring' or 'threads'");
  }
  try {
    for (size_t i = 0; i < options_.intra_op_parallelism; ++i) lanes_.emplace_back(new Lane(*this, name));
  } catch (const EngineUnavailable& e) {
    lanes_.clear();
    if (options_.engine != "auto" || name == "threads") throw;
    fallback_reason_ = e.what();
    name = "threads";
    for (size_t i = 0; i < options_.intra_op_parallelism; ++i) lanes_.emplace_back(new Lane(*this, name));
  }
  options_.engine = name;
}

IoHandle::~IoHandle() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [this] { return pending_ == 0 && detached_pending_ == 0; });
  }
  stop_lanes();
}

void IoHandle::stop_lanes() noexcept {
  for (auto& lane : lanes_) lane->stop();
  lanes_.clear();
}

std::shared_ptr<File> IoHandle::open_for(const std::string& path, bool write) const {
  return std::make_shared<File>(path, write ? OpenMode::kWrite : OpenMode::kRead, options_.direct, false, write);
}

std::shared_ptr<Request> IoHandle::submit_write(const void* buffer, uint64_t nbytes, std::shared_ptr<File> file,
                                                uint64_t file_offset, bool owns_file, bool truncate,
                                                bool detached) {
  return submit(true, const_cast<void*>(buffer), nbytes, std::move(file), file_offset, owns_file, truncate, false,
                detached);
}

std::shared_ptr<Request> IoHandle::submit_read(void* buffer, uint64_t nbytes, std::shared_ptr<File> file,
                                               uint64_t file_offset, bool owns_file, bool allow_short,
                                               bool detached) {
  return submit(false, buffer, nbytes, std::move(file), file_offset, owns_file, false, allow_short, detached);
}

std::shared_ptr<Request> IoHandle::submit(bool write, void* buffer, uint64_t nbytes, std::shared_ptr<File> file,
                                          uint64_t file_offset, bool owns_file, bool truncate, bool allow_short,
                                          bool detached) {
  if (!file) throw std::invalid_argument("no file given");
  if (nbytes > 0 && buffer == nullptr) throw std::invalid_argument("null buffer for a non-empty request");
  if (write && file->mode() == OpenMode::kRead) {
    errno = EBADF;
    FP_CHECK(-1, "write to a file opened read-only", file->path());
  }
  if (!write && file->mode() == OpenMode::kWrite) {
    errno = EBADF;
    FP_CHECK(-1, "read from a file opened write-only", file->path());
  }
  file->acquire();

  auto request = std::make_shared<Request>();
  request->write_ = write;
  request->nbytes_ = nbytes;
  request->file_offset_ = file_offset;
  request->path_ = file->path();
  request->file_ = file;
  request->owns_file_ = owns_file;
  request->truncate_ = truncate;
  request->allow_short_ = allow_short;
  request->detached_ = detached;

  // Split: unaligned head and tail through the buffered descriptor, the
  // aligned middle (when memory is aligned too) through the direct one. Split
  // points are multiples of the alignment (>= page size), so a direct and a
  // buffered transfer never share a page.
  std::vector<std::vector<Chunk>> per_lane(lanes_.size());
  const size_t lanes = lanes_.size();
  size_t lane = next_lane_.fetch_add(1) % lanes;
  size_t count = 0;
  auto add = [&](uint64_t offset, uint64_t length, bool direct, size_t piece) {
    unsigned char* base = static_cast<unsigned char*>(buffer);
    for (uint64_t done = 0; done < length; done += piece) {
      Chunk c;
      c.request = request;
      c.buffer = base + (offset - file_offset) + done;
      c.length = static_cast<size_t>(std::min<uint64_t>(piece, length - done));
      c.offset = offset + done;
      c.direct = direct;
      per_lane[lane].push_back(std::move(c));
      lane = (lane + 1) % lanes;
      ++count;
    }
  };
  const uint64_t end = file_offset + nbytes;
  bool direct = options_.direct && file->direct() && nbytes > 0;
  uint64_t middle_start = file_offset, middle_end = file_offset;
  if (direct) {
    const uint64_t a = file->alignment();
    middle_start = std::min(round_up(file_offset, a), end);
    middle_end = std::max(round_down(end, a), middle_start);
    const uintptr_t address = reinterpret_cast<uintptr_t>(buffer) + (middle_start - file_offset);
    if (middle_end == middle_start || address % file->memory_alignment() != 0) direct = false;
  }
  if (direct) {
    const uint64_t a = file->alignment();
    const size_t piece = static_cast<size_t>(std::max<uint64_t>(a, round_down(options_.block_size, a)));
    add(file_offset, middle_start - file_offset, false, options_.block_size);
    add(middle_start, middle_end - middle_start, true, piece);
    add(middle_end, end - middle_end, false, options_.block_size);
  } else {
    add(file_offset, nbytes, false, options_.block_size);
  }

  request->chunks_left_.store(count);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    request->id_ = next_id_++;
    ++(detached ? detached_pending_ : pending_);
  }
  requests_.fetch_add(1, std::memory_order_relaxed);
  if (count == 0) {
    finalize(request);
    return request;
  }
  for (size_t i = 0; i < lanes; ++i) lanes_[i]->enqueue(per_lane[i]);
  return request;
}

void IoHandle::record_error(const std::shared_ptr<Request>& request, std::exception_ptr error) {
  request->failed_.store(true, std::memory_order_release);
  std::lock_guard<std::mutex> lock(mutex_);
  if (request->detached_) {
    if (!request->error_) request->error_ = std::move(error);
  } else if (!first_error_) {
    first_error_ = std::move(error);
  }
}

void IoHandle::finish_chunk(const std::shared_ptr<Request>& request) {
  if (request->chunks_left_.fetch_sub(1, std::memory_order_acq_rel) == 1) finalize(request);
}

void IoHandle::finalize(const std::shared_ptr<Request>& request) {
  File& file = *request->file_;
  if (!request->failed()) {
    try {
      const uint64_t eof = request->eof_offset_.load();
      if (!request->write_ && eof != UINT64_MAX && !request->allow_short_) {
        throw UnexpectedEndOfFile(request->path_, eof, request->nbytes_, request->bytes_transferred(),
                                  std::string("handle.cpp:") + std::to_string(__LINE__));
      }
      if (request->write_ && request->truncate_) file.truncate(request->file_offset_ + request->nbytes_);
    } catch (...) {
      record_error(request, std::current_exception());
    }
  }
  file.release();
  if (request->owns_file_) {
    try {
      file.close();
    } catch (...) {
      if (!request->failed()) record_error(request, std::current_exception());
    }
  }
  request->file_.reset();
  std::lock_guard<std::mutex> lock(mutex_);
  request->done_.store(true, std::memory_order_release);
  finished_ids_.push_back(request->id_);
  if (request->detached_) {
    --detached_pending_;
    idle_.notify_all();
    return;
  }
  --pending_;
  ++completed_since_wait_;
  if (pending_ == 0) idle_.notify_all();
}

size_t IoHandle::wait_request(const std::shared_ptr<Request>& request) {
  if (!request) throw std::invalid_argument("no request given");
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [&] { return request->done(); });
  if (request->error_) {
    std::exception_ptr error = std::move(request->error_);
    request->error_ = nullptr;
    std::rethrow_exception(error);
  }
  return 1;
}

size_t IoHandle::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [this] { return pending_ == 0; });
  const size_t completed = completed_since_wait_;
  completed_since_wait_ = 0;
  if (first_error_) {
    std::exception_ptr error = std::move(first_error_);
    first_error_ = nullptr;
    std::rethrow_exception(error);
  }
  return completed;
}

size_t IoHandle::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_;
}

std::vector<uint64_t> IoHandle::take_finished_ids() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<uint64_t> ids;
  ids.swap(finished_ids_);
  return ids;
}

HandleStats IoHandle::stats() const {
  HandleStats s;
  s.bytes_direct = bytes_direct_.load();
  s.bytes_buffered = bytes_buffered_.load();
  s.requests = requests_.load();
  return s;
}

DirectoryProbe probe_directory(const std::string& directory) {
  DirectoryProbe probe;
  std::random_device random;
  const std::string path = directory + "/.fastpersist-probe-" + std::to_string(::getpid()) + "-" +
                           std::to_string(random());
  {
    int fd = static_cast<int>(
        FP_CHECK(::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600), "create a probe file in", path));
    ::close(fd);
  }
  try {
    File file(path, OpenMode::kReadWrite, true, false, false);
    probe.fs_type = filesystem_type(file.fd(), path);
    probe.alignment = file.alignment();
    probe.memory_alignment = file.memory_alignment();
    if (!file.direct()) {
      probe.reason = file.fallback_reason();
    } else {
      // Some filesystems accept O_DIRECT at open and refuse the I/O itself.
      AlignedBuffer block(file.alignment(), false, false);
      std::memset(block.data(), 0x5a, block.size());
      ssize_t written = ::pwrite(file.direct_fd(), block.data(), block.size(), 0);
      ssize_t read = written == static_cast<ssize_t>(block.size())
                         ? ::pread(file.direct_fd(), block.data(), block.size(), 0)
                         : -1;
      if (written == static_cast<ssize_t>(block.size()) && read == static_cast<ssize_t>(block.size())) {
        probe.direct = true;
      } else {
        probe.reason = std::string("O_DIRECT opened but a direct ") + (written < 0 ? "write" : "read") +
                       " failed (" + std::strerror(errno) + "): using buffered I/O";
      }
    }
    file.close();
  } catch (...) {
    ::unlink(path.c_str());
    throw;
  }
  ::unlink(path.c_str());
  return probe;
}

}  // namespace fastpersist

// Tests of the CRC-32 pool (crc_pool.hpp) without Python: results equal crc32_update, many jobs from
// several threads at once, waiting, shutdown draining what is queued, submissions after shutdown,
// mismatched lists, copies, and a forked child that computes on its own thread:
//   g++ -std=c++17 -pthread -Inative/include -Inative/src native/src/*.cpp native/tests/crc_pool_test.cpp && ./a.out
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <thread>
#include <vector>

#include "check.hpp"
#include "fastpersist/checksum.hpp"
#include "fastpersist/crc_pool.hpp"

using namespace fastpersist;

static bool matches(const CrcJob& job, const std::vector<uintptr_t>& addresses, const std::vector<size_t>& lengths) {
  for (size_t i = 0; i < addresses.size(); ++i) {
    if (job.crc(i) != crc32_update(0, reinterpret_cast<const void*>(addresses[i]), lengths[i])) return false;
  }
  return true;
}

int main() {
  std::vector<unsigned char> data(3 << 20);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 2654435761u >> 13);
  const uintptr_t base = reinterpret_cast<uintptr_t>(data.data());
  std::vector<uintptr_t> addresses;
  std::vector<size_t> lengths;
  for (size_t offset = 0, n = 1; offset + n <= data.size(); offset += n, n = n * 3 + 1) {  // 1 byte to ~1.6 MB
    addresses.push_back(base + offset);
    lengths.push_back(n);
  }
  addresses.push_back(base);
  lengths.push_back(0);  // an empty range: CRC 0

  {
    CrcPool pool(4);
    EXPECT(pool.threads() == 4);
    auto job = pool.submit(addresses, lengths);
    job->wait();
    EXPECT(job->done() && job->size() == addresses.size());
    EXPECT(matches(*job, addresses, lengths));
    EXPECT(job->crc(addresses.size() - 1) == 0);
    EXPECT(pool.submit({}, {})->done());  // nothing to do: done at once

    // Several threads submitting and waiting at once, each its own jobs.
    bool ok[4] = {false, false, false, false};
    std::vector<std::thread> submitters;
    for (int t = 0; t < 4; ++t) {
      submitters.emplace_back([&, t] {
        bool good = true;
        for (int round = 0; round < 50; ++round) {
          auto mine = pool.submit(addresses, lengths);
          mine->wait();
          good = good && matches(*mine, addresses, lengths);
        }
        ok[t] = good;
      });
    }
    for (auto& s : submitters) s.join();
    EXPECT(ok[0] && ok[1] && ok[2] && ok[3]);

    bool refused = false;
    try {
      pool.submit(addresses, {1});
    } catch (const std::invalid_argument&) {
      refused = true;
    }
    EXPECT(refused);

    // Shutdown runs what is queued before the threads stop.
    std::vector<std::shared_ptr<CrcJob>> queued;
    for (int i = 0; i < 20; ++i) queued.push_back(pool.submit(addresses, lengths));
    pool.shutdown();
    EXPECT(pool.threads() == 0);
    for (auto& q : queued) EXPECT(q->done() && matches(*q, addresses, lengths));
    auto after = pool.submit(addresses, lengths);  // computed on this thread
    EXPECT(after->done() && matches(*after, addresses, lengths));
    pool.shutdown();  // idempotent
  }

  {
    // Copies, their page tables filled first or not, with their CRC-32s or not, on the threads and (after
    // shutdown) here.
    CrcPool pool(3);
    for (int after_shutdown = 0; after_shutdown < 2; ++after_shutdown) {
      if (after_shutdown) pool.shutdown();
      for (int variant = 0; variant < 4; ++variant) {
        const bool populate = variant & 1, checksum = variant & 2;
        std::vector<unsigned char> copy(data.size(), 0);
        std::vector<uintptr_t> destinations;
        for (uintptr_t address : addresses) destinations.push_back(reinterpret_cast<uintptr_t>(copy.data()) + (address - base));
        auto job = pool.submit_copies(destinations, addresses, lengths, populate, checksum);
        job->wait();
        bool same = job->done() && (checksum ? matches(*job, addresses, lengths) : job->crc(0) == 0);
        for (size_t i = 0; i < addresses.size(); ++i) {
          const size_t at = addresses[i] - base;
          same = same && std::equal(data.begin() + at, data.begin() + at + lengths[i], copy.begin() + at);
        }
        EXPECT(same);
      }
    }
    bool refused = false;
    try {
      pool.submit_copies({base}, addresses, lengths);
    } catch (const std::invalid_argument&) {
      refused = true;
    }
    EXPECT(refused);
  }

  {
    CrcPool none(0);  // no threads: every submission runs here
    auto job = none.submit(addresses, lengths);
    EXPECT(job->done() && matches(*job, addresses, lengths));
  }

  {
    // A child forked while the pool runs: it computes on its own thread and leaves the parent's threads alone.
    CrcPool pool(2);
    std::fflush(nullptr);
    const pid_t child = ::fork();
    if (child == 0) {
      auto job = pool.submit(addresses, lengths);
      const bool good = job->done() && matches(*job, addresses, lengths) && pool.threads() == 0;
      pool.shutdown();
      ::_exit(good ? 0 : 3);
    }
    int status = 0;
    EXPECT(child > 0 && ::waitpid(child, &status, 0) == child);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    auto job = pool.submit(addresses, lengths);  // the parent's pool still works
    job->wait();
    EXPECT(matches(*job, addresses, lengths));
  }

  std::printf("crc_pool_test: ok\n");
  return 0;
}

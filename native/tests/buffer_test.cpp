// Tests of the aligned, page-locked memory component (buffer.hpp) without Python: alignment, zero size,
// huge-page alignment, release:
//   g++ -std=c++17 -Inative/include -Inative/src native/src/*.cpp native/tests/buffer_test.cpp && ./a.out
#include <cstring>

#include "check.hpp"
#include "fastpersist/buffer.hpp"

using namespace fastpersist;

int main() {
  AlignedBuffer empty(0, false);
  EXPECT(empty.size() == 0 && empty.data() != nullptr);
  AlignedBuffer small(5000, false);
  EXPECT(small.size() == 5000 && small.address() % 4096 == 0 && !small.locked());
  std::memset(small.data(), 0x5A, small.size());  // writable end to end
  AlignedBuffer locked(1 << 16, true);  // locking may be refused (RLIMIT_MEMLOCK): then it says why
  EXPECT(locked.locked() || !locked.lock_error().empty());
  AlignedBuffer huge(4 << 20, false, true);
  EXPECT(huge.address() % (2 << 20) == 0);
  huge.release();
  huge.release();  // idempotent
  uint64_t soft = 0, hard = 0;
  memlock_limit(soft, hard);
  EXPECT(soft <= hard);
  std::printf("buffer: ok\n");
  return 0;
}

// The engines, handles and errors end to end, without Python or torch (the other *_test.cpp files test one
// component each):
//   g++ -std=c++17 -pthread -Inative/include -Inative/src -DFASTPERSIST_HAVE_IO_URING=1 \
//       native/src/*.cpp native/tests/core_smoke.cpp -o core_smoke && ./core_smoke DIR
// Exits 0 when every check passes; prints the first failure otherwise.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "check.hpp"
#include "fastpersist/buffer.hpp"
#include "fastpersist/engine.hpp"
#include "fastpersist/error.hpp"
#include "fastpersist/file.hpp"
#include "fastpersist/handle.hpp"

using namespace fastpersist;

static int round_trip(const std::string& dir, const std::string& engine, size_t size, uint64_t offset, size_t shift) {
  HandleOptions options;
  options.block_size = 64 << 10;
  options.queue_depth = 4;
  options.engine = engine;
  IoHandle handle(options);
  AlignedBuffer source(size + shift + 1, false), destination(size + shift + 1, false);
  auto* src = static_cast<unsigned char*>(source.data()) + shift;
  auto* dst = static_cast<unsigned char*>(destination.data()) + shift;
  for (size_t i = 0; i < size; ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  const std::string path = dir + "/smoke-" + engine + "-" + std::to_string(size);
  handle.submit_write(src, size, handle.open_for(path, true), offset, true, true);
  EXPECT(handle.wait() == 1);
  handle.submit_read(dst, size, handle.open_for(path, false), offset, true, false);
  EXPECT(handle.wait() == 1);
  EXPECT(std::memcmp(src, dst, size) == 0);
  return 0;
}

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : ".";
  for (const std::string& engine : engines_compiled()) {
    if (!probe_engine(engine).first) continue;
    for (size_t size : {size_t(0), size_t(1), size_t(4095), size_t(4097), size_t(3 * 65536 + 77)}) {
      for (uint64_t offset : {uint64_t(0), uint64_t(4096), uint64_t(333)}) {
        for (size_t shift : {size_t(0), size_t(1)}) {
          if (round_trip(dir, engine, size, offset, shift) != 0) return 1;
        }
      }
    }
  }
  // Errors carry errno, operation and path.
  try {
    File missing(dir + "/no/such/file", OpenMode::kRead);
    EXPECT(false);
  } catch (const IoError& e) {
    EXPECT(e.error_number() == ENOENT);
    EXPECT(e.path() == dir + "/no/such/file");
    EXPECT(e.operation() == "open for reading");
    EXPECT(!e.where().empty());
  }
  // Injected EIO surfaces from wait(); nothing stays pending.
  HandleOptions options;
  options.block_size = 4096;
  options.fault.enabled = true;
  options.fault.nth = 2;
  IoHandle faulty(options);
  AlignedBuffer buffer(5 * 4096, false);
  faulty.submit_write(buffer.data(), buffer.size(), faulty.open_for(dir + "/smoke-eio", true), 0, true, false);
  try {
    faulty.wait();
    EXPECT(false);
  } catch (const IoError& e) {
    EXPECT(e.error_number() == EIO);
  }
  EXPECT(faulty.pending() == 0);
  std::printf("core smoke: ok\n");
  return 0;
}

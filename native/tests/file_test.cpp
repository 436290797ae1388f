// Tests of the file component (file.hpp) and its errors (error.hpp) without Python: direct and buffered
// descriptors, sizes, allocation, the refused create, and an IoError that carries errno, operation and path:
//   g++ -std=c++17 -Inative/include -Inative/src native/src/*.cpp native/tests/file_test.cpp && ./a.out DIR
#include <cerrno>
#include <string>

#include "check.hpp"
#include "fastpersist/error.hpp"
#include "fastpersist/file.hpp"

using namespace fastpersist;

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : ".";
  const std::string path = dir + "/file-test.bin";
  {
    File file(path, OpenMode::kWrite, true, true, true);
    EXPECT(!file.closed() && file.size() == 0);
    EXPECT(file.direct() || !file.fallback_reason().empty());  // tmpfs refuses O_DIRECT, and says why
    EXPECT(!file.direct() || (file.alignment() >= 512 && file.alignment() % 512 == 0));
    file.truncate(12345);
    EXPECT(file.size() == 12345);
    if (file.allocate(0, 1 << 20)) EXPECT(file.size() == (1u << 20));
    file.fsync();
    file.close();
    file.close();  // idempotent
    EXPECT(file.closed());
  }
  try {
    File missing(path + ".missing", OpenMode::kReadWrite, true, false, false);  // create=false: must exist
    EXPECT(false);
  } catch (const IoError& e) {
    EXPECT(e.error_number() == ENOENT && e.path() == path + ".missing" && !e.where().empty());
  }
  try {
    FP_CHECK(-1 + 0 * (errno = EIO), "test operation", "some/path");
    EXPECT(false);
  } catch (const IoError& e) {
    EXPECT(e.error_number() == EIO && e.operation() == "test operation" && e.path() == "some/path");
    EXPECT(std::string(e.what()).find("some/path") != std::string::npos);
  }
  std::printf("file: ok\n");
  return 0;
}

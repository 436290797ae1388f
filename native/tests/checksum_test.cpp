// Tests of the CRC-32 component (checksum.hpp) without Python: known values, every length around the
// folding's 64- and 128-byte steps by each method the CPU has against a bitwise reference, the fused
// copy, combination of pieces:
//   g++ -std=c++17 -Inative/include -Inative/src native/src/*.cpp native/tests/checksum_test.cpp && ./a.out
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.hpp"
#include "fastpersist/checksum.hpp"

using namespace fastpersist;

// Bitwise reference: the definition of the reflected CRC-32 (zlib's), one bit at a time.
static uint32_t reference(const unsigned char* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
  }
  return ~c;
}

int main() {
  EXPECT(crc32_update(0, "", 0) == 0);
  EXPECT(crc32_update(0, "123456789", 9) == 0xCBF43926u);  // the standard check value
  std::vector<unsigned char> data(5000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 2654435761u >> 13);
  for (size_t n : {size_t(1), size_t(15), size_t(16), size_t(63), size_t(64), size_t(65), size_t(127), size_t(128),
                   size_t(129), size_t(1000), size_t(4999), size_t(5000)}) {
    for (size_t shift : {size_t(0), size_t(1), size_t(7)}) {
      if (shift + n > data.size()) continue;
      const uint32_t want = reference(data.data() + shift, n);
      EXPECT(crc32_update(0, data.data() + shift, n) == want);
      std::vector<unsigned char> copy(n + 1, 0xAB);
      EXPECT(copy_with_crc32(copy.data(), data.data() + shift, n, 0) == want);
      EXPECT(std::memcmp(copy.data(), data.data() + shift, n) == 0 && copy[n] == 0xAB);
      for (size_t cut : {size_t(0), n / 3, n}) {  // continuing and combining give the whole range's CRC
        const uint32_t first = crc32_update(0, data.data() + shift, cut);
        EXPECT(crc32_update(first, data.data() + shift + cut, n - cut) == want);
        EXPECT(crc32_combine(first, crc32_update(0, data.data() + shift + cut, n - cut), n - cut) == want);
      }
    }
  }
  for (const std::string& method : crc32_methods()) {  // each method, not only the fastest
    for (size_t n = 0; n <= 1100; ++n) {
      for (size_t shift : {size_t(0), size_t(3)}) {
        const uint32_t want = reference(data.data() + shift, n);
        EXPECT(crc32_update_with(method, 0, data.data() + shift, n) == want);
        std::vector<unsigned char> copy(n + 1, 0xAB);
        EXPECT(crc32_update_with(method, 0, data.data() + shift, n, copy.data()) == want);
        EXPECT(std::memcmp(copy.data(), data.data() + shift, n) == 0 && copy[n] == 0xAB);
      }
    }
    const uint32_t first = crc32_update_with(method, 0, data.data(), 777);
    EXPECT(crc32_update_with(method, first, data.data() + 777, 4000) == reference(data.data(), 4777));
  }
  bool refused = false;
  try {
    crc32_update_with("no-such-method", 0, data.data(), 1);
  } catch (const std::invalid_argument&) {
    refused = true;
  }
  EXPECT(refused);
  std::printf("checksum: ok (%s)\n", crc32_method().c_str());
  return 0;
}

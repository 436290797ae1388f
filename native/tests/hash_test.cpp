// Tests of the XXH64 component (hash.hpp) without Python: the reference implementation's values, seeds,
// every tail length, and that any one-bit change moves the hash:
//   g++ -std=c++17 -Inative/include -Inative/src native/src/*.cpp native/tests/hash_test.cpp && ./a.out
#include <vector>

#include "check.hpp"
#include "fastpersist/hash.hpp"

using namespace fastpersist;

int main() {
  EXPECT(xxh64("", 0, 0) == 0xEF46DB3751D8E999ULL);  // xxhash's published values
  EXPECT(xxh64("abc", 3, 0) == 0x44BC2CF5AD770999ULL);
  EXPECT(xxh64("", 0, 1) != xxh64("", 0, 0));
  std::vector<unsigned char> data(200);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 131 + 7);
  for (size_t n = 0; n <= data.size(); ++n) {  // every stripe/tail split: 32-byte stripes, 8/4/1-byte tails
    const uint64_t base = xxh64(data.data(), n, 0);
    EXPECT(n == 0 || base != xxh64(data.data(), n - 1, 0));
    for (size_t bit = 0; bit < n * 8; bit += 13) {
      data[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
      const uint64_t changed = xxh64(data.data(), n, 0);
      data[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
      EXPECT(changed != base);
    }
  }
  std::printf("hash: ok\n");
  return 0;
}

/**
 * @file checksum.cpp
 * @brief CRC-32 by carry-less multiplication folding, with a table fallback.
 *
 * The folding keeps four 128-bit accumulators, each step multiplying them by
 * x^(512±32) mod P and adding the next 64 bytes of input; then folds to one
 * accumulator, to 64 bits, to 32 bits, and finishes with a Barrett
 * reduction. The constants are those of the reflected polynomial 0xEDB88320
 * (Linux arch/x86/crypto/crc32-pclmul_asm.S). The fused copy stores each
 * 16-byte block it has just loaded, so the source is read once.
 */

#include "fastpersist/checksum.hpp"

#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FASTPERSIST_HAVE_PCLMUL 1
#else
#define FASTPERSIST_HAVE_PCLMUL 0
#endif

namespace fastpersist {
namespace {

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};

const Tables& tables() {
  static const Tables instance;
  return instance;
}

/// Raw (not inverted) CRC update, slice-by-8.
uint32_t crc_table(uint32_t c, const unsigned char* p, size_t n) {
  const Tables& T = tables();
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = T.t[7][lo & 0xFF] ^ T.t[6][(lo >> 8) & 0xFF] ^ T.t[5][(lo >> 16) & 0xFF] ^ T.t[4][lo >> 24] ^
        T.t[3][hi & 0xFF] ^ T.t[2][(hi >> 8) & 0xFF] ^ T.t[1][(hi >> 16) & 0xFF] ^ T.t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = T.t[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
  return c;
}

#if FASTPERSIST_HAVE_PCLMUL

__attribute__((target("pclmul,sse4.1"))) inline __m128i fold(__m128i x, __m128i k) {
  return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

/// Raw CRC of n bytes (n >= 64, a multiple of 16); copies them to dst when dst != nullptr.
__attribute__((target("pclmul,sse4.1"))) uint32_t crc_pclmul(uint32_t c, const unsigned char* p, size_t n,
                                                              unsigned char* dst) {
  const __m128i r2r1 = _mm_set_epi64x(0x00000001c6e41596LL, 0x0000000154442bd4LL);
  const __m128i r4r3 = _mm_set_epi64x(0x00000000ccaa009eLL, 0x00000001751997d0LL);
  const __m128i r5 = _mm_set_epi64x(0, 0x0000000163cd6124LL);
  const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
  const __m128i poly = _mm_set_epi64x(0x00000001F7011641LL, 0x00000001DB710641LL);

  auto load = [&](size_t at) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + at));
    if (dst) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + at), v);
    return v;
  };
  __m128i x1 = _mm_xor_si128(load(0), _mm_cvtsi32_si128(static_cast<int>(c)));
  __m128i x2 = load(16), x3 = load(32), x4 = load(48);
  size_t at = 64;
  for (; n - at >= 64; at += 64) {
    x1 = _mm_xor_si128(fold(x1, r2r1), load(at));
    x2 = _mm_xor_si128(fold(x2, r2r1), load(at + 16));
    x3 = _mm_xor_si128(fold(x3, r2r1), load(at + 32));
    x4 = _mm_xor_si128(fold(x4, r2r1), load(at + 48));
  }
  x1 = _mm_xor_si128(fold(x1, r4r3), x2);
  x1 = _mm_xor_si128(fold(x1, r4r3), x3);
  x1 = _mm_xor_si128(fold(x1, r4r3), x4);
  for (; n - at >= 16; at += 16) x1 = _mm_xor_si128(fold(x1, r4r3), load(at));
  // 128 -> 64 bits (also appends 32 zero bits): R4 * low half, plus the high half.
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(r4r3, x1, 0x01), _mm_srli_si128(x1, 8));
  // 64 -> 32 bits.
  __m128i x2b = _mm_srli_si128(x1, 4);
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), r5, 0x00), x2b);
  // Barrett reduction.
  __m128i keep = x1;
  x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly, 0x10);
  x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly, 0x00);
  x1 = _mm_xor_si128(x1, keep);
  return static_cast<uint32_t>(_mm_extract_epi32(x1, 1));
}

bool detect() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
}

#endif

uint32_t crc_raw(uint32_t c, const unsigned char* p, size_t n, unsigned char* dst) {
#if FASTPERSIST_HAVE_PCLMUL
  static const bool accelerated = detect();
  if (accelerated && n >= 64) {
    const size_t body = n & ~static_cast<size_t>(15);
    c = crc_pclmul(c, p, body, dst);
    p += body;
    if (dst) dst += body;
    n -= body;
  }
#endif
  if (dst && n) std::memcpy(dst, p, n);
  return crc_table(c, p, n);
}

}  // namespace

uint32_t crc32_update(uint32_t crc, const void* data, size_t length) noexcept {
  return ~crc_raw(~crc, static_cast<const unsigned char*>(data), length, nullptr);
}

uint32_t copy_with_crc32(void* destination, const void* source, size_t length, uint32_t crc) noexcept {
  return ~crc_raw(~crc, static_cast<const unsigned char*>(source), length, static_cast<unsigned char*>(destination));
}

namespace {

/// Product of two polynomials modulo the CRC polynomial (reflected), as in zlib's multmodp.
uint32_t multiply_modulo(uint32_t a, uint32_t b) noexcept {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ 0xEDB88320u : b >> 1;
  }
  return p;
}

/// x^(2^k) modulo the polynomial, for k = 0..31 (zlib's x2n_table).
struct PowerTable {
  uint32_t t[32];
  PowerTable() {
    uint32_t p = 1u << 30;  // x^1
    t[0] = p;
    for (int k = 1; k < 32; ++k) t[k] = p = multiply_modulo(p, p);
  }
};

/// x^(8 * n) modulo the polynomial: appending n zero bytes.
uint32_t x_to_bytes(uint64_t n) noexcept {
  static const PowerTable table;
  uint32_t p = 1u << 31;  // x^0
  int k = 3;              // 8 * n: start at x^(2^3)
  while (n) {
    if (n & 1) p = multiply_modulo(table.t[k & 31], p);
    n >>= 1;
    ++k;
  }
  return p;
}

}  // namespace

uint32_t crc32_combine(uint32_t crc_first, uint32_t crc_second, uint64_t length_second) noexcept {
  return multiply_modulo(x_to_bytes(length_second), crc_first) ^ crc_second;
}

bool crc32_accelerated() noexcept {
#if FASTPERSIST_HAVE_PCLMUL
  static const bool accelerated = detect();
  return accelerated;
#else
  return false;
#endif
}

}  // namespace fastpersist

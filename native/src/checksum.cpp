/**
 * @file checksum.cpp
 * @brief CRC-32 by carry-less multiplication folding, with a table fallback.
 *
 * The folding keeps four 128-bit accumulators, each step multiplying them by
 * x^(512±32) mod P and adding the next 64 bytes of input; then folds to one
 * accumulator, to 64 bits, to 32 bits, and finishes with a Barrett
 * reduction. The constants are those of the reflected polynomial 0xEDB88320
 * (Linux arch/x86/crypto/crc32-pclmul_asm.S). CPUs with VPCLMULQDQ and AVX2
 * keep eight 128-bit accumulators in four 256-bit registers instead and fold
 * 128 bytes a step (x^(1024±32) mod P), then fold the eight into one and go on
 * as above. That doubles one thread's rate where the arithmetic is the limit
 * (data in the caches: 9.3 -> 19-20 GB/s on the dev VM's EPYC); where memory
 * is, it gains less (docs/performance.md, "Verified loads at memory speed").
 * tools/crc32_constants.py derives every constant. The fused copy stores each
 * block it has just loaded, so the source is read once.
 */

#include "fastpersist/checksum.hpp"

#include <cstring>
#include <stdexcept>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FASTPERSIST_HAVE_PCLMUL 1
#else
#define FASTPERSIST_HAVE_PCLMUL 0
#endif
// 256-bit carry-less multiplication needs a compiler that knows VPCLMULQDQ (GCC 8, clang 6).
#if FASTPERSIST_HAVE_PCLMUL && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 8))
#define FASTPERSIST_HAVE_VPCLMUL 1
#else
#define FASTPERSIST_HAVE_VPCLMUL 0
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

#define FP_PCLMUL __attribute__((target("pclmul,sse4.1")))
#define FP_VPCLMUL __attribute__((target("vpclmulqdq,avx2,pclmul,sse4.1")))

// Folding constants: for a fold over D bits, the low half multiplies by x^(D+32) and the high half by
// x^(D-32), each mod P, bit-reflected and shifted (how tools/crc32_constants.py derives them).
constexpr long long kFold128Lo = 0x00000001751997d0LL, kFold128Hi = 0x00000000ccaa009eLL;    // D = 128
constexpr long long kFold512Lo = 0x0000000154442bd4LL, kFold512Hi = 0x00000001c6e41596LL;    // D = 512
constexpr long long kFold1024Lo = 0x00000001e88ef372LL, kFold1024Hi = 0x000000014a7fe880LL;  // D = 1024

FP_PCLMUL inline __m128i fold(__m128i x, __m128i k) {
  return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

FP_PCLMUL inline __m128i load16(const unsigned char* p, unsigned char* dst, size_t at) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + at));
  if (dst) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + at), v);
  return v;
}

/// Folds the 16-byte blocks of [at, n) into x (n - at a multiple of 16), then reduces x to the raw CRC.
FP_PCLMUL uint32_t finish(__m128i x1, const unsigned char* p, size_t at, size_t n, unsigned char* dst) {
  const __m128i r4r3 = _mm_set_epi64x(kFold128Hi, kFold128Lo);
  const __m128i r5 = _mm_set_epi64x(0, 0x0000000163cd6124LL);
  const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
  const __m128i poly = _mm_set_epi64x(0x00000001F7011641LL, 0x00000001DB710641LL);
  for (; n - at >= 16; at += 16) x1 = _mm_xor_si128(fold(x1, r4r3), load16(p, dst, at));
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

/// Raw CRC of n bytes (n >= 64, a multiple of 16), four 128-bit lanes; copies them to dst when dst != nullptr.
FP_PCLMUL uint32_t crc_pclmul(uint32_t c, const unsigned char* p, size_t n, unsigned char* dst) {
  const __m128i r2r1 = _mm_set_epi64x(kFold512Hi, kFold512Lo);
  const __m128i r4r3 = _mm_set_epi64x(kFold128Hi, kFold128Lo);
  __m128i x1 = _mm_xor_si128(load16(p, dst, 0), _mm_cvtsi32_si128(static_cast<int>(c)));
  __m128i x2 = load16(p, dst, 16), x3 = load16(p, dst, 32), x4 = load16(p, dst, 48);
  size_t at = 64;
  for (; n - at >= 64; at += 64) {
    x1 = _mm_xor_si128(fold(x1, r2r1), load16(p, dst, at));
    x2 = _mm_xor_si128(fold(x2, r2r1), load16(p, dst, at + 16));
    x3 = _mm_xor_si128(fold(x3, r2r1), load16(p, dst, at + 32));
    x4 = _mm_xor_si128(fold(x4, r2r1), load16(p, dst, at + 48));
  }
  x1 = _mm_xor_si128(fold(x1, r4r3), x2);
  x1 = _mm_xor_si128(fold(x1, r4r3), x3);
  x1 = _mm_xor_si128(fold(x1, r4r3), x4);
  return finish(x1, p, at, n, dst);
}

#if FASTPERSIST_HAVE_VPCLMUL

FP_VPCLMUL inline __m256i fold256(__m256i x, __m256i k) {
  return _mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00), _mm256_clmulepi64_epi128(x, k, 0x11));
}

FP_VPCLMUL inline __m256i load32(const unsigned char* p, unsigned char* dst, size_t at) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + at));
  if (dst) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + at), v);
  return v;
}

/// Raw CRC of n bytes (n >= 128, a multiple of 16) with 256-bit carry-less multiplication: eight 128-bit
/// lanes in four registers fold 128 bytes a step (twice the four lanes of crc_pclmul, two per instruction).
FP_VPCLMUL uint32_t crc_vpclmul(uint32_t c, const unsigned char* p, size_t n, unsigned char* dst) {
  const __m256i k = _mm256_set_epi64x(kFold1024Hi, kFold1024Lo, kFold1024Hi, kFold1024Lo);
  const __m128i r4r3 = _mm_set_epi64x(kFold128Hi, kFold128Lo);
  const __m256i seed = _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_cvtsi32_si128(static_cast<int>(c)), 0);
  __m256i y0 = _mm256_xor_si256(load32(p, dst, 0), seed);
  __m256i y1 = load32(p, dst, 32), y2 = load32(p, dst, 64), y3 = load32(p, dst, 96);
  size_t at = 128;
  for (; n - at >= 128; at += 128) {
    y0 = _mm256_xor_si256(fold256(y0, k), load32(p, dst, at));
    y1 = _mm256_xor_si256(fold256(y1, k), load32(p, dst, at + 32));
    y2 = _mm256_xor_si256(fold256(y2, k), load32(p, dst, at + 64));
    y3 = _mm256_xor_si256(fold256(y3, k), load32(p, dst, at + 96));
  }
  // The eight lanes, in byte order, folded into one 128 bits at a time.
  const __m128i lanes[8] = {_mm256_castsi256_si128(y0), _mm256_extracti128_si256(y0, 1),
                            _mm256_castsi256_si128(y1), _mm256_extracti128_si256(y1, 1),
                            _mm256_castsi256_si128(y2), _mm256_extracti128_si256(y2, 1),
                            _mm256_castsi256_si128(y3), _mm256_extracti128_si256(y3, 1)};
  __m128i x1 = lanes[0];
  for (int i = 1; i < 8; ++i) x1 = _mm_xor_si128(fold(x1, r4r3), lanes[i]);
  return finish(x1, p, at, n, dst);
}

#endif

bool detect_pclmul() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
}

bool detect_vpclmul() {
#if FASTPERSIST_HAVE_VPCLMUL
  __builtin_cpu_init();
  return detect_pclmul() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq");
#else
  return false;
#endif
}

#endif

enum class Method { table, pclmul, vpclmul };

/// The fastest method this CPU has (decided once).
Method best_method() {
#if FASTPERSIST_HAVE_PCLMUL
  static const Method best = detect_vpclmul() ? Method::vpclmul : detect_pclmul() ? Method::pclmul : Method::table;
  return best;
#else
  return Method::table;
#endif
}

const char* method_name(Method m) {
  switch (m) {
    case Method::vpclmul:
      return "vpclmul";
    case Method::pclmul:
      return "pclmul";
    default:
      return "table";
  }
}

uint32_t crc_raw_with(Method method, uint32_t c, const unsigned char* p, size_t n, unsigned char* dst) {
#if FASTPERSIST_HAVE_PCLMUL
  // The folding covers the 16-byte blocks; the table finishes the last few bytes.
  uint32_t (*folding)(uint32_t, const unsigned char*, size_t, unsigned char*) = nullptr;
#if FASTPERSIST_HAVE_VPCLMUL
  if (method == Method::vpclmul && n >= 256) folding = crc_vpclmul;
#endif
  if (folding == nullptr && method != Method::table && n >= 64) folding = crc_pclmul;
  if (folding != nullptr) {
    const size_t body = n & ~static_cast<size_t>(15);
    c = folding(c, p, body, dst);
    p += body;
    if (dst) dst += body;
    n -= body;
  }
#else
  (void)method;
#endif
  if (dst && n) std::memcpy(dst, p, n);
  return crc_table(c, p, n);
}

uint32_t crc_raw(uint32_t c, const unsigned char* p, size_t n, unsigned char* dst) {
  return crc_raw_with(best_method(), c, p, n, dst);
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

bool crc32_accelerated() noexcept { return best_method() != Method::table; }

std::vector<std::string> crc32_methods() {
  std::vector<std::string> names{"table"};
  const Method best = best_method();
  if (best != Method::table) names.push_back("pclmul");
  if (best == Method::vpclmul) names.push_back("vpclmul");
  return names;
}

std::string crc32_method() { return method_name(best_method()); }

uint32_t crc32_update_with(const std::string& method, uint32_t crc, const void* data, size_t length,
                           void* copy_to) {
  const std::vector<std::string> names = crc32_methods();
  size_t index = 0;
  while (index < names.size() && names[index] != method) ++index;
  if (index == names.size()) {
    throw std::invalid_argument("CRC-32 method '" + method + "' is not available on this CPU (available: " +
                                method_name(best_method()) + " and slower ones)");
  }
  return ~crc_raw_with(static_cast<Method>(index), ~crc, static_cast<const unsigned char*>(data), length,
                       static_cast<unsigned char*>(copy_to));
}

}  // namespace fastpersist

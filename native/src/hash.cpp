/**
 * @file hash.cpp
 * @brief XXH64 written from its specification (xxhash's doc/xxhash_spec.md): four 64-bit lanes
 *        over 32-byte stripes, a merge, the tail in 8-, 4- and 1-byte steps, then the avalanche.
 */

#include "fastpersist/hash.hpp"

#include <cstring>

namespace fastpersist {
namespace {

constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kPrime3 = 0x165667B19E3779F9ULL;
constexpr uint64_t kPrime4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t kPrime5 = 0x27D4EB2F165667C5ULL;

inline uint64_t rotate_left(uint64_t value, int bits) { return (value << bits) | (value >> (64 - bits)); }

// Little-endian loads; memcpy keeps unaligned addresses legal (the compiler emits one move).
inline uint64_t load64(const unsigned char* p) {
  uint64_t value;
  std::memcpy(&value, p, sizeof value);
  return value;
}

inline uint32_t load32(const unsigned char* p) {
  uint32_t value;
  std::memcpy(&value, p, sizeof value);
  return value;
}

inline uint64_t round(uint64_t accumulator, uint64_t input) {
  accumulator += input * kPrime2;
  return rotate_left(accumulator, 31) * kPrime1;
}

inline uint64_t merge_round(uint64_t accumulator, uint64_t lane) {
  accumulator ^= round(0, lane);
  return accumulator * kPrime1 + kPrime4;
}

}  // namespace

uint64_t xxh64(const void* data, size_t length, uint64_t seed) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* const end = p + length;
  uint64_t hash;
  if (length >= 32) {
    uint64_t v1 = seed + kPrime1 + kPrime2, v2 = seed + kPrime2, v3 = seed, v4 = seed - kPrime1;
    const unsigned char* const last_stripe = end - 32;
    do {
      v1 = round(v1, load64(p));
      v2 = round(v2, load64(p + 8));
      v3 = round(v3, load64(p + 16));
      v4 = round(v4, load64(p + 24));
      p += 32;
    } while (p <= last_stripe);
    hash = rotate_left(v1, 1) + rotate_left(v2, 7) + rotate_left(v3, 12) + rotate_left(v4, 18);
    hash = merge_round(hash, v1);
    hash = merge_round(hash, v2);
    hash = merge_round(hash, v3);
    hash = merge_round(hash, v4);
  } else {
    hash = seed + kPrime5;
  }
  hash += static_cast<uint64_t>(length);
  while (end - p >= 8) {
    hash ^= round(0, load64(p));
    hash = rotate_left(hash, 27) * kPrime1 + kPrime4;
    p += 8;
  }
  if (end - p >= 4) {
    hash ^= static_cast<uint64_t>(load32(p)) * kPrime1;
    hash = rotate_left(hash, 23) * kPrime2 + kPrime3;
    p += 4;
  }
  while (p < end) {
    hash ^= static_cast<uint64_t>(*p) * kPrime5;
    hash = rotate_left(hash, 11) * kPrime1;
    ++p;
  }
  hash ^= hash >> 33;
  hash *= kPrime2;
  hash ^= hash >> 29;
  hash *= kPrime3;
  hash ^= hash >> 32;
  return hash;
}

}  // namespace fastpersist

#pragma once
/**
 * @file hash.hpp
 * @brief XXH64, a fast 64-bit non-cryptographic hash (Yann Collet's algorithm, from its specification).
 *
 * Used to tell whether the ranks of a data-parallel save hold byte-identical
 * copies of a storage before any of them writes it: 64 bits make an
 * accidental match of different bytes practically impossible (a CRC-32's
 * 2^-32 per comparison is not, over millions of saves), and four independent
 * lanes run at memory speed on one core. Results equal the reference
 * implementation's XXH64(data, length, seed).
 */

#include <cstddef>
#include <cstdint>

namespace fastpersist {

/**
 * @brief XXH64 of @p length bytes at @p data.
 * @param seed the hash's seed (0 in the reference test vectors).
 * @return the 64-bit hash, as the reference XXH64() returns it.
 */
uint64_t xxh64(const void* data, size_t length, uint64_t seed) noexcept;

}  // namespace fastpersist

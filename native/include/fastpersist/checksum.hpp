#pragma once
/**
 * @file checksum.hpp
 * @brief CRC-32 (the zip / zlib polynomial) at memory speed, optionally fused with a copy.
 *
 * x86-64 CPUs with PCLMULQDQ fold 64 bytes per step with carry-less
 * multiplication (the method of Intel's "Fast CRC Computation Using PCLMULQDQ"
 * white paper, constants as in the Linux kernel's crc32-pclmul); those with
 * VPCLMULQDQ and AVX2 fold 128 bytes per step in 256-bit registers; elsewhere
 * a slice-by-8 table is used. The fastest method the CPU has is chosen once.
 * Results equal zlib's crc32().
 */

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fastpersist {

/**
 * @brief Continues a CRC-32 over @p length bytes at @p data.
 * @param crc the CRC of the bytes before (0 to start), as zlib's crc32(crc, ...).
 * @return the CRC of everything so far.
 */
uint32_t crc32_update(uint32_t crc, const void* data, size_t length) noexcept;

/**
 * @brief Copies @p length bytes from @p source to @p destination (which must not
 *        overlap) and returns the CRC-32 of those bytes continued from @p crc,
 *        reading the source once.
 */
uint32_t copy_with_crc32(void* destination, const void* source, size_t length, uint32_t crc) noexcept;

/**
 * @brief The CRC-32 of two byte ranges one after the other, from the CRC-32 of each
 *        (zlib's crc32_combine): lets several threads checksum pieces of one record.
 * @param crc_first CRC-32 of the first range (or of everything before the second).
 * @param crc_second CRC-32 of the second range, computed from 0.
 * @param length_second bytes in the second range.
 * @return CRC-32 of the concatenation.
 */
uint32_t crc32_combine(uint32_t crc_first, uint32_t crc_second, uint64_t length_second) noexcept;

/** @brief Whether a carry-less-multiplication method is in use on this CPU. */
bool crc32_accelerated() noexcept;

/** @brief The method in use: "vpclmul", "pclmul" or "table". */
std::string crc32_method();

/** @brief Every method this CPU can run, slowest first ("table" always). */
std::vector<std::string> crc32_methods();

/**
 * @brief crc32_update (or, with @p copy_to, copy_with_crc32) by the named method, for tests and
 *        benchmarks that compare the methods on one machine.
 * @throws std::invalid_argument when this CPU cannot run @p method.
 */
uint32_t crc32_update_with(const std::string& method, uint32_t crc, const void* data, size_t length,
                           void* copy_to = nullptr);

}  // namespace fastpersist

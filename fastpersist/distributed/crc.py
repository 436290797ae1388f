"""CRC-32 (zlib's polynomial) of a concatenation from the CRC-32s of its pieces.

``crc32_combine(crc_a, crc_b, len_b)`` is zlib's ``crc32_combine``: the CRC-32
of ``a + b`` given ``crc32(a)``, ``crc32(b)`` and ``len(b)``, in O(log len_b)
32x32 GF(2) matrix steps. Lets each rank checksum only its slice of a record
that spans a rank boundary, and the committing rank combine the slices.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["crc32_combine", "crc32_combine_all"]

_POLY = 0xEDB88320


def _times(matrix: list[int], vector: int) -> int:
    total = 0
    index = 0
    while vector:
        if vector & 1:
            total ^= matrix[index]
        vector >>= 1
        index += 1
    return total


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, matrix[n]) for n in range(32)]


def crc32_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)``."""
    if length_b < 0:
        raise ValueError("length_b must be >= 0")
    if length_b == 0:
        return crc_a
    odd = [_POLY] + [1 << n for n in range(31)]  # the operator for one zero bit
    even = _square(odd)  # two zero bits
    odd = _square(even)  # four zero bits
    crc = crc_a
    while True:
        even = _square(odd)  # first pass: one zero byte
        if length_b & 1:
            crc = _times(even, crc)
        length_b >>= 1
        if not length_b:
            break
        odd = _square(even)
        if length_b & 1:
            crc = _times(odd, crc)
        length_b >>= 1
        if not length_b:
            break
    return crc ^ crc_b


def crc32_combine_all(pieces: Iterable[tuple[int, int]]) -> int:
    """CRC-32 of the concatenation of pieces given as ``(crc32(piece), len(piece))`` in order."""
    crc = 0
    for piece_crc, length in pieces:
        crc = crc32_combine(crc, piece_crc, length)
    return crc

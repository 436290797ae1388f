"""Derives the folding constants of native/src/checksum.cpp (CRC-32, reflected polynomial 0xEDB88320).

For a fold over D bits the low 64-bit half of an accumulator is multiplied by x^(D+32) mod P and the
high half by x^(D-32) mod P, each bit-reflected as a 64-bit value and shifted left by one (the form of
the Linux kernel's crc32-pclmul_asm.S). Prints the constants for the 128-bit fold (one accumulator),
the 512-bit fold (four 128-bit lanes) and the 1024-bit fold (eight lanes in four 256-bit registers),
and checks the first two against the kernel's published values. Run: ``python tools/crc32_constants.py``.
"""

from __future__ import annotations

POLYNOMIAL = 0x104C11DB7  # x^32 + ... + 1, not reflected
KERNEL = {  # arch/x86/crypto/crc32-pclmul_asm.S
    (128, "lo"): 0x1751997D0,
    (128, "hi"): 0x0CCAA009E,
    (512, "lo"): 0x154442BD4,
    (512, "hi"): 0x1C6E41596,
}


def x_power_mod(exponent: int) -> int:
    """x^exponent mod P, not reflected."""
    value = 1
    for _ in range(exponent):
        value <<= 1
        if value & (1 << 32):
            value ^= POLYNOMIAL
    return value


def reflect(value: int, bits: int) -> int:
    return int(format(value, f"0{bits}b")[::-1], 2)


def fold_constant(exponent: int) -> int:
    return reflect(x_power_mod(exponent) << 32, 64) << 1


def constants(distance: int) -> dict[str, int]:
    """The (lo, hi) multipliers that fold an accumulator ``distance`` bits forward."""
    return {"lo": fold_constant(distance + 32), "hi": fold_constant(distance - 32)}


def main() -> None:
    for distance in (128, 512, 1024):
        pair = constants(distance)
        for half, value in pair.items():
            known = KERNEL.get((distance, half))
            if known is not None and known != value:
                raise SystemExit(f"fold {distance} {half}: derived {value:#x}, the kernel's {known:#x}")
            print(f"fold {distance:4d} bits, {half}: {value:#011x}" + (" (= the kernel's)" if known else ""))
    print(f"x^64 (64 -> 32 bits): {fold_constant(64):#011x}")


if __name__ == "__main__":
    main()

"""Float formats numpy lacks (bf16, fp8 e4m3) as bit patterns, and the error bound of one rounding, for the
compatibility and accuracy tests. numpy only: importable in spawned workers without torch."""

import numpy as np

# Mantissa bits (without the hidden bit) and the smallest normal exponent of each output format.
_FORMATS = {"bf16": (7, -126), "fp16": (10, -14), "fp32": (23, -126)}


def bf16_bits(a):
    """fp32 values -> bf16 bits (uint16), round to nearest even (finite inputs)."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits):
    """bf16 bits (uint16) -> fp32 values (exact)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def _fp8_e4m3_table():
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    value = sign * value
    value[(codes & 0x7F) == 0x7F] = np.nan  # e4m3fn: only S.1111.111 is NaN, no infinities
    return value.astype(np.float32)


FP8_E4M3 = _fp8_e4m3_table()


def fp8_value(bits):
    """fp8 e4m3fn bits (uint8) -> fp32 values (exact)."""
    return FP8_E4M3[np.asarray(bits, np.uint8)]


def to_format(values, fmt):
    """fp32 values rounded to `fmt` ("bf16", "fp16", "fp32"), returned as fp32 (exact in fp32)."""
    v = np.asarray(values, np.float32)
    if fmt == "bf16":
        return bf16_value(bf16_bits(v))
    if fmt == "fp16":
        return v.astype(np.float16).astype(np.float32)
    return v


def encode(values, fmt):
    """fp32 values as an array of `fmt` for the library: uint16 bits for bf16 (wrap in epcomm.typed), float16 or
    float32 otherwise."""
    v = np.asarray(values, np.float32)
    if fmt == "bf16":
        return bf16_bits(v)
    return v.astype(np.float16 if fmt == "fp16" else np.float32)


def decode(array, fmt):
    """What encode() made (or the library wrote), as float64."""
    if fmt == "bf16":
        return bf16_value(array).astype(np.float64)
    if fmt == "fp8_e4m3":
        return fp8_value(array).astype(np.float64)
    return np.asarray(array).astype(np.float64)


def half_ulp(ref, fmt):
    """Half the spacing of `fmt` around each |ref| (float64): the largest error of one round-to-nearest."""
    man, emin = _FORMATS[fmt]
    mag = np.maximum(np.abs(ref), np.finfo(np.float64).tiny)
    exp = np.maximum(np.floor(np.log2(mag)), emin)
    return 0.5 * 2.0 ** (exp - man)


def one_rounding_bound(ref, abs_terms, num_terms, fmt):
    """The error an fp32 sum of `num_terms` terms may carry into one final rounding to `fmt`: half an ulp of `fmt`
    at the result, plus the fp32 accumulation (each multiply and add rounds once: (2 * num_terms) * 2^-24 times the
    sum of the terms' magnitudes), plus the fp32 rounding of the exact result itself."""
    acc = (2 * num_terms + 1) * 2.0 ** -24 * np.asarray(abs_terms, np.float64)
    return half_ulp(np.abs(ref) + acc, fmt) + acc

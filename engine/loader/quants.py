"""Dequantization of GGML tensor types to float32, vectorised with NumPy.

Each function takes the raw bytes of whole blocks, shaped (n_blocks, block_bytes)
as uint8, and returns float32 values shaped (n_blocks, block_elems). The layouts
are those of ggml's `block_*` structs (ggml-common.h); products are formed in the
same order as ggml's reference C code, so results are bit-exact with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

QK_K = 256  # elements per K-quant super-block


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte `start` of every block, as float32 (n, 1)."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _low_high_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) packed bytes -> (n, 32): low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32) bits, bit j at column j."""
    bits = qh.copy().view("<u4")  # (n, 1)
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def dequant_q4_0(b: np.ndarray) -> np.ndarray:
    # block_q4_0 { half d; uint8 qs[16]; }
    d = _f16(b, 0)
    q = _low_high_nibbles(b[:, 2:18]).astype(np.int8) - np.int8(8)
    return q.astype(np.float32) * d


def dequant_q4_1(b: np.ndarray) -> np.ndarray:
    # block_q4_1 { half d; half m; uint8 qs[16]; }
    d, m = _f16(b, 0), _f16(b, 2)
    q = _low_high_nibbles(b[:, 4:20])
    return q.astype(np.float32) * d + m


def dequant_q5_0(b: np.ndarray) -> np.ndarray:
    # block_q5_0 { half d; uint8 qh[4]; uint8 qs[16]; }
    d = _f16(b, 0)
    q = _low_high_nibbles(b[:, 6:22]) | (_high_bits_32(b[:, 2:6]) << 4)
    return (q.astype(np.int8) - np.int8(16)).astype(np.float32) * d


def dequant_q5_1(b: np.ndarray) -> np.ndarray:
    # block_q5_1 { half d; half m; uint8 qh[4]; uint8 qs[16]; }
    d, m = _f16(b, 0), _f16(b, 2)
    q = _low_high_nibbles(b[:, 8:24]) | (_high_bits_32(b[:, 4:8]) << 4)
    return q.astype(np.float32) * d + m


def dequant_q8_0(b: np.ndarray) -> np.ndarray:
    # block_q8_0 { half d; int8 qs[32]; }
    d = _f16(b, 0)
    return b[:, 2:34].view(np.int8).astype(np.float32) * d


def q8_0_split(raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 bytes of an (N, K) matrix -> its (N, K) int8 codes and (N, K / 32) float16
    scales, so that dequantize(raw, "Q8_0", shape) == codes * scales repeated 32 times along K."""
    N, K = shape
    if K % 32:
        raise ValueError(f"Q8_0 matrix {shape}: K must be a multiple of 32")
    blocks = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if blocks.size != N * K // 32 * 34:
        raise ValueError(f"Q8_0 matrix {shape}: {blocks.size} bytes, expected {N * K // 32 * 34}")
    blocks = blocks.reshape(N * K // 32, 34)
    scales = np.ascontiguousarray(blocks[:, :2]).view("<f2").astype(np.float16).reshape(N, K // 32)
    return np.ascontiguousarray(blocks[:, 2:]).view(np.int8).reshape(N, K), scales


def _k4_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte, 6-bit scales/mins of Q4_K and Q5_K -> two (n, 8) arrays.

    Sub-blocks 0-3 keep their 6 bits in bytes 0-3 (scale) and 4-7 (min); sub-blocks
    4-7 keep 4 low bits in bytes 8-11 and their 2 high bits in the top of bytes 0-7.
    """
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def dequant_q4_k(b: np.ndarray) -> np.ndarray:
    # block_q4_K { half d; half dmin; uint8 scales[12]; uint8 qs[128]; }
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k4_scales_mins(b[:, 4:16])
    qs = b[:, 16:144].reshape(n, 4, 1, 32)
    # each 32-byte group holds two sub-blocks: low nibbles, then high nibbles
    q = (qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    q = q.reshape(n, 8, 32).astype(np.float32)
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, QK_K)


def dequant_q5_k(b: np.ndarray) -> np.ndarray:
    # block_q5_K { half d; half dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]; }
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k4_scales_mins(b[:, 4:16])
    qh = b[:, 16:48].reshape(n, 1, 32)
    qs = b[:, 48:176].reshape(n, 4, 1, 32)
    low = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
    # sub-block i takes bit i of each qh byte as its fifth bit
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = (low | (high << 4)).astype(np.float32)
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, QK_K)


def dequant_q6_k(b: np.ndarray) -> np.ndarray:
    # block_q6_K { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d; }
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [half of block][first/second 32 bytes][32]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # (n, 16), one per 16 values
    d = _f16(b, 208)
    # within each 128-value half: values 0-31 low nibble of ql[0:32], 32-63 low nibble
    # of ql[32:64], 64-95 high nibble of ql[0:32], 96-127 high nibble of ql[32:64];
    # their 2 high bits are bits (0,1), (2,3), (4,5), (6,7) of qh[0:32]
    low = np.stack([ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)  # (n, 2, 4, 32)
    scale = (d * sc).reshape(n, 2, 4, 2, 1)  # scales go in 16-value steps
    return (scale * q.reshape(n, 2, 4, 2, 16)).reshape(n, QK_K)


def dequant_q2_k(b: np.ndarray) -> np.ndarray:
    # block_q2_K { uint8 scales[16]; uint8 qs[64]; half d; half dmin; }
    n = b.shape[0]
    sc = b[:, 0:16]
    qs = b[:, 16:80].reshape(n, 2, 1, 32)
    d, dmin = _f16(b, 80), _f16(b, 82)
    # each 128-value half reads its 32 bytes four times, two bits at a time
    q = ((qs >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(n, 16, 16)
    dl = (d * (sc & 0x0F).astype(np.float32))[:, :, None]
    ml = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    return (dl * q.astype(np.float32) - ml).reshape(n, QK_K)


def _k3_scales(scales: np.ndarray) -> np.ndarray:
    """Unpack Q3_K's 12 bytes into 16 signed 6-bit scales (n, 16) as float32.

    Scale i has its low 4 bits in byte i % 8 (low nibble for i < 8, high nibble
    after) and its 2 high bits in byte 8 + i % 4, at bit 2 * (i // 4).
    """
    i = np.arange(16)
    low = (scales[:, i % 8] >> np.where(i < 8, 0, 4).astype(np.uint8)) & 0x0F
    high = (scales[:, 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 3
    return ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)


def dequant_q3_k(b: np.ndarray) -> np.ndarray:
    # block_q3_K { uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; half d; }
    n = b.shape[0]
    hmask = b[:, 0:32].reshape(n, 1, 32)
    qs = b[:, 32:96].reshape(n, 2, 1, 32)
    sc = _k3_scales(b[:, 96:108])
    d = _f16(b, 108)
    low = ((qs >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(n, 8, 32)
    # the value group g (of 8) subtracts 4 unless bit g of its hmask byte is set
    hbit = (hmask >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = low.astype(np.int8) - ((1 - hbit) << 2).astype(np.int8)
    dl = (d * sc).reshape(n, 16, 1)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


@dataclass(frozen=True)
class QuantType:
    name: str
    block_elems: int
    block_bytes: int
    dequant_blocks: Callable[[np.ndarray], np.ndarray]


QUANT_TYPES: dict[str, QuantType] = {
    q.name: q
    for q in (
        QuantType("Q4_0", 32, 18, dequant_q4_0),
        QuantType("Q4_1", 32, 20, dequant_q4_1),
        QuantType("Q5_0", 32, 22, dequant_q5_0),
        QuantType("Q5_1", 32, 24, dequant_q5_1),
        QuantType("Q8_0", 32, 34, dequant_q8_0),
        QuantType("Q2_K", QK_K, 84, dequant_q2_k),
        QuantType("Q3_K", QK_K, 110, dequant_q3_k),
        QuantType("Q4_K", QK_K, 144, dequant_q4_k),
        QuantType("Q5_K", QK_K, 176, dequant_q5_k),
        QuantType("Q6_K", QK_K, 210, dequant_q6_k),
    )
}

# float types: name -> how to read the raw little-endian bytes
FLOAT_TYPES = ("F32", "F16", "BF16")


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Raw bytes of a GGML tensor -> float32 array of `shape` (row-major, last axis = ne0)."""
    n = int(np.prod(shape))
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if type_name == "F32":
        return raw.view("<f4").reshape(shape).astype(np.float32, copy=False)
    if type_name == "F16":
        return raw.view("<f2").astype(np.float32).reshape(shape)
    if type_name == "BF16":
        return bf16_to_f32(raw.view("<u2")).reshape(shape)
    qt = QUANT_TYPES.get(type_name)
    if qt is None:
        supported = ", ".join(FLOAT_TYPES + tuple(QUANT_TYPES))
        raise ValueError(f"GGUF tensor type {type_name} is not supported (supported: {supported})")
    if n % qt.block_elems:
        raise ValueError(f"{type_name} tensor of {n} values is not a whole number of blocks")
    n_blocks = n // qt.block_elems
    if raw.size != n_blocks * qt.block_bytes:
        raise ValueError(f"{type_name} tensor: expected {n_blocks * qt.block_bytes} bytes, got {raw.size}")
    return qt.dequant_blocks(raw.reshape(n_blocks, qt.block_bytes)).reshape(shape)

"""Split-KV flash decoding on the tensor cores (flash_decode.cu): one kernel over a static
grid that reads lengths and KV pointers from device arrays (graph-safe); the last split
block of each (row, KV head) combines the partials."""

from __future__ import annotations

import cupy as cp
import numpy as np

from ._module import check, check_scalar, f32, function, i32, i64, launch, module, sm_count, use_bf16, wgmma_supported

CHUNK_THREADS = 128
MAX_SPLITS = 64  # flash_decode.cu's bound on the splits of one sequence
KEYS = 64  # keys per shared-memory tile; a chunk is a multiple of it
BLOCKS_PER_SM = 4  # blocks an SM holds at once in a grid of several waves (fp8 K/V: min_blocks' launch bounds)


def min_blocks(blocks: int, head_dim: int, group: int, kv_fp8: bool) -> int:
    """Launch bounds: a grid of fp8 K/V that fills the GPU four times over runs four blocks
    an SM (128 registers a thread instead of ~160, no spills up to 128 dims and 8 heads a
    group); the conversions of fp8 tiles leave it latency-bound at three. Small grids keep
    the registers (their blocks are few, each on the critical path)."""
    wide = kv_fp8 and head_dim <= 128 and group <= 8 and blocks >= BLOCKS_PER_SM * sm_count()
    return BLOCKS_PER_SM if wide else 1


def swapped(group: int, kv_fp8: bool) -> bool:
    """fp8 K/V with at most 8 query heads a KV head: the kernel's form with the keys as the
    MMA's rows and the group's heads as its 8 columns (q in registers, no query tile). The
    16-bit tiles, bound by memory, gained nothing from it (H200, 8B and SmolLM2 shapes)."""
    return kv_fp8 and group <= 8


QK_WGMMA = True  # the swapped form's q K^T on wgmma where qk_wgmma() holds (tests and benchmarks turn it off)


def qk_wgmma(group: int, kv_fp8: bool, head_dim: int) -> bool:
    """The swapped form with its q K^T on Hopper's wgmma (flash_decode.cu's -DQK_WGMMA, built for
    sm_90a): fp8 K/V, at most 4 query heads a KV head (their hi and lo codes fill the MMA's 8
    columns; fewer leave columns of zeros), head dim 128 (K's 128-byte rows in the swizzle the
    MMA reads)."""
    return QK_WGMMA and swapped(group, kv_fp8) and group <= 4 and head_dim == 128 and wgmma_supported()


def smem_bytes(head_dim: int, kv_fp8: bool = False, group: int = 16, bufs: int = 2, wgmma: bool = False) -> int:
    """The 16-row query tile (none in the swapped form) and `bufs` buffers of K and V tiles,
    rows padded by 8 elements (fp8: byte rows padded by 16 bytes). wgmma (q K^T on it): up to
    1,024 bytes to align, q^T's 8 rows of codes, K tiles of unpadded rows, V tiles as above, and
    4 ints."""
    if wgmma:
        return 1024 + 8 * head_dim + bufs * KEYS * (2 * head_dim + 16) + 16
    if kv_fp8:
        return (0 if swapped(group, kv_fp8) else 2 * 16 * (head_dim + 8)) + 2 * bufs * KEYS * (head_dim + 16)
    return 2 * (16 + 2 * bufs * KEYS) * (head_dim + 8)


DEEP_MAX_SMEM = 96 << 10  # four buffers only where a block's shared memory stays within this
GROUPS_A_BLOCK = 4  # flash_decode.cu's TG where a launch asks for tile groups (16-bit K/V)
GROUPED_MAX_SMEM = 160 << 10  # ... two buffers a group (8) where the blocks fit the SMs at once and this holds
THREE_BUFS_MAX_WAVES = 2  # three buffers for q K^T on wgmma in grids of at most this many waves of four blocks an SM
THREE_BUFS_MAX_SPLITS = 2  # ... whose rows take at most this many splits


def buffers(blocks: int, pdl: bool, head_dim: int, kv_fp8: bool, group: int, wgmma: bool, splits: int) -> int:
    """K/V tile buffers a block (flash_decode.cu's -DBUFS), with programmatic dependent launch
    (without it, 2):
    - 4 where the blocks fit the SMs at once (the decode graphs of a few rows), so that a row of
      up to 256 keys in one split has all its tiles asked for before the wait, where that takes
      at most DEEP_MAX_SMEM (not 16-bit K/V of 128-dim heads: 140 KB). H200, SmolLM2 shape, B=1
      decode graph at 160 keys (three tiles): 0.403 -> 0.395 ms, the attention 3.13 -> 2.93 us a
      layer; B=8 decode (32 + 128 tokens) +3 %; 8B fp8 B=1 at 128 + 64 tokens 364.1 -> 369.0 tok/s.
    - 3 for q K^T on wgmma (`wgmma`, qk_wgmma) with rows in at most THREE_BUFS_MAX_SPLITS splits
      (`splits`, the grid's) over at most THREE_BUFS_MAX_WAVES waves of four blocks an SM: two
      tiles in flight a block, not one, where the last wave leaves SMs with fewer blocks. Four
      blocks an SM still fit (54 KB each). H200, 8B shape, rows of 576-640 keys, us a launch, 2
      -> 3 buffers: one split, 64 rows 25.0 -> 21.1, 96 rows 40.2 -> 34.9, 128 rows 44.5 -> 41.1
      (1,500 keys 104.3 -> 97.5); two splits, 32 rows 17.8 -> 15.7, 64 rows 31.0 -> 30.4 (2,000
      keys 80.8 -> 77.7); but one split, 160 rows 51.2 -> 53.3 (past two waves; 192 rows 65.2 ->
      60.0, 256 rows 79.6 -> 79.3), and 32 rows in 4 splits 19.5 -> 19.9.
    - else 2."""
    if not pdl:
        return 2
    if blocks <= sm_count() and smem_bytes(head_dim, kv_fp8, group, 4, wgmma) <= DEEP_MAX_SMEM:
        return 4
    if wgmma and splits <= THREE_BUFS_MAX_SPLITS and blocks <= THREE_BUFS_MAX_WAVES * BLOCKS_PER_SM * sm_count():
        return 3
    return 2


def grouped_buffers(blocks: int, head_dim: int) -> int:
    """K/V tile buffers a block of GROUPS_A_BLOCK tile groups (flash_decode.cu's -DTG): two a group where
    the blocks fit the SMs at once and their shared memory stays within GROUPED_MAX_SMEM (a row of
    up to 8 tiles then has every tile asked for before the wait), else one. Every one is filled
    before the wait (AHEAD = BUFS), with or without programmatic dependent launch."""
    deep = 2 * GROUPS_A_BLOCK
    if blocks <= sm_count() and smem_bytes(head_dim, bufs=deep) <= GROUPED_MAX_SMEM:
        return deep
    return GROUPS_A_BLOCK


def flash_decode(q: cp.ndarray, k_ptrs: cp.ndarray, v_ptrs: cp.ndarray, kv_lens: cp.ndarray,
                 layer_offset: int, num_kv_heads: int, part_o: cp.ndarray, part_ml: cp.ndarray,
                 counters: cp.ndarray, out: cp.ndarray, scale: float, chunk: int = 256, window: int = 0,
                 pdl: bool = False, kv_fp8: bool = False, whole: int = 0, short: int = 0,
                 grouped: bool = False) -> cp.ndarray:
    """out (B, H, D) = softmax(q k^T * scale) v over each row's kv_lens[b] cached keys.

    part_o (B, H, S, D) float32 and part_ml (B, H, S, 2) float32 are the split partials;
    S fixes the grid: a row's keys go in at most S splits of `chunk` keys or more (longer
    where S of `chunk` do not cover them, in multiples of KEYS).
    counters (B, num_kv_heads) int32 must be zero; the kernel leaves them zero.
    kv_fp8: the cache holds float8 e4m3 (one byte an element) instead of q's 16-bit type.
    whole: a row of at most this many keys (after the window) takes them all in one split.
    short: a longer row of at most this many keys takes splits of KEYS keys (at most S of them).
    grouped: 16-bit K/V only; each block runs GROUPS_A_BLOCK groups of 4 warps, each over its own tiles of
    the split (flash_decode.cu's -DTG), so that a split's tiles run side by side. A row's bits then
    differ from those of a launch without it, but not with the buffers or pdl.
    """
    if q.ndim != 3:
        raise ValueError(f"q: expected (B, heads, head_dim), got {q.shape}")
    B, H, D = q.shape
    check_scalar(q, "q")
    check(q, "q", q.dtype)
    if H % num_kv_heads:
        raise ValueError(f"{H} query heads are not a multiple of {num_kv_heads} KV heads")
    if D % (32 if kv_fp8 else 16) or D > 256:
        raise ValueError(f"head_dim {D} must be a multiple of {32 if kv_fp8 else 16} and at most 256")
    if H // num_kv_heads > 16:
        raise ValueError(f"{H // num_kv_heads} query heads per KV head: at most 16")
    if chunk % KEYS:
        raise ValueError(f"chunk {chunk} must be a multiple of {KEYS}")
    if short < 0:
        raise ValueError(f"short {short} must be >= 0")
    S = part_o.shape[2] if part_o.ndim == 4 else -1
    check(part_o, "part_o", np.float32, (B, H, S, D))
    check(part_ml, "part_ml", np.float32, (B, H, S, 2))
    for name, arr, dt in (("k_ptrs", k_ptrs, np.int64), ("v_ptrs", v_ptrs, np.int64), ("kv_lens", kv_lens, np.int32)):
        check(arr, name, dt, (B,))
    if not 1 <= S <= MAX_SPLITS:
        raise ValueError(f"{S} splits: 1 to {MAX_SPLITS}")
    if short > S * KEYS:
        raise ValueError(f"short {short}: {S} splits of {KEYS} keys cover at most {S * KEYS}")
    check(counters, "counters", np.int32, (B, num_kv_heads))
    check(out, "out", q.dtype, (B, H, D))
    if grouped and kv_fp8:
        raise ValueError("grouped: 16-bit K/V only")
    group = H // num_kv_heads
    blocks = B * num_kv_heads * S
    wg = qk_wgmma(group, kv_fp8, D)
    groups = GROUPS_A_BLOCK if grouped else 1
    bufs = grouped_buffers(blocks, D) if grouped else buffers(blocks, pdl, D, kv_fp8, group, wg, S)
    mod = module("flash_decode", arch="sm_90a" if wg else None, USE_BF16=use_bf16(q), HEAD_DIM=D, GROUP=group,
                 CHUNK=chunk, KV_FP8=int(kv_fp8), WHOLE=whole, SHORT=short,
                 MIN_BLOCKS=min_blocks(blocks, D, group, kv_fp8), SWAP=int(swapped(group, kv_fp8)),
                 QK_WGMMA=int(wg), BUFS=bufs, AHEAD=bufs if pdl or grouped else 1, TG=groups)
    smem = smem_bytes(D, kv_fp8, group, bufs, wg)
    launch(function(mod, "flash_decode_chunk", smem), (S, num_kv_heads, B), (CHUNK_THREADS * groups,),
           (q, k_ptrs, v_ptrs, kv_lens, i64(layer_offset), part_o, part_ml, counters, out, i32(H), i32(num_kv_heads),
            i32(S), i32(window), f32(scale)), shared_mem=smem, pdl=pdl)
    return out

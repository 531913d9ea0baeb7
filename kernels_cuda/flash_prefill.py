"""Causal flash attention for ragged prefill chunks over the KV cache: flash_prefill.cu (mma.sync,
any GPU the project runs on), or on Hopper flash_prefill_wgmma.cu (wgmma, a producer warpgroup that
copies and widens the K/V tiles beside the MMAs). Both take the same arguments and tiles."""

from __future__ import annotations

import cupy as cp
import numpy as np

from ._module import (MAX_BLOCK_SMEM, blocks_per_sm, check, check_scalar, f32, function, i32, i64, module, sm_count,
                      use_bf16, wgmma_supported)

BLOCK_M = 64
BLOCK_N = 64
# Query heads a block takes (sharing its K/V tiles) where the grouping allows, in launches whose
# longest sequence has SHARE_MIN_KEYS keys or more. H200, Llama-3-8B's heads (32 over 8), us of
# one launch with one head a block -> two: 8,192-token prompt 2,894 -> 2,543 (fp8 K/V), 2,519 ->
# 2,317 (16-bit); 2,048 tokens 237 -> 228 and 202 -> 208; 16 prompts of 512: 270 -> 271 and
# 232 -> 246. (Four heads a block spill: 208-222 registers a thread at 128 threads.)
MAX_HEADS = 2
SHARE_MIN_KEYS = 4096


# flash_prefill_wgmma.cu on sm_90 for these head dims (False: flash_prefill.cu everywhere)
WGMMA = True
WGMMA_HEAD_DIMS = (64, 128)
WGMMA_RAW = 2  # stages of K/V rows as cached
WGMMA_STAGES = 3  # stages of 16-bit K / V^T tiles at most (fewer where the shared memory is short)
WGMMA_ITEM_CAP, WGMMA_ITEM_BYTES = 160, 48  # the work items a block may take (its table in shared memory)
# consumer warpgroups (query heads) a block, by head dim. At 128 a thread holds ~164 registers, so
# three warpgroups (168 at most each) fit an SM's 64 K. At 64 one head a block: H200, SmolLM2's
# heads (9 over 3), 4 prompts of 448 tokens, e4m3 cache: 12.7 us a launch against 15.8 with three
# (two 256-thread blocks an SM against one of 512; an earlier form of the kernel)
WGMMA_MAX_HEADS = {64: 1, 128: 2}
WGMMA_MIN_BLOCKS = {64: 2, 128: 1}  # blocks an SM the registers are capped for (two at 64: 128 each)
WGMMA_PINGPONG = True  # two consumer warpgroups take turns to issue their MMAs (FlashAttention-3's schedule)


# Launches whose longest row has fewer keys stay on flash_prefill.cu. H200, us a launch (at 2eea4b4;
# docs/performance.md has later figures), flash_prefill.cu -> flash_prefill_wgmma.cu, the same bits:
# Llama-3-8B's heads (32 over 8), e4m3 cache, 16 prompts of 128 tokens 39.7 -> 29.2, 4 of 448 60.5 ->
# 40.3, one of 2,048 208.9 -> 116.2, one of 8,192 2,608 -> 1,558; 16-bit cache 4 of 448 52.9 -> 41.8,
# one of 2,048 170.4 -> 126.0. SmolLM2's (9 over 3, head dim 64): 4 of 448 18.7 -> 22.4 and 16 of 128
# 19.0 -> 23.7 (a small launch: the persistent blocks' start costs more than they save), one of 1,024
# 31.3 -> 22.8, one of 2,048 51.7 -> 41.0
WGMMA_MIN_KEYS = {64: 1024, 128: 0}
WGMMA_MAX_BLOCKS: int | None = None  # the persistent grid at most (tests: several items a block); None: a full wave


def wgmma_heads(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """The query heads of one KV head a flash_prefill_wgmma.cu block takes (one consumer
    warpgroup each, sharing the producer's K/V tiles)."""
    group = num_heads // num_kv_heads
    return max(h for h in range(1, WGMMA_MAX_HEADS[head_dim] + 1) if group % h == 0)


def wgmma_smem_bytes(head_dim: int, kv_fp8: bool, heads: int, stages: int) -> int:
    """flash_prefill_wgmma.cu's shared memory: 1,024 bytes to align, two Q tiles a head (this work
    item's, the next one's) and the 16-bit K and V^T stages (64 x head_dim each), the raw stages (K
    and V rows as cached), the work items' table, the mbarriers."""
    tile16 = 64 * head_dim * 2
    raw_tile = 2 * 64 * head_dim * (1 if kv_fp8 else 2)
    return (1024 + 2 * (heads + stages) * tile16 + WGMMA_RAW * raw_tile + WGMMA_ITEM_CAP * WGMMA_ITEM_BYTES
            + 2 * stages * 8)


def wgmma_stages(head_dim: int, kv_fp8: bool, heads: int) -> int:
    """The 16-bit stages a flash_prefill_wgmma.cu block has room for: WGMMA_STAGES, or fewer."""
    return max([s for s in range(1, WGMMA_STAGES + 1) if wgmma_smem_bytes(head_dim, kv_fp8, heads, s) <= MAX_BLOCK_SMEM]
               or [1])


def use_wgmma(head_dim: int, max_keys: int) -> bool:
    """Whether flash_prefill launches flash_prefill_wgmma.cu for this head dim and longest row here."""
    return (WGMMA and head_dim in WGMMA_HEAD_DIMS and max_keys >= WGMMA_MIN_KEYS[head_dim]
            and wgmma_supported())


def heads_per_block(num_heads: int, num_kv_heads: int, max_keys: int = 0) -> int:
    """The query heads of one KV head that a block takes: MAX_HEADS where some sequence has
    max_keys >= SHARE_MIN_KEYS keys, or fewer where the heads per KV head are not a multiple
    of it; else one."""
    group = num_heads // num_kv_heads
    most = MAX_HEADS if max_keys >= SHARE_MIN_KEYS else 1
    return max(h for h in range(1, most + 1) if group % h == 0)


def smem_bytes(head_dim: int, kv_fp8: bool = False, heads: int = 1) -> int:
    """The Q tiles of `heads` heads plus double-buffered K and V tiles, rows padded by 8
    elements; with an fp8 cache the tiles arrive as bytes (double-buffered) and are widened
    into one 16-bit K and V tile."""
    if kv_fp8:
        return 2 * heads * BLOCK_M * (head_dim + 8) + 4 * BLOCK_N * head_dim + 2 * 2 * BLOCK_N * (head_dim + 8)
    return 2 * (heads * BLOCK_M + 4 * BLOCK_N) * (head_dim + 8)


def tiles(q_lens: np.ndarray, kv_lens: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tile_seq, tile_q0): one tile per 64 queries of each sequence (host side), the tiles
    with the most keys first (kv_lens: each sequence's keys with its chunk, q_lens where
    omitted), so that a launch's longest blocks do not start last."""
    q_lens = np.asarray(q_lens, np.int64)
    if q_lens.size == 0:  # a ragged step of one-token rows only: no prompt tiles
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    kv = q_lens if kv_lens is None else np.asarray(kv_lens, np.int64)
    counts = -(-q_lens // BLOCK_M)
    tile_seq = np.repeat(np.arange(len(q_lens), dtype=np.int32), counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    tile_q0 = ((np.arange(tile_seq.size) - np.repeat(starts, counts)) * BLOCK_M).astype(np.int32)
    keys = (kv - q_lens)[tile_seq] + np.minimum(tile_q0 + BLOCK_M, q_lens[tile_seq])
    order = np.argsort(-keys, kind="stable")
    return tile_seq[order], tile_q0[order]


def flash_prefill(q: cp.ndarray, tile_seq: cp.ndarray, tile_q0: cp.ndarray, seq_q_start: cp.ndarray,
                  seq_q_len: cp.ndarray, seq_kv_len: cp.ndarray, k_ptrs: cp.ndarray, v_ptrs: cp.ndarray,
                  layer_offset: int, num_kv_heads: int, scale: float, out: cp.ndarray, window: int = 0,
                  kv_fp8: bool = False, max_keys: int = 0, tiles_on_device: cp.ndarray | None = None
                  ) -> cp.ndarray:
    """out (T, H, D): each sequence's queries attend causally to its cached keys
    [0, seq_kv_len) (the chunk's own keys already written), grouped by KV head.
    kv_fp8: the cache holds float8 e4m3 instead of q's 16-bit type. max_keys: the longest
    seq_kv_len, as the host knows it (picks the kernel, use_wgmma, and flash_prefill.cu's heads a
    block, heads_per_block). On Hopper flash_prefill_wgmma.cu runs where use_wgmma holds; both
    kernels give the same bits. tiles_on_device: an int32 device array of one element, the count
    of tile_seq's first tiles to run, which the kernel reads; the launch then takes a whole wave
    of blocks whatever that count, so that a graph replays it for any step's tiles (tile_seq
    sized for the most). Only flash_prefill_wgmma.cu reads it: use_wgmma must hold."""
    if q.ndim != 3:
        raise ValueError(f"q: expected (T, heads, head_dim), got {q.shape}")
    T, H, D = q.shape
    check_scalar(q, "q")
    check(q, "q", q.dtype)
    if D % 16:
        raise ValueError(f"head_dim {D} must be a multiple of 16")
    if H % num_kv_heads:
        raise ValueError(f"{H} query heads are not a multiple of {num_kv_heads} KV heads")
    n_tiles = tile_seq.shape[0]
    check(tile_seq, "tile_seq", np.int32)
    check(tile_q0, "tile_q0", np.int32, (n_tiles,))
    n_seqs = seq_q_start.shape[0]
    for name, arr, dt in (("seq_q_start", seq_q_start, np.int32), ("seq_q_len", seq_q_len, np.int32),
                          ("seq_kv_len", seq_kv_len, np.int32), ("k_ptrs", k_ptrs, np.int64),
                          ("v_ptrs", v_ptrs, np.int64)):
        check(arr, name, dt, (n_seqs,))
    check(out, "out", q.dtype, (T, H, D))
    if n_tiles > 65535:
        raise ValueError(f"{n_tiles} query tiles: at most 65535 in a launch")
    if tiles_on_device is not None:
        check(tiles_on_device, "tiles_on_device", np.int32, (1,))
        if not use_wgmma(D, max_keys):
            raise ValueError("tiles_on_device: only flash_prefill_wgmma.cu reads the tile count on the device")
    if not n_tiles:
        return out
    args = (q, out, tile_seq, tile_q0, seq_q_start, seq_q_len, seq_kv_len, k_ptrs, v_ptrs, i64(layer_offset), i32(H),
            i32(num_kv_heads), i32(window), f32(scale))
    if use_wgmma(D, max_keys):
        heads = wgmma_heads(H, num_kv_heads, D)
        stages = wgmma_stages(D, kv_fp8, heads)
        smem, threads = wgmma_smem_bytes(D, kv_fp8, heads, stages), 128 * (heads + 1)
        mod = module("flash_prefill_wgmma", arch="sm_90a", USE_BF16=use_bf16(q), HEAD_DIM=D, KV_FP8=int(kv_fp8),
                     HEADS=heads, RAW=WGMMA_RAW, STAGES=stages, ITEM_CAP=WGMMA_ITEM_CAP,
                     MIN_BLOCKS=WGMMA_MIN_BLOCKS[D], PINGPONG=int(WGMMA_PINGPONG and heads == 2))
        kernel = function(mod, "flash_prefill_wgmma", smem)
        items = n_tiles * (H // heads)  # persistent: as many blocks as fit at once take the items in turn
        wave = WGMMA_MAX_BLOCKS or sm_count() * blocks_per_sm(kernel, threads, smem)
        grid = wave if tiles_on_device is not None else min(items, wave)
        # more items a block than its table holds (a step of > ~84k prompt tokens at 8B's heads): flash_prefill.cu
        if -(-items // grid) <= WGMMA_ITEM_CAP:
            kernel((grid,), (threads,), (*args, i32(n_tiles), i64(0) if tiles_on_device is None else tiles_on_device),
                   shared_mem=smem)
            return out
        if tiles_on_device is not None:
            raise ValueError(f"tiles_on_device: {n_tiles} tiles are more than {grid} blocks' tables hold")
    heads = heads_per_block(H, num_kv_heads, max_keys)
    smem = smem_bytes(D, kv_fp8, heads)
    mod = module("flash_prefill", USE_BF16=use_bf16(q), HEAD_DIM=D, KV_FP8=int(kv_fp8), HEADS=heads)
    function(mod, "flash_prefill", smem)((H // heads, n_tiles), (128 * heads,), args, shared_mem=smem)
    return out

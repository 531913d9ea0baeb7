"""Skinny matrix products for decode batches of 1 to 16 rows on the tensor cores (gemv.cu)."""

from __future__ import annotations

import dataclasses

import cupy as cp
import numpy as np

from ._module import (blocks_per_sm, check, check_scalar, f32, i32, i64, launch, module, ptr_or_null, same_scalar,
                      sm_count, use_bf16)
from . import rmsnorm
from .quant import Fp8Matrix, Q8Matrix
from .rope import check_rope_args

# The runner uses this kernel for every step of up to MAX_ROWS rows, so a sequence's logits
# do not depend on what else is in such a step. H200 sweep (`bench/kernels.py --gemv-sweep`,
# Llama-3-8B matrices, the step's five products): on par with cuBLAS at 1 and 8 rows; at
# 9-16 rows, with two feature tiles a block, ~4 % slower (it was ~16 % with one tile).
MAX_ROWS = 16
# gemv.cu's shape constants (warps per block, chunks a warp loads per pass), chosen with
# `bench/kernels.py --gemv-sweep` and the decode graphs: DEPTH 8 up to 4 rows; DEPTH 4 from
# 5 rows on, where each chunk also brings 5-16 x rows (H200, 8B decode graph: B=8 4.87 ->
# 4.80 ms, B=16 5.56 -> 5.35 ms; B=1 is faster with 8). The order of a sum over k does
# not depend on DEPTH, so neither does any output bit.
CONFIG = {"WARPS": 8, "DEPTH": 8}
CONFIG_WIDE = {"WARPS": 8, "DEPTH": 4}  # from 5 rows on
PREFETCH_BUDGET = 12 << 20  # bytes of a matrix asked into the L2 while the previous kernel ends
# 16-bit rows of at most FITTED_MAX_ROW_BYTES (e4m3 rows of half that) at 1 to FITTED_MAX_ROWS rows
# (not staged, not Q8_0) take FITTED_TILES tiles a block (as beyond 8 rows already) and passes of just
# the chunks a warp has in the row: DEPTH = FITTED_TILES x ceil(chunks / WARPS) (fitted_config), so
# the whole row comes in before the wait (PRELOAD) and no pass runs on masked chunks. CONFIG's DEPTH 8
# gave SmolLM2's 576-value rows 8 chunks a warp of which 2-3 exist, one tile made 72-120 blocks a
# product, and CONFIG_WIDE's DEPTH 4 left those rows past the first pass. H200, decode graphs of random
# weights at 96 keys, before -> after alternated in one process, us (the same bits; forty-first
# session): SmolLM2 B=1 365.8 -> 325.7, B=4 438.2 -> 395.4, B=8 492.4 -> 403.3, B=12 556.3 -> 455.7,
# B=16 590.1 -> 498.0; with e4m3 weights B=1 385.8 -> 353.3, B=8 454.4 -> 430.0; Llama-3.2-1B (4 KB
# rows) B=1 868.9 -> 856.7, B=8 979.6 -> 923.8, B=16 1,073.4 -> 1,019.9. One tile with fitted passes
# was slower at one row (399.2 against 363.1), four tiles (a form built for the measurement) slower
# than two (341.5 against 323.3).
FITTED_MAX_ROW_BYTES = 4096
FITTED_MAX_ROWS = MAX_ROWS
FITTED_TILES = 2


# 16-bit weights at 1-8 rows take two 8-feature tiles a block in the matrices with the most
# rows (LM heads) and in wide ones whose rows still fit the first pass of a block's warps (see
# tiles): there one tile gives many blocks that each stream little (and, with a folded norm,
# each norm the row again). H200 decode graphs, B=1 (bench/kernels.py --timeline): SmolLM2's LM
# head 25.4 -> 16.0 us, its gate/up product 3.0 -> 2.4 us; Llama-3-8B's LM head 262 -> 249 us,
# while its other products were 1-15 % slower with two tiles (and SmolLM2's down product, whose
# 3 KB rows then miss the first pass, 2.1 -> 2.9 us).
TWO_TILES_MIN_N = 65536
TWO_TILES_MIN_N_SHORT = 2048
# 16-bit matrices below TWO_TILES_MIN_N rows (not LM heads) of at least STAGED_MIN_BYTES, or of at
# least STAGED_MIN_BYTES_ONE_WAVE whose one-tile grid fits one wave of STAGED_CONFIG's blocks,
# stream their weights through shared memory in whole row segments (gemv.cu's STAGED): a warp
# load of 64 bytes from each of 8 rows, the MMA fragments' own layout, read HBM 7-10 % slower
# than whole row segments (bench/kernels.py --read-patterns). The choice depends on the matrix
# (and the GPU's SM count) alone, never on the rows of x: the two forms sum over k in different
# orders, and a matrix must give the same bits at 1-16 rows, fused or not. H200, Llama-3-8B
# decode graphs at 575 keys, both forms captured on one runner and timed in turn
# (docs/performance.md, fourteenth session): gate/up, down and o staged, B=1 4.470 -> 4.092 ms,
# B=8 4.687 -> 4.365, B=16 5.598 -> 5.473; the QKV product (768 blocks, two waves when
# staged) stays direct: staging it too cost 1.5-4 %.
STAGED_MIN_BYTES = 96 << 20
STAGED_MIN_BYTES_ONE_WAVE = 16 << 20
# 1-8 rows: two buffers a warp; 4 blocks an SM (<= 64 registers: the 8B down product's 512
# blocks then take one wave, where 68 registers left 3 blocks an SM and two waves)
STAGED_CONFIG = {"STAGED": 1, "WARPS": 8, "DEPTH": 4, "STAGES": 2, "MIN_BLOCKS": 4}
# 9-16 rows (two tiles): one buffer of longer passes
STAGED_CONFIG_WIDE = {"STAGED": 1, "WARPS": 8, "DEPTH": 8, "STAGES": 1}
# With TILE_LOOP in a config (rows that fit the first pass, no folded norm, not staged), the grid is
# the blocks that fit the GPU at once (at most LOOP_MAX_GRID where set: tests), each looping over
# tiles gridDim apart and loading the next one's weights while it adds and stores this one's sums.
# The same bits as a block a tile.
LOOP_MAX_GRID: int | None = None
# Q8_0 matrices (Q8Matrix, GGUF LM heads) at up to Q8_SHORT_MAX_ROWS rows whose rows fit a first pass
# of DEPTH 4 take Q8_SHORT_CONFIG, others default_config (DEPTH sets no bit; neither does TILE_LOOP).
# H200, us a launch (graphs of ten, PDL), 16-bit -> Q8_0 with default_config / Q8_SHORT_CONFIG: SmolLM2's
# LM head (49,152 x 576) at 1 row 17.1 -> 28.2 / 16.2, in its decode graph 0.3735 -> 0.3846 / 0.3723 ms
# (2 rows 0.4495 -> 0.4446, 4 rows 0.4437 -> 0.4424); Llama-3-8B's (128,256 x 4,096; past the first
# pass, default_config) at 1 row 255.4 -> 163.4 (3.4 TB/s), at 8 rows 252.7 -> 240.2.
Q8_SHORT_MAX_ROWS = 4
Q8_SHORT_CONFIG = {**CONFIG, "DEPTH": 4, "TILE_LOOP": 1}


def q8_config(rows: int, K: int) -> dict:
    """gemv.cu's shape constants for a Q8Matrix of K columns at `rows` rows."""
    if rows <= Q8_SHORT_MAX_ROWS and K <= Q8_SHORT_CONFIG["WARPS"] * (Q8_SHORT_CONFIG["DEPTH"] // 2) * 64:
        return Q8_SHORT_CONFIG
    return default_config(rows)


def staged(n: int, row_bytes: int, fp8: bool) -> bool:
    """Whether a matrix of n rows of row_bytes streams through shared memory (gemv.cu's STAGED)."""
    if fp8 or n >= TWO_TILES_MIN_N:
        return False
    size = n * row_bytes
    return size >= STAGED_MIN_BYTES or (size >= STAGED_MIN_BYTES_ONE_WAVE
                                        and -(-n // 8) <= STAGED_CONFIG["MIN_BLOCKS"] * sm_count())


def staged_config(rows: int) -> dict:
    """gemv.cu's shape constants for a staged matrix at `rows` rows (WARPS fixed: it sets the sum order)."""
    return STAGED_CONFIG if rows <= 8 else STAGED_CONFIG_WIDE


def fitted_config(rows: int, row_bytes: int, fp8: bool = False) -> dict | None:
    """The shape constants of a product of `rows` rows of row_bytes (e4m3 codes with fp8) whose
    passes fit the row (see FITTED_MAX_ROW_BYTES; FITTED_TILES tiles), or None where it takes the
    others. e4m3 rows go up to half as many bytes, the same k-values: Llama-3-8B's 4 KB rows of
    codes were not measured in this form and keep CONFIG and CONFIG_WIDE."""
    chunks = -(-row_bytes // 64)  # a row's 64-byte chunks (4 lanes' 16-byte loads)
    per = -(-chunks // CONFIG["WARPS"])  # those of each warp
    limit = FITTED_MAX_ROW_BYTES // (2 if fp8 else 1)
    if rows > FITTED_MAX_ROWS or per * CONFIG["WARPS"] * 64 > limit:
        return None
    return {"WARPS": CONFIG["WARPS"], "DEPTH": FITTED_TILES * per}


def default_config(rows: int) -> dict:
    """gemv.cu's shape constants for a product of `rows` rows (CONFIG or CONFIG_WIDE)."""
    return CONFIG if rows <= 4 else CONFIG_WIDE


def tiles(rows: int, fp8: bool = False, row_bytes: int = 0, n: int = 0, config: dict | None = None) -> int:
    """8-feature tiles a block computes: two for e4m3 weights (H200, Llama-3-8B matrices at 1
    row: one tile left each block a single pass over its 8 rows and ran at ~2.4 TB/s) and
    beyond 8 rows; for 16-bit weights at 1-8 rows FITTED_TILES where the config is
    fitted_config's (config None: fitted_config, else default_config), else one, except for n >=
    TWO_TILES_MIN_N rows of weights, or n >= TWO_TILES_MIN_N_SHORT rows of row_bytes that two tiles
    still preload."""
    if rows > 8 or fp8:
        return 2
    fitted = fitted_config(rows, row_bytes)
    cfg = config or fitted or default_config(rows)
    if cfg == fitted:
        return FITTED_TILES
    if n >= TWO_TILES_MIN_N or (n >= TWO_TILES_MIN_N_SHORT and preload(row_bytes, cfg, 2)):
        return 2
    return 1


def preload(row_bytes: int, config: dict, n_tiles: int) -> bool:
    """Whether a block loads all its weights before waiting for the previous kernel
    (gemv.cu's PRELOAD): when a row fits in the first pass of its warps (WARPS x DEPTH /
    tiles chunks of 64 bytes), the block then only waits for x and multiplies. H200 decode
    graphs (and SmolLM2's 30 layers of 1-3 KB rows, 16-bit): B=1 0.564 -> 0.477 ms a step.
    Loading the first pass of longer rows early as well made the Llama-3-8B graphs 1-4 %
    faster with e4m3 weights at 1-8 rows, but 1-7 % slower with 16-bit weights and with e4m3
    at 16 rows, so those keep their L2 prefetch alone."""
    return row_bytes <= config["WARPS"] * (config["DEPTH"] // n_tiles) * 64


@dataclasses.dataclass(frozen=True)
class NormIn:
    """A product's input rows made in its blocks, as rmsnorm.add_rms_norm (or rms_norm,
    without delta) makes them, to the bit, instead of read from x (gemv.cu's NORM_IN):
    res (B, K) float32 (+ delta (B, K) float32 + bias (K,)), normed with weight (K,) float32.
    Where delta is given, res + delta (+ bias) goes to res_out (B, K) if given (the residual
    stream's next state), which must not be res: the other blocks still read it. K a
    multiple of 4, at most 4 x rmsnorm.THREADS. delta may also be (P, B, K), a view whose
    parts lie apart (each part's rows contiguous): the parts are added in order first
    (attn_block's o product, a part per KV head)."""
    res: cp.ndarray
    weight: cp.ndarray
    eps: float
    delta: cp.ndarray | None = None
    bias: cp.ndarray | None = None
    res_out: cp.ndarray | None = None

    def args(self, B: int, K: int) -> tuple:
        """The kernel's nres .. nres_out, checked."""
        if K % 4 or K > 4 * rmsnorm.THREADS:
            raise ValueError(f"gemv: a folded norm needs K a multiple of 4 and at most {4 * rmsnorm.THREADS}, got {K}")
        check(self.res, "norm.res", np.float32, (B, K))
        check(self.weight, "norm.weight", np.float32, (K,))
        parts, stride = (1, 0) if self.delta is None else rmsnorm.delta_parts(self.delta, B, K, "norm.delta")
        if self.res_out is not None:
            check(self.res_out, "norm.res_out", np.float32, (B, K))
            if self.res_out.data.ptr == self.res.data.ptr:
                raise ValueError("gemv: norm.res_out must not be norm.res")
        if self.bias is not None:
            check(self.bias, "norm.bias", np.float32, (K,))
        return (self.res, ptr_or_null(self.delta), ptr_or_null(self.bias), self.weight, f32(self.eps),
                ptr_or_null(self.res_out if self.delta is not None else None), i64(stride), i32(parts))


NO_NORM = (np.uint64(0),) * 4 + (f32(0), np.uint64(0), i64(0), i32(1))


def _weights(x: cp.ndarray, w) -> tuple[cp.ndarray, cp.ndarray | None]:
    """(codes or 16-bit matrix, scales or None) of a weight argument: a 16-bit array of x's
    type, an Fp8Matrix (--quantization fp8) or a Q8Matrix (a GGUF Q8_0 LM head)."""
    if isinstance(w, Fp8Matrix):
        check(w.data, "w.data", np.uint8)
        check(w.scale, "w.scale", np.float32, (w.data.shape[0],))
        return w.data, w.scale
    if isinstance(w, Q8Matrix):
        check(w.data, "w.data", np.int8)
        if w.data.ndim != 2 or w.data.shape[1] % 32:
            raise ValueError(f"gemv: a Q8_0 matrix needs K a multiple of 32, got {w.data.shape}")
        check(w.scale, "w.scale", np.float16, (w.data.shape[0], w.data.shape[1] // 32))
        return w.data, w.scale
    same_scalar(x, w, "x, w")
    check(w, "w", w.dtype)
    return w, None


def _launch(name: str, x: cp.ndarray, w, extra: tuple, pdl: bool, config: dict | None, norm: NormIn | None = None,
            **defines: int) -> int:
    """Checks shared by the skinny kernels, then the launch (x, w, B, N, K, prefetch, wscale,
    the norm's fields, *extra): a block per 8 weight rows (16 from 9 rows on, see tiles),
    whatever the epilogue makes of them (SiLU pairs, RoPE pairs: N / 8 or N / 16 blocks all
    the same). With norm, x gives the rows' shape and type only. Returns the tile count (a
    tile: a block's weight rows, at most N / 8; see gemv_keys)."""
    w, scale = _weights(x, w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv: x {x.shape} and w {w.shape} do not chain")
    B, K = x.shape
    N = w.shape[0]
    if not 1 <= B <= MAX_ROWS:
        raise ValueError(f"gemv: {B} rows (1..{MAX_ROWS}); use gemm for more")
    q8 = w.dtype == np.int8
    group = 16 // w.itemsize  # k-values in a lane's 16-byte weight load
    if K % group:
        raise ValueError(f"gemv: K={K} must be a multiple of {group}")
    check(x, "x", x.dtype)
    fp8 = scale is not None and not q8
    narrow = fp8 or q8  # one-byte codes: the e4m3 form's lanes, tiles and order (a Q8_0 block's scale folded in)
    row_bytes = K * w.itemsize
    # an explicit config (benchmarks, tests) is taken as it is, staged or not (its STAGED key)
    if config:
        cfg = config
    elif q8:
        cfg = q8_config(B, K)
    else:
        cfg = staged_config(B) if staged(N, row_bytes, fp8) else fitted_config(B, row_bytes, fp8) or default_config(B)
    in_stages = bool(cfg.get("STAGED"))
    if in_stages and narrow:
        raise ValueError("gemv: the staged form takes 16-bit weights")
    prefetch = min(row_bytes, PREFETCH_BUDGET // N) // 16 * 16  # the first bytes of every row
    n_tiles = tiles(B, narrow, row_bytes, N, cfg)
    suffix = "16" if B > 8 else "8x2" if n_tiles == 2 else "8"
    pre = int(preload(row_bytes, cfg, n_tiles) and not in_stages)
    if norm is not None:
        defines.update(NORM_IN=1, NORM_THREADS=rmsnorm.THREADS)
    if cfg.get("TILE_LOOP") and (not pre or norm is not None):
        raise ValueError("gemv: TILE_LOOP takes rows that fit the first pass and no folded norm")
    kernel = module("gemv", USE_BF16=use_bf16(x), W_FP8=int(fp8), W_Q8=int(q8), PRELOAD=pre, **cfg,
                    **defines).get_function(f"{name}_{suffix}")
    if norm is not None:  # a block's 48 KB, less the kernel's own (staged: ~40 KB)
        room = (48 << 10) - kernel.shared_size_bytes
        if x.nbytes > room:
            raise ValueError(f"gemv: a folded norm keeps the rows in shared memory, {x.nbytes} bytes > {room} bytes")
    count = grid = -(-N // (8 * n_tiles))
    if cfg.get("TILE_LOOP"):
        grid = min(grid, LOOP_MAX_GRID or blocks_per_sm(kernel, 32 * cfg["WARPS"], 0) * sm_count())
    launch(kernel, (grid,), (32 * cfg["WARPS"],), (x, w, i32(B), i32(N), i32(K), i32(prefetch), ptr_or_null(scale),
                                                   *(NO_NORM if norm is None else norm.args(B, K)), *extra),
           shared_mem=0 if norm is None else x.nbytes, pdl=pdl)
    return count


def gemv(x: cp.ndarray, w, out: cp.ndarray | None = None, pdl: bool = False,
         config: dict | None = None, norm: NormIn | None = None) -> cp.ndarray:
    """out (B, N) float32 = x (B, K) @ w (N, K)^T; B <= 16, K a multiple of 8, 16-bit operands
    (or w an Fp8Matrix, K a multiple of 16, or a Q8Matrix, K a multiple of 32). norm: x's rows
    are made from it (NormIn; x gives their shape and type and is neither read nor written).
    config: gemv.cu's shape constants (staged with a STAGED key), instead of the ones chosen for
    the matrix and B.

    Each output element is computed the same way whatever B is (batch invariance).
    """
    if out is None:
        out = cp.empty((x.shape[0], w.shape[0]), np.float32)
    check(out, "out", np.float32, (x.shape[0], w.shape[0]))
    _launch("gemv", x, w, (out,), pdl, config, norm)
    return out


def gemv_keys(x: cp.ndarray, w, out: cp.ndarray, keys: cp.ndarray, pdl: bool = False) -> int:
    """gemv's out = x @ w^T (an LM head's logits), and for each row the greedy key (common.cuh's
    greedy_key: the largest logit with its token, ties to the lower token, NaN never) of each
    tile of the product's features in keys (B, >= ceil(N / 8)) uint64: the max of a row's keys is
    the token sample_tokens' argmax would take from out, found there by reading `tiles` keys
    instead of N logits (sampling.sample_tokens' keys). Returns the tile count; keys past it
    are left as they were. The logits' bits are gemv's."""
    check(out, "out", np.float32, (x.shape[0], w.shape[0]))
    check(keys, "keys", np.uint64)
    most = -(-w.shape[0] // 8)  # tiles of one 8-feature tile a block: the most any form takes
    if keys.ndim != 2 or keys.shape[0] != x.shape[0] or keys.shape[1] < most:
        raise ValueError(f"gemv_keys: keys needs ({x.shape[0]}, >= {most}), got {keys.shape}")
    return _launch("gemv_keys", x, w, (out, keys, i32(keys.shape[1])), pdl, None)


def gemv_silu(x: cp.ndarray, w, out: cp.ndarray, pdl: bool = False, norm: NormIn | None = None) -> cp.ndarray:
    """out (B, inter) 16-bit = SiLU(x @ gate^T) * (x @ up^T), w = [gate; up] (2 inter, K).

    The same bits as gemv followed by activation.silu_mul; inter must be a multiple of 8.
    norm: as gemv's.
    """
    inter = w.shape[0] // 2
    if w.shape[0] % 16:
        raise ValueError(f"gemv_silu: 2 * intermediate = {w.shape[0]} must be a multiple of 16")
    check_scalar(out, "out")
    check(out, "out", x.dtype, (x.shape[0], inter))
    _launch("gemv_silu", x, w, (out,), pdl, None, norm)
    return out


def gemv_rope(x: cp.ndarray, w, positions: cp.ndarray, cos: cp.ndarray, sin: cp.ndarray,
              k_ptrs: cp.ndarray, v_ptrs: cp.ndarray, layer_offset: int, num_heads: int, num_kv_heads: int,
              q_out: cp.ndarray, bias: cp.ndarray | None = None, pdl: bool = False,
              kv_fp8: bool = False, norm: NormIn | None = None) -> cp.ndarray:
    """The QKV product with RoPE and the KV-cache write in its epilogue: the same bits as
    gemv followed by rope.rope_kv_write (see there for the arguments). norm: as gemv's."""
    B = x.shape[0]
    head_dim = q_out.shape[-1]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if w.shape[0] != width or head_dim % 16:
        raise ValueError(f"gemv_rope: w has {w.shape[0]} rows, expected {width}; head_dim {head_dim} "
                         "must be a multiple of 16")
    check_rope_args(B, width, positions, cos, sin, k_ptrs, v_ptrs, q_out, num_heads, head_dim, bias)
    check(q_out, "q_out", x.dtype)
    _launch("gemv_rope", x, w, (ptr_or_null(bias), positions, cos, sin, q_out, k_ptrs, v_ptrs, i64(layer_offset),
                                i32(num_heads), i32(num_kv_heads)), pdl, None, norm, HEAD_DIM=head_dim,
            KV_FP8=int(kv_fp8))
    return q_out

"""SiLU(gate) * up (activation.cu)."""

from __future__ import annotations

import cupy as cp
import numpy as np

from ._module import (MAX_BLOCK_SMEM, blocks_per_sm, check, check_scalar, function, i32, launch, module, prod_kind,
                      quant_out_args, quant_out_target, scale_args, sm90_or_newer, sm_count, use_bf16,
                      wide_threads)


# most threads a block (one row each) in steps of _module.WIDE_MIN_ROWS rows or more; SILU_VEC
# follows. H200, 2,048 rows of Llama-3-8B's 14,336: 256 threads (7 groups a thread) 54 us against
# 78 us with 1,024 (2 a thread) for the float8 path's codes, 46 vs 58 us for a 16-bit output
SILU_THREADS = 256
# such blocks an SM must hold at least (activation.cu's -DSILU_MIN_BLOCKS: registers capped at 80
# a thread, 88 uncapped for the e4m3 codes, which fit two): H200, the float8 path's codes, bf16
# raw sums with their scales, 2,048 x 14,336: 68.0 -> 58.7 us; 1,024 rows 36.6 -> 32.1 us; four
# (64 registers) spill and are no faster. Same bits. Up to 7 groups a thread (8 spill a little).
SILU_MIN_BLOCKS = 3

# Steps of at least SILU_BULK_MIN_ROWS rows of a 16-bit product (sm_90) take silu_mul_bulk: blocks
# of SILU_BULK_THREADS threads, as many an SM as fit, each row's [gate | up] a bulk copy
# SILU_BULK_STAGES rows ahead. H200, Llama-3-8B's 14,336, bfloat16 into e4m3 codes, graphs of 24
# launches over three inputs (so from HBM), us a launch: 2,040 rows 48.5 -> 40.3 (3.0 -> 3.6 TB/s;
# three stages, one block an SM: 39.4), 1,024 rows 25.5 -> 22.6, 256 rows 7.5 -> 7.1. Same bits.
# In place it gains less: a mixed step's 32 (2,040 rows, eager, events) 1.718 -> 1.650 ms; a
# 256-row decode graph's SiLU stage 40.0 us either way (docs/performance.md, forty-ninth session).
SILU_BULK_MIN_ROWS = 256
SILU_BULK_THREADS = 512
SILU_BULK_STAGES = 2
# the shared memory silu_mul_bulk may take (its own barriers and scratch aside): the attribute is
# set to this once a kernel, since the rows' length (so its need) is a launch argument, not built in
SILU_BULK_SMEM = MAX_BLOCK_SMEM - 1024


def _shape(rows: int, inter: int) -> tuple[int, int]:
    """(threads, SILU_VEC) of `rows` rows of `inter` outputs: every 8-value group of a row in
    a thread's registers (up to 8 groups a thread)."""
    threads = wide_threads(rows, inter, 8, SILU_THREADS)
    return threads, max(1, min(8, -(-inter // (8 * threads))))


_bulk_fits: dict[int, bool] = {}  # a build of silu_mul_bulk -> whether its registers allow SILU_BULK_THREADS


def _bulk(rows: int, inter: int, prod: int, defines: dict) -> tuple | None:
    """silu_mul_bulk's (kernel, grid, threads, shared memory) for these rows, or None where the
    one-block-a-row kernel takes them (SILU_BULK_MIN_ROWS; a float32 product; not sm_90; a row
    whose groups do not fit the block's registers or whose stages do not fit shared memory; a
    build whose registers a thread leave too few for a block of SILU_BULK_THREADS)."""
    vec = -(-inter // (8 * SILU_BULK_THREADS))
    smem = SILU_BULK_STAGES * 2 * inter * 2  # stages of [gate | up] rows, 16-bit (a float32 product: None below)
    if rows < SILU_BULK_MIN_ROWS or prod == 0 or inter % 8 or vec > 8 or smem > SILU_BULK_SMEM or not sm90_or_newer():
        return None
    kernel = function(module("activation", SILU_VEC=vec, SILU_STAGES=SILU_BULK_STAGES, **defines), "silu_mul_bulk",
                      SILU_BULK_SMEM)
    fits = _bulk_fits.get(kernel.kernel.ptr)
    if fits is None:  # H200, the 8B shape's build (4 groups a thread): 87 registers, blocks of up to 640
        fits = _bulk_fits[kernel.kernel.ptr] = kernel.max_threads_per_block >= SILU_BULK_THREADS
    if not fits:
        return None
    grid = min(rows, sm_count() * blocks_per_sm(kernel, SILU_BULK_THREADS, smem))
    return kernel, grid, SILU_BULK_THREADS, smem


def silu_mul(gate_up: cp.ndarray, out: cp.ndarray | None = None, out_dtype=np.float16,
             pdl: bool = False, scales: tuple | None = None, quant: tuple | None = None,
             codes_only: bool = False) -> cp.ndarray:
    """gate_up (T, 2 I) a matrix product (float32, float16 or bfloat16) -> out (T, I) 16-bit;
    scales: gate_up is a float8 product's raw sums, (per token, per feature) scales
    (_module.scale_args). quant: (codes, scales) to write out's rows as e4m3 into too
    (_module.quant_out_args); with codes_only, into them alone (out is left as it was)."""
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: expected (T, 2 * inter), got {gate_up.shape}")
    prod = prod_kind(gate_up, "gate_up")
    check(gate_up, "gate_up", gate_up.dtype)
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = cp.empty((T, inter), out_dtype)
    check_scalar(out, "out")
    check(out, "out", out.dtype, (T, inter))
    quant_out, q_args = quant_out_args(quant, T, inter)
    if not T:
        return out
    defines = {"USE_BF16": use_bf16(out), "PROD": prod, "QUANT_OUT": quant_out}
    args = (gate_up, quant_out_target(out, quant, codes_only), i32(inter), *scale_args(scales, T, 2 * inter), *q_args)
    bulk = _bulk(T, inter, prod, defines)
    if bulk is not None:
        kernel, grid, threads, smem = bulk
        launch(kernel, (grid,), (threads,), (*args, i32(T)), shared_mem=smem, pdl=pdl)
        return out
    threads, vec = _shape(T, inter)
    bounds = ({"SILU_BLOCK": threads, "SILU_MIN_BLOCKS": SILU_MIN_BLOCKS}
              if threads == SILU_THREADS and vec <= 7 else {})  # 8 groups a thread would spill
    launch(module("activation", SILU_VEC=vec, **defines, **bounds).get_function("silu_mul"), (T,), (threads,), args,
           pdl=pdl)
    return out

"""RMSNorm and fused residual-add + RMSNorm (rmsnorm.cu)."""

from __future__ import annotations

import cupy as cp
import numpy as np

from ._module import (WIDE_MIN_ROWS, check, check_scalar, f32, i32, i64, launch, module, prod_kind, ptr_or_null,
                      quant_out_args, quant_out_target, row_group_fits, row_group_grid, scale_args, use_bf16)

# Threads a block (one row) below _module.WIDE_MIN_ROWS rows: decode steps (gemv.NormIn sums in
# this block's order).
THREADS = 512
# Steps of WIDE_MIN_ROWS rows or more (prefill, mixed) take WIDE_THREADS a row, or more for rows
# over 8 float4 a thread. H200, Llama-3-8B's 4,096 with a float8 product's delta and codes out:
# 2,048 rows 36.6 -> 33.3 us, 8,192 rows 131.6 -> 115.5 us (512 rows: 14.1 vs 14.5; 128 threads
# holding 8 float4: 37.6 and 127.5). Their sums add in another order than at THREADS, so those
# steps' bits differ from a decode step's (as their cuBLAS products' already do).
WIDE_THREADS = 256
# Steps of AHEAD_MIN_ROWS rows or more issue all of a thread's loads at once (rmsnorm.cu's
# -DNORM_AHEAD; the same arithmetic, the same bits). H200, add + RMSNorm of 4,096 with a float8
# product's delta and codes out, us: 1,024 rows 12.35 -> 11.82, 2,048 35.5 -> 31.8, 8,192 126.8
# -> 108.9; 16-bit out 31.3 -> 30.5 and 115.8 -> 114.1 at 2,048 / 8,192. Fewer rows lose by it
# (512: 7.5 -> 8.1 us, 16-bit 5.0 -> 5.9; 128: 3.45 -> 3.69).
AHEAD_MIN_ROWS = 1024
# A 16-bit residual stream in steps of ROWS_MIN_ROWS rows or more takes add_rms_norm_rows
# (rmsnorm.cu): ROW_THREADS threads a row, two rows a block, where the row divides into 8 x
# ROW_THREADS values, a thread holds at most ROW_MAX_CHUNKS of 8, and the delta is in one part.
# H200, 4,096 a row, a bfloat16 stream, a bfloat16 delta, e4m3 codes out, captured graphs, us
# (raw sums with their scales / scaled already), norm_row's blocks -> add_rms_norm_rows: 2,040 rows
# 24.32 / 22.84 -> 17.58 / 16.71 (a floor of 13.9 us: 7 bytes a value at 4.2 TB/s), 1,024 13.55 /
# 12.57 -> 10.25 / 10.25, 512 5.90 / 5.77 -> 5.04 / 4.69, 256 3.63 / 3.57 -> 3.22 / 2.98, 128 2.95 /
# 2.88 -> 2.84 / 2.63. 64 threads a row, or launch bounds for 3-4 blocks an SM, were slower. A
# float32 stream (11 bytes a value) gained with scaled raw sums at 2,040 rows and lost elsewhere
# (2,040 rows: 28.84 -> 27.63 and 26.18 -> 29.65; 1,024: 15.07 -> 16.34 and 13.68 -> 16.14), so it
# keeps norm_row.
ROWS_MIN_ROWS = 128
ROW_THREADS = 128
ROW_MAX_CHUNKS = 8


def _shape(rows: int, hidden: int) -> tuple[int, int, int]:
    """(threads, NORM_VEC, NORM_AHEAD) of a launch over `rows` rows of `hidden` values (a row
    past what the registers hold goes through the kernel's plain loop)."""
    if rows < WIDE_MIN_ROWS:
        return THREADS, 4, 0
    n4 = -(-hidden // 4)
    threads = min(1024, max(WIDE_THREADS, -(-n4 // (8 * 32)) * 32))
    return threads, max(1, min(8, -(-n4 // threads))), int(rows >= AHEAD_MIN_ROWS)


def _out(out, rows, hidden, dtype):
    if out is None:
        out = cp.empty((rows, hidden), dtype)
    check_scalar(out, "out")
    check(out, "out", out.dtype, (rows, hidden))
    return out


def _res16(residual: cp.ndarray, out: cp.ndarray, name: str) -> int:
    """-DRES16 of a residual stream: 0 for float32, 1 for 16 bits of out's type (rmsnorm.cu)."""
    if residual.dtype == np.float32:
        check(residual, name, np.float32)
        return 0
    check(residual, name, out.dtype)
    return 1


def rms_norm(x: cp.ndarray, weight: cp.ndarray, eps: float, out: cp.ndarray | None = None,
             out_dtype=np.float16, pdl: bool = False, quant: tuple | None = None,
             codes_only: bool = False) -> cp.ndarray:
    """out (rows, hidden) 16-bit = x / rms(x) * weight; x float32 (or 16-bit, of out's
    type: a residual stream kept in 16 bits, see add_rms_norm; many rows of it take
    add_rms_norm_rows without a delta, rows_kernel), weight float32. quant: (codes, scales) to
    write out's rows as e4m3 into too (_module.quant_out_args); with codes_only, into them alone
    (out is left as it was)."""
    if x.ndim != 2:
        raise ValueError(f"x: expected (rows, hidden), got {x.shape}")
    rows, hidden = x.shape
    check(weight, "weight", np.float32, (hidden,))
    out = _out(out, rows, hidden, out_dtype)
    res16 = _res16(x, out, "x")
    quant_out, q_args = quant_out_args(quant, rows, hidden)
    if rows_kernel(rows, hidden, res16, 1):  # a 16-bit residual stream of many rows: normed as stored
        _rows(x, None, 0, None, weight, out, eps, None, (quant_out, q_args), quant_out_target(out, quant, codes_only),
              pdl)
    elif rows:
        threads, vec, ahead = _shape(rows, hidden)
        launch(module("rmsnorm", USE_BF16=use_bf16(out), QUANT_OUT=quant_out, NORM_VEC=vec,
                      NORM_AHEAD=ahead, RES16=res16).get_function("rms_norm"),
               (rows,), (threads,),
               (x, weight, quant_out_target(out, quant, codes_only), i32(hidden), f32(eps), *q_args), pdl=pdl)
    return out


def add_rms_norm(residual: cp.ndarray, delta: cp.ndarray, weight: cp.ndarray, eps: float,
                 out: cp.ndarray | None = None, bias: cp.ndarray | None = None,
                 out_dtype=np.float16, pdl: bool = False, scales: tuple | None = None,
                 quant: tuple | None = None, codes_only: bool = False) -> cp.ndarray:
    """residual += delta (+ bias), in place; out = rms_norm(residual) * weight. delta: a
    matrix product's output, float32 or 16 bits (float16, or bfloat16 as uint16 bits: as
    cuBLAS / cuBLASLt write it in steps of many rows); scales: delta is a float8 product's raw
    sums; (per token, per feature) scales (_module.scale_args). quant, codes_only: as
    rms_norm's. A float32 delta may also be (P, rows, hidden), a view whose parts lie apart
    (each part's rows contiguous): the parts are added in order first. The residual stream is
    float32, or 16 bits of out's type: each sum is then rounded to 16 bits before it is normed
    (as a 16-bit model adds its residual stream; the runner's steps of many rows in bfloat16)."""
    if residual.ndim != 2:
        raise ValueError(f"residual: expected (rows, hidden), got {residual.shape}")
    rows, hidden = residual.shape
    prod = prod_kind(delta, "delta")
    parts, stride = delta_parts(delta, rows, hidden, "delta", delta.dtype)
    check(weight, "weight", np.float32, (hidden,))
    if bias is not None:
        check(bias, "bias", np.float32, (hidden,))
    out = _out(out, rows, hidden, out_dtype)
    res16 = _res16(residual, out, "residual")
    quant_out, q_args = quant_out_args(quant, rows, hidden)
    if rows_kernel(rows, hidden, res16, parts):
        _rows(residual, delta, prod, bias, weight, out, eps, scales, (quant_out, q_args),
              quant_out_target(out, quant, codes_only), pdl)
    elif rows:
        threads, vec, ahead = _shape(rows, hidden)
        launch(module("rmsnorm", USE_BF16=use_bf16(out), QUANT_OUT=quant_out, NORM_VEC=vec, NORM_AHEAD=ahead,
                      PROD=prod, RES16=res16).get_function("add_rms_norm"), (rows,), (threads,),
               (residual, delta, ptr_or_null(bias), weight, quant_out_target(out, quant, codes_only), i32(hidden),
                f32(eps), *scale_args(scales, rows, hidden), *q_args, i64(stride), i32(parts)), pdl=pdl)
    return out


def _rows(residual: cp.ndarray, delta: cp.ndarray | None, prod: int, bias: cp.ndarray | None, weight: cp.ndarray,
          out: cp.ndarray, eps: float, scales: tuple | None, quant_q: tuple, target, pdl: bool) -> None:
    """add_rms_norm_rows over a 16-bit residual stream's rows (rows_kernel), with its caller's
    checked arguments: prod (-DPROD of delta), quant_q (quant_out_args'), target (the output,
    quant_out_target's); no delta: the stream normed as stored, and not written (-DROW_DELTA=0)."""
    rows, hidden = residual.shape
    quant_out, q_args = quant_q
    mod = module("rmsnorm", USE_BF16=use_bf16(out), QUANT_OUT=quant_out, RES16=1, ROW_THREADS=ROW_THREADS,
                 HIDDEN=hidden, ROW_SCALED=int(scales is not None), ROW_BIAS=int(bias is not None),
                 ROW_DELTA=int(delta is not None), PROD=prod)
    launch(mod.get_function("add_rms_norm_rows"), *row_group_grid(rows, ROW_THREADS),
           (residual, ptr_or_null(delta), ptr_or_null(bias), weight, target, i32(rows), f32(eps),
            *scale_args(scales, rows, hidden), *q_args), pdl=pdl)


def rows_kernel(rows: int, hidden: int, res16: int, parts: int) -> bool:
    """Whether add_rms_norm takes add_rms_norm_rows (ROWS_MIN_ROWS) for this launch."""
    return bool(res16) and rows >= ROWS_MIN_ROWS and parts == 1 and row_group_fits(hidden, ROW_THREADS, ROW_MAX_CHUNKS)


def delta_parts(delta: cp.ndarray, rows: int, hidden: int, name: str, dtype=np.float32) -> tuple[int, int]:
    """(parts, floats from one part to the next) of a delta (rows, hidden) of `dtype`, or a
    float32 (P, rows, hidden) in parts whose rows are each contiguous (attn_block's o
    product), checked."""
    if delta.ndim != 3:
        check(delta, name, dtype, (rows, hidden))
        return 1, 0
    check(delta, name, np.float32, (delta.shape[0], rows, hidden), contiguous=False)
    if delta.strides[1:] != (hidden * 4, 4) or delta.strides[0] % 4:
        raise ValueError(f"{name}: each part must hold its rows contiguously")
    return delta.shape[0], delta.strides[0] // 4

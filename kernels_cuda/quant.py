"""float8 e4m3 rows with a float32 scale each (quant.cu): the weights and activations of
--quantization fp8."""

from __future__ import annotations

from dataclasses import dataclass

import cupy as cp
import numpy as np

from ._module import check, i32, launch, module, row_group_fits, row_group_grid, threads_for, use_bf16


@dataclass
class CodesMatrix:
    """A weight matrix (N, K) held as one-byte codes (data) and their scales (scale)."""

    data: cp.ndarray
    scale: cp.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes


@dataclass
class Fp8Matrix(CodesMatrix):
    """A weight matrix W (N, K) as e4m3 codes (data: (N, K) uint8) and a scale per row (scale:
    (N,) float32): W ~ data * scale[:, None]."""


@dataclass
class Q8Matrix(CodesMatrix):
    """A GGUF Q8_0 weight matrix W (N, K) kept as it is: int8 codes (data: (N, K) int8) and a
    float16 scale for each 32 values of a row (scale: (N, K / 32) float16), W = data * scale
    repeated 32 times along K (gemv.cu's W_Q8)."""


# Steps of GROUP_MIN_ROWS rows or more take quantize_rows_group (quant.cu): GROUP_THREADS threads a
# row, where the row divides into 8 x GROUP_THREADS values and a thread holds at most
# GROUP_MAX_CHUNKS of 8. The same bits as quantize_rows. H200, 4,096 float16 a row (the attention's
# output before the o product), captured graphs, us, one block of 512 threads a row against 128
# threads a row: 2,040 rows 8.36 -> 6.82, 1,024 4.15 -> 3.06, 512 2.52 -> 2.14, 256 1.90 -> 1.74, 128
# 1.51 -> 1.55 (64 threads a row: 6.91 / 3.23 / 2.37 / 2.12 / 2.06; 32: as the blocks).
GROUP_MIN_ROWS = 256
GROUP_THREADS = 128
GROUP_MAX_CHUNKS = 8


def group_kernel(rows: int, K: int) -> bool:
    """Whether quantize_rows takes quantize_rows_group (GROUP_MIN_ROWS) for this launch."""
    return rows >= GROUP_MIN_ROWS and row_group_fits(K, GROUP_THREADS, GROUP_MAX_CHUNKS)


def quantize_rows(x: cp.ndarray, q: cp.ndarray | None = None, scale: cp.ndarray | None = None,
                  pdl: bool = False) -> tuple[cp.ndarray, cp.ndarray]:
    """x (rows, K) 16-bit -> q (rows, K) e4m3 codes, scale (rows,) float32 = max |row| / 448
    (1 for a row of zeros); K a multiple of 8."""
    if x.ndim != 2 or x.shape[1] % 8:
        raise ValueError(f"quantize_rows: x must be (rows, K) with K a multiple of 8, got {x.shape}")
    rows, K = x.shape
    check(x, "x", x.dtype)
    q = cp.empty((rows, K), np.uint8) if q is None else q
    scale = cp.empty(rows, np.float32) if scale is None else scale
    check(q, "q", np.uint8, (rows, K))
    check(scale, "scale", np.float32, (rows,))
    if rows and group_kernel(rows, K):
        mod = module("quant", USE_BF16=use_bf16(x), Q_ROW_THREADS=GROUP_THREADS, Q_K=K)
        launch(mod.get_function("quantize_rows_group"), *row_group_grid(rows, GROUP_THREADS),
               (x, q, scale, i32(rows)), pdl=pdl)
    elif rows:
        launch(module("quant", USE_BF16=use_bf16(x)).get_function("quantize_rows"), (rows,), (threads_for(K, 8),),
               (x, q, scale, i32(K)), pdl=pdl)
    return q, scale


def quantize_matrix(w: cp.ndarray) -> Fp8Matrix:
    """A 16-bit weight matrix (N, K) -> Fp8Matrix, a scale per output feature."""
    q, scale = quantize_rows(w)
    return Fp8Matrix(q, scale)

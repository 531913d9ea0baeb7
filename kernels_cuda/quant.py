"""float8 e4m3 rows with a float32 scale each (quant.cu): the weights and activations of
--quantization fp8."""

from __future__ import annotations

from dataclasses import dataclass

import cupy as cp
import numpy as np

from ._module import check, i32, launch, module, threads_for, use_bf16


@dataclass
class Fp8Matrix:
    """A weight matrix W (N, K) as e4m3 codes and a scale per row: W ~ data * scale[:, None]."""

    data: cp.ndarray  # (N, K) uint8, e4m3 codes
    scale: cp.ndarray  # (N,) float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes


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
    if rows:
        launch(module("quant", USE_BF16=use_bf16(x)).get_function("quantize_rows"), (rows,), (threads_for(K, 8),),
               (x, q, scale, i32(K)), pdl=pdl)
    return q, scale


def quantize_matrix(w: cp.ndarray) -> Fp8Matrix:
    """A 16-bit weight matrix (N, K) -> Fp8Matrix, a scale per output feature."""
    q, scale = quantize_rows(w)
    return Fp8Matrix(q, scale)

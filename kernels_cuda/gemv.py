"""Skinny matrix products for decode batches of 1 to 16 rows on the tensor cores (gemv.cu)."""

from __future__ import annotations

import cupy as cp
import numpy as np

from ._module import check, i32, launch, module, same_scalar, use_bf16

# The runner uses this kernel for every step of up to MAX_ROWS rows, so a sequence's logits
# do not depend on what else is in such a step. H200 sweep (`bench/kernels.py --gemv-sweep`,
# Llama-3-8B matrices): ~3 % faster than cuBLAS at 1 and 8 rows, ~16 % slower at 16;
# invariance was kept over those 16 % for 9-16 rows.
MAX_ROWS = 16
# gemv.cu's shape constants (warps per block, chunks per pass), chosen with
# `bench/kernels.py --gemv-sweep`.
CONFIG = {"WARPS": 8, "DEPTH": 8}
PREFETCH_BUDGET = 12 << 20  # bytes of a matrix asked into the L2 while the previous kernel ends


def gemv(x: cp.ndarray, w: cp.ndarray, out: cp.ndarray | None = None, pdl: bool = False,
         config: dict | None = None) -> cp.ndarray:
    """out (B, N) float32 = x (B, K) @ w (N, K)^T; B <= 16, K a multiple of 8, 16-bit operands.

    Each output element is computed the same way whatever B is (batch invariance).
    """
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv: x {x.shape} and w {w.shape} do not chain")
    B, K = x.shape
    N = w.shape[0]
    if not 1 <= B <= MAX_ROWS:
        raise ValueError(f"gemv: {B} rows (1..{MAX_ROWS}); use gemm for more")
    if K % 8:
        raise ValueError(f"gemv: K={K} must be a multiple of 8")
    same_scalar(x, w, "x, w")
    check(x, "x", x.dtype)
    check(w, "w", w.dtype)
    if out is None:
        out = cp.empty((B, N), np.float32)
    check(out, "out", np.float32, (B, N))
    cfg = config or CONFIG
    prefetch = min(2 * K, PREFETCH_BUDGET // N) // 16 * 16  # the first bytes of every row
    name = "gemv_8" if B <= 8 else "gemv_16"
    launch(module("gemv", USE_BF16=use_bf16(w), **cfg).get_function(name),
           ((N + 7) // 8,), (32 * cfg["WARPS"],), (x, w, out, i32(B), i32(N), i32(K), i32(prefetch)), pdl=pdl)
    return out

"""Skinny matrix products for decode batches of 1 to 16 rows on the tensor cores (gemv.cu)."""

from __future__ import annotations

import cupy as cp
import numpy as np

from ._module import check, i32, launch, module, same_scalar, use_bf16

MAX_ROWS = 16
# gemv.cu's shape constants: warps per block, 8-feature tiles per block, 16-byte loads per
# lane per chunk, and the depth of the weight pipeline (STAGES > 0: a cp.async ring in
# shared memory; 0: DEPTH register loads per pass). Chosen by `bench/kernels.py --gemv-sweep`.
CONFIG = {"WARPS": 8, "NTILE": 1, "VEC": 1, "STAGES": 8, "DEPTH": 8}


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
    feats = 8 * cfg["NTILE"]
    name = "gemv_8" if B <= 8 else "gemv_16"
    launch(module("gemv", USE_BF16=use_bf16(w), **cfg).get_function(name),
           ((N + feats - 1) // feats,), (32 * cfg["WARPS"],), (x, w, out, i32(B), i32(N), i32(K)), pdl=pdl)
    return out

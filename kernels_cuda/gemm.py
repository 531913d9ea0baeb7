"""y = x @ W^T through cuBLAS (gemmEx: 16-bit operands, float32 output and accumulation)."""

from __future__ import annotations

import cupy as cp
import numpy as np
from cupy.cuda import cublas

from ._module import check, same_scalar

CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
_ONE = np.array(1.0, np.float32)
_ZERO = np.array(0.0, np.float32)


def gemm(x: cp.ndarray, w: cp.ndarray, out: cp.ndarray | None = None) -> cp.ndarray:
    """out (M, N) float32 = x (M, K) @ w (N, K)^T, on the current stream."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemm: x {x.shape} and w {w.shape} do not chain")
    same_scalar(x, w, "x, w")
    check(x, "x", x.dtype)
    check(w, "w", w.dtype)
    M, K = x.shape
    N = w.shape[0]
    if out is None:
        out = cp.empty((M, N), np.float32)
    check(out, "out", np.float32, (M, N))
    if M == 0:
        return out
    dtype = CUDA_R_16BF if w.dtype == np.uint16 else CUDA_R_16F
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    # row-major out (M, N) is column-major out^T (N, M) = W (N, K) x^T (K, M)
    cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, N, M, K,
                  _ONE.ctypes.data, w.data.ptr, dtype, K, x.data.ptr, dtype, K,
                  _ZERO.ctypes.data, out.data.ptr, CUDA_R_32F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    return out

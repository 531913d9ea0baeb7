"""y = x @ W^T through cuBLAS (gemmEx: 16-bit operands, float32 output and accumulation).

cuBLAS is called through ctypes on the library CuPy loaded: CuPy's own wrappers refuse
to run during stream capture, which the decode graphs need (cuBLAS itself supports it).
"""

from __future__ import annotations

import ctypes

import cupy as cp
import numpy as np

from ._module import check, same_scalar

CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
_ONE = ctypes.c_float(1.0)
_ZERO = ctypes.c_float(0.0)
_lib: ctypes.CDLL | None = None


def _cublas() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        from cupy.cuda import cublas as _  # noqa: F401 - makes CuPy load libcublas
        path = None
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib
            path = load_nvidia_dynamic_lib("cublas").abs_path
        except Exception:  # noqa: BLE001 - older CuPy: fall back to the sonames
            pass
        for name in [p for p in (path, "libcublas.so.13", "libcublas.so.12", "libcublas.so") if p]:
            try:
                _lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise RuntimeError("cannot find libcublas")
        v, i = ctypes.c_void_p, ctypes.c_int
        _lib.cublasSetStream_v2.argtypes = [v, v]
        _lib.cublasGemmEx.argtypes = [v, i, i, i, i, i, v, v, i, i, v, i, i, v, v, i, i, i, i]
    return _lib


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
    lib = _cublas()
    handle = cp.cuda.device.get_cublas_handle()
    status = lib.cublasSetStream_v2(handle, cp.cuda.get_current_stream().ptr)
    if status:
        raise RuntimeError(f"cublasSetStream failed ({status})")
    # row-major out (M, N) is column-major out^T (N, M) = W (N, K) x^T (K, M)
    status = lib.cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, ctypes.byref(_ONE), w.data.ptr, dtype, K,
                              x.data.ptr, dtype, K, ctypes.byref(_ZERO), out.data.ptr, CUDA_R_32F, N,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    if status:
        raise RuntimeError(f"cublasGemmEx failed ({status}) for ({M}x{K}) @ ({N}x{K})^T")
    return out

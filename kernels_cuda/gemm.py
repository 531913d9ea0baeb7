"""y = x @ W^T through cuBLAS (gemmEx: 16-bit operands, float32 accumulation, float32 or
16-bit output), and its float8 form through cuBLASLt (--quantization fp8: e4m3 codes in,
the sums of their products out, in float32 or bfloat16, the scales applied by the kernel
that reads them; or, gemm_fp8_scaled, the scales applied in cuBLASLt's epilogue).

cuBLAS is called through ctypes on the library CuPy loaded: CuPy's own wrappers refuse
to run during stream capture, which the decode graphs need (cuBLAS itself supports it).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import cupy as cp
import numpy as np

from ._module import (MAX_BLOCK_SMEM, ByValue, _cuda_driver, check, function, i32, launch_ex, module, same_scalar,
                      wgmma_supported)
from .quant import Fp8Matrix

CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 0, 2, 14, 28
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
_ONE = ctypes.c_float(1.0)
_ZERO = ctypes.c_float(0.0)
_lib: ctypes.CDLL | None = None


def _load(name: str) -> ctypes.CDLL:
    """libcublas / libcublasLt: the copy CuPy's packages bring, else by soname."""
    from cupy.cuda import cublas as _  # noqa: F401 - makes CuPy load libcublas
    path = None
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        path = load_nvidia_dynamic_lib(name).abs_path
    except Exception:  # noqa: BLE001 - older CuPy: fall back to the sonames
        pass
    for soname in [p for p in (path, f"lib{name}.so.13", f"lib{name}.so.12", f"lib{name}.so") if p]:
        try:
            return ctypes.CDLL(soname)
        except OSError:
            continue
    raise RuntimeError(f"cannot find lib{name}")


def _cublas() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = _load("cublas")
        v, i = ctypes.c_void_p, ctypes.c_int
        _lib.cublasSetStream_v2.argtypes = [v, v]
        _lib.cublasGemmEx.argtypes = [v, i, i, i, i, i, v, v, i, i, v, i, i, v, v, i, i, i, i]
    return _lib


_OUT_TYPES = {np.dtype(np.float32): CUDA_R_32F, np.dtype(np.float16): CUDA_R_16F, np.dtype(np.uint16): CUDA_R_16BF}


def _out_type(out: cp.ndarray, allowed: tuple) -> int:
    if out.dtype not in allowed:  # a dtype equals its scalar type: no conversion on the hot path
        raise ValueError(f"out: expected one of {[np.dtype(d).name for d in allowed]}, got {out.dtype}")
    return _OUT_TYPES[out.dtype]


def gemm(x: cp.ndarray, w: cp.ndarray, out: cp.ndarray | None = None) -> cp.ndarray:
    """out (M, N) = x (M, K) @ w (N, K)^T, on the current stream, accumulated in float32;
    out float32 or x's 16-bit type (default float32)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemm: x {x.shape} and w {w.shape} do not chain")
    same_scalar(x, w, "x, w")
    check(x, "x", x.dtype)
    check(w, "w", w.dtype)
    M, K = x.shape
    N = w.shape[0]
    if out is None:
        out = cp.empty((M, N), np.float32)
    out_type = _out_type(out, (np.float32, x.dtype))
    check(out, "out", out.dtype, (M, N))
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
                              x.data.ptr, dtype, K, ctypes.byref(_ZERO), out.data.ptr, out_type, N,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    if status:
        raise RuntimeError(f"cublasGemmEx failed ({status}) for ({M}x{K}) @ ({N}x{K})^T")
    return out


# ---------------------------------------------------------------------------- float8 (cuBLASLt)
# cublasLt.h constants. gemm_fp8's product is of the codes alone, and the readers of its
# output (rope_kv_write, silu_mul, add_rms_norm) multiply by the token's and the feature's
# scale (common.cuh's dequant). gemm_fp8_scaled has cuBLASLt scale A's rows and B's columns
# in its epilogue instead (the "outer vector" scale modes, _LT_*_SCALE_*): cuBLASLt 13.1 on
# the H200 has one algorithm for them, bfloat16 out (docs/performance.md, thirty-first and
# thirty-second sessions).
# A product runs with cuBLASLt's workspace only where its algorithm asks for one, and the
# heuristic is asked first for algorithms that need none (_Lt._untuned). An algorithm given a
# workspace may take a tile scheduler whose 4-byte counter cuBLASLt zeroes with a memset before
# each product; in a serving step that left the device idle ~4.5 us a product, against ~0.5 us
# between kernels otherwise. With none it takes a static schedule (H200, 2,041-token mixed steps,
# the scaled products: 28.78 -> 28.52 ms a step, their kernels 0.6 % slower; lone prompts of 128
# / 512 tokens, every product: 4.62 -> 4.41 / 8.16 -> 7.92 ms; fifty-fourth session). Products
# tuned by timing (tune_gemm_fp8) choose among all the heuristic's algorithms.
_LT_TRANSA, _LT_TRANSB, _LT_FAST_ACCUM = 3, 4, 25
_LT_A_SCALE_POINTER, _LT_B_SCALE_POINTER, _LT_A_SCALE_MODE, _LT_B_SCALE_MODE = 17, 18, 31, 32
_LT_SCALE_OUTER_VEC_32F = 3
_LT_PREF_MAX_WORKSPACE_BYTES = 1
LT_WORKSPACE_BYTES = 32 << 20
# Hopper's fp8 MMAs add into a reduced-precision accumulator unless cuBLASLt promotes the
# sums to float32 now and then; fast accumulation (gemm_fp8's fast_accum) skips that. H200,
# 8B shapes: 7-10 % faster at 1-2k rows, none at 256; rms error 1.7e-3 of the sums at K =
# 4,096 and 3.2e-3 at 14,336, against 2e-4 promoted and 3.6e-2 for e4m3's own rounding of
# the inputs (docs/performance.md, twenty-fifth session).


def rows_bucket(M: int) -> int:
    """A product's power-of-two bucket of rows (at least 16): one choice of kernel each."""
    return max(16, 1 << (M - 1).bit_length())


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class _Lt:
    """One cuBLASLt handle, a workspace, and a plan (descriptors + algorithm) per shape."""

    def __init__(self) -> None:
        lib = _load("cublasLt")
        v, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        lib.cublasLtCreate.argtypes = [ctypes.POINTER(v)]
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(v), i, i]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [v, i, v, sz]
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(v), i, u64, u64, i64]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(v)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [v, i, v, sz]
        lib.cublasLtMatmulPreferenceDestroy.argtypes = [v]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [v, v, v, v, v, v, v, i, ctypes.POINTER(_HeuristicResult),
                                                       ctypes.POINTER(i)]
        lib.cublasLtMatmul.argtypes = [v, v, v, v, v, v, v, v, v, v, v, v, v, v, sz, v]
        self.lib = lib
        self.handle = v()
        self._ok(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = cp.empty(LT_WORKSPACE_BYTES, np.uint8)
        # keys (M, N, K, out type, fast accumulation, scaled in the epilogue)
        self.plans: dict[tuple[int, int, int, int, bool, bool], tuple] = {}
        self.algos: dict[tuple[int, int, int, int, bool, bool], _HeuristicResult] = {}
        self.tuned: dict[tuple[int, int, int, int, bool, bool], _HeuristicResult] = {}  # (choose) by exact rows
        self.unscalable: set[tuple] = set()  # buckets with no algorithm for epilogue scales

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status:
            raise RuntimeError(f"{what} failed (cuBLAS status {status})")

    def _set(self, desc, attr: int, value) -> None:
        self._ok(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                 f"cublasLtMatmulDescSetAttribute({attr})")

    def plan(self, M: int, N: int, K: int, out_type: int, fast: bool, scaled: bool = False) -> tuple:
        """(descriptor, layouts, algorithm) of an (M, K) x (N, K)^T product into out_type, with
        fast accumulation or not, scaled in the epilogue or not (matmul's x_scale). The
        algorithm is the one chosen for exactly M rows (choose), else comes from cuBLASLt's
        heuristic once per power-of-two bucket of M (a serving step's token count changes from
        step to step, and a heuristic query costs ~ms)."""
        key = (M, N, K, out_type, fast, scaled)
        plan = self.plans.get(key)
        if plan is None:
            desc, a, b, c = self._descriptors(M, N, K, out_type, fast, scaled)
            bucket = self._bucket(key)
            algo = self.tuned.get(key, self.algos.get(bucket))
            if algo is None:
                algo = self.algos[bucket] = self._untuned(desc, a, b, c, M, N, K)
            plan = self.plans[key] = (desc, a, b, c, algo)
        return plan

    @staticmethod
    def _bucket(key: tuple) -> tuple:
        """The plan key's power-of-two bucket of rows (rows_bucket): one algorithm each."""
        M, *rest = key
        return (rows_bucket(M), *rest)

    @staticmethod
    def tuned_key(M: int, N: int, K: int, out_type: int, fast: bool) -> tuple:
        """The plan key a tuned choice (choose) is kept under: exact rows, unscaled."""
        return (M, N, K, out_type, fast, False)

    def choose(self, M: int, N: int, K: int, out_type: int, fast: bool, algo: "_HeuristicResult") -> None:
        """Use `algo` for this shape's products of exactly M rows and, where M is its bucket's power
        of two, for the bucket's other row counts that nothing was chosen for (see tune_gemm_fp8).
        Decode graphs of 160, 192 and 224 rows each take their own: those tuned for 256 rows ran
        them slower than the padded 256-row graph (docs/performance.md, fiftieth session)."""
        exact = self.tuned_key(M, N, K, out_type, fast)
        self.tuned[exact] = algo
        bucket = self._bucket(exact)
        if bucket[0] == M:
            self.algos[bucket] = algo
        for key, plan in self.plans.items():
            if key == exact or (bucket[0] == M and self._bucket(key) == bucket and key not in self.tuned):
                self.plans[key] = (*plan[:4], algo)

    def exact(self, M: int, N: int, K: int, out_type: int, fast: bool, scaled: bool = False) -> tuple:
        """The plan with the heuristic's algorithm for exactly M rows (when a bucket's
        algorithm does not run on M)."""
        key = (M, N, K, out_type, fast, scaled)
        desc, a, b, c, _ = self.plans[key]
        plan = self.plans[key] = (desc, a, b, c, self._untuned(desc, a, b, c, M, N, K))
        return plan

    def _descriptors(self, M: int, N: int, K: int, out_type: int, fast: bool, scaled: bool = False) -> tuple:
        lib, v = self.lib, ctypes.c_void_p
        desc = v()
        self._ok(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                 "cublasLtMatmulDescCreate")
        # column-major: out^T (N, M) = W (N x K, i.e. A = K x N transposed) times x^T (B = K x M)
        self._set(desc, _LT_TRANSA, ctypes.c_int(CUBLAS_OP_T))
        self._set(desc, _LT_TRANSB, ctypes.c_int(CUBLAS_OP_N))
        self._set(desc, _LT_FAST_ACCUM, ctypes.c_int8(int(fast)))
        if scaled:  # a scale per row of op(A) (the weights' rows) and per column of B (the tokens)
            for attr in (_LT_A_SCALE_MODE, _LT_B_SCALE_MODE):
                self._set(desc, attr, ctypes.c_int32(_LT_SCALE_OUTER_VEC_32F))
            # the heuristic offers no algorithm while the scales' addresses are null: a device
            # address stands in for them until matmul sets the real ones
            for attr in (_LT_A_SCALE_POINTER, _LT_B_SCALE_POINTER):
                self._set(desc, attr, ctypes.c_void_p(self.workspace.data.ptr))
        layouts = []
        for dtype, rows, cols in ((CUDA_R_8F_E4M3, K, N), (CUDA_R_8F_E4M3, K, M), (out_type, N, M)):
            layout = v()
            self._ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, rows),
                     "cublasLtMatrixLayoutCreate")
            layouts.append(layout)
        return (desc, *layouts)

    def _untuned(self, desc, a, b, c, M: int, N: int, K: int) -> "_HeuristicResult":
        """The heuristic's first algorithm among those that need no workspace, else among all (see
        the note on workspaces above)."""
        try:
            return self._heuristic(desc, a, b, c, M, N, K, workspace=0)[0]
        except RuntimeError:
            return self._heuristic(desc, a, b, c, M, N, K)[0]

    def _heuristic(self, desc, a, b, c, M: int, N: int, K: int, count: int = 1,
                   workspace: int = LT_WORKSPACE_BYTES) -> list["_HeuristicResult"]:
        """Up to `count` algorithms that need at most `workspace` bytes, cuBLASLt's best guess first."""
        lib, v = self.lib, ctypes.c_void_p
        pref = v()
        self._ok(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        ws = ctypes.c_uint64(workspace)
        self._ok(lib.cublasLtMatmulPreferenceSetAttribute(pref, _LT_PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                          ctypes.sizeof(ws)), "cublasLtMatmulPreferenceSetAttribute")
        results, found = (_HeuristicResult * count)(), ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, pref, count, results,
                                                    ctypes.byref(found))
        lib.cublasLtMatmulPreferenceDestroy(pref)
        if status or found.value < 1:
            raise RuntimeError(f"cuBLASLt has no float8 algorithm for ({M}x{K}) @ ({N}x{K})^T (status {status}); "
                               "--quantization fp8 needs compute capability 8.9+")
        return list(results[:found.value])

    def matmul(self, plan: tuple, algo: "_HeuristicResult", xq: cp.ndarray, w: Fp8Matrix, out: cp.ndarray,
               x_scale: cp.ndarray | None = None, add: bool = False) -> int:
        """One product on the current stream; cuBLAS's status. x_scale: the tokens' scales, for
        a plan scaled in the epilogue (the weights' are w.scale). The descriptor holds the
        scales' addresses, so they are set here, before each call (a captured graph keeps the
        values of its capture). add: out += the product (beta 1, out as C and D), else out =."""
        desc, a, b, c, _ = plan
        if x_scale is not None:
            self._set(desc, _LT_A_SCALE_POINTER, ctypes.c_void_p(w.scale.data.ptr))
            self._set(desc, _LT_B_SCALE_POINTER, ctypes.c_void_p(x_scale.data.ptr))
        ws = LT_WORKSPACE_BYTES if algo.workspaceSize else 0  # see the note on workspaces above
        return self.lib.cublasLtMatmul(self.handle, desc, ctypes.byref(_ONE_LT), w.data.data.ptr, a, xq.data.ptr, b,
                                       ctypes.byref(_ONE_LT if add else _ZERO_LT), out.data.ptr, c, out.data.ptr, c,
                                       ctypes.byref(algo.algo), self.workspace.data.ptr if ws else None, ws,
                                       cp.cuda.get_current_stream().ptr)


_lt: _Lt | None = None
_ONE_LT, _ZERO_LT = ctypes.c_float(1.0), ctypes.c_float(0.0)


def _lt_handle() -> _Lt:
    """The process's cuBLASLt state, made on first use."""
    global _lt
    if _lt is None:
        _lt = _Lt()
    return _lt


def gemm_fp8(xq: cp.ndarray, w: Fp8Matrix, out: cp.ndarray, fast_accum: bool = False, pdl: bool = False) -> cp.ndarray:
    """out (M, N) = xq @ w.data^T over the values of the e4m3 codes (xq (M, K), e.g. from
    quant.quantize_rows), on the current stream, accumulated in float32 (fast_accum: in the
    MMAs' own accumulator, never promoted; see _LT_FAST_ACCUM's note); out float32 or
    bfloat16 (uint16 bits: the raw sums exceed float16's range, and the e4m3 inputs
    carry 3 mantissa bits to bfloat16's 8); K and N multiples of 16. The product
    of the scaled matrices is out * x_scale[:, None] * w.scale[None, :]: the caller hands
    (x_scale, w.scale) to whichever kernel reads out (their `scales` argument). With
    fast_accum, a shape whose bucket of rows tune_gemm_fp8_wgmma found faster on gemm_fp8.cu
    runs there (launched with pdl, if asked)."""
    M, N, K, out_type = _fp8_shape(xq, w, out, (np.float32, np.uint16))
    if M == 0:
        return out
    if fast_accum and _wgmma_plans:
        config = _wgmma_plan(M, N, K, out_type)
        if config is not None:  # checked to fit this shape when it was chosen
            _launch_wgmma(xq, w, out, config, out_type, pdl)
            return out
    _lt_product(xq, w, out, M, N, K, out_type, fast_accum)
    return out


def gemm_fp8_scaled(xq: cp.ndarray, x_scale: cp.ndarray, w: Fp8Matrix, out: cp.ndarray,
                    fast_accum: bool = False, add: bool = False) -> bool:
    """out (M, N) bfloat16 (uint16 bits) or float32 (an fp8 LM head's logits) = the product of
    the scaled matrices, (xq * x_scale[:, None]) @ (w.data * w.scale[:, None])^T, the scales
    applied in cuBLASLt's epilogue: its reader needs no scales. Its rounding differs from
    gemm_fp8's (the scaled sum is rounded to bfloat16 once, where gemm_fp8's reader scales the
    rounded raw sum). add: out += the product instead, in the epilogue (a residual stream's add;
    out's type's rounding of the sum and of the product, as a 16-bit product added to the stream
    has). Returns False, having written nothing, where cuBLASLt has no algorithm for it (the
    caller then takes gemm_fp8)."""
    M, N, K, out_type = _fp8_shape(xq, w, out, (np.uint16, np.float32))
    check(x_scale, "x_scale", np.float32, (M,))
    if M == 0:
        return True
    lt = _lt_handle()
    bucket = lt._bucket((M, N, K, out_type, fast_accum, True))
    if bucket in lt.unscalable:
        return False
    try:
        _lt_product(xq, w, out, M, N, K, out_type, fast_accum, x_scale, add)
    except RuntimeError:  # no algorithm (an older cuBLASLt, or another GPU)
        lt.unscalable.add(bucket)
        return False
    return True


def _fp8_shape(xq: cp.ndarray, w: Fp8Matrix, out: cp.ndarray, out_types: tuple) -> tuple[int, int, int, int]:
    """(M, N, K, cuBLAS out type) of an fp8 product, its arguments checked."""
    if xq.ndim != 2 or xq.shape[1] != w.shape[1]:
        raise ValueError(f"gemm_fp8: x {xq.shape} and w {w.shape} do not chain")
    M, K = xq.shape
    N = w.shape[0]
    if K % 16 or N % 16:
        raise ValueError(f"gemm_fp8: K={K} and N={N} must be multiples of 16")
    check(xq, "xq", np.uint8)
    check(w.data, "w.data", np.uint8)
    check(w.scale, "w.scale", np.float32, (N,))
    out_type = _out_type(out, out_types)
    check(out, "out", out.dtype, (M, N))
    return M, N, K, out_type


def _lt_product(xq: cp.ndarray, w: Fp8Matrix, out: cp.ndarray, M: int, N: int, K: int, out_type: int,
                fast_accum: bool, x_scale: cp.ndarray | None = None, add: bool = False) -> None:
    """The product through cuBLASLt (added to out: add): the bucket's algorithm, or the
    heuristic's for exactly M rows where that one does not run on M."""
    lt, scaled = _lt_handle(), x_scale is not None
    for attempt in range(2):
        plan = (lt.plan(M, N, K, out_type, fast_accum, scaled) if attempt == 0
                else lt.exact(M, N, K, out_type, fast_accum, scaled))
        status = lt.matmul(plan, plan[4], xq, w, out, x_scale, add)
        if status == 0:
            break
    lt._ok(status, f"cublasLtMatmul ({M}x{K}) @ ({N}x{K})^T")


TUNE_MIN_GAIN = 0.05


def fp8_tuned(xq: cp.ndarray, w: Fp8Matrix, out: cp.ndarray, fast_accum: bool = False) -> bool:
    """Whether tune_gemm_fp8 has timed the products of xq's exact rows by w's shape in this
    process (on its cuBLASLt state): a runner built after another takes the choices made then,
    so that the two run the same algorithms; timed again, a near tie may go the other way, and
    the first runner's captured graphs keep the old one (other bits than the second's steps)."""
    (M, K), N = xq.shape, w.shape[0]
    return _lt is not None and _Lt.tuned_key(M, N, K, _out_type(out, (np.float32, np.uint16)), fast_accum) in _lt.tuned


def tune_gemm_fp8(xq: cp.ndarray, ws: list[Fp8Matrix], out: cp.ndarray, fast_accum: bool = False,
                  candidates: int = 8, reps: int = 3) -> tuple[list[float], int]:
    """Time the algorithms cuBLASLt's heuristic offers for xq @ w^T (gemm_fp8's product) over
    the matrices ws one after another, as a step runs them (a matrix of each layer: together
    they do not fit in L2), and keep the fastest for this shape's products of xq's rows (and,
    rows a power of two, of the others in their bucket: _Lt.choose). The heuristic's first
    guess is often not the fastest for the few rows of a decode step (H200, 8B down projection
    at 128 rows: 25.0 vs 22.8 us).
    xq should hold data (not zeros). Returns each candidate's microseconds a product (inf for
    one that does not run; the heuristic's order) and the index of the one now used (0: the
    heuristic's first choice). The fastest replaces the heuristic's first choice only when
    faster by TUNE_MIN_GAIN: a smaller gain is within what these timings vary by, and the
    order of products in a step can reverse it (seen at 32 and 256 rows).
    """
    M, K = xq.shape
    N = ws[0].shape[0]
    out_type = _out_type(out, (np.float32, np.uint16))
    lt = _lt_handle()
    plan = lt.plan(M, N, K, out_type, fast_accum)
    algos = lt._heuristic(*plan[:4], M, N, K, count=candidates)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for algo in algos:
        if any(lt.matmul(plan, algo, xq, w, out) for w in ws):  # also the warm-up
            times.append(float("inf"))
            continue
        runs = []
        for _ in range(reps):
            start.record()
            for w in ws:
                lt.matmul(plan, algo, xq, w, out)
            end.record()
            end.synchronize()
            runs.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / len(ws))
        times.append(sorted(runs)[len(runs) // 2])
    best = min(range(len(algos)), key=times.__getitem__)
    if not times[best] < (1.0 - TUNE_MIN_GAIN) * times[0]:
        best = 0
    lt.choose(M, N, K, out_type, fast_accum, algos[best])
    return times, best


# ---------------------------------------------------------------------------- float8 on wgmma
# gemm_fp8.cu: the same product (the sums of the codes' products, bfloat16 or float32 out) on
# Hopper's wgmma, its operands brought in by the bulk tensor copy engine, the tokens as the MMA's
# N and K split over a cluster where a shape has few tiles. The runner times it against cuBLASLt
# per decode bucket (tune_gemm_fp8_wgmma) and runs it where it wins: on H200 at 32 rows of the
# 8B shape; at 128-256 rows its exposed epilogue keeps it behind (docs/performance.md).
MAX_SM_SMEM = 228 << 10  # shared memory of an SM (sm_90), for min_blocks blocks (1 KB each reserved)
_CU_TENSOR_MAP_DATA_TYPE_UINT8, _CU_TENSOR_MAP_SWIZZLE_128B, _CU_TENSOR_MAP_L2_PROMOTION_256B = 0, 3, 3


@dataclass(frozen=True)
class WgmmaConfig:
    """gemm_fp8.cu's constants: BT tokens a block (the MMA's N: 16, 32, 64, 128 or 256, halved
    with TSPLIT 2), RM x 64 weight rows a consumer warpgroup, CW consumer warpgroups, K split
    over SPLITS blocks of a cluster, STAGES stages of KBOX 128-byte slices of K in flight,
    MIN_BLOCKS blocks an SM; TSPLIT 2: the warpgroups in pairs on the same weight rows, half the
    tokens each."""

    bt: int = 64
    rm: int = 1
    cw: int = 2
    splits: int = 1
    stages: int = 4
    kbox: int = 1
    min_blocks: int = 1
    tsplit: int = 1

    @property
    def bmw(self) -> int:
        """Weight rows (out's columns) a block."""
        return 64 * self.rm * self.cw // self.tsplit

    @property
    def smem(self) -> int:
        """Dynamic shared memory: alignment slack, the stages, their barriers (gemm_fp8.cu)."""
        return 1024 + self.stages * (self.bmw + self.bt) * 128 * self.kbox + 16 * self.stages

    def fits(self, M: int, N: int, K: int) -> bool:
        """Whether this configuration can run an (M, K) x (N, K)^T product on this GPU."""
        bk = 128 * self.kbox
        stages_bytes = self.smem - 1024 - 16 * self.stages
        threads = 128 * (self.cw + 1)
        nt = self.bt // self.tsplit  # the MMA's N
        registers = self.rm * nt // 2 + 40  # the accumulators and ~40 more a thread
        return (wgmma_supported() and self.cw % self.tsplit == 0 and nt in (16, 32, 64, 128, 256)
                and registers * threads * self.min_blocks <= 65536 and registers <= 255
                and N % self.bmw == 0 and K % bk == 0 and K // bk >= self.splits and self.splits <= 8
                and self.smem <= MAX_BLOCK_SMEM and (self.smem + 1024) * self.min_blocks <= MAX_SM_SMEM
                and self.bt * (self.bmw + 4) * 4 <= stages_bytes)


_maps: dict[tuple[int, int, int, int], ByValue] = {}


@functools.lru_cache(maxsize=None)
def _encode_tiled():
    """The driver's cuTensorMapEncodeTiled, its argument types set."""
    fn = _cuda_driver().cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def _tensor_map(ptr: int, rows: int, cols: int, box_rows: int) -> ByValue:
    """A 2-D tensor map over row-major uint8 (rows, cols) at ptr: boxes of 128 bytes x box_rows
    rows, 128-byte swizzle (gemm_fp8.cu's tiles); rows past `rows` read as zeros. Made once per
    (buffer, shape): a step's rows change, its buffers do not."""
    key = (ptr, rows, cols, box_rows)
    tmap = _maps.get(key)
    if tmap is None:
        tmap = ByValue(128)
        u32, u64 = ctypes.c_uint32, ctypes.c_uint64
        status = _encode_tiled()(tmap.address, _CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, ctypes.c_void_p(ptr),
                                 (u64 * 2)(cols, rows), (u64 * 1)(cols), (u32 * 2)(128, box_rows), (u32 * 2)(1, 1), 0,
                                 _CU_TENSOR_MAP_SWIZZLE_128B, _CU_TENSOR_MAP_L2_PROMOTION_256B, 0)
        if status:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed ({status}) for ({rows} x {cols}) at {ptr:#x}")
        _maps[key] = tmap
    return tmap


def gemm_fp8_wgmma(xq: cp.ndarray, w: Fp8Matrix, out: cp.ndarray, config: WgmmaConfig = WgmmaConfig(),
                   pdl: bool = False) -> cp.ndarray:
    """gemm_fp8's product (out = the sums of xq @ w.data^T, float32 or bfloat16 bits) through
    gemm_fp8.cu on wgmma; `config` must fit (M, N, K) (WgmmaConfig.fits)."""
    M, K = xq.shape
    N = w.shape[0]
    if w.shape[1] != K or not config.fits(M, N, K):
        raise ValueError(f"gemm_fp8_wgmma: {config} does not fit ({M}x{K}) @ ({N}x{w.shape[1]})^T")
    check(xq, "xq", np.uint8)
    check(w.data, "w.data", np.uint8)
    out_type = _out_type(out, (np.float32, np.uint16))
    check(out, "out", out.dtype, (M, N))
    if M:
        _launch_wgmma(xq, w, out, config, out_type, pdl)
    return out


def _launch_wgmma(xq: cp.ndarray, w: Fp8Matrix, out: cp.ndarray, config: WgmmaConfig, out_type: int,
                  pdl: bool) -> None:
    """gemm_fp8.cu's launch, its arguments checked by the caller (M > 0)."""
    M, K = xq.shape
    N = w.shape[0]
    mod = module("gemm_fp8", arch="sm_90a", BT=config.bt, RM=config.rm, CW=config.cw, SPLITS=config.splits,
                 STAGES=config.stages, KBOX=config.kbox, MIN_BLOCKS=config.min_blocks, TSPLIT=config.tsplit,
                 OUT_F32=int(out_type == CUDA_R_32F))
    kernel = function(mod, "gemm_fp8_wgmma", config.smem)
    grid = (-(-M // config.bt), N // config.bmw, config.splits)
    args = (_tensor_map(xq.data.ptr, M, K, config.bt), _tensor_map(w.data.data.ptr, N, K, 64), out,
            i32(M), i32(N), i32(K))
    launch_ex(kernel, grid, (128 * (config.cw + 1),), args, shared_mem=config.smem, pdl=pdl)


# Candidates for each bucket of rows (WgmmaConfig fields bt, rm, cw, splits, stages, kbox,
# min_blocks, tsplit): the fastest for the 8B shapes in a search over ~500 configurations (H200,
# docs/performance.md, twenty-ninth session); those that do not fit a shape are skipped.
WGMMA_CANDIDATES = {
    32: [(32, 1, 1, 1, 9, 2, 1), (32, 1, 1, 2, 4, 2, 2), (32, 1, 1, 3, 4, 2, 2)],
    64: [(64, 1, 1, 1, 7, 2, 1), (64, 1, 1, 2, 6, 1, 2), (64, 2, 1, 1, 4, 1, 2), (64, 1, 1, 2, 12, 1, 1)],
    128: [(128, 1, 1, 2, 4, 1, 2), (128, 2, 2, 1, 4, 1, 1), (128, 1, 1, 2, 9, 1, 1)],
    256: [(128, 1, 1, 1, 4, 1, 2), (128, 1, 1, 1, 9, 1, 1), (256, 1, 2, 1, 4, 1, 1), (256, 1, 2, 2, 5, 1, 1, 2)],
}
# (rows, N, K, out type) -> the configuration tune_gemm_fp8_wgmma chose, None where cuBLASLt won
_wgmma_plans: dict[tuple[int, int, int, int], WgmmaConfig | None] = {}


def _wgmma_plan(M: int, N: int, K: int, out_type: int) -> WgmmaConfig | None:
    """The choice tuned for exactly M rows, else for M's power-of-two bucket (rows_bucket)."""
    key = (M, N, K, out_type)
    return _wgmma_plans[key] if key in _wgmma_plans else _wgmma_plans.get((rows_bucket(M), N, K, out_type))


def _graph_us(launch_all, stream: cp.cuda.Stream, reps: int = 5) -> float:
    """Median microseconds of launch_all() (a product over each of a few matrices) replayed as a
    CUDA graph captured on `stream`, per call of launch_all: what a captured step pays, without
    the host's launch costs (an eager launch of gemm_fp8.cu through ctypes costs ~20 us)."""
    with stream:
        launch_all()  # builds and plans outside the capture
        stream.begin_capture()
        launch_all()
        graph = stream.end_capture()
        graph.launch(stream)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        runs = []
        for _ in range(reps):
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            runs.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return sorted(runs)[len(runs) // 2]


def tune_gemm_fp8_wgmma(xq: cp.ndarray, ws: list[Fp8Matrix], out: cp.ndarray, stream: cp.cuda.Stream,
                        pdl: bool = False) -> tuple[float, dict[WgmmaConfig, float], WgmmaConfig | None]:
    """Time gemm_fp8 with fast accumulation (cuBLASLt, as tuned) and gemm_fp8.cu's candidates for
    xq's bucket of rows (WGMMA_CANDIDATES) over the matrices ws, each as a captured graph, and
    run this shape's products of xq's rows (and, rows a power of two, of the others in their
    bucket that were not tuned) on the fastest candidate from now on when it beats cuBLASLt by
    TUNE_MIN_GAIN. xq should hold data (not zeros). Returns cuBLASLt's microseconds
    a product, each fitting candidate's, and the configuration now used (None: cuBLASLt)."""
    M, K = xq.shape
    N = ws[0].shape[0]
    key = (M, N, K, _out_type(out, (np.float32, np.uint16)))
    _wgmma_plans[key] = None  # cuBLASLt, as tuned, while it is timed
    per = len(ws)
    lt_us = _graph_us(lambda: [gemm_fp8(xq, w, out, True) for w in ws], stream) / per
    times = {}
    if wgmma_supported():
        for fields in WGMMA_CANDIDATES.get(rows_bucket(M), []):
            config = WgmmaConfig(*fields)
            if config.fits(M, N, K):
                times[config] = _graph_us(lambda c=config: [gemm_fp8_wgmma(xq, w, out, c, pdl) for w in ws],
                                          stream) / per
    best = min(times, key=times.__getitem__, default=None)
    if best is None or not times[best] < (1.0 - TUNE_MIN_GAIN) * lt_us:
        return lt_us, times, None
    _wgmma_plans[key] = best
    return lt_us, times, best

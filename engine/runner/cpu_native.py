"""16-bit weights for the CPU runner: cpu_kernels.c compiled on first use, via ctypes.

The build goes to `<cache>/cpu_kernels/<hash>.so` (keyed by the source, compiler
and machine) with the system C compiler; without one, `load_kernels` returns None
and the runner keeps float32 weights and NumPy's BLAS.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..env import c_compiler
from ..loader.quants import f32_to_bf16_bits

log = logging.getLogger("cuserve.cpu")

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
W_F16, W_BF16 = 0, 1


@dataclass
class W16:
    """A weight matrix kept as 16-bit floats: bits (N, K) uint16, kind W_F16 or W_BF16."""

    bits: np.ndarray
    kind: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes


def to_w16(w: np.ndarray, kind: int) -> W16:
    w = np.ascontiguousarray(w, dtype=np.float32)
    if kind == W_F16:
        return W16(w.astype(np.float16).view(np.uint16), kind)
    return W16(f32_to_bf16_bits(w), kind)


class CpuKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._matmul = lib.matmul_w16
        self._matmul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        self._matmul.restype = None
        self._widen = lib.widen_w16
        self._widen.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        self._widen.restype = None

    def widen(self, w: W16, rows: slice | None = None) -> np.ndarray:
        bits = w.bits if rows is None else w.bits[rows]
        bits = np.ascontiguousarray(bits)
        out = np.empty(bits.shape, np.float32)
        self._widen(bits.ctypes.data, out.ctypes.data, bits.size, w.kind)
        return out

    def matmul(self, x: np.ndarray, w: W16) -> np.ndarray:
        """x (M, K) float32 @ w.T -> (M, N) float32."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        M, K = x.shape
        N = w.bits.shape[0]
        if w.bits.shape[1] != K:
            raise ValueError(f"matmul: x has {K} columns, weights {w.bits.shape}")
        # one kernel for every M: a row's result never depends on the rest of the batch
        out = np.empty((M, N), np.float32)
        self._matmul(x.ctypes.data, w.bits.ctypes.data, out.ctypes.data, M, N, K, w.kind)
        return out


def _compiler() -> str | None:
    for name in (c_compiler(), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def load_kernels(cache: Path) -> CpuKernels | None:
    """The compiled kernels, building them if needed; None when that is impossible."""
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found: the CPU runner uses float32 weights (slower decode)")
        return None
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    key = hashlib.sha256(source + version.encode() + " ".join(FLAGS).encode() + platform.machine().encode())
    target = cache / "cpu_kernels" / f"{key.hexdigest()[:16]}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / "k.so"
            result = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True)
            if result.returncode != 0:
                log.warning("could not compile the CPU kernels (%s): %s", cc, result.stderr.strip()[:500])
                return None
            os.replace(out, target)
    try:
        return CpuKernels(ctypes.CDLL(str(target)))
    except OSError as exc:
        log.warning("could not load the CPU kernels: %s", exc)
        return None

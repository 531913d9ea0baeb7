"""Loading the .cu families through CuPy RawModule, and argument helpers.

16-bit tensors are float16 CuPy arrays, or uint16 arrays holding bfloat16 bits
(CuPy has no bfloat16 dtype); a module is compiled per (family, constants) with
-DUSE_BF16 chosen from the arrays it is given. Constants go in as -D options.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from pathlib import Path

import cupy as cp
import numpy as np

KERNEL_DIR = Path(__file__).resolve().parent
SCALAR_DTYPES = (np.dtype(np.float16), np.dtype(np.uint16))  # fp16, bf16 bits

_MODULES: dict[tuple, cp.RawModule] = {}
_early = False  # early_triggers: modules built now let the next kernel launch before their wait


@contextlib.contextmanager
def early_triggers(on: bool = True):
    """Kernels launched inside come from modules built with -DEARLY_TRIGGER=1 where `on`
    (common.cuh's PDL_ENTER: the next kernel may launch before their wait)."""
    global _early
    before, _early = _early, on
    try:
        yield
    finally:
        _early = before


def module(family: str, arch: str | None = None, **defines: int) -> cp.RawModule:
    """The family's kernels built with these -D constants; arch: an architecture-specific
    target ("sm_90a" for wgmma; NVRTC takes it over the plain one CuPy adds), else the
    device's own."""
    if _timeline is not None:
        defines["STAMPS"] = 2 if _timeline.points else 1
    if _early:
        defines["EARLY_TRIGGER"] = 1
    key = (family, arch, tuple(sorted(defines.items())))
    mod = _MODULES.get(key)
    if mod is None:
        source = (KERNEL_DIR / f"{family}.cu").read_text(encoding="utf-8")
        options = ("-std=c++17", f"-I{KERNEL_DIR}", *(f"-D{k}={int(v)}" for k, v in sorted(defines.items())),
                   *((f"-arch={arch}",) if arch else ()))
        mod = cp.RawModule(code=source, options=options)
        _MODULES[key] = mod
    if _timeline is not None:  # a stamped module built for an earlier Timeline stamps into this one's buffer now
        _timeline.attach(mod)
    return mod


# The points inside a kernel where block 0 also stamps the timer in a Timeline with points
# (common.cuh's STAMP_POINT, built with -DSTAMPS=2), in the order it passes them; kernels not named
# here have none.
STAMP_POINTS = {
    "flash_decode_chunk": ("landed", "tiles done"),  # q and the tiles before the wait in; the tile loop over
    "attn_o": ("landed", "tiles done"),  # (decode_split's, as flash_decode's)
}


class Timeline:
    """Where the kernels of a stream (a replayed graph above all) start, on the GPU's global
    timer (common.cuh's STAMPS): while one is open, modules are compiled with stamps and
    launch() notes each kernel's name. Exploration only (bench/kernels.py --timeline): the
    stamp's atomic delays block 0 of each kernel by an L2 round trip. points: also stamp at the
    points inside the kernels of STAMP_POINTS, noted as "kernel:point".

        tl = Timeline()
        with tl.compiling():  # build the runner to be timed, then tl.names.clear() and capture
            ...
        tl.reset(); graph.launch(s); s.synchronize(); starts = tl.read()
    """

    def __init__(self, slots: int = 1 << 14, points: bool = False) -> None:
        self.buf = cp.zeros(1 + slots, np.uint64)
        self.points = points
        self.names: list[str] = []
        self._slots: dict[int, cp.ndarray] = {}  # each stamped module's stamp_buf, by the module's id

    def note(self, kernel: str) -> None:
        """A launch of `kernel`: its name, and its points' where stamped."""
        self.names.append(kernel)
        if self.points:
            self.names.extend(f"{kernel}:{point}" for point in STAMP_POINTS.get(kernel, ()))

    @contextlib.contextmanager
    def compiling(self):
        """Modules compiled and kernels launched inside are stamped and named (see the class)."""
        global _timeline
        _timeline = self
        try:
            yield self
        finally:
            _timeline = None

    def attach(self, mod: cp.RawModule) -> None:
        """Point a stamped module's stamp_buf at this buffer (once a module)."""
        if id(mod) not in self._slots:
            slot = self._slots[id(mod)] = cp.ndarray((1,), np.uint64, memptr=mod.get_global("stamp_buf"))
            slot[0] = self.buf.data.ptr

    def enable(self, on: bool) -> None:
        """Point the stamped modules at the buffer, or at nothing (their kernels then skip the
        stamp: the same code, timed without it)."""
        for slot in self._slots.values():
            slot[0] = self.buf.data.ptr if on else 0

    def reset(self) -> None:
        self.buf[0] = 0

    def read(self) -> np.ndarray:
        """The stamps since reset(), in nanoseconds, in the order the kernels passed their wait."""
        n = int(self.buf[0].get())
        if n >= self.buf.size:
            raise RuntimeError(f"Timeline: {n} stamps for {self.buf.size - 1} slots")
        return self.buf[1:1 + n].get().astype(np.int64)


_timeline: Timeline | None = None


_SMEM_SET: set[tuple[int, str]] = set()


def function(mod: cp.RawModule, name: str, dynamic_smem: int = 0) -> cp.RawKernel:
    """A kernel of a module; with dynamic_smem, allowed that much dynamic shared memory (the
    attribute is set once per kernel, not at every launch)."""
    kernel = mod.get_function(name)
    if dynamic_smem and (id(mod), name) not in _SMEM_SET:
        kernel.max_dynamic_shared_size_bytes = dynamic_smem
        _SMEM_SET.add((id(mod), name))
    return kernel


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    return cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrMultiProcessorCount, device)


def sm_count() -> int:
    """Streaming multiprocessors of the current device."""
    return _sm_count(cp.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _wgmma_supported(device: int) -> bool:
    return cp.cuda.Device(device).compute_capability == "90"


def wgmma_supported() -> bool:
    """The kernels on wgmma (gemm_fp8.cu, flash_prefill_wgmma.cu) are built for sm_90a: Hopper
    (H100 / H200) only."""
    return _wgmma_supported(cp.cuda.Device().id)


_occupancy: dict[tuple[int, int, int], int] = {}


def blocks_per_sm(kernel: cp.RawKernel, threads: int, smem: int) -> int:
    """Blocks of `threads` threads and `smem` bytes of dynamic shared memory that fit on one SM at
    once (the driver's occupancy calculator, its registers included): a persistent launch's blocks."""
    key = (kernel.kernel.ptr, threads, smem)
    if key not in _occupancy:
        n = ctypes.c_int(0)
        status = _cuda_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), ctypes.c_void_p(kernel.kernel.ptr), ctypes.c_int(threads), ctypes.c_size_t(smem))
        if status:
            raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed ({status})")
        _occupancy[key] = max(1, n.value)
    return _occupancy[key]


MAX_BLOCK_SMEM = 227 << 10  # shared memory a block may have on sm_90


def align16(n: int) -> int:
    """n rounded up to a multiple of 16 (a shared-memory layout's 16-byte pieces)."""
    return -(-n // 16) * 16


def use_bf16(arr: cp.ndarray) -> int:
    check_scalar(arr, "tensor")
    return int(arr.dtype == np.uint16)


PRODUCT_DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.uint16): 2}


def prod_kind(arr: cp.ndarray, name: str) -> int:
    """-DPROD of a kernel that reads a matrix product (common.cuh): 0 float32, 1 float16,
    2 bfloat16 (uint16 bits)."""
    kind = PRODUCT_DTYPES.get(arr.dtype)
    if kind is None:
        raise ValueError(f"{name}: expected float32, float16 or bfloat16 (uint16 bits), got {arr.dtype}")
    return kind


def check_scalar(arr: cp.ndarray, name: str) -> None:
    if arr.dtype not in SCALAR_DTYPES:
        raise ValueError(f"{name}: expected float16 or bfloat16 (uint16 bits), got {arr.dtype}")


def check(arr: cp.ndarray, name: str, dtype, shape: tuple | None = None, contiguous: bool = True) -> None:
    if not isinstance(arr, cp.ndarray):
        raise ValueError(f"{name}: expected a CuPy array, got {type(arr).__name__}")
    if dtype is not None and arr.dtype != np.dtype(dtype):
        raise ValueError(f"{name}: expected {np.dtype(dtype)}, got {arr.dtype}")
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(arr.shape)}")
    if contiguous and not arr.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")


def same_scalar(a: cp.ndarray, b: cp.ndarray, names: str) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{names}: 16-bit dtypes differ ({a.dtype} vs {b.dtype})")


def i32(x) -> np.int32:
    return np.int32(x)


def i64(x) -> np.int64:
    return np.int64(x)


def f32(x) -> np.float32:
    return np.float32(x)


def ptr_or_null(arr: cp.ndarray | None):
    """A device pointer argument that may be null."""
    return arr if arr is not None else np.uint64(0)


def threads_for(n: int, per_thread: int, most: int = 1024) -> int:
    """Threads of a one-row-a-block kernel whose threads take `per_thread` values at a time:
    one group each, in whole warps, at most `most`."""
    return max(32, min(most, -(-n // (per_thread * 32)) * 32))


# Steps of this many rows or more (prefill, mixed) run the one-row-a-block kernels that read a
# matrix product (RoPE, SiLU * up, RMSNorm) with smaller blocks, each thread taking several
# groups: many blocks an SM then overlap each other's loads and block-wide sums. Fewer rows
# (decode steps) keep a group a thread: with a block per row, small blocks would leave the SMs
# few warps (H200, 8B fp8 decode graph at 128 rows: 4.90 -> 5.28 ms with small blocks there).
WIDE_MIN_ROWS = 512


def wide_threads(rows: int, n: int, per_thread: int, wide_most: int) -> int:
    """threads_for a launch over `rows` rows: at most wide_most from WIDE_MIN_ROWS rows up."""
    return threads_for(n, per_thread, most=wide_most if rows >= WIDE_MIN_ROWS else 1024)


# Kernels that give a row to a group of threads, several rows a block of ROW_GROUP_BLOCK
# (rmsnorm.cu's add_rms_norm_rows, quant.cu's quantize_rows_group: common.cuh's group_reduce).
ROW_GROUP_BLOCK = 256


def row_group_fits(n: int, threads: int, max_chunks: int) -> bool:
    """Whether a row of n values splits into 8-value chunks over `threads` threads, at most
    max_chunks a thread (what such a kernel holds in registers)."""
    return n % (8 * threads) == 0 and n // (8 * threads) <= max_chunks


def row_group_grid(rows: int, threads: int) -> tuple[tuple[int], tuple[int]]:
    """(grid, block) of such a kernel over `rows` rows of `threads` threads each."""
    return (-(-rows // (ROW_GROUP_BLOCK // threads)),), (ROW_GROUP_BLOCK,)


def scale_args(scales: tuple[cp.ndarray, cp.ndarray] | None, rows: int, cols: int) -> tuple:
    """(rs, cs) kernel arguments for the raw sums of a float8 product (gemm.gemm_fp8):
    scales = (a scale per row (rows,), a scale per column (cols,)) float32, or None (two
    nulls: nothing to scale)."""
    if scales is None:
        return np.uint64(0), np.uint64(0)
    rs, cs = scales
    check(rs, "row scales", np.float32, (rows,))
    check(cs, "column scales", np.float32, (cols,))
    return rs, cs


def quant_out_args(quant: tuple[cp.ndarray, cp.ndarray] | None, rows: int, cols: int) -> tuple[int, tuple]:
    """-DQUANT_OUT and the (q, q_scale) kernel arguments of a kernel whose 16-bit output
    feeds a float8 product (common.cuh's QUANT_OUT): quant = (codes (rows, cols) uint8,
    a scale per row (rows,) float32) to write too, or None (0, two nulls)."""
    if quant is None:
        return 0, (np.uint64(0), np.uint64(0))
    q, scale = quant
    check(q, "quant codes", np.uint8, (rows, cols))
    check(scale, "quant scales", np.float32, (rows,))
    if cols % 8:
        raise ValueError(f"quant: the row length ({cols}) must be a multiple of 8")
    return 1, (q, scale)


def quant_out_target(out: cp.ndarray, quant: tuple | None, codes_only: bool):
    """The 16-bit out argument of such a kernel: null when only its e4m3 codes are wanted
    (codes_only with quant; the kernel then leaves out as it was)."""
    return np.uint64(0) if quant is not None and codes_only else out


# ---------------------------------------------------------------------------- launching
# Kernels go through CuPy's launch, or, with pdl=True, through cuLaunchKernelEx with the
# programmatic stream-serialization attribute (Hopper's programmatic dependent launch:
# the kernel may start while the previous one finishes; the kernels open with
# griddepcontrol.wait, see PDL_ENTER in common.cuh). Graph capture records either.

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("i", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


_driver: ctypes.CDLL | None = None
_PDL_ATTR = _Attr(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=_AttrValue(i=1))


def _cuda_driver() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
        _driver.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return _driver


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(device: int) -> bool:
    return int(cp.cuda.Device(device).compute_capability) >= 90


def sm90_or_newer() -> bool:
    """Whether the current device has compute capability 9.0 (Hopper) or newer: programmatic
    dependent launch, thread-block clusters, bulk copies on an mbarrier (asked at launches:
    once a device)."""
    return _sm90_or_newer(cp.cuda.Device().id)


CU_EVENT_RECORD_EXTERNAL = 1


def record_event(event: cp.cuda.Event, stream: cp.cuda.Stream) -> None:
    """event.record(stream), except that while the stream captures a graph, the record becomes a
    node of the graph (cuEventRecordWithFlags, CU_EVENT_RECORD_EXTERNAL): each replay records the
    event, and the host can wait for it. A plain record in a capture only orders the captured
    streams; it adds no node, and the host cannot wait for the event until it is recorded again
    (cudaErrorInvalidValue)."""
    if not stream.is_capturing():
        event.record(stream)
        return
    status = _cuda_driver().cuEventRecordWithFlags(ctypes.c_void_p(event.ptr), ctypes.c_void_p(stream.ptr),
                                                   ctypes.c_uint(CU_EVENT_RECORD_EXTERNAL))
    if status:
        raise RuntimeError(f"cuEventRecordWithFlags failed: CUresult {status}")


def pdl_supported() -> bool:
    """Programmatic dependent launch needs compute capability 9.0 (Hopper) or newer."""
    return sm90_or_newer()


class ByValue:
    """A kernel argument passed by value as raw bytes (a __grid_constant__ struct such as a
    CUtensorMap), kept at `align` bytes: launch() hands the driver its address."""

    def __init__(self, size: int, align: int = 64) -> None:
        self._buf = (ctypes.c_uint8 * (size + align))()
        start = ctypes.addressof(self._buf)
        self.address = start + (-start % align)
        self.value = (ctypes.c_uint8 * size).from_address(self.address)


def _c_arg(arg):
    if isinstance(arg, ByValue):
        return arg.value
    if isinstance(arg, cp.ndarray):
        return ctypes.c_void_p(arg.data.ptr)
    if isinstance(arg, np.generic):
        return {np.dtype(np.int32): ctypes.c_int, np.dtype(np.int64): ctypes.c_longlong,
                np.dtype(np.uint64): ctypes.c_ulonglong, np.dtype(np.float32): ctypes.c_float}[arg.dtype](arg.item())
    raise TypeError(f"kernel argument of type {type(arg).__name__}")


def launch(kernel: cp.RawKernel, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0,
           pdl: bool = False) -> None:
    """Launch on the current stream; with pdl, as a programmatic dependent launch."""
    if pdl:
        launch_ex(kernel, grid, block, args, shared_mem, pdl)
        return
    if _timeline is not None:
        _timeline.note(kernel.name)
    kernel(grid, block, args, shared_mem=shared_mem)


def launch_ex(kernel: cp.RawKernel, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0,
              pdl: bool = False) -> None:
    """launch() through cuLaunchKernelEx, which also takes ByValue arguments (CuPy's launch
    does not): ~20 us of host time against ~5 through CuPy, nothing in a captured graph."""
    if _timeline is not None:
        _timeline.note(kernel.name)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    block = tuple(block) + (1,) * (3 - len(block))
    values = [_c_arg(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    config = _LaunchConfig(*grid, *block, shared_mem, cp.cuda.get_current_stream().ptr, ctypes.pointer(_PDL_ATTR),
                           int(pdl))
    status = _cuda_driver().cuLaunchKernelEx(ctypes.byref(config), kernel.kernel.ptr, params, None)
    if status:
        raise RuntimeError(f"cuLaunchKernelEx failed ({status})")

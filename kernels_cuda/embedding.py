"""Embedding gather into the residual stream (embedding.cu): float32, or the table's 16 bits."""

from __future__ import annotations

import cupy as cp
import numpy as np

from ._module import check, i32, launch, module, ptr_or_null, use_bf16


def embedding(ids: cp.ndarray, table: cp.ndarray, out: cp.ndarray | None = None, pdl: bool = False,
              src: cp.ndarray | None = None, sampled: cp.ndarray | None = None) -> cp.ndarray:
    """out (T, hidden) float32 (or the table's 16-bit type: the rows as they are) = table[ids];
    ids (T,) int32, table (vocab, hidden) 16-bit. With src (T,) int32 and sampled int32: token
    t is sampled[src[t]] where src[t] >= 0."""
    check(ids, "ids", np.int32)
    if table.ndim != 2:
        raise ValueError(f"table: expected (vocab, hidden), got {table.shape}")
    T, hidden = ids.shape[0], table.shape[1]
    if (src is None) != (sampled is None):
        raise ValueError("src and sampled go together")
    if src is not None:
        check(src, "src", np.int32, (T,))
        check(sampled, "sampled", np.int32)
    if out is None:
        out = cp.empty((T, hidden), np.float32)
    check(out, "out", np.float32 if out.dtype == np.float32 else table.dtype, (T, hidden))
    if T:
        mod = module("embedding", USE_BF16=use_bf16(table), RES16=int(out.dtype != np.float32))
        launch(mod.get_function("embedding"),
               (T,), (min(1024, hidden),), (ids, ptr_or_null(src), ptr_or_null(sampled), table, out, i32(hidden)),
               pdl=pdl)
    return out


STAGE_IN_THREADS = 256


def stage_in(src_ptr: int, dst: cp.ndarray, nbytes: int) -> None:
    """dst's first nbytes <- the nbytes at src_ptr: pinned host memory allocated mapped
    (cudaHostAllocMapped, whose host address the device reads as is), over the bus, by one
    kernel. nbytes: a multiple of 16, at most dst's bytes."""
    if nbytes % 16 or not 0 < nbytes <= dst.nbytes:
        raise ValueError(f"stage_in: {nbytes} bytes must be a positive multiple of 16 within dst's {dst.nbytes}")
    if not dst.flags.c_contiguous:
        raise ValueError("stage_in: dst must be contiguous")
    n16 = nbytes // 16
    launch(module("embedding").get_function("stage_in"), (min(64, -(-n16 // STAGE_IN_THREADS)),),
           (STAGE_IN_THREADS,), (np.uint64(src_ptr), dst, i32(n16)))

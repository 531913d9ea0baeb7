"""Embedding gather into the float32 residual stream (embedding.cu)."""

from __future__ import annotations

import cupy as cp
import numpy as np

from ._module import check, i32, launch, module, use_bf16


def embedding(ids: cp.ndarray, table: cp.ndarray, out: cp.ndarray | None = None, pdl: bool = False) -> cp.ndarray:
    """out (T, hidden) float32 = table[ids]; ids (T,) int32, table (vocab, hidden) 16-bit."""
    check(ids, "ids", np.int32)
    if table.ndim != 2:
        raise ValueError(f"table: expected (vocab, hidden), got {table.shape}")
    T, hidden = ids.shape[0], table.shape[1]
    if out is None:
        out = cp.empty((T, hidden), np.float32)
    check(out, "out", np.float32, (T, hidden))
    if T:
        launch(module("embedding", USE_BF16=use_bf16(table)).get_function("embedding"),
               (T,), (min(1024, hidden),), (ids, table, out, i32(hidden)), pdl=pdl)
    return out

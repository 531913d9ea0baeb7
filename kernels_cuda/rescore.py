"""An fp8 LM head's largest logits recomputed from the 16-bit head (rescore.cu)."""

from __future__ import annotations

import cupy as cp
import numpy as np

from ._module import check, check_scalar, i32, launch, module, same_scalar, sm_count, use_bf16

TOP_THREADS = 256  # rescore.cu's
RESCORE_THREADS = 256
# a row's slices: enough blocks for every SM several times over (a lone row's 128,256 logits in
# one block would stream at one SM's pace), each slice at least MIN_SLICE logits, at most
# MAX_SPLITS (rescore_candidates' first warp merges their lists)
BLOCKS_PER_SM = 4
MIN_SLICE = 1024
MAX_SPLITS = 128


def splits(rows: int, vocab: int) -> int:
    """Slices top_candidates cuts each of `rows` rows of `vocab` logits into."""
    want = -(-BLOCKS_PER_SM * sm_count() // max(rows, 1))
    return max(1, min(want, MAX_SPLITS, vocab // MIN_SLICE))


def candidate_buffers(rows: int, vocab: int, cand: int) -> tuple[cp.ndarray, cp.ndarray]:
    """(values float32, ids int32) scratch for rescore() of up to `rows` rows: the largest
    rows x splits x cand any row count up to `rows` takes."""
    n = max(r * splits(r, vocab) for r in range(1, rows + 1)) * cand
    return cp.zeros(n, np.float32), cp.zeros(n, np.int32)


def rescore(logits: cp.ndarray, x: cp.ndarray, head: cp.ndarray, cand: int,
            scratch: tuple[cp.ndarray, cp.ndarray] | None = None, pdl: bool = False) -> None:
    """logits (rows, vocab) float32, in place: each row's `cand` largest replaced by x[row] .
    head[id] in float32 (x (rows, hidden) and head (vocab, hidden) of one 16-bit type). scratch:
    candidate_buffers' (else allocated here)."""
    check(logits, "logits", np.float32)
    if logits.ndim != 2 or x.ndim != 2 or head.ndim != 2:
        raise ValueError("logits, x and head: expected matrices")
    rows, vocab = logits.shape
    hidden = x.shape[1]
    check_scalar(x, "x")
    same_scalar(x, head, "x and head")
    check(x, "x", x.dtype, (rows, hidden))
    check(head, "head", head.dtype, (vocab, hidden))
    if not 1 <= cand <= 32:
        raise ValueError(f"cand: 1 to 32 candidates a row, got {cand}")
    if not rows:
        return
    n = splits(rows, vocab)
    cand_v, cand_i = scratch if scratch is not None else candidate_buffers(rows, vocab, cand)
    if cand_v.size < rows * n * cand or cand_i.size < rows * n * cand:
        raise ValueError(f"scratch: {rows * n * cand} candidates needed, {min(cand_v.size, cand_i.size)} given")
    mod = module("rescore", CAND=cand, USE_BF16=use_bf16(x))
    launch(mod.get_function("top_candidates"), (n, rows), (TOP_THREADS,), (logits, i32(vocab), i32(n), cand_v, cand_i),
           pdl=pdl)
    launch(mod.get_function("rescore_candidates"), (rows,), (RESCORE_THREADS,),
           (logits, i32(vocab), i32(n), cand_v, cand_i, x, head, i32(hidden)), pdl=pdl)

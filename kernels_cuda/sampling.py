"""GPU sampling and logprobs (sampling.cu), with the NumPy runner's semantics."""

from __future__ import annotations

import cupy as cp
import numpy as np

from ._module import check, function, i32, launch, module, ptr_or_null

THREADS = 1024
FEW_CAP = 4096  # sampling.cu's FEW_CAP: tokens sample_few takes at most
FEW_SMEM = (THREADS // 32) * (1024 // 2) * 4 + 1024 * 12 + FEW_CAP * 2  # sampling.cu's FEW_SMEM


def sample_tokens(logits: cp.ndarray, work: cp.ndarray, params: dict[str, cp.ndarray], counts: cp.ndarray,
                  prompt_mask: cp.ndarray, sampled: cp.ndarray, rows: int | None = None, pdl: bool = False,
                  host_out: np.ndarray | None = None, logprobs: tuple | None = None,
                  few_cap: int = FEW_CAP, few_used: cp.ndarray | None = None,
                  keys: tuple[cp.ndarray, int] | None = None) -> cp.ndarray:
    """Sample one token per row of logits (R, V) float32 into sampled (R,) int32, and where
    host_out (pinned int32 host memory) is given, into host_out[params["out_index"][row]] too:
    the host reads them there once the step is done, with no copy after it. With logprobs =
    (out_lp, out_rank, top_ids, top_lp): token_logprobs' outputs for the sampled tokens of the
    rows with params["lp_n"] >= 0, in the same launch.

    A row with top-k, top-p or min-p whose filters keep at most few_cap tokens (and whose kept
    tokens lie within 64 nats of its largest logit) takes its thresholds from those tokens,
    gathered into shared memory (sample_few); a top-p row whose nucleus is larger, from the
    tokens of the bins its threshold can lie in, if those are at most few_cap. Other rows with
    filters bisect over the whole row. few_cap=0 makes every row bisect (the tests compare the
    two). few_used (R,) int32, if given, gets 1 for each sampled row whose threshold sample_few
    found, 0 for the other sampled rows (greedy rows: untouched).

    keys = (keys (>= rows, stride) uint64, count), as gemv.gemv_keys left them with these logits:
    a greedy row with no penalties, biases or bans takes the max of its first `count` keys (the
    same token as its argmax over the logits) and does not read its logits for the token.

    params: per-row device arrays temperature, top_p, min_p, rep_pen, freq_pen, pres_pen
    (float32); top_k, counters, pen_slot, bias_n, banned_n (int32); seeds (uint64);
    bias_ids (R, max_bias) int32, bias_vals (R, max_bias) float32, banned_ids
    (R, max_banned) int32. counts (slots, V) int32 and prompt_mask (slots, ceil(V/32))
    uint32 hold the penalty state of the slots named by pen_slot.
    """
    R, V = logits.shape
    rows = R if rows is None else rows
    check(logits, "logits", np.float32)
    check(work, "work", np.float32)
    if work.shape[1] != V or work.shape[0] < rows:
        raise ValueError(f"work: expected at least ({rows}, {V}), got {work.shape}")
    for name in ("temperature", "top_p", "min_p", "rep_pen", "freq_pen", "pres_pen"):
        check(params[name], name, np.float32)
    for name in ("top_k", "counters", "pen_slot", "bias_n", "banned_n"):
        check(params[name], name, np.int32)
    check(params["seeds"], "seeds", np.uint64)
    check(counts, "counts", np.int32)
    if counts.shape[1] != V:
        raise ValueError(f"counts: expected (slots, {V}), got {counts.shape}")
    check(prompt_mask, "prompt_mask", np.uint32, (counts.shape[0], (V + 31) // 32))
    check(sampled, "sampled", np.int32)
    if host_out is not None:
        if host_out.dtype != np.int32:
            raise ValueError(f"host_out: expected int32, got {host_out.dtype}")
        check(params["out_index"], "out_index", np.int32)
    p = params
    if logprobs is not None:
        check_logprobs(p["lp_n"], *logprobs)
    out_lp, out_rank, top_ids, top_lp = logprobs or (None,) * 4
    if few_used is not None:
        check(few_used, "few_used", np.int32)
    key_arr, key_count = keys if keys is not None else (None, 0)
    if key_arr is not None:
        check(key_arr, "keys", np.uint64)
        if key_arr.ndim != 2 or key_arr.shape[0] < rows or not 0 < key_count <= key_arr.shape[1]:
            raise ValueError(f"keys: expected ({rows}+, >= {key_count}) with a count > 0, got {key_arr.shape}")
    if rows:
        launch(function(module("sampling"), "sample_tokens", FEW_SMEM), (rows,), (THREADS,),
               (logits, work, i32(V), p["temperature"], p["top_k"], p["top_p"], p["min_p"], p["seeds"],
                p["counters"], p["rep_pen"], p["freq_pen"], p["pres_pen"], p["pen_slot"], counts, prompt_mask,
                p["bias_n"], p["bias_ids"], p["bias_vals"], i32(p["bias_ids"].shape[1]),
                p["banned_n"], p["banned_ids"], i32(p["banned_ids"].shape[1]), sampled,
                np.uint64(0 if host_out is None else host_out.ctypes.data),
                ptr_or_null(None if host_out is None else p["out_index"]),
                ptr_or_null(None if logprobs is None else p["lp_n"]), ptr_or_null(out_lp), ptr_or_null(out_rank),
                ptr_or_null(top_ids), ptr_or_null(top_lp), i32(0 if top_ids is None else top_ids.shape[1]),
                i32(min(few_cap, FEW_CAP)), ptr_or_null(few_used), ptr_or_null(key_arr), i32(key_count),
                i32(0 if key_arr is None else key_arr.shape[1])), shared_mem=FEW_SMEM, pdl=pdl)
    return sampled


def plain_params(temperature: list[float], top_k: int = 0, top_p: float = 1.0) -> dict[str, cp.ndarray]:
    """sample_tokens' per-row parameters for rows of these temperatures, each with this top-k and
    top-p and no min-p, penalties, biases, bans or logprobs; row r's token goes to out_index r
    (tests and bench/kernels.py)."""
    R = len(temperature)
    full = lambda v, dtype: cp.full(R, v, dtype)  # noqa: E731
    return {"temperature": cp.asarray(np.array(temperature, np.float32)), "top_k": full(top_k, cp.int32),
            "top_p": full(top_p, cp.float32), "min_p": full(0.0, cp.float32), "rep_pen": full(1.0, cp.float32),
            "freq_pen": full(0.0, cp.float32), "pres_pen": full(0.0, cp.float32),
            "seeds": cp.arange(R, dtype=cp.uint64), "counters": full(0, cp.int32), "pen_slot": full(-1, cp.int32),
            "bias_n": full(0, cp.int32), "banned_n": full(0, cp.int32), "bias_ids": cp.zeros((R, 1), cp.int32),
            "bias_vals": cp.zeros((R, 1), cp.float32), "banned_ids": cp.zeros((R, 1), cp.int32),
            "lp_n": full(-1, cp.int32), "out_index": cp.arange(R, dtype=cp.int32)}


def token_logprobs(logits: cp.ndarray, lp_n: cp.ndarray, target_ids: cp.ndarray, out_lp: cp.ndarray,
                   out_rank: cp.ndarray, top_ids: cp.ndarray, top_lp: cp.ndarray, rows: int | None = None,
                   pdl: bool = False) -> None:
    """Per row with lp_n >= 0: logprob and rank of target_ids[row] under the raw logits,
    and the lp_n (<= top_ids.shape[1]) most likely tokens with their logprobs."""
    R, V = logits.shape
    rows = R if rows is None else rows
    check(logits, "logits", np.float32)
    check(target_ids, "target_ids", np.int32)
    check_logprobs(lp_n, out_lp, out_rank, top_ids, top_lp)
    if rows:
        launch(module("sampling").get_function("token_logprobs"), (rows,), (THREADS,),
               (logits, i32(V), lp_n, target_ids, out_lp, out_rank, top_ids, top_lp, i32(top_ids.shape[1])), pdl=pdl)


def check_logprobs(lp_n: cp.ndarray, out_lp: cp.ndarray, out_rank: cp.ndarray, top_ids: cp.ndarray,
                   top_lp: cp.ndarray) -> None:
    check(lp_n, "lp_n", np.int32)
    check(out_lp, "out_lp", np.float32)
    check(out_rank, "out_rank", np.int32)
    check(top_ids, "top_ids", np.int32)
    check(top_lp, "top_lp", np.float32, top_ids.shape)

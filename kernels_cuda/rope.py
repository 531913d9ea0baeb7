"""RoPE fused with the KV-cache write (rope.cu)."""

from __future__ import annotations

import cupy as cp
import numpy as np

from ._module import (check, check_scalar, i32, i64, launch, module, prod_kind, ptr_or_null, scale_args,
                      use_bf16, wide_threads)


# most threads a block (one token each) in steps of _module.WIDE_MIN_ROWS tokens or more; a thread
# takes the rest of the token's groups in turn, four at a time (rope.cu's unrolled loops). H200,
# Llama-3-8B's QKV product as bfloat16 sums with float8 scales, fp8 K/V: 2,048 tokens 37.9 us at
# 640 threads (one group each) -> 16.3 us at 128; 8,192: 148.4 -> 60.2; same bits
ROPE_THREADS = 128

# steps of ROWS_MIN_ROWS tokens or more (head_dim a multiple of 16) take rope.cu's
# rope_kv_write_rows: ROWS_THREADS threads a token, each asking for all of its 8-value items
# (ROPE_ITEMS of them) before it uses any. Same bits. H200, Llama-3-8B's QKV (bfloat16 sums,
# fp8 K/V), captured graphs with PDL, us, the one-block form -> this: 256 tokens 3.26 -> 2.39,
# 512 4.97 -> 3.48, 1,024 7.74 -> 6.82, 2,040 14.95 -> 14.36 (float16 sums 15.07 -> 13.08);
# 128 threads a token were no faster than the one-block form from 1,024 tokens up
ROWS_MIN_ROWS = 256
ROWS_THREADS = 256


def rows_items(T: int, num_heads: int, num_kv_heads: int, head_dim: int, rows: bool | None = None) -> int:
    """Items a thread of rope_kv_write_rows takes for this launch; 0: the one-block-a-token form.
    rows: force the form (True / False), else chosen by T."""
    if head_dim % 16 or rows is False or (rows is None and T < ROWS_MIN_ROWS):
        return 0
    items = (num_heads + num_kv_heads) * head_dim // 16 + num_kv_heads * head_dim // 8
    return -(-items // ROWS_THREADS)


def check_rope_args(T: int, width: int, positions: cp.ndarray, cos: cp.ndarray, sin: cp.ndarray,
                    k_ptrs: cp.ndarray, v_ptrs: cp.ndarray, q_out: cp.ndarray | None, num_heads: int, head_dim: int,
                    bias: cp.ndarray | None) -> None:
    """The checks rope_kv_write, the fused QKV product (gemv.gemv_rope) and the attention block
    (attn_block, which keeps q to itself: q_out None) share."""
    check(positions, "positions", np.int32, (T,))
    check(cos, "cos", np.float32)
    check(sin, "sin", np.float32, cos.shape)
    if cos.ndim != 2 or cos.shape[1] != head_dim // 2:
        raise ValueError(f"cos: expected (max_len, {head_dim // 2}), got {cos.shape}")
    check(k_ptrs, "k_ptrs", np.int64, (T,))
    check(v_ptrs, "v_ptrs", np.int64, (T,))
    if q_out is not None:
        check_scalar(q_out, "q_out")
        check(q_out, "q_out", q_out.dtype, (T, num_heads, head_dim))
    if bias is not None:
        check(bias, "bias", np.float32, (width,))


def rope_kv_write(qkv: cp.ndarray, positions: cp.ndarray, cos: cp.ndarray, sin: cp.ndarray,
                  k_ptrs: cp.ndarray, v_ptrs: cp.ndarray, layer_offset: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, q_out: cp.ndarray, bias: cp.ndarray | None = None, pdl: bool = False,
                  kv_fp8: bool = False, scales: tuple | None = None, rows: bool | None = None) -> cp.ndarray:
    """Rotate q, k of a layer's QKV product; write q to q_out (T, H, D) and k, v into the cache.

    k_ptrs / v_ptrs (T,) int64: element addresses of each token's K / V region (layer 0);
    the token at position p of layer l lands at ptr + layer_offset + p * kv_heads * head_dim.
    kv_fp8: the cache holds float8 e4m3 (rounded to nearest, saturating) instead of q_out's type.
    qkv: the product in float32, float16 or bfloat16 (uint16 bits; _module.prod_kind).
    scales: qkv is a float8 product's raw sums; (per token, per feature) scales (_module.scale_args).
    rows: force rope_kv_write_rows (True) or the one-block-a-token form (False); None: by T.
    """
    if qkv.ndim != 2:
        raise ValueError(f"qkv: expected (T, width), got {qkv.shape}")
    T = qkv.shape[0]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    prod = prod_kind(qkv, "qkv")
    check(qkv, "qkv", qkv.dtype, (T, width))
    check_rope_args(T, width, positions, cos, sin, k_ptrs, v_ptrs, q_out, num_heads, head_dim, bias)
    if T:
        defines = dict(USE_BF16=use_bf16(q_out), HEAD_DIM=head_dim, KV_FP8=int(kv_fp8), PROD=prod)
        items = rows_items(T, num_heads, num_kv_heads, head_dim, rows)
        if items:
            fn, threads = module("rope", **defines, ROPE_ITEMS=items).get_function("rope_kv_write_rows"), ROWS_THREADS
        else:
            fn = module("rope", **defines).get_function("rope_kv_write")
            threads = wide_threads(T, (num_heads + num_kv_heads) * head_dim // 2, 4, ROPE_THREADS)
        launch(fn, (T,), (threads,),
               (qkv, ptr_or_null(bias), positions, cos, sin, q_out, k_ptrs, v_ptrs, i64(layer_offset),
                i32(num_heads), i32(num_kv_heads), *scale_args(scales, T, width)), pdl=pdl)
    return q_out

"""The attention block of a decode step in one kernel (attn_block.cu): input norm, QKV, RoPE
and the K/V write, split-KV attention and the o product, for models whose per-block slices
of the QKV and o weights fit in shared memory (SmolLM2-135M and smaller). The o product
comes out in kv_heads parts that the next kernel's folded norm adds (gemv.NormIn)."""

from __future__ import annotations

import cupy as cp
import numpy as np

from ._module import (MAX_BLOCK_SMEM, align16, check, check_scalar, f32, function, i32, i64, launch, module,
                      ptr_or_null, sm90_or_newer, use_bf16)
from .gemv import NormIn
from .rmsnorm import delta_parts
from .rope import check_rope_args

CLUSTER = 8  # attn_block.cu's blocks a cluster: the KV head's keys and weight rows in eighths
THREADS = 256
TILE = 64


def smem_bytes(hidden: int, head_dim: int, group: int, kv_fp8: bool) -> int:
    """attn_block.cu's layout: the block's QKV and o weight slices, the normed row, two
    double-buffered K/V tiles, the token's K/V row, and the float arrays."""
    kv = 1 if kv_fp8 else 2
    rw, qw = (group + 2) * head_dim, group * head_dim
    rc, oc = rw // CLUSTER, hidden // CLUSTER
    tile = align16(TILE * (head_dim + 16 // kv) * kv)
    fixed = (align16(rc * hidden * 2) + align16(oc * qw * 2) + align16(hidden * 2) + 4 * tile
             + align16(2 * head_dim * kv))
    floats = rc + rw + qw + group * TILE + 3 * group + 2 * qw + 2 * CLUSTER * group + head_dim + 32
    return fixed + 4 * floats


def device_supported() -> bool:
    """Thread-block clusters and distributed shared memory need compute capability 9.0."""
    return sm90_or_newer()


def supported(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, kv_fp8: bool) -> bool:
    """Whether the kernel takes this shape: whole 16-byte pieces, QKV rows and output
    features that split into CLUSTER equal parts, and a block's shared memory within sm_90's."""
    if num_heads % num_kv_heads or head_dim % 8 or (kv_fp8 and head_dim % 16):
        return False
    group = num_heads // num_kv_heads
    if ((group + 2) * head_dim) % CLUSTER or hidden % CLUSTER or hidden % 8:
        return False
    return smem_bytes(hidden, head_dim, group, kv_fp8) <= MAX_BLOCK_SMEM


def attn_block(norm: NormIn, w_qkv: cp.ndarray, qkv_bias: cp.ndarray | None, w_o: cp.ndarray,
               positions: cp.ndarray, cos: cp.ndarray, sin: cp.ndarray, k_ptrs: cp.ndarray, v_ptrs: cp.ndarray,
               kv_lens: cp.ndarray, layer_offset: int, num_heads: int, num_kv_heads: int, out_parts: cp.ndarray,
               scale: float, window: int = 0, pdl: bool = False, kv_fp8: bool = False) -> cp.ndarray:
    """out_parts[g] (B, hidden) float32, g < num_kv_heads: the o product of the attention of
    KV head g's query heads, for B one-token rows (sum the parts for o). The rows are made
    as a product's folded norm makes them (gemv.NormIn, without bias or parts): RMSNorm(res
    + delta), res + delta to res_out. w_qkv ((heads + 2 kv_heads) head_dim, hidden) and w_o
    (hidden, heads head_dim) 16-bit; qkv_bias (that many,) float32 or None. positions,
    cos / sin, k_ptrs / v_ptrs and layer_offset as rope.rope_kv_write's: the token's K/V
    row goes to the cache at its position; kv_lens (B,) int32 counts it (0: a padding row,
    left alone). out_parts (kv_heads, B, hidden): a view whose parts may lie apart (a part's
    rows contiguous). window: sliding window (0: none)."""
    if norm.res.ndim != 2:
        raise ValueError(f"attn_block: norm.res (B, hidden), got {norm.res.shape}")
    B, hidden = norm.res.shape
    if norm.bias is not None or (norm.delta is not None and norm.delta.ndim != 2):
        raise ValueError("attn_block: the input norm takes no bias and a delta in one part")
    res, delta, _, weight, eps, res_out, _, _ = norm.args(B, hidden)
    check_scalar(w_qkv, "w_qkv")
    head_dim = w_o.shape[1] // num_heads if w_o.ndim == 2 else 0
    if not supported(hidden, num_heads, num_kv_heads, head_dim, kv_fp8):
        raise ValueError(f"attn_block: hidden {hidden}, {num_heads} heads / {num_kv_heads} KV heads of {head_dim} "
                         f"(fp8 K/V {kv_fp8}) is not a shape this kernel takes (see supported)")
    check(w_qkv, "w_qkv", w_qkv.dtype, ((num_heads + 2 * num_kv_heads) * head_dim, hidden))
    check(w_o, "w_o", w_qkv.dtype, (hidden, num_heads * head_dim))
    check_rope_args(B, w_qkv.shape[0], positions, cos, sin, k_ptrs, v_ptrs, None, num_heads, head_dim, qkv_bias)
    check(kv_lens, "kv_lens", np.int32, (B,))
    if out_parts.ndim != 3 or out_parts.shape[0] != num_kv_heads:
        raise ValueError(f"attn_block: out_parts ({num_kv_heads}, {B}, {hidden}), got {out_parts.shape}")
    _, part_stride = delta_parts(out_parts, B, hidden, "out_parts")
    group = num_heads // num_kv_heads
    mod = module("attn_block", USE_BF16=use_bf16(w_qkv), HEAD_DIM=head_dim, GROUP=group, HIDDEN=hidden,
                 KV_FP8=int(kv_fp8))
    smem = smem_bytes(hidden, head_dim, group, kv_fp8)
    launch(function(mod, "attn_block", smem), (CLUSTER * num_kv_heads, B), (THREADS,),
           (res, delta, weight, eps, res_out, w_qkv, ptr_or_null(qkv_bias), w_o, positions, cos, sin, k_ptrs,
            v_ptrs, kv_lens, i64(layer_offset), out_parts, i64(part_stride), i32(num_heads), i32(num_kv_heads),
            i32(window), f32(scale)), shared_mem=smem, pdl=pdl)
    return out_parts

"""Decode attention and the o product of a small model in one kernel (attn_o.cu), for steps
of up to 16 one-token rows: each of SLICES blocks of a KV head runs that head's attention
over the row's keys (flash_decode's arithmetic, the row as one split) and its slice of the o
product's output features. The o product comes out in kv_heads parts that the next kernel's
norm adds (gemv.NormIn, rmsnorm.add_rms_norm)."""

from __future__ import annotations

import cupy as cp
import numpy as np

from . import flash_decode
from ._module import (MAX_BLOCK_SMEM, align16, check, check_scalar, f32, function, i32, i64, launch, module,
                      use_bf16)
from .rmsnorm import delta_parts

SLICES = 16  # attn_o.cu's blocks a KV head a row, each a sixteenth of the output features (H200, SmolLM2
# B=1 graphs at 96 keys: 8 slices 0.376-0.380 ms, 16 0.369-0.370, 24 0.375-0.378)


def smem_bytes(hidden: int, head_dim: int, group: int, kv_fp8: bool, slices: int = SLICES) -> int:
    """attn_o.cu's layout: flash_decode's (its decode_split), then the block's o weight slice."""
    return align16(flash_decode.smem_bytes(head_dim, kv_fp8, group)) + hidden // slices * group * head_dim * 2


def supported(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, kv_fp8: bool) -> bool:
    """Whether the kernel takes this shape: whole 16-byte pieces, output features that split
    into SLICES equal parts, and a block's shared memory within sm_90's."""
    if num_heads % num_kv_heads or head_dim % 16 or (kv_fp8 and head_dim % 32) or hidden % SLICES:
        return False
    if num_heads // num_kv_heads > 16 or head_dim > 256:
        return False
    return smem_bytes(hidden, head_dim, num_heads // num_kv_heads, kv_fp8) <= MAX_BLOCK_SMEM


def attn_o(q: cp.ndarray, w_o: cp.ndarray, k_ptrs: cp.ndarray, v_ptrs: cp.ndarray, kv_lens: cp.ndarray,
           layer_offset: int, num_kv_heads: int, attn_out: cp.ndarray, out_parts: cp.ndarray, scale: float,
           window: int = 0, pdl: bool = False, kv_fp8: bool = False) -> cp.ndarray:
    """out_parts[g] (B, hidden) float32, g < num_kv_heads: the o product (w_o (hidden, heads
    head_dim), 16-bit) of the attention of KV head g's query heads, for B one-token rows of q
    (B, heads, head_dim), rotated, each attending to its kv_lens[b] cached keys (its own
    included; 0: a padding row, left alone) at k_ptrs / v_ptrs[b] + layer_offset, as
    flash_decode reads them. The attention goes to attn_out (B, heads, head_dim) as flash_decode
    writes it. Sum the parts for o. out_parts (kv_heads, B, hidden): a view
    whose parts may lie apart (a part's rows contiguous). window: sliding window (0: none)."""
    if q.ndim != 3:
        raise ValueError(f"attn_o: q (B, heads, head_dim), got {q.shape}")
    B, heads, head_dim = q.shape
    check_scalar(q, "q")
    check(q, "q", q.dtype)
    hidden = w_o.shape[0] if w_o.ndim == 2 else 0
    if not supported(hidden, heads, num_kv_heads, head_dim, kv_fp8):
        raise ValueError(f"attn_o: hidden {hidden}, {heads} heads / {num_kv_heads} KV heads of {head_dim} "
                         f"(fp8 K/V {kv_fp8}) is not a shape this kernel takes (see supported)")
    check(w_o, "w_o", q.dtype, (hidden, heads * head_dim))
    check(attn_out, "attn_out", q.dtype, (B, heads, head_dim))
    for name, arr, dt in (("k_ptrs", k_ptrs, np.int64), ("v_ptrs", v_ptrs, np.int64), ("kv_lens", kv_lens, np.int32)):
        check(arr, name, dt, (B,))
    if out_parts.ndim != 3 or out_parts.shape[0] != num_kv_heads:
        raise ValueError(f"attn_o: out_parts ({num_kv_heads}, {B}, {hidden}), got {out_parts.shape}")
    _, part_stride = delta_parts(out_parts, B, hidden, "out_parts")
    group = heads // num_kv_heads
    mod = module("attn_o", USE_BF16=use_bf16(q), HEAD_DIM=head_dim, GROUP=group, HIDDEN=hidden, SLICES=SLICES,
                 KV_FP8=int(kv_fp8), SWAP=int(flash_decode.swapped(group, kv_fp8)))
    smem = smem_bytes(hidden, head_dim, group, kv_fp8)
    launch(function(mod, "attn_o", smem), (SLICES * num_kv_heads, B), (flash_decode.CHUNK_THREADS,),
           (q, w_o, k_ptrs, v_ptrs, kv_lens, i64(layer_offset), attn_out, out_parts, i64(part_stride), i32(heads),
            i32(num_kv_heads), i32(window), f32(scale)), shared_mem=smem, pdl=pdl)
    return out_parts

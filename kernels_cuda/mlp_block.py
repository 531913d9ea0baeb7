"""The second half of a decoder layer in one kernel (mlp_block.cu): the o product, the residual
add and post-attention RMSNorm, gate/up, SiLU * up and the down product, for decode steps of
up to MAX_ROWS rows of models whose per-block weight slices fit in shared memory
(SmolLM2-135M and smaller). The down product comes out in parts() parts that the next
kernel's norm adds (gemv.NormIn, rmsnorm.add_rms_norm)."""

from __future__ import annotations

import cupy as cp
import numpy as np

from ._module import (
    MAX_BLOCK_SMEM,
    align16,
    check,
    check_scalar,
    f32,
    function,
    i32,
    i64,
    launch,
    module,
    ptr_or_null,
    use_bf16,
)
from .rmsnorm import delta_parts

CLUSTER = 8  # mlp_block.cu's blocks a cluster: the o features in eighths
FEAT = 16  # intermediate features a block owns
THREADS = 256
MAX_ROWS = 16
PAD = 8  # 16-bit values after each shared-memory row


def smem_bytes(hidden: int, q_width: int) -> int:
    """mlp_block.cu's layout: the o, gate/up and down weight slices, the attention / normed rows, SiLU *
    up, the block's o features, gate and up, and the down share (also the warps' sums)."""
    oc = hidden // CLUSTER
    fixed = (align16(oc * (q_width + PAD) * 2) + align16(2 * FEAT * (hidden + PAD) * 2)
             + align16(hidden * FEAT * 2) + align16(MAX_ROWS * (max(q_width, hidden) + PAD) * 2)
             + align16(MAX_ROWS * (FEAT + PAD) * 2) + align16(MAX_ROWS * oc * 4) + align16(MAX_ROWS * 2 * FEAT * 4))
    red = 8 * max(oc // 8, 2 * FEAT // 8) * 128
    return fixed + 4 * max(MAX_ROWS * hidden, red)


def parts(intermediate: int) -> int:
    """Parts the down product comes out in: one a cluster."""
    return intermediate // (FEAT * CLUSTER)


def down_blocks(w_down: cp.ndarray) -> cp.ndarray:
    """The down product's (hidden, intermediate) matrix as the kernel reads it: (intermediate
    / FEAT, hidden, FEAT), the columns of a block's features together (one copy a block)."""
    hidden, inter = w_down.shape
    return cp.ascontiguousarray(w_down.reshape(hidden, inter // FEAT, FEAT).transpose(1, 0, 2))


def supported(hidden: int, q_width: int, intermediate: int) -> bool:
    """Whether the kernel takes this shape: o features that split into CLUSTER tiles of 8,
    k-steps of 16, intermediate features in whole clusters of FEAT a block, and a block's
    shared memory within sm_90's."""
    if hidden % (8 * CLUSTER) or q_width % 16 or hidden % 16 or intermediate % (FEAT * CLUSTER):
        return False
    return smem_bytes(hidden, q_width) <= MAX_BLOCK_SMEM


def mlp_block(res: cp.ndarray, attn: cp.ndarray, w_o: cp.ndarray, o_bias: cp.ndarray | None, norm_w: cp.ndarray,
              eps: float, res_out: cp.ndarray, w_gate_up: cp.ndarray, w_down_blocks: cp.ndarray, out_parts: cp.ndarray,
              pdl: bool = False) -> cp.ndarray:
    """For B <= MAX_ROWS rows: h = res + attn @ w_o^T (+ o_bias) to res_out (float32, not res
    itself), x = RMSNorm(h) * norm_w (16-bit), a = SiLU(x @ gate^T) * (x @ up^T) (16-bit),
    and a @ w_down^T in parts(intermediate) parts out_parts[p] (B, hidden) float32, to be
    added in order. res (B, hidden) float32; attn (B, q_width) 16-bit; w_o (hidden, q_width),
    w_gate_up (2 intermediate, hidden: gate rows, then up rows) 16-bit, w_down_blocks: the
    (hidden, intermediate) 16-bit down matrix as down_blocks lays it out; o_bias (hidden,)
    float32 or None; norm_w (hidden,) float32. out_parts (P, B, hidden): a view whose parts
    may lie apart (a part's rows contiguous)."""
    if res.ndim != 2 or attn.ndim != 2 or attn.shape[0] != res.shape[0]:
        raise ValueError(f"mlp_block: res (B, hidden) and attn (B, q_width), got {res.shape}, {attn.shape}")
    B, hidden = res.shape
    q_width = attn.shape[1]
    if not 1 <= B <= MAX_ROWS:
        raise ValueError(f"mlp_block: 1 to {MAX_ROWS} rows, got {B}")
    check_scalar(attn, "attn")
    check(attn, "attn", attn.dtype, (B, q_width))
    inter = w_down_blocks.shape[0] * FEAT if w_down_blocks.ndim == 3 else 0
    if not supported(hidden, q_width, inter):
        raise ValueError(f"mlp_block: hidden {hidden}, o input {q_width}, intermediate {inter} is not a shape "
                         "this kernel takes (see supported)")
    check(res, "res", np.float32, (B, hidden))
    check(res_out, "res_out", np.float32, (B, hidden))
    if res_out.data.ptr == res.data.ptr:
        raise ValueError("mlp_block: res_out must not be res (other blocks still read it)")
    check(w_o, "w_o", attn.dtype, (hidden, q_width))
    check(w_gate_up, "w_gate_up", attn.dtype, (2 * inter, hidden))
    check(w_down_blocks, "w_down_blocks", attn.dtype, (inter // FEAT, hidden, FEAT))
    check(norm_w, "norm_w", np.float32, (hidden,))
    if o_bias is not None:
        check(o_bias, "o_bias", np.float32, (hidden,))
    P = parts(inter)
    if out_parts.ndim != 3 or out_parts.shape[0] != P:
        raise ValueError(f"mlp_block: out_parts ({P}, {B}, {hidden}), got {out_parts.shape}")
    _, part_stride = delta_parts(out_parts, B, hidden, "out_parts")
    mod = module("mlp_block", USE_BF16=use_bf16(attn), HIDDEN=hidden, QW=q_width, INTER=inter)
    smem = smem_bytes(hidden, q_width)
    launch(function(mod, "mlp_block", smem), (inter // FEAT,), (THREADS,),
           (res, attn, w_o, ptr_or_null(o_bias), norm_w, f32(eps), res_out, w_gate_up, w_down_blocks, out_parts,
            i64(part_stride), i32(B)), shared_mem=smem, pdl=pdl)
    return out_parts

"""The CUDA runner: the NumPy runner's interface, on a GPU through CuPy.

Weights live on the device in fp16 (bf16 for bf16 checkpoints), with Q/K/V and
gate/up fused. Every buffer a step touches is allocated once at start: the
activations (sized for the largest step), `DecodeBuffers` (per-row inputs, flash
partials, logits, sampling state) and the KV pool, which takes the memory the cache
config leaves. A step whose rows are all single decode tokens fills the per-row
inputs with one host-to-device copy and replays the CUDA graph captured for the
smallest batch bucket >= B (padding rows point at a spare KV slot and change
nothing). Steps with prefill chunks run as one ragged batch (cuBLAS GEMMs + the
flash-attention prefill kernel), their inputs staged in one copy too: up to
RAGGED_GRAPH_TOKENS[-1] tokens they replay graphs of the layers captured for the next
token count (with every layer's attention but the last's where the prompts' attention reads
its tile count on the device, else in pieces with the attention, whose launch follows the
step's sequences, between them); larger steps, bound by the device, launch eagerly.
Sampling runs on the GPU; only the sampled ids (and requested logprobs) come back. `submit`
launches a step and returns a function that waits for it, so the engine can use the host
meanwhile; `execute` is the two in one.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import cupy as cp
import cupyx
import numpy as np

from kernels_cuda import attn_block as attn_block_module
from kernels_cuda import attn_o as attn_o_module
from kernels_cuda import mlp_block as mlp_block_module
from kernels_cuda._module import early_triggers, pdl_supported, record_event, sm_count
from kernels_cuda.activation import silu_mul
from kernels_cuda.embedding import embedding, stage_in
from kernels_cuda.flash_decode import BLOCKS_PER_SM as FLASH_BLOCKS_PER_SM
from kernels_cuda.flash_decode import KEYS as FLASH_KEYS
from kernels_cuda.flash_decode import MAX_SPLITS as FLASH_MAX_SPLITS
from kernels_cuda.flash_decode import flash_decode, qk_wgmma
from kernels_cuda.flash_prefill import BLOCK_M as PREFILL_TILE
from kernels_cuda.flash_prefill import flash_prefill, tiles, use_wgmma
from kernels_cuda.gemm import (fp8_tuned, gemm, gemm_fp8, gemm_fp8_scaled, rows_bucket, tune_gemm_fp8,
                               tune_gemm_fp8_wgmma, wgmma_supported)
from kernels_cuda.gemv import MAX_ROWS as GEMV_MAX_ROWS
from kernels_cuda.gemv import NormIn, gemv, gemv_keys, gemv_rope, gemv_silu
from kernels_cuda.quant import Fp8Matrix, Q8Matrix, quantize_matrix, quantize_rows
from kernels_cuda.rmsnorm import add_rms_norm, rms_norm, rows_kernel
from kernels_cuda.rescore import candidate_buffers, rescore
from kernels_cuda.rope import rope_kv_write
from kernels_cuda.sampling import sample_tokens, token_logprobs

from ..config import EngineConfig, ModelConfig
from ..loader import LoadedModel
from ..loader.quants import q8_0_split
from ..loader.random_model import WEIGHT_STD, RandomWeights
from ..loader.weights import Weights
from ..outputs import RunnerOutput, ScheduledSeq, SchedulerOutput, TokenLogprobs
from ..request import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, SamplingParams
from .numpy_runner import rope_tables
from .packing import ModelWeights, pack_model

log = logging.getLogger("cuserve.cuda")


def graph_buckets(largest: int = 1024, fine_from: int = 64) -> tuple[int, ...]:
    """The row counts decode graphs are captured for (a step runs the smallest that holds its
    rows, the rest padding): powers of two up to `fine_from`, then four a doubling (64, 80, 96,
    112, 128, 160, ...). A step's products, LM head and row-wise kernels run on all of its
    bucket's rows, which from ~64 rows of the 8B shape on cost more with each row: with powers of
    two alone a step of 129-255 rows ran the 256-row graph (docs/performance.md, fiftieth
    session), one of 65-127 rows the 128-row graph (fifty-first). Each graph's fp8 products are
    tuned for its rows (_tune_products), so each bucket costs start-up time."""
    out, p = [], 1
    while p <= largest:
        out.extend(m for m in ((p,) if p < fine_from else (p, p * 5 // 4, p * 3 // 2, p * 7 // 4)) if m <= largest)
        p *= 2
    return tuple(out)


BUCKETS = graph_buckets()
MAX_BANNED = MAX_STOP_TOKEN_IDS + 8  # stop_token_ids + eos ids while min_tokens holds
GRAPH_RESERVE_BYTES = 512 << 20  # left free for cuBLAS workspaces and graph instantiation
# A sequence's sampling values that do not change (CudaRunner._param_rows, in this order:
# _param_values): those staged for each row as they are, and two the host reads (min_tokens,
# whether a penalty applies)
PARAM_FIELDS = {"temperature": np.float32, "top_k": np.int32, "top_p": np.float32, "min_p": np.float32,
                "rep_pen": np.float32, "freq_pen": np.float32, "pres_pen": np.float32, "lp_n": np.int32,
                "bias_n": np.int32, "min_tokens": np.int64, "penalized": np.bool_}
PARAM_STAGED = tuple(name for name in PARAM_FIELDS if name not in ("min_tokens", "penalized"))


def _param_values(p: SamplingParams) -> tuple:
    """p's values of PARAM_FIELDS, in its order."""
    return (p.temperature, p.top_k or 0, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty,
            p.presence_penalty, -1 if p.logprobs is None else p.logprobs, len(p.logit_bias), p.min_tokens,
            p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty))


# Ragged steps (prefill, mixed) of up to the last of these tokens (the default step budget)
# replay graphs of their layers, captured for each of these token counts (the step padded to
# the next one), with the attention launched between them (_capture_ragged). Launched eagerly,
# such a step is bound by the host's ~350 launches for an 8B model (~9-10 ms; a 128-token
# prompt's TTFT 16 ms against 4 ms replayed), and a small model's steps are at every size
# (SmolLM2, 2,048 tokens: 8-13 ms a step). Larger steps launch eagerly. Each count stays in its
# power-of-two bucket of rows, where cuBLASLt's algorithm is chosen (gemm._Lt.plan), so padding
# changes no product's algorithm.
RAGGED_GRAPH_TOKENS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1152, 1280, 1408,
                       1536, 1664, 1792, 1920, 2048)
# The decode attention keeps up to ~222 KB of shared memory on an SM; a kernel that starts
# while it drains (programmatic dependent launch) runs with that split of the SM's memory,
# ~28 KB of L1, and the skinny GEMM re-reads its input rows from L1. So the o projection
# overlaps the attention only when its input is this small (H200, Llama-3-8B shape:
# B=8 5.07 -> 4.85 ms a step, B=16 7.44 -> 6.34 ms without the overlap; B=1 and SmolLM2's
# small rows are as fast or faster with it).
O_PROJ_PDL_MAX_INPUT = 16 << 10


# Models up to this hidden size run their RMSNorms inside the products after them in steps of
# up to FOLD_NORM_MAX_ROWS rows (CudaRunner._fold_norms).
FOLD_NORM_MAX_HIDDEN = 1024
FOLD_NORM_MAX_ROWS = 1

# The decode graphs of a model of hidden size <= EARLY_TRIGGER_MAX_HIDDEN are built from kernels
# that let the next one launch before their own wait (common.cuh's EARLY_TRIGGER, all but the
# embedding after stage_in), so that a kernel's loads before its wait (weights, earlier steps'
# keys) overlap the whole kernel before it, not just its end. H200, decode graphs at B=1 (every
# kernel so built against the default, alternated in one process; .devexp/s63/et.py): SmolLM2's
# shape 326.6 -> 324.9 us at 40 keys, 337.0 -> 333.3 at 160; Llama-3-8B's at 575 keys 4,140 ->
# 4,156 us (its products stream weights at the memory's rate, and the next one's prefetch competes
# with them), hence small models only; SmolLM2's GGUF in the engine, B=1 / 16: +0.8-2.7 % / +10 %.
# Not with fp8 layer weights: their graphs of SmolLM2's shape at 160 keys are slower with it at 1-12
# rows (-6.6 to -11.6 %), faster only at 16 (+5.6 %) and the same from 24 (H200; docs/performance.md,
# sixty-fifth session).
# (The GPU runner tests whose names hold fp8, and the residual-add ones, pass with it on: 27 of 27.)
EARLY_TRIGGER_MAX_HIDDEN = 1024

# Decode steps of a small model with the attention block as one kernel (CudaRunner._attn_block).
# Off: on the H200 the SmolLM2 decode graphs (alternated in one process) at 511 keys took
# 0.4611 -> 0.4377 ms at B=1, 0.5175 -> 0.4791 at B=2, 0.5459 -> 0.4927 at B=4, but 0.6168 ->
# 0.7760 at B=8 (two waves of clusters) and 0.3861 -> 0.4291 at B=1 with 100 keys: the kernel's
# stage (6.5 us) is shorter than the three it replaces (~8 us), yet the down product before it
# grows from ~1.9 to ~4.1 us while its blocks stream their weight slices. It must serve every
# step of up to 16 rows or none (batch invariance), so it stays off until it wins at all of them.
FUSE_ATTENTION = False

# Decode steps of up to GEMV_MAX_ROWS rows of a small model with the attention and the o product
# as one kernel (CudaRunner._attn_o). Off: on the H200 the SmolLM2 decode graphs at 96 keys
# (alternated in one process) took 0.380 -> 0.369-0.370 ms at B=1, but 0.459 -> 0.488-0.493 at
# B=2 and 0.514-0.515 -> 0.568 at B=8 (0.380 -> 0.403-0.406 at B=1 with 160 keys and 8 slices):
# its stage (4.0 us at B=1) is shorter than the two it replaces (attention 2.8 + o 2.5), but
# the QKV stage before it grows by 0.3 us and the gate/up stage after it by 0.5 (the norm
# folded into it adds the o parts). It must serve every decode step of up to 16 rows or none
# (batch invariance), so it stays off until it wins at all of them.
FUSE_ATTN_O = False

# Steps of up to GEMV_MAX_ROWS rows of a small model with o, the post-attention norm, gate/up,
# SiLU and down as one kernel (CudaRunner._mlp_block). Off: on the H200 the SmolLM2 decode
# graphs at 96 keys (alternated in one process) took 0.382 -> 0.445 ms at B=1, 0.465 -> 0.466 at
# B=2, 0.629 -> 0.626 at B=16. Its stage is no shorter than the three it replaces (o 2.4 +
# gate/up 2.3 + down 1.9 us): after its wait, each dependent phase costs 0.4-1.4 us (block 0's
# global timer: the attention rows from the L2 1.0, o 1.4 (m16 tensor-core tiles of one row,
# recomputed by every cluster), the norm 1.1, gate/up 1.0, down with a cluster barrier 1.0),
# and the attention and QKV stages around it grow by ~0.9 us each. It must serve every step of
# up to 16 rows or none (batch invariance), so it stays off until it wins at one row.
FUSE_MLP = False

# Ragged (prefill and mixed) steps run the last layer past its K/V write for the rows that sample
# only (CudaRunner._sampled_tail): a prompt token's last-layer output feeds nothing unless the
# token samples (or its prompt's logprobs are asked for). False: every token through the last
# layer, as before.
SAMPLED_TAIL = True

# A ragged step's graph holds every layer's attention but the last's (CudaRunner._capture_ragged)
# where the prompts' attention is flash_prefill_wgmma.cu at every length (Hopper, head dim 128):
# the decode rows' attention over the graph's most rows (those past the step's take no keys) and
# the prompts' over its most tiles (the kernel reads the step's count). Else, or False, the graph
# is cut before each layer's attention, which is launched between the pieces: H200, 8B fp8
# serving, the pieces' ends and the eager launches left the device idle ~5-6 us a layer (the
# fifty-fourth session's kernel trace).
ATTENTION_IN_GRAPH = True

# A GGUF checkpoint's LM head stored as Q8_0 (the tied embedding, or `output`) is also kept on the
# device as it is (a Q8Matrix: int8 codes and a float16 scale a block of 32, 1.06 bytes a value),
# and products of up to GEMV_MAX_ROWS rows read that (gemv.cu's W_Q8): each code times its scale
# becomes the value the loader makes, and only the order of the float32 sums differs from the
# 16-bit form's (the same order at every such step: batch invariance). Steps of more rows and the
# embedding read the 16-bit form. Only for a hidden size of Q8_LM_HEAD_MIN_HIDDEN or more, where
# the product is bound by its bytes. H200, random weights, decode graphs at 512 keys, 1 / 2 / 4
# rows: Llama-3-8B's shape (hidden 4,096; its LM head alone at one row 250 -> 161 us) 4.045 /
# 4.054 / 4.210 -> 3.955 / 3.966 / 4.122 ms (-2.1 to -2.2 %); Llama-3.2-1B's (hidden 2,048; 126 ->
# 82 us) 0.942 / 0.953 / 0.951 -> 0.897 / 0.911 / 0.908 ms (-4.4 to -4.8 %). SmolLM2 (hidden 576: its
# blocks' latency, not their bytes, sets the time), the real GGUF in bench/decode.py, 16-bit ->
# Q8_0, tok/s: 1 row 2,617.8-2,620.1 -> 2,629.6-2,629.9, 2 rows 4,545.6-4,561.0 -> 4,513.3-4,532.0,
# 4 rows 8,878.1-8,942.5 -> 8,771.1-8,802.1: no gain, so it keeps the 16-bit form. False: the
# 16-bit form everywhere.
Q8_LM_HEAD = True
Q8_LM_HEAD_MIN_HIDDEN = 2048

# --quantize-lm-head: each row's this many largest logits of the e4m3 head are recomputed from its
# 16-bit form (kernels_cuda/rescore.py), which stays on the device (an untied head: 2 bytes a value
# beside the e4m3 copy's 1). Greedy decoding then picks the 16-bit head's token wherever that token
# is among the e4m3 head's largest (SmolLM2 on the H200: at 226 positions of 226, against 94 %
# unrescored), and top-k / top-p see exact values where the probability mass is. H200, the 8B head
# at 1 / 256 rows: 16-bit 252 / 415 us, e4m3 143 / 235, rescored 174 / 313 (docs/performance.md,
# fifty-eighth session). 0: none, and an untied head's 16-bit form is freed.
LM_HEAD_RESCORE = 8

# Steps of up to GEMV_MAX_ROWS rows: the LM head also leaves, for each row, each tile's largest
# logit with its token as one key (gemv.gemv_keys), and the sampling kernel takes a greedy row's
# token as the max of those keys (e.g. 3,072 for SmolLM2) instead of reading its logits (49,152
# floats by one block: ~4.4 us of its B=1 decode graph, by leaving the kernel out). The same token
# either way. False: greedy rows read their logits.
GREEDY_KEYS = True

# bfloat16 models carry the residual stream in bfloat16 (not float32) in steps of more than
# GEMV_MAX_ROWS rows, as the model itself (and vLLM, and HF transformers) add it: add + RMSNorm
# then reads and writes 7 bytes a value instead of 11 (residual, delta, residual, e4m3 codes).
# Steps of fewer rows (the skinny GEMM's, whose fused norms fold the stream into their
# products) keep float32. False: float32 everywhere, as before.
RESIDUAL_16 = True

# --quantization fp8, steps in buckets of at least EPILOGUE_SCALES_MIN_BUCKET rows (gemm.rows_bucket:
# one form per bucket, so the warm-up plans each): the fp8 products named here have cuBLASLt
# apply their scales in its epilogue (gemm.gemm_fp8_scaled), so their readers (RoPE, the
# post-attention add + RMSNorm, SiLU * up) read no per-feature scales (6,144, 4,096 and 28,672
# floats a row for the 8B shape). These products run as fast scaled; down does not (H200, 2,040
# rows: 166.6 -> 173.4 us), so it keeps raw sums. Serving (8B fp8 + fp8 K/V, H200, loads
# alternated): gate/up alone +1.6 % over raw sums, QKV and o as well +0.7 % more
# (docs/performance.md, thirty-second session).
EPILOGUE_SCALES = ("qkv", "o", "gate_up")
EPILOGUE_SCALES_MIN_BUCKET = 1024
# ... and in those steps of a bfloat16 model (its 16-bit residual stream, RESIDUAL_16), the products
# named here add to the stream in cuBLASLt's epilogue (beta 1: gemm_fp8_scaled's add), so the norm
# after each reads the stream alone (rmsnorm.rms_norm: add_rms_norm_rows without a delta), 3 bytes a
# value instead of 7, and no delta is written and read back. Not with a bias. H200, 8B shape, a
# product and its norm in graphs, us: 2,040 rows o 72.6 -> 67.0, down 192.2 -> 187.6; 1,024 rows
# 34.0 -> 30.6 and 91.7 -> 88.1. In a whole mixed step (2,040 rows, eager, every kernel timed) the
# norms gained 5 us each, o lost 1 us and down, scaled, 6 us, so down keeps its raw sums and its
# add + RMSNorm (docs/performance.md, forty-seventh session).
ADD_IN_EPILOGUE = ("o",)

# --quantization fp8 with fast accumulation: whether the decode buckets' products also time
# gemm_fp8.cu (wgmma, Hopper) against cuBLASLt at start and run it where it is faster
# (gemm.tune_gemm_fp8_wgmma; docs/performance.md, twenty-ninth session)
FP8_WGMMA = True

# The roofline gauge (last_roofline_fraction, /metrics) times one decode step in this many: a
# step's pair of timing events costs ~3 us of device time (H200, SmolLM2 at one row, a 400 us
# step: 406.7 -> 409.9 us with them).
ROOFLINE_EVERY = 8

# Steps of up to 16 rows take a row of at most this many keys in one split (see decode_split_plan).
WHOLE_KEYS = 256
# Steps of up to 16 rows of a model with 16-bit K/V and heads of at most TILE_GROUPS_MAX_DIM dims run
# their decode attention in tile groups (flash_decode's grouped: four groups of 4 warps a block, each
# over its own 64-key tiles of the split, side by side rather than one after another), and take a
# row of at most GROUPED_WHOLE_KEYS keys in one split. One form for every step of up to 16 rows, so
# that a row's bits do not depend on the step's rows.
TILE_GROUPS = True
TILE_GROUPS_MAX_DIM = 64
GROUPED_WHOLE_KEYS = 512
# ... and a longer row in splits of FLASH_KEYS keys while they number at most this many and the
# step's blocks fit the SMs once (decode_split_plan).
SHORT_SPLITS = 12
# flash-decode blocks an SM holds at once (its registers and shared memory)
DECODE_BLOCKS_PER_SM = FLASH_BLOCKS_PER_SM
# ... and the blocks an SM that the split plan of a step of more than 16 rows fills where q K^T runs on
# wgmma (flash_decode.qk_wgmma): its blocks, three tiles deep where they take a row in one or two splits
# (flash_decode.buffers), keep the memory busy at two an SM, and fewer splits write fewer partials.
# H200, 8B shape, fp8 K/V, rows of 576-640 keys, us a launch: 32 rows 3 splits 19.7 -> 2 splits 15.7
# (one: 15.0); 64 rows 2 splits 31.0 -> 1 split 21.4 (2,000 keys: 80.8 -> 67.2).
WGMMA_DECODE_BLOCKS_PER_SM = 2


class SplitPlan(NamedTuple):
    """The flash-decode grid of a step's bucket (flash_decode's chunk, S, whole and short)."""

    chunk: int  # shortest split, keys
    splits: int  # splits a row at most (the grid's S)
    whole: int  # a row of at most this many keys takes one split
    short: int  # a longer row of at most this many keys takes splits of FLASH_KEYS (0: none)
    grouped: bool = False  # blocks of tile groups (flash_decode's grouped)


def decode_split_plan(rows: int, kv_heads: int, max_model_len: int, sms: int,
                      per_sm: int = DECODE_BLOCKS_PER_SM, grouped: bool = False) -> SplitPlan:
    """The flash-decode grid for a step of `rows` rows on `sms` SMs. Shortest split: 128 keys
    up to 16 rows, so that a short context still spreads over several blocks (B=1, 8 KV
    heads, 512 keys: 32 blocks rather than 16 of 256), 256 from 32 rows on. Splits: as many
    as fill the GPU's resident blocks (DECODE_BLOCKS_PER_SM; past 16 rows per_sm an SM, which
    the runner lowers for q K^T on wgmma: WGMMA_DECODE_BLOCKS_PER_SM) once with rows x KV heads
    x splits, so a step of many rows, whose blocks already fill it, takes each row in one or
    two long splits (fewer blocks, fewer partials to combine: H200, Llama-3-8B shape, 128
    rows of 576 keys, one split against three of 256: 88.5 vs 97.7 us a layer, fp8 K/V 71.6
    vs 84.9); no more than the longest context
    needs, at most MAX_SPLITS (the kernel lengthens the splits of longer contexts). (H200
    decode graphs at B=1: 64-key splits were no better at 512 tokens and worse at 2,048.)
    Up to 16 rows, a row of at most WHOLE_KEYS keys still takes one split: its few serial
    tiles cost less than writing partials and combining them (H200 decode graphs, SmolLM2
    at 160 keys: B=1 0.558 -> 0.500 ms a step, B=8 0.606 -> 0.556; Llama-3-8B at 256 keys:
    B=1 4.748 -> 4.706. SmolLM2 at 257 keys gained from one split of up to 384 too, 0.565
    -> 0.535, but one of 512 keys lost, 0.556 -> 0.598, and 384 was not measured on 8B).
    Past WHOLE_KEYS, a row of up to SHORT_SPLITS x FLASH_KEYS keys takes splits of FLASH_KEYS
    where the step's rows x KV heads x that many splits fit the SMs once (8B: B=1, 768 keys;
    SmolLM2: up to 8 rows): more blocks for a short row (H200 decode graphs against 128-key
    splits, one process: 8B B=1 at 575 keys 4.178 -> 4.124 ms, fp8 K/V 4.166 -> 4.130;
    SmolLM2 at 511 keys B=1 / 2 / 4 0.462 / 0.537 / 0.566 -> 0.454 / 0.530 / 0.550; 16 splits
    were worse for SmolLM2 at 1,000 keys, 0.487 -> 0.490, hence 12).
    grouped (up to 16 rows; the runner's TILE_GROUPS): blocks of tile groups, and GROUPED_WHOLE_KEYS
    in place of WHOLE_KEYS.
    """
    shortest = 128 if rows <= 16 else 256
    fill = -(-(DECODE_BLOCKS_PER_SM if rows <= 16 else per_sm) * sms // (rows * kv_heads))
    splits = max(1, min(FLASH_MAX_SPLITS, -(-max_model_len // shortest), fill))
    if rows > 16:
        return SplitPlan(shortest, splits, 0, 0)
    whole = GROUPED_WHOLE_KEYS if grouped else WHOLE_KEYS
    n = min(SHORT_SPLITS, sms // (rows * kv_heads), -(-max_model_len // FLASH_KEYS))
    if n * FLASH_KEYS <= whole:
        return SplitPlan(shortest, splits, whole, 0, grouped)
    return SplitPlan(shortest, max(splits, n), whole, n * FLASH_KEYS, grouped)


def bucket_for(n: int) -> int:
    """The smallest graph bucket that holds n rows."""
    for b in BUCKETS:
        if b >= n:
            return b
    raise ValueError(f"{n} rows exceed the largest batch bucket ({BUCKETS[-1]})")


def measure_copy_bandwidth(stream: cp.cuda.Stream, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Device-to-device copy rate, bytes read + written per second: the memory bandwidth
    the roofline divides a step's bytes by (as the issue's 4.26 TB/s on an H200)."""
    with stream:
        src = cp.empty(nbytes, np.uint8)
        dst = cp.empty_like(src)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        dst[...] = src  # warm-up
        times = []
        for _ in range(repeats):
            start.record(stream)
            dst[...] = src
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e-3)
        del src, dst
    return 2 * nbytes / sorted(times)[len(times) // 2]


# ---------------------------------------------------------------------------- buffers


class StagedInputs:
    """A step's inputs packed in pinned host memory and one device buffer, so that they go up
    in a single copy. The host side has two copies used in turn: `writable` hands out the one
    the step before last uploaded from, so a step launched ahead fills its inputs while the
    previous step's copy (queued behind the step before it) may not have run yet. The host
    sides are mapped: a decode graph's first kernel reads its side itself (`stage_in`, `read`),
    and its embedding reads the token ids there too (`mapped`). fields: name -> (dtype, shape)."""

    def __init__(self, fields: dict[str, tuple[np.dtype, tuple[int, ...]]]) -> None:
        offsets, total = {}, 0
        for name, (dtype, shape) in fields.items():
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            offsets[name] = (total, nbytes)
            total += -(-nbytes // 256) * 256
        self.nbytes = total
        self.device_bytes = cp.zeros(total, np.uint8)
        self._pinned, self._hosts = [], []
        for _ in range(2):
            pinned = cp.cuda.PinnedMemoryPointer(cp.cuda.PinnedMemory(total, cp.cuda.runtime.hostAllocMapped), 0)
            host_bytes = np.frombuffer(pinned, np.uint8, total)
            host_bytes[:] = 0  # padding rows and fields no step has filled yet read as zeros
            self._pinned.append(pinned)
            self._hosts.append({name: host_bytes[off:off + n].view(dtype).reshape(shape)
                                for name, (dtype, shape) in fields.items() for off, n in [offsets[name]]})
        self._uploaded = [cp.cuda.Event(disable_timing=True) for _ in range(2)]
        self._side = 0
        self.dev: dict[str, cp.ndarray] = {
            name: self.device_bytes[off:off + n].view(dtype).reshape(shape)
            for name, (dtype, shape) in fields.items() for off, n in [offsets[name]]}
        self._ends = {name: off + n for name, (off, n) in offsets.items()}
        device = cp.cuda.Device().id
        # each host side's fields as the device reads them in place (mapped: the host address)
        self.mapped: list[dict[str, cp.ndarray]] = [
            {name: cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(
                cp.cuda.UnownedMemory(pinned.ptr + offsets[name][0], offsets[name][1], pinned, device), 0))
             for name, (dtype, shape) in fields.items()} for pinned in self._pinned]

    @property
    def host(self) -> dict[str, np.ndarray]:
        """The host fields of the current side (what the next upload copies)."""
        return self._hosts[self._side]

    @property
    def side(self) -> int:
        """The current host side (0 or 1)."""
        return self._side

    def stage_in(self, side: int, upto: str) -> None:
        """On the current stream: the device buffer's prefix ending with field `upto` read from
        host side `side` by a kernel (a graph captures it with a fixed side)."""
        stage_in(self._pinned[side].ptr, self.device_bytes, -(-self._ends[upto] // 16) * 16)  # fields pad to 256

    def read(self, stream: cp.cuda.Stream) -> None:
        """Mark the current side as read once the stream gets here (after a graph that staged it
        in): `writable` hands it out again only then."""
        self._uploaded[self._side].record(stream)

    def upload(self, stream: cp.cuda.Stream, upto: str | None = None) -> None:
        """Copy the current host side (or its prefix ending with field `upto`) to the device."""
        n = self.nbytes if upto is None else self._ends[upto]
        cp.cuda.runtime.memcpyAsync(self.device_bytes.data.ptr, self._pinned[self._side].ptr, n,
                                    cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        self._uploaded[self._side].record(stream)

    def writable(self) -> dict[str, np.ndarray]:
        """Move to the other host side and return its fields once its last upload has read
        them (that of the step before last: queued, at the latest, ahead of the last step)."""
        self._side ^= 1
        self._uploaded[self._side].synchronize()
        return self.host


RAGGED_TOKENS = {"tok_ids": np.int32, "tok_pos": np.int32, "tok_src": np.int32, "tok_k": np.int64, "tok_v": np.int64}
RAGGED_SEQS = {"q_start": np.int32, "q_len": np.int32, "kv_len": np.int32, "seq_k": np.int64, "seq_v": np.int64,
               "last_tok": np.int64, "last_len": np.int32, "last_k": np.int64, "last_v": np.int64,
               "dec_len": np.int32}
RAGGED_TILES = {"tile_seq": np.int32, "tile_q0": np.int32}


def ragged_fields(tokens: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The inputs of a ragged step of up to `tokens` tokens (so as many sequences at most):
    per token its id, position, where its id is in `sampled` (_token_sources) and its K/V
    slot pointers; per sequence where its queries start, how many, its keys and its K/V
    pointers; per sequence that samples its last token's row, its keys and K/V pointers
    (CudaRunner._sampled_tail); the keys of the leading decode rows and zeros past them
    (dec_len: a graph's decode attention, ATTENTION_IN_GRAPH); the prompts' tiles for
    flash_prefill (one per 64 queries: at most tokens / 64 + one a sequence) and their count
    (n_tiles: a graph's prompt attention)."""
    tiles_max = tokens + tokens // PREFILL_TILE + 1
    return {**{name: (dt, (tokens,)) for name, dt in {**RAGGED_TOKENS, **RAGGED_SEQS}.items()},
            **{name: (dt, (tiles_max,)) for name, dt in RAGGED_TILES.items()}, "n_tiles": (np.int32, (1,))}


class HostOutputs:
    """Pinned host memory for a step's sampled ids and logprobs, in two sets used in turn: a
    step launched ahead writes its outputs while the host still reads the previous step's.
    The sampling kernel writes the ids straight into `sampled` (mapped memory: row r of set s
    at s * rows + r, the step's `out_index`), so a step ends with no copy (H200, SmolLM2 at
    one row: the copy took 5.5 us of a 400 us step); the logprobs are copied from their
    device arrays (`device`: same shapes and types) when a step asks for them. Each set has
    its step's events: start and end of a decode graph, outputs ready."""

    def __init__(self, rows: int, logprobs: dict[str, cp.ndarray]) -> None:
        self.device = logprobs
        self._mapped = cp.cuda.PinnedMemory(2 * rows * 4, cp.cuda.runtime.hostAllocMapped)
        self.sampled = np.frombuffer(cp.cuda.PinnedMemoryPointer(self._mapped, 0), np.int32, 2 * rows)
        self.sampled[:] = -1
        self.out_index = [np.arange(s * rows, (s + 1) * rows, dtype=np.int32) for s in range(2)]
        self.sets = [{"sampled": self.sampled[s * rows:(s + 1) * rows],
                      **{name: cupyx.empty_pinned(a.shape, a.dtype) for name, a in logprobs.items()}}
                     for s in range(2)]
        self.events = [(cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event(disable_timing=True)) for _ in range(2)]
        self._next = 0

    def take(self) -> int:
        """The set for the next step."""
        slot, self._next = self._next, self._next ^ 1
        return slot


@dataclass
class DecodeBuffers:
    """Every buffer of a decode step, for `rows` rows (allocated once).

    Activations are views of the runner's activation buffers (shared with prefill,
    which never runs at the same time); the rest is owned here.
    """

    inputs: StagedInputs  # input_ids, positions, kv_lens, k/v ptrs, sampling params (R,)
    ragged: StagedInputs  # a ragged step's tokens, sequences and prefill tiles (ragged_fields)
    embed_out: cp.ndarray  # (A, hidden) f32 -- the residual stream, updated in place
    # the same bytes as 16-bit rows (A, hidden), the residual stream of steps over GEMV_MAX_ROWS
    # rows in bfloat16 models (CudaRunner._residual), or None
    res16: cp.ndarray | None
    norm_out: cp.ndarray  # (A, hidden) 16-bit
    # qkv_out, gate_up_out: the bytes of a product some kernel reads back, seen through
    # `products` as float32 rows and as 16-bit rows (CudaRunner._product)
    qkv_out: cp.ndarray  # (A, q + 2 kv)
    q_rot: cp.ndarray  # (A, heads, head_dim) 16-bit
    attn_out: cp.ndarray  # (A, heads, head_dim) 16-bit
    o_proj_out: cp.ndarray  # (A, hidden) f32; its bytes also seen as 16-bit rows (products["o"])
    gate_up_out: cp.ndarray  # (A, 2 inter)
    mlp_act: cp.ndarray  # (A, inter) 16-bit
    down_out: cp.ndarray  # (A, hidden) f32; its bytes also seen as 16-bit rows (products["down"])
    final_norm_out: cp.ndarray  # (R, hidden) 16-bit
    # a ragged step's rows that sample, gathered for its last layer (CudaRunner._sampled_tail):
    # their residual stream (R, hidden) f32, the same bytes as 16-bit rows (res_last16, as
    # res16), and their rotated q (R, heads, head_dim) 16-bit
    res_last: cp.ndarray
    res_last16: cp.ndarray | None
    q_last: cp.ndarray
    logits: cp.ndarray  # (R, vocab) f32
    # steps of up to GEMV_MAX_ROWS rows: the LM head's greedy keys, a tile's a row (gemv.gemv_keys)
    logit_keys: cp.ndarray  # (min(R, GEMV_MAX_ROWS), ceil(vocab / 8)) uint64
    sample_work: cp.ndarray  # (R, vocab) f32 processed logits of rows with penalties / bias
    part_o: cp.ndarray  # flat f32 flash-decode partial outputs, (rows, heads, splits, head_dim) per bucket
    part_ml: cp.ndarray  # flat f32 their max and sum, (rows, heads, splits, 2)
    attn_counters: cp.ndarray  # (R, kv_heads) int32 split blocks done per (row, KV head), 0 between steps
    sampled: cp.ndarray  # (R,) int32
    lp_value: cp.ndarray  # (R,) f32
    lp_rank: cp.ndarray  # (R,) int32
    lp_top_ids: cp.ndarray  # (R, MAX_LOGPROBS) int32
    lp_top_values: cp.ndarray  # (R, MAX_LOGPROBS) f32
    pen_counts: cp.ndarray  # (slots + 1, vocab) int32 tokens generated, per penalty slot
    pen_prompt_mask: cp.ndarray  # (slots + 1, ceil(vocab / 32)) uint32 prompt tokens, per slot
    # --quantization fp8, steps of more than GEMV_MAX_ROWS rows: a matrix product's input as
    # e4m3 codes (flat, up to (A, widest K)) and a scale per row
    act_q: cp.ndarray | None = None
    act_scale: cp.ndarray | None = None
    # steps whose products make their own normed rows (CudaRunner._fold_norms): the residual
    # stream's other buffer, (FOLD_NORM_MAX_ROWS, hidden) f32, as the products write the sum
    # to one while they read the other
    res_alt: cp.ndarray | None = None
    # steps whose attention block is one kernel (CudaRunner._attn_block): its o product, a part
    # per KV head, (kv_heads, GEMV_MAX_ROWS, hidden) f32
    o_parts: cp.ndarray | None = None
    # steps whose o .. down run as one kernel (CudaRunner._mlp_block): the down product in a part
    # per cluster, (mlp_block.parts, GEMV_MAX_ROWS, hidden) f32
    down_parts: cp.ndarray | None = None
    # an fp8 LM head's candidates (values, ids) while they are rescored (rescore.candidate_buffers)
    head_cand: tuple[cp.ndarray, cp.ndarray] | None = None
    products: dict[str, tuple[cp.ndarray, cp.ndarray]] = dataclasses.field(default_factory=dict)

    def memory_bytes(self) -> int:
        owned = [self.final_norm_out, self.res_last, self.q_last, self.logits, self.logit_keys, self.sample_work,
                 self.part_o, self.part_ml, self.sampled, self.lp_value, self.lp_rank, self.lp_top_ids,
                 self.lp_top_values, self.pen_counts, self.pen_prompt_mask]
        shared = [self.embed_out, self.norm_out, self.qkv_out, self.q_rot, self.attn_out, self.o_proj_out,
                  self.gate_up_out, self.mlp_act, self.down_out]
        shared += [a for a in (self.act_q, self.act_scale, self.res_alt, self.o_parts, self.down_parts)
                   if a is not None]
        owned += list(self.head_cand or ())
        return self.inputs.nbytes + self.ragged.nbytes + sum(a.nbytes for a in owned + shared)


# ---------------------------------------------------------------------------- runner


def _upload_matrix(dtype: str):
    def convert(m: np.ndarray) -> cp.ndarray:
        dev = cp.asarray(np.ascontiguousarray(m, dtype=np.float32))
        if dtype == "bfloat16":
            bits = dev.view(cp.uint32)
            return ((bits + cp.uint32(0x7FFF) + ((bits >> 16) & cp.uint32(1))) >> 16).astype(cp.uint16)
        return dev.astype(cp.float16)
    return convert


class CudaRunner:
    device = "cuda"

    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, *,
                 model_config: ModelConfig | None = None, weights: Weights | ModelWeights | None = None,
                 progress: bool = True, pdl: bool | None = None) -> None:
        """Load weights to the GPU, allocate every buffer, size the KV pool, capture graphs.

        Either `model` (a LoadedModel), or `model_config` with `weights` (checkpoint
        Weights, or ModelWeights already on the device, e.g. random for benchmarks).
        """
        cfg = model.config if model is not None else model_config
        weights = model.weights if model is not None else weights
        self.config = cfg
        self.engine_config = config
        self.enforce_eager = config.enforce_eager
        self.stream = cp.cuda.Stream(non_blocking=True)
        # a step with both decode rows and prompts runs the prompts' attention on a second
        # stream beside the decode rows' (_submit_varlen's attention; H200, 8B fp8 weights + K/V,
        # 252 decodes at 576 keys + 4 prompts of 448: the step 35.32 -> 34.87 ms; same bits)
        self.overlap_attention = True
        # ragged steps run their last layer past its attention for the rows that sample only
        # (_sampled_tail): SAMPLED_TAIL by default
        self.sampled_tail = SAMPLED_TAIL
        self._side_stream = cp.cuda.Stream(non_blocking=True)
        self._side_events = (cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True))
        # recorded by every step before the attention of its layer near_end_layer (the last
        # quarter of the layers on): wait_near_end (SchedulerConfig.late_ahead)
        self._near_end = cp.cuda.Event(disable_timing=True)
        self.near_end_layer = cfg.num_layers - max(1, cfg.num_layers // 4)
        # programmatic dependent launch in the decode graphs (Hopper+); _launch_pdl is whether
        # the kernels launched now use it: only while capturing (see _capture_graphs)
        self.pdl = pdl_supported() if pdl is None else pdl
        self._launch_pdl = False
        self.dtype_name = config.compute_dtype(cfg.dtype)
        self.scalar = np.uint16 if self.dtype_name == "bfloat16" else np.float16
        self.kv_fp8 = config.cache.kv_fp8  # K/V as float8 e4m3 bytes (uint8 arrays here)
        self.quant_fp8 = config.quantization == "fp8"  # layer matrices as Fp8Matrix
        self.fp8_fast_accum = config.fp8_accumulation == "fast"  # their cuBLASLt products' sums
        for wanted, flag in ((self.kv_fp8, f"--kv-cache-dtype {config.cache.kv_cache_dtype}"),
                             (self.quant_fp8, f"--quantization {config.quantization}")):
            if wanted and tuple(int(c) for c in cp.cuda.Device().compute_capability) < (8, 9):
                raise RuntimeError(f"{flag} needs compute capability 8.9 or newer (Ada, Hopper); this GPU is "
                                   f"{cp.cuda.Device().compute_capability}")
        if self.quant_fp8 and (cfg.hidden_size % 16 or cfg.q_size % 16 or cfg.intermediate_size % 16):
            raise ValueError(f"--quantization fp8 needs hidden, attention and intermediate sizes that are multiples "
                             f"of 16; this model has {cfg.hidden_size}, {cfg.q_size}, {cfg.intermediate_size}")
        if config.quantize_lm_head and cfg.vocab_size % 16:  # cuBLASLt's fp8 products: N % 16 == 0
            raise ValueError(f"--quantize-lm-head needs a vocabulary that is a multiple of 16; this model's is "
                             f"{cfg.vocab_size}")
        if self.kv_fp8 and cfg.head_dim % 32:
            raise ValueError(f"--kv-cache-dtype {config.cache.kv_cache_dtype} needs a head_dim that is a multiple "
                             f"of 32; this model's is {cfg.head_dim}")
        self.kv_dtype = np.dtype(np.uint8) if self.kv_fp8 else np.dtype(self.scalar)
        # the fused epilogues pair 8 gate/up rows and 8 (j, j + head_dim / 2) dims a block
        self._epilogue_shapes_fit = cfg.intermediate_size % 8 == 0 and cfg.head_dim % 16 == 0
        self._norms_fit = self._epilogue_shapes_fit and cfg.hidden_size % 4 == 0 and \
            cfg.hidden_size <= FOLD_NORM_MAX_HIDDEN
        # decode steps of up to GEMV_MAX_ROWS rows may run norm, QKV, RoPE, attention and o as one
        # kernel where the model is small enough (_attn_block): fuse_attention, FUSE_ATTENTION
        # by default (off: see there)
        self.attn_block_fits = self._norms_fit and not self.quant_fp8 and attn_block_module.device_supported() \
            and attn_block_module.supported(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                            self.kv_fp8)
        self.fuse_attention = FUSE_ATTENTION and self.attn_block_fits
        # ... or attention and o as one kernel (_attn_o)
        self.attn_o_fits = self._norms_fit and not self.quant_fp8 and attn_block_module.device_supported() \
            and attn_o_module.supported(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.kv_fp8)
        self.fuse_attn_o = FUSE_ATTN_O and self.attn_o_fits
        # ... and o, the post-attention norm, gate/up, SiLU and down as one kernel (_mlp_block)
        self.mlp_block_fits = self._norms_fit and not self.quant_fp8 and attn_block_module.device_supported() \
            and mlp_block_module.supported(cfg.hidden_size, cfg.q_size, cfg.intermediate_size)
        self.fuse_mlp = FUSE_MLP and self.mlp_block_fits
        sched = config.scheduler
        self.max_model_len = sched.model_len(cfg)
        self.rows = bucket_for(sched.max_num_seqs)  # decode rows, a bucket
        self.max_tokens = max(sched.max_step_tokens, self.rows)
        # flash-decode split plan per graph bucket
        self.splits: dict[int, SplitPlan] = {}
        wgmma = qk_wgmma(cfg.num_heads // cfg.num_kv_heads, self.kv_fp8, cfg.head_dim)
        per_sm = WGMMA_DECODE_BLOCKS_PER_SM if wgmma else DECODE_BLOCKS_PER_SM
        grouped = TILE_GROUPS and not self.kv_fp8 and cfg.head_dim <= TILE_GROUPS_MAX_DIM
        for bucket in BUCKETS:
            self.splits[bucket] = decode_split_plan(bucket, cfg.num_kv_heads, self.max_model_len, sm_count(), per_sm,
                                                    grouped)
            if bucket >= self.rows:
                break
        self.max_splits = max(plan.splits for plan in self.splits.values())

        # the LM head as stored in a GGUF file where that is Q8_0 (Q8_LM_HEAD; see _lm_head)
        self.lm_head_q8: Q8Matrix | None = None
        # an fp8 LM head's 16-bit form, whose rows rescore its largest logits (LM_HEAD_RESCORE)
        self.lm_head_exact: cp.ndarray | None = None
        with self.stream:
            given = isinstance(weights, ModelWeights)
            if given:
                self.weights = weights
            elif isinstance(weights, RandomWeights):  # benchmarks: draw them here, not on the host
                self.weights = self._random_weights(weights.seed)
            else:
                self.weights = pack_model(weights, cfg, np.float32, progress=progress,
                                          matrix=_upload_matrix(self.dtype_name))
                self._norms_and_biases_to_device()
                if Q8_LM_HEAD:
                    self.lm_head_q8 = self._stored_q8_lm_head(weights)
            if self.quant_fp8:
                self._quantize_layers(in_place=not given)
                if config.quantize_lm_head and not isinstance(self.weights.lm_head, Fp8Matrix):
                    if LM_HEAD_RESCORE:
                        self.lm_head_exact = self.weights.lm_head
                    self.weights = dataclasses.replace(self.weights, lm_head=quantize_matrix(self.weights.lm_head))
                cp.get_default_memory_pool().free_all_blocks()
            self._down_blocks: list[cp.ndarray] | None = None  # see _mlp_down
            if self.fuse_mlp:
                self._mlp_down(0)  # made here, not while a graph is captured
            cos, sin = rope_tables(cfg, self.max_model_len)
            self.rope_cos, self.rope_sin = cp.asarray(cos), cp.asarray(sin)
            self.buffers = self._allocate_buffers()
            self.stream.synchronize()
        self._size_kv_pool()
        self._pen_slots: dict[int, int] = {}
        self._free_pen_slots = list(range(self.rows))  # slot `rows` is the padding rows' spare
        # each sequence's fixed sampling values, staged once (_param_rows): a step gathers its
        # rows' from here instead of reading every row's SamplingParams again
        self._param_slots: dict[int, int] = {}
        self._param_table = {name: np.zeros(2 * self.rows, dtype) for name, dtype in PARAM_FIELDS.items()}
        self._param_owner: list[object] = [None] * (2 * self.rows)  # the SamplingParams each entry holds
        self._free_param_slots = list(range(2 * self.rows))
        b = self.buffers
        self._outputs = HostOutputs(self.rows, {"lp_value": b.lp_value, "lp_rank": b.lp_rank,
                                                "lp_top_ids": b.lp_top_ids, "lp_top_values": b.lp_top_values})
        # the last step submitted: where each sampling sequence's token is in `sampled` (the
        # rows of a step launched ahead with pending_tokens take theirs from there)
        self._sampled_at: dict[int, int] = {}
        self.graphs: dict[int, tuple[cp.cuda.Graph, cp.cuda.Graph]] = {}  # bucket -> one a host side
        # token count -> the graphs of a ragged step's layers between its attentions (_capture_ragged)
        # with the layer offset of the attention launched after each (None: the last piece)
        self.ragged_graphs: dict[int, list[tuple[cp.cuda.Graph, int | None]]] = {}
        self.ragged_attention_in_graph = False  # whether they hold the attention (_capture_ragged)
        if self.quant_fp8:
            self._tune_products()
        if not self.enforce_eager:
            self._capture_graphs()
        self._warm_up()
        if not self.enforce_eager:
            self._capture_ragged()
        record_event(self._near_end, self.stream)  # passed: a first wait_near_end returns at once
        self.copy_bandwidth = measure_copy_bandwidth(self.stream)  # bytes/s, read + written
        self.weight_bytes = self._weight_bytes()
        self.last_roofline_fraction: float | None = None  # of the last decode step timed, for /metrics
        self._decode_steps = 0  # submitted: every ROOFLINE_EVERY-th is timed
        log.info("CUDA runner: %s weights%s, decode buffers %.1f MiB, KV pool %d slots (%.2f GiB, %s), graphs for %s",
                 self.dtype_name, (f" (layers{' and LM head' * config.quantize_lm_head} fp8 e4m3"
                                   + (f", its {LM_HEAD_RESCORE} largest logits a row rescored in 16 bits"
                                      if self.lm_head_exact is not None else "") + ")"
                                   if self.quant_fp8 else "")
                 + (f" (LM head also Q8_0 for steps of <= {GEMV_MAX_ROWS} rows)" if self.lm_head_q8 else ""),
                 self.buffers.memory_bytes() / 2**20,
                 self.num_kv_slots, self.kv_pool_bytes / 2**30, "fp8 e4m3" if self.kv_fp8 else self.dtype_name,
                 sorted(self.graphs) or "none (eager)")
        if self.ragged_graphs:
            log.info("CUDA runner: ragged steps of up to %d tokens replay graphs (%d token counts, %d graphs)",
                     max(self.ragged_graphs), len(self.ragged_graphs), sum(map(len, self.ragged_graphs.values())))

    # ------------------------------------------------------------------ setup

    def _random_weights(self, seed: int) -> ModelWeights:
        from .packing import LayerWeights
        cfg = self.config
        rs = cp.random.RandomState(seed)

        def mat(rows: int, cols: int) -> cp.ndarray:
            m = rs.standard_normal((rows, cols), dtype=cp.float32)
            m *= WEIGHT_STD
            return m.astype(self.scalar) if self.scalar == np.float16 else _upload_matrix("bfloat16")(cp.asnumpy(m))

        def ones(n: int) -> cp.ndarray:
            return cp.ones(n, np.float32)

        h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        layers = [LayerWeights(
            input_layernorm=ones(h), qkv_proj=mat(q + 2 * kv, h),
            qkv_bias=(rs.standard_normal(q + 2 * kv, dtype=cp.float32) * WEIGHT_STD) if cfg.qkv_bias else None,
            o_proj=mat(h, q), o_bias=None, post_attention_layernorm=ones(h),
            gate_up_proj=mat(2 * inter, h), down_proj=mat(h, inter)) for _ in range(cfg.num_layers)]
        embed = mat(cfg.vocab_size, h)
        lm_head = embed if cfg.tie_word_embeddings else mat(cfg.vocab_size, h)
        return ModelWeights(embed, layers, ones(h), lm_head)

    def _norms_and_biases_to_device(self) -> None:
        w = self.weights
        w.norm = cp.asarray(w.norm, dtype=np.float32)
        for layer in w.layers:
            layer.input_layernorm = cp.asarray(layer.input_layernorm, dtype=np.float32)
            layer.post_attention_layernorm = cp.asarray(layer.post_attention_layernorm, dtype=np.float32)
            if layer.qkv_bias is not None:
                layer.qkv_bias = cp.asarray(layer.qkv_bias, dtype=np.float32)
            if layer.o_bias is not None:
                layer.o_bias = cp.asarray(layer.o_bias, dtype=np.float32)

    def _quantize_layers(self, in_place: bool) -> None:
        """--quantization fp8: each layer's four matrices -> e4m3 with a scale per output
        feature (the embedding and LM head stay 16-bit, as in vLLM, unless quantize_lm_head),
        one layer at a time.
        in_place (weights this runner loaded): each layer's 16-bit matrices are dropped as
        soon as it is done, so the peak is the 16-bit model plus one layer; otherwise new
        layer objects, and weights a caller passed in stay as they were."""
        w = self.weights
        layers = w.layers if in_place else list(w.layers)
        for i, layer in enumerate(layers):
            mats = {name: getattr(layer, name) for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
            layers[i] = dataclasses.replace(layer, **{name: quantize_matrix(m) for name, m in mats.items()
                                                      if not isinstance(m, Fp8Matrix)})
            del layer, mats
        if not in_place:
            self.weights = dataclasses.replace(w, layers=layers)

    def _allocate_buffers(self) -> DecodeBuffers:
        cfg, R, A = self.config, self.rows, self.max_tokens
        H, D, V = cfg.num_heads, cfg.head_dim, cfg.vocab_size
        s = self.scalar
        parts = max(min(bucket, R) * H * plan.splits for bucket, plan in self.splits.items())
        fields = {
            "input_ids": (np.int32, ()), "positions": (np.int32, ()), "kv_lens": (np.int32, ()),
            "k_ptrs": (np.int64, ()), "v_ptrs": (np.int64, ()),
            "temperature": (np.float32, ()), "top_k": (np.int32, ()), "top_p": (np.float32, ()),
            "min_p": (np.float32, ()), "seeds": (np.uint64, ()), "counters": (np.int32, ()),
            "rep_pen": (np.float32, ()), "freq_pen": (np.float32, ()), "pres_pen": (np.float32, ()),
            "pen_slot": (np.int32, ()), "lp_n": (np.int32, ()), "bias_n": (np.int32, ()),
            # where a row's input token is in `sampled` (-1: input_ids), where its token goes in
            # the host's outputs (HostOutputs)
            "token_src": (np.int32, ()), "out_index": (np.int32, ()),
            "banned_n": (np.int32, ()),
            # large, copied only when a row uses them
            "bias_ids": (np.int32, (MAX_LOGIT_BIAS,)), "bias_vals": (np.float32, (MAX_LOGIT_BIAS,)),
            "banned_ids": (np.int32, (MAX_BANNED,)),
        }
        widest = max(cfg.hidden_size, cfg.q_size, cfg.intermediate_size)

        def product(width: int) -> cp.ndarray:  # float32 rows of the skinny GEMM, or 16-bit rows
            return cp.zeros(max(A * width * self.prod_dtype.itemsize, min(A, GEMV_MAX_ROWS) * width * 4), np.uint8)

        def views(raw: cp.ndarray, width: int, wide=self.prod_dtype) -> tuple[cp.ndarray, cp.ndarray]:
            return tuple(raw[:raw.size // (dt.itemsize * width) * dt.itemsize * width].view(dt).reshape(-1, width)
                         for dt in (np.dtype(np.float32), wide))
        qkv_width, gate_up_width = cfg.q_size + 2 * cfg.kv_size, 2 * cfg.intermediate_size
        qkv_out, gate_up_out = product(qkv_width), product(gate_up_width)
        # the residual stream's deltas (o, down): 16-bit rows only in bfloat16 (float8 sums,
        # bfloat16 weights); float16's range may be too small for a delta, so there they stay
        # float32 at every row count (H200, 8B fp8 + fp8 K/V, 2,044 rows: add_rms_norm 34.8 ->
        # 28.8 us alone; a mixed step's 64 of them 2.50 -> 1.95 ms)
        delta_wide = self.prod_dtype if self.prod_dtype == np.uint16 else np.dtype(np.float32)
        o_out, down_out = (views(cp.zeros(A * cfg.hidden_size * 4, np.uint8), cfg.hidden_size, delta_wide)
                           for _ in range(2))
        embed_out = cp.zeros((A, cfg.hidden_size), np.float32)
        res_last = cp.zeros((R, cfg.hidden_size), np.float32)

        def as_16(f32: cp.ndarray) -> cp.ndarray | None:  # the first half of f32's bytes as 16-bit rows
            return f32.view(s).reshape(-1)[:f32.size].reshape(f32.shape) if self.residual_16 else None
        return DecodeBuffers(
            products={"qkv": views(qkv_out, qkv_width), "gate_up": views(gate_up_out, gate_up_width),
                      "o": o_out, "down": down_out},
            act_q=cp.zeros(A * widest, np.uint8) if self.quant_fp8 else None,
            act_scale=cp.zeros(A, np.float32) if self.quant_fp8 else None,
            res_alt=cp.zeros((GEMV_MAX_ROWS, cfg.hidden_size), np.float32) if self._norms_fit else None,
            o_parts=cp.zeros((cfg.num_kv_heads, GEMV_MAX_ROWS, cfg.hidden_size), np.float32)
            if self.attn_block_fits or self.attn_o_fits else None,
            down_parts=cp.zeros((mlp_block_module.parts(cfg.intermediate_size), GEMV_MAX_ROWS, cfg.hidden_size),
                                np.float32) if self.mlp_block_fits else None,
            inputs=StagedInputs({name: (dtype, (R, *inner)) for name, (dtype, inner) in fields.items()}),
            ragged=StagedInputs(ragged_fields(A)),
            embed_out=embed_out,
            res16=as_16(embed_out),
            norm_out=cp.zeros((A, cfg.hidden_size), s),
            qkv_out=qkv_out,
            q_rot=cp.zeros((A, H, D), s),
            attn_out=cp.zeros((A, H, D), s),
            o_proj_out=o_out[0],
            gate_up_out=gate_up_out,
            mlp_act=cp.zeros((A, cfg.intermediate_size), s),
            down_out=down_out[0],
            final_norm_out=cp.zeros((R, cfg.hidden_size), s),
            res_last=res_last,
            res_last16=as_16(res_last),
            q_last=cp.zeros((R, H, D), s),
            logits=cp.zeros((R, V), np.float32),
            logit_keys=cp.zeros((min(R, GEMV_MAX_ROWS), -(-V // 8)), np.uint64),
            sample_work=cp.zeros((R, V), np.float32),
            part_o=cp.zeros(parts * D, np.float32),
            part_ml=cp.zeros(parts * 2, np.float32),
            attn_counters=cp.zeros((R, cfg.num_kv_heads), np.int32),
            sampled=cp.zeros(R, np.int32),
            lp_value=cp.zeros(R, np.float32),
            lp_rank=cp.zeros(R, np.int32),
            lp_top_ids=cp.zeros((R, MAX_LOGPROBS), np.int32),
            lp_top_values=cp.zeros((R, MAX_LOGPROBS), np.float32),
            head_cand=candidate_buffers(R, V, LM_HEAD_RESCORE) if self.lm_head_exact is not None else None,
            pen_counts=cp.zeros((R + 1, V), np.int32),
            pen_prompt_mask=cp.zeros((R + 1, (V + 31) // 32), np.uint32),
        )

    def _size_kv_pool(self) -> None:
        cfg, cache = self.config, self.engine_config.cache
        elem = self.kv_dtype.itemsize
        per_slot = cfg.kv_bytes_per_token(elem)
        if cache.kv_cache_bytes is not None:
            budget = cache.kv_cache_bytes
        else:
            cp.get_default_memory_pool().free_all_blocks()  # cached blocks are not "used"
            free, total = cp.cuda.runtime.memGetInfo()
            used = total - free
            budget = int(total * cache.gpu_memory_utilization) - used - GRAPH_RESERVE_BYTES
        slots = budget // per_slot
        if slots < self.max_model_len + 1:
            raise RuntimeError(
                f"not enough GPU memory for the KV cache: {max(budget, 0) / 2**30:.2f} GiB holds {max(slots, 0)} "
                f"tokens, one sequence of max_model_len={self.max_model_len} needs {self.max_model_len + 1}; "
                f"lower --max-model-len or raise --gpu-memory-utilization / --kv-cache-gib")
        self.num_kv_slots = int(slots) - 1  # the last slot is the padding rows' scratch
        shape = (cfg.num_layers, self.num_kv_slots + 1, cfg.num_kv_heads, cfg.head_dim)
        with self.stream:
            self.k_cache = cp.zeros(shape, self.kv_dtype)
            self.v_cache = cp.zeros(shape, self.kv_dtype)
            self.stream.synchronize()
        self.kv_pool_bytes = 2 * self.k_cache.nbytes
        self._slot_bytes = cfg.kv_size * elem  # bytes from one slot to the next within a layer
        self._layer_elems = (self.num_kv_slots + 1) * cfg.kv_size  # elements from one layer to the next
        self._near_end_offset = self.near_end_layer * self._layer_elems
        self._last_layer_offset = (cfg.num_layers - 1) * self._layer_elems  # where ragged graphs end a piece
        self._spare_k = self.k_cache.data.ptr + self.num_kv_slots * self._slot_bytes
        self._spare_v = self.v_cache.data.ptr + self.num_kv_slots * self._slot_bytes

    def memory_bytes(self) -> int:
        return self.buffers.memory_bytes()

    def _weight_bytes(self) -> int:
        w = self.weights
        mats = [w.embed_tokens] + ([] if w.lm_head is w.embed_tokens else [w.lm_head])
        for layer in w.layers:
            mats += [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
        return sum(m.nbytes for m in mats)

    def decode_step_bytes(self, kv_tokens: int, rows: int = 1) -> int:
        """Bytes a decode step of `rows` rows must read at least: every weight once (the LM head
        included, in the form such a step reads: see _lm_head; the embedding rows are negligible)
        and the K/V of `kv_tokens` cached tokens."""
        w = self.weights
        embed = 0 if w.lm_head is w.embed_tokens else w.embed_tokens.nbytes
        head = self._lm_head(rows)
        return (self.weight_bytes - embed - w.lm_head.nbytes + head.nbytes
                + kv_tokens * self.config.kv_bytes_per_token(self.kv_dtype.itemsize))

    def _stored_q8_lm_head(self, weights) -> Q8Matrix | None:
        """The checkpoint's LM head as a Q8Matrix on the device where its file stores it as
        Q8_0 and the model is wide enough (Q8_LM_HEAD, Q8_LM_HEAD_MIN_HIDDEN), else None."""
        cfg = self.config
        name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        if cfg.hidden_size < Q8_LM_HEAD_MIN_HIDDEN or cfg.hidden_size % 32:
            return None
        stored = weights.stored(name) if isinstance(weights, Weights) else None
        if stored is None or stored[0] != "Q8_0":
            return None
        codes, scales = q8_0_split(stored[1], (cfg.vocab_size, cfg.hidden_size))
        return Q8Matrix(cp.asarray(codes), cp.asarray(scales))

    def _lm_head(self, n: int):
        """The LM head that a product of n rows reads: the stored Q8_0 form up to GEMV_MAX_ROWS
        rows where kept (lm_head_q8), else the loaded one (16-bit, or an Fp8Matrix with
        quantize_lm_head). One form for every such step, so a sequence's logits do not depend on
        what else is in it (batch invariance)."""
        q8 = self.lm_head_q8
        return q8 if q8 is not None and n <= GEMV_MAX_ROWS else self.weights.lm_head

    def _logits(self, n: int, keys: bool = False) -> tuple[cp.ndarray, int] | None:
        """logits[:n] = the LM head (_lm_head's form for n rows) of final_norm_out[:n]. An fp8
        LM head past GEMV_MAX_ROWS rows is scaled in cuBLASLt's epilogue into float32: the
        sampling kernel reads finished logits (H200, 8B shape, graphs, us: 256 rows 451.6 ->
        234.9 with the rows' quantize, 128 rows 292.3 -> 156.4; its raw sums and a pass to scale
        them: 527.5 / 322.1). Its largest logits a row are then recomputed from the 16-bit form
        where that is kept (LM_HEAD_RESCORE). keys (GREEDY_KEYS; steps of up to GEMV_MAX_ROWS rows
        whose logits are not rescored): the head also leaves its tiles' greedy keys (gemv_keys),
        returned as _sample takes them; else None."""
        b = self.buffers
        x, head, logits = b.final_norm_out[:n], self._lm_head(n), b.logits[:n]
        rescored = isinstance(head, Fp8Matrix) and self.lm_head_exact is not None
        if keys and GREEDY_KEYS and n <= GEMV_MAX_ROWS and not rescored:
            return b.logit_keys[:n], gemv_keys(x, head, logits, b.logit_keys[:n], pdl=self._launch_pdl)
        if isinstance(head, Fp8Matrix) and n > GEMV_MAX_ROWS:
            xq, x_scale = self._quantized(x)
            if not gemm_fp8_scaled(xq, x_scale, head, logits, self.fp8_fast_accum):
                raise RuntimeError("cuBLASLt offers no float8 product scaled in its epilogue into float32 here, "
                                   "which an fp8 LM head needs: run without --quantize-lm-head")
        else:
            self._linear(x, head, logits)
        if rescored:
            rescore(logits, x, self.lm_head_exact, LM_HEAD_RESCORE, b.head_cand, pdl=self._launch_pdl)

    # ------------------------------------------------------------------ the model

    def _linear(self, x: cp.ndarray, w, out: cp.ndarray, pdl: bool | None = None,
                xq: tuple | None = None, name: str = "") -> tuple | None:
        """out = x @ w^T: the skinny GEMM up to GEMV_MAX_ROWS rows (16-bit or fp8 weights),
        else cuBLAS. fp8 weights there take x quantized per row (xq: (codes, scales) its
        producer wrote, see _quant_in; else quantized here) and leave out unscaled (cuBLASLt's
        fp8 product): returns the (per token, per feature) scales for the kernel that reads
        out (its `scales` argument), else None. The product `name` is scaled in cuBLASLt's
        epilogue instead where EPILOGUE_SCALES says so."""
        n = x.shape[0]
        if n <= GEMV_MAX_ROWS:
            gemv(x, w, out, pdl=self._launch_pdl if pdl is None else pdl)
        elif isinstance(w, Fp8Matrix):
            xq, x_scale = xq if xq is not None else self._quantized(x)
            if (name in EPILOGUE_SCALES and rows_bucket(n) >= EPILOGUE_SCALES_MIN_BUCKET
                    and gemm_fp8_scaled(xq, x_scale, w, out, self.fp8_fast_accum)):
                return None
            gemm_fp8(xq, w, out, self.fp8_fast_accum, pdl=self._launch_pdl if pdl is None else pdl)
            return x_scale, w.scale
        else:
            gemm(x, w, out)
        return None

    def _quantized(self, x: cp.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
        """x's rows as e4m3 codes and their scales (act_q, act_scale), for an fp8 product."""
        b = self.buffers
        return quantize_rows(x, b.act_q[:x.size].reshape(x.shape), b.act_scale[:x.shape[0]], pdl=self._launch_pdl)

    def _epilogue_adds(self, n: int, name: str) -> bool:
        """Whether the product `name` (o, down) of an n-row step adds to the residual stream in
        cuBLASLt's epilogue (ADD_IN_EPILOGUE): fp8 products scaled there (EPILOGUE_SCALES'
        buckets), a 16-bit stream (residual_16) of rows that the norms' row kernel takes."""
        return (name in ADD_IN_EPILOGUE and self.quant_fp8 and self.residual_16 and n > GEMV_MAX_ROWS
                and rows_bucket(n) >= EPILOGUE_SCALES_MIN_BUCKET and rows_kernel(n, self.config.hidden_size, 1, 1))

    def _residual_linear(self, x: cp.ndarray, w, res: cp.ndarray, out: cp.ndarray, name: str,
                         xq: tuple | None = None, pdl: bool | None = None,
                         bias: cp.ndarray | None = None) -> tuple[tuple | None, cp.ndarray | None]:
        """The product `name` (o, down) of x that the residual stream res takes next: added to res
        in cuBLASLt's epilogue where _epilogue_adds and no bias (returns (None, None): nothing
        left to add), else _linear's into out (returns its scales and out)."""
        if bias is None and self._epilogue_adds(x.shape[0], name):
            xq = xq if xq is not None else self._quantized(x)
            if gemm_fp8_scaled(*xq, w, res, self.fp8_fast_accum, add=True):
                return None, None
        return self._linear(x, w, out, pdl=pdl, xq=xq, name=name), out

    def _norm(self, res: cp.ndarray, delta: cp.ndarray | None, weight: cp.ndarray, out: cp.ndarray,
              scales: tuple | None = None, bias: cp.ndarray | None = None, quant: tuple | None = None) -> None:
        """res += delta (+ bias) and out = RMSNorm(res) (add_rms_norm); delta None (a product added
        in its epilogue, _residual_linear): the norm of res alone. quant: as add_rms_norm's, the
        codes only."""
        eps, pdl = self.config.rms_norm_eps, self._launch_pdl
        if delta is None:
            rms_norm(res, weight, eps, out=out, pdl=pdl, quant=quant, codes_only=quant is not None)
        else:
            add_rms_norm(res, delta, weight, eps, out=out, bias=bias, pdl=pdl, scales=scales, quant=quant,
                         codes_only=quant is not None)

    @property
    def prod_dtype(self) -> np.dtype:
        """The type cuBLAS / cuBLASLt write the products that RoPE and SiLU read back in
        steps of more than GEMV_MAX_ROWS rows: the model's 16-bit type, bfloat16 for the
        raw sums of a float8 product (float16's range is too small for them)."""
        return np.dtype(np.uint16) if self.quant_fp8 else np.dtype(self.scalar)

    def _product(self, name: str, n: int) -> cp.ndarray:
        """n rows of the product `name` ("qkv", "gate_up", "o", "down"): float32 from the
        skinny GEMM (up to GEMV_MAX_ROWS rows), else 16 bits (prod_dtype): half the bytes
        written and read back where the rows are many (o and down: see _allocate_buffers)."""
        f32, p16 = self.buffers.products[name]
        return (f32 if n <= GEMV_MAX_ROWS else p16)[:n]

    @property
    def residual_16(self) -> bool:
        """Whether steps of more than GEMV_MAX_ROWS rows carry the residual stream in 16 bits
        (RESIDUAL_16, bfloat16 models)."""
        return RESIDUAL_16 and self.scalar == np.uint16

    def _residual(self, n: int, sampled: bool = False) -> cp.ndarray:
        """The residual stream of an n-row step: embed_out, or its bytes as 16-bit rows (res16);
        sampled: of the n rows a ragged step's last layer takes on (res_last, res_last16)."""
        b = self.buffers
        f32, r16 = (b.res_last, b.res_last16) if sampled else (b.embed_out, b.res16)
        return r16[:n] if r16 is not None and n > GEMV_MAX_ROWS else f32[:n]

    def _quant_in(self, n: int, width: int) -> tuple | None:
        """Steps whose products run on float8 codes (--quantization fp8, more than
        GEMV_MAX_ROWS rows): the (codes, scales) buffers that RMSNorm and SiLU * up fill
        instead of their 16-bit output (their `quant`, `codes_only`), so the product after
        them needs no quantize_rows of its own; else None."""
        if not self.quant_fp8 or n <= GEMV_MAX_ROWS:
            return None
        b = self.buffers
        return b.act_q[:n * width].reshape(n, width), b.act_scale[:n]

    def _fused(self, n: int) -> bool:
        """Steps of up to GEMV_MAX_ROWS rows run the skinny GEMM with RoPE + K/V write in the
        QKV product's epilogue and SiLU * up in the gate/up product's (same bits, 3 fewer
        kernels a layer); larger steps run cuBLAS and the separate kernels."""
        return n <= GEMV_MAX_ROWS and self._epilogue_shapes_fit

    def _fold_norms(self, n: int) -> bool:
        """One-row steps of a model with hidden size <= FOLD_NORM_MAX_HIDDEN make each RMSNorm
        of the layers (with its residual add) in every block of the product after it (gemv.NormIn: the bits
        of add_rms_norm), not in a kernel of its own: 2 fewer kernels a layer, where a step is
        a chain of short kernels. H200, SmolLM2 decode graphs (96 keys): B=1 0.442 -> 0.415 ms;
        but B=2 0.458 -> 0.475 and B=8 0.513 -> 0.816 (a block norms its rows one after the
        other); with a wide hidden size every block would re-read too much."""
        return n <= FOLD_NORM_MAX_ROWS and self._fused(n) and self._norms_fit

    def _attn_block(self, n: int) -> bool:
        """Decode steps of up to GEMV_MAX_ROWS rows of a small model (attn_block.supported:
        the weight slices of a cluster's blocks fit in shared memory) run the input norm, QKV,
        RoPE + K/V write, attention and o as one kernel (kernels_cuda/attn_block.cu): 3
        kernels a layer instead of 5. Every such step does, whatever its rows, so decoding
        stays batch-invariant; the bits differ from the separate kernels' (other orders of
        sums), which prefill and mixed steps still run."""
        return self.fuse_attention and self.attn_block_fits and self._fused(n)

    def _attn_o(self, n: int) -> bool:
        """Decode steps of up to GEMV_MAX_ROWS rows of a small model (attn_o.supported) run the
        attention and the o product as one kernel (kernels_cuda/attn_o.cu), its o in a part per
        KV head that the post-attention norm adds. Every such decode step does, so rows stay
        batch-invariant; not with the attention block in one kernel (_attn_block)."""
        return self.fuse_attn_o and self.attn_o_fits and self._fused(n) and not self._attn_block(n)

    def _mlp_block(self, n: int) -> bool:
        """Steps of up to GEMV_MAX_ROWS rows of a small model (mlp_block.supported: its blocks'
        weight slices fit in shared memory) run o, the residual add and post-attention norm,
        gate/up, SiLU * up and down as one kernel (kernels_cuda/mlp_block.cu): 1 stage a layer
        instead of 3. Every such step does, decode and prefill, so rows stay batch-invariant;
        the bits differ from the separate kernels' (other orders of sums), which larger steps
        run. Not with the attention block in one kernel (_attn_block)."""
        return self.fuse_mlp and self._fused(n) and not self._attn_block(n) and not self._attn_o(n)

    def _mlp_down(self, i: int) -> cp.ndarray:
        """Layer i's down matrix as _mlp_block reads it (mlp_block.down_blocks: a block's
        columns together), a second copy that steps of more rows do not read: made for every
        layer at the first need, so a runner that never runs the kernel holds none."""
        if self._down_blocks is None:
            self._down_blocks = [mlp_block_module.down_blocks(layer.down_proj) for layer in self.weights.layers]
        return self._down_blocks[i]

    def _layers(self, n: int, rope: tuple, attention, kv_lens: cp.ndarray | None = None, front_of_last: bool = False
                ) -> tuple[tuple | None, cp.ndarray, cp.ndarray | None]:
        """The decoder layers over the first n rows of the activation buffers; the
        residual stream ends un-added (the last down projection is added by the caller,
        with the scales returned: see _linear). rope: (positions, k_ptrs, v_ptrs) of the n
        tokens; attention(layer_offset) reads q_rot and writes attn_out. kv_lens (n one-token
        rows' key counts, decode steps): where _attn_block, each layer's attention block runs as
        one kernel instead; where _attn_o, its attention and o do; `attention` is then not
        called. With float8 products
        the normed rows and SiLU * up go to them as codes only (_quant_in). Returns (those
        scales, the residual stream's buffer: embed_out, or res_alt where _fold_norms or
        _mlp_block left it there, and the last down product to add to it: down_out, or
        down_parts where _mlp_block, or None where its epilogue added it: _residual_linear).
        front_of_last: stop where the last layer's attention would run (its q rotated, its K/V
        written), returning (None, the residual stream, None): _sampled_tail takes it on from
        there for the rows that sample."""
        cfg, b, w = self.config, self.buffers, self.weights
        fused, fold = self._fused(n), self._fold_norms(n)
        positions, k_ptrs, v_ptrs = rope
        down_scales = None
        normed_q = self._quant_in(n, cfg.hidden_size)
        # the residual stream's buffers: [the one holding it, the other]; a folded norm with a
        # delta reads the first and writes the sum to the second, which then holds the stream
        block = kv_lens is not None and self._attn_block(n)
        attn_o = kv_lens is not None and self._attn_o(n)
        res = [self._residual(n), b.res_alt[:n] if fold or block or self._mlp_block(n) else None]
        last_down = None  # the last down product, not yet added to the residual stream

        for i, layer in enumerate(w.layers):
            if block:
                self._layer_block(n, i, layer, res, rope, kv_lens, fold)
                continue
            norm = None
            if fold:
                norm = self._folded(res, last_down, layer.input_layernorm)
            else:  # layer 0, and a down product added in its epilogue: no delta
                self._norm(res[0], last_down, layer.input_layernorm, b.norm_out[:n], down_scales, quant=normed_q)
            offset = i * self._layer_elems
            rope_in = (positions, self.rope_cos, self.rope_sin, k_ptrs, v_ptrs, offset, cfg.num_heads, cfg.num_kv_heads)
            if fused:
                gemv_rope(b.norm_out[:n], layer.qkv_proj, *rope_in, b.q_rot[:n], bias=layer.qkv_bias,
                          pdl=self._launch_pdl, kv_fp8=self.kv_fp8, norm=norm)
            else:
                qkv = self._product("qkv", n)
                scales = self._linear(b.norm_out[:n], layer.qkv_proj, qkv, xq=normed_q, name="qkv")
                rope_kv_write(qkv, *rope_in, cfg.head_dim, b.q_rot[:n], bias=layer.qkv_bias, pdl=self._launch_pdl,
                              kv_fp8=self.kv_fp8, scales=scales)
            if front_of_last and i == len(w.layers) - 1:
                return None, res[0], None
            o = None
            if attn_o:
                o = b.o_parts[:, :n], None
                attn_o_module.attn_o(b.q_rot[:n], layer.o_proj, k_ptrs, v_ptrs, kv_lens, offset, cfg.num_kv_heads,
                                     b.attn_out[:n], o[0], cfg.softmax_scale, cfg.sliding_window or 0,
                                     pdl=self._launch_pdl, kv_fp8=self.kv_fp8)
            else:
                attention(offset)
            down_scales, last_down = self._layer_back(n, i, res, o)
        return down_scales, res[0], b.down_out[:n] if block else last_down

    def _folded(self, res: list, delta: cp.ndarray | None, weight: cp.ndarray, bias: cp.ndarray | None = None
                ) -> NormIn:
        """The norm a product folds in (_fold_norms) over the residual stream's two buffers res:
        with a delta it reads res[0] and writes the sum to res[1], which then holds the stream
        (res is swapped)."""
        norm = NormIn(res[0], weight, self.config.rms_norm_eps, delta, bias, res[1] if delta is not None else None)
        if delta is not None:
            res.reverse()
        return norm

    def _layer_back(self, n: int, i: int, res: list, o: tuple | None = None) -> tuple[tuple | None, cp.ndarray]:
        """Layer i from its attention's output (attn_out) on, for n rows: o (or o given as
        (product, scales), where the attention made it), the residual add and post-attention
        norm, gate/up, SiLU * up and down (or _mlp_block's kernel for all of it). res: the
        residual stream's buffers, as _layers keeps them. Returns the down product's scales
        (see _linear) and the down product, not yet added to the stream (None, None where its
        epilogue added it: _residual_linear)."""
        cfg, b, layer = self.config, self.buffers, self.weights.layers[i]
        pdl = self._launch_pdl
        if o is None:
            attn = b.attn_out[:n].reshape(n, cfg.q_size)
            if self._mlp_block(n):
                down = b.down_parts[:, :n]
                mlp_block_module.mlp_block(res[0], attn, layer.o_proj, layer.o_bias, layer.post_attention_layernorm,
                                           cfg.rms_norm_eps, res[1], layer.gate_up_proj,
                                           self._mlp_down(i), down, pdl=pdl)
                res.reverse()
                return None, down
            scales, o_out = self._residual_linear(attn, layer.o_proj, res[0], self._product("o", n), "o",
                                                  pdl=pdl and attn.nbytes <= O_PROJ_PDL_MAX_INPUT, bias=layer.o_bias)
        else:
            o_out, scales = o
        norm, norm_q = None, self._quant_in(n, cfg.hidden_size)
        if self._fold_norms(n):
            norm = self._folded(res, o_out, layer.post_attention_layernorm, layer.o_bias)
        else:
            self._norm(res[0], o_out, layer.post_attention_layernorm, b.norm_out[:n], scales, layer.o_bias, norm_q)
        act_q = self._quant_in(n, cfg.intermediate_size)
        if self._fused(n):
            gemv_silu(b.norm_out[:n], layer.gate_up_proj, b.mlp_act[:n], pdl=pdl, norm=norm)
        else:
            gate_up = self._product("gate_up", n)
            scales = self._linear(b.norm_out[:n], layer.gate_up_proj, gate_up, xq=norm_q, name="gate_up")
            silu_mul(gate_up, out=b.mlp_act[:n], pdl=pdl, scales=scales, quant=act_q, codes_only=True)
        return self._residual_linear(b.mlp_act[:n], layer.down_proj, res[0], self._product("down", n), "down",
                                     xq=act_q)

    def _layer_block(self, n: int, i: int, layer, res: list, rope: tuple, kv_lens: cp.ndarray,
                     fold: bool) -> None:
        """Layer i of _layers with its attention block in one kernel (_attn_block): that
        kernel (norming res[0] + the last down product), the post-attention norm adding its
        o parts (folded into gate/up where fold), gate/up + SiLU, down. res: _layers'
        residual stream's two buffers (_folded swaps them)."""
        cfg, b = self.config, self.buffers
        pdl = self._launch_pdl
        parts = b.o_parts[:, :n]
        attn_block_module.attn_block(
            self._folded(res, None if i == 0 else b.down_out[:n], layer.input_layernorm), layer.qkv_proj,
            layer.qkv_bias, layer.o_proj, rope[0], self.rope_cos, self.rope_sin, rope[1], rope[2], kv_lens,
            i * self._layer_elems, cfg.num_heads, cfg.num_kv_heads, parts, cfg.softmax_scale, cfg.sliding_window or 0,
            pdl=pdl, kv_fp8=self.kv_fp8)
        norm = None
        if fold:
            norm = self._folded(res, parts, layer.post_attention_layernorm, layer.o_bias)
        else:
            self._norm(res[0], parts, layer.post_attention_layernorm, b.norm_out[:n], bias=layer.o_bias)
        gemv_silu(b.norm_out[:n], layer.gate_up_proj, b.mlp_act[:n], pdl=pdl, norm=norm)
        self._linear(b.mlp_act[:n], layer.down_proj, b.down_out[:n])

    def _decode_attention(self, n: int, q: cp.ndarray, k_ptrs: cp.ndarray, v_ptrs: cp.ndarray, kv_lens: cp.ndarray,
                          offset: int) -> None:
        """Split-KV attention of n one-token rows, with the split plan of their bucket."""
        cfg, b = self.config, self.buffers
        plan = self.splits[bucket_for(n)]
        H, D, S = cfg.num_heads, cfg.head_dim, plan.splits
        part_o = b.part_o[:n * H * S * D].reshape(n, H, S, D)
        part_ml = b.part_ml[:n * H * S * 2].reshape(n, H, S, 2)
        flash_decode(q, k_ptrs, v_ptrs, kv_lens, offset, cfg.num_kv_heads, part_o, part_ml, b.attn_counters[:n],
                     b.attn_out[:n], cfg.softmax_scale, plan.chunk, cfg.sliding_window or 0, pdl=self._launch_pdl,
                     kv_fp8=self.kv_fp8, whole=plan.whole, short=plan.short, grouped=plan.grouped)

    def _mark_near_end(self, offset: int) -> None:
        """Record _near_end on the stream before the attention of layer near_end_layer of a ragged
        step (in its graph, as one of the graph's nodes: record_event). Decode steps do not mark
        it, so after one wait_near_end returns at once (the mark is the last ragged step's). That
        is how decode steps had it before the ragged graphs held the attention: their graphs'
        plain record added no node."""
        if offset == self._near_end_offset:
            record_event(self._near_end, self.stream)

    def wait_near_end(self) -> None:
        """Wait until the last step submitted has reached the last quarter of its layers
        (Engine._late_ahead): launching the next step then still leaves the device busy."""
        self._near_end.synchronize()

    def _sample(self, n: int, keys: tuple[cp.ndarray, int] | None = None) -> None:
        """Tokens for the first n rows of logits; keys: the LM head's greedy keys of these logits
        (_logits' return), which greedy rows then read instead."""
        b, d = self.buffers, self.buffers.inputs.dev
        sample_tokens(b.logits, b.sample_work, d, b.pen_counts, b.pen_prompt_mask, b.sampled, rows=n,
                      pdl=self._launch_pdl, host_out=self._outputs.sampled,
                      logprobs=(b.lp_value, b.lp_rank, b.lp_top_ids, b.lp_top_values), keys=keys)

    def _decode_body(self, n: int, side: int | None = None) -> None:
        """One decode step for n rows (a bucket): no host work, no branches on data. side: its
        inputs read from that host side first (StagedInputs.stage_in; the decode graphs), else
        as uploaded before it."""
        b, w = self.buffers, self.weights
        d = b.inputs.dev
        ids = d  # where the embedding reads its ids: the device copy, or the host side stage_in reads
        if side is not None:
            b.inputs.stage_in(side, "banned_n")
            ids = b.inputs.mapped[side]  # stage_in lets the embedding start before the copy is done
        embedding(ids["input_ids"][:n], w.embed_tokens, self._residual(n), pdl=self._launch_pdl,
                  src=ids["token_src"][:n], sampled=b.sampled)

        def attention(offset: int) -> None:
            self._decode_attention(n, b.q_rot[:n], d["k_ptrs"][:n], d["v_ptrs"][:n], d["kv_lens"][:n], offset)

        down_scales, residual, delta = self._layers(n, (d["positions"][:n], d["k_ptrs"][:n], d["v_ptrs"][:n]),
                                                    attention, kv_lens=d["kv_lens"][:n])
        # the final norm is a kernel of its own even where _fold_norms: the LM head has the most
        # blocks, each of which would norm the row again (H200, SmolLM2 B=1 graph 0.404 -> 0.400 ms)
        self._norm(residual, delta, w.norm, b.final_norm_out[:n], down_scales)
        self._sample(n, self._logits(n, keys=True))

    def _tune_products(self) -> None:
        """--quantization fp8: each layer product's cuBLASLt algorithm for the decode buckets
        over GEMV_MAX_ROWS rows, timed over the layers' matrices (gemm.tune_gemm_fp8) instead of
        the heuristic's first guess, then against gemm_fp8.cu's candidates (FP8_WGMMA); its
        input holds random e4m3 codes while timed."""
        cfg, b, layers = self.config, self.buffers, self.weights.layers
        # each graph's rows its own choice (gemm._Lt.choose); the powers of two first, whose choices
        # also serve the other row counts of their bucket (ragged steps' products), as before there
        # were graphs between them
        sizes = sorted((m for m in BUCKETS if GEMV_MAX_ROWS < m <= self.rows), key=lambda m: (rows_bucket(m) != m, m))
        if not sizes:
            return
        with self.stream:
            n = max(sizes) * max(cfg.hidden_size, cfg.q_size, cfg.intermediate_size)
            codes = cp.random.randint(0, 0x7E, n, dtype=np.uint8)  # no NaN codes (0x7F, 0xFF)
            b.act_q[:n] = codes | (cp.random.randint(0, 2, n, dtype=np.uint8) << 7)
            saved = dict.fromkeys(sizes, 0.0)  # us a step against the heuristic's first choices
            wgmma_saved = dict.fromkeys(sizes, 0.0)  # and then against cuBLASLt (graph-timed)
            for m in sizes:
                for name, width, out in (("qkv_proj", cfg.hidden_size, self._product("qkv", m)),
                                         ("o_proj", cfg.q_size, self._product("o", m)),
                                         ("gate_up_proj", cfg.hidden_size, self._product("gate_up", m)),
                                         ("down_proj", cfg.intermediate_size, self._product("down", m))):
                    xq = b.act_q[:m * width].reshape(m, width)
                    mats = [getattr(x, name) for x in layers]
                    if fp8_tuned(xq, mats[0], out, self.fp8_fast_accum):  # by a runner before this one
                        continue
                    times, used = tune_gemm_fp8(xq, mats, out, self.fp8_fast_accum)
                    log.debug("fp8 %s at %d rows: %s us, #%d used", name, m, ", ".join(f"{t:.1f}" for t in times), used)
                    saved[m] += (times[0] - times[used]) * len(layers)
                    if FP8_WGMMA and self.fp8_fast_accum and wgmma_supported():  # where it beats cuBLASLt
                        lt_us, wg_times, config = tune_gemm_fp8_wgmma(xq, mats, out, self.stream, self.pdl)
                        log.debug("fp8 %s at %d rows: cuBLASLt %.1f us, gemm_fp8.cu %s; %s used", name, m, lt_us,
                                  ", ".join(f"{t:.1f}" for t in wg_times.values()), config or "cuBLASLt")
                        if config is not None:
                            wgmma_saved[m] += (lt_us - wg_times[config]) * len(layers)
            self.stream.synchronize()
        log.info("fp8 products: cuBLASLt algorithms timed; us a step saved by rows: %s; by gemm_fp8.cu after: %s",
                 ", ".join(f"{m}: {us:.0f}" for m, us in saved.items()),
                 ", ".join(f"{m}: {us:.0f}" for m, us in wgmma_saved.items()))

    def _capture_graphs(self) -> None:
        """One graph of _decode_body per bucket, its kernels launched with programmatic
        dependent launch (self.pdl). Only captured launches use it: a replay costs no host
        time, while an eager launch through cuLaunchKernelEx (ctypes) costs ~22 us of host
        time against ~5 us through CuPy (H200), and eager steps are host-bound when short
        (prefill of 128 tokens: 10.5 ms with it, 6.9 ms without)."""
        self._launch_pdl = self.pdl
        try:
            self._capture_each_bucket()
        finally:
            self._launch_pdl = False

    @property
    def early_launch(self) -> bool:
        """Whether the decode graphs' kernels let the next one launch before their wait
        (EARLY_TRIGGER_MAX_HIDDEN; _module.early_triggers): small models with 16-bit weights."""
        return self.config.hidden_size <= EARLY_TRIGGER_MAX_HIDDEN and not self.quant_fp8

    def _capture_each_bucket(self) -> None:
        """Two graphs a bucket, one for each host side of the step inputs (their first kernel
        reads that side: _decode_body's `side`)."""
        for _ in range(2):  # both host sides, for steps that fill only their rows
            self.buffers.inputs.writable()
            self._fill_padding(0, self.rows)
        self.buffers.inputs.upload(self.stream)
        early = self.early_launch
        for bucket in BUCKETS:
            if bucket > self.rows:
                break
            with self.stream:
                # warm-up: compiles, cuBLAS picks algorithms; with early triggers, the modules of
                # both forms (eager steps, ragged ones among them, launch the plain form)
                self._decode_body(bucket, side=0)
                with early_triggers(early):
                    if early:
                        self._decode_body(bucket, side=0)
                    self.stream.synchronize()
                    graphs = []
                    for side in range(2):
                        self.stream.begin_capture()
                        try:
                            self._decode_body(bucket, side)
                        except Exception:
                            self.stream.end_capture()
                            log.exception("could not capture the decode graph for %d rows; it runs eagerly", bucket)
                            break
                        graphs.append(self.stream.end_capture())
                    else:
                        self.graphs[bucket] = tuple(graphs)
        self.stream.synchronize()

    def decode_graph(self, n: int) -> cp.cuda.Graph:
        """The decode graph for n rows that reads the host side the last step filled."""
        return self.graphs[bucket_for(n)][self.buffers.inputs.side]

    def _capture_ragged(self) -> None:
        """The graphs of ragged steps (RAGGED_GRAPH_TOKENS): for each token count, _ragged_body
        captured in pieces, cut before a layer's attention, the last piece after the final norm;
        at a step, the pieces replay with the step's attention launched between them
        (_submit_varlen). Where ATTENTION_IN_GRAPH holds (ragged_attention_in_graph), every layer's
        attention but the last's is in the graph (_graph_attention): two pieces, cut before the
        last layer's attention (where _sampled_tail takes the rows that sample on). Else a piece a
        layer. Padding tokens (_pad_ragged) write their K/V into the spare slot. Captured with
        programmatic dependent launch, as the decode graphs are."""
        sizes = [t for t in RAGGED_GRAPH_TOKENS if t <= self.max_tokens]
        if not sizes:
            return
        cfg, ragged = self.config, self.buffers.ragged
        in_graph = self.ragged_attention_in_graph = ATTENTION_IN_GRAPH and use_wgmma(cfg.head_dim, 0)
        g = ragged.writable()
        self._pad_ragged(g, 0, sizes[-1])
        g["dec_len"][:] = 0  # no decode row takes keys, no prompt tile runs
        g["n_tiles"][0] = 0
        self._launch_pdl = self.pdl
        try:
            with self.stream:
                ragged.upload(self.stream)
                for T in sizes:
                    def held(offset: int) -> bool:  # the graph holds this attention: launch it there
                        if in_graph and offset != self._last_layer_offset:
                            self._graph_attention(T, offset)
                            return True
                        return False
                    self._ragged_body(T, held)  # warm-up: compiles, plans the products
                    self.stream.synchronize()
                    pieces: list[tuple[cp.cuda.Graph, int | None]] = []

                    def split(offset: int) -> None:
                        if not held(offset):
                            pieces.append((self.stream.end_capture(), offset))
                            self.stream.begin_capture()
                    self.stream.begin_capture()
                    try:
                        self._ragged_body(T, split)
                    except Exception:
                        log.exception("could not capture the ragged graphs for %d tokens; such steps run eagerly", T)
                        continue
                    finally:
                        if self.stream.is_capturing():
                            pieces.append((self.stream.end_capture(), None))
                    self.ragged_graphs[T] = pieces
                self.stream.synchronize()
        finally:
            self._launch_pdl = False

    def _graph_tiles(self, T: int) -> int:
        """The most prompt tiles a ragged step of up to T tokens has: one per 64 queries and one
        more a sequence, of which a step has at most `rows` (_submit_varlen runs a step with more
        eagerly)."""
        return T // PREFILL_TILE + min(T, self.rows)

    def _graph_attention(self, T: int, offset: int) -> None:
        """Layer `offset`'s attention in the graph of ragged steps of up to T tokens
        (ATTENTION_IN_GRAPH): the decode attention over min(rows, T) rows, their keys dec_len
        (zero past the step's decode rows: those blocks write nothing), and the prompts' over
        _graph_tiles(T) tiles, of which the kernel runs the step's count (n_tiles)."""
        d = self.buffers.ragged.dev
        self._ragged_attention(offset, min(self.rows, T), d["dec_len"], T, self._graph_tiles(T), self.max_model_len,
                               d["n_tiles"])

    def _ragged_attention(self, offset: int, nd: int, dec_lens: cp.ndarray, seqs: int, n_tiles: int, max_keys: int,
                          tiles_on_device: cp.ndarray | None = None) -> None:
        """Layer `offset`'s attention in a ragged step, from the staged inputs (its q rotated, its
        K/V written): the first nd rows, one token each, by split-KV decoding over dec_lens[:nd]
        keys, and the prompts' first n_tiles tiles (their sequences among the first `seqs`; the
        longest max_keys keys) by flash_prefill, on the side stream beside the decode rows' where
        both run (overlap_attention: the two read the same q and K/V and write other rows of
        attn_out). tiles_on_device: the count of tiles to run, read on the device (a graph's
        launch, n_tiles then the most it may be)."""
        cfg, b = self.config, self.buffers
        d = b.ragged.dev
        self._mark_near_end(offset)

        def prefill() -> None:
            flash_prefill(b.q_rot, d["tile_seq"][:n_tiles], d["tile_q0"][:n_tiles],
                          *(d[name][:seqs] for name in ("q_start", "q_len", "kv_len", "seq_k", "seq_v")), offset,
                          cfg.num_kv_heads, cfg.softmax_scale, b.attn_out, cfg.sliding_window or 0, kv_fp8=self.kv_fp8,
                          max_keys=max_keys, tiles_on_device=tiles_on_device)

        def decode() -> None:
            self._decode_attention(nd, b.q_rot[:nd], d["seq_k"][:nd], d["seq_v"][:nd], dec_lens[:nd], offset)

        if nd and n_tiles and self.overlap_attention:
            ready, done = self._side_events
            ready.record(self.stream)
            self._side_stream.wait_event(ready)
            with self._side_stream:
                prefill()
            done.record(self._side_stream)
            decode()
            self.stream.wait_event(done)
            return
        if nd:
            decode()
        if n_tiles:
            prefill()

    def _pad_ragged(self, g: dict[str, np.ndarray], start: int, end: int) -> None:
        """Tokens [start, end) of a ragged step's staged inputs as padding: token 0 at position
        0, its own id, K/V written to the spare slot."""
        g["tok_ids"][start:end] = 0
        g["tok_pos"][start:end] = 0
        g["tok_src"][start:end] = -1
        g["tok_k"][start:end] = self._spare_k
        g["tok_v"][start:end] = self._spare_v

    def _ragged_body(self, n: int, attention, sampled: int = 0) -> None:
        """A ragged step's n tokens from the staged inputs to the final norm (norm_out): the
        embedding, the layers (attention(offset) for each layer's attention), the final norm.
        sampled: where nonzero, the last layer from its attention on takes only the rows that
        sample, this many (_sampled_tail: final_norm_out)."""
        b, w = self.buffers, self.weights
        d = b.ragged.dev
        embedding(d["tok_ids"][:n], w.embed_tokens, self._residual(n), pdl=self._launch_pdl, src=d["tok_src"][:n],
                  sampled=b.sampled)
        down_scales, residual, delta = self._layers(n, (d["tok_pos"][:n], d["tok_k"][:n], d["tok_v"][:n]), attention,
                                                    front_of_last=sampled > 0)
        if sampled:
            self._sampled_tail(residual, n, sampled)
            return
        self._norm(residual, delta, w.norm, b.norm_out[:n], down_scales)

    def _takes_sampled_tail(self, T: int, n: int, prompt_logprobs: bool) -> bool:
        """Whether a ragged step of T tokens, n of whose rows sample, runs its last layer past
        the attention for the sampling rows only (_sampled_tail): where some tokens sample
        nothing (prompt tokens but a prompt's last), no row wants its prompt's logprobs
        (prompt_logprobs; those read every token's final hidden state), and the step is one of
        the cuBLAS path's (more than GEMV_MAX_ROWS tokens)."""
        return self.sampled_tail and GEMV_MAX_ROWS < T and 0 < n < T and n <= self.rows and not prompt_logprobs

    def _sampled_tail(self, residual: cp.ndarray, T: int, n: int) -> None:
        """The last layer of a ragged step of T tokens, from where _layers(front_of_last)
        stopped (every token's K/V written, q rotated), for the n rows that sample only: their
        residual rows (of `residual`) and q gathered (last_tok), their attention as one-token
        rows over every key of their sequence (split-KV decoding: last_len, last_k, last_v),
        then o .. down and the final norm into final_norm_out[:n], which the LM head reads. The
        other tokens' last-layer outputs would feed nothing: the K/V they leave is written
        before. For the 8B shape that is 1/32 of a prompt token's products and attention."""
        cfg, b = self.config, self.buffers
        d = b.ragged.dev
        last = cfg.num_layers - 1
        alt = b.res_alt[:n] if self._fold_norms(n) or self._mlp_block(n) else None
        res = [self._gather_sampled(residual, T, n), alt]
        offset = last * self._layer_elems
        self._mark_near_end(offset)
        self._decode_attention(n, b.q_last[:n], d["last_k"][:n], d["last_v"][:n], d["last_len"][:n], offset)
        down_scales, delta = self._layer_back(n, last, res)
        self._norm(res[0], delta, self.weights.norm, b.final_norm_out[:n], down_scales)

    def _gather_sampled(self, residual: cp.ndarray, T: int, n: int) -> cp.ndarray:
        """The residual rows (of `residual`, T rows) and rotated q of a ragged step's n rows that
        sample (their last tokens: last_tok) into res_last / q_last. Returns the rows' residual
        stream: 16-bit or float32 as _residual has it for n rows."""
        b = self.buffers
        rows = b.ragged.dev["last_tok"][:n]
        res = self._residual(n, sampled=True)
        if residual.dtype == res.dtype:
            cp.take(residual, rows, axis=0, out=res)
        else:  # bfloat16 rows (their bits as uint16) into the float32 stream of a few rows
            res[...] = (cp.take(residual, rows, axis=0).astype(np.uint32) << 16).view(np.float32)
        cp.take(b.q_rot[:T], rows, axis=0, out=b.q_last[:n])
        return res

    def _ragged_graph_tokens(self, T: int) -> int | None:
        """The token count whose graphs a ragged step of T tokens replays, or None (eager)."""
        for size in self.ragged_graphs:
            if size >= T:
                return size
        return None

    def _warm_up(self) -> None:
        """Run the ragged path (prefill and mixed steps) once at every power of two of tokens
        from 2 to the step budget, before the first request: its kernels compile (NVRTC;
        ~0.3 s for the 8B fp8 shapes on a cold kernel cache) and cuBLAS(Lt) picks an algorithm
        for each bucket of rows here, not in the first requests' time to first token. Each
        step is a one-token row (the split-KV decode attention beside the prompts') and prompts
        filling the rest, the last of the largest step at the end of the context (the prefill
        attention's variant for long rows). It writes K/V into free slots and samples nothing."""
        longest = min(self.max_model_len, self.num_kv_slots) - 1
        budget = min(self.max_tokens, self.num_kv_slots)
        if longest < 1 or budget < 2:
            return
        sizes = sorted({min(1 << k, budget) for k in range(1, budget.bit_length() + 1)})
        for T in sizes:
            rows, slot, left = [ScheduledSeq(-1, [0], 0, 0, False)], 1, T - 1
            while left > 0:
                n = min(left, longest, self.num_kv_slots - slot)
                start = longest - n if T == sizes[-1] and left == n else 0  # a chunk with a prefix
                if n < 1 or slot + start + n > self.num_kv_slots:
                    break
                rows.append(ScheduledSeq(-1 - len(rows), [0] * n, start, slot, False))
                slot, left = slot + start + n, left - n
            self._execute_varlen(rows)
        self._sampled_at = {}
        self._warm_up_first_uses()
        log.debug("warm-up: ragged steps of %s tokens", sizes)

    def _warm_up_first_uses(self) -> None:
        """What the warm-up's steps leave unbuilt, built with launches that do no work: the
        decode attention of a mixed step's decode rows at each count of them (its launch bounds
        follow the row count, not the bucket's: the ends of each bucket's range), and CuPy's
        gathers of sampled rows (_sample_rows, _gather_sampled). H200,
        8B fp8 at 128 rows, first run after start on a cold kernel cache: a mixed step took
        388 ms and the step where the first requests finished 221-275 ms, compiling these and
        CuPy's gathers of pending tokens (since gone: the embedding kernel's token_src).

        Then a ragged step's last layer for its sampling rows (_sampled_tail) and the LM head at
        every count of them: their products run eagerly at the exact count, and cuBLAS loads a
        kernel at its first use. H200, 8B fp8 + fp8 K/V, the engine alone, 512 x (512 + 128) at
        256 streams twice an engine: without this the first load's LM head took 13-48 ms (against
        < 2) at 21 new counts in the ramp, and that load ran 0.9-1.9 % slower than the
        second (two hosts: 11,647.4 / 11,871.8 and 12,091.1 / 12,199.6 tok/s); with it 11,862.8 /
        11,844.4 and 12,215.7 / 12,168.1, for < 0.3 s more of start."""
        b, d = self.buffers, self.buffers.inputs.dev
        with self.stream:
            empty = cp.zeros(self.rows, np.int32)  # rows of no keys: every block leaves at once
            low = 1
            for bucket in BUCKETS:
                if bucket > self.rows:
                    break
                for nd in sorted({low, bucket}):
                    self._decode_attention(nd, b.q_rot[:nd], d["k_ptrs"][:nd], d["v_ptrs"][:nd], empty[:nd], 0)
                low = bucket + 1
            self._sample_rows(b.norm_out[:1], np.zeros(1, np.int64), 1)
            if self.sampled_tail:  # into a float32 stream, and a 16-bit one over GEMV_MAX_ROWS rows
                wide = GEMV_MAX_ROWS + 1
                for n in sorted({1, min(wide, self.rows)}):
                    self._gather_sampled(self._residual(wide), wide, n)
                T = min(self.max_tokens, max(wide, self.rows + 1))
                if T > self.rows:
                    staged = b.ragged.dev
                    staged["last_tok"][:self.rows] = 0
                    staged["last_len"][:self.rows] = 0  # no keys: the attention leaves at once
                    for n in range(1, self.rows + 1):
                        self._sampled_tail(self._residual(T), T, n)
            for n in range(1, self.rows + 1):
                self._logits(n, keys=True)
            self.stream.synchronize()

    def _sample_rows(self, hidden: cp.ndarray, rows, n: int) -> None:
        """final_norm_out[:n] = hidden[rows] (host or device row numbers): the rows the LM
        head takes."""
        cp.take(hidden, cp.asarray(rows), axis=0, out=self.buffers.final_norm_out[:n])

    # ------------------------------------------------------------------ step inputs

    def _fill_padding(self, start: int, end: int) -> None:
        h = self.buffers.inputs.host
        if end <= start:
            return
        for name in ("input_ids", "positions", "kv_lens", "top_k", "counters", "bias_n", "banned_n"):
            h[name][start:end] = 0
        h["k_ptrs"][start:end] = self._spare_k
        h["v_ptrs"][start:end] = self._spare_v
        h["temperature"][start:end] = 0.0  # greedy: the cheapest
        h["top_p"][start:end] = 1.0
        h["min_p"][start:end] = 0.0
        h["seeds"][start:end] = 0
        h["rep_pen"][start:end] = 1.0
        h["freq_pen"][start:end] = 0.0
        h["pres_pen"][start:end] = 0.0
        h["pen_slot"][start:end] = -1
        h["lp_n"][start:end] = -1
        h["token_src"][start:end] = -1

    def _fill_sampling(self, rows: list[ScheduledSeq], slot: int) -> tuple[bool, bool]:
        """Sampling parameters of `rows` into the staged inputs (row order), their tokens
        bound for host set `slot` (every row's, padding included: HostOutputs.out_index).
        A row's fixed values come from its sequence's entry in the parameter table
        (_param_rows); only its counter is read from the row.

        Returns (whether any row has logit_bias or bans, whether any asks for logprobs).
        """
        h = self.buffers.inputs.host
        h["out_index"][:] = self._outputs.out_index[slot]
        n = len(rows)
        at = self._param_rows(rows)
        table = self._param_table
        for name in PARAM_STAGED:
            h[name][:n] = table[name][at]
        h["seeds"][:n] = [r.rng_seed & 0xFFFFFFFFFFFFFFFF for r in rows]
        counters = np.fromiter((len(r.output_token_ids) + r.pending_tokens for r in rows), np.int32, n)
        h["counters"][:n] = counters
        h["pen_slot"][:n] = -1
        for i in np.flatnonzero(table["penalized"][at]).tolist():
            h["pen_slot"][i] = self._penalty_slot(rows[i])
        h["banned_n"][:n] = 0
        extra = False
        # only the rows with a logit_bias or tokens banned (min_tokens) take a row's loop
        for i in np.flatnonzero((h["bias_n"][:n] > 0) | (counters < table["min_tokens"][at])).tolist():
            p = rows[i].sampling
            if p.logit_bias:
                nb = len(p.logit_bias)
                h["bias_ids"][i, :nb] = list(p.logit_bias.keys())
                h["bias_vals"][i, :nb] = list(p.logit_bias.values())
                extra = True
            if counters[i] < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.config.eos_token_ids))
                h["banned_n"][i] = len(banned)
                if banned:
                    h["banned_ids"][i, :len(banned)] = banned
                    extra = True
        return extra, bool((h["lp_n"][:n] >= 0).any())

    def _param_rows(self, rows: list[ScheduledSeq]) -> np.ndarray:
        """Where each row's sequence has its sampling values in the parameter table, entered
        at first sight (a sequence keeps its SamplingParams; _release frees its entry). An
        entry counts only for the very SamplingParams object it was made from, so a sequence id
        seen again with other parameters (a caller other than the scheduler) is entered again.
        A full table starts again: its entries are only a copy."""
        slot_of, owner = self._param_slots, self._param_owner
        at = [a if (a := slot_of.get(r.seq_id, -1)) >= 0 and owner[a] is r.sampling else -1 for r in rows]
        if -1 in at:
            if len(self._free_param_slots) < at.count(-1):
                slot_of.clear()
                self._param_owner = owner = [None] * len(owner)
                self._free_param_slots = list(range(len(owner)))
                at = [-1] * len(rows)
            table = self._param_table
            for i, r in enumerate(rows):
                if at[i] < 0:
                    entry = slot_of.get(r.seq_id, -1)  # held for other parameters: taken over
                    at[i] = entry = entry if entry >= 0 else self._free_param_slots.pop()
                    slot_of[r.seq_id] = entry
                    owner[entry] = r.sampling
                    for name, value in zip(PARAM_FIELDS, _param_values(r.sampling)):
                        table[name][entry] = value
        return np.array(at, np.intp)

    def _penalty_slot(self, row: ScheduledSeq) -> int:
        """The penalty state's slot of a row whose sequence has a penalty (the parameter
        table's `penalized`, which _fill_sampling asks first)."""
        slot = self._pen_slots.get(row.seq_id)
        if slot is None:  # first sight: counts of what it generated so far, prompt bitmap
            slot = self._free_pen_slots.pop()
            self._pen_slots[row.seq_id] = slot
            V = self.config.vocab_size
            counts = np.bincount(np.asarray(row.output_token_ids, np.int64), minlength=V).astype(np.int32)
            mask = np.zeros((V + 31) // 32, np.uint32)
            prompt = np.unique(np.asarray(row.prompt_token_ids, np.int64))
            np.bitwise_or.at(mask, prompt >> 5, (np.uint32(1) << (prompt & 31).astype(np.uint32)))
            with self.stream:
                self.buffers.pen_counts[slot].set(counts, self.stream)
                self.buffers.pen_prompt_mask[slot].set(mask, self.stream)
        return slot

    def _release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            slot = self._pen_slots.pop(sid, None)
            if slot is not None:
                self._free_pen_slots.append(slot)
            entry = self._param_slots.pop(sid, None)
            if entry is not None:
                self._param_owner[entry] = None
                self._free_param_slots.append(entry)

    # ------------------------------------------------------------------ execute

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.submit(out)()

    def submit(self, out: SchedulerOutput) -> Callable[[], RunnerOutput]:
        """Launch a step on the stream and return at once; the returned function waits for it
        and gives its output. The host is free in between (the engine emits the previous
        step's tokens there). Call it before the next submit: the step inputs are reused."""
        self._release(out.finished_seq_ids)
        with self.stream:
            for c in out.kv_copies:
                self._copy_kv(c.src_start, c.dst_start, c.num_tokens)
        if out.is_empty:
            self._sampled_at = {}
            return lambda: RunnerOutput()
        if self._decodes(out):
            return self._submit_decode(out.seqs)
        return self._submit_varlen(out.seqs)

    @property
    def chain_rows(self) -> int:
        """Pending rows a step launched ahead may have (Engine._submit_ahead): one decode graph's."""
        return self.rows

    def _token_sources(self, rows: list[ScheduledSeq], token_at: np.ndarray, T: int) -> np.ndarray | None:
        """Where each of a step's T input tokens is in `sampled` (-1: the ids given), for the
        embedding kernel: a row with a pending token (a step launched ahead,
        Scheduler.schedule_ahead) takes as its input at token_at[row] what the last step
        submitted sampled for it, still on the device. None when no row has one."""
        pending = [i for i, r in enumerate(rows) if r.pending_tokens]
        if not pending:
            return None
        try:
            src = [self._sampled_at[rows[i].seq_id] for i in pending]
        except KeyError as exc:
            raise ValueError(f"sequence {exc.args[0]} has a pending token but the last step did not sample it"
                             ) from None
        out = np.full(T, -1, np.int32)
        out[token_at[pending]] = src
        return out

    def _decodes(self, out: SchedulerOutput) -> bool:
        """Whether a step runs as a decode step (one graph), not through the ragged path."""
        return (len(out.seqs) <= self.rows
                and all(r.num_tokens == 1 and r.sample and not r.want_prompt_logprobs for r in out.seqs))

    def _copy_kv(self, src: int, dst: int, n: int) -> None:
        if n <= 0:
            return
        pitch = self._layer_elems * self.kv_dtype.itemsize
        for pool in (self.k_cache, self.v_cache):
            cp.cuda.runtime.memcpy2DAsync(pool.data.ptr + dst * self._slot_bytes, pitch,
                                          pool.data.ptr + src * self._slot_bytes, pitch,
                                          n * self._slot_bytes, self.config.num_layers,
                                          cp.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)

    def _submit_decode(self, rows: list[ScheduledSeq]) -> Callable[[], RunnerOutput]:
        """A row with a pending token takes as its input what the last step sampled for it
        (still on the device), not row.token_ids (_token_sources)."""
        B = len(rows)
        bucket = bucket_for(B)
        inputs = self.buffers.inputs
        h = inputs.writable()
        h["input_ids"][:B] = [r.token_ids[0] for r in rows]
        h["positions"][:B] = [r.start_pos for r in rows]
        np.add(h["positions"][:B], 1, out=h["kv_lens"][:B])  # one token a row: kv_len = start_pos + 1
        starts = np.fromiter((r.kv_start for r in rows), np.int64, B)
        h["k_ptrs"][:B] = self.k_cache.data.ptr + starts * self._slot_bytes
        h["v_ptrs"][:B] = self.v_cache.data.ptr + starts * self._slot_bytes
        src = self._token_sources(rows, np.arange(B), B)
        h["token_src"][:B] = -1 if src is None else src
        slot = self._outputs.take()
        extra, want_lp = self._fill_sampling(rows, slot)
        self._fill_padding(B, bucket)
        start, end, _ = self._outputs.events[slot]
        timed = self._decode_steps % ROOFLINE_EVERY == 0
        self._decode_steps += 1
        graphs = self.graphs.get(bucket)
        with self.stream:
            if graphs is None or extra:  # a graph reads the fields up to banned_n itself
                inputs.upload(self.stream, upto=None if extra else "banned_n")
            self._sampled_at = {r.seq_id: i for i, r in enumerate(rows)}
            if timed:
                start.record(self.stream)
            if graphs is not None:
                graphs[inputs.side].launch(self.stream)
                inputs.read(self.stream)
            else:
                self._decode_body(bucket)
            if timed:
                end.record(self.stream)
            self._download(slot, B, want_lp)
        kv_tokens = int(h["kv_lens"][:B].sum())

        def finish() -> RunnerOutput:
            result = self._collect(rows, list(range(B)), want_lp, slot)  # waits for this step only
            seconds = cp.cuda.get_elapsed_time(start, end) * 1e-3 if timed else 0.0
            if seconds > 0:
                self.last_roofline_fraction = self.decode_step_bytes(kv_tokens, B) / (seconds * self.copy_bandwidth)
            return result
        return finish

    def _download(self, slot: int, n: int, want_lp: bool) -> None:
        """Mark host set `slot` ready after the step (the sampling kernel wrote the ids there),
        with the logprobs of n rows copied into it first if the step has any."""
        host = self._outputs.sets[slot]
        for name, dev in self._outputs.device.items() if want_lp else ():
            src = dev[:n]
            cp.cuda.runtime.memcpyAsync(host[name].ctypes.data, src.data.ptr, src.nbytes,
                                        cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        self._outputs.events[slot][2].record(self.stream)

    def _collect(self, rows: list[ScheduledSeq], logit_rows: list[int], want_lp: bool, slot: int) -> RunnerOutput:
        """The sampled ids (and logprobs) of the rows that sample, once host set `slot` has them."""
        self._outputs.events[slot][2].synchronize()
        host = self._outputs.sets[slot]
        n = len(logit_rows)
        result = RunnerOutput()
        sampled = host["sampled"][:n].tolist()
        for i, row in zip(range(n), (rows[j] for j in logit_rows)):
            result.sampled[row.seq_id] = sampled[i]
            k = row.sampling.logprobs
            if k is not None:
                result.logprobs[row.seq_id] = TokenLogprobs(
                    sampled[i], float(host["lp_value"][i]), int(host["lp_rank"][i]),
                    [(int(t), float(v)) for t, v in zip(host["lp_top_ids"][i, :k], host["lp_top_values"][i, :k])])
        return result

    # ------------------------------------------------------------------ ragged (prefill) steps

    def _execute_varlen(self, rows: list[ScheduledSeq]) -> RunnerOutput:
        return self._submit_varlen(rows)()

    def _submit_varlen(self, rows: list[ScheduledSeq]) -> Callable[[], RunnerOutput]:
        """A step through the ragged path: its tokens, sequences and tiles staged in one copy
        (DecodeBuffers.ragged), the sampling parameters of its sampling rows in another, both
        ahead of its layers."""
        b = self.buffers
        T, S = sum(r.num_tokens for r in rows), len(rows)
        if T > self.max_tokens:
            raise ValueError(f"step of {T} tokens exceeds the runner's {self.max_tokens}")
        g = b.ragged.writable()
        q_lens, q_start, kv_lens = g["q_len"][:S], g["q_start"][:S], g["kv_len"][:S]
        q_lens[:] = [r.num_tokens for r in rows]
        q_start[0] = 0
        np.cumsum(q_lens[:-1], out=q_start[1:])
        kv_lens[:] = [r.kv_len for r in rows]
        seq_k, seq_v = g["seq_k"][:S], g["seq_v"][:S]
        np.multiply(np.fromiter((r.kv_start for r in rows), np.int64, S), self._slot_bytes, out=seq_k)
        seq_v[:] = seq_k
        seq_k += self.k_cache.data.ptr
        seq_v += self.v_cache.data.ptr
        g["tok_ids"][:T] = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in rows), np.int32, T)
        # a token's position: its row's start_pos + its place in the row (one arange, not one a row)
        starts = np.fromiter((r.start_pos for r in rows), np.int32, S)
        g["tok_pos"][:T] = np.arange(T, dtype=np.int32) + np.repeat(starts - q_start, q_lens)
        g["tok_k"][:T] = np.repeat(seq_k, q_lens)
        g["tok_v"][:T] = np.repeat(seq_v, q_lens)
        # The leading one-token rows (the decodes the scheduler puts first) attend through
        # split-KV decoding: a 64-query prefill tile would spend 63/64 of its work on padding.
        nd = int(np.argmin(q_lens == 1)) if (q_lens != 1).any() else S
        nd = min(nd, self.rows)
        tile_seq, tile_q0 = tiles(q_lens[nd:], kv_lens[nd:])
        n_tiles = tile_seq.size
        g["tile_seq"][:n_tiles] = tile_seq + nd  # the prompts' sequences come after the decode rows
        g["tile_q0"][:n_tiles] = tile_q0
        logit_rows = [i for i, r in enumerate(rows) if r.sample]
        n = len(logit_rows)
        g["last_tok"][:n] = (q_start + q_lens - 1)[logit_rows]
        prompt_rows = [i for i, r in enumerate(rows) if r.want_prompt_logprobs]
        sampled_tail = self._takes_sampled_tail(T, n, bool(prompt_rows))
        if sampled_tail:
            g["last_len"][:n] = kv_lens[logit_rows]
            g["last_k"][:n] = seq_k[logit_rows]
            g["last_v"][:n] = seq_v[logit_rows]
        tok_src = self._token_sources(rows, q_start, T)
        g["tok_src"][:T] = -1 if tok_src is None else tok_src
        graphed = self._ragged_graph_tokens(T)
        if graphed is not None and self.ragged_attention_in_graph:
            if S > self.rows:  # more prompt tiles than the graph's attention takes (_graph_tiles): eagerly
                graphed = None
            else:
                g["dec_len"][:nd] = kv_lens[:nd]
                g["dec_len"][nd:min(self.rows, graphed)] = 0
                g["n_tiles"][0] = n_tiles
        if graphed is not None:
            self._pad_ragged(g, T, graphed)
        if n:
            b.inputs.writable()
            slot = self._outputs.take()
            extra, want_lp = self._fill_sampling([rows[i] for i in logit_rows], slot)

        with self.stream:
            b.ragged.upload(self.stream)
            if n:
                b.inputs.upload(self.stream, upto=None if extra else "banned_n")
            self._sampled_at = {rows[i].seq_id: j for j, i in enumerate(logit_rows)}
            max_keys = int(kv_lens[nd:].max(initial=0))

            def attention(offset: int) -> None:
                self._ragged_attention(offset, nd, b.ragged.dev["kv_len"], S, n_tiles, max_keys)

            if graphed is None:
                self._ragged_body(T, attention, n if sampled_tail else 0)
            else:  # the layers' graphs, the attention they leave out between them
                for piece, offset in self.ragged_graphs[graphed]:
                    piece.launch(self.stream)
                    if offset is None:
                        break
                    if sampled_tail and offset == self._last_layer_offset:
                        self._sampled_tail(self._residual(T), T, n)  # the last layer's rows that sample, eagerly
                        break
                    attention(offset)
            result = RunnerOutput()
            for i in prompt_rows:
                result.prompt_logprobs[rows[i].seq_id] = self._prompt_logprobs(rows[i], int(q_start[i]))
            if n == 0:
                self.stream.synchronize()
                return lambda: result
            if not sampled_tail:
                self._sample_rows(b.norm_out[:T], b.ragged.dev["last_tok"][:n], n)
            self._sample(n, self._logits(n, keys=True))
            self._download(slot, n, want_lp)

        def finish() -> RunnerOutput:
            sampled = self._collect(rows, logit_rows, want_lp, slot)
            sampled.prompt_logprobs = result.prompt_logprobs
            return sampled
        return finish

    def forward(self, out: SchedulerOutput, all_logits: bool = False) -> np.ndarray:
        """Logits as the NumPy runner's forward() returns them (the last token of each
        sequence, or every token), through the ragged path. For tests and debugging."""
        rows = [ScheduledSeq(r.seq_id, r.token_ids, r.start_pos, r.kv_start, False) for r in out.seqs]
        self._execute_varlen(rows)  # runs the layers; norm_out holds every token's final hidden state
        b = self.buffers
        T = sum(r.num_tokens for r in rows)
        wanted = np.arange(T) if all_logits else np.cumsum([r.num_tokens for r in rows]) - 1
        logits = np.empty((len(wanted), self.config.vocab_size), np.float32)
        with self.stream:
            for p0 in range(0, len(wanted), self.rows):
                idx = wanted[p0:p0 + self.rows]
                self._sample_rows(b.norm_out[:T], idx, len(idx))
                self._logits(len(idx))
                logits[p0:p0 + len(idx)] = cp.asnumpy(b.logits[:len(idx)], stream=self.stream)
            self.stream.synchronize()
        return logits

    def _prompt_logprobs(self, row: ScheduledSeq, first_token: int) -> list[TokenLogprobs]:
        """Logprobs of the prompt tokens this chunk predicts (positions start_pos + 1 on),
        in pieces of `rows` positions through the logits buffer."""
        b = self.buffers
        prompt = row.prompt_token_ids
        first, last = row.start_pos + 1, min(row.kv_len, len(prompt) - 1)
        out: list[TokenLogprobs] = []
        top_n = row.sampling.prompt_logprobs or 0
        for p0 in range(first, last + 1, self.rows):
            p1 = min(last + 1, p0 + self.rows)
            n = p1 - p0
            src = cp.arange(first_token + p0 - 1 - row.start_pos, first_token + p1 - 1 - row.start_pos)
            self._sample_rows(b.norm_out, src, n)
            self._logits(n)
            targets = cp.asarray(np.array(prompt[p0:p1], np.int32))
            lp_n = cp.full(n, top_n, np.int32)
            token_logprobs(b.logits[:n], lp_n, targets, b.lp_value, b.lp_rank, b.lp_top_ids, b.lp_top_values, rows=n)
            values, ranks = cp.asnumpy(b.lp_value[:n]), cp.asnumpy(b.lp_rank[:n])
            ids, tops = cp.asnumpy(b.lp_top_ids[:n]), cp.asnumpy(b.lp_top_values[:n])
            for j in range(n):
                out.append(TokenLogprobs(prompt[p0 + j], float(values[j]), int(ranks[j]),
                                         [(int(t), float(v)) for t, v in zip(ids[j, :top_n], tops[j, :top_n])]))
        return out

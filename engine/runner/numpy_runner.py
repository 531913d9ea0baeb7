"""The reference forward pass in float32 NumPy: the CPU runner and the yardstick
every CUDA kernel is checked against.

One step runs a ragged batch of sequences (decode tokens and prefill chunks)
flattened into T tokens. Names follow the CUDA runner's buffers (DESIGN.md):
embed_out, norm_out, qkv_out, attn_out, o_proj_out, residual, gate_up_out, mlp_act,
down_out, final_norm_out, logits; batched_positions, batched_kv_lens, batched_kv_starts.

The KV pool is two arrays (num_layers, num_slots, num_kv_heads, head_dim); a
sequence owns the contiguous slots [kv_start, kv_start + capacity) and its token at
position p lives in slot kv_start + p.
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..loader.weights import Weights
from ..outputs import RunnerOutput, SchedulerOutput
from .cpu_native import W_BF16, W_F16, CpuKernels, W16, to_w16
from .packing import LayerWeights, Matrix, pack_model
from .sampling import sample_rows

WEIGHT_KINDS = {"float16": W_F16, "bfloat16": W_BF16}

PREFILL_QUERY_BLOCK = 256  # query rows per attention block in prefill (bounds the score matrix)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(variance + eps)) * weight


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """SiLU(gate) * up for a (T, 2 I) gate/up product."""
    gate, up = np.split(gate_up, 2, axis=-1)
    return gate * (0.5 * (1.0 + np.tanh(0.5 * gate))) * up  # sigmoid via tanh: no overflow


def rope_tables(cfg: ModelConfig, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (max_len, head_dim // 2) float32, from angles computed in float64."""
    inv_freq = np.asarray(cfg.rope_inv_freq(), dtype=np.float64)
    angles = np.arange(max_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate (T, heads, head_dim) by per-token (T, head_dim // 2) tables (HF's half split)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def softmax_lastdim(scores: np.ndarray) -> np.ndarray:
    scores = scores - scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


class NumpyRunner:
    """Runs SchedulerOutputs on the CPU. execute(SchedulerOutput) -> RunnerOutput."""

    device = "cpu"

    def __init__(self, config: ModelConfig, weights: Weights, *, num_kv_slots: int, max_model_len: int,
                 weight_dtype: str = "float32", kernels: CpuKernels | None = None, progress: bool = True) -> None:
        """weight_dtype "float32" is the exact reference; "float16" / "bfloat16" keep the
        matrices in 16 bits (half the bytes read per decode step) and need `kernels`."""
        if max_model_len > num_kv_slots:
            raise ValueError(f"KV pool of {num_kv_slots} slots cannot hold one sequence of {max_model_len} tokens")
        self.config = config
        self.max_model_len = max_model_len
        self.num_kv_slots = num_kv_slots
        self.weight_dtype = weight_dtype
        self.kernels = kernels
        if weight_dtype == "float32":
            self.weights = pack_model(weights, config, np.float32, progress=progress)
        elif weight_dtype in WEIGHT_KINDS and kernels is not None:
            kind = WEIGHT_KINDS[weight_dtype]
            self.weights = pack_model(weights, config, np.float32, progress=progress,
                                      matrix=lambda m: to_w16(m, kind))
        else:
            raise ValueError(f"weight_dtype {weight_dtype!r} needs the compiled CPU kernels "
                             f"(float32, float16 or bfloat16)")
        cache_shape = (config.num_layers, num_kv_slots, config.num_kv_heads, config.head_dim)
        self.k_cache = np.zeros(cache_shape, np.float32)  # (layers, slots, kv_heads, head_dim)
        self.v_cache = np.zeros(cache_shape, np.float32)
        self.rope_cos, self.rope_sin = rope_tables(config, max_model_len)  # (max_len, head_dim // 2)

    @staticmethod
    def kv_bytes_per_slot(config: ModelConfig) -> int:
        return config.kv_bytes_per_token(np.dtype(np.float32).itemsize)

    # ------------------------------------------------------------------ step

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for copy in out.kv_copies:
            src = slice(copy.src_start, copy.src_start + copy.num_tokens)
            dst = slice(copy.dst_start, copy.dst_start + copy.num_tokens)
            self.k_cache[:, dst] = self.k_cache[:, src]
            self.v_cache[:, dst] = self.v_cache[:, src]
        if out.is_empty:
            return RunnerOutput()
        want_all = any(s.want_prompt_logprobs for s in out.seqs)
        logits = self.forward(out, all_logits=want_all)
        return sample_rows(out, logits, all_logits=want_all, eos_token_ids=self.config.eos_token_ids)

    def forward(self, out: SchedulerOutput, all_logits: bool = False) -> np.ndarray:
        """Run the step's tokens through the model, writing their K/V into the pool.

        Returns float32 logits: (len(out.seqs), vocab) for the last token of each
        sequence, or (out.num_tokens, vocab) for every token when all_logits.
        """
        cfg, w = self.config, self.weights
        seqs = out.seqs
        for s in seqs:
            if s.kv_len > self.max_model_len:
                raise ValueError(f"sequence {s.seq_id}: {s.kv_len} tokens exceed max_model_len {self.max_model_len}")
        token_ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64)
        batched_positions = np.concatenate([np.arange(s.start_pos, s.kv_len) for s in seqs])  # (T,)
        batched_kv_starts = np.array([s.kv_start for s in seqs], dtype=np.int64)  # (B,)
        batched_kv_lens = np.array([s.kv_len for s in seqs], dtype=np.int64)  # (B,)
        token_rows = np.repeat(np.arange(len(seqs)), [s.num_tokens for s in seqs])  # (T,) row of each token
        slots = batched_kv_starts[token_rows] + batched_positions  # (T,) KV slot each token writes
        cos, sin = self.rope_cos[batched_positions], self.rope_sin[batched_positions]

        embed_out = self._embed(token_ids)  # (T, hidden)
        residual = embed_out
        for i, layer in enumerate(w.layers):
            attn_out = self._attention_block(i, layer, residual, cos, sin, slots, seqs,
                                             batched_kv_starts, batched_kv_lens)
            residual = residual + attn_out
            norm_out = rms_norm(residual, layer.post_attention_layernorm, cfg.rms_norm_eps)
            gate_up_out = self._linear(norm_out, layer.gate_up_proj)  # (T, 2 inter)
            mlp_act = silu_mul(gate_up_out)  # (T, inter)
            down_out = self._linear(mlp_act, layer.down_proj)  # (T, hidden)
            residual = residual + down_out

        if not all_logits:
            last = np.cumsum([s.num_tokens for s in seqs]) - 1
            residual = residual[last]
        final_norm_out = rms_norm(residual, w.norm, cfg.rms_norm_eps)
        return self._linear(final_norm_out, w.lm_head)  # logits (rows, vocab)

    def _linear(self, x: np.ndarray, w: Matrix) -> np.ndarray:
        """x (T, in) @ w.T for w (out, in), float32 or 16-bit."""
        if isinstance(w, W16):
            return self.kernels.matmul(x, w)
        return x @ w.T

    def _embed(self, token_ids: np.ndarray) -> np.ndarray:
        table = self.weights.embed_tokens
        if isinstance(table, W16):
            return self.kernels.widen(W16(table.bits[token_ids], table.kind))
        return table[token_ids]

    # ------------------------------------------------------------- attention

    def _attention_block(self, i: int, layer: LayerWeights, residual: np.ndarray, cos: np.ndarray,
                         sin: np.ndarray, slots: np.ndarray, seqs, kv_starts: np.ndarray,
                         kv_lens: np.ndarray) -> np.ndarray:
        cfg = self.config
        T = residual.shape[0]
        norm_out = rms_norm(residual, layer.input_layernorm, cfg.rms_norm_eps)
        qkv_out = self._linear(norm_out, layer.qkv_proj)  # (T, q_size + 2 kv_size)
        if layer.qkv_bias is not None:
            qkv_out += layer.qkv_bias
        q, k, v = np.split(qkv_out, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=1)
        q = apply_rope(q.reshape(T, cfg.num_heads, cfg.head_dim), cos, sin)  # (T, heads, head_dim)
        k = apply_rope(k.reshape(T, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        self.k_cache[i, slots] = k
        self.v_cache[i, slots] = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)

        attn_out = np.empty((T, cfg.num_heads, cfg.head_dim), np.float32)  # (T, heads, head_dim)
        first_token = np.cumsum([0] + [s.num_tokens for s in seqs[:-1]])  # (B,) token index of each row
        single = np.array([s.num_tokens == 1 for s in seqs])
        if single.any():  # decodes (and one-token chunks): one query per row, batched
            tok = first_token[single]
            attn_out[tok] = self._decode_attention(i, q[tok], kv_starts[single], kv_lens[single])
        for s, start in zip(seqs, first_token):
            if s.num_tokens > 1:
                attn_out[start:start + s.num_tokens] = self._prefill_attention(
                    i, q[start:start + s.num_tokens], s.kv_start, s.start_pos)
        o_proj_out = self._linear(attn_out.reshape(T, cfg.q_size), layer.o_proj)  # (T, hidden)
        if layer.o_bias is not None:
            o_proj_out += layer.o_bias
        return o_proj_out

    def _decode_attention(self, i: int, q: np.ndarray, kv_starts: np.ndarray, kv_lens: np.ndarray) -> np.ndarray:
        """One query per sequence, vectorised over sequences and heads. q: (B, heads, head_dim)."""
        cfg = self.config
        B = q.shape[0]
        max_len = int(kv_lens.max())
        offsets = np.arange(max_len)
        valid = offsets[None, :] < kv_lens[:, None]  # (B, max_len)
        if cfg.sliding_window is not None:
            valid &= offsets[None, :] > (kv_lens[:, None] - 1 - cfg.sliding_window)
        gather = kv_starts[:, None] + np.where(valid, offsets[None, :], 0)  # (B, max_len) slots
        # float64 here: rows are padded to the longest context of the batch, and the
        # padding must not change a row's float32 result (batch invariance)
        keys = self.k_cache[i][gather].astype(np.float64)  # (B, max_len, kv_heads, head_dim)
        values = self.v_cache[i][gather].astype(np.float64)
        qg = q.reshape(B, cfg.num_kv_heads, cfg.group_size, cfg.head_dim).astype(np.float64)
        scores = qg @ keys.transpose(0, 2, 3, 1)  # (B, kv_heads, group, max_len)
        scores *= cfg.softmax_scale
        scores = np.where(valid[:, None, None, :], scores, -np.inf)
        probs = softmax_lastdim(scores)
        out = probs @ values.transpose(0, 2, 1, 3)  # (B, kv_heads, group, head_dim)
        return out.reshape(B, cfg.num_heads, cfg.head_dim).astype(np.float32)

    def _prefill_attention(self, i: int, q: np.ndarray, kv_start: int, start_pos: int) -> np.ndarray:
        """Causal attention of one sequence's chunk over its whole context. q: (n, heads, head_dim)."""
        cfg = self.config
        n = q.shape[0]
        kv_len = start_pos + n
        keys = self.k_cache[i, kv_start:kv_start + kv_len].transpose(1, 2, 0)  # (kv_heads, head_dim, kv_len)
        values = self.v_cache[i, kv_start:kv_start + kv_len].transpose(1, 0, 2)  # (kv_heads, kv_len, head_dim)
        qg = q.reshape(n, cfg.num_kv_heads, cfg.group_size, cfg.head_dim).transpose(1, 2, 0, 3)
        out = np.empty((cfg.num_kv_heads, cfg.group_size, n, cfg.head_dim), np.float32)
        key_pos = np.arange(kv_len)
        for b in range(0, n, PREFILL_QUERY_BLOCK):
            e = min(n, b + PREFILL_QUERY_BLOCK)
            q_pos = np.arange(start_pos + b, start_pos + e)
            allowed = key_pos[None, :] <= q_pos[:, None]  # (block, kv_len)
            if cfg.sliding_window is not None:
                allowed &= key_pos[None, :] > q_pos[:, None] - cfg.sliding_window
            scores = qg[:, :, b:e] @ keys[:, None]  # (kv_heads, group, block, kv_len)
            scores *= cfg.softmax_scale
            scores = np.where(allowed, scores, -np.inf)
            out[:, :, b:e] = softmax_lastdim(scores) @ values[:, None]
        return out.transpose(2, 0, 1, 3).reshape(n, cfg.num_heads, cfg.head_dim)

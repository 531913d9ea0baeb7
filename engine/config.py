"""Frozen configuration objects passed down from the edge into the engine.

Config flows one way (DESIGN.md): config.yaml -> CLI flags -> env -> these
frozen dataclasses. Anything derived from them is computed by a property or a
function and returned, never written back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# RoPE scaling kinds the runners implement.
ROPE_SCALING_KINDS = ("llama3", "linear")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (HF `rope_scaling` / `rope_parameters`)."""

    kind: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(
                f"rope scaling type {self.kind!r} is not supported "
                f"(supported: {', '.join(ROPE_SCALING_KINDS)})"
            )
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama, Mistral, Qwen2)."""

    architecture: str  # "llama" | "mistral" | "qwen2"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # per-frequency divisors of the rotary frequencies, as GGUF files of Llama 3.1+
    # store them (`rope_freqs.weight`) instead of the llama3 scaling parameters
    rope_freq_factors: tuple[float, ...] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, or Llama with attention_bias
    o_proj_bias: bool = False  # Llama with attention_bias
    sliding_window: int | None = None  # Mistral v0.1: attend to the last N positions only
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # dtype the checkpoint stores its float weights in: "float32", "float16",
    # "bfloat16"; quantized GGUF files report the type of most of their matrices
    # ("q4_1", ...). The CUDA runner uses it to pick fp16 or bf16 on the device.
    dtype: str = "float32"
    name: str = ""

    def __post_init__(self) -> None:
        for attr in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            value = getattr(self, attr)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config: {attr} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"model config: {len(self.rope_freq_factors)} rope frequency factors for "
                f"head_dim {self.head_dim} (expected {self.head_dim // 2})"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"model config: sliding_window must be > 0, got {self.sliding_window}")

    @property
    def q_size(self) -> int:  # width of the query projection
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:  # width of the key (and of the value) projection
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:  # query heads per KV head (GQA)
        return self.num_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def rope_inv_freq(self) -> tuple[float, ...]:
        """Inverse rotary frequencies (head_dim // 2 of them), scaling applied.

        Computed in float64; runners turn position * inv_freq into cos/sin tables.
        """
        dim = self.head_dim
        inv = [self.rope_theta ** (-(2 * i) / dim) for i in range(dim // 2)]
        if self.rope_freq_factors is not None:
            inv = [f / s for f, s in zip(inv, self.rope_freq_factors)]
        rs = self.rope_scaling
        if rs is None:
            return tuple(inv)
        if rs.kind == "linear":
            return tuple(f / rs.factor for f in inv)
        # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between
        old = rs.original_max_position_embeddings
        low_wavelen = old / rs.low_freq_factor
        high_wavelen = old / rs.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / rs.factor)
            else:
                smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
                out.append((1 - smooth) * f / rs.factor + smooth * f)
        return tuple(out)

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.qkv_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            per_layer += h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + L * per_layer + h + head

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of K and V cache one token takes over all layers."""
        return 2 * self.num_layers * self.kv_size * itemsize


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults a checkpoint ships (generation_config.json); None = unset."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

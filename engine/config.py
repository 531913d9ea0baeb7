"""Frozen configuration objects passed down from the edge into the engine.

Config flows one way (DESIGN.md): config.yaml -> CLI flags -> env -> these
frozen dataclasses. Anything derived from them is computed by a property or a
function and returned, never written back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .env import cache_dir as _default_cache_dir

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


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8 is e4m3, as in vLLM
# weight quantization at load (vLLM's --quantization fp8): the four matrices of every layer
# as e4m3 with a scale per output feature; activations quantized per token on the fly
QUANTIZATIONS = ("fp8",)


# how the fp8 products of many rows add (cuBLASLt): "fast", in the tensor cores' own
# accumulator, as vLLM's fp8 kernels do; "promoted", into float32 now and then (slower)
FP8_ACCUMULATIONS = ("fast", "promoted")
# EngineConfig.dtype: the 16-bit type the runner computes in; "auto" is the checkpoint's
# (bfloat16 for a bfloat16 checkpoint, else float16, as vLLM's --dtype auto)
DTYPES = ("auto", "float16", "bfloat16")


def check_quantization(value: str | None) -> None:
    if value is not None and value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset), got {value!r}")


def check_lm_head(quantize_lm_head: bool, quantization: str | None) -> None:
    if quantize_lm_head and quantization != "fp8":
        raise ValueError("quantize_lm_head needs quantization fp8 (the LM head is quantized as the layers are)")


@dataclass(frozen=True)
class CacheConfig:
    """Size of the KV pool. `kv_cache_bytes` wins; otherwise the GPU runner takes
    `gpu_memory_utilization` of the device memory and the CPU runner `cpu_kv_cache_bytes`."""

    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_bytes: int = 1 << 30
    block_size: int = 16  # KV regions are handed out in multiples of this many slots
    initial_decode_slots: int = 256  # output slots reserved at admission beyond the prompt
    # "auto": the model's 16-bit type; "fp8": float8 e4m3 (scale 1), half the bytes a token
    # (twice the tokens in the same memory, half the K/V reads of a decode step); CUDA only
    kv_cache_dtype: str = "auto"

    @property
    def kv_fp8(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size < 1 or self.initial_decode_slots < 1:
            raise ValueError("block_size and initial_decode_slots must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 2048  # tokens per step (decodes + prefill chunks)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_waiting: int = 1024  # requests queued beyond this are refused (overload)
    # launch steps that take prompts ahead of the step in flight too, when the waiting
    # requests fill them (Scheduler.schedule_ahead), not only steady decode steps; H200, 8B fp8
    # at 256 streams: +5.7 % output tok/s over HTTP, the same at 32 streams and for a lone request
    prompts_ahead: bool = True
    # launch a step ahead only once the step in flight nears its end (the runner's
    # wait_near_end), so that requests arriving meanwhile join it; only after steps of
    # LATE_AHEAD_MIN_STEP_S or more whose last quarter covers the next launch, and while requests
    # arrive (engine.py). H200, 8B fp8 + fp8 K/V, 256 streams over HTTP, one SSE write a stream a
    # step (fifty-second session, 6 loads each on one host, servers in both orders): TTFT p50
    # 92-105 ms against 120-135, output tok/s +0.4 %. (The forty-third session, before one write a
    # step, saw the mode one step lower but p50 the same, its tail made by the HTTP path's bursts.)
    late_ahead: bool = True
    # prompt tokens a step may take beyond max_num_batched_tokens while it catches up with a
    # backlog: a short queue (at most max_num_seqs / 4 requests) whose first request two steps
    # have passed over (Scheduler._step_budget). Under a fixed concurrency, successors arrive as
    # fast as their predecessors were admitted, so a burst left waiting (a stall on the HTTP
    # path) never drains at the steady budget. None: half of max_num_batched_tokens; 0: off.
    # H200, 8B fp8, 256 streams over HTTP, 2,048 + 1,024: TTFT p50 ~130-146 ms against ~180,
    # output tok/s -0.5 %; 32 streams unchanged
    catch_up_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.catch_up_tokens is not None and self.catch_up_tokens < 0:
            raise ValueError(f"catch_up_tokens must be >= 0, got {self.catch_up_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step"
            )

    @property
    def catch_up(self) -> int:
        """The tokens a step catching up with a backlog takes beyond the budget."""
        return self.max_num_batched_tokens // 2 if self.catch_up_tokens is None else self.catch_up_tokens

    @property
    def max_step_tokens(self) -> int:
        """The most tokens a step can hold: the budget, and what a step catching up adds."""
        return self.max_num_batched_tokens + self.catch_up

    def model_len(self, model: ModelConfig) -> int:
        """The context limit actually served."""
        if self.max_model_len is None:
            return model.max_position_embeddings
        return self.max_model_len


@dataclass(frozen=True)
class EngineConfig:
    model: str  # path to a .gguf file or HF directory, or a known model name
    device: str = "auto"  # "auto" | "cuda" | "cpu"
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    seed: int | None = None  # seeds the streams of requests that give no seed
    enforce_eager: bool = False  # CUDA: run every step without graphs (debugging)
    served_model_name: str | None = None
    # CPU runner weights: "auto" = 16 bits when the C kernels compile (bfloat16 for bf16
    # checkpoints, else float16), "float32" = the exact reference
    cpu_weight_dtype: str = "auto"
    quantization: str | None = None  # None (the checkpoint's 16-bit weights) or "fp8" (CUDA only)
    fp8_accumulation: str = "fast"  # FP8_ACCUMULATIONS, for quantization "fp8"
    quantize_lm_head: bool = False  # with quantization "fp8": the LM head as e4m3 too (vLLM keeps it 16-bit)
    dtype: str = "auto"  # DTYPES: the 16-bit type of weights and activations (compute_dtype)
    cache_dir: str = field(default_factory=lambda: str(_default_cache_dir()))  # downloads, compiled kernels

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got {self.device!r}")
        check_quantization(self.quantization)
        if self.fp8_accumulation not in FP8_ACCUMULATIONS:
            raise ValueError(f"fp8_accumulation must be one of {', '.join(FP8_ACCUMULATIONS)}, "
                             f"got {self.fp8_accumulation!r}")
        check_lm_head(self.quantize_lm_head, self.quantization)
        if self.cpu_weight_dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"cpu_weight_dtype must be auto, float32, float16 or bfloat16, "
                             f"got {self.cpu_weight_dtype!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    def compute_dtype(self, checkpoint_dtype: str) -> str:
        """The 16-bit type to run a checkpoint stored in `checkpoint_dtype` in: `dtype`, or for
        "auto" bfloat16 where the checkpoint is bfloat16, else float16."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if checkpoint_dtype == "bfloat16" else "float16"

"""Random-weight models of real shapes (`--model random:llama3-8b`), for benchmarks.

Speed does not depend on the weights' values, so a benchmark can use a named shape
with random weights: the CUDA runner draws them on the device (seconds for 8B), the
NumPy runner on the host. The tokenizer has the shape's vocabulary: the 256 bytes of
byte-level BPE, then placeholder words " w<i>", then the special tokens.
"""

from __future__ import annotations

import zlib

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from ..config import GenerationDefaults, ModelConfig
from .tokenizer import Tokenizer, _byte_level_alphabet
from .weights import Weights, layer_weight_names

RANDOM_PREFIX = "random:"
WEIGHT_STD = 0.02

SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(architecture="llama", hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama3.2-1b": dict(architecture="llama", hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                        num_kv_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
                        rope_theta=500000.0, tie_word_embeddings=True),
    "llama3-8b": dict(architecture="llama", hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0),
    "mistral-7b": dict(architecture="mistral", hidden_size=4096, intermediate_size=14336, num_layers=32,
                       num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=32768, max_position_embeddings=32768,
                       rope_theta=1000000.0),
    "qwen2.5-7b": dict(architecture="qwen2", hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                       num_kv_heads=4, head_dim=128, vocab_size=152064, max_position_embeddings=32768,
                       rope_theta=1000000.0, qkv_bias=True),
}
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>")
CHATML = ("{% for m in messages %}<|begin_of_text|>{{ m['role'] }}\n{{ m['content'] }}<|end_of_text|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|begin_of_text|>assistant\n{% endif %}")


class RandomWeights(Weights):
    """Weights drawn from N(0, 0.02) (norms: 1), reproducible per tensor name."""

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        self.config = config
        self.seed = seed
        names = layer_weight_names(config.num_layers, qkv_bias=config.qkv_bias, o_proj_bias=config.o_proj_bias,
                                   tied=config.tie_word_embeddings)
        super().__init__({name: self._reader(name) for name in names}, {name: self._shape(name) for name in names})

    def _shape(self, name: str) -> tuple[int, ...]:
        c = self.config
        h, q, kv, i = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
        table = {"embed_tokens.weight": (c.vocab_size, h), "lm_head.weight": (c.vocab_size, h), "norm.weight": (h,),
                 "layernorm.weight": (h,), "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
                 "o_proj.weight": (h, q), "gate_proj.weight": (i, h), "up_proj.weight": (i, h),
                 "down_proj.weight": (h, i), "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)}
        return next(shape for suffix, shape in table.items() if name.endswith(suffix))

    def _reader(self, name: str):
        def read() -> np.ndarray:
            shape = self._shape(name)
            if name.endswith("norm.weight"):
                return np.ones(shape, np.float32)
            rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
            return (rng.standard_normal(shape, dtype=np.float32) * WEIGHT_STD).astype(np.float32)
        return read


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    alphabet = list(_byte_level_alphabet())
    n_words = vocab_size - len(alphabet) - len(SPECIAL_TOKENS)
    tokens = alphabet + [f"Ġw{i}" for i in range(n_words)]
    backend = BackendTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos, eos = backend.token_to_id(SPECIAL_TOKENS[0]), backend.token_to_id(SPECIAL_TOKENS[1])
    return Tokenizer(backend, bos_token_id=bos, eos_token_ids=(eos,), chat_template=CHATML)


def load_random(name: str, with_tokenizer: bool = True
                ) -> tuple[ModelConfig, RandomWeights, Tokenizer | None, GenerationDefaults]:
    shape = name[len(RANDOM_PREFIX):] if name.startswith(RANDOM_PREFIX) else name
    if shape not in SHAPES:
        raise ValueError(f"unknown random shape {shape!r} (known: {', '.join(SHAPES)})")
    vocab = SHAPES[shape]["vocab_size"]
    config = ModelConfig(**SHAPES[shape], rms_norm_eps=1e-5, bos_token_id=vocab - 2, eos_token_ids=(vocab - 1,),
                         dtype="float16", name=f"{RANDOM_PREFIX}{shape}")
    tokenizer = synthetic_tokenizer(vocab) if with_tokenizer else None
    return config, RandomWeights(config), tokenizer, GenerationDefaults()

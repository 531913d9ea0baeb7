"""Checkpoint tensors -> the fused matrices both runners compute with.

Q, K and V become one (q_size + 2 kv_size, hidden) matrix and gate/up one
(2 intermediate, hidden) matrix, so a layer makes 4 matrix products instead of 7.
Matrices keep the checkpoint's (out_features, in_features) layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..config import ModelConfig
from ..loader.weights import Weights


# Matrices may be stored in another form than float32 (the CPU runner's 16-bit
# weights, the CUDA runner's device arrays): `matrix` converts each one at load.
Matrix = Any
MatrixFn = Callable[[np.ndarray], Matrix]


@dataclass
class LayerWeights:
    input_layernorm: np.ndarray  # (hidden,)
    qkv_proj: Matrix  # (q_size + 2 kv_size, hidden)
    qkv_bias: np.ndarray | None  # (q_size + 2 kv_size,)
    o_proj: Matrix  # (hidden, q_size)
    o_bias: np.ndarray | None  # (hidden,)
    post_attention_layernorm: np.ndarray  # (hidden,)
    gate_up_proj: Matrix  # (2 intermediate, hidden): gate rows, then up rows
    down_proj: Matrix  # (hidden, intermediate)


@dataclass
class ModelWeights:
    embed_tokens: Matrix  # (vocab, hidden)
    layers: list[LayerWeights]
    norm: np.ndarray  # (hidden,)
    lm_head: Matrix  # (vocab, hidden); the embedding itself when tied


def _identity(m: np.ndarray) -> np.ndarray:
    return m


def _check(name: str, arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if arr.shape != shape:
        raise ValueError(f"{name}: shape {arr.shape}, expected {shape} from the model config")
    return arr


def pack_layer(weights: Weights, cfg: ModelConfig, i: int, dtype: np.dtype, matrix: MatrixFn = _identity
               ) -> LayerWeights:
    p = f"model.layers.{i}."
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return _check(p + name, weights[p + name], shape).astype(dtype, copy=False)

    qkv = np.concatenate([get("self_attn.q_proj.weight", (q, h)), get("self_attn.k_proj.weight", (kv, h)),
                          get("self_attn.v_proj.weight", (kv, h))])
    qkv_bias = None
    if cfg.qkv_bias:
        qkv_bias = np.concatenate([get("self_attn.q_proj.bias", (q,)), get("self_attn.k_proj.bias", (kv,)),
                                   get("self_attn.v_proj.bias", (kv,))])
    return LayerWeights(
        input_layernorm=np.array(get("input_layernorm.weight", (h,))),
        qkv_proj=matrix(qkv),
        qkv_bias=qkv_bias,
        o_proj=matrix(np.array(get("self_attn.o_proj.weight", (h, q)))),
        o_bias=np.array(get("self_attn.o_proj.bias", (h,))) if cfg.o_proj_bias else None,
        post_attention_layernorm=np.array(get("post_attention_layernorm.weight", (h,))),
        gate_up_proj=matrix(np.concatenate([get("mlp.gate_proj.weight", (inter, h)),
                                            get("mlp.up_proj.weight", (inter, h))])),
        down_proj=matrix(np.array(get("mlp.down_proj.weight", (h, inter)))),
    )


def pack_model(weights: Weights, cfg: ModelConfig, dtype: np.dtype = np.float32, progress: bool = True,
               matrix: MatrixFn = _identity) -> ModelWeights:
    from tqdm.auto import tqdm

    embed = matrix(np.array(_check("model.embed_tokens.weight", weights["model.embed_tokens.weight"],
                                   (cfg.vocab_size, cfg.hidden_size)), dtype=dtype))
    layers = [pack_layer(weights, cfg, i, dtype, matrix)
              for i in tqdm(range(cfg.num_layers), desc="Loading layers", unit="layer",
                            disable=not progress, leave=False)]
    norm = np.array(weights["model.norm.weight"], dtype=dtype)
    if cfg.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = matrix(np.array(_check("lm_head.weight", weights["lm_head.weight"],
                                         (cfg.vocab_size, cfg.hidden_size)), dtype=dtype))
    return ModelWeights(embed, layers, norm, lm_head)

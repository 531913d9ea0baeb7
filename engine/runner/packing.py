"""Checkpoint tensors -> the fused matrices both runners compute with.

Q, K and V become one (q_size + 2 kv_size, hidden) matrix and gate/up one
(2 intermediate, hidden) matrix, so a layer makes 4 matrix products instead of 7.
Matrices keep the checkpoint's (out_features, in_features) layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from ..loader.weights import Weights


@dataclass
class LayerWeights:
    input_layernorm: np.ndarray  # (hidden,)
    qkv_proj: np.ndarray  # (q_size + 2 kv_size, hidden)
    qkv_bias: np.ndarray | None  # (q_size + 2 kv_size,)
    o_proj: np.ndarray  # (hidden, q_size)
    o_bias: np.ndarray | None  # (hidden,)
    post_attention_layernorm: np.ndarray  # (hidden,)
    gate_up_proj: np.ndarray  # (2 intermediate, hidden): gate rows, then up rows
    down_proj: np.ndarray  # (hidden, intermediate)


@dataclass
class ModelWeights:
    embed_tokens: np.ndarray  # (vocab, hidden)
    layers: list[LayerWeights]
    norm: np.ndarray  # (hidden,)
    lm_head: np.ndarray  # (vocab, hidden); the embedding itself when tied


def _check(name: str, arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if arr.shape != shape:
        raise ValueError(f"{name}: shape {arr.shape}, expected {shape} from the model config")
    return arr


def pack_layer(weights: Weights, cfg: ModelConfig, i: int, dtype: np.dtype) -> LayerWeights:
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
        qkv_proj=qkv,
        qkv_bias=qkv_bias,
        o_proj=np.array(get("self_attn.o_proj.weight", (h, q))),
        o_bias=np.array(get("self_attn.o_proj.bias", (h,))) if cfg.o_proj_bias else None,
        post_attention_layernorm=np.array(get("post_attention_layernorm.weight", (h,))),
        gate_up_proj=np.concatenate([get("mlp.gate_proj.weight", (inter, h)), get("mlp.up_proj.weight", (inter, h))]),
        down_proj=np.array(get("mlp.down_proj.weight", (h, inter))),
    )


def pack_model(weights: Weights, cfg: ModelConfig, dtype: np.dtype = np.float32, progress: bool = True) -> ModelWeights:
    from tqdm.auto import tqdm

    embed = np.array(_check("model.embed_tokens.weight", weights["model.embed_tokens.weight"],
                            (cfg.vocab_size, cfg.hidden_size)), dtype=dtype)
    layers = [pack_layer(weights, cfg, i, dtype)
              for i in tqdm(range(cfg.num_layers), desc="Loading layers", unit="layer",
                            disable=not progress, leave=False)]
    norm = np.array(weights["model.norm.weight"], dtype=dtype)
    if cfg.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = np.array(_check("lm_head.weight", weights["lm_head.weight"],
                                  (cfg.vocab_size, cfg.hidden_size)), dtype=dtype)
    return ModelWeights(embed, layers, norm, lm_head)

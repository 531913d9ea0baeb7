"""HF model directories (config.json + safetensors) -> ModelConfig + Weights + Tokenizer.

Safetensors files are read through their JSON header and a memory map: the format
is a header length, a JSON directory and raw little-endian tensors, which NumPy can
view without copying. (The `safetensors` package's NumPy API cannot return bfloat16.)
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import struct
from typing import Any

import numpy as np

from ..config import GenerationDefaults, ModelConfig, RopeScaling
from .quants import bf16_to_f32
from .tokenizer import Tokenizer, tokenizer_from_hf_dir
from .weights import Weights, check_complete, layer_weight_names

# HF architecture -> our architecture name
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}


def _open_safetensors(path: str) -> tuple[mmap.mmap, dict[str, Any], int]:
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (header_len,) = struct.unpack_from("<Q", mm, 0)
    header = json.loads(mm[8:8 + header_len])
    return mm, header, 8 + header_len


def _tensor_reader(mm: mmap.mmap, info: dict[str, Any], base: int, source: str):
    dtype = info["dtype"]
    if dtype not in _DTYPES:
        raise ValueError(f"{source}: tensor dtype {dtype} is not supported (F32, F16, BF16)")
    shape = tuple(info["shape"])
    start, end = info["data_offsets"]

    def read() -> np.ndarray:
        raw = np.frombuffer(mm, dtype=_DTYPES[dtype], count=(end - start) // np.dtype(_DTYPES[dtype]).itemsize,
                            offset=base + start).reshape(shape)
        if dtype == "BF16":
            return bf16_to_f32(raw)
        if dtype == "F64":
            return raw.astype(np.float32)
        return raw
    return read


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, name) for name in dict.fromkeys(weight_map.values())]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


def read_weights(path: str) -> tuple[Weights, str]:
    """All tensors of the directory's safetensors files, and their (float) dtype."""
    readers, shapes, dtypes = {}, {}, {}
    for file in _weight_files(path):
        mm, header, base = _open_safetensors(file)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            readers[name] = _tensor_reader(mm, info, base, file)
            shapes[name] = tuple(info["shape"])
            dtypes[info["dtype"]] = dtypes.get(info["dtype"], 0) + 1
    dtype = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(max(dtypes, key=dtypes.get), "float32")
    return Weights(readers, shapes), dtype


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters`; earlier versions `rope_theta` + `rope_scaling`
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3", float(scaling["factor"]), float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
    if kind == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: llama3, linear)")


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def model_config_from_hf(cfg: dict[str, Any], dtype: str, name: str = "",
                         generation: dict[str, Any] | None = None) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"architecture {', '.join(archs) or '(none in config.json)'} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"activation {cfg['hidden_act']!r} is not supported (silu)")
    if cfg.get("mlp_bias"):
        raise ValueError("MLP biases (mlp_bias=true) are not supported")
    heads = cfg["num_attention_heads"]
    theta, scaling = _rope(cfg)
    window = cfg.get("sliding_window")
    if arch == "qwen2" and not cfg.get("use_sliding_window", False):
        window = None
    attention_bias = bool(cfg.get("attention_bias", False))
    generation = generation or {}
    eos = _ids(generation.get("eos_token_id")) or _ids(cfg.get("eos_token_id"))
    bos = generation.get("bos_token_id", cfg.get("bos_token_id"))
    return ModelConfig(
        architecture=arch,
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or attention_bias,
        o_proj_bias=arch != "qwen2" and attention_bias,
        sliding_window=window,
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        dtype=dtype,
        name=name,
    )


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_hf_dir(path: str, with_tokenizer: bool = True
                ) -> tuple[ModelConfig, Weights, Tokenizer | None, GenerationDefaults]:
    cfg = _read_json(os.path.join(path, "config.json"))
    if cfg is None:
        raise FileNotFoundError(f"{path}: no config.json")
    gen = _read_json(os.path.join(path, "generation_config.json")) or {}
    weights, dtype = read_weights(path)
    config = model_config_from_hf(cfg, dtype, name=os.path.basename(os.path.normpath(path)), generation=gen)
    # tied checkpoints may still carry a copy of the embedding as lm_head; both work
    check_complete(weights, layer_weight_names(
        config.num_layers, qkv_bias=config.qkv_bias, o_proj_bias=config.o_proj_bias,
        tied=config.tie_word_embeddings), path)
    tokenizer = None
    if with_tokenizer:
        tokenizer = tokenizer_from_hf_dir(path, config.eos_token_ids, config.bos_token_id)
        # the tokenizer config may name an eos token the model config leaves out
        config = dataclasses.replace(config, eos_token_ids=tokenizer.eos_token_ids,
                                     bos_token_id=tokenizer.bos_token_id)
    defaults = GenerationDefaults(
        temperature=gen.get("temperature"), top_p=gen.get("top_p"), top_k=gen.get("top_k"),
        repetition_penalty=gen.get("repetition_penalty"),
    )
    return config, weights, tokenizer, defaults

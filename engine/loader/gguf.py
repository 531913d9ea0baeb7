"""GGUF files -> ModelConfig + Weights + Tokenizer.

The header (metadata and tensor directory) is parsed here with `struct` over a
memory map: gguf's GGUFReader builds a NumPy view per string and takes ~5 s on a
49k-token vocabulary, most of the 10 s load budget. Type codes, block sizes and the
dequantization reference come from the `gguf` package.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..config import GenerationDefaults, ModelConfig, RopeScaling
from .quants import dequantize
from .tokenizer import Tokenizer, tokenizer_from_gguf
from .weights import Weights, check_complete, layer_weight_names

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHS = ("llama", "qwen2")

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_ARRAY_DTYPES = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # NumPy order: GGUF's ne reversed, so the last axis is ne0
    type_name: str  # "F32", "Q4_1", ...
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """The parsed header of a GGUF file and a read-only map of its bytes."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, ValueError, UnicodeDecodeError, IndexError) as exc:
            raise ValueError(f"{path}: not a readable GGUF file ({exc})") from exc

    # -- primitive readers over the map
    def _unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        raw = self._map[self._pos:self._pos + n]
        self._pos += n
        return raw.decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            item_type, count = GGUFValueType(self._unpack("<I")), self._unpack("<Q")
            if item_type == GGUFValueType.STRING:
                return [self._string() for _ in range(count)]
            if item_type == GGUFValueType.ARRAY:
                return [self._value(GGUFValueType.ARRAY) for _ in range(count)]
            dtype = np.dtype(_ARRAY_DTYPES[item_type])
            arr = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
            self._pos += count * dtype.itemsize
            return arr.tolist()
        return self._unpack(_SCALAR_FORMATS[vtype])

    def _parse(self) -> None:
        if self._map[:4] != GGUF_MAGIC:
            raise ValueError("bad magic (expected GGUF)")
        self._pos = 4
        self.version = self._unpack("<I")
        if self.version not in (2, 3):
            raise ValueError(f"GGUF version {self.version} is not supported (2 or 3)")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.meta[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("<I")
            ne = [self._unpack("<Q") for _ in range(n_dims)]
            ttype = GGMLQuantizationType(self._unpack("<I"))
            offset = self._unpack("<Q")
            infos.append((name, tuple(reversed(ne)), ttype, offset))
        align = int(self.meta.get("general.alignment", 32))
        data_start = (self._pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ttype, offset in infos:
            block_elems, block_bytes = GGML_QUANT_SIZES[ttype]
            nbytes = int(np.prod(shape)) // block_elems * block_bytes
            start = data_start + offset
            if start + nbytes > len(self._map):
                raise ValueError(f"tensor {name} runs past the end of the file")
            self.tensors[name] = TensorInfo(name, shape, ttype.name, start, nbytes)

    def raw(self, info: TensorInfo) -> np.ndarray:
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def read(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        return dequantize(self.raw(info), info.type_name, info.shape)


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's halves).

    llama.cpp orders the rows of each head as (pair i, half h) -> 2 i + h, where HF
    has h * head_dim / 2 + i. Works on weights (rows, cols) and biases (rows,).
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> HF name, None for tensors that are not weights (rope_freqs)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        mapped = _LAYER_NAMES.get(part)
        return None if mapped is None else f"model.layers.{layer}.{mapped}.{suffix}"
    mapped = _GLOBAL_NAMES.get(base)
    return None if mapped is None else f"{mapped}.{suffix}"


def _model_config(gf: GGUFFile) -> ModelConfig:
    meta = gf.meta
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{gf.path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHS)})")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden = key("embedding_length")
    heads = key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    head_dim = key("attention.key_length", hidden // heads if hidden and heads else None)
    rope_dims = key("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"{gf.path}: partial rotary embeddings ({rope_dims} of {head_dim}) are not supported")
    scaling = None
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type == "linear":
        scaling = RopeScaling("linear", float(key("rope.scaling.factor")))
    elif scaling_type not in ("none", None):
        raise ValueError(f"{gf.path}: rope scaling type {scaling_type!r} is not supported (supported: linear)")
    freq_factors = None
    if "rope_freqs.weight" in gf.tensors:
        freq_factors = tuple(float(x) for x in gf.read("rope_freqs.weight").reshape(-1))
    tokens = meta.get("tokenizer.ggml.tokens", [])
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if k in meta]
    matrix_types = Counter(t.type_name for t in gf.tensors.values() if len(t.shape) == 2)
    dtype = matrix_types.most_common(1)[0][0] if matrix_types else "F32"
    dtype = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(dtype, dtype.lower())
    return ModelConfig(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=key("vocab_size", len(tokens) or None) or gf.tensors["token_embd.weight"].shape[0],
        max_position_embeddings=key("context_length", 4096),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rope_freq_factors=freq_factors,
        tie_word_embeddings="output.weight" not in gf.tensors,
        qkv_bias="blk.0.attn_q.bias" in gf.tensors,
        o_proj_bias="blk.0.attn_output.bias" in gf.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        dtype=dtype,
        name=meta.get("general.name") or os.path.basename(gf.path),
    )


def load_gguf(path: str, with_tokenizer: bool = True) -> tuple[ModelConfig, Weights, Tokenizer | None, GenerationDefaults]:
    gf = GGUFFile(path)
    config = _model_config(gf)
    permute = config.architecture == "llama"  # llama.cpp permutes Q/K for its llama arch only

    def reordered(name: str) -> bool:  # rows read in another order than the file's
        return permute and (".q_proj." in name or ".k_proj." in name)

    def reader(gguf_name: str, name: str):
        heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
        unpermute = reordered(name)

        def read() -> np.ndarray:
            w = gf.read(gguf_name)
            return _unpermute_rows(w, heads) if unpermute else w
        return read

    def stored(info: TensorInfo):
        return lambda: (info.type_name, gf.raw(info))

    readers, shapes, raw = {}, {}, {}
    for gguf_name, info in gf.tensors.items():
        name = hf_name(gguf_name)
        if name is not None:
            readers[name] = reader(gguf_name, name)
            shapes[name] = info.shape
            if not reordered(name):
                raw[name] = stored(info)
    weights = Weights(readers, shapes, raw)
    check_complete(weights, layer_weight_names(
        config.num_layers, qkv_bias=config.qkv_bias, o_proj_bias=config.o_proj_bias,
        tied=config.tie_word_embeddings), path)
    tokenizer = None
    if with_tokenizer:
        tokenizer = tokenizer_from_gguf(gf.meta, config.eos_token_ids, config.bos_token_id)
    return config, weights, tokenizer, GenerationDefaults()

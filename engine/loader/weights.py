"""Named checkpoint tensors, read from memory-mapped files only when asked for."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Callable

import numpy as np


class Weights(Mapping[str, np.ndarray]):
    """HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...).

    Indexing reads the tensor from its file and converts it: float32 for float32,
    bfloat16 and quantized sources (all exact), float16 for float16 sources. Each
    access reads again; callers keep what they need.
    """

    def __init__(self, readers: dict[str, Callable[[], np.ndarray]], shapes: dict[str, tuple[int, ...]],
                 stored: dict[str, Callable[[], tuple[str, np.ndarray]]] | None = None):
        self._readers = readers
        self._shapes = shapes
        self._stored = stored or {}

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            reader = self._readers[name]
        except KeyError:
            raise KeyError(f"checkpoint has no tensor {name!r}") from None
        return reader()

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def stored(self, name: str) -> tuple[str, np.ndarray] | None:
        """(GGML type name, raw bytes) of a tensor whose file bytes are its values as they are
        (a GGUF tensor in its row order), e.g. to keep a Q8_0 matrix quantized on the device;
        None where the source has no such form."""
        reader = self._stored.get(name)
        return reader() if reader is not None else None


def layer_weight_names(num_layers: int, *, qkv_bias: bool, o_proj_bias: bool, tied: bool) -> list[str]:
    """Every tensor name a Llama-family checkpoint must provide."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not tied:
        names.append("lm_head.weight")
    for i in range(num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        if qkv_bias:
            names += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
        if o_proj_bias:
            names.append(p + "self_attn.o_proj.bias")
    return names


def check_complete(weights: Weights, required: list[str], source: str) -> None:
    missing = [n for n in required if n not in weights]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{source}: checkpoint lacks {', '.join(missing[:5])}{more}")

"""Model files -> ModelConfig + named weights + Tokenizer.

`load_model` accepts a .gguf file, an HF directory (config.json + safetensors), a
directory holding one .gguf file, or the name of a known model (the default,
SmolLM2-135M-Instruct, is fetched into the cache folder on first use).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..config import GenerationDefaults, ModelConfig
from .download import DEFAULT_MODEL, download, known_model
from .gguf import load_gguf
from .random_model import RANDOM_PREFIX, load_random
from .safetensors import load_hf_dir
from .tokenizer import Tokenizer
from .weights import Weights

__all__ = ["DEFAULT_MODEL", "LoadedModel", "load_model", "resolve_model_path"]


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: Weights
    tokenizer: Tokenizer | None
    generation_defaults: GenerationDefaults
    path: str


def resolve_model_path(model: str, cache: Path, quiet: bool = False) -> str:
    """A path or a known model name -> the local path to load (downloading if needed)."""
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return path
    known = known_model(model)
    if known is not None:
        return str(download(known, cache, quiet=quiet))
    raise FileNotFoundError(
        f"model {model!r} is neither a local .gguf file or HF directory nor a known model "
        f"(known: {DEFAULT_MODEL}, or random:<shape> for benchmarks); no model hub is used"
    )


def load_model(model: str, cache: Path | None = None, with_tokenizer: bool = True) -> LoadedModel:
    if model.startswith(RANDOM_PREFIX):  # a named shape with random weights, for benchmarks
        config, weights, tokenizer, defaults = load_random(model, with_tokenizer)
        return LoadedModel(config, weights, tokenizer, defaults, model)
    if cache is None:
        from ..env import cache_dir
        cache = cache_dir()
    path = resolve_model_path(model, cache)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(p for p in os.listdir(path) if p.endswith(".gguf"))
        if len(ggufs) == 1:
            path = os.path.join(path, ggufs[0])
        else:
            raise FileNotFoundError(f"{path}: expected config.json or exactly one .gguf file")
    if os.path.isdir(path):
        config, weights, tokenizer, defaults = load_hf_dir(path, with_tokenizer)
    else:
        config, weights, tokenizer, defaults = load_gguf(path, with_tokenizer)
    return LoadedModel(config, weights, tokenizer, defaults, path)

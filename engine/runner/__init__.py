"""Runners: execute(SchedulerOutput) -> RunnerOutput, on the CPU (NumPy) or a GPU (CuPy)."""

from __future__ import annotations

import logging

from ..config import EngineConfig
from ..loader import LoadedModel

log = logging.getLogger("cuserve.runner")


def cuda_available() -> bool:
    """Whether CuPy is installed and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no"
        return False


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if cuda_available() and _cuda_runner_present() else "cpu"
    if device == "cuda" and not cuda_available():
        raise RuntimeError("--device cuda: CuPy does not see a CUDA device (pip install 'cuserve[cuda12]' or "
                           "'cuserve[cuda13]' to match the driver)")
    return device


def _cuda_runner_present() -> bool:
    try:
        from . import cuda_runner  # noqa: F401
        return True
    except ImportError:
        return False


def make_runner(config: EngineConfig, model: LoadedModel):
    device = resolve_device(config.device)
    max_len = config.scheduler.model_len(model.config)
    if device == "cuda":
        from .cuda_runner import CudaRunner
        return CudaRunner(config, model)
    if config.quantization is not None:
        raise ValueError(f"--quantization {config.quantization} needs the CUDA runner; the CPU runner keeps "
                         "16-bit or float32 weights")
    if config.cache.kv_fp8:
        raise ValueError(f"--kv-cache-dtype {config.cache.kv_cache_dtype} needs the CUDA runner; the CPU runner "
                         "keeps K/V in float32")
    from pathlib import Path

    from .cpu_native import load_kernels
    from .numpy_runner import NumpyRunner
    budget = config.cache.kv_cache_bytes or config.cache.cpu_kv_cache_bytes
    slots = budget // NumpyRunner.kv_bytes_per_slot(model.config)
    max_len = min(max_len, slots)
    weight_dtype = config.cpu_weight_dtype
    kernels = load_kernels(Path(config.cache_dir)) if weight_dtype != "float32" else None
    if weight_dtype == "auto":
        weight_dtype = "float32" if kernels is None else config.compute_dtype(model.config.dtype)
    log.info("CPU runner: %s weights, %d KV slots (%.2f GiB), context limit %d",
             weight_dtype, slots, budget / 2**30, max_len)
    return NumpyRunner(model.config, model.weights, num_kv_slots=slots, max_model_len=max_len,
                       weight_dtype=weight_dtype, kernels=kernels)

"""Server settings: config.yaml < CUSERVE_* environment variables < command-line flags.

`ServeSettings` is the single list of settings; the CLI flags, the environment
variable names, config.yaml and the README's table all derive from its fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.config import (DTYPES, FP8_ACCUMULATIONS, KV_CACHE_DTYPES, CacheConfig, EngineConfig, SchedulerConfig,
                           check_lm_head, check_quantization)
from engine.env import cache_dir as default_cache_dir
from engine.env import prefixed
from engine.loader import DEFAULT_MODEL

ENV_PREFIX = "CUSERVE_"
# HTTP processes by default where the model runs on a GPU: 2 cut the serving target's TTFT p50 by
# ~10 % against 1 on two H200 hosts (8B fp8, 256 streams, 11 loads each: means 97.4 / 108.2 ms; 4
# gave back most of it: 111-116 ms), at the same tok/s (fifty-ninth session)
AUTO_API_SERVERS = 2


def _s(default: Any, kind: str, help: str, choices: tuple[str, ...] | None = None):
    return field(default=default, metadata={"kind": kind, "help": help, "choices": choices})


@dataclass(frozen=True)
class ServeSettings:
    model: str = _s(DEFAULT_MODEL, "str", "a .gguf file, an HF model directory, or a known model name")
    served_model_name: str | None = _s(None, "str", "the model id the API reports and accepts (default: --model)")
    host: str = _s("127.0.0.1", "str", "address to listen on (0.0.0.0 for all interfaces)")
    port: int = _s(8000, "int", "TCP port")
    device: str = _s("auto", "str", "where the model runs: auto (a GPU if CuPy sees one), cuda or cpu",
                     ("auto", "cuda", "cpu"))
    api_key: str | None = _s(None, "str", "require 'Authorization: Bearer <key>' on every endpoint but /health")
    max_model_len: int | None = _s(None, "int", "context limit in tokens (default: the model's)")
    max_num_seqs: int = _s(128, "int", "sequences decoded together at most")
    max_num_batched_tokens: int = _s(2048, "int", "tokens per engine step (decodes + prefill chunks; a step "
                                     "catching up with a queue may take catch_up_tokens more)")
    max_waiting: int = _s(1024, "int", "queued requests beyond this get 503 + Retry-After")
    schedule_prompts_ahead: bool = _s(True, "bool", "CUDA: also launch engine steps that take prompts while the "
                                      "step before runs, when waiting requests fill them (more throughput under a "
                                      "queue); off: only steady decode steps go ahead")
    late_ahead: bool = _s(True, "bool", "CUDA: launch a step ahead only once the step in flight nears its end "
                          "(its last quarter of layers), so that requests arriving meanwhile join it (while "
                          "requests arrive: a lower TTFT under load); off: as soon as the step before is launched")
    catch_up_tokens: int | None = _s(None, "int", "prompt tokens an engine step may take beyond "
                                     "max_num_batched_tokens while a short queue waits that two steps passed over "
                                     "(so a burst drains instead of delaying every later request); default: half of "
                                     "max_num_batched_tokens; 0: off")
    kv_cache_gib: float | None = _s(None, "float", "KV cache size in GiB (default: GPU: from "
                                    "gpu_memory_utilization; CPU: cpu_kv_cache_gib)")
    kv_cache_dtype: str = _s("auto", "str", "KV cache element: auto (the model's 16-bit type) or fp8 (e4m3, "
                             "half the memory a token; CUDA only)", KV_CACHE_DTYPES)
    quantization: str | None = _s(None, "str", "fp8: the layers' weights as float8 e4m3 with a scale per output "
                                  "feature, activations quantized per token (half the weight memory and reads; "
                                  "CUDA, compute capability 8.9+)")
    fp8_accumulation: str = _s("fast", "str", "with --quantization fp8, how products of more than 16 rows add: "
                               "fast (in the tensor cores' accumulator, as vLLM's fp8 kernels; 7-10 % faster "
                               "prefill on Hopper, ~0.2-0.3 % rms error in the sums against e4m3's own ~3.6 %) "
                               "or promoted (into float32 now and then)", FP8_ACCUMULATIONS)
    quantize_lm_head: bool = _s(False, "bool", "with --quantization fp8, the LM head as float8 e4m3 too, with a "
                                "scale per vocabulary row (vLLM keeps it 16-bit): half its reads and, past 16 rows "
                                "a step, its products at the float8 rate; each row's 8 largest logits are then "
                                "recomputed from the 16-bit head, kept beside it, so the greedy token is the 16-bit "
                                "head's wherever that is among them (SmolLM2: at 226 positions of 226, against 94 % "
                                "unrescored); the other logits move (~0.16 at the median of its top ten). 8B: ~0.08 "
                                "ms a decode step at 1 row, ~0.1 ms at 256")
    dtype: str = _s("auto", "str", "the 16-bit type of weights and activations: auto (the checkpoint's: bfloat16 "
                    "for a bfloat16 checkpoint, else float16), float16 or bfloat16 (the CPU runner's with "
                    "cpu_weight_dtype auto)", DTYPES)
    gpu_memory_utilization: float = _s(0.9, "float", "fraction of GPU memory for weights + buffers + KV cache")
    cpu_kv_cache_gib: float = _s(1.0, "float", "KV cache size in GiB on the CPU")
    cpu_weight_dtype: str = _s("auto", "str", "CPU weights: auto (16-bit with the C kernels), float32, float16, "
                               "bfloat16", ("auto", "float32", "float16", "bfloat16"))
    enforce_eager: bool = _s(False, "bool", "CUDA: run every step without CUDA graphs (debugging)")
    engine_process: bool = _s(True, "bool", "run the engine (scheduling, steps, detokenizing) in a process of "
                              "its own, so that it does not share a GIL with the HTTP work (throughput under many "
                              "streams); --no-engine-process: on a thread of the server's process")
    api_server_count: int | None = _s(None, "int", "HTTP server processes sharing the port (SO_REUSEPORT), each "
                                      "with its own event loop (parsing, tokenizing, JSON, SSE) and link to the one "
                                      "engine process: one loop under hundreds of streams delays first tokens (H200, "
                                      "8B fp8, 256 streams: TTFT p50 -10 % with 2, the same tok/s); default: 2 when "
                                      "the model runs on a GPU, else 1; more than 1 needs engine_process")
    seed: int | None = _s(None, "int", "seed for requests that give none (reproducible runs)")
    chat_template: str | None = _s(None, "str", "a Jinja file to use instead of the model's chat template")
    max_request_bytes: int = _s(8 << 20, "int", "largest request body accepted (413 beyond)")
    retry_after: int = _s(1, "int", "seconds a 503 (overloaded) asks clients to wait")
    shutdown_timeout: float = _s(30.0, "float", "seconds in-flight requests get to finish after SIGTERM")
    keep_alive_timeout: int = _s(65, "int", "seconds an idle keep-alive connection stays open: longer than "
                                 "clients keep idle connections (httpx 5, load balancers 60), so that a client "
                                 "never sends a request on a connection the server is closing")
    log_level: str = _s("info", "str", "debug, info, warning or error", ("debug", "info", "warning", "error"))
    cache_dir: str | None = _s(None, "str", "downloads and compiled kernels (default: $CUSERVE_CACHE or "
                               "~/.cache/cuserve)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {value!r}")
        check_quantization(self.quantization)
        check_lm_head(self.quantize_lm_head, self.quantization)
        for name in ("port", "max_num_seqs", "max_num_batched_tokens", "max_waiting", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.api_server_count is not None:
            if self.api_server_count < 1:
                raise ValueError(f"api_server_count must be >= 1, got {self.api_server_count}")
            if self.api_server_count > 1 and not self.engine_process:
                raise ValueError("api_server_count > 1 needs engine_process: the HTTP processes share an engine "
                                 "process")

    def api_servers_at_most(self) -> int:
        """HTTP processes this server may run: api_server_count, or by default AUTO_API_SERVERS unless
        the model surely runs on the CPU (the device is known once the engine is up: `api_servers`)."""
        if self.api_server_count is not None:
            return self.api_server_count
        reuse_port = hasattr(socket, "SO_REUSEPORT")
        return AUTO_API_SERVERS if self.engine_process and self.device != "cpu" and reuse_port else 1

    def api_servers(self, device: str) -> int:
        """HTTP processes to run once the engine is up on `device` ("cuda" or "cpu")."""
        if self.api_server_count is not None:
            return self.api_server_count
        return min(self.api_servers_at_most(), AUTO_API_SERVERS if device == "cuda" else 1)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def engine_config(self) -> EngineConfig:
        gib = 1 << 30
        return EngineConfig(
            model=self.model, device=self.device, seed=self.seed, enforce_eager=self.enforce_eager,
            served_model_name=self.model_name, cpu_weight_dtype=self.cpu_weight_dtype,
            quantization=self.quantization, fp8_accumulation=self.fp8_accumulation,
            quantize_lm_head=self.quantize_lm_head, dtype=self.dtype,
            cache_dir=self.cache_dir or str(default_cache_dir()),
            cache=CacheConfig(kv_cache_bytes=int(self.kv_cache_gib * gib) if self.kv_cache_gib else None,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              cpu_kv_cache_bytes=int(self.cpu_kv_cache_gib * gib),
                              kv_cache_dtype=self.kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_model_len=self.max_model_len, max_waiting=self.max_waiting,
                                      prompts_ahead=self.schedule_prompts_ahead, late_ahead=self.late_ahead,
                                      catch_up_tokens=self.catch_up_tokens),
        )


SETTINGS = {f.name: f for f in dataclasses.fields(ServeSettings)}


def _coerce(name: str, value: Any, source: str) -> Any:
    kind = SETTINGS[name].metadata["kind"]
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if kind == "float":
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source}: {name} must be {kind}, got {value!r}") from None


def settings_from_yaml(path: str) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of settings")
    unknown = sorted(set(data) - set(SETTINGS))
    if unknown:
        raise ValueError(f"{path}: unknown settings {', '.join(unknown)}")
    return {k: _coerce(k, v, path) for k, v in data.items()}


def settings_from_env() -> dict[str, Any]:
    values = {}
    for key, raw in prefixed(ENV_PREFIX).items():
        if key in SETTINGS:
            values[key] = _coerce(key, raw, f"{ENV_PREFIX}{key.upper()}")
    return values


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a YAML file of settings (see config.yaml)")
    for name, f in SETTINGS.items():
        flag = "--" + name.replace("_", "-")
        kind, choices = f.metadata["kind"], f.metadata["choices"]
        text = f.metadata["help"].replace("%", "%%")  # argparse formats help with %
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            parser.add_argument(flag, type={"int": int, "float": float}.get(kind, str), default=None,
                                choices=choices, help=text)


def resolve_settings(args: argparse.Namespace) -> ServeSettings:
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(settings_from_yaml(args.config))
    values.update(settings_from_env())
    values.update({name: getattr(args, name) for name in SETTINGS if getattr(args, name, None) is not None})
    return ServeSettings(**values)


def config_yaml() -> str:
    """config.yaml's text: every setting, its default and what it does."""
    lines = ["# cuserve settings, with their defaults.",
             "# Precedence: this file (cuserve serve --config config.yaml) < CUSERVE_<NAME> environment",
             "# variables < command-line flags (--name-with-dashes).", ""]
    for name, f in SETTINGS.items():
        lines.append(f"# {f.metadata['help']}")
        default = f.default
        lines.append(f"{name}: {yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}")
        lines.append("")
    return "\n".join(lines)

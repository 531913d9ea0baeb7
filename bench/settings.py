"""--set MODULE.NAME=VALUE for the benchmarks that build an engine: a module-level setting of the
engine or its kernels (engine/runner/cuda_runner.py's ATTENTION_IN_GRAPH, kernels_cuda/...'s
constants) given another value for one run, so that a default and its alternative are measured
in one script with committed code, not through a hook:

    python bench/serve.py --engine random:llama3-8b ... --engine-process \\
        --set engine.runner.cuda_runner.ATTENTION_IN_GRAPH=False

VALUE is a Python literal (True, 0.5, (16, 32), 'text'). The setting must exist and keep its type
(an int may become a float); it is changed where the engine is built, before it is (in this
process, or in the engine's own: build_engine), and the module that reads it must read it there
at run time (a name another module imported with `from ... import` keeps its old value there).
A server's engine is out of reach: these are for the engine-mode benchmarks.

The weight flags those benchmarks share with the server (--quantization, --fp8-accumulation,
--quantize-lm-head, --dtype) are here too (add_weight_flags).
"""

from __future__ import annotations

import ast
import importlib
import logging
from typing import Any

log = logging.getLogger("cuserve.bench")

Setting = tuple[str, str, Any]  # (module, name, value)


def add_flag(ap) -> None:
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="give a module-level setting of the engine or its kernels this value for the run "
                         "(bench/settings.py); may be repeated")


def from_args(ap, args) -> list[Setting]:
    """args.set parsed, or the parser's error."""
    try:
        return parse(args.set)
    except ValueError as exc:
        ap.error(str(exc))


def parse(items: list[str]) -> list[Setting]:
    """MODULE.NAME=VALUE strings as (module, name, value); ValueError where one is malformed."""
    settings = []
    for item in items:
        target, sep, text = item.partition("=")
        module, dot, name = target.strip().rpartition(".")
        if not sep or not dot or not module or not name.isidentifier():
            raise ValueError(f"--set {item!r}: expected MODULE.NAME=VALUE")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"--set {item!r}: {text.strip()!r} is not a Python literal") from None
        settings.append((module, name, value))
    return settings


def apply(settings: list[Setting]) -> None:
    """Give each setting its value; ValueError for a module that does not import, a name it does
    not have, or a value of another type than the setting's (bool stays bool, a number a number)."""
    for module, name, value in settings:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"--set {module}.{name}: cannot import {module}: {exc}") from None
        if not hasattr(mod, name):
            raise ValueError(f"--set {module}.{name}: {module} has no setting {name}")
        old = getattr(mod, name)
        numbers = (int, float)
        same = type(old) is type(value) or (type(old) in numbers and type(value) in numbers) or old is None
        if not same:
            raise ValueError(f"--set {module}.{name}: {value!r} is a {type(value).__name__}, the setting a "
                             f"{type(old).__name__} ({old!r})")
        setattr(mod, name, value)
        log.warning("--set %s.%s = %r (was %r)", module, name, value, old)


def add_weight_flags(ap, quantization_help: str = "fp8: e4m3 layer weights (default: 16-bit)",
                     dtype_help: str = "auto, float16 or bfloat16 (the server's setting)") -> None:
    """The server's weight settings, for the benchmarks that build an engine (weight_settings)."""
    ap.add_argument("--quantization", default=None, help=quantization_help)
    ap.add_argument("--fp8-accumulation", default="fast", help="fast or promoted (the server's setting)")
    ap.add_argument("--quantize-lm-head", action="store_true",
                    help="with --quantization fp8, the LM head as e4m3 too (the server's setting)")
    ap.add_argument("--dtype", default="auto", help=dtype_help)


def weight_settings(args) -> dict:
    """EngineConfig's fields from add_weight_flags' flags."""
    return {"quantization": args.quantization, "fp8_accumulation": args.fp8_accumulation,
            "quantize_lm_head": args.quantize_lm_head, "dtype": args.dtype}


def build_engine(settings: list[Setting], config):
    """The engine for `config` with the settings applied first: EngineProcess's `build` (the
    engine's process applies them; pass it through functools.partial)."""
    from engine import Engine
    apply(settings)
    return Engine(config)

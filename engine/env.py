"""The one module that reads environment variables (DESIGN.md: config flows one way).

Everything else receives these values as arguments or through the frozen configs.
"""

from __future__ import annotations

import os
from pathlib import Path

# name -> what it sets (documented in README and config.yaml)
ENV_VARS = {
    "CUSERVE_CACHE": "folder for downloaded models and compiled kernels (default ~/.cache/cuserve)",
    "CC": "C compiler for the CPU runner's kernels (default: cc, gcc or clang on PATH)",
}


def cache_dir() -> Path:
    value = os.environ.get("CUSERVE_CACHE")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "cuserve"


def c_compiler() -> str | None:
    return os.environ.get("CC") or None


def prefixed(prefix: str = "CUSERVE_") -> dict[str, str]:
    """All variables starting with `prefix`, prefix removed and lower-cased."""
    return {k[len(prefix):].lower(): v for k, v in os.environ.items() if k.startswith(prefix)}

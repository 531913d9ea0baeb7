"""DESIGN.md's import contracts, checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            prefix = "." * node.level
            names.add(prefix + (node.module or ""))
    return names


def test_pure_python_core_has_no_arrays():
    for name in ("scheduler.py", "kv_cache.py", "request.py", "outputs.py"):
        mods = imported_modules(ROOT / "engine" / name)
        assert not any(m.split(".")[0] in ("numpy", "cupy") for m in mods), (name, mods)
        assert not any(m.lstrip(".").startswith("runner") for m in mods), (name, mods)


def test_engine_never_imports_server():
    for path in (ROOT / "engine").rglob("*.py"):
        mods = imported_modules(path)
        assert not any(m == "server" or m.startswith("server.") or m.startswith("..server") for m in mods), path


def test_environment_is_read_in_one_module():
    readers = []
    for package in ("engine", "server"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            if "os.environ" in text or "os.getenv" in text:
                readers.append(path.relative_to(ROOT).as_posix())
    assert readers == ["engine/env.py"], readers

"""Regenerate config.yaml and the README's settings table from server/settings.py.

    python tools/gen_docs.py          # rewrite both
    python tools/gen_docs.py --check  # exit 1 if either is stale (the tests run this)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server.settings import ENV_PREFIX, SETTINGS, config_yaml  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"


def settings_table() -> str:
    rows = ["| setting (config.yaml) | flag | environment | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for name, f in SETTINGS.items():
        default = "—" if f.default is None else f"`{f.default}`"
        rows.append(f"| `{name}` | `--{name.replace('_', '-')}` | `{ENV_PREFIX}{name.upper()}` | {default} | "
                    f"{f.metadata['help']} |")
    return "\n".join(rows)


def readme_text(current: str) -> str:
    head, rest = current.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{settings_table()}\n{END}{tail}"


def main() -> int:
    check = "--check" in sys.argv
    targets = {ROOT / "config.yaml": config_yaml(),
               ROOT / "README.md": readme_text((ROOT / "README.md").read_text(encoding="utf-8"))}
    stale = [p.name for p, text in targets.items() if p.read_text(encoding="utf-8") != text]
    if check:
        if stale:
            print(f"stale: {', '.join(stale)} (run python tools/gen_docs.py)")
        return 1 if stale else 0
    for path, text in targets.items():
        path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`cuserve` command line: download the default model, serve the API."""

from __future__ import annotations

import argparse
import sys


def _download(args: argparse.Namespace) -> int:
    from engine.env import cache_dir
    from engine.loader import DEFAULT_MODEL, resolve_model_path

    model = args.model or DEFAULT_MODEL
    try:
        path = resolve_model_path(model, cache_dir())
    except (FileNotFoundError, RuntimeError) as exc:
        print(f"cuserve download: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cuserve", description="OpenAI-compatible LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    download = sub.add_parser("download", help="fetch a known model into the cache folder ($CUSERVE_CACHE)")
    download.add_argument("--model", help="known model name (default: SmolLM2-135M-Instruct)")
    download.set_defaults(func=_download)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

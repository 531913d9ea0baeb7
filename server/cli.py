"""`cuserve` command line: serve the API, download the default model."""

from __future__ import annotations

import argparse
import logging
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


def _serve(args: argparse.Namespace) -> int:
    from .launch import serve
    from .settings import resolve_settings

    try:
        settings = resolve_settings(args)
    except (ValueError, OSError) as exc:
        print(f"cuserve serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(settings)


def build_parser() -> argparse.ArgumentParser:
    from .settings import add_cli_flags

    parser = argparse.ArgumentParser(prog="cuserve", description="OpenAI-compatible LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI API (default model: SmolLM2-135M-Instruct)")
    add_cli_flags(serve)
    serve.set_defaults(func=_serve)
    download = sub.add_parser("download", help="fetch a known model into the cache folder ($CUSERVE_CACHE)")
    download.add_argument("--model", help="known model name (default: SmolLM2-135M-Instruct)")
    download.set_defaults(func=_download)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

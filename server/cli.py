"""`cuserve` command line: serve the API, download the default model."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading


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
    import uvicorn

    from .app import create_app
    from .settings import resolve_settings

    try:
        settings = resolve_settings(args)
    except (ValueError, OSError) as exc:
        print(f"cuserve serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fatal: list[str] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGTERM/SIGINT: /health turns 503 at once
            app.state.cuserve.draining = True
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's, without re-raising the signal once the drain is done: a shutdown
            that let every request finish exits 0 (orchestrators read a signal as a crash)."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    def on_fatal(message: str) -> None:
        fatal.append(message)
        server.should_exit = True

    from engine.engine import quiet_collector

    # the server keeps its model for life: full collections once a minute, not every few seconds
    app = create_app(settings, on_fatal=on_fatal, on_ready=quiet_collector)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=int(settings.shutdown_timeout), access_log=False,
                            timeout_keep_alive=settings.keep_alive_timeout,
                            loop=_loop_impl(), http=_http_impl())
    server = Server(config)
    server.run()
    if fatal:
        print(f"cuserve serve: {fatal[0]}", file=sys.stderr)
        return 1
    return 0


def _loop_impl() -> str:
    try:
        import uvloop  # noqa: F401
        return "uvloop"
    except ImportError:
        return "asyncio"


def _http_impl() -> str:
    try:
        import httptools  # noqa: F401
        return "httptools"
    except ImportError:
        return "h11"


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

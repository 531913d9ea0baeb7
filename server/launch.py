"""How `cuserve serve` runs: uvicorn, draining on SIGTERM/SIGINT, and with --api-server-count N
N HTTP processes on one port.

One event loop does a stream's HTTP work (parsing, tokenizing, JSON, SSE writes). Under
hundreds of streams that loop runs at ~97 % of a core in decode-only steps (H200, 8B fp8, 256
streams: ~33k SSE events a second; forty-third session), and a request's first token, its last,
and new requests wait behind the stream of tokens. With N > 1 this process also starts N - 1
HTTP processes (`ApiServers`) once the engine process is up. Each has its own loop, its own link
to the one engine process (`EngineClient`), its row of the shared metrics table, and its own
listening socket on the port (SO_REUSEPORT), so the kernel spreads new connections evenly over
the processes by their addresses. (One socket shared by all would not: a loop that wakes for a
burst of connections accepts them all, and a load's keep-alive connections stay where they
landed.) Until the others start, while the model loads, this process's socket is the only one.
This process owns the others: it tells them to drain when it is told to (a signal to the whole
group is not relied on), waits for them before it stops the engine, and logs one that dies
(the rest go on serving; its streams end with their connections).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection, wait

import uvicorn

from .settings import ServeSettings

log = logging.getLogger("cuserve.server")
# how often an extra HTTP process looks for this one's orders (drain, force) and for its death
WATCH_INTERVAL_S = 0.1
START_TIMEOUT_S = 120.0  # for an extra HTTP process to accept connections, once the engine is up


class Server(uvicorn.Server):
    """uvicorn's server with the drain the API promises: on the first SIGTERM/SIGINT /health turns
    503 at once and requests in flight finish; a second SIGINT stops at once. `on_exit(force)` runs
    on each (this process's hook to pass the order on to its other HTTP processes). With `signals`
    False it takes none (an extra HTTP process, which its owner stops). `on_started()` runs once
    it accepts connections."""

    def __init__(self, config: uvicorn.Config, app, on_exit=None, signals: bool = True, on_started=None) -> None:
        super().__init__(config)
        self.app, self.on_exit, self.signals, self.on_started = app, on_exit, signals, on_started

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.on_started is not None and self.started:
            self.on_started()

    def handle_exit(self, sig, frame) -> None:
        self.app.state.cuserve.draining = True
        super().handle_exit(sig, frame)
        if self.on_exit is not None:
            self.on_exit(self.force_exit)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, without re-raising the signal once the drain is done: a shutdown
        that let every request finish exits 0 (orchestrators read a signal as a crash)."""
        if not self.signals or threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def uvicorn_config(app, settings: ServeSettings) -> uvicorn.Config:
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                          timeout_graceful_shutdown=int(settings.shutdown_timeout), access_log=False,
                          timeout_keep_alive=settings.keep_alive_timeout, loop=_loop_impl(), http=_http_impl())


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


def serve(settings: ServeSettings) -> int:
    """Run the server until a signal drains it; the exit status."""
    from engine.engine import quiet_collector

    from .app import create_app

    fatal: list[str] = []

    def on_fatal(message: str) -> None:
        fatal.append(message)
        server.should_exit = True

    api_servers = ApiServers(settings) if settings.api_servers_at_most() > 1 else None
    # the server keeps its model for life: full collections once a minute, not every few seconds
    app = create_app(settings, on_fatal=on_fatal, on_ready=quiet_collector, api_servers=api_servers)
    config = uvicorn_config(app, settings)
    server = Server(config, app, on_exit=api_servers.order_exit if api_servers is not None else None)
    if api_servers is None:
        server.run()
    else:
        try:  # before the model loads: a port in use fails at once
            sock = listen_socket(settings.host, settings.port, check_free=True)
        except OSError as exc:
            print(f"cuserve serve: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
            return 1
        log.info("listening on http://%s:%d; more HTTP processes join once the model is up", settings.host,
                 settings.port)
        try:
            server.run(sockets=[sock])
        finally:
            api_servers.stop(0.0)  # a no-op after a drain; after a forced exit it stops them now
    if fatal:
        print(f"cuserve serve: {fatal[0]}", file=sys.stderr)
        return 1
    return 0


def listen_socket(host: str, port: int, check_free: bool = False) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEPORT, which the other HTTP processes' sockets
    join. `check_free`: first bind a plain socket there, so that a port another server listens on
    (even one with SO_REUSEPORT, which would otherwise take this one in) fails here."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("api_server_count > 1 needs SO_REUSEPORT (Linux)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if check_free:
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    sock = socket.socket(family)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class ApiServers:
    """The HTTP processes beyond this one (settings.api_servers(device) - 1). `start(engine)`, once the
    engine process is up, spawns them with its spare links; `order_exit` passes a drain (or a
    forced stop) on; `stop` waits for them (killing any left at the deadline)."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.metrics_table = None  # the app's shared Metrics table (Metrics.shared), set by create_app
        ctx = multiprocessing.get_context("spawn")
        self._ctx = ctx
        self._open, self._drain, self._force = ctx.Event(), ctx.Event(), ctx.Event()
        self.procs: list[multiprocessing.process.BaseProcess] = []

    def start(self, engine) -> None:
        """Spawn settings.api_servers(engine.device) - 1 processes, each with one of
        `engine.spare_links` (the rest are closed), then watch them."""
        if self.metrics_table is None:
            raise RuntimeError("ApiServers.start needs the app's metrics table")
        count = self.settings.api_servers(engine.device)
        for link in engine.spare_links[count - 1:]:  # the engine process closes these links too
            link.close()
        log.info("HTTP processes on http://%s:%d: %d", self.settings.host, self.settings.port, count)
        level = logging.getLogger().getEffectiveLevel()
        started = []
        for index, link in enumerate(engine.spare_links[:count - 1], start=1):
            ready = self._ctx.Event()
            proc = self._ctx.Process(target=_api_server_main, name=f"cuserve-http-{index}", daemon=True,
                                     args=(self.settings, link, engine.info, engine.config, self.metrics_table,
                                           index, ready, self._open, self._drain, self._force, level))
            proc.start()
            link.close()  # the child has its copy; the engine process sees EOF only when that one closes
            self.procs.append(proc)
            started.append(ready)
        engine.spare_links = []
        # ready (`open`) only once every process accepts connections: a load's first connections (kept
        # alive for all of it) would otherwise all land on the processes that were up
        deadline = time.monotonic() + START_TIMEOUT_S
        for proc, ready in zip(self.procs, started):
            while not ready.wait(WATCH_INTERVAL_S):
                if not proc.is_alive() or time.monotonic() > deadline:
                    self.stop(0.0)
                    raise RuntimeError(f"HTTP process {proc.name} did not start (exit code {proc.exitcode})")
        threading.Thread(target=self._watch, name="cuserve-http-watch", daemon=True).start()

    def open(self) -> None:
        """All are up and this process serves: the others may serve too (they answer 503 till then,
        so that a 200 from /health means every process accepts and serves)."""
        self._open.set()

    def order_exit(self, force: bool) -> None:
        """This process was told to stop: the others drain too (force: stop at once)."""
        self._drain.set()
        if force:
            self._force.set()

    def stop(self, timeout: float) -> None:
        """Drain the others (if not yet ordered), wait up to `timeout` s, then kill what is left."""
        self.order_exit(False)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                log.warning("HTTP process %s did not stop in time; killing it", proc.name)
                proc.kill()
                proc.join(5)

    def _watch(self) -> None:
        procs = {proc.sentinel: proc for proc in self.procs}
        while procs:
            for sentinel in wait(list(procs)):
                proc = procs.pop(sentinel)
                if not self._drain.is_set():  # not one this process told to stop
                    log.error("HTTP process %s exited (code %s); the other %d serve on", proc.name, proc.exitcode,
                              len(procs) + 1)


def _api_server_main(settings: ServeSettings, link: Connection, info: dict, config, metrics_table, index: int,
                     ready, gate, drain, force, log_level: int) -> None:
    """An extra HTTP process: the app over an EngineClient, on a socket of its own on the port. It
    ignores signals (its owner passes orders on, so that a signal to the whole group counts once)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.engine import quiet_collector
    from engine.engine_process import EngineClient

    from .app import create_app
    from .metrics import Metrics

    engine = EngineClient(link, info, config)
    engine.start()
    app = create_app(settings, engine=engine, metrics=Metrics(shared=metrics_table, process=index))
    app.state.cuserve.gate = gate
    quiet_collector()
    try:
        sock = listen_socket(settings.host, settings.port)
    except OSError as exc:
        log.error("HTTP process %d cannot listen on %s:%d: %s", index, settings.host, settings.port, exc)
        engine.shutdown()
        sys.exit(1)
    server = Server(uvicorn_config(app, settings), app, signals=False, on_started=ready.set)
    owner = multiprocessing.parent_process()

    def watch() -> None:
        while not force.is_set():
            if drain.is_set() and not server.should_exit:
                app.state.cuserve.draining = True
                server.should_exit = True
            if wait([owner.sentinel], WATCH_INTERVAL_S):
                log.error("the server's first process is gone; HTTP process %d stops", index)
                break
        app.state.cuserve.draining = True
        server.should_exit = server.force_exit = True

    threading.Thread(target=watch, name="cuserve-http-orders", daemon=True).start()
    server.run(sockets=[sock])

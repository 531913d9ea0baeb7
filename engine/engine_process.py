"""The engine in a process of its own: the server's default.

In one process, the engine thread (scheduling, launching steps, detokenizing) and the
server's event loop (HTTP, JSON, SSE) share one GIL; under hundreds of streams the event
loop's work a token delays the engine's next step, and the GPU waits. `EngineProcess`
runs the `Engine` in a child process (spawned: CUDA is only ever touched there) and gives
the server the same `EngineAPI` in this one.

The child serves one or more links (multiprocessing Pipes, pickled tuples): link 0 belongs to
the process that spawned it (`EngineProcess`), each other one to an `EngineClient` in another
process (the server's extra HTTP processes, `--api-server-count`). A link's client -> the child:
    ("add", request_id, prompt_token_ids, params, arrival)
    ("abort", request_id)
    ("call", fn, args)   -> ("result", ok, value): fn(engine, *args) run in the child
    ("close",)           the child aborts what this link added and closes its end
    ("shutdown",)        link 0 only: the engine stops and the child ends
the child -> a client:
    ("ready", info) once on link 0, or ("failed", message) if the engine could not be built
    ("step", outputs, events, stats, gauges, dead): one engine step's outputs for the requests
        that this link added (packed, without their prompt ids: the client has them), the
        observer calls the step made (link 0 only), the counters and gauges after it, and why
        the engine stopped (a string) or None. Every open link gets one each step that has outputs.
    ("result", ok, value)
A closed link's requests are aborted; the child ends when link 0 closes or says "shutdown".
Outputs and events reach a client's consumers on its one reader thread, once per step.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import signal
import threading
import time
import traceback
import uuid
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from .config import EngineConfig
from .engine import (BatchSink, CompletionOutput, Engine, EngineAPI, EngineDeadError, EngineGauges, EngineObserver,
                     EngineStats, LoopSink, RequestOutput, Sink, deliver, flush_sinks, freeze_long_lived)
from .request import Request, RequestTimings, SamplingParams
from .scheduler import QueueFullError

log = logging.getLogger("cuserve.engine")

# an output on the wire: (request_id, pieces, finished, prompt_logprobs, num_generated_tokens,
# timings, error, error_kind), each piece (index, text, token_ids, logprobs, finish_reason, stop_reason)
Packed = tuple


def _pack(out: RequestOutput) -> Packed:
    pieces = [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) for c in out.outputs]
    return (out.request_id, pieces, out.finished, out.prompt_logprobs, out.num_generated_tokens, out.timings,
            out.error, out.error_kind)


def _unpack(packed: Packed, prompt_token_ids: list[int]) -> RequestOutput:
    request_id, pieces, finished, prompt_logprobs, generated, timings, error, error_kind = packed
    return RequestOutput(request_id, prompt_token_ids, [CompletionOutput(*p) for p in pieces], finished,
                         prompt_logprobs, generated, timings, error, error_kind)


class EngineClient(EngineAPI):
    """The `EngineAPI` of an engine process reached over one link (`conn`): what another
    process holds (an extra HTTP server, given one of `EngineProcess.spare_links` and its
    `info`). `shutdown` closes the link (the child aborts what this client added), not the
    engine. If the link breaks, every request in flight here gets an error output and `dead` is set."""

    def __init__(self, conn: Connection, info: dict, config: EngineConfig) -> None:
        self.config = config
        self._conn = conn
        self.info = info
        self.model_config = info["model_config"]
        self.tokenizer = info["tokenizer"]
        self.generation_defaults = info["generation_defaults"]
        self.max_model_len = info["max_model_len"]
        self.device = info["device"]
        self.stats = EngineStats()
        self._gauges = EngineGauges()
        self.observer = EngineObserver()
        self.dead: BaseException | None = None
        self._send_lock = threading.Lock()
        self._calls = threading.Lock()  # one call() at a time
        self._results: queue.Queue = queue.Queue()
        # request id -> (its consumer, its prompt ids), until its last output
        self._requests: dict[str, tuple[Sink, list[int]]] = {}
        self._loop_sinks: dict[asyncio.AbstractEventLoop, LoopSink] = {}
        self._stopping = False
        self._reader: threading.Thread | None = None

    # ------------------------------------------------------------------ api

    def start(self) -> None:
        """Start delivering the child's outputs (its engine runs from the start)."""
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, name="cuserve-engine-reader", daemon=True)
            self._reader.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Close this link: the child aborts the requests it added (which fail here) and closes
        its end, which ends the reader."""
        self._stopping = True
        try:
            self._send(("close",))
        except (OSError, EngineDeadError):
            pass
        self._close(timeout)

    def _close(self, timeout: float) -> None:
        if self._reader is not None:  # it ends when the child closes its end (a close here would not wake it)
            self._reader.join(timeout)
            self._reader = None
        self._conn.close()
        if self.dead is None:
            self.dead = EngineDeadError("this server process closed its link to the engine")
        self._fail_requests("the server is shutting down")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, sink: Sink,
                    request_id: str | None = None, arrival: float | None = None) -> str:
        """Queue a request. Raises ValueError at once; a full queue (QueueFullError in the
        engine) comes back as the request's one output, with error_kind "overloaded"."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        self.check_request(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        self._requests[request_id] = (sink, prompt_token_ids)
        try:
            arrival = arrival if arrival is not None else time.monotonic()
            self._send(("add", request_id, prompt_token_ids, params, arrival))
        except BaseException:
            self._requests.pop(request_id, None)
            raise
        return request_id

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except (OSError, EngineDeadError):
            pass  # the child is gone: the reader fails the request

    def gauges(self) -> EngineGauges:
        return self._gauges

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> Any:
        """fn(engine, *args) in the child (fn and args picklable: fn a module-level function);
        returns its result or raises RuntimeError with the child's exception."""
        with self._calls:
            self._send(("call", fn, args))
            ok, value = self._results.get(timeout=timeout)
        if not ok:
            raise RuntimeError(value)
        return value

    # ------------------------------------------------------------------ internals

    def _send(self, message: tuple) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            try:
                if message[0] == "step":
                    self._on_step(*message[1:])
                elif message[0] == "result":
                    self._results.put(message[1:])
            except Exception:  # noqa: BLE001 - a consumer's fault must not stop the others' outputs
                log.exception("delivering the engine's outputs failed")
        if not self._stopping:
            self._die(self._lost())

    def _lost(self) -> str:
        """Why the link broke, as the requests' errors say it."""
        return "the engine process closed its link to this server process"

    def _on_step(self, outputs: list[Packed], events: list[tuple], stats: EngineStats, gauges: EngineGauges,
                 dead: str | None) -> None:
        self.stats, self._gauges = stats, gauges
        for kind, value in events:
            try:
                getattr(self.observer, kind)(value)
            except Exception:  # noqa: BLE001 - metrics must not stop outputs
                log.exception("engine observer failed")
        flush: set[BatchSink] = set()
        for packed in outputs:
            request_id, finished = packed[0], packed[2]
            entry = self._requests.pop(request_id, None) if finished else self._requests.get(request_id)
            if entry is not None:
                deliver(entry[0], _unpack(packed, entry[1]), flush)
        flush_sinks(flush)
        if dead is not None:
            self._die(dead)

    def _die(self, message: str) -> None:
        """The child's engine is gone: every request still waiting gets an error output."""
        if self.dead is None:
            log.error("%s", message)
            self.dead = EngineDeadError(message)
            self._results.put((False, message))  # a call() waiting for an answer
        self._fail_requests(message)

    def _fail_requests(self, message: str) -> None:
        flush: set[BatchSink] = set()
        for request_id in list(self._requests):
            entry = self._requests.pop(request_id, None)
            if entry is not None:
                deliver(entry[0], RequestOutput(request_id, entry[1], [], finished=True, error=message,
                                                      error_kind="internal"), flush)
        flush_sinks(flush)


class EngineProcess(EngineClient):
    """An `Engine` in a spawned child process, behind the same API as an in-process one.

    The constructor returns once the child has built the engine (loaded the model, captured
    its graphs) and raises RuntimeError if that failed. `build(config)`, a picklable
    function, makes the child's engine (default: `Engine(config)`). If the child dies, every
    request in flight gets an error output and `dead` is set. With `links` > 1 the child also
    serves `links - 1` clients in other processes: `spare_links` are their ends, to be sent
    to them (as Process arguments) with `info` for their `EngineClient`."""

    def __init__(self, config: EngineConfig, build: Callable[[EngineConfig], Engine] | None = None,
                 log_level: int | None = None, links: int = 1) -> None:
        if links < 1:
            raise ValueError(f"links must be >= 1, got {links}")
        ctx = multiprocessing.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(links)]
        level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
        self._proc = ctx.Process(target=_child_main, args=(config, [child for _, child in pipes], build, level),
                                 name="cuserve-engine", daemon=True)
        self._proc.start()
        for _, child in pipes:
            child.close()
        conn = pipes[0][0]
        self.spare_links = [mine for mine, _ in pipes[1:]]
        try:
            kind, info = conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited with code {self._proc.exitcode} while starting") from None
        if kind != "ready":
            self._proc.join(10)
            raise RuntimeError(info)
        super().__init__(conn, info, config)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the child's engine and wait for the process (killed if it does not exit)."""
        self._stopping = True
        try:
            self._send(("shutdown",))
        except (OSError, EngineDeadError):
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine process did not stop in %.0f s; killing it", timeout)
            self._proc.kill()
            self._proc.join(5)
        for link in self.spare_links:
            link.close()
        self._close(timeout)

    def _lost(self) -> str:
        self._proc.join(5)
        return f"the engine process exited (code {self._proc.exitcode})"


# ---------------------------------------------------------------------- the child


class _Recorder(EngineObserver):
    """The child engine's observer: its calls, sent with the step's outputs."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def on_first_token(self, timings: RequestTimings) -> None:
        self.events.append(("on_first_token", timings))

    def on_token_gap(self, seconds: float) -> None:
        self.events.append(("on_token_gap", seconds))

    def on_finished(self, timings: RequestTimings) -> None:
        self.events.append(("on_finished", timings))


class _Links(BatchSink):
    """The consumer of every request in the child: each step's outputs split by the link whose
    client added them, one message a step on every open link (link 0 also gets the observer's
    calls). Sends come from the engine thread (steps) and the main thread (call results)."""

    def __init__(self, engine: Engine, conns: list[Connection], recorder: _Recorder) -> None:
        super().__init__()
        self.engine, self.conns, self.recorder = engine, conns, recorder
        self.open = [True] * len(conns)
        self._locks = [threading.Lock() for _ in conns]
        self.owner: dict[str, int] = {}  # request id -> the link that added it, until its last output

    def send(self, link: int, message: tuple) -> None:
        """Send on one link; a link > 0 that fails is closed (its requests aborted). Link 0's
        failure raises: the parent is gone."""
        with self._locks[link]:
            if not self.open[link]:
                return
            try:
                self.conns[link].send(message)
                return
            except (OSError, ValueError):
                if link == 0:
                    raise
        self.close(link)

    def close(self, link: int) -> None:
        """A client went away: abort what it added, and stop sending to it."""
        with self._locks[link]:
            if not self.open[link]:
                return
            self.open[link] = False
            self.conns[link].close()
        for request_id, owner in list(self.owner.items()):
            if owner == link:
                self.engine.abort(request_id)

    def _dispatch(self, batch: list[RequestOutput]) -> None:  # on the engine thread, after a step
        events, self.recorder.events = self.recorder.events, []
        self.report(batch, events)

    def report(self, outputs: list[RequestOutput], events: list[tuple[str, Any]]) -> None:
        engine, owner = self.engine, self.owner
        parts: list[list[Packed]] = [[] for _ in self.conns]
        for out in outputs:
            link = owner.pop(out.request_id, 0) if out.finished else owner.get(out.request_id, 0)
            parts[link].append(_pack(out))
        dead = None if engine.dead is None else repr(engine.dead)
        stats, gauges = engine.stats, engine.gauges()
        for link, part in enumerate(parts):
            if self.open[link]:
                self.send(link, ("step", part, events if link == 0 else [], stats, gauges, dead))


def _child_main(config: EngineConfig, conns: list[Connection], build: Callable[[EngineConfig], Engine] | None,
                log_level: int) -> None:
    # ^C in a terminal and a SIGTERM to the whole group reach this process too: the server's
    # process handles them (drains its requests), then sends "shutdown"; a parent that dies
    # without it closes link 0, which ends this process as well
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = build(config) if build is not None else Engine(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        log.error("could not build the engine:\n%s", traceback.format_exc())
        conns[0].send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    recorder = _Recorder()
    links = _Links(engine, conns, recorder)
    links.send(0, ("ready", {"model_config": engine.model_config, "tokenizer": engine.tokenizer,
                             "generation_defaults": engine.generation_defaults,
                             "max_model_len": engine.max_model_len, "device": engine.device}))
    engine.observer = recorder
    freeze_long_lived()  # this process serves this engine until it ends
    engine.start()
    try:
        while links.open[0]:
            for conn in wait([c for c, is_open in zip(conns, links.open) if is_open]):
                link = conns.index(conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # that client is gone (link 0: the parent)
                    if link == 0:
                        return
                    links.close(link)
                    continue
                if not _handle(engine, links, link, message):
                    return
    finally:
        engine.shutdown()
        for link in range(len(conns)):
            conns[link].close()


def _handle(engine: Engine, links: _Links, link: int, message: tuple) -> bool:
    """Carry out one client's message; False: stop the engine."""
    kind = message[0]
    if kind == "add":  # checked by the client (EngineClient.add_request)
        _, request_id, prompt_token_ids, params, arrival = message
        links.owner[request_id] = link
        try:
            engine.enqueue(Request(request_id, prompt_token_ids, params, arrival=arrival), links)
        except (ValueError, QueueFullError, EngineDeadError) as exc:
            error_kind = "overloaded" if isinstance(exc, QueueFullError) else (
                "invalid" if isinstance(exc, ValueError) else "internal")
            links.report([RequestOutput(request_id, [], [], finished=True, error=str(exc),
                                        error_kind=error_kind)], [])
    elif kind == "abort":
        engine.abort(message[1])
    elif kind == "call":
        try:
            result = ("result", True, message[1](engine, *message[2]))
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            result = ("result", False, f"{type(exc).__name__}: {exc}")
        links.send(link, result)
    elif kind == "close":
        links.close(link)
    elif kind == "shutdown":
        return link != 0
    return True

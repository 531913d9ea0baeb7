"""The engine: scheduler -> runner -> scheduler.update -> detokenize -> outputs.

`Engine.step()` runs one step on the caller's thread (the offline `LLM` does this);
`Engine.start()` runs steps on a thread of their own for a server, which talks to it
through the thread-safe `add_request` / `abort` and per-request async streams. The
scheduler and runner are only ever touched by the thread that steps. With a runner that
runs steps asynchronously (`submit`: the CUDA runner), a step's outputs are detokenized
and delivered while the next step runs on the device (see `_emit_deferred`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import random
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from .config import EngineConfig, ModelConfig
from .detokenize import IncrementalDetokenizer
from .kv_cache import KVCache
from .loader import LoadedModel, load_model
from .outputs import RunnerOutput, ScheduledSeq, SchedulerOutput, TokenLogprobs
from .request import FinishReason, Request, RequestTimings, SamplingParams, Sequence
from .runner import make_runner
from .scheduler import QueueFullError, Scheduler

log = logging.getLogger("cuserve.engine")
# SchedulerConfig.late_ahead waits only after steps at least this long (Engine._late_ahead)
LATE_AHEAD_MIN_STEP_S = 0.005
# ... and only while requests arrive: one came in within this many seconds (a batch submitted at
# once, as bench/decode.py and LLM.generate do, has nothing to wait for once it is in)
LATE_AHEAD_ARRIVALS_S = 1.0

_MASK64 = (1 << 64) - 1

__all__ = ["CompletionOutput", "Engine", "EngineAPI", "EngineDeadError", "EngineGauges", "QueueFullError", "RequestOutput"]


def freeze_long_lived() -> None:
    """Collect once, then put every object alive now (the model, the tokenizer's tables, the
    runner and its graphs) out of the cyclic collector's reach (gc.freeze): a full collection
    then walks only what was made since, instead of stalling the step loop (H200, 8B shape,
    bench/decode.py at 128 rows: one step of 27 ms, and of 221 ms in the first run, among
    steps of 5 ms, where the first requests of the batch finished). For a process that keeps
    one engine for its life (the engine process, a benchmark): objects frozen here that become
    cyclic garbage later are never collected."""
    gc.collect()
    gc.freeze()


# a serving process's full collections, once it is ready (quiet_collector): one this often
FULL_COLLECTION_PERIOD_S = 60.0


def quiet_collector(period_s: float = FULL_COLLECTION_PERIOD_S) -> threading.Thread:
    """For a serving process once its model is loaded: freeze_long_lived(), then take full
    collections off the allocation-driven schedule and run one every `period_s` seconds on a
    daemon thread instead (young generations keep their thresholds). Under load a server
    allocates fast, and CPython ran a full collection every ~2.5 s, each walking every live
    object with the event loop stopped: H200, 8B fp8, 256 streams over HTTP: 44-107 ms each,
    ITL p99 63-83 ms; none of 24 such collections found garbage. With this, ITL p99 was
    45-55 ms. Returns the collecting thread."""
    freeze_long_lived()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 1_000_000)  # gen-2 runs once per 10^6 gen-1 runs: never, in practice

    def collect() -> None:
        while True:
            time.sleep(period_s)
            gc.collect()

    thread = threading.Thread(target=collect, name="cuserve-gc", daemon=True)
    thread.start()
    return thread


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


@dataclass(slots=True)  # made and read for every token: slots build and read quicker
class CompletionOutput:
    """One sequence's part of a RequestOutput: a delta while streaming."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # the sequences with something new
    finished: bool = False
    prompt_logprobs: list[TokenLogprobs] | None = None  # sent once, with the first output
    num_generated_tokens: int = 0  # all sequences, so far
    timings: RequestTimings | None = None
    error: str | None = None  # the engine failed this request
    error_kind: str | None = None  # "overloaded" | "invalid" | "internal"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @staticmethod
    def merged(deltas: list[RequestOutput]) -> RequestOutput:
        """Deltas of one request, in order, as one: the last one's fields, each sequence's pieces
        joined in index order (text, token ids, logprobs; its last piece's finish and stop
        reasons), and the prompt logprobs, which come with the first delta. A stream that falls
        behind takes what waits this way: each piece joined once, built directly (not through
        dataclasses.replace, which costs several times as much)."""
        last = deltas[-1]
        pieces: dict[int, list[CompletionOutput]] = {}
        for delta in deltas:
            for c in delta.outputs:
                pieces.setdefault(c.index, []).append(c)
        outputs = []
        for index in sorted(pieces):
            cs = pieces[index]
            if len(cs) == 1:
                outputs.append(cs[0])
                continue
            logprobs = None
            if any(c.logprobs is not None for c in cs):
                logprobs = [lp for c in cs for lp in (c.logprobs or ())]
            outputs.append(CompletionOutput(index, "".join(c.text for c in cs), [t for c in cs for t in c.token_ids],
                                            logprobs, cs[-1].finish_reason, cs[-1].stop_reason))
        prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), last.prompt_logprobs)
        return RequestOutput(last.request_id, last.prompt_token_ids, outputs, last.finished, prompt_logprobs,
                             last.num_generated_tokens, last.timings, last.error, last.error_kind)

    @staticmethod
    def coalesced(batch: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs that waited together (of one or several requests) with each request's joined
        into one delta, in the order the requests first appear: a consumer that fell behind
        (hundreds of streams) serializes fewer, larger events, not later ones."""
        if len(batch) < 2:
            return batch
        groups: dict[str, list[RequestOutput]] = {}
        for out in batch:
            groups.setdefault(out.request_id, []).append(out)
        if len(groups) == len(batch):
            return batch
        return [g[0] if len(g) == 1 else RequestOutput.merged(g) for g in groups.values()]


Sink = Callable[[RequestOutput], None]


@dataclass
class _Tracked:
    request: Request
    sink: Sink
    detoks: list[IncrementalDetokenizer]
    sent_tokens: list[int]  # per sequence: output tokens already delivered
    sent_prompt_logprobs: bool = False


@dataclass
class EngineStats:
    """Counters since start (the server's /metrics reads them)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count
    steps: int = 0
    step_errors: int = 0


@dataclass
class EngineGauges:
    """The scheduler's state after a step (the server's /metrics reads them)."""

    running: int = 0  # requests with sequences in the running batch
    waiting: int = 0  # requests queued (not yet admitted) or preempted
    kv_usage: float = 0.0  # fraction of the KV cache owned by sequences
    preemptions: int = 0  # since start
    catch_up_steps: int = 0  # since start: steps given SchedulerConfig.catch_up more tokens
    roofline_fraction: float | None = None  # of the last decode step timed (CUDA runner: one in 8), else None


class EngineObserver:
    """Hooks for metrics, called on the thread that delivers outputs (no-ops here)."""

    def on_first_token(self, timings: RequestTimings) -> None:  # timings.first_token was just set
        pass

    def on_token_gap(self, seconds: float) -> None:  # time between two tokens of one sequence
        pass

    def on_finished(self, timings: RequestTimings) -> None:  # the request's timings, complete
        pass


class BatchSink:
    """A consumer of outputs that takes them one by one (`__call__`) and hands them on once
    per engine step (`flush`, which the engine calls after delivering a step's outputs)."""

    def __init__(self) -> None:
        self._pending: list[RequestOutput] = []

    def __call__(self, out: RequestOutput) -> None:
        self._pending.append(out)

    def flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        self._dispatch(batch)

    def _dispatch(self, batch: list[RequestOutput]) -> None:
        raise NotImplementedError


def flush_sinks(sinks: set[BatchSink]) -> None:
    """Flush each BatchSink that `deliver` collected, then forget them."""
    for sink in sinks:
        sink.flush()
    sinks.clear()


def deliver(sink: Sink, out: RequestOutput, flush: set[BatchSink]) -> bool:
    """Hand `out` to `sink` (a BatchSink joins `flush`, to be flushed once the step's outputs
    are all handed over); False, logged, if the consumer failed (e.g. its event loop is gone)."""
    try:
        sink(out)
        if isinstance(sink, BatchSink):
            flush.add(sink)
        return True
    except Exception:  # noqa: BLE001 - a consumer's fault is its own
        log.warning("output consumer of request %s failed", out.request_id, exc_info=True)
        return False


class OutputStream:
    """The outputs of one or more requests (a response's prompts) for one consumer in asyncio
    code. `add` queues a request in the engine; the engine's LoopSink appends each step's
    outputs on the loop's thread, and `take` returns all that waits, in order, waking the
    consumer once a step however many outputs the step brought it (an asyncio.Queue wakes its
    getter for each item). `close` aborts what has not finished and ends a waiting `take`.
    Made, used and closed on the loop's thread."""

    __slots__ = ("engine", "sink", "loop", "pending", "unfinished", "closed", "_waiter")

    def __init__(self, engine: EngineAPI) -> None:
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        sink = engine._loop_sinks.get(self.loop)
        if sink is None:
            sink = engine._loop_sinks.setdefault(self.loop, LoopSink(self.loop))
        self.sink = sink
        self.pending: list[RequestOutput] = []
        self.unfinished: set[str] = set()  # ids of requests added whose last output has not come
        self.closed = False
        self._waiter: asyncio.Future | None = None

    def add(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request (EngineAPI.add_request's errors, raised at once); returns its id."""
        request_id = request_id or uuid.uuid4().hex
        self.sink.streams[request_id] = self
        try:
            self.engine.add_request(prompt_token_ids, params, self.sink, request_id)
        except BaseException:
            self.sink.streams.pop(request_id, None)
            raise
        self.unfinished.add(request_id)
        return request_id

    @property
    def done(self) -> bool:
        """Nothing more to take: every request finished and taken, or the stream closed."""
        return self.closed or not (self.unfinished or self.pending)

    def push(self, out: RequestOutput) -> None:  # the LoopSink, on the loop's thread
        self.pending.append(out)
        if out.finished:
            self.unfinished.discard(out.request_id)
            self.sink.streams.pop(out.request_id, None)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[RequestOutput]:
        """Everything waiting, oldest first: at least one output, or [] once closed."""
        while not self.pending and not self.closed:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        outs, self.pending = self.pending, []
        return outs

    def close(self) -> None:
        """Abort every request not finished (its consumer is gone); a waiting take() returns []."""
        self.closed = True
        for request_id in self.unfinished:
            self.sink.streams.pop(request_id, None)
            self.engine.abort(request_id)
        self.unfinished.clear()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class LoopSink(BatchSink):
    """Delivers outputs to the OutputStreams of one event loop, one wake-up of the loop per
    engine step. The engine calls it (and `flush`) on its thread; `streams` (request id ->
    its stream) belongs to the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop
        self.streams: dict[str, OutputStream] = {}

    def _dispatch(self, batch: list[RequestOutput]) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._put, batch)

    def _put(self, batch: list[RequestOutput]) -> None:
        streams = self.streams
        for out in batch:
            stream = streams.get(out.request_id)
            if stream is not None:
                stream.push(out)


class EngineAPI:
    """What the server calls on an engine, whether its steps run on a thread of this process
    (`Engine`) or in a process of their own (`engine_process.EngineProcess`): both give these
    attributes (config, model_config, tokenizer, generation_defaults, max_model_len, device,
    stats, observer, dead) and add_request / abort / gauges / start / shutdown."""

    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int
    _loop_sinks: dict[asyncio.AbstractEventLoop, LoopSink]

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, sink: Sink,
                    request_id: str | None = None, arrival: float | None = None) -> str:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def call(self, fn: Callable, *args):
        """fn(engine, *args) where the engine lives (benchmarks and tests: its runner, its
        scheduler's settings) and its result."""
        raise NotImplementedError

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name or self.config.model

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request that can never run here."""
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
        params.check_vocab(vocab)
        n_prompt = len(prompt_token_ids)
        if n_prompt >= self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens, but the "
                             f"prompt has {n_prompt} tokens, which leaves no room for output")
        if params.max_tokens is not None and n_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                             f"you requested {n_prompt + params.max_tokens} tokens ({n_prompt} in the prompt, "
                             f"{params.max_tokens} for the completion). Please reduce the prompt or max_tokens.")
        if params.n > self.config.scheduler.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs ({self.config.scheduler.max_num_seqs})")

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (deltas) in asyncio code; the engine must be started.

        Closing the iterator early (a client went away) aborts the request.
        """
        stream = OutputStream(self)
        stream.add(prompt_token_ids, params, request_id)
        try:
            while not stream.done:
                for out in RequestOutput.coalesced(await stream.take()):  # one: a single request's
                    yield out
        finally:
            stream.close()  # closed early (a client went away): the request is aborted


class Engine(EngineAPI):
    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, runner=None) -> None:
        self.config = config
        self.model = model if model is not None else load_model(config.model, Path(config.cache_dir))
        if self.model.tokenizer is None:
            raise ValueError("the engine needs the model's tokenizer")
        self.tokenizer = self.model.tokenizer
        # the detokenizers' table of every token's bytes (~0.25 s for a 128k vocabulary), made
        # now rather than in the first request's time; an EngineProcess's server side gets it
        # with the tokenizer (pickled with its cached properties)
        _ = self.tokenizer.token_bytes, self.tokenizer.special_ids
        self.model_config = self.model.config
        self.runner = runner if runner is not None else make_runner(config, self.model)
        kv = KVCache(self.runner.num_kv_slots, config.cache.block_size)
        self.max_model_len = min(config.scheduler.model_len(self.model_config), kv.num_slots)
        self.scheduler = Scheduler(config.scheduler, kv, self.max_model_len,
                                   config.cache.initial_decode_slots, self.tokenizer.eos_token_ids)
        self.stats = EngineStats()
        self._rng = random.Random(config.seed)
        self._tracked: dict[str, _Tracked] = {}
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead: BaseException | None = None
        # observer of each step: (engine, what was scheduled, seconds it took)
        self.on_step: Callable[[Engine, SchedulerOutput, float], None] | None = None
        self.observer = EngineObserver()
        self._loop_sinks: dict[asyncio.AbstractEventLoop, LoopSink] = {}
        self._flush: set[BatchSink] = set()
        self._deferred: list[Sequence] = []  # sequences whose last step's outputs wait for the next step
        # a step scheduled and launched while the one before it ran: (output, finish, launched at)
        self._ahead: tuple[SchedulerOutput, Callable[[], RunnerOutput], float] | None = None
        self._last_step_end = 0.0
        self._last_step_seconds = 0.0
        self._last_arrival = -float("inf")  # perf_counter when a request last came out of the inbox
        self.schedule_ahead = True  # launch steady decode steps ahead of the previous update (_submit_ahead)

    # ------------------------------------------------------------------ api

    @property
    def generation_defaults(self):
        """The model's sampling defaults (its generation_config), for requests that omit them."""
        return self.model.generation_defaults

    @property
    def device(self) -> str:
        return self.runner.device

    def gauges(self) -> EngineGauges:
        """The scheduler's state now (read from another thread, it may be a step old)."""
        sched = self.scheduler
        running = len({seq.request.request_id for seq in list(sched.running)})
        waiting = self._pending_adds() + len(sched.waiting) + len(
            {seq.request.request_id for seq in list(sched.preempted)})
        return EngineGauges(running, waiting, sched.kv.usage, sched.num_preemptions, sched.num_catch_up_steps,
                            getattr(self.runner, "last_roofline_fraction", None))

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, sink: Sink,
                    request_id: str | None = None, arrival: float | None = None) -> str:
        """Queue a request (any thread). Raises ValueError or QueueFullError at once."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead!r}")
        self.check_request(prompt_token_ids, params)
        return self.enqueue(Request(request_id or uuid.uuid4().hex, prompt_token_ids, params, arrival=arrival), sink)

    def enqueue(self, request: Request, sink: Sink) -> str:
        """Queue a request that check_request passed (any thread); add_request without the
        check, for an engine process whose parent made it. Raises QueueFullError at once."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead!r}")
        request_id = request.request_id
        with self._wake:
            if self.scheduler.queue_full(self._pending_adds()):
                raise QueueFullError(f"server overloaded: {self.config.scheduler.max_waiting} requests "
                                     f"are already waiting")
            self._inbox.append(("add", (request, sink)))
            self._wake.notify()
        return request_id

    def _pending_adds(self) -> int:
        """Requests in the inbox not yet handed to the scheduler (a copy: other threads append)."""
        return sum(1 for kind, _ in list(self._inbox) if kind == "add")

    def abort(self, request_id: str) -> None:
        """Stop a request in whatever state it is (any thread); its sink gets a final output."""
        with self._wake:
            self._inbox.append(("abort", request_id))
            self._wake.notify()

    def call(self, fn: Callable, *args):
        """fn(engine, *args), here on the caller's thread."""
        return fn(self, *args)

    # ------------------------------------------------------------ the loop

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="cuserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def has_work(self) -> bool:
        return bool(self._inbox) or bool(self._deferred) or self._ahead is not None or self.scheduler.has_work()

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stopping and not self.has_work():
                        self._wake.wait()
                    if self._stopping:
                        return
                self.step()
        except BaseException as exc:  # a bug in the loop itself: fail everything, loudly
            log.exception("engine loop died")
            self.dead = exc
            self._fail_all(f"engine stopped: {exc!r}")
            self._flush_sinks()

    def step(self) -> list[RequestOutput]:
        """Run one step; returns (and delivers) the outputs it produced."""
        try:
            return self._step()
        finally:
            self._flush_sinks()

    def _flush_sinks(self) -> None:
        """Wake the event loops that have outputs waiting."""
        flush_sinks(self._flush)

    def _step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # scheduled and launched during the last step
            sched_out, finish, started = ahead
        else:
            if not self.scheduler.has_work():
                return outputs + self._emit_deferred()
            started = time.perf_counter()
            sched_out = self.scheduler.schedule()
            if sched_out.is_empty:
                return outputs + self._emit_deferred()
            finish = None
        try:
            if finish is None:
                finish = self._submit(sched_out)
            if self._late_ahead():  # the last step's tokens out first, then wait for this step's end
                outputs += self._emit_deferred()
                self._flush_sinks()
                self.runner.wait_near_end()
            outputs += self._submit_ahead(sched_out)
            # the previous step's tokens are detokenized and delivered while this one runs
            outputs += self._emit_deferred()
            self._flush_sinks()
            result = finish()
        except Exception:  # keep serving the others: find and fail only the requests at fault
            log.exception("runner failed on step %d; retrying its requests one by one", sched_out.step)
            self._drop_ahead()
            outputs += self._emit_deferred()
            self.stats.step_errors += 1
            result, failed = self._execute_isolated(sched_out)
            for request_id, exc in failed.items():
                outputs.append(self._fail(request_id, f"internal error while generating: {exc!r}"))
        touched = self.scheduler.update(sched_out, result)
        self.stats.steps += 1
        if self._overlap and self.has_work():
            urgent, self._deferred = self._split_urgent(touched)  # the rest once the next step is launched
            if urgent:
                outputs += self._emit(urgent)
        else:
            outputs += self._emit(touched)
        now = time.perf_counter()
        self._last_step_seconds = now - max(started, self._last_step_end)  # launched ahead: from the last end
        if self.on_step is not None:
            self.on_step(self, sched_out, self._last_step_seconds)
        self._last_step_end = now
        return outputs

    def _submit_ahead(self, prev: SchedulerOutput) -> list[RequestOutput]:
        """Launch the step after `prev` before waiting for `prev`, when the scheduler can
        tell it already (Scheduler.schedule_ahead: the decode rows of what prev samples, the
        rest of its prompts, admissions) and the runner can take input tokens from `prev`'s
        output on the device (`chain_rows`, the CUDA runner): the device then goes from one
        step to the next without waiting for the host's update and schedule.

        Requests that came in meanwhile are taken by a plain step, unless the scheduler may
        launch prompts ahead (SchedulerConfig.prompts_ahead): then they are taken in first
        (their aborts and refusals are returned) and join the step launched ahead when the
        waiting requests fill it."""
        max_rows = getattr(self.runner, "chain_rows", 0)
        if not (self.schedule_ahead and max_rows):
            return []
        if not self.scheduler.config.prompts_ahead:
            if self._inbox:
                return []
            outputs = []
        else:
            outputs = self._drain_inbox()
        nxt = self.scheduler.schedule_ahead(prev, max_rows)
        if nxt is None:
            return outputs
        try:
            self._ahead = (nxt, self.runner.submit(nxt), time.perf_counter())
        except Exception:  # noqa: BLE001 - not launched: a plain step takes its rows (the scheduler
            # counts a row only at update; requests it admitted stay admitted, nothing computed)
            log.exception("could not launch step %d ahead; scheduling it after step %d", nxt.step, prev.step)
        return outputs

    def _drop_ahead(self) -> None:
        """Forget a step launched ahead of one that failed (after it has run: its device
        buffers are reused). The scheduler never counted it, so its rows run again."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            try:
                ahead[1]()
            except Exception:  # noqa: BLE001 - it ran on the failed step's outputs
                log.warning("dropped the step launched ahead of step %d", ahead[0].step - 1, exc_info=True)

    def _late_ahead(self) -> bool:
        """Whether to wait for the step in flight to near its end before launching the next
        one ahead (SchedulerConfig.late_ahead): a step launched ahead is fixed when launched,
        so launching it late lets the requests that arrive meanwhile join it, and takes the
        time from a request's arrival to its step's start from up to two steps to at most one
        (H200, 8B fp8 over HTTP, 256 streams: the client's TTFT p50 ~123 -> ~96-102 ms, on by
        default since the fifty-second session; the forty-third, before one SSE write a stream a
        step, saw only the mode move). Only with a runner
        that marks that point (wait_near_end), after a step of LATE_AHEAD_MIN_STEP_S or more
        (the last quarter of a shorter one would not cover the next launch), and while requests arrive
        (LATE_AHEAD_ARRIVALS_S): otherwise no one could join the step, and waiting would only
        risk the device idling while the host launches it."""
        return (self.scheduler.config.late_ahead and self._last_step_seconds >= LATE_AHEAD_MIN_STEP_S
                and time.perf_counter() - self._last_arrival <= LATE_AHEAD_ARRIVALS_S
                and callable(getattr(self.runner, "wait_near_end", None)))

    @property
    def _overlap(self) -> bool:
        """An asynchronous runner (`submit`): each step's outputs are emitted during the next step."""
        return callable(getattr(self.runner, "submit", None))

    def _submit(self, out: SchedulerOutput) -> Callable[[], RunnerOutput]:
        """Start a step; the returned function waits for its output. A runner with `submit`
        returns before its device finishes (the CUDA runner); others run the step here."""
        if self._overlap:
            return self.runner.submit(out)
        result = self.runner.execute(out)
        return lambda: result

    @staticmethod
    def _split_urgent(touched: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """The sequences of requests whose output should not wait for the next step's
        launch (a mixed step's launch takes the host ~15 ms for an 8B model), and the others.
        Urgent: a request's first token (its time to first token) and its end (under a fixed
        concurrency its client's next request, which then has a better chance to join the next
        step). A handful a step, so the device waits little for them; a step's other tokens
        are emitted while the next step runs."""
        urgent: list[Sequence] = []
        rest: list[Sequence] = []
        for seq in touched:
            request = seq.request
            (urgent if request.timings.first_token is None or request.is_finished else rest).append(seq)
        return urgent, rest

    def _emit_deferred(self) -> list[RequestOutput]:
        """Emit the tokens of the last step, when that step left them for the next one.

        With an asynchronous runner, a step's outputs (detokenization, stop strings, delivery)
        are handled while the next step runs on the device, so the device does not wait for
        the host's per-token work. The next step was scheduled before a stop string could be
        seen: a sequence that stops on one has a token computed in that step which is dropped
        (update skips finished sequences), and its KV slots, freed here, are taken again only
        by a later schedule, after that step has finished."""
        touched, self._deferred = self._deferred, []
        return self._emit(touched) if touched else []

    # ------------------------------------------------------------ internals

    def _execute_isolated(self, out: SchedulerOutput) -> tuple[RunnerOutput, dict[str, Exception]]:
        """Run a failed step again, one request at a time.

        Safe to repeat: a retry writes the same K/V into the same slots (positions the
        scheduler has not yet counted as computed), and the KV copies, which only read
        and write counted positions, give the same result when replayed in order.
        """
        groups: dict[str, list[ScheduledSeq]] = {}
        for row in out.seqs:
            seq = self.scheduler.get_seq(row.seq_id)
            if seq is None:
                continue
            if row.pending_tokens:  # its input is the token the step before produced, now in the sequence
                row = dataclasses.replace(row, token_ids=seq.output_token_ids[-1:], pending_tokens=0)
            groups.setdefault(seq.request.request_id, []).append(row)
        merged, failed = RunnerOutput(), {}
        copies = out.kv_copies
        for request_id, rows in groups.items():
            try:
                part = self.runner.execute(SchedulerOutput(rows, kv_copies=copies, step=out.step))
                copies = []
            except Exception as exc:  # noqa: BLE001 - this request is the one at fault
                failed[request_id] = exc
                continue
            merged.sampled.update(part.sampled)
            merged.logprobs.update(part.logprobs)
            merged.prompt_logprobs.update(part.prompt_logprobs)
        return merged, failed

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                self._last_arrival = time.perf_counter()
                request, sink = item
                request.timings.received = time.monotonic()
                try:
                    self.scheduler.add_request(request, self._rng_seeds(request.params))
                except (ValueError, QueueFullError) as exc:
                    kind = "overloaded" if isinstance(exc, QueueFullError) else "invalid"
                    out = RequestOutput(request.request_id, request.prompt_token_ids, [], finished=True,
                                        error=str(exc), error_kind=kind)
                    self._deliver(_Tracked(request, sink, [], []), out)
                    outputs.append(out)
                    continue
                self._tracked[request.request_id] = self._track(request, sink)
                self.stats.prompt_tokens += request.num_prompt_tokens
            else:
                request = self.scheduler.abort(item)
                if request is not None:
                    outputs += self._emit([s for s in request.seqs])
        return outputs

    def _rng_seeds(self, params: SamplingParams) -> list[int]:
        if params.seed is None:
            return [self._rng.getrandbits(64) for _ in range(params.n)]
        base = (params.seed * 0x9E3779B97F4A7C15) & _MASK64
        return [(base + i) & _MASK64 for i in range(params.n)]

    def _track(self, request: Request, sink: Sink) -> _Tracked:
        p = request.params
        detoks = [IncrementalDetokenizer(self.tokenizer.token_bytes, self.tokenizer.special_ids, p.stop,
                                         p.skip_special_tokens, p.include_stop_str_in_output)
                  for _ in range(p.n)]
        return _Tracked(request, sink, detoks, [0] * p.n)

    def _emit(self, touched: list[Sequence]) -> list[RequestOutput]:
        """Detokenize what the touched sequences got and deliver one output per request."""
        now = time.monotonic()
        by_request: dict[str, list[Sequence]] = {}
        for seq in touched:
            by_request.setdefault(seq.request.request_id, []).append(seq)
        outputs = []
        for request_id, seqs in by_request.items():
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            request = tracked.request
            pieces = []
            for seq in seqs:
                new = seq.output_token_ids[tracked.sent_tokens[seq.index]:]
                detok = tracked.detoks[seq.index]
                delta = detok.push(new)
                if delta.stop is not None and not seq.is_finished:
                    self.scheduler.finish(seq, FinishReason.STOP, delta.stop)
                text = delta.text + (detok.flush() if seq.is_finished else "")
                lps = None
                if request.params.logprobs is not None:
                    lps = seq.output_logprobs[tracked.sent_tokens[seq.index]:]
                tracked.sent_tokens[seq.index] = len(seq.output_token_ids)
                self.stats.generation_tokens += len(new)
                if new:
                    if request.timings.first_token is None:
                        request.timings.first_token = now
                        self.observer.on_first_token(request.timings)
                    elif request.params.n == 1:
                        self.observer.on_token_gap(now - request.timings.last_token)
                    request.timings.last_token = now
                reason = seq.finish_reason.value if seq.finish_reason is not None else None
                pieces.append(CompletionOutput(seq.index, text, list(new), lps, reason, seq.stop_reason))
            out = RequestOutput(request_id, request.prompt_token_ids, pieces,
                                num_generated_tokens=request.num_generated_tokens)
            if request.params.prompt_logprobs is not None and not tracked.sent_prompt_logprobs:
                out.prompt_logprobs = list(request.prompt_logprobs)
                tracked.sent_prompt_logprobs = True
            if request.is_finished:
                out.finished = True
                request.timings.finished = now
                out.timings = request.timings
                del self._tracked[request_id]
                for seq in request.seqs:
                    key = seq.finish_reason.value
                    self.stats.requests_finished[key] = self.stats.requests_finished.get(key, 0) + 1
                self.observer.on_finished(request.timings)
            self._deliver(tracked, out)
            outputs.append(out)
        return outputs

    def _deliver(self, tracked: _Tracked, out: RequestOutput) -> None:
        """Hand an output to its consumer; a consumer that fails is dropped, never the engine."""
        if not deliver(tracked.sink, out, self._flush) and not out.finished:
            self.abort(out.request_id)

    def _fail(self, request_id: str, message: str) -> RequestOutput:
        request = self.scheduler.abort(request_id)
        tracked = self._tracked.pop(request_id, None)
        prompt = request.prompt_token_ids if request is not None else []
        out = RequestOutput(request_id, prompt, [], finished=True, error=message, error_kind="internal")
        if tracked is not None:
            self._deliver(tracked, out)
        return out

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._tracked):
            try:
                self._fail(request_id, message)
            except Exception:  # noqa: BLE001 - best effort while dying
                log.exception("could not fail request %s", request_id)

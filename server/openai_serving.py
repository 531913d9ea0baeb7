"""OpenAI completions and chat completions on top of the engine's async streams."""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.engine import EngineDeadError, RequestOutput
from engine.loader.tokenizer import ChatTemplateError
from engine.outputs import TokenLogprobs
from engine.request import SamplingParams
from engine.scheduler import QueueFullError

from .errors import APIError, sse_error
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

if TYPE_CHECKING:
    from .app import ServerState

_DONE = "data: [DONE]\n\n"


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # one, not one a call (json.dumps)
# Characters that JSON leaves raw (ensure_ascii=False) but that line readers split on (Python's
# str.splitlines, hence httpx's aiter_lines): escaped, an SSE data line stays one line for them.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _json(obj: Any) -> str:
    text = _ENCODER.encode(obj)
    # translate() walks every character (~3.4 us for a 95-character event); three searches cost
    # ~0.2 us, and such characters are rare
    if "\x85" in text or "\u2028" in text or "\u2029" in text:
        return text.translate(_LINE_BREAKS)
    return text


class _Events:
    """The SSE events of one streamed response: its envelope (id, object, created, model) is
    serialized once; an event serializes only what it adds (choices, usage)."""

    def __init__(self, **envelope: Any) -> None:
        self._head = "data: " + _json(envelope)[:-1] + ","

    def __call__(self, **fields: Any) -> str:
        return self._head + _json(fields)[1:] + "\n\n"


# --------------------------------------------------------------------------- per-choice state


@dataclass
class Choice:
    """What one (prompt, sequence) pair has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class PromptRun:
    """One prompt sent to the engine (a request with n sequences)."""

    prompt_index: int
    prompt_ids: list[int]
    prompt_text: str
    choices: list[Choice]
    prompt_logprobs: list[TokenLogprobs] | None = None


class TokenText:
    """Token ids -> the strings the logprob objects show (OpenAI's 'bytes:\\x..' for
    tokens that are not whole UTF-8 characters)."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.token_bytes = token_bytes

    def text(self, token_id: int) -> str:
        raw = self.token_bytes[token_id]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def offsets(self, token_ids: list[int], start: int) -> tuple[list[int], int]:
        """Character offset of each token in the text they decode to, from `start`;
        and the offset after the last one."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out, pos = [], start
        for t in token_ids:
            out.append(pos)
            pos += len(decoder.decode(self.token_bytes[t]))
        return out, pos


# --------------------------------------------------------------------------- serving


class OpenAIServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    # ------------------------------------------------------------------ helpers

    @property
    def engine(self):
        return self.state.require_engine()

    def check_model(self, name: str | None) -> None:
        if name and name not in self.state.model_names:
            raise APIError(404, f"The model `{name}` does not exist (served: {self.state.settings.model_name}).",
                           param="model", code="model_not_found")

    def sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        defaults = self.engine.generation_defaults

        def pick(value, default, fallback):
            return value if value is not None else (default if default is not None else fallback)

        top_k = pick(req.top_k, defaults.top_k, None)
        if top_k is not None and top_k <= 0:  # vLLM: 0 or -1 = all tokens
            top_k = None
        try:
            return SamplingParams(
                n=req.n, max_tokens=max_tokens,
                temperature=pick(req.temperature, defaults.temperature, 1.0),
                top_p=pick(req.top_p, defaults.top_p, 1.0), top_k=top_k, min_p=req.min_p or 0.0,
                seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=pick(req.repetition_penalty, defaults.repetition_penalty, 1.0),
                logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
                stop=req.stop if req.stop is not None else (), stop_token_ids=req.stop_token_ids or (),
                ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None

    def _check(self, prompt_ids: list[int], params: SamplingParams, param: str) -> None:
        try:
            self.engine.check_request(prompt_ids, params)
        except ValueError as exc:
            code = "context_length_exceeded" if "context length" in str(exc) else None
            raise APIError(400, str(exc), param=param, code=code) from None

    async def _stream_prompt(self, run: PromptRun, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        try:
            async for out in self.engine.generate(run.prompt_ids, params):
                yield out
        except QueueFullError as exc:
            raise APIError(503, str(exc), code="overloaded",
                           headers={"Retry-After": str(self.state.settings.retry_after)}) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def raise_for_error(self, out: RequestOutput) -> None:
        if out.error is None:
            return
        if out.error_kind == "overloaded":
            raise APIError(503, out.error, code="overloaded",
                           headers={"Retry-After": str(self.state.settings.retry_after)})
        if out.error_kind == "invalid":
            raise APIError(400, out.error)
        raise APIError(500, f"generation failed: {out.error}", code="internal_error")

    @staticmethod
    def _apply(run: PromptRun, out: RequestOutput) -> list[tuple[Choice, str, list[int], list[TokenLogprobs]]]:
        """Fold an engine delta into the run; returns (choice, text, token ids, logprobs) deltas."""
        if out.prompt_logprobs is not None:
            run.prompt_logprobs = out.prompt_logprobs
        deltas = []
        for piece in out.outputs:
            choice = run.choices[piece.index]
            choice.text += piece.text
            choice.token_ids += piece.token_ids
            lps = piece.logprobs or []
            choice.logprobs += lps
            if piece.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = piece.finish_reason, piece.stop_reason
            deltas.append((choice, piece.text, piece.token_ids, lps))
        return deltas

    async def _collect(self, run: PromptRun, params: SamplingParams) -> PromptRun:
        async for out in self._stream_prompt(run, params):
            self.raise_for_error(out)
            self._apply(run, out)
        return run

    async def _run_all(self, raw: Request, runs: list[PromptRun], params: SamplingParams) -> list[PromptRun]:
        """Generate every prompt to the end; a client that disconnects aborts them all."""
        tasks = [asyncio.ensure_future(self._collect(run, params)) for run in runs]
        watcher = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            pending = set(tasks)
            while pending:
                done, _ = await asyncio.wait(pending | {watcher}, return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:  # closing the streams aborts the requests in the engine
                    raise APIError(499, "client disconnected")
                for task in done:
                    pending.discard(task)
                    task.result()  # the first failure fails the whole response
            return runs
        finally:
            watcher.cancel()
            for task in tasks:
                task.cancel()

    async def _merged(self, runs: list[PromptRun], params: SamplingParams
                      ) -> AsyncIterator[tuple[PromptRun, RequestOutput]]:
        """Interleave the streams of several prompts as their outputs arrive."""
        if len(runs) == 1:
            async for out in self._stream_prompt(runs[0], params):
                yield runs[0], out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(run: PromptRun) -> None:
            try:
                async for out in self._stream_prompt(run, params):
                    await queue.put((run, out, None))
            except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((run, None, exc))

        tasks = [asyncio.ensure_future(pump(run)) for run in runs]
        pending = len(runs)
        try:
            while pending:
                run, out, exc = await queue.get()
                if exc is not None:
                    raise exc
                yield run, out
                if out.finished:
                    pending -= 1
        finally:
            for t in tasks:
                t.cancel()

    def _streaming(self, events: Callable[[], AsyncIterator[str]]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for event in events():
                    yield event
            except APIError as exc:
                yield sse_error(exc.status, exc.message, exc.code)
            except Exception as exc:  # noqa: BLE001 - the stream has started: report, then close
                yield sse_error(500, f"internal error: {type(exc).__name__}: {exc}")
            yield _DONE

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _first_output(self, stream: AsyncIterator) -> tuple[Any, AsyncIterator]:
        """Start a stream and wait for its first item, so admission errors (overload,
        validation) become HTTP errors instead of events in a 200 stream."""
        iterator = stream.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            return None, iterator
        out = first[1] if isinstance(first, tuple) else first
        if out.error is not None and out.error_kind in ("overloaded", "invalid"):
            await iterator.aclose()
            self.raise_for_error(out)
        return first, iterator

    # ------------------------------------------------------------------ completions

    async def completions(self, req: CompletionRequest, raw: Request):
        self.check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        tok = self.engine.tokenizer
        prompts = _prompt_list(req.prompt)
        params = self.sampling_params(req, req.max_tokens, req.logprobs,
                                      prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None)
        runs = []
        for i, prompt in enumerate(prompts):
            ids = await _encode(tok, prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
            self._check(ids, params, "prompt")  # before decoding: ids may be anything a client sent
            if isinstance(prompt, str):
                text = prompt
            else:
                text = tok.decode(ids, skip_special_tokens=False) if req.echo else ""
            runs.append(PromptRun(i, ids, text, [Choice(i * req.n + j) for j in range(req.n)]))

        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = self.state.settings.model_name
        text_of = TokenText(tok.token_bytes)

        if req.max_tokens == 0 and not (req.echo and req.logprobs is not None):
            for run in runs:  # nothing to generate, no logprobs to compute: the prompt alone
                for c in run.choices:
                    c.finish_reason = "length"
            if not req.stream:
                return JSONResponse(self._completion_body(request_id, created, model, runs, req, text_of))

        if not req.stream:
            if req.max_tokens != 0 or (req.echo and req.logprobs is not None):
                await self._run_all(raw, runs, params)
            return JSONResponse(self._completion_body(request_id, created, model, runs, req, text_of))

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        first, rest = (None, None)
        if req.max_tokens != 0 or (req.echo and req.logprobs is not None):
            first, rest = await self._first_output(self._merged(runs, params))

        event = _Events(id=request_id, object="text_completion", created=created, model=model)

        async def events() -> AsyncIterator[str]:
            def chunk(choice: Choice, text: str, logprobs: dict | None) -> str:
                return event(choices=[{"index": choice.index, "text": text, "logprobs": logprobs,
                                       "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}])

            echoed = set()

            def echo_prefix(run: PromptRun, choice: Choice) -> tuple[str, dict | None]:
                if not req.echo or choice.index in echoed:
                    return "", None
                echoed.add(choice.index)
                lp = None
                if req.logprobs is not None:
                    lp, _ = self._legacy_logprobs(text_of, run.prompt_ids, _prompt_lp_list(run), 0)
                return run.prompt_text, lp

            if first is None:  # max_tokens 0 without logprobs
                for run in runs:
                    for c in run.choices:
                        text, lp = echo_prefix(run, c)
                        yield chunk(c, text, lp)
            else:
                async def all_outputs():
                    yield first
                    async for item in rest:
                        yield item

                offsets: dict[int, int] = {}
                async for run, out in all_outputs():
                    self.raise_for_error(out)
                    for choice, text, ids, lps in self._apply(run, out):
                        prefix, prefix_lp = echo_prefix(run, choice)
                        lp = None
                        if req.logprobs is not None:
                            start = offsets.get(choice.index, len(prefix))
                            lp, offsets[choice.index] = self._legacy_logprobs(text_of, ids, lps, start)
                            if prefix_lp is not None:
                                lp = {k: prefix_lp[k] + lp[k] for k in lp}
                        if prefix or text or ids or choice.finish_reason is not None:
                            yield chunk(choice, prefix + text, lp)
            if include_usage:
                yield event(choices=[], usage=_usage(runs))

        return self._streaming(events)

    @staticmethod
    def _legacy_logprobs(text_of: TokenText, ids: list[int], lps: list[TokenLogprobs | None],
                         start: int) -> tuple[dict[str, list], int]:
        """The completions API's logprobs object for these tokens, and the text offset after them."""
        offsets, end = text_of.offsets(ids, start)
        return {
            "tokens": [text_of.text(t) for t in ids],
            "token_logprobs": [lp.logprob if lp is not None else None for lp in lps],
            "top_logprobs": [({text_of.text(t): v for t, v in lp.top} if lp is not None else None) for lp in lps],
            "text_offset": offsets,
        }, end

    def _completion_body(self, request_id: str, created: int, model: str, runs: list[PromptRun],
                         req: CompletionRequest, text_of: TokenText) -> dict[str, Any]:
        choices = []
        for run in runs:
            for c in run.choices:
                text = (run.prompt_text if req.echo else "") + c.text
                logprobs = None
                if req.logprobs is not None:
                    gen, _ = self._legacy_logprobs(text_of, c.token_ids, c.logprobs,
                                                   len(run.prompt_text) if req.echo else 0)
                    if req.echo:
                        prompt, _ = self._legacy_logprobs(text_of, run.prompt_ids, _prompt_lp_list(run), 0)
                        gen = {k: prompt[k] + gen[k] for k in gen}
                    logprobs = gen
                choices.append({"index": c.index, "text": text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        choices.sort(key=lambda ch: ch["index"])
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": _usage(runs)}

    # ------------------------------------------------------------------ chat

    def render_chat(self, messages, add_generation_prompt: bool = True, tools=None,
                    extra: dict[str, Any] | None = None) -> str:
        tok = self.engine.tokenizer
        try:
            dicts = []
            for m in messages:
                d = m.model_dump(exclude_none=True)
                d["content"] = m.text() if m.content is not None else None
                dicts.append(d)
            kwargs = dict(extra or {})
            if tools:
                kwargs["tools"] = tools
            return tok.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, **kwargs)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        if req.response_format is not None and req.response_format.type != "text":
            raise APIError(400, f"response_format {req.response_format.type!r} is not supported",
                           param="response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        tok = self.engine.tokenizer
        prompt_text = self.render_chat(req.messages, req.add_generation_prompt, req.tools, req.chat_template_kwargs)
        ids = await _encode(tok, prompt_text, add_special_tokens=False)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs)
        self._check(ids, params, "messages")
        run = PromptRun(0, ids, prompt_text, [Choice(j) for j in range(req.n)])
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = self.state.settings.model_name
        text_of = TokenText(tok.token_bytes)

        def chat_logprobs(lps: list[TokenLogprobs]) -> dict[str, Any]:
            def entry(token_id: int, logprob: float) -> dict[str, Any]:
                return {"token": text_of.text(token_id), "logprob": logprob,
                        "bytes": list(text_of.token_bytes[token_id])}
            return {"content": [{**entry(lp.token_id, lp.logprob),
                                 "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}

        if not req.stream:
            if max_tokens == 0:
                for c in run.choices:
                    c.finish_reason = "length"
            else:
                await self._run_all(raw, [run], params)
            return JSONResponse({
                "id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                             "logprobs": chat_logprobs(c.logprobs) if req.logprobs else None,
                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                            for c in run.choices],
                "usage": _usage([run]),
            })

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        first, rest = (None, None)
        if max_tokens != 0:
            first, rest = await self._first_output(self._stream_prompt(run, params))

        event = _Events(id=request_id, object="chat.completion.chunk", created=created, model=model)

        async def events() -> AsyncIterator[str]:
            def chunk(index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None) -> str:
                return event(choices=[{"index": index, "delta": delta, "logprobs": logprobs,
                                       "finish_reason": finish_reason, "stop_reason": stop_reason}])

            for c in run.choices:
                yield chunk(c.index, {"role": "assistant", "content": ""})
            if first is None:
                for c in run.choices:
                    yield chunk(c.index, {}, finish_reason="length")
            else:
                async def all_outputs():
                    yield first
                    async for item in rest:
                        yield item

                async for out in all_outputs():
                    self.raise_for_error(out)
                    for choice, text, ids, lps in self._apply(run, out):
                        if not (text or choice.finish_reason or (req.logprobs and lps)):
                            continue
                        yield chunk(choice.index, {"content": text} if text else {},
                                    chat_logprobs(lps) if req.logprobs else None,
                                    choice.finish_reason, choice.stop_reason)
            if include_usage:
                yield event(choices=[], usage=_usage([run]))

        return self._streaming(events)


# --------------------------------------------------------------------------- helpers


def _prompt_list(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def _prompt_lp_list(run: PromptRun) -> list[TokenLogprobs | None]:
    """Per prompt token: None for the first (nothing predicts it), then the engine's."""
    return [None] + list(run.prompt_logprobs or [])[: len(run.prompt_ids) - 1]


def _usage(runs: list[PromptRun]) -> dict[str, int]:
    prompt = sum(len(r.prompt_ids) for r in runs)
    completion = sum(len(c.token_ids) for r in runs for c in r.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _encode(tok, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) < 20_000:  # short texts: faster than a thread hop
        return tok.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tok.encode, text, add_special_tokens)


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return

"""OpenAI completions and chat completions on top of the engine's async streams."""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import uuid
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.engine import EngineDeadError, OutputStream, RequestOutput
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


def _escaped(text: str) -> str:
    # translate() walks every character (~3.4 us for a 95-character event); three searches cost
    # ~0.2 us, and such characters are rare
    if "\x85" in text or "\u2028" in text or "\u2029" in text:
        return text.translate(_LINE_BREAKS)
    return text


def _json(obj: Any) -> str:
    return _escaped(_ENCODER.encode(obj))


def _value(obj: Any) -> str:
    """JSON of one value as _json writes it; None and strings (most of a streamed event's members)
    without the encoder's set-up, which costs more than encoding them."""
    if obj is None:
        return "null"
    if type(obj) is str:
        return _escaped(encode_basestring(obj))
    return _json(obj)


class _Events:
    """The SSE events of one streamed response: its envelope (id, object, created, model) is
    serialized once; an event serializes only what it adds (choices, usage)."""

    def __init__(self, **envelope: Any) -> None:
        self._head = "data: " + _json(envelope)[:-1] + ","

    def __call__(self, **fields: Any) -> str:
        return self._head + _json(fields)[1:] + "\n\n"

    def choice(self, index: int, key: str, value: str, logprobs: Any, finish_reason: str | None,
               stop_reason: int | str | None) -> str:
        """The event of one choice, {"index", key: value (JSON text), "logprobs", "finish_reason",
        "stop_reason"}: the same text as self(choices=[{...}]) in a fifth of the time (one such
        event a stream an engine step is most of what streaming costs the server)."""
        return (f'{self._head}"choices":[{{"index":{index:d},"{key}":{value},"logprobs":{_value(logprobs)},'
                f'"finish_reason":{_value(finish_reason)},"stop_reason":{_value(stop_reason)}}}]}}\n\n')


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
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
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
        except ValueError as exc:  # a field of the request's own (FieldError), or the prompt's
            code = "context_length_exceeded" if "context length" in str(exc) else None
            raise APIError(400, str(exc), param=getattr(exc, "field", param), code=code) from None

    def _start(self, runs: list[PromptRun], params: SamplingParams) -> tuple[OutputStream, dict[str, PromptRun]]:
        """Queue one request a prompt, their outputs into one stream; returns it and each
        request's prompt by request id. Admission errors raised at once are API errors."""
        stream = OutputStream(self.engine)
        by_id: dict[str, PromptRun] = {}
        try:
            for run in runs:
                by_id[stream.add(run.prompt_ids, params)] = run
        except BaseException as exc:
            stream.close()
            if isinstance(exc, QueueFullError):
                raise APIError(503, str(exc), code="overloaded",
                               headers={"Retry-After": str(self.state.settings.retry_after)}) from None
            if isinstance(exc, EngineDeadError):
                raise APIError(503, str(exc), code="engine_dead") from None
            if isinstance(exc, ValueError):
                raise APIError(400, str(exc)) from None
            raise
        return stream, by_id

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

    async def _run_all(self, raw: Request, runs: list[PromptRun], params: SamplingParams) -> list[PromptRun]:
        """Generate every prompt to the end; the first failure fails the whole response, and a
        client that disconnects aborts them all."""
        stream, by_id = self._start(runs, params)
        watcher = asyncio.ensure_future(_wait_disconnect(raw))
        watcher.add_done_callback(lambda _: stream.close())
        try:
            while not stream.done:
                for out in await stream.take():
                    self.raise_for_error(out)
                    self._apply(by_id[out.request_id], out)
            if watcher.done():
                raise APIError(499, "client disconnected")
            return runs
        finally:
            watcher.cancel()
            stream.close()

    async def _first_outputs(self, runs: list[PromptRun], params: SamplingParams
                             ) -> tuple[OutputStream, dict[str, PromptRun], list[RequestOutput]]:
        """Start the prompts and wait for their first outputs, so admission errors (overload,
        validation) become HTTP errors instead of events in a 200 stream."""
        stream, by_id = self._start(runs, params)
        try:
            first = await stream.take()
            for out in first:
                if out.error is not None and out.error_kind in ("overloaded", "invalid"):
                    self.raise_for_error(out)
        except BaseException:
            stream.close()
            raise
        return stream, by_id, first

    def _streaming(self, head: list[str], generation: tuple[OutputStream, dict[str, PromptRun],
                   list[RequestOutput]] | None, render: Callable[[PromptRun, RequestOutput], list[str]],
                   tail: Callable[[], list[str]]) -> StreamingResponse:
        """The SSE response: `head`'s events, then those `render` makes of each engine output,
        then `tail()`'s and [DONE]. One write an engine step: a stream wakes once a step and
        sends what the step brought it as one body chunk, however many events that is."""
        async def body() -> AsyncIterator[str]:
            parts = list(head)
            stream = None
            try:
                if generation is not None:
                    stream, by_id, batch = generation
                    while True:
                        for out in RequestOutput.coalesced(batch):
                            self.raise_for_error(out)
                            parts += render(by_id[out.request_id], out)
                        if parts:
                            yield "".join(parts)
                            parts = []
                        if stream.done:
                            break
                        batch = await stream.take()
                parts += tail()
            except APIError as exc:
                parts.append(sse_error(exc.status, exc.message, exc.code))
            except Exception as exc:  # noqa: BLE001 - the stream has started: report, then close
                parts.append(sse_error(500, f"internal error: {type(exc).__name__}: {exc}"))
            finally:
                if stream is not None:
                    stream.close()  # a client gone (cancelled here) or a failure: abort what runs
            parts.append(_DONE)
            yield "".join(parts)

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

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
        generation = None
        if req.max_tokens != 0 or (req.echo and req.logprobs is not None):
            generation = await self._first_outputs(runs, params)
        event = _Events(id=request_id, object="text_completion", created=created, model=model)

        def chunk(choice: Choice, text: str, logprobs: dict | None) -> str:
            return event.choice(choice.index, "text", _value(text), logprobs, choice.finish_reason, choice.stop_reason)

        echoed = set()

        def echo_prefix(run: PromptRun, choice: Choice) -> tuple[str, dict | None]:
            if not req.echo or choice.index in echoed:
                return "", None
            echoed.add(choice.index)
            lp = None
            if req.logprobs is not None:
                lp, _ = self._legacy_logprobs(text_of, run.prompt_ids, _prompt_lp_list(run), 0)
            return run.prompt_text, lp

        head = []
        if generation is None:  # max_tokens 0 without logprobs: the prompts alone
            for run in runs:
                for c in run.choices:
                    head.append(chunk(c, *echo_prefix(run, c)))
        offsets: dict[int, int] = {}

        def render(run: PromptRun, out: RequestOutput) -> list[str]:
            events = []
            for choice, text, ids, lps in self._apply(run, out):
                prefix, prefix_lp = echo_prefix(run, choice)
                lp = None
                if req.logprobs is not None:
                    start = offsets.get(choice.index, len(prefix))
                    lp, offsets[choice.index] = self._legacy_logprobs(text_of, ids, lps, start)
                    if prefix_lp is not None:
                        lp = {k: prefix_lp[k] + lp[k] for k in lp}
                if prefix or text or ids or choice.finish_reason is not None:
                    events.append(chunk(choice, prefix + text, lp))
            return events

        def tail() -> list[str]:
            return [event(choices=[], usage=_usage(runs))] if include_usage else []

        return self._streaming(head, generation, render, tail)

    @staticmethod
    def _legacy_logprobs(text_of: TokenText, ids: list[int], lps: list[TokenLogprobs | None],
                         start: int) -> tuple[dict[str, list], int]:
        """The completions API's logprobs object for these tokens, and the text offset after them.
        Each top_logprobs entry holds the chosen token too, as OpenAI documents for this API (up
        to logprobs + 1 entries; vLLM's as well), where the chat API's top_logprobs do not."""
        offsets, end = text_of.offsets(ids, start)

        def top(token_id: int, lp: TokenLogprobs) -> dict[str, float]:
            entry = {text_of.text(t): v for t, v in lp.top}
            entry.setdefault(text_of.text(token_id), lp.logprob)
            return entry
        return {
            "tokens": [text_of.text(t) for t in ids],
            "token_logprobs": [lp.logprob if lp is not None else None for lp in lps],
            "top_logprobs": [(top(t, lp) if lp is not None else None) for t, lp in zip(ids, lps)],
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
                    extra: dict[str, Any] | None = None, continue_final_message: bool = False) -> str:
        """The chat template over the messages. continue_final_message (vLLM's): the last message,
        the assistant's, is left open for the model to continue: the text ends where its content
        does, whatever the template writes after a message."""
        tok = self.engine.tokenizer
        if continue_final_message:
            if add_generation_prompt:
                raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                               param="continue_final_message")
            if not messages or messages[-1].role != "assistant":
                raise APIError(400, "continue_final_message needs the last message to be the assistant's",
                               param="continue_final_message")
        try:
            dicts = []
            for m in messages:
                d = m.model_dump(exclude_none=True)
                d["content"] = m.text() if m.content is not None else None
                dicts.append(d)
            kwargs = dict(extra or {})
            if tools:
                kwargs["tools"] = tools
            text = tok.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, **kwargs)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        if continue_final_message:
            final = dicts[-1]["content"] or ""
            end = text.rfind(final) if final else -1
            if end < 0:
                raise APIError(400, "continue_final_message: the chat template does not write the last message's "
                               "content as it is", param="continue_final_message")
            text = text[:end + len(final)]
        return text

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        if req.response_format is not None and req.response_format.type != "text":
            raise APIError(400, f"response_format {req.response_format.type!r} is not supported",
                           param="response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        _check_tools(req)
        tok = self.engine.tokenizer
        prompt_text = self.render_chat(req.messages, req.add_generation_prompt, req.tools, req.chat_template_kwargs,
                                       req.continue_final_message)
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
        generation = await self._first_outputs([run], params) if max_tokens != 0 else None
        event = _Events(id=request_id, object="chat.completion.chunk", created=created, model=model)

        def chunk(index: int, delta: str, logprobs=None, finish_reason=None, stop_reason=None) -> str:
            return event.choice(index, "delta", delta, logprobs, finish_reason, stop_reason)

        head = [chunk(c.index, '{"role":"assistant","content":""}') for c in run.choices]
        if generation is None:
            head += [chunk(c.index, "{}", finish_reason="length") for c in run.choices]

        def render(run: PromptRun, out: RequestOutput) -> list[str]:
            events = []
            for choice, text, ids, lps in self._apply(run, out):
                if text or choice.finish_reason or (req.logprobs and lps):
                    events.append(chunk(choice.index, f'{{"content":{_value(text)}}}' if text else "{}",
                                        chat_logprobs(lps) if req.logprobs else None,
                                        choice.finish_reason, choice.stop_reason))
            return events

        def tail() -> list[str]:
            return [event(choices=[], usage=_usage([run]))] if include_usage else []

        return self._streaming(head, generation, render, tail)


# --------------------------------------------------------------------------- helpers


def _check_tools(req: ChatCompletionRequest) -> None:
    """Tools as vLLM serves them without a tool-call parser: with tool_choice "none" the chat
    template gets them (a template that knows tools renders them) and the reply is text; any other
    choice would need the model's output parsed into tool calls, which this server does not do, so
    it is refused rather than answered with text that a client would take for no call."""
    choice = req.tool_choice
    if choice is not None and choice != "none" and not req.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if req.tools and choice != "none":
        shown = "auto (the default with tools)" if choice is None else json.dumps(choice)
        raise APIError(400, f"tool_choice {shown} is not supported: this server does not parse tool calls from "
                       "the model's output; tool_choice \"none\" renders the tools into the chat template and "
                       "answers with text", param="tool_choice" if choice is not None else "tools")


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

"""The engine on SmolLM2 (CPU): batching, streaming, aborts, seeds."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

import engine.engine as engine_module
from engine import Engine, EngineConfig, SamplingParams, SchedulerConfig
from engine.llm import LLM

PROMPTS = [
    "The capital of France is", "def quicksort(arr):", "Once upon a time, in a land far away,",
    "The three primary colors are", "To be or not to be,", "import numpy as np\n",
    "My favourite food is", "In 1969, the first man on the moon was",
]


@pytest.fixture(scope="module")
def llm(smollm2, smollm2_path):
    offline = LLM.__new__(LLM)  # reuse the loaded model instead of loading it again
    offline.engine = Engine(EngineConfig(model=smollm2_path, device="cpu",
                                         scheduler=SchedulerConfig(max_model_len=1024)), model=smollm2)
    offline.tokenizer = offline.engine.tokenizer
    return offline


@pytest.fixture(scope="module")
def served(smollm2, smollm2_path):
    """An engine running on its own thread, as the server uses it."""
    engine = Engine(EngineConfig(model=smollm2_path, device="cpu",
                                 scheduler=SchedulerConfig(max_model_len=1024, max_waiting=4)), model=smollm2)
    engine.start()
    yield engine
    engine.shutdown()


def texts(outputs):
    return [o.outputs[0].text for o in outputs]


def test_batch_invariance_greedy(llm):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, batched in zip(PROMPTS, together):
        alone = llm.generate([prompt], params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == batched.outputs[0].token_ids, prompt


def test_seed_gives_the_same_text_alone_and_in_a_batch(llm):
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234)
    alone = llm.generate([PROMPTS[2]], seeded, use_tqdm=False)[0].outputs[0].text
    others = [SamplingParams(max_tokens=24, temperature=0.8) for _ in range(7)]
    batch = llm.generate(PROMPTS[:2] + [PROMPTS[2]] + PROMPTS[3:], others[:2] + [seeded] + others[2:],
                         use_tqdm=False)
    assert batch[2].outputs[0].text == alone
    again = llm.generate([PROMPTS[2]], seeded, use_tqdm=False)[0].outputs[0].text
    assert again == alone


def test_n_sequences_and_stop_strings(llm):
    out = llm.generate(["The capital of France is"],
                       SamplingParams(n=3, max_tokens=30, temperature=0.9, seed=7, stop=["."]), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert "." not in c.text
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            assert c.stop_reason == "."


def test_stops_at_eos(llm):
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer briefly."}])
    ids = llm.tokenizer.encode(chat, add_special_tokens=False)
    out = llm.generate([ids], SamplingParams(max_tokens=200, temperature=0), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert "<|im_end|>" not in out.text and "4" in out.text


def test_prompt_logprobs_with_zero_max_tokens(llm):
    ids = llm.tokenizer.encode("The capital of France is Paris")
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert [lp.token_id for lp in out.prompt_logprobs] == ids[1:]
    paris = out.prompt_logprobs[-1]
    assert paris.rank == 1 and len(paris.top) == 2  # the model expects " Paris"


def test_logprobs_and_timings(llm):
    out = llm.generate(["Hello"], SamplingParams(max_tokens=5, temperature=0, logprobs=3), use_tqdm=False)[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 5 and all(lp.rank == 1 and len(lp.top) == 3 for lp in lps)
    t = out.timings
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.last_token <= t.finished


def test_async_stream_deltas_add_up(served):
    ids = served.tokenizer.encode("Write a haiku about the sea:")

    async def collect():
        deltas, final = [], None
        async for out in served.generate(ids, SamplingParams(max_tokens=20, temperature=0)):
            deltas.append(out.outputs[0].text if out.outputs else "")
            final = out
        return deltas, final

    deltas, final = asyncio.run(collect())
    assert final.finished and len(deltas) > 3
    expected = served.tokenizer.decode(served_tokens(served, ids, 20))
    assert "".join(deltas) == expected


def test_merged_deltas_keep_every_field():
    """RequestOutput.merged (a stream's waiting deltas as one): the last delta's every field but
    the sequences' pieces, which join in index order (a sequence in one delta only kept as it
    is), and the prompt logprobs, which come with the first delta that has them. Every field is checked by
    name, so one added later and not carried fails here."""
    from engine.engine import CompletionOutput, RequestOutput
    from engine.outputs import TokenLogprobs
    from engine.request import RequestTimings

    def lp(t):
        return TokenLogprobs(t, -0.5, 1)

    first = RequestOutput("r", [1, 2], [CompletionOutput(0, "a", [5], [lp(5)]), CompletionOutput(2, "x", [9])],
                          False, [lp(1)], 2, RequestTimings(arrival=1.0), None, None)
    later_fields = dict(request_id="r", prompt_token_ids=[1, 2], finished=True, prompt_logprobs=None,
                        num_generated_tokens=5, timings=RequestTimings(arrival=1.0, first_token=2.0),
                        error="boom", error_kind="internal")
    later = RequestOutput(outputs=[CompletionOutput(1, "q", [7], None, "stop", 3),
                                   CompletionOutput(0, "b", [6], None, "length")], **later_fields)
    merged = RequestOutput.merged([first, later])
    for f in dataclasses.fields(RequestOutput):
        if f.name not in ("outputs", "prompt_logprobs"):
            assert getattr(merged, f.name) is getattr(later, f.name), f.name
    assert merged.prompt_logprobs == [lp(1)]
    assert merged.outputs == [CompletionOutput(0, "ab", [5, 6], [lp(5)], "length", None),
                              CompletionOutput(1, "q", [7], None, "stop", 3), CompletionOutput(2, "x", [9])]
    one = RequestOutput("s", [1], [CompletionOutput(0, "he", [4, 4], [lp(4), lp(4)])], num_generated_tokens=2)
    two = RequestOutput("s", [1], [CompletionOutput(0, "llo", [8], [lp(8)], "stop", "lo")], True,
                        num_generated_tokens=3)
    mid = RequestOutput("s", [1], [CompletionOutput(0, "", [], None)], num_generated_tokens=2)
    assert RequestOutput.merged([one, mid, two]) == RequestOutput(
        "s", [1], [CompletionOutput(0, "hello", [4, 4, 8], [lp(4), lp(4), lp(8)], "stop", "lo")], True, None, 3)
    assert RequestOutput.merged([two]) == two


def test_a_stream_that_falls_behind_gets_merged_deltas(served):
    """A consumer busy elsewhere (a server with hundreds of streams) gets what waited as one
    delta: fewer events, the same tokens, text and logprobs."""
    ids = served.tokenizer.encode("Write a haiku about the sea:")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)

    async def collect():
        deltas = []
        async for out in served.generate(ids, params):
            deltas.append(out)
            if len(deltas) == 1:
                time.sleep(1.0)  # the loop is busy: the engine keeps producing
        return deltas

    deltas = asyncio.run(collect())
    tokens = [t for d in deltas for c in d.outputs for t in c.token_ids]
    assert tokens == served_tokens(served, ids, 24)
    assert len(deltas) < len(tokens)  # something was merged
    merged = max(deltas, key=lambda d: sum(len(c.token_ids) for c in d.outputs))
    assert len(merged.outputs[0].token_ids) > 1
    assert len(merged.outputs[0].logprobs) == len(merged.outputs[0].token_ids)
    assert "".join(c.text for d in deltas for c in d.outputs) == served.tokenizer.decode(tokens)
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
    assert deltas[-1].num_generated_tokens == 24


def served_tokens(engine, ids, n):
    """Greedy tokens for ids through a blocking wait on the running engine."""
    done = threading.Event()
    tokens = []

    def sink(out):
        for piece in out.outputs:
            tokens.extend(piece.token_ids)
        if out.finished:
            done.set()
    engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0), sink)
    assert done.wait(60)
    return tokens


def test_closing_the_stream_aborts_and_frees_memory(served):
    ids = served.tokenizer.encode("Count from one to one thousand:")

    async def read_three():
        stream = served.generate(ids, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.aclose()

    asyncio.run(read_three())
    for _ in range(200):
        if served.scheduler.num_running == 0 and not served.has_work():
            break
        threading.Event().wait(0.05)
    assert served.scheduler.num_running == 0 and served.scheduler.kv.usage == 0.0
    assert served.stats.requests_finished.get("abort", 0) >= 1


def test_overload_and_invalid_requests_fail_at_once(served):
    with pytest.raises(ValueError, match="maximum context length"):
        served.add_request([1] * 1024, SamplingParams(max_tokens=1), lambda out: None)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        served.add_request([10**7], SamplingParams(max_tokens=1), lambda out: None)


def test_a_failing_step_fails_only_its_requests(smollm2, smollm2_path):
    engine = Engine(EngineConfig(model=smollm2_path, device="cpu",
                                 scheduler=SchedulerConfig(max_model_len=256)), model=smollm2)
    real = engine.runner.execute
    poisoned: set[int] = set()

    def flaky(out):
        if any(row.seq_id in poisoned for row in out.seqs):
            raise RuntimeError("simulated device fault")
        return real(out)
    engine.runner.execute = flaky
    check_only_the_poisoned_request_fails(engine, poisoned)


def check_only_the_poisoned_request_fails(engine, poisoned: set[int], want: list[int] | None = None) -> None:
    """A request runs alone, then a second joins whose sequence id goes into `poisoned` (the
    engine's runner fails steps that hold it): the second fails with the fault, the first
    finishes with all its tokens (`want`, when given), and every KV slot is free again."""
    results = {}
    good = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                              lambda o: results.setdefault("good", []).append(o))
    engine.step()  # good is running alone
    bad = engine.add_request([4, 5, 6], SamplingParams(max_tokens=6, temperature=0),
                             lambda o: results.setdefault("bad", []).append(o))
    engine._drain_inbox()
    poisoned.add(engine.scheduler.requests[bad].seqs[0].seq_id)
    while engine.has_work():
        engine.step()
    assert results["bad"][-1].finished and "simulated device fault" in results["bad"][-1].error
    good_out = results["good"]
    assert good_out[-1].finished and good_out[-1].error is None
    tokens = [t for o in good_out if o.outputs for t in o.outputs[0].token_ids]
    assert len(tokens) == 8 and (want is None or tokens == want)
    assert engine.scheduler.kv.usage == 0.0 and good


class OverlappingRunner:
    """The NumPy runner behind the asynchronous interface of the CUDA runner (`submit`
    returns a function that waits for the step), recording when steps are submitted."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.num_kv_slots = inner.num_kv_slots
        self.submits = self.waits = 0

    def execute(self, out):
        return self.submit(out)()

    def submit(self, out):
        self.submits += 1
        result = self.inner.execute(out)

        def finish():
            self.waits += 1
            return result
        return finish


class ChainingRunner(OverlappingRunner):
    """Also takes steps launched ahead (`chain_rows`, SchedulerOutput.chained), as the CUDA
    runner does: a row's input token is the one the step before sampled for it."""

    chain_rows = 64

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.last: dict[int, int] = {}
        self.chained = 0
        self.chained_prefills = 0  # steps launched ahead with prompt tokens (admissions, chunks)

    def submit(self, out):
        if out.chained:
            self.chained += 1
            self.chained_prefills += any(not r.pending_tokens for r in out.seqs)
            out = dataclasses.replace(out, chained=False, seqs=[
                dataclasses.replace(r, token_ids=[self.last[r.seq_id]], pending_tokens=0,
                                    output_token_ids=r.output_token_ids + [self.last[r.seq_id]])
                if r.pending_tokens else r for r in out.seqs])
        finish = super().submit(out)
        self.last.update(finish().sampled)
        self.waits -= 1  # finish() above was this wrapper's, not the engine's
        return finish


class LateRunner(ChainingRunner):
    """Also marks where a step nears its end (wait_near_end, SchedulerConfig.late_ahead): counts
    the waits, and the submits that came after a wait in the same engine step."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.near_end_waits = 0

    def wait_near_end(self) -> None:
        self.near_end_waits += 1


def overlapping_engine(smollm2, smollm2_path, runner=OverlappingRunner, max_num_seqs: int = 256,
                       prompts_ahead: bool = False, late_ahead: bool = False) -> Engine:
    engine = Engine(EngineConfig(model=smollm2_path, device="cpu", scheduler=SchedulerConfig(
        max_model_len=1024, max_num_seqs=max_num_seqs, prompts_ahead=prompts_ahead, late_ahead=late_ahead)),
        model=smollm2)
    engine.runner = runner(engine.runner)
    return engine


def run_all(engine, prompts, params) -> dict:
    results: dict[int, list] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        ids = engine.tokenizer.encode(prompt)
        engine.add_request(ids, p, lambda o, i=i: results.setdefault(i, []).append(o))
    while engine.has_work():
        engine.step()
    return results


def test_an_overlapping_runner_gets_each_steps_tokens_emitted_during_the_next(smollm2, smollm2_path):
    """With a runner whose steps run asynchronously, a step's tokens are detokenized and
    delivered after the next step is submitted, and all at once when no step follows; a
    request's first token and its last go out before the next step is launched."""
    engine = overlapping_engine(smollm2, smollm2_path)
    seen = []

    def sink(o):
        seen.append((engine.runner.submits, sum(len(c.token_ids) for c in o.outputs)))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), sink)
    while engine.has_work():
        engine.step()
    # token k (of step k) arrives once step k + 1 is submitted; the first before it, the last with no
    # step after it
    assert seen == [(1, 1), (3, 1), (4, 1), (5, 1), (6, 1), (6, 1)]


def test_an_overlapping_engine_wakes_the_event_loop_before_waiting_for_the_device(smollm2, smollm2_path):
    """Outputs for an asyncio consumer (LoopSink) are handed to its loop as soon as they are
    emitted, not after the step that runs meanwhile has finished."""
    from engine.engine import LoopSink
    engine = overlapping_engine(smollm2, smollm2_path)
    loop = asyncio.new_event_loop()
    try:
        sink = LoopSink(loop)
        flushes = []
        real_flush = sink.flush

        def flush():
            if sink._pending:
                flushes.append((engine.runner.submits, engine.runner.waits))
            real_flush()
        sink.flush = flush
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), sink)
        while engine.has_work():
            engine.step()
    finally:
        loop.close()
    # step k's token goes out after step k + 1 is submitted and before it is waited for; the first
    # before step 2 is submitted
    assert flushes == [(1, 1), (3, 2), (4, 3), (4, 4)]


def test_late_ahead_waits_only_while_requests_arrive(smollm2, smollm2_path, monkeypatch):
    """A step is launched late (after the runner's wait_near_end) only while requests come in:
    once the last arrival is older than LATE_AHEAD_ARRIVALS_S, the engine launches each step
    ahead at once (no one could join it), and a new request brings the wait back."""
    monkeypatch.setattr(engine_module, "LATE_AHEAD_MIN_STEP_S", 0.0)
    monkeypatch.setattr(engine_module, "LATE_AHEAD_ARRIVALS_S", 60.0)
    engine = overlapping_engine(smollm2, smollm2_path, LateRunner, prompts_ahead=True, late_ahead=True)
    runner = engine.runner
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    engine.add_request([1, 2, 3], params, lambda o: outs.setdefault("a", []).append(o))
    for _ in range(3):
        engine.step()
    assert runner.near_end_waits >= 2  # the arrival is fresh
    engine._last_arrival -= 120.0  # as if it came two minutes ago
    before = runner.near_end_waits
    for _ in range(3):
        engine.step()
    assert runner.near_end_waits == before
    engine.add_request([4, 5, 6], params, lambda o: outs.setdefault("b", []).append(o))
    engine.step()
    engine.step()
    assert runner.near_end_waits > before
    while engine.has_work():
        engine.step()
    assert outs["a"][-1].finished and outs["b"][-1].finished
    assert sum(len(c.token_ids) for o in outs["b"] for c in o.outputs) == 12


@pytest.mark.parametrize("runner,prompts_ahead", [(OverlappingRunner, False), (ChainingRunner, False),
                                                   (ChainingRunner, True), (LateRunner, True)],
                         ids=["overlap", "chained", "prompts", "late"])
def test_overlapping_runs_give_the_outputs_of_plain_runs(smollm2, smollm2_path, llm, runner, prompts_ahead,
                                                         monkeypatch):
    """Same tokens, texts, stop reasons and logprobs with and without the overlap, stop
    strings included: a sequence stopped by one while its next token was being computed
    does not get that token. chained: steps are also launched ahead of the previous step's
    update (seeded sampling, a repetition penalty and min_tokens count the token in flight).
    prompts: with room for 3 sequences, so that the later prompts are admitted while others
    decode, and those admissions launched ahead too (SchedulerConfig.prompts_ahead). late: each
    step launched ahead only once the step in flight nears its end (SchedulerConfig.late_ahead;
    every step counts as long enough here)."""
    late = runner is LateRunner
    if late:
        monkeypatch.setattr(engine_module, "LATE_AHEAD_MIN_STEP_S", 0.0)
        monkeypatch.setattr(engine_module, "LATE_AHEAD_ARRIVALS_S", float("inf"))
    prompts = PROMPTS[:4] + ["The capital of France is"]
    params = [SamplingParams(max_tokens=12 + 3 * i, temperature=0, logprobs=2 if i == 1 else None,
                             repetition_penalty=1.3 if i == 2 else 1.0, min_tokens=10 if i == 3 else 0)
              for i in range(4)] + [SamplingParams(n=3, max_tokens=30, temperature=0.9, seed=7, stop=[".", " the"])]
    engine = overlapping_engine(smollm2, smollm2_path, runner, max_num_seqs=3 if prompts_ahead else 256,
                                prompts_ahead=prompts_ahead, late_ahead=late)
    got = run_all(engine, prompts, params)
    want = run_all(llm.engine, prompts, params)
    if late:  # one wait a step
        assert engine.runner.near_end_waits == engine.stats.steps > 10
    if issubclass(runner, ChainingRunner):
        assert engine.runner.chained > 10
        assert engine.runner.chained_prefills >= 1 if prompts_ahead else engine.runner.chained_prefills == 0
    assert any(c.finish_reason == "stop" for c in want[4][-1].outputs)
    for i in range(len(prompts)):
        assert got[i][-1].finished and want[i][-1].finished
        for g, w in zip(got[i][-1].outputs, want[i][-1].outputs):
            assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason)
        joined = [lambda outs, j=j: ("".join(c.text for o in outs for c in o.outputs if c.index == j),
                                     [t for o in outs for c in o.outputs if c.index == j for t in c.token_ids],
                                     [lp.token_id for o in outs for c in o.outputs if c.index == j
                                      for lp in (c.logprobs or [])])
                  for j in range(params[i].n)]
        for f in joined:
            assert f(got[i]) == f(want[i])


@pytest.mark.parametrize("runner", [OverlappingRunner, ChainingRunner], ids=["overlap", "chained"])
def test_an_overlapping_step_that_fails_on_the_device_fails_only_its_requests(smollm2, smollm2_path, llm, runner):
    """A fault that shows when the step is waited for (an asynchronous device error) is
    handled as a failing execute: the step's requests are retried one by one, the one at
    fault fails, the others finish with all their tokens. chained: the first step to fail
    is one launched ahead (the one launched ahead of it is dropped); its rows are retried
    with the tokens they were given on the device."""
    engine = overlapping_engine(smollm2, smollm2_path, runner)
    poisoned: set[int] = set()
    real_submit = engine.runner.submit
    armed = [runner is OverlappingRunner]

    def submit(out):
        finish = real_submit(out)
        if any(row.seq_id in poisoned for row in out.seqs) and (armed[0] or out.chained):
            armed[0] = True

            def fault():
                raise RuntimeError("simulated device fault")
            return fault
        return finish
    engine.runner.submit = submit
    want = []
    llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                           lambda o: want.extend(o.outputs[0].token_ids if o.outputs else []))
    while llm.engine.has_work():
        llm.engine.step()
    check_only_the_poisoned_request_fails(engine, poisoned, want)
    assert armed[0]


def test_an_output_stream_takes_what_steps_brought_at_once_and_close_aborts(smollm2, smollm2_path):
    """Several requests' outputs in one OutputStream (a response's prompts): take() returns all
    that the steps so far brought, in order, in one call; a request's last output retires it;
    close() aborts what has not finished, and take() then returns [] instead of waiting."""
    from engine.engine import OutputStream
    engine = overlapping_engine(smollm2, smollm2_path)
    aborted = []
    real_abort = engine.abort
    engine.abort = lambda request_id: (aborted.append(request_id), real_abort(request_id))

    async def main():
        stream = OutputStream(engine)
        short = stream.add([1, 2, 3], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        long = stream.add([4, 5, 6], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        for _ in range(5):
            engine.step()
        await asyncio.sleep(0)  # the loop runs the LoopSink's hand-over
        batch = await stream.take()
        by_id = {}
        for out in batch:
            by_id.setdefault(out.request_id, []).append(out)
        assert [sum(len(c.token_ids) for c in o.outputs) for o in by_id[short]] == [1, 1]
        assert by_id[short][-1].finished and not any(o.finished for o in by_id[long])
        assert len(by_id[long]) >= 3 and stream.unfinished == {long} and not stream.done
        stream.close()
        assert aborted == [long] and stream.done
        assert await asyncio.wait_for(stream.take(), 1.0) == []
        for _ in range(3):
            engine.step()
        assert not engine.has_work()

    asyncio.run(main())


def test_coalesced_joins_each_request_s_waiting_outputs():
    """Outputs of two requests that waited together: each request's become one delta (text and
    ids joined, the last one's finish), in the order the requests first appear; outputs of
    distinct requests pass as they are."""
    from engine.engine import CompletionOutput, RequestOutput

    def out(rid, text, tid, finished=False):
        return RequestOutput(rid, [1], [CompletionOutput(0, text, [tid], None, "length" if finished else None)],
                             finished)
    a1, b1, a2, b2 = out("a", "x", 5), out("b", "p", 7), out("a", "y", 6, True), out("b", "q", 8)
    got = RequestOutput.coalesced([a1, b1, a2, b2])
    assert [o.request_id for o in got] == ["a", "b"]
    assert got[0].outputs[0].text == "xy" and got[0].outputs[0].token_ids == [5, 6] and got[0].finished
    assert got[0].outputs[0].finish_reason == "length"
    assert got[1].outputs[0].text == "pq" and not got[1].finished
    assert RequestOutput.coalesced([a1, b1]) == [a1, b1]

"""The engine in a process of its own (engine.engine_process): the same outputs as the
engine on a thread, errors, aborts, and what happens when the process dies."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest

from engine import Engine, EngineConfig, SamplingParams, SchedulerConfig
from engine.engine import EngineDeadError, EngineObserver
from engine.engine_process import EngineClient, EngineProcess

PROMPTS = ["The capital of France is", "def quicksort(arr):", "Once upon a time,"]


def config(path: str, **scheduler) -> EngineConfig:
    return EngineConfig(model=path, device="cpu", scheduler=SchedulerConfig(max_model_len=512, **scheduler))


class Recorder(EngineObserver):
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def on_first_token(self, timings) -> None:
        self.calls.append(("first", timings))

    def on_token_gap(self, seconds: float) -> None:
        self.calls.append(("gap", seconds))

    def on_finished(self, timings) -> None:
        self.calls.append(("finished", timings))


@pytest.fixture(scope="module")
def proc(smollm2_path):
    engine = EngineProcess(config(smollm2_path))
    engine.start()
    yield engine
    engine.shutdown()


async def run(engine, prompt_ids: list[int], params: SamplingParams) -> list:
    return [out async for out in engine.generate(prompt_ids, params)]


def _pid_and_device(engine) -> tuple[int, str]:  # run in the engine's process (EngineProcess.call)
    return os.getpid(), engine.runner.device


def _fail(engine) -> None:
    raise KeyError("no such thing")


def test_the_tokenizer_tables_are_made_before_the_first_request(proc, smollm2, smollm2_path):
    """The detokenizers' table of token bytes (~0.25 s for a 128k vocabulary) is made when the
    engine is built, not in its first request's time; the server side of an EngineProcess gets
    it with the tokenizer."""
    from engine.loader.tokenizer import Tokenizer
    tok = smollm2.tokenizer
    fresh = Tokenizer(tok.backend, bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids,
                      chat_template=tok.chat_template)
    assert "token_bytes" not in vars(fresh)
    engine = Engine(config(smollm2_path), model=dataclasses.replace(smollm2, tokenizer=fresh))
    assert engine.tokenizer is fresh and {"token_bytes", "special_ids"} <= set(vars(fresh))
    assert {"token_bytes", "special_ids"} <= set(vars(proc.tokenizer))
    assert proc.tokenizer.token_bytes == fresh.token_bytes


def test_same_tokens_and_text_as_the_engine_on_a_thread(proc, smollm2, smollm2_path):
    local = Engine(config(smollm2_path), model=smollm2)
    local.start()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    try:
        for prompt in PROMPTS:
            ids = proc.tokenizer.encode(prompt)
            here, there = asyncio.run(run(local, ids, params)), asyncio.run(run(proc, ids, params))
            joined = [out.outputs[0] for out in there]
            assert [t for c in joined for t in c.token_ids] == [t for out in here for t in out.outputs[0].token_ids]
            assert "".join(c.text for c in joined) == "".join(out.outputs[0].text for out in here)
            assert [lp.token_id for c in joined for lp in c.logprobs] == [t for c in joined for t in c.token_ids]
            last = there[-1]
            assert last.finished and last.outputs[0].finish_reason == "length"
            assert last.prompt_token_ids == ids and last.num_generated_tokens == 12
            assert last.timings.arrival <= last.timings.first_token <= last.timings.finished
    finally:
        local.shutdown()
    assert proc.device == "cpu" and proc.max_model_len == 512
    assert proc.stats.generation_tokens >= 12 * len(PROMPTS)
    assert proc.stats.requests_finished["length"] >= len(PROMPTS)
    assert proc.gauges().running == 0 and proc.gauges().kv_usage == 0.0


def test_observer_calls_come_back(proc):
    recorder = Recorder()
    proc.observer = recorder
    try:
        asyncio.run(run(proc, proc.tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=5, temperature=0,
                                                                                 ignore_eos=True)))
    finally:
        proc.observer = EngineObserver()
    kinds = [kind for kind, _ in recorder.calls]
    assert kinds == ["first", "gap", "gap", "gap", "gap", "finished"]
    first, finished = recorder.calls[0][1], recorder.calls[-1][1]
    assert first.arrival <= first.first_token and finished.finished >= finished.first_token
    # stamped in this process, then by the engine's loop in its own (one clock: time.monotonic)
    assert first.arrival <= first.received <= first.first_scheduled <= first.first_token
    assert all(0 <= value < 60 for kind, value in recorder.calls if kind == "gap")


def test_bad_requests_raise_here_and_the_engine_goes_on(proc):
    ids = proc.tokenizer.encode(PROMPTS[1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(run(proc, [proc.model_config.vocab_size], SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="maximum context length"):
        asyncio.run(run(proc, ids, SamplingParams(max_tokens=600)))
    outs = asyncio.run(run(proc, ids, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
    assert outs[-1].finished and outs[-1].num_generated_tokens == 3


def test_closing_a_stream_aborts_its_request(proc):
    ids = proc.tokenizer.encode(PROMPTS[2])

    async def main():
        stream = proc.generate(ids, SamplingParams(max_tokens=400, ignore_eos=True))
        first = await stream.__anext__()
        await stream.aclose()
        done = await run(proc, ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        return first, done

    first, done = asyncio.run(main())
    assert not first.finished
    assert done[-1].finished and done[-1].num_generated_tokens == 4
    deadline = time.monotonic() + 10
    while proc.stats.requests_finished.get("abort", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # the abort's output is sent with a later step
    assert proc.stats.requests_finished.get("abort", 0) >= 1


def test_call_runs_in_the_engine_process(proc):
    assert proc.call(_pid_and_device) == (proc.pid, "cpu") and proc.pid != os.getpid()
    with pytest.raises(RuntimeError, match="KeyError"):
        proc.call(_fail)


def test_a_full_queue_answers_overloaded(smollm2_path):
    engine = EngineProcess(config(smollm2_path, max_num_seqs=1, max_waiting=1))
    engine.start()
    ids = engine.tokenizer.encode(PROMPTS[0])

    async def main():
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        return await asyncio.gather(*(run(engine, ids, long) for _ in range(5)))

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    kinds = [outs[-1].error_kind for outs in results]
    assert kinds.count("overloaded") >= 1, kinds
    served = [outs for outs in results if outs[-1].error is None]
    assert served and all(outs[-1].num_generated_tokens == 200 for outs in served)
    assert all(len(outs) == 1 and outs[0].finished for outs in results if outs[-1].error_kind == "overloaded")


def test_a_killed_engine_process_fails_its_requests_not_this_process(smollm2_path):
    engine = EngineProcess(config(smollm2_path))
    engine.start()
    ids = engine.tokenizer.encode(PROMPTS[0])

    async def main():
        outs = []
        async for out in engine.generate(ids, SamplingParams(max_tokens=400, ignore_eos=True)):
            outs.append(out)
            if len(outs) == 2:
                os.kill(engine.pid, signal.SIGKILL)
        return outs

    try:
        outs = asyncio.run(main())
        assert outs[-1].finished and outs[-1].error_kind == "internal"
        assert "exited" in outs[-1].error and str(-signal.SIGKILL) in outs[-1].error
        assert isinstance(engine.dead, EngineDeadError)
        with pytest.raises(EngineDeadError):
            asyncio.run(run(engine, ids, SamplingParams(max_tokens=2)))
    finally:
        engine.shutdown()


def _running(engine) -> int:  # run in the engine's process
    return len(engine.scheduler.running) + len(engine.scheduler.waiting)


def test_clients_on_other_links_get_their_own_outputs_and_the_observer_stays_on_link_0(smollm2_path):
    """An engine process with three links: each client's requests come back to it alone, with
    the tokens the engine gives a lone request; every client sees the engine's counters, and
    only link 0's observer is called."""
    engine = EngineProcess(config(smollm2_path), links=3)
    clients = [EngineClient(link, engine.info, engine.config) for link in engine.spare_links]
    recorders = [Recorder() for _ in range(3)]
    for api, recorder in zip([engine, *clients], recorders):
        api.observer = recorder
        api.start()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    try:
        alone = [asyncio.run(run(engine, i, params)) for i in ids]
        recorders[0].calls.clear()

        async def main():
            return await asyncio.gather(*(run(api, i, params) for api, i in zip([engine, *clients], ids)))

        together = asyncio.run(main())
        for outs, lone in zip(together, alone):
            tokens = [[t for o in x for t in o.outputs[0].token_ids] for x in (outs, lone)]
            assert tokens[0] == tokens[1]
            assert outs[-1].finished and outs[-1].error is None and len({o.request_id for o in outs}) == 1
        # a step's message goes to every link, each read on its own thread: link 0's (with the
        # observer's calls) may be read after another link's last output has ended that one's stream
        deadline = time.monotonic() + 10.0
        while [kind for kind, _ in recorders[0].calls].count("finished") < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [kind for kind, _ in recorders[0].calls].count("finished") == 3
        assert recorders[1].calls == [] and recorders[2].calls == []
        assert clients[1].stats.generation_tokens == engine.stats.generation_tokens >= 6 * 8
        assert clients[0].call(_pid_and_device) == (engine.pid, "cpu")
    finally:
        for client in clients:
            client.shutdown()
        engine.shutdown()


def test_a_client_that_closes_its_link_has_its_requests_aborted_and_the_others_go_on(smollm2_path):
    engine = EngineProcess(config(smollm2_path), links=2)
    client = EngineClient(engine.spare_links[0], engine.info, engine.config)
    engine.start()
    client.start()
    ids = engine.tokenizer.encode(PROMPTS[0])

    async def main():
        long = client.generate(ids, SamplingParams(max_tokens=400, ignore_eos=True))
        first = await long.__anext__()
        other = asyncio.ensure_future(run(engine, ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)))
        await asyncio.sleep(0)
        client.shutdown()  # its stream's next output is the error the shutdown gives it
        rest = [out async for out in long]
        return first, rest, await other

    try:
        first, rest, other = asyncio.run(main())
        assert not first.finished and rest[-1].finished and rest[-1].error_kind == "internal"
        assert other[-1].finished and other[-1].error is None and other[-1].num_generated_tokens == 30
        deadline = time.monotonic() + 10
        while engine.stats.requests_finished.get("abort", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # the abort's output (for no one now) brings link 0 the counters
        assert engine.stats.requests_finished.get("abort", 0) == 1
        assert engine.call(_running) == 0
        with pytest.raises(EngineDeadError):
            asyncio.run(run(client, ids, SamplingParams(max_tokens=2)))
    finally:
        engine.shutdown()


def test_a_model_that_does_not_load_raises_in_the_constructor(tmp_path):
    with pytest.raises(RuntimeError, match="FileNotFoundError"):
        EngineProcess(config(str(tmp_path / "missing.gguf")))


def test_freeze_long_lived_puts_live_objects_out_of_the_collectors_reach():
    """What the engine process does once its engine is built (and bench/decode.py after its
    warm-up): later full collections walk only objects made since."""
    import gc

    from engine.engine import freeze_long_lived
    before = gc.get_freeze_count()
    keep = [[i] for i in range(1000)]
    try:
        freeze_long_lived()
        assert gc.get_freeze_count() >= before + len(keep)
    finally:
        gc.unfreeze()  # the test process goes on making and dropping engines


QUIET_COLLECTOR_CHILD = """
import gc, sys, time, weakref
from engine.engine import quiet_collector

class Node:
    pass

keep = [[i] for i in range(1000)]
thread = quiet_collector(period_s=0.2)
assert gc.get_freeze_count() >= len(keep), gc.get_freeze_count()
assert gc.get_threshold()[2] >= 10 ** 6, gc.get_threshold()
assert thread.daemon and thread.is_alive()
node = Node()
node.self = node  # a cycle: only the cyclic collector frees it
ref = weakref.ref(node)
gc.collect(1)
gc.collect(1)  # survived two young collections: in the oldest generation now
del node
for _ in range(200):  # allocations drive young collections only; a full one must come from the thread
    junk = [[] for _ in range(2000)]
del junk
assert ref() is not None, "a young collection freed an old cycle"
deadline = time.monotonic() + 5
while ref() is not None and time.monotonic() < deadline:
    time.sleep(0.05)
assert ref() is None, "the collecting thread did not run a full collection"
print("ok")
"""


def test_quiet_collector_freezes_and_runs_full_collections_on_its_own_schedule():
    """What `cuserve serve` does once the model is loaded (in a child process: freezing and
    thresholds are the whole process's): the objects alive then are frozen, allocations no
    longer trigger full collections, and the collecting thread still frees old cyclic garbage."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", QUIET_COLLECTOR_CHILD], cwd=root, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

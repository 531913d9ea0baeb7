"""The scheduler and KV bookkeeping on the CPU, with a fake runner.

The fake runner keeps a simulated KV pool (one token id per slot): it applies the
step's KV copies, checks that each scheduled sequence's region already holds exactly
its earlier tokens, writes the new ones, and "samples" a token that depends only on
the sequence's history. So growth moves, n > 1 prefix copies and preemption with
recompute are all checked for correctness, not just for bookkeeping.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from engine.config import SchedulerConfig
from engine.kv_cache import KVCache
from engine.outputs import RunnerOutput, SchedulerOutput, TokenLogprobs
from engine.request import FinishReason, Request, SamplingParams, SeqStatus
from engine.scheduler import QueueFullError, Scheduler

EOS = 2


def next_token(history: list[int]) -> int:
    digest = hashlib.sha256(repr(history).encode()).digest()
    return 10 + digest[0] % 200  # never EOS


class FakeRunner:
    def __init__(self, num_slots: int) -> None:
        self.pool: list[int | None] = [None] * num_slots
        self.steps: list[SchedulerOutput] = []

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps.append(out)
        for c in out.kv_copies:
            self.pool[c.dst_start:c.dst_start + c.num_tokens] = self.pool[c.src_start:c.src_start + c.num_tokens]
        result = RunnerOutput()
        for row in out.seqs:
            context = self.pool[row.kv_start:row.kv_start + row.start_pos]
            expected = (row.prompt_token_ids + row.output_token_ids)[:row.start_pos]
            assert context == expected, f"seq {row.seq_id}: KV region holds {context}, expected {expected}"
            self.pool[row.kv_start + row.start_pos:row.kv_start + row.kv_len] = row.token_ids
            if row.want_prompt_logprobs:
                first, last = row.start_pos + 1, min(row.kv_len, len(row.prompt_token_ids) - 1)
                result.prompt_logprobs[row.seq_id] = [
                    TokenLogprobs(row.prompt_token_ids[p], -1.0, 1) for p in range(first, last + 1)]
            if row.sample:
                history = row.prompt_token_ids + row.output_token_ids
                result.sampled[row.seq_id] = next_token(history + [row.seq_id % 1 + row.rng_seed])
        return result


def make_scheduler(num_slots=4096, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024,
                   max_waiting=100, initial_decode_slots=16, block_size=16, prompts_ahead=False, catch_up_tokens=None):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len, max_waiting=max_waiting, prompts_ahead=prompts_ahead,
                          catch_up_tokens=catch_up_tokens)
    kv = KVCache(num_slots, block_size)
    return Scheduler(cfg, kv, max_model_len, initial_decode_slots, (EOS,)), FakeRunner(kv.num_slots)


def make_requests(lengths, max_tokens=8, prefix="r", **params):
    return [Request(f"{prefix}{i}", [100 + (i * 7 + j) % 50 for j in range(n)],
                    SamplingParams(max_tokens=max_tokens, **params)) for i, n in enumerate(lengths)]


def add(s: Scheduler, request: Request, seed: int = 0) -> None:
    s.add_request(request, [seed] * request.params.n)


def run_to_completion(s: Scheduler, runner: FakeRunner, max_steps=10_000) -> int:
    steps = 0
    while s.has_work():
        out = s.schedule()
        s.update(out, runner.execute(out))
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def reference_output(request: Request, seed: int = 0) -> list[int]:
    """What the fake model generates for a sequence run alone, without interruptions."""
    tokens = list(request.prompt_token_ids)
    out = []
    for _ in range(request.params.max_tokens):
        out.append(next_token(tokens + out + [seed]))
    return out


# ---------------------------------------------------------------- basics


def test_all_requests_complete_with_right_outputs():
    s, runner = make_scheduler()
    requests = make_requests([5, 17, 3, 40, 9])
    for r in requests:
        add(s, r)
    run_to_completion(s, runner)
    for r in requests:
        seq = r.seqs[0]
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.output_token_ids == reference_output(r)
    assert s.kv.usage == 0.0 and not s.running and not s.requests


def test_decodes_come_first_and_prefill_is_chunked():
    s, runner = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    short = make_requests([4], max_tokens=30, prefix="short")[0]
    add(s, short)
    out = s.schedule()
    s.update(out, runner.execute(out))  # short is now decoding
    long = make_requests([50], max_tokens=4, prefix="long")[0]
    add(s, long)
    chunks = []
    while not long.seqs[0].output_token_ids:
        out = s.schedule()
        assert out.seqs[0].seq_id == short.seqs[0].seq_id and out.seqs[0].num_tokens == 1  # decode first
        assert out.num_tokens <= 16
        chunk = [r for r in out.seqs if r.seq_id == long.seqs[0].seq_id]
        if chunk:
            chunks.append((chunk[0].start_pos, chunk[0].num_tokens, chunk[0].sample))
        s.update(out, runner.execute(out))
    # 50 prompt tokens in chunks of 15 (16 minus the decode), positions contiguous, sampled only at the
    # end; the first, on admission, also leaves a row for the long prompt's own decode (_prompt_room)
    assert [c[1] for c in chunks] == [14, 15, 15, 6]
    assert [c[0] for c in chunks] == [0, 14, 29, 44]
    assert [c[2] for c in chunks] == [False, False, False, True]
    run_to_completion(s, runner)
    assert long.seqs[0].output_token_ids == reference_output(long)


def test_max_num_seqs_limits_running():
    s, runner = make_scheduler(max_num_seqs=2)
    requests = make_requests([3, 3, 3, 3])
    for r in requests:
        add(s, r)
    while s.has_work():
        out = s.schedule()
        assert len(s.running) <= 2
        s.update(out, runner.execute(out))
    assert all(r.seqs[0].output_token_ids == reference_output(r) for r in requests)


def test_queue_overflow_raises_distinct_error():
    # room = max_waiting (3) + free running slots (1 while nothing runs)
    s, runner = make_scheduler(max_waiting=3, max_num_seqs=1)
    for r in make_requests([4, 4, 4, 4]):
        add(s, r)
    with pytest.raises(QueueFullError):
        add(s, make_requests([4], prefix="extra")[0])
    _step(s, runner)  # one runs now: 3 wait, no free slot
    assert len(s.running) == 1 and s.queue_full()
    with pytest.raises(QueueFullError):
        add(s, make_requests([4], prefix="late")[0])


def test_invalid_requests_are_refused():
    s, _ = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match="context limit"):
        add(s, make_requests([32])[0])
    with pytest.raises(ValueError):
        Request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        r = make_requests([3])[0]
        add(s, r)
        add(s, Request(r.request_id, [1, 2], SamplingParams()))


# ---------------------------------------------------------------- memory


def test_admission_waits_for_memory():
    # each request reserves 20 prompt + 16 output slots -> 48 slots (3 blocks); the pool holds two
    s, runner = make_scheduler(num_slots=96, max_model_len=64)
    requests = make_requests([20, 20, 20], max_tokens=16)
    for r in requests:
        add(s, r)
    out = s.schedule()
    assert {row.seq_id for row in out.seqs} == {requests[0].seqs[0].seq_id, requests[1].seqs[0].seq_id}
    assert requests[2].seqs[0].status is SeqStatus.WAITING
    s.update(out, runner.execute(out))
    run_to_completion(s, runner)
    assert all(r.seqs[0].output_token_ids == reference_output(r) for r in requests)
    assert s.kv.usage == 0.0


def test_pool_too_small_for_all_preempts_and_recomputes_without_losing_work():
    """Eight requests whose outputs outgrow the pool together: regions grow, the newest
    sequences are preempted and recomputed, and every output equals its solo run."""
    s, runner = make_scheduler(num_slots=320, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=200,
                               initial_decode_slots=8)
    requests = make_requests([10, 14, 6, 22, 9, 17, 12, 8], max_tokens=60)
    for r in requests:
        add(s, r)
    run_to_completion(s, runner)
    assert s.num_preemptions > 0  # the pool really was too small
    assert any(c for step in runner.steps for c in step.kv_copies) or s.num_preemptions
    for r in requests:
        assert r.seqs[0].finish_reason is FinishReason.LENGTH
        assert r.seqs[0].output_token_ids == reference_output(r)
    assert s.kv.usage == 0.0


def test_regions_grow_in_place_or_move_with_a_copy():
    s, runner = make_scheduler(num_slots=256, max_num_seqs=2, initial_decode_slots=4, max_model_len=200)
    a, b = make_requests([10, 10], max_tokens=40)
    add(s, a)
    add(s, b)  # b sits right after a, so a cannot grow in place and must move
    run_to_completion(s, runner)
    moves = [c for step in runner.steps for c in step.kv_copies]
    assert moves and all(c.num_tokens > 0 for c in moves)
    assert a.seqs[0].output_token_ids == reference_output(a)
    assert b.seqs[0].output_token_ids == reference_output(b)


# ---------------------------------------------------------------- abort


def _step(s, runner, n=1):
    for _ in range(n):
        out = s.schedule()
        s.update(out, runner.execute(out))


def test_abort_waiting():
    s, runner = make_scheduler(max_num_seqs=1)
    first, second = make_requests([4, 4])
    add(s, first)
    add(s, second)
    _step(s, runner)
    assert second.seqs[0].status is SeqStatus.WAITING
    s.abort(second.request_id)
    assert second.seqs[0].finish_reason is FinishReason.ABORT and second not in s.waiting
    run_to_completion(s, runner)
    assert s.kv.usage == 0.0


def test_abort_mid_prefill_and_mid_decode_frees_memory():
    s, runner = make_scheduler(max_num_batched_tokens=16)
    long, short = make_requests([60, 3], max_tokens=50)
    add(s, short)
    add(s, long)
    _step(s, runner, 2)
    assert 0 < long.seqs[0].num_computed < 60  # mid-prefill
    assert short.seqs[0].output_token_ids  # mid-decode
    s.abort(long.request_id)
    s.abort(short.request_id)
    assert s.kv.usage == 0.0 and not s.running and not s.has_work()
    assert long.seqs[0].finish_reason is FinishReason.ABORT is short.seqs[0].finish_reason


def test_abort_preempted():
    s, runner = make_scheduler(num_slots=128, max_num_seqs=4, initial_decode_slots=4, max_model_len=120)
    requests = make_requests([20, 20, 20], max_tokens=60)
    for r in requests:
        add(s, r)
    while not s.preempted:
        _step(s, runner)
    victim = s.preempted[0].request
    s.abort(victim.request_id)
    assert not s.preempted or all(seq.request is not victim for seq in s.preempted)
    run_to_completion(s, runner)
    assert s.kv.usage == 0.0
    assert victim.seqs[0].finish_reason is FinishReason.ABORT


# ---------------------------------------------------------------- n > 1, stops


def test_n_siblings_share_the_prompt_prefill():
    s, runner = make_scheduler()
    request = make_requests([12], max_tokens=5, n=3)[0]
    s.add_request(request, [11, 22, 33])
    run_to_completion(s, runner)
    prompt_tokens_run = sum(r.num_tokens for step in runner.steps for r in step.seqs
                            if r.start_pos < 11)
    assert prompt_tokens_run == 11  # the first 11 prompt tokens ran once
    copies = [c for step in runner.steps for c in step.kv_copies]
    assert len(copies) == 2 and all(c.num_tokens == 11 for c in copies)
    outputs = [seq.output_token_ids for seq in request.seqs]
    for seq, seed in zip(request.seqs, [11, 22, 33]):
        assert seq.output_token_ids == reference_output(request, seed)
    assert len({tuple(o) for o in outputs}) == 3  # different seeds, different continuations
    assert s.kv.usage == 0.0


def test_n_with_one_token_prompt():
    s, runner = make_scheduler()
    request = make_requests([1], max_tokens=3, n=2)[0]
    s.add_request(request, [5, 6])
    run_to_completion(s, runner)
    assert [seq.output_token_ids for seq in request.seqs] == [reference_output(request, 5),
                                                              reference_output(request, 6)]


def test_stop_tokens_eos_and_min_tokens():
    s, runner = make_scheduler()
    request = make_requests([4], max_tokens=10, min_tokens=2, stop_token_ids=(77,))[0]
    add(s, request)
    out = s.schedule()
    seq = request.seqs[0]
    s.update(out, RunnerOutput(sampled={seq.seq_id: EOS}))  # eos before min_tokens: ignored
    assert not seq.is_finished
    out = s.schedule()
    s.update(out, RunnerOutput(sampled={seq.seq_id: 77}))
    assert seq.finish_reason is FinishReason.STOP and seq.stop_reason == 77
    ignore = make_requests([4], max_tokens=3, prefix="ig", ignore_eos=True)[0]
    add(s, ignore)
    for _ in range(3):
        out = s.schedule()
        s.update(out, RunnerOutput(sampled={ignore.seqs[0].seq_id: EOS}))
    assert ignore.seqs[0].finish_reason is FinishReason.LENGTH
    assert ignore.seqs[0].output_token_ids == [EOS] * 3


def test_context_limit_finishes_with_length():
    s, runner = make_scheduler(max_model_len=20)
    request = make_requests([15], max_tokens=None)[0]
    add(s, request)
    run_to_completion(s, runner)
    assert request.seqs[0].finish_reason is FinishReason.LENGTH
    assert request.seqs[0].num_tokens == 20


def test_prompt_logprobs_only_with_zero_max_tokens():
    s, runner = make_scheduler(max_num_batched_tokens=8)
    request = make_requests([20], max_tokens=0, prompt_logprobs=1)[0]
    add(s, request)
    run_to_completion(s, runner)
    assert request.seqs[0].finish_reason is FinishReason.LENGTH
    assert request.seqs[0].output_token_ids == []
    assert [lp.token_id for lp in request.prompt_logprobs] == request.prompt_token_ids[1:]
    assert not any(r.sample for step in runner.steps for r in step.seqs)


# ---------------------------------------------------------------- steps scheduled ahead


class ChainingFakeRunner(FakeRunner):
    """Takes steps scheduled ahead (SchedulerOutput.chained): a row's input token is what
    the step before sampled for it, which its output_token_ids does not hold yet."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.last: dict[int, int] = {}
        self.chained = 0
        self.chained_prefills = 0  # steps scheduled ahead with prompt tokens (admissions, chunks)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if out.chained:
            self.chained += 1
            self.chained_prefills += any(not r.pending_tokens for r in out.seqs)
            assert all(r.pending_tokens in (0, 1) and (r.num_tokens == 1 or not r.pending_tokens) for r in out.seqs)
            out = dataclasses.replace(out, chained=False, seqs=[
                dataclasses.replace(r, token_ids=[self.last[r.seq_id]], pending_tokens=0,
                                    output_token_ids=r.output_token_ids + [self.last[r.seq_id]])
                if r.pending_tokens else r for r in out.seqs])
        result = super().execute(out)
        self.last.update(result.sampled)
        return result


def run_ahead(s: Scheduler, runner: ChainingFakeRunner, max_rows: int = 8) -> None:
    """The engine's order with a runner that chains: launch a step, schedule and launch the
    next one ahead when the scheduler can, then update with the first step's output."""
    launched = None
    while s.has_work() or launched is not None:
        if launched is None:
            out = s.schedule()
            launched = (out, runner.execute(out))
        out, result = launched
        nxt = s.schedule_ahead(out, max_rows)
        launched = (nxt, runner.execute(nxt)) if nxt is not None else None
        s.update(out, result)


@pytest.mark.parametrize("prompts_ahead", [False, True], ids=["decodes", "prompts"])
def test_steps_scheduled_ahead_give_the_outputs_of_plain_steps(prompts_ahead):
    """Chained steps (each launched before the previous one's update) produce the same tokens
    and finish reasons as plain steps, with admissions (max_num_seqs), region growth and
    moves (a small pool), stop tokens and the context limit breaking the chain on the way.
    The token a stopping sequence got in its last chained step is dropped. prompts: the
    admissions are launched ahead too."""
    def requests():
        reqs = make_requests([5, 17, 3, 40, 9, 12], max_tokens=30)
        reqs[1] = make_requests([17], max_tokens=30, prefix="s")[0]
        stop_at = reference_output(reqs[1])[6]  # the 7th token stops it
        reqs[1] = make_requests([17], max_tokens=30, prefix="s", stop_token_ids=(stop_at,))[0]
        reqs.append(make_requests([25], max_tokens=None, prefix="long")[0])  # ends at the context limit
        return reqs
    plain, ahead = requests(), requests()
    s, runner = make_scheduler(num_slots=512, max_num_seqs=4, initial_decode_slots=4, max_model_len=80)
    for r in plain:
        add(s, r)
    run_to_completion(s, runner)
    s2, _ = make_scheduler(num_slots=512, max_num_seqs=4, initial_decode_slots=4, max_model_len=80,
                           prompts_ahead=prompts_ahead)
    s2_runner = ChainingFakeRunner(s2.kv.num_slots)
    for r in ahead:
        add(s2, r)
    run_ahead(s2, s2_runner)
    assert s2_runner.chained > 20
    assert s2_runner.chained_prefills >= 2 if prompts_ahead else s2_runner.chained_prefills == 0
    assert any(c.num_tokens for step in s2_runner.steps for c in step.kv_copies)  # moves happened
    for p, a in zip(plain, ahead):
        assert a.seqs[0].output_token_ids == p.seqs[0].output_token_ids
        assert (a.seqs[0].finish_reason, a.seqs[0].stop_reason) == (p.seqs[0].finish_reason, p.seqs[0].stop_reason)
    assert ahead[1].seqs[0].finish_reason is FinishReason.STOP and len(ahead[1].seqs[0].output_token_ids) == 7
    assert ahead[-1].seqs[0].num_tokens == 80
    assert s2.kv.usage == 0.0 and not s2.running and not s2.requests


def test_a_burst_is_admitted_at_the_rate_it_is_served_once_all_of_it_decodes():
    """Prompts admitted from a queue leave a row of the budget for each sequence that will
    decode once the queue is in: the burst's steps take as many prompt tokens as the later
    steps can, when all of it decodes (otherwise its early, decode-free steps admit faster
    and the successors of those requests arrive in a wave that queues). A lone request still
    gets all but one row of the budget."""
    s, runner = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64)
    burst = make_requests([24] * 8, max_tokens=4, prefix="b")
    for r in burst:
        add(s, r)
    prompt_tokens = []
    while any(not r.seqs[0].output_token_ids for r in burst):
        out = s.schedule()
        prompt_tokens.append(sum(r.num_tokens for r in out.seqs if r.start_pos < len(r.prompt_token_ids)))
        s.update(out, runner.execute(out))
    assert prompt_tokens == [56, 56, 56, 24]  # 64 less a row for each of the 8, from the first step on
    run_to_completion(s, runner)
    for r in burst:
        assert r.seqs[0].output_token_ids == reference_output(r)

    s, runner = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64)
    lone = make_requests([100], max_tokens=2)[0]
    add(s, lone)
    assert s.schedule().seqs[0].num_tokens == 63


def test_a_queue_makes_progress_when_the_budget_is_max_num_seqs():
    """The rows kept for decodes are at most half the budget, so prompts always get some."""
    s, runner = make_scheduler(max_num_seqs=8, max_num_batched_tokens=8)
    requests = make_requests([6] * 12, max_tokens=3)
    for r in requests:
        add(s, r)
    out = s.schedule()
    assert sum(r.num_tokens for r in out.seqs) == 4
    s.update(out, runner.execute(out))
    run_to_completion(s, runner)
    for r in requests:
        assert r.seqs[0].output_token_ids == reference_output(r)


@pytest.mark.parametrize("catch_up_tokens", [None, 0])
def test_a_short_queue_passed_over_by_two_steps_gets_the_catch_up_budget(catch_up_tokens):
    """A step may take catch_up_tokens more (half the budget by default) while the queue's
    first request has waited through two steps, and the queue is short (<= max_num_seqs / 4):
    a burst left waiting at full load drains, instead of every later request waiting as
    long. Passed over once, or in a longer queue, a request gets the plain budget (at lower
    loads the next step drains it anyway, and a longer step would only delay the others);
    catch_up_tokens=0 turns it off."""

    def steps(prompts: list[int]) -> tuple[list[int], int]:
        s, runner = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64, catch_up_tokens=catch_up_tokens)
        decoders = make_requests([8] * 6, max_tokens=40, prefix="d")
        queued = make_requests(prompts, max_tokens=3, prefix="q")
        for r in decoders:
            add(s, r)
        out = s.schedule()  # the 6 prompts whole; they decode from now on
        s.update(out, runner.execute(out))
        for r in queued:
            add(s, r)
        sizes = []
        for _ in range(3):
            out = s.schedule()
            sizes.append(sum(r.num_tokens for r in out.seqs))
            s.update(out, runner.execute(out))
        caught_up = s.num_catch_up_steps
        run_to_completion(s, runner)
        for r in decoders + queued:
            assert r.seqs[0].output_token_ids == reference_output(r)
        return sizes, caught_up

    assert SchedulerConfig(max_num_batched_tokens=64, catch_up_tokens=catch_up_tokens).max_step_tokens == (
        64 if catch_up_tokens == 0 else 96)
    # a 120-token prompt and a 60-token one: the first gets the room of a plain step (64 less a
    # row for each of the 8 that will decode), then all of the next step after the 6 decodes;
    # the second, passed over twice, then comes in whole in a step of 96 (6 decodes, the first's
    # last 6 tokens, its 60), or 50 of it in a plain step
    assert steps([120, 60]) == (([62, 64, 72], 1) if catch_up_tokens is None else ([62, 64, 62], 0))
    # three more behind the long one: a longer queue than 8 / 4, plain steps
    assert steps([120, 60, 60, 60]) == ([62, 64, 62], 0)


def test_schedule_ahead_rows():
    """The step after prev, before update(prev): a decode row (pending token) for each row of
    prev that samples, the next chunk of a prompt prev ran part of, then admissions."""
    s, runner = make_scheduler(max_num_seqs=3, max_num_batched_tokens=16, initial_decode_slots=4, prompts_ahead=True)
    a, b, c, d = make_requests([6, 6, 20, 6], max_tokens=3)
    add(s, a)
    add(s, b)
    out = s.schedule()  # both prompts whole
    nxt = s.schedule_ahead(out, 8)
    assert nxt.chained and [r.seq_id for r in nxt.seqs] == [r.seq_id for r in out.seqs]
    assert [r.start_pos for r in nxt.seqs] == [r.kv_len for r in out.seqs] == [6, 6]
    assert all(r.pending_tokens == 1 and r.sample and r.num_tokens == 1 for r in nxt.seqs)
    assert s.schedule_ahead(out, 1) is None  # more decode rows than the runner chains
    add(s, c)
    # c is admitted ahead: 2 decodes + the first 13 of its 20 tokens (a row stays for its own decode)
    nxt = s.schedule_ahead(out, 8)
    assert [(r.seq_id, r.start_pos, r.num_tokens, r.pending_tokens) for r in nxt.seqs] == \
        [(0, 6, 1, 1), (1, 6, 1, 1), (2, 0, 13, 0)]
    assert not nxt.seqs[2].sample and c.seqs[0] in s.running and c.timings.first_scheduled is not None
    s.update(out, runner.execute(out))
    nxt_result = runner.execute(dataclasses.replace(nxt, seqs=[
        dataclasses.replace(r, token_ids=s.get_seq(r.seq_id).output_token_ids[-1:], pending_tokens=0)
        if r.pending_tokens else r for r in nxt.seqs]))
    add(s, d)  # max_num_seqs is reached: d waits
    after = s.schedule_ahead(nxt, 8)  # a and b's third tokens, c's last 7 prompt tokens (it samples)
    assert [(r.seq_id, r.start_pos, r.num_tokens, r.sample) for r in after.seqs] == \
        [(0, 7, 1, True), (1, 7, 1, True), (2, 13, 7, True)]
    assert d.seqs[0] not in s.running
    assert s.schedule_ahead(dataclasses.replace(nxt, seqs=nxt.seqs[:2]), 8) is None  # c runs, not in prev
    s.preempted.append(c.seqs[0])  # a sequence to readmit: only a plain step does that
    assert s.schedule_ahead(nxt, 8) is None
    s.preempted.clear()
    s.update(nxt, nxt_result)
    assert [len(q.seqs[0].output_token_ids) for q in (a, b)] == [2, 2]
    # a and b end with after's token (max_tokens 3): room for d and one more, and d's 6 tokens
    # leave the step room too: a plain step, which can take what arrives meanwhile
    assert s.schedule_ahead(after, 8) is None and d.seqs[0] not in s.running
    e = make_requests([30], prefix="e")[0]
    # now the prompts fill the step: c decodes, d whole, e's first 7 tokens, in a's and b's places (16
    # tokens less a row for each of c, d and e: _prompt_room)
    add(s, e)
    last = s.schedule_ahead(after, 8)
    assert [(r.seq_id, r.start_pos, r.num_tokens, r.pending_tokens) for r in last.seqs] == \
        [(2, 20, 1, 1), (3, 0, 6, 0), (4, 0, 7, 0)]
    assert sorted(last.finished_seq_ids) == [0, 1]  # their state can go when this step is submitted


def test_schedule_ahead_without_prompts_ahead_only_in_steady_decoding():
    """SchedulerConfig.prompts_ahead off: only steps that decode every running
    sequence, with no one waiting, are scheduled ahead."""
    s, runner = make_scheduler(max_num_seqs=2, initial_decode_slots=4)
    a, b, c = make_requests([6, 6, 6], max_tokens=3)
    add(s, a)
    add(s, b)
    out = s.schedule()  # both prefill
    assert s.schedule_ahead(out, 8) is None  # prompt rows: a plain step after them
    s.update(out, runner.execute(out))
    out = s.schedule()  # both decode their first token
    nxt = s.schedule_ahead(out, 8)
    assert [(r.seq_id, r.start_pos, r.pending_tokens) for r in nxt.seqs] == [(0, 7, 1), (1, 7, 1)]
    add(s, c)
    assert s.schedule_ahead(out, 8) is None  # someone waits: admit it in a plain step
    s.abort(c.request_id)
    chunked, _ = make_scheduler(max_num_seqs=4, max_num_batched_tokens=4)
    add(chunked, make_requests([6])[0])
    assert chunked.schedule_ahead(chunked.schedule(), 8) is None  # a prompt part-way: a plain step

"""Continuous batching. Pure Python: no arrays (DESIGN.md).

Each step, in this order, within `max_num_batched_tokens` (half as many more, or
`catch_up_tokens`, while a short queue holds a request passed over by two steps:
`_step_budget`):
  1. running sequences with one pending token decode (their region grows first if
     full, preempting the most recently admitted sequences when memory is short);
  2. running sequences part-way through their prompt get their next chunk;
  3. preempted sequences, then waiting requests in arrival order, are admitted while
     `max_num_seqs` and KV memory allow, and get a first chunk. New prompts get at most
     the budget less a row for each sequence that will decode once the queue is in
     (`_prompt_room`), so a burst is admitted at the rate it can be served at.
A request with n > 1 prefills its prompt (all but the last token) once, in sibling
0's region; the siblings copy that prefix (a KVCopy) and all n then run the last
prompt token as their first decode, each sampling from its own stream.
"""

from __future__ import annotations

import time
from collections import deque

from .config import SchedulerConfig
from .kv_cache import KVCache
from .outputs import KVCopy, RunnerOutput, ScheduledSeq, SchedulerOutput
from .request import FinishReason, Request, Sequence, SeqStatus


# steps a waiting request must have been passed over by (made since it was queued) before the
# next step catches up (Scheduler._step_budget). H200, 8B fp8 over HTTP, TTFT p50: 256 streams
# 123.0 / 134.1 ms after one, 133.3 / 138.2 after two (~150 without catching up); but 32 streams
# 127.6 / 128.9 ms after one, 107.1 / 91.5 after two, 102.6 / 91.8 without: there the next plain
# step drains a burst anyway, and a longer step only delays the others
CATCH_UP_PASSED_OVER = 2


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting`: the engine is overloaded, retry later."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCache, max_model_len: int,
                 initial_decode_slots: int = 256, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.config = config
        self.kv = kv_cache
        self.max_model_len = max_model_len
        self.initial_decode_slots = initial_decode_slots
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()  # not yet admitted, arrival order
        self.preempted: deque[Sequence] = deque()  # admitted once, waiting to be recomputed
        self.running: list[Sequence] = []  # own a KV region, in admission order
        self.requests: dict[str, Request] = {}  # every unfinished request
        self._seqs: dict[int, Sequence] = {}
        self._next_seq_id = 0
        self._step = 0
        self.num_preemptions = 0
        self.num_steps = 0  # steps scheduled (schedule, schedule_ahead) with rows
        self.num_catch_up_steps = 0  # of which given the catch-up tokens too (_step_budget)
        self._gone: list[int] = []  # sequences finished or preempted since the last schedule()

    # ------------------------------------------------------------ requests

    def add_request(self, request: Request, rng_seeds: list[int]) -> None:
        """Queue a request; its n sequences draw from `rng_seeds` (one per sequence)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self.queue_full():
            raise QueueFullError(f"server overloaded: {self.config.max_waiting} requests are already waiting")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt of {request.num_prompt_tokens} tokens leaves no room to generate "
                             f"within the context limit of {self.max_model_len} tokens")
        n = request.params.n
        if n > self.config.max_num_seqs:
            raise ValueError(f"n={n} exceeds max_num_seqs ({self.config.max_num_seqs})")
        if self.kv.round_up(self._initial_capacity(request, 0)) * n > self.kv.num_slots:
            raise ValueError(f"the KV pool ({self.kv.num_slots} slots) cannot hold this request's "
                             f"{n} x {request.num_prompt_tokens}-token prompt")
        for index in range(n):
            seq = Sequence(self._next_seq_id, request, index, rng_seeds[index])
            self._next_seq_id += 1
            request.seqs.append(seq)
            self._seqs[seq.seq_id] = seq
        for seq in request.seqs[1:]:
            seq.needs_fork = True  # copy the prefix from sibling 0 rather than prefill
        self.requests[request.request_id] = request
        request.queued_after = self.num_steps
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish every sequence of the request (any state) and free its memory."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request in self.waiting:
            self.waiting.remove(request)
        for seq in request.seqs:
            if not seq.is_finished:
                self.finish(seq, FinishReason.ABORT)
        return request

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        if seq.is_finished:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.kv.free(seq.seq_id)
        elif seq in self.preempted:
            self.preempted.remove(seq)
        self._gone.append(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        del self._seqs[seq.seq_id]
        if seq.request.is_finished:
            self.requests.pop(seq.request.request_id, None)

    # ------------------------------------------------------------ queries

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.preempted)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def queue_full(self, pending: int = 0) -> bool:
        """Whether one more request would overflow the waiting queue. Room is
        `max_waiting` plus the running slots still free (those requests start at once);
        `pending` counts requests on their way in that are not added yet."""
        free = max(0, self.config.max_num_seqs - len(self.running))
        return len(self.waiting) + len(self.preempted) + pending >= self.config.max_waiting + free

    def get_seq(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

    def has_work(self) -> bool:
        return bool(self.running or self.preempted or self.waiting)

    # ------------------------------------------------------------ capacity

    def _max_len(self, seq_or_request) -> int:
        """Tokens a sequence may reach: prompt + max_tokens, within the context limit."""
        request = seq_or_request.request if isinstance(seq_or_request, Sequence) else seq_or_request
        max_tokens = request.params.max_tokens
        if max_tokens is None:
            return self.max_model_len
        return min(self.max_model_len, request.num_prompt_tokens + max_tokens)

    def _initial_capacity(self, request: Request, num_tokens: int) -> int:
        """Slots to reserve on admission: what is there plus a first stretch of output."""
        base = max(num_tokens, request.num_prompt_tokens)
        return max(1, min(self._max_len(request), base + self.initial_decode_slots))

    def _preempt(self, seq: Sequence) -> None:
        self._gone.append(seq.seq_id)
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.needs_fork = False
        if seq.index == 0:  # siblings waiting for its prefix prefill on their own instead
            for sib in seq.request.seqs[1:]:
                sib.needs_fork = False
        self.preempted.appendleft(seq)

    def _ensure_capacity(self, seq: Sequence, kv_len: int, copies: list[KVCopy]) -> bool:
        """Make seq's region hold kv_len tokens; False if seq itself had to be preempted."""
        start, capacity = self.kv.region(seq.seq_id)
        if kv_len <= capacity:
            return True
        target = min(self._max_len(seq), max(kv_len, 2 * capacity))
        while not self.kv.can_grow(seq.seq_id, target):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        old_start = self.kv.grow(seq.seq_id, target)
        if old_start is not None and seq.num_computed:
            copies.append(KVCopy(old_start, self.kv.region(seq.seq_id)[0], seq.num_computed))
        return True

    # ------------------------------------------------------------ schedule

    def _row(self, seq: Sequence, end: int, start: int | None = None) -> ScheduledSeq:
        """seq's tokens [start, end) (start: its computed tokens, unless given)."""
        request = seq.request
        start = seq.num_computed if start is None else start
        sample = end == seq.num_tokens and request.params.max_tokens != 0
        want_prompt_lp = (request.params.prompt_logprobs is not None and seq.index == 0
                          and seq.num_preemptions == 0 and start < request.num_prompt_tokens)
        return ScheduledSeq(
            seq_id=seq.seq_id,
            token_ids=seq.token_slice(start, end),
            start_pos=start,
            kv_start=self.kv.region(seq.seq_id)[0],
            sample=sample,
            sampling=request.params,
            output_token_ids=seq.output_token_ids,
            prompt_token_ids=request.prompt_token_ids,
            want_prompt_logprobs=want_prompt_lp,
            rng_seed=seq.rng_seed,
        )

    def _prefill_target(self, seq: Sequence) -> int:
        """How far this sequence's chunks go: all its tokens, or the shared prefix."""
        if seq.index == 0 and seq.request.params.n > 1 and any(s.needs_fork for s in seq.request.seqs):
            return max(seq.request.num_prompt_tokens - 1, 0)
        return seq.num_tokens

    def _fork_siblings(self, seq0: Sequence, copies: list[KVCopy]) -> None:
        prefix = seq0.request.num_prompt_tokens - 1
        for sib in seq0.request.seqs[1:]:
            if sib.needs_fork and sib.status is SeqStatus.RUNNING:
                if prefix:
                    copies.append(KVCopy(self.kv.region(seq0.seq_id)[0], self.kv.region(sib.seq_id)[0], prefix))
                sib.num_computed = prefix
                sib.needs_fork = False

    def _admit(self, seqs: list[Sequence], capacities: list[int], ending: int = 0) -> bool:
        """Run seqs with regions of these capacities, if max_num_seqs and the pool allow;
        `ending` running sequences are known to end before the step these join."""
        if len(self.running) - ending + len(seqs) > self.config.max_num_seqs:
            return False
        if not self.kv.can_allocate(capacities):
            return False
        for seq, capacity in zip(seqs, capacities):
            self.kv.allocate(seq.seq_id, capacity)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        return True

    def _step_budget(self) -> int:
        """The tokens a step may take: max_num_batched_tokens, and SchedulerConfig.catch_up
        more while the queue is a backlog: its first request has waited through
        CATCH_UP_PASSED_OVER steps (a request queued in time gets into the next step while
        there is room), and the queue is short (at most max_num_seqs / 4 requests). A longer
        queue is a flood, as when a load starts: admitting it faster would only bring its
        successors back faster than a steady step takes them."""
        c = self.config
        w = self.waiting
        if (c.catch_up and w and len(w) <= max(1, c.max_num_seqs // 4)
                and w[0].queued_after <= self.num_steps - CATCH_UP_PASSED_OVER):
            return c.max_step_tokens
        return c.max_num_batched_tokens

    def _scheduled(self, out: SchedulerOutput, budget: int) -> SchedulerOutput:
        """Count a step made with rows, within `budget` tokens."""
        self.num_steps += 1
        if budget > self.config.max_num_batched_tokens:
            self.num_catch_up_steps += 1
        return out

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        budget = step_budget = self._step_budget()
        rows: list[ScheduledSeq] = []
        copies: list[KVCopy] = []

        # forks whose prefix is ready: the siblings join the decodes below
        for seq in self.running:
            if seq.index == 0 and seq.request.params.n > 1 and seq.num_computed >= self._prefill_target(seq):
                self._fork_siblings(seq, copies)

        # 1. decodes
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.needs_fork:
                continue
            if seq.num_tokens - seq.num_computed != 1 or self._prefill_target(seq) != seq.num_tokens:
                continue
            if budget < 1:
                break
            if not self._ensure_capacity(seq, seq.num_computed + 1, copies):
                continue
            rows.append(self._row(seq, seq.num_tokens))
            budget -= 1

        # 2. prompts part-way through
        decoding = {r.seq_id for r in rows}
        prompt_tokens = 0
        for seq in self.running:
            if budget < 1:
                break
            if seq.needs_fork or seq.seq_id in decoding:
                continue
            target = self._prefill_target(seq)
            if target - seq.num_computed < 1:
                continue
            end = min(target, seq.num_computed + budget)
            rows.append(self._row(seq, end))
            budget -= end - seq.num_computed
            prompt_tokens += end - seq.num_computed

        # 3. admissions: preempted sequences first, then new requests
        while budget > 0 and self.preempted:
            seq = self.preempted[0]
            if not self._admit([seq], [self._initial_capacity(seq.request, seq.num_tokens)]):
                break
            self.preempted.popleft()
            end = min(self._prefill_target(seq), budget)
            rows.append(self._row(seq, end))
            budget -= end
            prompt_tokens += end
        if not self.preempted:
            self._admit_waiting(budget, step_budget, rows, copies, prompt_tokens=prompt_tokens)

        gone, self._gone = self._gone, []
        out = SchedulerOutput(seqs=rows, kv_copies=copies, step=self._step, finished_seq_ids=gone)
        return self._scheduled(out, step_budget) if rows else out

    def _prompt_room(self, step_budget: int, ending: int = 0) -> int:
        """Tokens a step may give to prompts when it admits new requests: the step's budget
        (_step_budget) less a row for each sequence that
        will be decoding once the waiting requests are in (at most max_num_seqs, at most half
        of max_num_batched_tokens; `ending`: running sequences about to end).

        Requests admitted in one step finish in one step, and under a fixed concurrency
        their successors arrive together: a burst taken in while few sequences decode, at
        more prompts a step than the server keeps up once they all decode, comes back as a
        wave that outruns what later steps can take, and every later request waits in a
        queue that does not drain. A lone request still gets (nearly) the whole budget."""
        c = self.config
        cap = min(c.max_num_seqs, c.max_num_batched_tokens // 2)
        decoding = len(self.running) - ending + len(self.preempted)
        for request in self.waiting:
            if decoding >= cap:
                break
            decoding += request.params.n
        return step_budget - min(decoding, cap)

    def _admit_waiting(self, budget: int, step_budget: int, rows: list[ScheduledSeq], copies: list[KVCopy],
                       ending: int = 0, prompt_tokens: int = 0) -> None:
        """New requests, in arrival order, while the budget (within _prompt_room, of which
        `prompt_tokens` are already the step's), max_num_seqs and the pool allow: the first
        chunk of each one's prompt (`ending`, `step_budget`: as _admit, _prompt_room)."""
        if self.waiting:
            budget = min(budget, self._prompt_room(step_budget, ending) - prompt_tokens)
        while budget > 0 and self.waiting:
            request = self.waiting[0]
            capacity = self._initial_capacity(request, request.num_prompt_tokens)
            if not self._admit(request.seqs, [capacity] * len(request.seqs), ending):
                break
            self.waiting.popleft()
            if request.timings.first_scheduled is None:
                request.timings.first_scheduled = time.monotonic()
            seq0 = request.seqs[0]
            target = self._prefill_target(seq0)
            if target == 0:  # one-token prompt and n > 1: nothing to share, all decode next step
                self._fork_siblings(seq0, copies)
                continue
            end = min(target, budget)
            rows.append(self._row(seq0, end))
            budget -= end

    def schedule_ahead(self, prev: SchedulerOutput, max_rows: int) -> SchedulerOutput | None:
        """The step after `prev`, scheduled while `prev` still runs (before update(prev)), or
        None when it cannot be known yet. Its rows, in schedule()'s order:
        - a decode row for each row of prev that samples, one position on, its input the
          token prev samples (pending_tokens=1: the runner takes it on the device); at most
          max_rows of them. A row whose token ends it by length (max_tokens, the context
          limit) gets none: update(prev) finishes it;
        - the next chunk of each prompt prev ran part of (its tokens are known);
        - new requests admitted from the waiting queue, as schedule() admits them.
        The last two only with SchedulerConfig.prompts_ahead, and only when the waiting
        requests fill the step (_prompts_fill): a step launched ahead is fixed before requests
        that arrive meanwhile could join it, which would cost them a step when there is room.
        Under a queue, the device then does not wait for the host's update and schedule
        between steps that take prompts. Without it, only steady decoding goes ahead: prev
        decoded every running sequence, and no one waits.

        None unless every running sequence is in prev and none needs anything only a plain
        step does: a region grown (a move would copy a token not counted yet), preempted
        sequences readmitted, a fork, prompt logprobs. A row that prev's token turns out to
        stop (EOS, stop token or string) has a token computed in vain: update skips finished
        sequences, as it does for any sequence that finishes while a step is in flight.
        """
        if self.preempted or not prev.seqs:
            return None
        if not self.config.prompts_ahead and (self.waiting or any(len(r.token_ids) != 1 for r in prev.seqs)):
            return None  # before building rows (a one-token prompt chunk part-way is caught below)
        in_prev = {row.seq_id for row in prev.seqs}
        if any(seq.seq_id not in in_prev for seq in self.running):
            return None
        budget = step_budget = self._step_budget()
        decodes: list[ScheduledSeq] = []
        chunks: list[tuple[ScheduledSeq, int]] = []  # prev's prompt rows part-way, and where they go to
        ending: list[int] = []  # sequences whose token from prev is their last
        # the loop below runs for every row of every step launched ahead (256 at a time under
        # load), on the host's path between two steps: its lookups are hoisted
        seqs, region, running, max_model_len = self._seqs, self.kv.region, SeqStatus.RUNNING, self.max_model_len
        for row in prev.seqs:
            seq = seqs.get(row.seq_id)
            if seq is None or seq.status is not running:
                continue  # aborted meanwhile
            if seq.needs_fork or row.want_prompt_logprobs or seq.num_computed != row.start_pos:
                return None
            request = seq.request
            params = request.params
            if row.sample:
                output = seq.output_token_ids
                generated = len(output) + 1  # with prev's token
                if ((params.max_tokens is not None and generated >= params.max_tokens)
                        or seq.num_tokens + 1 >= max_model_len):
                    ending.append(seq.seq_id)  # prev's token is its last
                    continue
                start, capacity = region(seq.seq_id)
                kv_len = row.kv_len
                if kv_len + 1 > capacity:
                    return None
                decodes.append(ScheduledSeq(
                    seq_id=seq.seq_id, token_ids=row.token_ids[-1:], start_pos=kv_len, kv_start=start,
                    sample=True, sampling=params, output_token_ids=output,
                    prompt_token_ids=request.prompt_token_ids, rng_seed=seq.rng_seed, pending_tokens=1))
            else:
                target = self._prefill_target(seq)
                if row.kv_len < target:
                    chunks.append((row, target))  # cut once the decodes have taken their share
        if not self.config.prompts_ahead and chunks:
            return None
        if len(decodes) > max_rows or len(decodes) > budget:
            return None
        budget -= len(decodes)
        prompt_tokens = sum(target - row.kv_len for row, target in chunks)
        room = min(budget, self._prompt_room(step_budget, len(ending))) if self.waiting else budget
        if (chunks or self.waiting) and not self._prompts_fill(room - prompt_tokens, len(ending)):
            return None  # a plain step, scheduled once prev is done, can take what arrives meanwhile
        rows = decodes
        chunk_tokens = 0  # what the chunks take of the budget
        for row, target in chunks:
            if budget < 1:
                break
            end = min(target, row.kv_len + budget)
            rows.append(self._row(self._seqs[row.seq_id], end, start=row.kv_len))
            budget -= end - row.kv_len
            chunk_tokens += end - row.kv_len
        copies: list[KVCopy] = []
        # the ending sequences' places go to new ones already (their regions are freed by
        # update(prev)); the runner lets go of their state when this step is submitted, after
        # prev on its stream
        self._admit_waiting(budget, step_budget, rows, copies, ending=len(ending), prompt_tokens=chunk_tokens)
        if not rows:
            return None
        self._step += 1
        gone, self._gone = self._gone, []
        return self._scheduled(SchedulerOutput(seqs=rows, kv_copies=copies, step=self._step,
                                               finished_seq_ids=gone + ending, chained=True), step_budget)

    def _prompts_fill(self, budget: int, ending: int) -> bool:
        """Whether the waiting requests would use up a step's prompt budget (what is left of
        it after the prompts part-way through), or its room for sequences (max_num_seqs, with
        `ending` places about to free): then a request arriving later could not have joined
        that step anyway, and launching it ahead costs no one a step. (The pool's room is
        left to _admit.)"""
        if budget <= 0:
            return True
        room = self.config.max_num_seqs - (len(self.running) - ending)
        for request in self.waiting:
            room -= request.params.n
            if room < 0:
                return True
            budget -= request.num_prompt_tokens
            if budget <= 0:
                return True
        return room <= 0

    # ------------------------------------------------------------ update

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[Sequence]:
        """Apply a step's results; returns the sequences that got a token or finished."""
        touched: list[Sequence] = []
        for row in out.seqs:
            seq = self._seqs.get(row.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue  # aborted meanwhile
            seq.num_computed = row.kv_len
            request = seq.request
            if row.want_prompt_logprobs and row.seq_id in result.prompt_logprobs:
                request.prompt_logprobs.extend(result.prompt_logprobs[row.seq_id])
            if row.sample:
                token = result.sampled[row.seq_id]
                seq.output_token_ids.append(token)
                if row.seq_id in result.logprobs:
                    seq.output_logprobs.append(result.logprobs[row.seq_id])
                self._check_stop(seq, token)
                touched.append(seq)
            elif request.params.max_tokens == 0 and seq.num_computed >= request.num_prompt_tokens:
                self.finish(seq, FinishReason.LENGTH)
                touched.append(seq)
        return touched

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.request.params
        n_out = len(seq.output_token_ids)
        if n_out >= params.min_tokens:
            if token in params.stop_token_ids:
                return self.finish(seq, FinishReason.STOP, token)
            if not params.ignore_eos and token in self.eos_token_ids:
                return self.finish(seq, FinishReason.STOP)
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return self.finish(seq, FinishReason.LENGTH)
        if seq.num_tokens >= self.max_model_len:
            return self.finish(seq, FinishReason.LENGTH)
        return None

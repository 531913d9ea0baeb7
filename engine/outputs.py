"""The contract between the scheduler and the runners: plain data, no arrays.

The scheduler emits one `SchedulerOutput` per step; a runner (NumPy or CUDA)
executes it and returns one `RunnerOutput`. Both runners take the same input and
return the same output, which is how the GPU is checked against the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import SamplingParams


@dataclass(slots=True)  # a row a sequence a step: slots make them quicker to build and read
class ScheduledSeq:
    """One sequence's share of a step: a decode token or a chunk of its prompt."""

    seq_id: int
    token_ids: list[int]  # tokens to run now: a prefill chunk, or the one last sampled token
    start_pos: int  # position of token_ids[0] = tokens of this sequence already in its KV region
    kv_start: int  # first slot of the sequence's contiguous KV region in the pool
    sample: bool  # sample a next token after this chunk (False for non-final prefill chunks)
    sampling: SamplingParams | None = None  # needed when sample is True
    # tokens generated so far (penalties, seeded draws); the scheduler's own list
    output_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)  # repetition penalty covers the prompt too
    want_prompt_logprobs: bool = False  # return logprobs of the prompt tokens this chunk predicts
    rng_seed: int = 0  # the sequence's sampling stream; draws are keyed by (rng_seed, tokens generated)
    # tokens generated that output_token_ids does not hold yet: 1 in a step scheduled ahead
    # (SchedulerOutput.chained), whose previous step's token is still on the device
    pending_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def kv_len(self) -> int:  # tokens in the KV region once this chunk is written
        return self.start_pos + len(self.token_ids)


@dataclass
class KVCopy:
    """Copy the first `num_tokens` KV slots of one region to another (n > 1 siblings)."""

    src_start: int
    dst_start: int
    num_tokens: int


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]  # decodes first, then prefill chunks
    kv_copies: list[KVCopy] = field(default_factory=list)  # run before the forward pass
    step: int = 0
    # sequences finished or preempted since the last step: per-sequence runner state may go
    finished_seq_ids: list[int] = field(default_factory=list)
    # scheduled ahead, while the previous step ran (Scheduler.schedule_ahead): its rows with
    # pending_tokens decode what that step samples, taken on the device (their token_ids hold
    # stale values); the others are prompt chunks, as in any step
    chained: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class TokenLogprobs:
    """Log-probability of one chosen token and the top-n alternatives at its position."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class RunnerOutput:
    sampled: dict[int, int] = field(default_factory=dict)  # seq_id -> sampled token id
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # seq_id -> of the sampled token
    # seq_id -> logprobs of the prompt tokens this chunk scored (position start_pos + 1 on)
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)

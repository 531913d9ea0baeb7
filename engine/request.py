"""Requests, their sampling parameters and per-request state. No arrays here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top-n alternatives a request may ask for (OpenAI allows 20)
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI allows 300)
MAX_STOP_TOKEN_IDS = 256
# characters of a request's stop strings in all: the detokenizer builds a table of each on the
# engine's thread (~0.2 us a character), and a stop string longer than any output is no use
MAX_STOP_CHARS = 16384


class FieldError(ValueError):
    """A request field the engine refuses (ValueError); `field` names it, as the API's param."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def check_stop_strings(stop) -> None:
    """Raise ValueError unless stop is a sequence of non-empty strings within MAX_STOP_CHARS."""
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError("stop strings must be non-empty strings")
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_CHARS:
        raise ValueError(f"stop strings may have at most {MAX_STOP_CHARS} characters in all, got {total}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ValueError."""

    n: int = 1  # sequences generated from one prompt
    max_tokens: int | None = 16  # None: up to the context limit
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int | None = None  # None = all tokens
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict, hash=False)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; k: the chosen token's logprob and the top k
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in dict(self.logit_bias).items()})
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            raise bad("max_tokens", "an integer >= 0")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "between 0 and 100")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise bad("top_k", "an integer >= 1 (or unset)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "between -2 and 2")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "between -2 and 2")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "in (0, 2]")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"an integer between 0 and {MAX_LOGPROBS}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may have at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for bias in self.logit_bias.values():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be between -100 and 100, got {bias}")
        check_stop_strings(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids this request names must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            for tid in ids:
                if not 0 <= tid < vocab_size:
                    raise FieldError(name, f"token id {tid} is outside the vocabulary (0..{vocab_size - 1})")


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the client went away or the engine was asked to abort


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted and waiting to be recomputed
    RUNNING = "running"  # owns a KV region
    FINISHED = "finished"


@dataclass
class RequestTimings:
    arrival: float = field(default_factory=time.monotonic)
    received: float | None = None  # the engine took it from its inbox (Engine._drain_inbox), between steps
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to the first scheduled step (None before it)."""
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def inbox_time(self) -> float | None:
        """Of the queue time, the seconds until the engine's loop took the request in (None before it)."""
        return None if self.received is None else self.received - self.arrival


class Sequence:
    """One generated continuation of a request (a request with n > 1 has n of them)."""

    def __init__(self, seq_id: int, request: Request, index: int, rng_seed: int) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index  # sibling index, 0..n-1
        self.rng_seed = rng_seed
        self.output_token_ids: list[int] = []
        self.num_computed = 0  # tokens whose K/V are in the sequence's region
        self.status = SeqStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.num_preemptions = 0
        self.needs_fork = False  # n > 1: waits to copy sibling 0's prompt prefix
        self.output_logprobs: list = []  # TokenLogprobs per output token (when asked for)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        prompt = self.request.prompt_token_ids
        p = len(prompt)
        if end <= p:
            return prompt[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return prompt[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.request.request_id}#{self.index}, {self.status.value}, "
                f"computed={self.num_computed}/{self.num_tokens})")


class Request:
    """A prompt, how to sample from it, and its sequences' progress."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival: float | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.timings = RequestTimings() if arrival is None else RequestTimings(arrival=arrival)
        self.seqs: list[Sequence] = []
        self.prompt_logprobs: list = []  # TokenLogprobs of prompt tokens 1.. (when asked for)
        self.queued_after = 0  # the steps the scheduler had made when it queued this (Scheduler._step_budget)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs  # (n = 1 without a generator: asked for each token the engine emits)
        if len(seqs) == 1:
            return seqs[0].status is SeqStatus.FINISHED
        return all(s.status is SeqStatus.FINISHED for s in seqs)

    @property
    def num_generated_tokens(self) -> int:
        seqs = self.seqs
        if len(seqs) == 1:
            return len(seqs[0].output_token_ids)
        return sum(len(s.output_token_ids) for s in seqs)

"""Token sampling in NumPy; the CUDA sampler implements the same rules.

Per row, in this order (as vLLM does):
  1. logit_bias is added; eos and stop_token_ids are masked while fewer than
     min_tokens tokens were generated;
  2. repetition penalty (prompt and output tokens: positive logits divided, negative
     multiplied), then frequency and presence penalties (output tokens);
  3. greedy (temperature 0) takes the argmax; otherwise logits are divided by the
     temperature, top-k keeps logits >= the k-th largest, min-p keeps probabilities
     >= min_p * the largest, top-p keeps the largest probabilities whose sum reaches
     top_p (computed after the other filters, renormalised);
  4. the token is drawn by inverse CDF, in token-id order, with a uniform number that
     depends only on (the sequence's rng seed, how many tokens it has generated), so a
     seeded request gives the same tokens whatever else is in the batch.
Logprobs are those of the model's raw distribution (log-softmax of unprocessed logits).
"""

from __future__ import annotations

import numpy as np

from ..outputs import RunnerOutput, ScheduledSeq, SchedulerOutput, TokenLogprobs

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, counter: int) -> float:
    """A uniform number in [0, 1) with 24 random bits (exact in float32)."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ (counter & _MASK64)) >> 40) / float(1 << 24)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def token_logprobs(logprobs_row: np.ndarray, token_id: int, top_n: int) -> TokenLogprobs:
    chosen = float(logprobs_row[token_id])
    rank = int(np.count_nonzero(logprobs_row > chosen)) + 1
    top: list[tuple[int, float]] = []
    if top_n > 0:
        idx = np.argpartition(-logprobs_row, top_n - 1)[:top_n]
        idx = idx[np.lexsort((idx, -logprobs_row[idx]))]  # best first, lower id on ties
        top = [(int(i), float(logprobs_row[i])) for i in idx]
    return TokenLogprobs(token_id=token_id, logprob=chosen, rank=rank, top=top)


def process_logits(logits: np.ndarray, s: ScheduledSeq, eos_token_ids: tuple[int, ...] = ()) -> np.ndarray:
    """Steps 1-2 for one row (a copy of `logits` when anything applies)."""
    p = s.sampling
    out = logits
    if p.logit_bias:
        out = out.copy()
        ids = np.fromiter(p.logit_bias.keys(), np.int64)
        out[ids] += np.fromiter(p.logit_bias.values(), np.float32)
    if len(s.output_token_ids) < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        if banned:
            out = out.copy() if out is logits else out
            out[banned] = -np.inf
    if p.repetition_penalty != 1.0 and (s.output_token_ids or s.prompt_token_ids):
        out = out.copy() if out is logits else out
        seen = np.unique(np.fromiter(s.prompt_token_ids + s.output_token_ids, np.int64))
        vals = out[seen]
        out[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and s.output_token_ids:
        out = out.copy() if out is logits else out
        ids, counts = np.unique(np.fromiter(s.output_token_ids, np.int64), return_counts=True)
        out[ids] -= p.frequency_penalty * counts + p.presence_penalty
    return out


def allowed_probs(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float,
                  min_p: float) -> np.ndarray:
    """Step 3 for one non-greedy row: the renormalised distribution over allowed tokens."""
    scaled = logits.astype(np.float64) / temperature
    if top_k is not None and top_k < scaled.size:
        kth = np.partition(scaled, -top_k)[-top_k]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if min_p > 0.0:
        probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    if top_p < 1.0:
        threshold = _nucleus_threshold(probs, top_p)
        probs = np.where(probs >= threshold, probs, 0.0)
        probs /= probs.sum()
    return probs


def _nucleus_threshold(probs: np.ndarray, top_p: float) -> float:
    """top-p's threshold: the value at which the running sum of the probabilities in descending
    order first reaches top_p. Zeros sort last and add nothing, and the running sums over the m
    largest values, in that order, are the first m of the full sort's: so they are taken over
    the nonzero values, from the largest 64, 512, ... first."""
    need = top_p * (1.0 - 1e-12)  # the smallest prefix whose mass reaches top_p; its last value
    vals = probs[probs > 0.0]
    m = 64
    while True:
        whole = m >= vals.size
        desc = np.sort(vals if whole else np.partition(vals, vals.size - m)[vals.size - m:])[::-1]
        cut = int(np.searchsorted(np.cumsum(desc), need))
        if cut < desc.size or whole:
            return float(desc[min(cut, desc.size - 1)])  # past the end (rounding): every nonzero value
        m *= 8


def draw(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw in token-id order; never returns a zero-probability token. The running
    sums over the nonzero probabilities alone are the full ones at their ids (zeros add nothing)."""
    kept = np.flatnonzero(probs)
    cdf = np.cumsum(probs[kept] if kept.size < probs.size else probs)
    at = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(kept[min(at, kept.size - 1)])  # past the end (rounding): the last kept token


def sample_rows(out: SchedulerOutput, logits: np.ndarray, all_logits: bool = False,
                eos_token_ids: tuple[int, ...] = ()) -> RunnerOutput:
    """Sample every row of `out` that asks for it from its last token's logits.

    logits: (len(out.seqs), vocab), or (out.num_tokens, vocab) when all_logits.
    """
    result = RunnerOutput()
    ends = np.cumsum([s.num_tokens for s in out.seqs])
    last = ends - 1 if all_logits else np.arange(len(out.seqs))
    need_lp = [r for r, s in enumerate(out.seqs) if s.sample and s.sampling.logprobs is not None]
    raw_lp = {r: lp for r, lp in zip(need_lp, log_softmax(logits[last[need_lp]])) } if need_lp else {}

    for r, s in enumerate(out.seqs):
        if s.want_prompt_logprobs:
            result.prompt_logprobs[s.seq_id] = _prompt_logprobs(s, logits[ends[r] - s.num_tokens:ends[r]])
        if not s.sample:
            continue
        p = s.sampling
        row = process_logits(logits[last[r]], s, eos_token_ids)
        if p.greedy:
            token = int(np.argmax(row))
        else:
            probs = allowed_probs(row, p.temperature, p.top_k, p.top_p, p.min_p)
            token = draw(probs, seeded_uniform(s.rng_seed, len(s.output_token_ids)))
        result.sampled[s.seq_id] = token
        if r in raw_lp:
            result.logprobs[s.seq_id] = token_logprobs(raw_lp[r], token, p.logprobs)
    return result


def _prompt_logprobs(s: ScheduledSeq, chunk_logits: np.ndarray) -> list[TokenLogprobs]:
    """Logprobs of the prompt tokens predicted inside this chunk (positions start_pos+1 on)."""
    prompt = s.prompt_token_ids
    first, last = s.start_pos + 1, min(s.kv_len, len(prompt) - 1)  # predicted positions
    if last < first:
        return []
    lp = log_softmax(chunk_logits[: last - first + 1])
    top_n = s.sampling.prompt_logprobs or 0
    return [token_logprobs(lp[j], prompt[first + j], top_n) for j in range(last - first + 1)]

"""Sampling rules of the runners (NumPy implementation)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.outputs import ScheduledSeq, SchedulerOutput
from engine.request import SamplingParams
from engine.runner.sampling import _nucleus_threshold, allowed_probs, draw, log_softmax, sample_rows, seeded_uniform

V = 1000
DRAWS = 10_000


def rows(logits: np.ndarray, params: SamplingParams, n: int, **seq_kwargs) -> SchedulerOutput:
    return SchedulerOutput([ScheduledSeq(i, [1], 5, 0, True, params, rng_seed=i, **seq_kwargs) for i in range(n)])


def draw_many(logits: np.ndarray, params: SamplingParams, n: int = DRAWS) -> np.ndarray:
    out = sample_rows(rows(logits, params, n), np.repeat(logits[None], n, axis=0))
    return np.array([out.sampled[i] for i in range(n)])


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.fixture(scope="module")
def logits():
    return (np.random.default_rng(0).standard_normal(V) * 3).astype(np.float32)


def test_top_k_never_leaves_the_k_best(logits):
    allowed = set(np.argsort(-logits)[:7])
    picks = draw_many(logits, SamplingParams(temperature=1.0, top_k=7))
    assert set(picks) <= allowed and len(set(picks)) == 7


def test_top_p_never_leaves_the_nucleus(logits):
    probs = softmax(logits.astype(np.float64))
    order = np.argsort(-probs)
    cut = int(np.searchsorted(np.cumsum(probs[order]), 0.6)) + 1
    nucleus = set(order[:cut])
    picks = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.6))
    assert set(picks) <= nucleus and len(set(picks)) > 1


def test_min_p_never_picks_unlikely_tokens(logits):
    probs = softmax(logits.astype(np.float64))
    allowed = set(np.flatnonzero(probs >= 0.1 * probs.max()))
    picks = draw_many(logits, SamplingParams(temperature=1.0, min_p=0.1))
    assert set(picks) <= allowed and len(set(picks)) > 1


def test_combined_filters_and_temperature(logits):
    scaled = logits.astype(np.float64) / 0.7
    top = np.argsort(-scaled)[:20]
    probs = softmax(scaled[top])
    keep = probs >= 0.05 * probs.max()
    sub, kept = probs[keep] / probs[keep].sum(), top[keep]
    order = np.argsort(-sub)
    cut = int(np.searchsorted(np.cumsum(sub[order]), 0.9)) + 1
    allowed = set(kept[order[:cut]])
    picks = draw_many(logits, SamplingParams(temperature=0.7, top_k=20, min_p=0.05, top_p=0.9))
    assert set(picks) <= allowed


@pytest.mark.parametrize("size", [7, 64, 65, 600, 49152])
def test_top_p_threshold_and_draw_are_those_of_the_full_sort_and_cdf(size):
    """The nucleus threshold taken from the largest 64, 512, ... nonzero values keeps what the full
    sort's keeps, and the draw over the nonzero probabilities alone gives the full cdf's token:
    peaked, flat, tied and partly zero rows, top_p from 0.1 to 1 - 1e-6."""
    r = np.random.default_rng(size)
    for shape in ("peaked", "flat", "ties", "zeros"):
        x = r.standard_normal(size) * (0.1 if shape == "flat" else 3)
        x = np.round(x) if shape == "ties" else x
        p = np.exp(x - x.max())
        p[r.random(size) < (0.5 if shape == "zeros" else 0.0)] = 0.0
        p[np.argmax(x)] = 1.0
        p /= p.sum()
        desc = np.sort(p)[::-1]
        cum = np.cumsum(desc)
        for top_p in (0.1, 0.5, 0.9, 0.99, 1 - 1e-6):
            want = desc[min(int(np.searchsorted(cum, top_p * (1.0 - 1e-12))), size - 1)]
            got = _nucleus_threshold(p, top_p)
            assert got > 0 and np.array_equal(p >= got, p >= want), (shape, top_p)
        cdf = np.cumsum(p)
        for u in np.append(r.random(20), [0.0, 1.0 - 2**-24]):
            want = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
            want = want if want < size and p[want] > 0 else int(np.flatnonzero(p)[-1])
            assert draw(p, float(u)) == want, (shape, u)


def test_draws_follow_the_distribution(logits):
    params = SamplingParams(temperature=1.0, top_k=5)
    picks = draw_many(logits, params)
    probs = allowed_probs(logits, 1.0, 5, 1.0, 0.0)
    for token in np.flatnonzero(probs):
        freq = np.mean(picks == token)
        assert abs(freq - probs[token]) < 4 * np.sqrt(probs[token] * (1 - probs[token]) / DRAWS) + 1e-3


def test_greedy_bias_and_min_tokens(logits):
    best = int(np.argmax(logits))
    out = sample_rows(rows(logits, SamplingParams(temperature=0), 1), logits[None])
    assert out.sampled[0] == best
    forced = sample_rows(rows(logits, SamplingParams(temperature=0, logit_bias={3: 100.0}), 1), logits[None])
    assert forced.sampled[0] == 3
    banned = sample_rows(rows(logits, SamplingParams(temperature=0, min_tokens=2), 1), logits[None],
                         eos_token_ids=(best,))
    assert banned.sampled[0] != best


def test_penalties(logits):
    best = int(np.argmax(logits))
    second = int(np.argsort(-logits)[1])
    gap = float(logits[best] - logits[second])
    history = {"output_token_ids": [best, best]}
    p = SamplingParams(temperature=0, frequency_penalty=gap / 2 + 0.01)  # two repeats: 2 * penalty > gap
    assert sample_rows(rows(logits, p, 1, **history), logits[None]).sampled[0] == second
    p = SamplingParams(temperature=0, presence_penalty=min(gap / 2, 2.0))  # once, below the gap
    assert sample_rows(rows(logits, p, 1, **history), logits[None]).sampled[0] == best
    # repetition: positive logits of seen tokens (prompt included) are divided, negative multiplied
    small = np.array([4.0, 3.0, -1.0, -1.5], np.float32)
    rep = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample_rows(rows(small, rep, 1, prompt_token_ids=[0]), small[None]).sampled[0] == 1  # 4/2 < 3
    only_neg = np.array([-1.0, -1.5, -9.0, -9.0], np.float32)
    assert sample_rows(rows(only_neg, rep, 1, output_token_ids=[0]), only_neg[None]).sampled[0] == 1  # -2 < -1.5


def test_logprobs_are_those_of_the_raw_distribution(logits):
    params = SamplingParams(temperature=0.5, top_k=3, logprobs=5, seed=1)
    out = sample_rows(rows(logits, params, 1), logits[None])
    lp = out.logprobs[0]
    raw = log_softmax(logits[None].astype(np.float64))[0]
    assert lp.token_id == out.sampled[0]
    assert lp.logprob == pytest.approx(raw[lp.token_id], abs=1e-5)
    assert [t for t, _ in lp.top] == list(np.argsort(-logits)[:5])
    assert lp.rank == 1 + int(np.sum(raw > raw[lp.token_id]))


def test_seeded_uniform_is_a_fixed_function():
    assert seeded_uniform(42, 0) == seeded_uniform(42, 0)
    assert seeded_uniform(42, 0) != seeded_uniform(42, 1) != seeded_uniform(43, 1)
    us = np.array([seeded_uniform(7, i) for i in range(20000)])
    assert 0.0 <= us.min() and us.max() < 1.0 and abs(us.mean() - 0.5) < 0.01


def test_invalid_sampling_params_raise_readable_errors():
    for kwargs, word in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": 0}, "top_k"),
                         ({"min_p": 2}, "min_p"), ({"n": 0}, "n"), ({"max_tokens": -1}, "max_tokens"),
                         ({"presence_penalty": 3}, "presence_penalty"), ({"logprobs": 21}, "logprobs"),
                         ({"logit_bias": {1: 500}}, "logit_bias"), ({"stop": [""]}, "stop"),
                         ({"stop": ["ab", "c" * 16383]}, "stop strings may have at most 16384 characters"),
                         ({"min_tokens": 5, "max_tokens": 2}, "min_tokens")]:
        with pytest.raises(ValueError, match=word):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(logit_bias={10**6: 1.0}).check_vocab(V)

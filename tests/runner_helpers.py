"""Drive a runner directly with hand-made SchedulerOutputs (no scheduler involved)."""

from __future__ import annotations

import numpy as np

from engine.outputs import ScheduledSeq, SchedulerOutput

REGION = 512  # KV slots given to each test sequence


def prefill_step(prompts: list[list[int]]) -> SchedulerOutput:
    """All prompts as one ragged prefill batch; sequence i owns slots [i * REGION, ...)."""
    return SchedulerOutput([ScheduledSeq(i, p, 0, i * REGION, True) for i, p in enumerate(prompts)])


def decode_step(tokens: list[int], positions: list[int]) -> SchedulerOutput:
    return SchedulerOutput([ScheduledSeq(i, [t], pos, i * REGION, True)
                            for i, (t, pos) in enumerate(zip(tokens, positions))])


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())

"""The contiguous-region allocator behind the KV pool."""

from __future__ import annotations

import random

import pytest

from engine.kv_cache import KVCache


def test_allocate_free_and_usage():
    kv = KVCache(160, block_size=16)
    assert kv.usage == 0.0
    a = kv.allocate(1, 20)  # rounds up to 32
    b = kv.allocate(2, 16)
    assert (a, b) == (0, 32) and kv.region(1) == (0, 32) and kv.num_free_slots == 112
    assert kv.usage == pytest.approx(48 / 160)
    kv.free(1)
    kv.free(2)
    assert kv.usage == 0.0 and kv.largest_free() == 160


def test_best_fit_and_merging():
    kv = KVCache(160, block_size=16)
    for sid in range(5):
        kv.allocate(sid, 32)
    kv.free(1)  # hole of 32 at 32
    kv.free(3)  # hole of 32 at 96
    assert kv.largest_free() == 32
    assert kv.can_allocate([32, 32]) and not kv.can_allocate([64])
    kv.free(2)  # holes merge: 32..128
    assert kv.largest_free() == 96
    assert kv.allocate(9, 48) == 32


def test_grow_in_place_then_move():
    kv = KVCache(128, block_size=16)
    kv.allocate(1, 16)
    assert kv.grow(1, 32) is None and kv.region(1) == (0, 32)  # in place
    kv.allocate(2, 16)  # right after 1
    assert kv.can_grow(1, 48)
    old = kv.grow(1, 48)
    assert old == 0 and kv.region(1) == (48, 48)  # moved past 2
    assert kv.num_free_slots == 128 - 64


def test_move_may_reuse_its_own_freed_slots():
    kv = KVCache(96, block_size=16)
    kv.allocate(1, 16)
    kv.allocate(2, 32)  # 16..48
    kv.free(1)  # 0..16 free, 48..96 free
    kv.allocate(3, 16)  # 0..16 (best fit)
    kv.free(3)
    assert kv.can_grow(2, 96 - 16)  # 2 can take 16..96 by extending in place
    assert kv.grow(2, 80) is None and kv.region(2) == (16, 80)


def test_grow_failure_restores_the_region():
    kv = KVCache(64, block_size=16)
    kv.allocate(1, 32)
    kv.allocate(2, 32)
    assert not kv.can_grow(1, 48)
    with pytest.raises(MemoryError):
        kv.grow(1, 48)
    assert kv.region(1) == (0, 32) and kv.num_free_slots == 0


def test_random_operations_keep_the_books():
    rng = random.Random(0)
    kv = KVCache(1024, block_size=16)
    owned: dict[int, tuple[int, int]] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.4 and kv.can_allocate([need := rng.randint(1, 100)]):
            kv.allocate(step, need)
            owned[step] = kv.region(step)
        elif op < 0.7 and owned:
            sid = rng.choice(list(owned))
            kv.free(sid)
            del owned[sid]
        elif owned:
            sid = rng.choice(list(owned))
            target = owned[sid][1] + rng.randint(1, 64)
            if kv.can_grow(sid, target):
                kv.grow(sid, target)
                owned[sid] = kv.region(sid)
        # regions are disjoint, inside the pool, and the free count adds up
        spans = sorted(owned.values())
        for (s1, c1), (s2, _) in zip(spans, spans[1:]):
            assert s1 + c1 <= s2
        assert all(0 <= s and s + c <= kv.num_slots for s, c in spans)
        assert kv.num_free_slots == kv.num_slots - sum(c for _, c in spans)
    for sid in list(owned):
        kv.free(sid)
    assert kv.usage == 0.0 and kv.largest_free() == kv.num_slots

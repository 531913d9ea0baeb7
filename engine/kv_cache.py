"""KV memory bookkeeping: which sequence owns which slots of the pool. No arrays.

The pool is `num_slots` token slots (the runners hold the arrays, one slot = K and V
of one token in every layer). Each sequence owns one contiguous region
[start, start + capacity), so the attention kernels need one pointer per sequence
(`batched_k_ptrs`). Regions are handed out in blocks of `block_size` slots, best fit.

Policy (no request fails because memory ran out mid-generation):
  * admission reserves the prompt plus a first stretch of output
    (min(max_tokens, `initial_decode_slots`));
  * a region that fills up grows: in place when the slots after it are free,
    otherwise by moving to a larger free region (the scheduler emits a KVCopy);
  * when no region is large enough, the scheduler preempts the most recently
    admitted sequences (their slots are freed and they are recomputed later, keeping
    the tokens they generated) until the growth fits.
"""

from __future__ import annotations

import bisect


class KVCache:
    def __init__(self, num_slots: int, block_size: int = 16) -> None:
        if block_size < 1 or num_slots < block_size:
            raise ValueError(f"KV pool of {num_slots} slots is smaller than one block of {block_size}")
        self.block_size = block_size
        self.num_slots = num_slots - num_slots % block_size
        self._free: list[tuple[int, int]] = [(0, self.num_slots)]  # (start, length), sorted by start
        self._regions: dict[int, tuple[int, int]] = {}  # seq_id -> (start, capacity)
        self._used = 0

    # ------------------------------------------------------------ queries

    def round_up(self, num_tokens: int) -> int:
        b = self.block_size
        return max(b, -(-num_tokens // b) * b)

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - self._used

    @property
    def usage(self) -> float:
        """Fraction of the pool owned by sequences (0.0 when idle)."""
        return self._used / self.num_slots

    def region(self, seq_id: int) -> tuple[int, int]:
        """(start, capacity) of the sequence's region."""
        return self._regions[seq_id]

    def owns(self, seq_id: int) -> bool:
        return seq_id in self._regions

    def largest_free(self) -> int:
        return max((length for _, length in self._free), default=0)

    # --------------------------------------------------- allocate / free

    def can_allocate(self, capacities: list[int]) -> bool:
        """Whether regions of all these sizes fit at once (first the largest)."""
        free = sorted((length for _, length in self._free), reverse=True)
        for need in sorted((self.round_up(c) for c in capacities), reverse=True):
            # best fit: the smallest free run that holds it
            idx = next((i for i in range(len(free) - 1, -1, -1) if free[i] >= need), None)
            if idx is None:
                return False
            free[idx] -= need
            free.sort(reverse=True)
        return True

    def allocate(self, seq_id: int, capacity: int) -> int:
        """Reserve a region of at least `capacity` slots; returns its start.

        Call can_allocate first: running out here is a bookkeeping bug.
        """
        if seq_id in self._regions:
            raise KeyError(f"sequence {seq_id} already owns a KV region")
        need = self.round_up(capacity)
        start = self._take(need)
        if start is None:
            raise MemoryError(f"no free KV region of {need} slots (largest {self.largest_free()})")
        self._regions[seq_id] = (start, need)
        self._used += need
        return start

    def free(self, seq_id: int) -> None:
        start, capacity = self._regions.pop(seq_id)
        self._used -= capacity
        self._give_back(start, capacity)

    # ----------------------------------------------------------- growing

    def can_grow(self, seq_id: int, capacity: int) -> bool:
        start, cap = self._regions[seq_id]
        need = self.round_up(capacity)
        if need <= cap or self._free_after(start + cap) >= need - cap:
            return True
        # moving: the old region is freed first, so it may merge with its neighbours
        return self._largest_free_if_released(start, cap) >= need

    def grow(self, seq_id: int, capacity: int) -> int | None:
        """Enlarge the region to hold `capacity` slots.

        Returns None when it grew in place, or the old start when it moved (the
        caller copies the old slots to the new region(seq_id)).
        """
        start, cap = self._regions[seq_id]
        need = self.round_up(capacity)
        if need <= cap:
            return None
        extra = need - cap
        if self._free_after(start + cap) >= extra:
            self._take_at(start + cap, extra)
            self._regions[seq_id] = (start, need)
            self._used += extra
            return None
        self.free(seq_id)
        new_start = self._take(need)
        if new_start is None:  # restore the old region before complaining
            self._take_at(start, cap)
            self._regions[seq_id] = (start, cap)
            self._used += cap
            raise MemoryError(f"no free KV region of {need} slots to grow sequence {seq_id}")
        self._regions[seq_id] = (new_start, need)
        self._used += need
        return start

    # ----------------------------------------------------------- free list

    def _take(self, need: int) -> int | None:
        best = None
        for i, (start, length) in enumerate(self._free):
            if length >= need and (best is None or length < self._free[best][1]):
                best = i
        if best is None:
            return None
        start, length = self._free[best]
        if length == need:
            del self._free[best]
        else:
            self._free[best] = (start + need, length - need)
        return start

    def _take_at(self, at: int, need: int) -> None:
        i = bisect.bisect_right(self._free, (at, float("inf"))) - 1
        start, length = self._free[i]
        if not (start <= at and at + need <= start + length):
            raise MemoryError(f"slots [{at}, {at + need}) are not free")
        pieces = [(start, at - start), (at + need, start + length - at - need)]
        self._free[i:i + 1] = [p for p in pieces if p[1] > 0]

    def _free_after(self, at: int) -> int:
        i = bisect.bisect_left(self._free, (at, 0))
        if i < len(self._free) and self._free[i][0] == at:
            return self._free[i][1]
        return 0

    def _give_back(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._free, (start, 0))
        self._free.insert(i, (start, length))
        # merge with the next, then the previous run
        if i + 1 < len(self._free) and start + length == self._free[i + 1][0]:
            self._free[i] = (start, length + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]

    def _largest_free_if_released(self, start: int, length: int) -> int:
        merged = length
        end = start + length
        for s, l in self._free:
            if s + l == start or s == end:
                merged += l
        return max(merged, self.largest_free())

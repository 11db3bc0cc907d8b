"""Offline binomial checkpointing schedules for a scan of known length.

The reverse pass of a scan of `length` steps needs the carry before each step, in
reverse order. With `checkpoints` slots for stored carries (the initial carry takes
one), Griewank's binomial schedule ("revolve", Griewank & Walther, ACM TOMS 26(1),
2000) minimises the number of steps run again. Here the forward pass is the user's
primal scan: it runs every step once anyway and may store any carry it passes for
free, so what is minimised is the number of steps the *backward* pass runs again.
Writing `t(l, s)` for Griewank's minimal number of forward steps to reverse `l`
steps with `s` snapshots,

    t(l, s) = r * l - binom(s + r, s + 1),  with r the least integer such that
                                            binom(s + r, s) >= l,

the backward pass of a scan of `n` steps with `c` slots reruns

    recomputed(n, c) = t(n + 1, c) - n

steps: reversing `n` steps after a free forward sweep is revolve on `n + 1` steps
whose first sweep is free. Both are checked against the dynamic programme that
defines the optimum in `tests/test_scan.py`.

A schedule is a set of integer tables that the scan's loops index at run time.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np


def binomial_steps(n: int, s: int) -> int:
    """Griewank's `t(n, s)`: the fewest forward steps that reverse `n` steps with `s`
    snapshots (the initial state's included), counting the first forward sweep."""
    if n <= 1:
        return 0
    if s <= 1:
        return n * (n - 1) // 2
    r = 0
    while math.comb(s + r, s) < n:
        r += 1
    return r * n - math.comb(s + r, s + 1)


def recomputed_steps(length: int, checkpoints: int) -> int:
    """Steps the backward pass runs again for a scan of `length` steps with
    `checkpoints` stored carries (the initial carry's included), after a forward pass
    that stored them."""
    if length <= 1:
        return 0
    return binomial_steps(length + 1, checkpoints) - length


def _reverse_cost(n: int, free: int) -> int:
    # The state at the start is in a slot, `free` more slots, no free sweep.
    return binomial_steps(n, free + 1)


def _argmin_convex(cost, lo: int, hi: int) -> int:
    # Smallest minimiser of a discretely convex function on [lo, hi]. (Ties are
    # broken towards storing early; Equinox's online Stumm-Walther schedule breaks
    # some the other way, with the same number of recomputations.)
    while lo < hi:
        mid = (lo + hi) // 2
        if cost(mid + 1) - cost(mid) >= 0:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _split_reverse(n: int, free: int) -> int:
    # Advance `m` steps, store, reverse the tail with one slot fewer, then the head.
    # Both terms are convex in `m` (their increments are repetition numbers, which
    # never decrease), so the sum is too.
    return _argmin_convex(
        lambda m: m + _reverse_cost(n - m, free - 1) + _reverse_cost(m, free), 1, n - 1
    )


def _split_sweep(n: int, free: int) -> int:
    # The forward pass stores the state `m` steps in, for free.
    return _argmin_convex(
        lambda m: recomputed_steps(n - m, free) + _reverse_cost(m, free), 1, n - 1
    )


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The tables of one schedule.

    - `primal_slot[k]`: slot the forward pass stores the carry before step `k` in,
      or -1.
    - Reversal `j` (of `length`, in execution order) loads slot `restore[j]`, runs
      steps `advance_step[begin[j]:end[j]]` (after each, storing the carry in slot
      `advance_slot[g]` when that is not -1), then reverses step `reverse[j]`.
    """

    length: int
    checkpoints: int
    primal_slot: np.ndarray
    restore: np.ndarray
    begin: np.ndarray
    end: np.ndarray
    reverse: np.ndarray
    advance_step: np.ndarray
    advance_slot: np.ndarray

    @property
    def recomputed(self) -> int:
        return len(self.advance_step)

    def backward_order(self) -> list[int]:
        """Steps the backward pass evaluates, in order (recomputations and the step
        evaluated for each reversal), as Equinox's tests print them."""
        order = []
        for j in range(self.length):
            order.extend(int(k) for k in self.advance_step[self.begin[j] : self.end[j]])
            order.append(int(self.reverse[j]))
        return order


@functools.lru_cache(maxsize=64)
def schedule(length: int, checkpoints: int) -> Schedule:
    """The optimal schedule for `length` steps and `checkpoints` slots (>= 1)."""
    if checkpoints < 1:
        raise ValueError(f"`checkpoints` must be at least 1; got {checkpoints}.")
    checkpoints = min(checkpoints, max(length, 1))
    primal_slot = np.full((length,), -1, np.int32)
    ops: list[tuple[str, int]] = []

    def quadratic(a: int, b: int, depth: int) -> None:
        for k in range(b - 1, a - 1, -1):
            ops.append(("restore", depth))
            ops.extend(("advance", i) for i in range(a, k))
            ops.append(("reverse", k))

    # An explicit stack instead of recursion: "all" checkpoints on 16k steps would
    # nest 16k deep. A task reverses steps [a, b) with the state `a` in slot `depth`
    # and `free` slots above it; "sweep" tasks are still inside the forward pass.
    if length:
        primal_slot[0] = 0
    stack = [("sweep", 0, length, 0, checkpoints - 1)] if length else []
    while stack:
        kind, a, b, depth, free = stack.pop()
        n = b - a
        if n == 1:
            ops.append(("restore", depth))
            ops.append(("reverse", a))
        elif free == 0:
            quadratic(a, b, depth)
        elif kind == "sweep":
            m = _split_sweep(n, free)
            primal_slot[a + m] = depth + 1
            stack.append(("reverse", a, a + m, depth, free))
            stack.append(("sweep", a + m, b, depth + 1, free - 1))
        else:
            m = _split_reverse(n, free)
            ops.append(("restore", depth))
            ops.extend(("advance", i) for i in range(a, a + m))
            ops.append(("store", depth + 1))
            stack.append(("reverse", a, a + m, depth, free))
            stack.append(("reverse", a + m, b, depth + 1, free - 1))

    # Fold the operations into one record per reversal: a load, advances (each
    # possibly followed by a store), the reversal. A load of the slot just stored is
    # a no-op and is dropped.
    restore, begin, end, reverse = [], [], [], []
    advance_step: list[int] = []
    advance_slot: list[int] = []
    same_as_slot = -1
    in_record = False
    for op, arg in ops:
        if op == "restore":
            if in_record:
                assert arg == same_as_slot, "a load in the middle of a reversal"
                continue
            restore.append(arg)
            begin.append(len(advance_step))
            in_record = True
            same_as_slot = arg
        elif op == "advance":
            advance_step.append(arg)
            advance_slot.append(-1)
            same_as_slot = -1
        elif op == "store":
            advance_slot[-1] = arg
            same_as_slot = arg
        else:
            end.append(len(advance_step))
            reverse.append(arg)
            in_record = False
            same_as_slot = -1
    return Schedule(
        length,
        checkpoints,
        primal_slot,
        np.asarray(restore, np.int32),
        np.asarray(begin, np.int32),
        np.asarray(end, np.int32),
        np.asarray(reverse, np.int32),
        np.asarray(advance_step, np.int32),
        np.asarray(advance_slot, np.int32),
    )

"""The timing the experiments share: each script puts the repository it measures
first on `sys.path` (an older commit's worktree, say), and imports this from its
own directory, which stays on the path."""

import time

import jax


def best_ms(fn, args, repeat: int) -> float:
    """The least time of `repeat` calls of `fn(*args)`, in ms, after one call that
    compiles it."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best * 1e3

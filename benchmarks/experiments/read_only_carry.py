"""Experiment: the gradient of a checkpointed `esb.scan` whose carry the step only
reads (a table, a buffer returned as it is), against `lax.scan`.

Such a carry is the same at every step. Stored at checkpoints like any other, the
reverse pass's rerun steps wrote it back into the stack of checkpoints it was
loaded from, which XLA copied whole twice a reversed step; `esb.scan` now gives
it the `BUFFER` role (`_scan._unchanged_as_buffers`): not stored, rerun steps see
its final value. A `(256, 256)` float32 carry read whole every step, 100 steps,
default checkpoints. Run it with the repository to measure as its argument (a
worktree of an older commit, say), alternating, in the same hour:

    python benchmarks/experiments/read_only_carry.py [REPO]

Measured (jax 0.10.2, 2-core CPU, two runs alternating, 2026-12-07), gradient ms:

    code              esb.scan  lax.scan
    601785b (before)     71-72      61-62
    this change          40.3-40.4  61
"""

import sys
from pathlib import Path


sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import best_ms  # noqa: E402
from jax import lax  # noqa: E402

import eqx_shiftbuf as esb  # noqa: E402


def loss(scan):
    def f(p, a, xs):
        def body(c, x):
            return c, jnp.cos(c * x).sum() * p

        _, ys = scan(body, a, xs)
        return ys.sum()

    return f


def main():
    rng = np.random.default_rng(0)
    args = (0.7, jnp.asarray(rng.normal(size=(256, 256)), jnp.float32), jnp.ones(100))
    for name, scan in (("esb.scan", esb.scan), ("lax.scan", lax.scan)):
        grad = jax.grad(loss(scan), argnums=(0, 1))
        copies = len(esb.find_loop_copies(grad, *args))
        best = best_ms(jax.jit(grad), args, 30)
        print(f"{name:9s} grad {best:8.3f} ms  copies per step {copies}")


if __name__ == "__main__":
    main()

"""Experiment: `jax.vmap(jax.grad(...))` of a checkpointed `esb.scan` whose
`ShiftBuffer` carry the step only reads, shared by the batch, against `lax.scan`.

`esb.scan` under `vmap` broadcast every carry to the batch; it now batches a carry
only where its initial value is batched or the step makes it so, as `lax.scan`
decides (`_scan._with_batched_carries`). A `(512, 512)` float32 buffer read whole
every step with a batched state of 8 values, 100 steps, a batch of 16, default
checkpoints. Prints compiled temporary memory, copies a step and time. Run it with
the repository to measure as its argument (a worktree of an older commit, say),
alternating:

    python benchmarks/experiments/vmap_read_only_carry.py [REPO]

Measured (jax 0.10.2, 2-core CPU, no other load, two runs alternating with
`5b96917`, 2026-12-07):

    code               esb.scan                        lax.scan
    5b96917 (before)   64.0 MiB, 1 copy, 335-336 ms    45.6 MiB, 0, 185 ms
    this change        34.0 MiB, 0,      275.5-275.8 ms  45.6 MiB, 0, 186 ms
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


def main():
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.normal(size=(512, 512)), jnp.float32)
    xs = jnp.asarray(rng.normal(size=100), jnp.float32)
    rows = jnp.asarray(rng.integers(0, 512, 100), jnp.int32)

    def body(c, x):
        a, h = c
        xv, r = x
        a, w = a.read()
        h = jnp.tanh(h * xv + w[r, :8])
        return (a, h), jnp.sum(jnp.cos(w[:64] * xv))

    def loss(scan):
        def f(p, h0):
            (_, h), ys = scan(
                body, (esb.ShiftBuffer.from_array(table * p), h0), (xs, rows)
            )
            return jnp.sum(ys) + jnp.sum(h)

        return f

    h0 = jnp.stack([jnp.linspace(0, 1, 8)] * 16)
    args = (jnp.float32(0.9), h0)
    for name, scan in (("lax.scan", lax.scan), ("esb.scan", esb.scan)):
        g = jax.vmap(jax.grad(loss(scan), argnums=(0, 1)), in_axes=(None, 0))
        compiled = jax.jit(g).lower(*args).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
        copies = len(esb.find_loop_copies(g, *args, min_bytes=512 * 512 * 2))
        best = best_ms(jax.jit(g), args, 10)
        print(f"{name:9s} temp {temp:6.1f} MiB  copies per step {copies}  "
              f"vmap(grad) {best:7.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()

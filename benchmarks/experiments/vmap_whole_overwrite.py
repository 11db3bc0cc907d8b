"""Experiment: `jax.vmap(jax.grad(...))` of a `lax.scan` whose step reads each
batch element's whole buffer (`buf.read()` or `buf.array`), then overwrites all of
it with a function of what it read, against the same step in plain `lax`.

The buffer is shared by the batch at first and batched by its first overwrite;
the read is not batched. Its transpose accumulated each element's whole buffer
in a loop over the batch (`read()`) or scatter-added the windows into a batch of
zeros (`.array`), and XLA copied the batch of cotangents every step; it is now
one add over the batch (`_primitives._accum_batch`) or the windows themselves
(`_windows_onto_zeros`). A `(64, 512)` float32 buffer, 50 steps, a batch of 8.
Prints copies a step (of the whole batch of buffers) and the best of 7 times. Run
it with the repository to measure as its argument (a worktree of an older
commit, say), alternating:

    python benchmarks/experiments/vmap_whole_overwrite.py [REPO]

Measured (jax 0.10.2, 2-core CPU, no other load but a machine 10-15% slower
than earlier that day, two runs alternating with `a51c483`, 2026-12-07; copies a
step, best of 7 ms):

    code              read()             .array             plain lax
    a51c483 (before)  2, 190.5-198.5     2, 188.3-195.2     2, 178.4-182.3
    this change       1, 183.9-190.4     1, 186.4-189.4     2, 179.8-182.6

The copy of the batch of cotangents (1 MiB a step) is gone; the time moves
little against the step's own O(buffer) work (the whole overwrite, which plain
`lax` copies too).
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


SHAPE, STEPS, BATCH = (64, 512), 50, 8


def program(how: str):
    def step(buf, x):
        if how == "read":
            buf, w = buf.read()
        elif how == "array":
            w = buf.array
        else:
            w = buf
        upd = jnp.sin(w) * x
        if how == "plain":
            return lax.dynamic_update_slice(buf, upd, (0, 0)), (w * x).sum()
        return buf.dynamic_update_slice(upd, (0, 0)), (w * x).sum()

    def loss(p, a, xs):
        b = a if how == "plain" else esb.ShiftBuffer.from_array(a, axis=0)
        b, ys = lax.scan(lambda b, x: step(b, x * p), b, xs)
        return ys.sum() + ((b if how == "plain" else b.array) ** 2).sum()

    return jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, None, 0)))


def main():
    n = int(np.prod(SHAPE))
    a = jnp.asarray(np.linspace(-1, 1, n, dtype=np.float32).reshape(SHAPE))
    xs = np.linspace(0.1, 0.3, BATCH * STEPS * n, dtype=np.float32)
    args = (jnp.float32(1.1), a, jnp.asarray(xs).reshape((BATCH, STEPS) + SHAPE))
    print(
        f"{jax.devices()[0].platform}, jax {jax.__version__}; {SHAPE} float32, "
        f"{STEPS} steps, batch {BATCH}, vmap(grad)"
    )
    for how in ("read", "array", "plain"):
        f = program(how)
        best = best_ms(f, args, 7)
        copies = len(esb.find_loop_copies(f, *args, min_bytes=BATCH * n * 4))
        print(f"{how:6s} {copies} copies a step, {best:.1f} ms", flush=True)


if __name__ == "__main__":
    main()

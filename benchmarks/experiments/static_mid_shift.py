"""Experiment: an insert then a pop in the middle of a 1-D line, at Python-int
positions, written four ways in plain JAX.

A `ShiftBuffer` of one line is a ring; in the middle of the line (past
`_ops._ROW_COST`'s window) a shift selects between the line and its roll, made in
a conditional (`_xla.rolled_in_branch`): O(line), 3x plain `lax`'s forward on a
(4096,) line. Were the line stored unrotated, only the part after the position
would move: read in a conditional (so XLA does not fuse the read into the write,
openxla/xla#49176) and written back one place on with `dynamic_update_slice`,
in place. A ring's head is a run-time value, so the library would have to pick
that path with a `lax.cond` on the head being 0; XLA does not give a
conditional's result the buffer of its operand, and copies the in-place edit at
the end of the branch. The versions:

- `plain`: `jnp.concatenate`s (XLA fuses them, and copies the result into the
  loop's buffer);
- `ring`: the library's whole-line path for a ring (the head carried, 0);
- `unrotated`: the suffix moved, no head;
- `cond`: `lax.cond(head == 0, unrotated, ring)`, the head a run-time 0.

    python benchmarks/experiments/static_mid_shift.py [N ...]

Measured (jax 0.10.2, 2-core CPU shared with another process, one run,
2026-12-07, 200 steps, forward ms, copies a step):

    N        plain       ring        unrotated   cond
    4096     0.150 (1)   0.390 (0)   0.151 (0)   0.130 (2)
    65536    12.1 (1)    7.0 (0)     2.3 (0)     4.3 (2)

So the cheap path exists only where the layout is known unrotated when the
program is compiled; dispatching at run time trades the ring's O(line) `select`
for copies.
"""

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import best_ms  # noqa: E402
from jax import lax  # noqa: E402

import eqx_shiftbuf as esb  # noqa: E402
from eqx_shiftbuf._xla import in_branch, opaque_zero, rolled_in_branch  # noqa: E402


def versions(n: int):
    i, p = int(n * 0.37), int(n * 0.61)

    def plain(b, v):
        b = jnp.concatenate([b[:i], v[None], b[i:-1]])
        y = b[p]
        return jnp.concatenate([b[:p], b[p + 1 :], jnp.zeros((1,), b.dtype)]), y

    def unrotated_insert(b, col, v):
        t = in_branch(lambda u: lax.slice(u, (col,), (n - 1,)), b, b)
        start = col + opaque_zero(v)
        return lax.dynamic_update_slice(b, jnp.concatenate([v[None], t]), (start,))

    def unrotated_pop(b, col):
        t = in_branch(lambda u: lax.slice(u, (col,), (n,)), b, b)
        rest = jnp.concatenate([t[1:], jnp.zeros((1,), b.dtype)])
        return lax.dynamic_update_slice(b, rest, (col,)), t[0]

    def positions(h):
        pos = lax.iota(jnp.int32, n)
        return jnp.where(pos >= h, pos - h, pos - h + n)

    def ring_insert(b, h, col, v):
        pos = positions(h)
        return jnp.where(pos < col, b, jnp.where(pos == col, v, rolled_in_branch(b, 1)))

    def ring_pop(b, h, col):
        pos = positions(h)
        at = jnp.where(col + h >= n, col + h - n, col + h)
        y = in_branch(lambda u: lax.dynamic_slice(u, (at,), (1,)), b, b)[0]
        r = rolled_in_branch(b, -1)
        return jnp.where(pos < col, b, jnp.where(pos == n - 1, 0.0, r)), y

    def unrotated(c, v):
        b, h = c
        b = unrotated_insert(b, i, v)
        b, y = unrotated_pop(b, p)
        return (b, h), y

    def ring(c, v):
        b, h = c
        b = ring_insert(b, h, i, v)
        b, y = ring_pop(b, h, p)
        return (b, h), y

    def cond(c, v):
        b, h = c
        b = lax.cond(
            h == 0,
            lambda b: unrotated_insert(b, i, v),
            lambda b: ring_insert(b, h, i, v),
            b,
        )
        b, y = lax.cond(
            h == 0, lambda b: unrotated_pop(b, p), lambda b: ring_pop(b, h, p), b
        )
        return (b, h), y

    return {
        "plain": (plain, False),
        "ring": (ring, True),
        "unrotated": (unrotated, True),
        "cond": (cond, True),
    }


def run(step, with_head: bool):
    def f(s, xs, a):
        # The head: a run-time 0 (from the data), which XLA cannot fold.
        init = (a, (a[0] > jnp.inf).astype(jnp.int32)) if with_head else a
        _, ys = lax.scan(lambda b, x: step(b, jnp.sin(s * x)), init, xs)
        return ys.sum()

    return f


def main():
    for n in [int(a) for a in sys.argv[1:]] or [4096, 65536]:
        args = (
            jnp.float32(0.5),
            jnp.linspace(0, 1, 200),
            jnp.arange(n, dtype=jnp.float32),
        )
        want = None
        for name, (step, with_head) in versions(n).items():
            f = run(step, with_head)
            g = jax.jit(f)
            out = jax.block_until_ready(g(*args))
            want = out if want is None else want
            np.testing.assert_allclose(out, want, rtol=1e-5)
            ms = best_ms(g, args, 30)
            copies = len(esb.find_loop_copies(f, *args, min_bytes=n * 2))
            print(f"N={n:7d} {name:10s} {ms:8.3f} ms  copies {copies}")


if __name__ == "__main__":
    main()

"""Scans of shift steps at traced positions, with the library's ops or plain `lax`'s:
the shared setup of `tests/test_one_line.py` and `tests/test_many_lines.py`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import natural


STEPS = 12


def _edits(kind, ops, b, lead, i, j, val):
    if kind == "insert":
        return ops.insert(b, lead + (j,), val), 0.0
    if kind == "delete":
        return ops.delete(b, lead + (j,)), 0.0
    if kind == "pop":
        b, r = ops.pop(b, lead + (j,))
        return b, r.sum()
    if kind == "insert_delete":
        return ops.delete(ops.insert(b, lead + (i,), val), lead + (j,)), 0.0
    if kind == "insert_pop":
        b, r = ops.pop(ops.insert(b, lead + (i,), val), lead + (j,))
        return b, (r * val).sum()
    if kind == "pop_insert":
        b, r = ops.pop(b, lead + (i,))
        return ops.insert(b, lead + (j,), r * val), r.sum()
    assert kind == "insert_pop_unused"
    b, _ = ops.pop(ops.insert(b, lead + (i,), val), lead + (j,))
    return b, 0.0


def loss(kind, shape, axis, ops=natural.ESB, rows=False, scan=lax.scan):
    """The scan of a step `kind` on a buffer of `shape` shifted along `axis`, with
    the library's ops or plain `lax`'s (`natural.PLAIN`). The line is the first
    one (Python-int zeros before `axis`), or, with `rows`, the step's `lead` of
    `args` (traced). `scan(step, init, xs)` runs it."""

    def loss(s, a, xs):
        def step(b, x):
            i, j, v, lead = x
            lead = tuple(lead) if rows else (0,) * axis
            val = jnp.full(shape[axis + 1 :], v * s)
            b, y = _edits(kind, ops, b, lead, i, j, val)
            return b, y + v * s

        b, ys = scan(step, ops.wrap(a, axis), xs)
        return (ops.unwrap(b) ** 2).sum() + ys.sum()

    return loss


def args(shape, axis):
    n = shape[axis]
    t = jnp.arange(STEPS, dtype=jnp.int32)
    lead = jnp.stack([(t * (5 + 2 * d)) % shape[d] for d in range(axis)] or [t], 1)
    xs = (
        (t * 37) % n,
        (t * 91) % n,
        jnp.linspace(0.1, 1.0, STEPS, dtype=jnp.float32),
        lead,
    )
    return jnp.float32(0.5), jnp.ones(shape, jnp.float32), xs


def under(mode, loss):
    if mode == "fwd":
        return loss
    if mode == "grad":  # with respect to the buffer alone
        return jax.grad(loss, argnums=1)
    assert mode == "jvp"
    return lambda s, a, xs: jax.jvp(lambda s, a: loss(s, a, xs), (s, a), (s, a))

"""Shifts of a buffer of one line at traced positions are in place.

The line is the whole buffer (a 1-D buffer, a `(1, n)` row, a delay line or stack
`(K, D)` shifted along axis 0, stored as a ring), so a shift at a traced position is
one `select` over the buffer, between it and its roll. XLA:CPU fused the roll into
the `select`, whose kernel then read the buffer at shifted positions and wrote a new
one: a copy per step for a single traced insert, delete or pop, and for two shifts
with nothing read between them, in every mode. The roll is now materialised by a
`reduce_window` (`_xla.rolled_by_reduce`) and the line shifted in the buffer's own
shape. These tests count the copies under each mode, for shapes, step bodies and
differentiated arguments the corpus's rows do not cover (a gradient with respect to
the buffer alone, a popped value that is not used).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_shiftbuf as esb

from . import natural


STEPS = 12
# (shape, axis): a flat line, one row, a delay line of frames (a ring).
LINES = [((4096,), 0), ((1, 4096), 1), ((256, 64), 0)]


def _edits(kind, ops, b, axis, i, j, val):
    lead = (0,) * axis
    if kind == "insert":
        return ops.insert(b, lead + (j,), val), 0.0
    if kind == "delete":
        return ops.delete(b, lead + (j,)), 0.0
    if kind == "pop":
        b, r = ops.pop(b, lead + (j,))
        return b, r.sum()
    if kind == "insert_delete":
        return ops.delete(ops.insert(b, lead + (i,), val), lead + (j,)), 0.0
    assert kind == "insert_pop_unused"
    b, _ = ops.pop(ops.insert(b, lead + (i,), val), lead + (j,))
    return b, 0.0


def _loss(kind, shape, axis, ops=natural.ESB):
    """The scan of a step `kind` on a buffer of `shape` shifted along `axis`, with
    the library's ops or plain `lax`'s (`natural.PLAIN`)."""

    def loss(s, a, xs):
        def step(b, x):
            i, j, v = x
            val = jnp.full(shape[axis + 1 :], v * s)
            b, y = _edits(kind, ops, b, axis, i, j, val)
            return b, y + v * s

        b, ys = lax.scan(step, ops.wrap(a, axis), xs)
        return (ops.unwrap(b) ** 2).sum() + ys.sum()

    return loss


def _args(shape, axis):
    n = shape[axis]
    t = jnp.arange(STEPS, dtype=jnp.int32)
    xs = ((t * 37) % n, (t * 91) % n, jnp.linspace(0.1, 1.0, STEPS, dtype=jnp.float32))
    return jnp.float32(0.5), jnp.ones(shape, jnp.float32), xs


def _under(mode, loss):
    if mode == "fwd":
        return loss
    if mode == "grad":  # with respect to the buffer alone
        return jax.grad(loss, argnums=1)
    assert mode == "jvp"
    return lambda s, a, xs: jax.jvp(lambda s, a: loss(s, a, xs), (s, a), (s, a))


KINDS = ["insert", "delete", "pop", "insert_delete", "insert_pop_unused"]


@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape, axis", LINES, ids=str)
def test_traced_shifts_of_one_line_copy_nothing(shape, axis, kind, mode):
    s, a, xs = _args(shape, axis)
    fn = _under(mode, _loss(kind, shape, axis))
    copies = esb.find_loop_copies(fn, s, a, xs, min_bytes=a.nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))


def test_a_line_of_a_million_elements_is_shifted_in_place():
    # The longest line: 2**20 float32s, a traced insert then a pop.
    shape, axis = (2**20,), 0
    s, a, xs = _args(shape, axis)
    fn = jax.grad(_loss("insert_pop_unused", shape, axis), argnums=(0, 1))
    copies = esb.find_loop_copies(fn, s, a, xs, min_bytes=a.nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "shape, axis", [((64,), 0), ((1, 48), 1), ((32, 3), 0)], ids=str
)
def test_traced_shifts_of_one_line_match_plain_jnp(shape, axis, kind):
    s, a, xs = _args(shape, axis)
    a = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
    for mode in ("fwd", "grad"):
        got = jax.jit(_under(mode, _loss(kind, shape, axis)))(s, a, xs)
        plain = _loss(kind, shape, axis, natural.PLAIN)
        want = jax.jit(_under(mode, plain))(s, a, xs)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)

"""Shifts of buffers whose lines are indexed by several dimensions are in place.

A shift of one line of a buffer with other lines is written through a window of
the line and its neighbours (`_xla.window2_edit`): XLA:CPU duplicates a write whose
update has fewer dimensions of more than one element than the buffer into the next
read of the buffer, which then reads the older buffer, and the write copies. The
window spanned two lines along the dimension just before the line's only, so on a
buffer `(8, 32, 64)` shifted along its last axis it was `(1, 2, 64)`: two copies per
step under `grad` and `jvp` for an insert then a delete, and on `(2, 2, 64)` two
forward. It now spans two elements of every dimension before the line's that has
them, unless that window would be the whole buffer (then the line is read through
a reduction, as for two lines). These tests count the copies and compare values
and gradients with plain `lax` on such shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_shiftbuf as esb

from . import natural, shifts


# (shape, axis): lines indexed by two or three dimensions, one of them of one
# element, or so few lines that a window of two along each would be all of them.
SHAPES = [
    ((8, 32, 64), 2),
    ((4, 3, 5, 64), 3),
    ((3, 8, 64, 4), 2),
    ((2, 2, 64), 2),
    ((8, 1, 64), 2),
]
KINDS = ["insert_delete", "insert_pop", "pop_insert"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape, axis", SHAPES, ids=str)
def test_traced_shifts_of_many_lines_copy_nothing(shape, axis, kind):
    s, a, xs = shifts.args(shape, axis)
    found = {
        mode: esb.find_loop_copies(
            shifts.under(mode, shifts.loss(kind, shape, axis, rows=True)),
            s,
            a,
            xs,
            min_bytes=a.nbytes // 2,
        )
        for mode in ("fwd", "grad", "jvp")
    }
    assert all(c == [] for c in found.values()), "\n".join(
        f"{mode}: {c}" for mode, copies in found.items() for c in copies
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "shape, axis",
    [((4, 3, 6), 2), ((2, 3, 5, 6), 3), ((2, 2, 7), 2), ((3, 1, 6), 2)],
    ids=str,
)
def test_traced_shifts_of_many_lines_match_plain_lax(shape, axis, kind):
    s, _, xs = shifts.args(shape, axis)
    a = jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.float32)
    # Traced positions along the leading dimensions: several lines are edited.
    for mode in ("fwd", "grad"):
        got = jax.jit(shifts.under(mode, shifts.loss(kind, shape, axis, rows=True)))(
            s, a, xs
        )
        plain = shifts.loss(kind, shape, axis, natural.PLAIN, rows=True)
        want = jax.jit(shifts.under(mode, plain))(s, a, xs)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)

"""Shifts of a buffer of one line at traced positions are in place.

The line is the whole buffer (a 1-D buffer, a `(1, n)` row, a delay line or stack
`(K, D)` shifted along axis 0, stored as a ring), so a shift at a traced position is
one `select` over the buffer, between it and its roll. XLA:CPU fused the roll into
the `select`, whose kernel then read the buffer at shifted positions and wrote a new
one: a copy per step for a single traced insert, delete or pop, and for two shifts
with nothing read between them, in every mode. The roll is now materialised in a
conditional of its own (`_xla.rolled_in_branch`) and the line shifted in the
buffer's own shape. These tests count the copies under each mode, for shapes, step bodies and
differentiated arguments the corpus's rows do not cover (a gradient with respect to
the buffer alone, a popped value that is not used).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_shiftbuf as esb

from . import natural, shifts


# (shape, axis): a flat line, one row, a delay line of frames (a ring).
LINES = [((4096,), 0), ((1, 4096), 1), ((256, 64), 0)]
KINDS = ["insert", "delete", "pop", "insert_delete", "insert_pop_unused"]


@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape, axis", LINES, ids=str)
def test_traced_shifts_of_one_line_copy_nothing(shape, axis, kind, mode):
    s, a, xs = shifts.args(shape, axis)
    fn = shifts.under(mode, shifts.loss(kind, shape, axis))
    copies = esb.find_loop_copies(fn, s, a, xs, min_bytes=a.nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))


def test_a_line_of_a_million_elements_is_shifted_in_place():
    # The longest line: 2**20 float32s, a traced insert then a pop.
    shape, axis = (2**20,), 0
    s, a, xs = shifts.args(shape, axis)
    fn = jax.grad(shifts.loss("insert_pop_unused", shape, axis), argnums=(0, 1))
    copies = esb.find_loop_copies(fn, s, a, xs, min_bytes=a.nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "shape, axis", [((64,), 0), ((1, 48), 1), ((32, 3), 0)], ids=str
)
def test_traced_shifts_of_one_line_match_plain_jnp(shape, axis, kind):
    s, a, xs = shifts.args(shape, axis)
    a = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
    for mode in ("fwd", "grad"):
        got = jax.jit(shifts.under(mode, shifts.loss(kind, shape, axis)))(s, a, xs)
        plain = shifts.loss(kind, shape, axis, natural.PLAIN)
        want = jax.jit(shifts.under(mode, plain))(s, a, xs)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def _complex_loss(ops):
    """A traced insert then delete on a complex64 line (4096,)."""

    def loss(s, a, xs):
        def step(b, x):
            i, j, v, _ = x
            b = ops.insert(b, (i,), (v * s * (1 + 2j)).astype(jnp.complex64))
            return ops.delete(b, (j,)), v * s

        b, ys = jax.lax.scan(step, ops.wrap(a, 0), xs)
        final = ops.unwrap(b)
        return jnp.real(final * jnp.conj(final)).sum() + ys.sum()

    return loss


def test_traced_shifts_of_a_complex_line_copy_nothing_and_match_plain_jnp():
    # A complex value has no bits dtype to read its roll through a reduction: its
    # roll was left to XLA, which fused it into the shift's `select` and copied
    # the line every step (1 forward, 2 in grad and jvp). It is now materialised
    # (`_xla.rolled_in_branch`).
    s, a, xs = shifts.args((4096,), 0)
    a = (a * np.linspace(0.5, 1.5, a.size) * (1 - 1j)).astype(np.complex64)
    for mode in ("fwd", "grad"):
        fn = shifts.under(mode, _complex_loss(natural.ESB))
        copies = esb.find_loop_copies(fn, s, a, xs, min_bytes=a.nbytes // 2)
        assert copies == [], "\n".join(map(str, copies))
        plain = shifts.under(mode, _complex_loss(natural.PLAIN))
        got, want = jax.jit(fn)(s, a, xs), jax.jit(plain)(s, a, xs)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _one_frame_loss(lib: bool):
    # A delay line one frame long: `pop((0,))`, then `insert((0,), f(popped))`.
    def loss(a, xs):
        def step(b, x):
            if lib:
                b, r = b.pop((0,))
                b = b.insert((0,), jnp.tanh(x + r))
            else:
                r = b[0]
                b = jnp.tanh(x + r)[None]
            return b, r.sum()

        b0 = esb.ShiftBuffer.from_array(a, axis=0) if lib else a
        b, ys = jax.lax.scan(step, b0, xs)
        arr = b.array if lib else b
        return (arr**2).sum() + ys.sum()

    return loss


@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp", "vmap(grad)"])
def test_shifts_of_a_line_one_element_long_are_one_window(mode):
    # A pop then an insert of the whole buffer's one frame. Shifted as a line
    # (read, then written), the library copied the frame more often than plain
    # `lax` (2 / 2 / 4 a step in fwd / grad / jvp, plain `lax` 1 / 0 / 2: the
    # value popped is the whole buffer, kept past the pop's write of the fill).
    def under(f):
        if mode == "fwd":
            return f
        if mode == "grad":
            return jax.grad(f, argnums=(0, 1))
        if mode == "jvp":
            return lambda a, xs: jax.jvp(f, (a, xs), (a, xs))
        return jax.vmap(jax.grad(f, argnums=(0, 1)), in_axes=(0, None))

    rng = np.random.default_rng(10)
    a = jnp.asarray(rng.normal(size=(1, 256)), jnp.float32)
    a = jnp.stack([a, -a]) if "vmap" in mode else a
    xs = jnp.asarray(rng.normal(size=7), jnp.float32)
    lib, plain = under(_one_frame_loss(True)), under(_one_frame_loss(False))
    copies = lambda f: len(esb.find_loop_copies(f, a, xs, min_bytes=256 * 4 // 2))
    assert copies(lib) <= copies(plain)
    got = jax.jit(lib)(a, xs)
    want = jax.jit(plain)(a, xs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)

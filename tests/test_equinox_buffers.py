"""The free functions accept the buffers of `equinox.internal.scan(..., buffers=...)`.

`eqxi.scan(f, init, xs, buffers=lambda carry: ..., kind="checkpointed")` traces `f`
twice: once with plain arrays (through `eval_shape`) and once with Equinox's `_Buffer`
objects in place of the selected carry leaves. `lax.dynamic_slice` cannot read a
`_Buffer`; `esb.dynamic_slice` and the other `esb` functions can, and give what the
same body gives under `lax.scan` on plain arrays.

Equinox buffers are write-once: each location may be written at most once, and read
only where it was written before (or, as these tests do, where the initial carry put
a value that the loop never overwrites). `esb.insert`/`esb.pop` on an Equinox buffer
rewrite a whole line, so each test touches each line once.
"""

from __future__ import annotations

import functools

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_shiftbuf as esb

from . import reference as ref


STEPS = 4
CHECKPOINTS = [
    pytest.param(None, id="checkpoints=default"),
    pytest.param("all", id="checkpoints=all"),
    pytest.param(2, id="checkpoints=2"),
]


def scan(body, init, xs, *, equinox, checkpoints=None):
    """`lax.scan` on plain arrays, or `eqxi.scan` with `carry[1]` as the buffer."""
    if not equinox:
        return lax.scan(body, init, xs)
    return eqxi.scan(
        body,
        init,
        xs,
        buffers=lambda carry: carry[1],
        kind="checkpointed",
        checkpoints=checkpoints,
    )


def assert_trees_close(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# Windows: each step reads block i (written by step i-1, or by the initial carry for
# i = 0) and writes block i+1, of shape BLOCK, so every block is written once.

BLOCKS = [pytest.param((1, 3), id="rows"), pytest.param((2, 2), id="2x2-blocks")]


def window_body(ds, dus, block):
    rows, cols = block

    def body(carry, i):
        p, buf = carry
        prev = ds(buf, (i * rows, 0), block)
        # A one-element read at a traced column of the same block.
        corner = ds(buf, (i * rows, i % cols), (1, 1))
        new = jnp.sin(prev * p) + i + corner
        buf = dus(buf, new, ((i + 1) * rows, 0))
        return (p, buf), prev.sum() * corner[0, 0]

    return body


def window_run(p, block, *, equinox, checkpoints=None):
    rows, cols = block
    first = p * jnp.arange(1.0, rows * cols + 1).reshape(block)
    buf0 = jnp.zeros(((STEPS + 1) * rows, cols)).at[:rows].set(first)
    if equinox:
        body = window_body(esb.dynamic_slice, esb.dynamic_update_slice, block)
    else:
        body = window_body(lax.dynamic_slice, lax.dynamic_update_slice, block)
    (_, buf), ys = scan(
        body, (p, buf0), jnp.arange(STEPS), equinox=equinox, checkpoints=checkpoints
    )
    return buf, ys


def window_loss(p, block, **kwargs):
    buf, ys = window_run(p, block, **kwargs)
    return (buf**2).sum() + (ys * jnp.arange(STEPS)).sum()


def test_lax_dynamic_slice_cannot_read_an_equinox_buffer():
    # The reported failure that `esb.dynamic_slice` exists to avoid.
    def body(carry, i):
        p, buf = carry
        row = lax.dynamic_slice(buf, (i, 0), (1, 3))
        return (p, buf.at[i + 1].set(row[0])), None

    init = (jnp.float32(1), jnp.ones((STEPS + 1, 3)))
    with pytest.raises(
        AttributeError, match="'_Buffer' object has no attribute 'ndim'"
    ):
        scan(body, init, jnp.arange(STEPS), equinox=True)


@functools.cache
def _lax_scan_run(block):
    """The plain-array `lax.scan` reference, computed once per block."""
    return window_run(jnp.float32(0.7), block, equinox=False)


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
@pytest.mark.parametrize("block", BLOCKS)
def test_dynamic_slice_and_update_in_eqxi_scan_match_lax_scan(block, checkpoints):
    p = jnp.float32(0.7)
    actual = window_run(p, block, equinox=True, checkpoints=checkpoints)
    assert_trees_close(actual, _lax_scan_run(block))


def _grad(block, **kwargs):
    """`window_loss`'s derivative at 0.7, jitted (one program per configuration)."""
    return jax.jit(jax.grad(lambda p: window_loss(p, block, **kwargs)))(
        jnp.float32(0.7)
    )


@functools.cache
def _lax_scan_grad(block):
    return _grad(block, equinox=False)


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
@pytest.mark.parametrize("block", BLOCKS)
def test_dynamic_slice_and_update_in_eqxi_scan_have_lax_scan_gradients(
    block, checkpoints
):
    actual = _grad(block, equinox=True, checkpoints=checkpoints)
    np.testing.assert_allclose(actual, _lax_scan_grad(block), rtol=1e-5)


# ---------------------------------------------------------------------------
# Shifts: step i edits line i only (one whole-line write per line).

WIDTH = 5


def insert_body(carry, i):
    p, buf = carry
    return (p, esb.insert(buf, (i, (2 * i) % WIDTH), p * (i + 1.0))), None


def pop_body(carry, i):
    p, buf = carry
    buf, removed = esb.pop(buf, (i, (3 * i + 1) % WIDTH), fill=-1)
    return (p, buf), removed


def delete_body(carry, i):
    p, buf = carry
    return (p, esb.delete(buf, (i, (3 * i + 1) % WIDTH), fill=-1)), None


def lines(dtype=jnp.float32):
    return jnp.arange(STEPS * WIDTH).reshape(STEPS, WIDTH).astype(dtype)


SHIFT_BODIES = {
    "insert": lambda: insert_body,
    "pop": lambda: pop_body,
    "delete": lambda: delete_body,
}


@pytest.mark.parametrize("name", list(SHIFT_BODIES))
def test_shifts_refuse_equinox_buffers_with_a_clear_error(name):
    # A shift rewrites the line it reads; Equinox's write-once buffers would
    # differentiate that wrongly (a checkpointed scan replays the backward pass
    # against the final buffer), so the library refuses rather than risk it.
    init = (jnp.float32(1.5), lines())
    with pytest.raises(TypeError, match="cannot edit an equinox.internal loop buffer"):
        scan(SHIFT_BODIES[name](), init, jnp.arange(STEPS), equinox=True)


@pytest.mark.parametrize("name", list(SHIFT_BODIES))
def test_the_same_shift_bodies_work_on_plain_arrays(name):
    (_, out), _ = scan(
        SHIFT_BODIES[name](),
        (jnp.float32(1.5), lines()),
        jnp.arange(STEPS),
        equinox=False,
    )
    model = np.asarray(lines())
    for i in range(STEPS):
        if name == "insert":
            model = ref.insert(model, (i, (2 * i) % WIDTH), 1.5 * (i + 1), axis=1)
        else:
            model = ref.delete(model, (i, (3 * i + 1) % WIDTH), axis=1, fill=-1)
    np.testing.assert_array_equal(out, model)

"""Zero-size buffers and windows: every operation works, and an index out of range
is an error as for any other shape, a traced one when the program runs.

An access that touches no element has only zero-size results, which XLA replaces by
constants; its index check must run all the same. Along a dimension of length 0,
no insert/delete/pop index is valid: there is no element to remove, and an insert
lands inside a line of fixed length, which has no position.
"""

from __future__ import annotations

import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_shiftbuf as esb

from . import reference as ref


requires_raise = pytest.mark.skipif(
    os.environ.get("EQX_ON_ERROR", "raise") != "raise",
    reason="run-time index checks raise only with EQX_ON_ERROR=raise (the default)",
)
RUNTIME_ERRORS = (jax.errors.JaxRuntimeError, eqx.EquinoxRuntimeError)

# A buffer of 3 rows of nothing, shifted along axis 0 (its elements have shape (0,)):
# row indices 0 to 2 are valid.
ROWS = 3


def empty_rows():
    return jnp.zeros((ROWS, 0), jnp.float32)


def _axis(x):
    return {} if isinstance(x, esb.ShiftBuffer) else {"axis": 0}


# Each operation as `op(x, row)`: what it returns, and how it names the row index.
OPS = {
    "insert": (lambda x, i: esb.insert(x, i, jnp.zeros(0), **_axis(x)), "index"),
    "delete": (lambda x, i: esb.delete(x, i, **_axis(x)), "index"),
    "pop": (lambda x, i: esb.pop(x, i, **_axis(x)), "index"),
    "dynamic_slice": (
        lambda x, i: esb.dynamic_slice(x, (i, 0), (1, 0)),
        "start_indices",
    ),
    "dynamic_update_slice": (
        lambda x, i: esb.dynamic_update_slice(x, jnp.zeros((1, 0)), (i, 0)),
        "start_indices",
    ),
}
EDITS = ["insert", "delete", "dynamic_update_slice"]


def contents(out):
    """The arrays an operation returned, a ShiftBuffer read as its `.array`."""
    leaves = out if isinstance(out, tuple) else (out,)
    return [x.array if isinstance(x, esb.ShiftBuffer) else x for x in leaves]


def as_buffer(x, kind):
    return esb.ShiftBuffer.from_array(x, axis=0) if kind == "ShiftBuffer" else x


KINDS = ["array", "ShiftBuffer"]


# ---------------------------------------------------------------------------
# In range, everything works.


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op_name", list(OPS))
def test_operations_on_a_zero_size_buffer_run(op_name, kind):
    op, _ = OPS[op_name]
    run = jax.jit(lambda x, i: contents(op(as_buffer(x, kind), i)))
    got = run(empty_rows(), jnp.int32(ROWS - 1))
    want = {
        "insert": [(ROWS, 0)],
        "delete": [(ROWS, 0)],
        "pop": [(ROWS, 0), (0,)],
        "dynamic_slice": [(1, 0)],
        "dynamic_update_slice": [(ROWS, 0)],
    }[op_name]
    assert [g.shape for g in got] == want
    assert all(g.dtype == jnp.float32 for g in got)


def test_shifts_of_zero_size_elements_in_a_scan_match_numpy():
    # A (2, 3, 0) buffer shifted along axis 1: valid (row, column) indices, each
    # element of shape (0,). Inserts and pops, under grad and vmap too.
    x0 = np.zeros((2, 3, 0), np.float32)

    def step(sb, rc):
        sb = sb.insert((rc[0], rc[1]), jnp.zeros(0))
        sb, removed = sb.pop((rc[1] % 2, rc[0]))
        return sb, removed

    def run(x, rcs):
        sb, removed = jax.lax.scan(step, esb.ShiftBuffer.from_array(x, axis=1), rcs)
        return sb.array, removed

    rcs = jnp.array([[0, 2], [1, 0], [1, 1]], jnp.int32)
    array, removed = jax.jit(run)(x0, rcs)
    assert array.shape == (2, 3, 0) and removed.shape == (3, 0)
    grad = jax.jit(jax.grad(lambda x: run(x, rcs)[0].sum()))(x0)
    assert grad.shape == (2, 3, 0)
    batched = jax.jit(jax.vmap(run, in_axes=(None, 0)))(x0, jnp.stack([rcs, rcs]))
    assert batched[0].shape == (2, 2, 3, 0)


def test_reading_an_empty_window_of_a_non_empty_buffer_matches_numpy():
    x = jnp.arange(12.0).reshape(3, 4)
    got = jax.jit(lambda x, r: esb.dynamic_slice(x, (r, 1), (2, 0)))(x, jnp.int32(1))
    np.testing.assert_array_equal(got, ref.dynamic_slice(np.asarray(x), (1, 1), (2, 0)))
    assert got.shape == (2, 0)


def test_a_promised_access_of_a_zero_size_buffer_runs_unchecked():
    run = jax.jit(
        lambda x, i: esb.pop(x, (i, i), mode="promise_in_bounds")[0]  # no valid i
    )
    assert run(jnp.zeros((ROWS, 0)), jnp.int32(0)).shape == (ROWS, 0)


# ---------------------------------------------------------------------------
# Out of range: a Python int when the operation is called.


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op_name", list(OPS))
def test_python_int_index_out_of_range_is_an_index_error(op_name, kind):
    op, argname = OPS[op_name]
    message = f"`{argname}`[0]={ROWS} is out of range: valid values are 0 to 2."
    with pytest.raises(IndexError, match=re.escape(message)):
        op(as_buffer(empty_rows(), kind), ROWS)


@pytest.mark.parametrize("op_name", ["insert", "delete", "pop"])
def test_no_index_is_valid_along_a_zero_length_axis(op_name):
    # A (3, 0) buffer shifted along its last axis: its lines have no position.
    ops = {
        "insert": lambda x, idx: esb.insert(x, idx, 1.0),
        "delete": lambda x, idx: esb.delete(x, idx),
        "pop": lambda x, idx: esb.pop(x, idx),
    }
    message = (
        "`index`[1]=0 is out of range: the buffer has length 0 along dimension 1, "
        "so no value is valid."
    )
    with pytest.raises(IndexError, match=re.escape(message)):
        ops[op_name](empty_rows(), (0, 0))


# ---------------------------------------------------------------------------
# Out of range: a traced index when the compiled program runs.


@requires_raise
@pytest.mark.parametrize("row", [ROWS, -1], ids=["past-end", "negative"])
@pytest.mark.parametrize("op_name", list(OPS))
def test_traced_index_out_of_range_raises_when_the_program_runs(op_name, row):
    op, argname = OPS[op_name]
    run = jax.jit(lambda x, i: contents(op(x, i)))
    message = f"`{argname}`[0] is out of range: valid values are 0 to 2."
    with pytest.raises(RUNTIME_ERRORS, match=re.escape(message)):
        jax.block_until_ready(run(empty_rows(), jnp.int32(row)))


@pytest.mark.parametrize("op_name", list(OPS))
def test_the_check_of_an_access_that_touches_nothing_is_no_jax_effect(op_name):
    # It is kept on the side (its results are constants to XLA), as the check of a
    # recorded error is, so `jax.jit` still dispatches the program by its C++ fast
    # path; the callback is still compiled in.
    op, _ = OPS[op_name]
    fn = lambda x, i: contents(op(x, i))
    assert jax.make_jaxpr(fn)(empty_rows(), jnp.int32(0)).effects == set()
    assert "callback" in jax.jit(fn).lower(empty_rows(), jnp.int32(0)).as_text()


@requires_raise
@pytest.mark.parametrize("read", ["array", "dynamic_slice", "pop"])
@pytest.mark.parametrize("op_name", EDITS)
def test_shift_buffer_edit_out_of_range_raises_at_the_next_read(op_name, read):
    op, argname = OPS[op_name]
    reads = {
        "array": lambda sb: sb.array,
        "dynamic_slice": lambda sb: sb.dynamic_slice((0, 0), (1, 0)),
        "pop": lambda sb: sb.pop(0)[1],
    }
    run = jax.jit(
        lambda x, i: reads[read](op(esb.ShiftBuffer.from_array(x, axis=0), i))
    )
    message = f"esb.{op_name}: `{argname}`[0] is out of range: valid values are 0 to 2."
    with pytest.raises(RUNTIME_ERRORS, match=re.escape(message)):
        jax.block_until_ready(run(empty_rows(), jnp.int32(ROWS)))


@requires_raise
@pytest.mark.parametrize("op_name", ["insert", "delete", "pop"])
def test_traced_index_along_a_zero_length_axis_always_raises(op_name):
    # A traced index is checked when the program runs, even where no value could
    # pass: the call may sit in a branch that never runs.
    ops = {
        "insert": lambda x, i: esb.insert(x, (0, i), 1.0),
        "delete": lambda x, i: esb.delete(x, (0, i)),
        "pop": lambda x, i: esb.pop(x, (0, i)),
    }
    run = jax.jit(ops[op_name])
    message = (
        "`index`[1] is out of range: the buffer has length 0 along dimension 1, so "
        "no value is valid."
    )
    with pytest.raises(RUNTIME_ERRORS, match=re.escape(message)):
        jax.block_until_ready(run(empty_rows(), jnp.int32(0)))


@requires_raise
@pytest.mark.parametrize("op_name", ["dynamic_slice", "dynamic_update_slice"])
def test_traced_start_out_of_range_of_an_empty_window_raises(op_name):
    # The buffer has elements; the window has none, and neither has the result of
    # a read of it, nor the change a write of it makes.
    op, argname = OPS[op_name]
    run = jax.jit(lambda x, i: op(x, i))
    message = f"`{argname}`[0] is out of range: valid values are 0 to 2."
    with pytest.raises(RUNTIME_ERRORS, match=re.escape(message)):
        jax.block_until_ready(run(jnp.zeros((ROWS, 4)), jnp.int32(ROWS)))


@requires_raise
def test_traced_index_out_of_range_of_a_zero_size_buffer_raises_under_vmap_and_grad():
    pop = lambda x, i: esb.pop(esb.ShiftBuffer.from_array(x, axis=0), i)[0].array
    batched = jax.jit(jax.vmap(pop, in_axes=(None, 0)))
    # Anchored after the exception's name: a recorded error's message ends with
    # the same words.
    message = "RuntimeError: " + re.escape(
        "`index`[0] is out of range: valid values are 0 to 2."
    )
    with pytest.raises(RUNTIME_ERRORS, match=message):
        jax.block_until_ready(batched(empty_rows(), jnp.array([0, ROWS], jnp.int32)))
    grad = jax.jit(jax.grad(lambda x, i: pop(x, i).sum()))
    with pytest.raises(RUNTIME_ERRORS, match=message):
        jax.block_until_ready(grad(empty_rows(), jnp.int32(ROWS)))

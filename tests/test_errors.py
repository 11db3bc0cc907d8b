"""Bad input is an error that names the argument, what was expected and what was given.

Concrete (Python / NumPy / non-traced JAX) indices are checked when the operation is
called; traced indices are checked when the compiled program runs, through
`equinox.error_if`. An out-of-range index is never clamped, unlike `lax.dynamic_slice`.
"""

from __future__ import annotations

import functools
import gc
import os
import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_shiftbuf as esb

from . import reference as ref


ROWS, CAPACITY = 3, 4


def buffer(dtype=jnp.float32):
    """A fresh (ROWS, CAPACITY) buffer holding 0, 1, 2, ... (fresh: see the last test)."""
    return jnp.arange(ROWS * CAPACITY).reshape(ROWS, CAPACITY).astype(dtype)


# Each operation, called as `op(x, idx)` with one index tuple; `argname` is how the
# operation names that argument in its errors, and `bound(k)` the largest valid value
# of entry k for these window sizes.
OPS = {
    "insert": (lambda x, idx: esb.insert(x, idx, 1.0), "index", (2, 3)),
    "delete": (lambda x, idx: esb.delete(x, idx), "index", (2, 3)),
    "pop": (lambda x, idx: esb.pop(x, idx), "index", (2, 3)),
    "dynamic_slice": (
        lambda x, idx: esb.dynamic_slice(x, idx, (1, 2)),
        "start_indices",
        (2, 2),
    ),
    "dynamic_update_slice": (
        lambda x, idx: esb.dynamic_update_slice(x, jnp.ones((1, 2), x.dtype), idx),
        "start_indices",
        (2, 2),
    ),
}

# (position of the bad entry, its value): one past the end of each dimension (for
# insert, column == capacity), and negative.
BAD_ENTRIES = [
    pytest.param(1, "past_end", id="column-past-end"),
    pytest.param(0, "past_end", id="row-past-end"),
    pytest.param(0, -1, id="negative-row"),
    pytest.param(1, -1, id="negative-column"),
]


def bad_index(op_name: str, pos: int, value) -> tuple[tuple[int, int], int]:
    _, _, bounds = OPS[op_name]
    if value == "past_end":
        value = bounds[pos] + 1
    idx = [0, 0]
    idx[pos] = value
    return tuple(idx), value


requires_raise = pytest.mark.skipif(
    os.environ.get("EQX_ON_ERROR", "raise") != "raise",
    reason="run-time index checks raise only with EQX_ON_ERROR=raise (the default)",
)

# What a failed `equinox.error_if` raises when the program runs: `jax.jit` surfaces it
# as a `JaxRuntimeError` (the XLA callback error); `eqx.filter_jit` as an
# `EquinoxRuntimeError`. Both carry the library's message.
RUNTIME_ERRORS = (jax.errors.JaxRuntimeError, eqx.EquinoxRuntimeError)


# ---------------------------------------------------------------------------
# Index out of range, known when the operation is called.


@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("pos, value", BAD_ENTRIES)
def test_python_int_index_out_of_range_is_an_index_error(op_name, pos, value):
    op, argname, bounds = OPS[op_name]
    idx, value = bad_index(op_name, pos, value)
    message = (
        f"`{argname}`[{pos}]={value} is out of range: valid values are 0 to "
        f"{bounds[pos]}."
    )
    with pytest.raises(IndexError, match=re.escape(message)):
        op(buffer(), idx)


def test_insert_at_column_equal_to_capacity_is_an_index_error():
    # There is no "append" position: an insert must land inside the line.
    with pytest.raises(
        IndexError,
        match=re.escape(
            f"`index`[1]={CAPACITY} is out of range: valid values are 0 to 3"
        ),
    ):
        esb.insert(buffer(), (0, CAPACITY), 1.0)


@pytest.mark.parametrize(
    "make_entry",
    [np.int32, np.int64, jnp.int32],
    ids=["numpy-int32", "numpy-int64", "concrete-jax-int32"],
)
def test_concrete_array_index_out_of_range_is_an_index_error(make_entry):
    with pytest.raises(
        IndexError,
        match=re.escape("`index`[0]=3 is out of range: valid values are 0 to 2."),
    ):
        esb.delete(buffer(), (make_entry(3), 0))


def test_shift_buffer_methods_check_indices_like_the_free_functions():
    sb = esb.ShiftBuffer.from_array(buffer())
    with pytest.raises(IndexError, match=re.escape("`index`[1]=4 is out of range")):
        sb.insert((0, 4), 1.0)
    with pytest.raises(IndexError, match=re.escape("`index`[0]=-1 is out of range")):
        sb.pop((-1, 0))
    with pytest.raises(IndexError, match=re.escape("`start_indices`[1]=3 is out of")):
        sb.dynamic_slice((0, 3), (1, 2))


# ---------------------------------------------------------------------------
# Index out of range, known only when the compiled program runs.


@functools.cache
def _jitted_op(op_name):
    """`OPS[op_name]` jitted with a traced index: one program per operation,
    compiled once for every bad entry (the entries are run-time values)."""
    op = OPS[op_name][0]
    return jax.jit(lambda x, i: op(x, i))


@requires_raise
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("pos, value", BAD_ENTRIES)
def test_traced_index_out_of_range_raises_when_the_jitted_function_runs(
    op_name, pos, value
):
    op, argname, bounds = OPS[op_name]
    idx, value = bad_index(op_name, pos, value)
    run = _jitted_op(op_name)
    message = (
        f"`{argname}`[{pos}] is out of range: valid values are 0 to {bounds[pos]}."
    )
    with pytest.raises(RUNTIME_ERRORS, match=re.escape(message)):
        jax.block_until_ready(run(buffer(), idx))


@requires_raise
@pytest.mark.parametrize("op_name", ["pop", "dynamic_slice"])
def test_with_every_traced_entry_out_of_range_the_first_is_named(op_name):
    op, argname, bounds = OPS[op_name]
    run = jax.jit(lambda x, r, c: op(x, (r, c)))
    message = f"`{argname}`[0] is out of range: valid values are 0 to {bounds[0]}."
    with pytest.raises(RUNTIME_ERRORS, match=re.escape(message)):
        jax.block_until_ready(run(buffer(), jnp.int32(-1), jnp.int32(-1)))


@requires_raise
@pytest.mark.parametrize("read_bad", [True, False], ids=["read-bad", "read-ok"])
def test_a_reads_own_bad_index_is_named_before_a_recorded_error(read_bad):
    # A read checks its own indices and the buffer's recorded error in one check;
    # its own message comes first, the edit's when only the record is set.
    def run(x, edit_row, read_col):
        sb = esb.ShiftBuffer.from_array(x).insert((edit_row, 0), 1.0)
        return sb.dynamic_slice((0, read_col), (1, 2))

    read_col = CAPACITY if read_bad else 0
    message = (
        "`start_indices`[1] is out of range: valid values are 0 to 2."
        if read_bad
        else edit_message("insert", 0)
    )
    with pytest.raises(RUNTIME_ERRORS, match=re.escape(message)):
        jax.block_until_ready(
            jax.jit(run)(buffer(), jnp.int32(ROWS), jnp.int32(read_col))
        )


def test_a_checked_read_chooses_its_message_without_a_reduction():
    # Which message to raise is chosen with scalar `where`s: `argmax` over the
    # stacked flags is a variadic reduction, a kernel of its own that XLA:CPU runs
    # every step of a loop (as costly as a small edit).
    def step(x, r, c):
        sb = esb.ShiftBuffer.from_array(x).insert((r, c), 1.0)  # records an error
        return sb.pop((r, c))[1] + sb.dynamic_slice((r, c), (1, 1))[0, 0]

    text = str(jax.make_jaxpr(step)(buffer(), jnp.int32(0), jnp.int32(0)))
    assert "cond" in text  # the checks are there
    assert "argmax" not in text and "reduce_or" not in text


@requires_raise
def test_traced_index_out_of_range_under_filter_jit_is_an_equinox_runtime_error():
    run = eqx.filter_jit(lambda x, i: esb.insert(x, (0, i), 1.0))
    with pytest.raises(
        eqx.EquinoxRuntimeError,
        match=re.escape("`index`[1] is out of range: valid values are 0 to 3."),
    ):
        jax.block_until_ready(run(buffer(), jnp.int32(CAPACITY)))


@requires_raise
def test_traced_out_of_range_start_is_not_clamped_like_lax_dynamic_slice():
    x = jnp.arange(4.0)
    start = 3  # a window of 2 would start at 3: lax clamps it to 2
    clamped = jax.jit(lambda x, i: lax.dynamic_slice(x, (i,), (2,)))(x, start)
    np.testing.assert_array_equal(clamped, [2.0, 3.0])

    run = jax.jit(lambda x, i: esb.dynamic_slice(x, (i,), (2,)))
    with pytest.raises(RUNTIME_ERRORS, match="out of range"):
        jax.block_until_ready(run(x, start))


@requires_raise
def test_traced_out_of_range_write_does_not_silently_corrupt_the_buffer():
    x = jnp.arange(4.0)
    run = jax.jit(lambda x, i: esb.dynamic_update_slice(x, jnp.ones(2), (i,)))
    with pytest.raises(RUNTIME_ERRORS, match="out of range"):
        jax.block_until_ready(run(x, 3))


# ---------------------------------------------------------------------------
# A ShiftBuffer's edits record a bad traced index; its next read raises it.

EDITS = ("insert", "delete", "dynamic_update_slice")
READS = {
    "array": lambda sb: sb.array,
    "dynamic_slice": lambda sb: sb.dynamic_slice((0, 0), (1, 2)),
    "pop": lambda sb: sb.pop((0, 0))[1],
}


def edit_message(op_name: str, pos: int) -> str:
    _, argname, bounds = OPS[op_name]
    return (
        f"esb.{op_name}: `{argname}`[{pos}] is out of range: valid values are 0 to "
        f"{bounds[pos]}."
    )


@functools.cache
def _jitted_edit_then_read(op_name, read):
    """An edit at a traced index, then a read: compiled once for every bad entry."""
    op = OPS[op_name][0]
    return jax.jit(lambda x, i: READS[read](op(esb.ShiftBuffer.from_array(x), i)))


@requires_raise
@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("op_name", EDITS)
@pytest.mark.parametrize("pos, value", BAD_ENTRIES)
def test_shift_buffer_edit_out_of_range_raises_at_the_next_read(
    op_name, pos, value, read
):
    idx, _ = bad_index(op_name, pos, value)
    run = _jitted_edit_then_read(op_name, read)
    with pytest.raises(RUNTIME_ERRORS, match=re.escape(edit_message(op_name, pos))):
        jax.block_until_ready(run(buffer(), idx))


@pytest.mark.parametrize("op_name", EDITS)
def test_shift_buffer_edit_records_a_bad_index_instead_of_branching(op_name):
    # The point of deferring: no conditional (and no callback) for an edit, so a
    # loop of edits has none in its body; the read after the loop has the one check.
    op, _, _ = OPS[op_name]

    def edits(x, idx):
        def step(sb, i):
            return op(sb, (i[0], i[1])), None

        sb, _ = lax.scan(step, esb.ShiftBuffer.from_array(x), idx)
        return sb

    idx = jnp.zeros((5, 2), jnp.int32)
    edit_only = jax.jit(edits).lower(buffer(), idx).as_text()
    assert "callback" not in edit_only and "case" not in edit_only
    with_read = jax.jit(lambda x, i: edits(x, i).array).lower(buffer(), idx).as_text()
    assert "callback" in with_read


@requires_raise
def test_the_recorded_error_survives_a_jit_boundary():
    edit = jax.jit(lambda x, i: esb.ShiftBuffer.from_array(x).insert((i, 0), 1.0))
    sb = edit(buffer(), jnp.int32(ROWS))  # no read yet, so no error yet
    with pytest.raises(
        (eqx.EquinoxTracetimeError, *RUNTIME_ERRORS),
        match=re.escape(edit_message("insert", 0)),
    ):
        jax.block_until_ready(sb.array)


@requires_raise
def test_the_first_bad_edit_in_a_scan_is_the_one_reported():
    # Step 1 deletes at a bad row, step 3 inserts at a bad column; an in-range
    # read of the result names the delete.
    rows = jnp.array([0, ROWS, 0, 0, 0], jnp.int32)
    cols = jnp.array([0, 0, 0, CAPACITY + 1, 0], jnp.int32)

    def run(x, rows, cols):
        def step(sb, rc):
            r, c = rc
            sb = lax.cond(
                c > CAPACITY,
                lambda sb: sb.insert((r, c), 1.0),
                lambda sb: sb.delete((r, 0)),
                sb,
            )
            return sb, None

        sb, _ = lax.scan(step, esb.ShiftBuffer.from_array(x), (rows, cols))
        return sb.dynamic_slice((0, 0), (1, 2))

    with pytest.raises(RUNTIME_ERRORS, match=re.escape(edit_message("delete", 0))):
        jax.block_until_ready(jax.jit(run)(buffer(), rows, cols))


@requires_raise
def test_a_bad_edit_under_grad_raises():
    def loss(x, i):
        return (esb.ShiftBuffer.from_array(x).insert((i, 0), 1.0).array ** 2).sum()

    with pytest.raises(RUNTIME_ERRORS, match=re.escape(edit_message("insert", 0))):
        jax.block_until_ready(jax.jit(jax.grad(loss))(buffer(), jnp.int32(-1)))


@requires_raise
def test_a_bad_edit_under_checkpoint_raises():
    # `jax.checkpoint` splits the program into a forward and a rematerialised part;
    # the check, which has no result, must stay in one of them.
    def loss(x, i):
        return (esb.ShiftBuffer.from_array(x).insert((i, 0), 1.0).array ** 2).sum()

    with pytest.raises(RUNTIME_ERRORS, match=re.escape(edit_message("insert", 0))):
        jax.block_until_ready(
            jax.jit(jax.grad(jax.checkpoint(loss)))(buffer(), jnp.int32(-1))
        )


@pytest.mark.parametrize("read", list(READS))
def test_a_checked_read_leaves_the_jit_fast_path_on(read):
    # A program with a JAX effect (a `jax.debug.callback`, say) is dispatched from
    # Python, not by `jax.jit`'s C++ fast path: about 0.2 ms more per call, which
    # was most of the checked mode's cost on short loops. The recorded error's
    # check has no effect in its type, and is still compiled in.
    def run(x, idx):
        def step(sb, i):
            return sb.insert((i[0], i[1]), 1.0), None

        sb, _ = lax.scan(step, esb.ShiftBuffer.from_array(x), idx)
        return READS[read](sb)

    idx = jnp.zeros((5, 2), jnp.int32)
    for fn in (run, jax.grad(lambda x, i: run(x, i).sum())):
        assert jax.make_jaxpr(fn)(buffer(), idx).effects == set()
        assert "callback" in jax.jit(fn).lower(buffer(), idx).as_text()


@requires_raise
def test_a_bad_edit_in_one_batch_element_raises_under_vmap():
    def read_after_edit(x, i):
        return esb.ShiftBuffer.from_array(x).delete((i, 0)).array

    rows = jnp.array([0, 1, ROWS], jnp.int32)
    run = jax.jit(jax.vmap(read_after_edit, in_axes=(None, 0)))
    with pytest.raises(RUNTIME_ERRORS, match=re.escape(edit_message("delete", 0))):
        jax.block_until_ready(run(buffer(), rows))
    good = run(buffer(), jnp.array([0, 1, 2], jnp.int32))
    for k, r in enumerate([0, 1, 2]):
        np.testing.assert_array_equal(
            good[k], ref.delete(np.asarray(buffer()), (r, 0), axis=1)
        )


@requires_raise
@pytest.mark.parametrize("bad_element", [0, 1], ids=["first-bad", "second-bad"])
@pytest.mark.parametrize("as_buffer", [False, True], ids=["array", "ShiftBuffer"])
def test_a_bad_index_in_one_batch_element_is_the_one_named_under_vmap(
    as_buffer, bad_element
):
    # Under vmap the check raises one message for the batch: the bad element's,
    # not one an element whose indices are all in range would have chosen (the
    # last entry's, or a ShiftBuffer's recorded error's).
    def read(x, r, c):
        return esb.pop(esb.ShiftBuffer.from_array(x) if as_buffer else x, (r, c))[1]

    rows = [0, 0]
    rows[bad_element] = ROWS
    run = jax.jit(jax.vmap(read, in_axes=(None, 0, 0)))
    # Anchored after the exception's name: a recorded error's message ends with
    # the same words.
    message = "RuntimeError: " + re.escape(
        "`index`[0] is out of range: valid values are 0 to 2."
    )
    with pytest.raises(RUNTIME_ERRORS, match=message):
        jax.block_until_ready(
            run(buffer(), jnp.array(rows, jnp.int32), jnp.zeros(2, jnp.int32))
        )


def test_in_range_edits_record_nothing():
    def edits(x, i):
        sb = esb.ShiftBuffer.from_array(x).insert((i, i), 1.0)
        return sb.dynamic_update_slice(jnp.ones((1, 2)), (i, i)).delete((i, 0))

    sb = jax.jit(edits)(buffer(), jnp.int32(1))
    assert int(sb._error) == 0
    expected = ref.insert(np.asarray(buffer()), (1, 1), 1.0, axis=1)
    expected[1, 1:3] = 1.0
    np.testing.assert_array_equal(sb.array, ref.delete(expected, (1, 0), axis=1))


def test_a_promised_edit_records_nothing():
    edit = jax.jit(
        lambda x, i: esb.ShiftBuffer.from_array(x).delete(
            (i, 0), mode="promise_in_bounds"
        )
    )
    assert int(edit(buffer(), jnp.int32(ROWS))._error) == 0


# ---------------------------------------------------------------------------
# A recorded error's message is the program's own, whatever was traced before.
#
# Each test below names bounds that no other test's edits name: a read used to name
# only edits whose message something in the process had traced before the read, so
# an earlier test tracing the same message could hide the defect.


def raised_message(run, *args) -> str:
    """The message of the error that `run(*args)` raises when it runs."""
    with pytest.raises(RUNTIME_ERRORS) as info:
        jax.block_until_ready(run(*args))
    found = re.search(r"EquinoxRuntimeError: (.*)", str(info.value))
    assert found is not None, str(info.value)
    return found.group(1)


def read_first(x, edit, index, *, axis=-1, read=lambda sb: sb.array) -> str:
    """The message when a jitted `read`, traced before the bad edit, reads the result
    of a separately jitted `edit` (at `index`) of a buffer holding `x`."""
    reader = eqx.filter_jit(lambda sb: read(sb))  # a new function: traced afresh
    jax.block_until_ready(reader(esb.ShiftBuffer.from_array(x, axis=axis)))
    editor = eqx.filter_jit(
        lambda x, i: edit(esb.ShiftBuffer.from_array(x, axis=axis), i)
    )
    return raised_message(reader, editor(x, index))


# A buffer of shape (5, 6, 7) shifted along axis 1: an insert or delete index has 2
# entries, bounds 4 and 5; a (1, 3, 2) update has 3 starts, bounds 4, 3 and 5.
EDITS_3D = {
    "insert": (lambda sb, i: sb.insert(i, jnp.zeros(7)), "index", (4, 5)),
    "delete": (lambda sb, i: sb.delete(i), "index", (4, 5)),
    "dynamic_update_slice": (
        lambda sb, i: sb.dynamic_update_slice(jnp.ones((1, 3, 2)), i),
        "start_indices",
        (4, 3, 5),
    ),
}
EDIT_POSITIONS_3D = [
    pytest.param(op_name, pos, id=f"{op_name}-{pos}")
    for op_name, (_, _, bounds) in EDITS_3D.items()
    for pos in range(len(bounds))
]
DEFERRED_NOTE = (
    " (Raised at the first read of the ShiftBuffer after that edit: `.array`, "
    "`dynamic_slice` or `pop`. Edits record a bad index in the buffer rather than "
    "branch, which inside a loop would cost as much as the edit.)"
)


@requires_raise
@pytest.mark.parametrize("op_name, pos", EDIT_POSITIONS_3D)
def test_a_read_traced_before_the_edit_names_the_edit_exactly(op_name, pos):
    edit, argname, bounds = EDITS_3D[op_name]
    index: list = [0] * len(bounds)
    index[pos] = jnp.int32(bounds[pos] + 1)  # the only traced entry
    message = read_first(jnp.zeros((5, 6, 7)), edit, tuple(index), axis=1)
    assert message == (
        f"esb.{op_name}: `{argname}`[{pos}] is out of range: valid values are 0 to "
        f"{bounds[pos]}.{DEFERRED_NOTE}"
    )


@requires_raise
@pytest.mark.parametrize("read", list(READS))
def test_every_read_traced_before_the_edit_names_it(read):
    rows = {"array": 7, "dynamic_slice": 8, "pop": 9}[read]  # a shape of its own
    message = read_first(
        jnp.zeros((rows, 9)),
        lambda sb, i: sb.delete((i, 0)),
        jnp.int32(-1),
        read=READS[read],
    )
    assert message == (
        f"esb.delete: `index`[0] is out of range: valid values are 0 to {rows - 1}."
        f"{DEFERRED_NOTE}"
    )


@requires_raise
@pytest.mark.parametrize("op_name", EDITS)
def test_the_same_program_gives_the_same_message_on_every_trace(op_name):
    # The program: a jitted read traced first, then a separately jitted bad edit.
    # Traced afresh (new jitted functions), after other programs, it says the same.
    edit, _, _ = OPS[op_name]
    x = jnp.zeros((11, 13))
    bad = (jnp.int32(11), 0)
    first = read_first(x, edit, bad)
    retraced = read_first(x, edit, bad)
    for rows in range(12, 16):  # other programs, with other messages
        read_first(jnp.zeros((rows, 13)), edit, (jnp.int32(rows), 0))
    later = read_first(x, edit, bad)
    assert first == retraced == later
    assert first.startswith(f"esb.{op_name}: ")


# The largest update of a 1-D buffer whose code (3 + 3 * (size + 1)) a float32 holds
# exactly (up to 2**24), and one more.
LARGEST_EXACT_UPDATE = (2**24 - 3) // 3 - 1


@requires_raise
@pytest.mark.parametrize(
    "size, bound_stated",
    [
        pytest.param(LARGEST_EXACT_UPDATE, True, id="largest-exact"),
        pytest.param(LARGEST_EXACT_UPDATE + 1, False, id="too-large"),
    ],
)
def test_an_update_too_large_to_code_is_named_without_its_bound(size, bound_stated):
    # int8: the buffer is 5.6 MB; its update, 61 elements shorter, starts at 0 to 61.
    x = jnp.zeros((size + 61,), jnp.int8)
    update = jnp.ones((size,), jnp.int8)
    message = read_first(
        x, lambda sb, i: sb.dynamic_update_slice(update, (i,)), jnp.int32(62)
    )
    what = "esb.dynamic_update_slice: `start_indices`[0] is out of range: "
    reason = (
        "valid values are 0 to 61."
        if bound_stated
        else "the update would not fit inside the buffer."
    )
    assert message == what + reason + DEFERRED_NOTE


def _module_state() -> dict[str, int]:
    """The size of each module-level collection of the package."""
    sizes = {}
    for name, module in list(sys.modules.items()):
        if name == "eqx_shiftbuf" or name.startswith("eqx_shiftbuf."):
            for attr, value in vars(module).items():
                if isinstance(value, (list, dict, set)):
                    sizes[f"{name}.{attr}"] = len(value)
    return sizes


def test_tracing_programs_leaves_no_module_state_behind():
    # A recorded error's message is rebuilt from its code when it is raised: no
    # table of messages that grows with every edit ever traced.
    def trace_edits(rows):  # edits with messages of their own (their bounds)
        x = jnp.zeros((rows, 17))
        for op_name in EDITS:
            edit, _, _ = OPS[op_name]
            jax.jit(
                lambda x, i, edit=edit: edit(esb.ShiftBuffer.from_array(x), (i, 0))
            ).lower(x, jnp.int32(0))
        gc.collect()

    trace_edits(30)  # the first program may fill caches that are not per program
    before = _module_state()
    for rows in range(31, 41):
        trace_edits(rows)
    assert _module_state() == before


# 2**32 + 1 is 1 and -2**32 + 2 is 2 after a cast to int32: the range check must see
# the index as given, not its int32 wrap-around.
WRAPPING_INT64 = [
    pytest.param(2**32 + 1, id="2**32+1"),
    pytest.param(-(2**32) + 2, id="-2**32+2"),
]


@pytest.mark.parametrize("value", WRAPPING_INT64)
def test_concrete_int64_index_out_of_range_is_not_wrapped_into_range(value):
    with jax.enable_x64(True):
        x = jnp.arange(4.0)
        with pytest.raises(IndexError, match=re.escape(f"`start_indices`[0]={value}")):
            esb.dynamic_slice(x, (jnp.asarray(value, jnp.int64),), (1,))


@requires_raise
@pytest.mark.parametrize("value", WRAPPING_INT64)
def test_traced_int64_index_out_of_range_is_not_wrapped_into_range(value):
    with jax.enable_x64(True):
        x = jnp.arange(4.0)
        run = jax.jit(lambda x, i: esb.dynamic_slice(x, (i,), (1,)))
        with pytest.raises(RUNTIME_ERRORS, match="out of range"):
            jax.block_until_ready(run(x, jnp.asarray(value, jnp.int64)))


# A narrow index dtype and a line longer than its largest value: a bound compared
# in the index's own dtype wraps (199 is -57 as an int8), and a valid index was
# reported out of range.
NARROW_INDICES = [
    pytest.param(jnp.int8, 200, id="int8"),
    pytest.param(jnp.uint8, 300, id="uint8"),
    pytest.param(jnp.int16, 40000, id="int16"),
]


@requires_raise
@pytest.mark.parametrize("as_buffer", [False, True], ids=["array", "ShiftBuffer"])
@pytest.mark.parametrize("dtype, n", NARROW_INDICES)
def test_a_narrow_traced_index_of_a_long_line_is_checked_in_range(dtype, n, as_buffer):
    x = jnp.arange(n, dtype=jnp.float32)
    valid = jnp.iinfo(dtype).max - 1  # every value of the dtype is a valid start

    def run(x, i):
        b = esb.ShiftBuffer(x) if as_buffer else x
        b = esb.insert(b, (i,), -1.0)
        return b.array if as_buffer else b

    if jnp.issubdtype(dtype, jnp.signedinteger):  # (first: a call by the fast path
        # of `jax.jit`, once compiled, raises a `ValueError` instead)
        with pytest.raises(RUNTIME_ERRORS, match="out of range"):
            jax.block_until_ready(jax.jit(run)(x, jnp.asarray(-1, dtype)))
    got = jax.jit(run)(x, jnp.asarray(valid, dtype))
    np.testing.assert_array_equal(got, ref.insert(np.asarray(x), (valid,), -1.0, 0))


# A read of a constant buffer (closed over) or of a broadcast scalar (a buffer made
# by `zeros` and read before any edit): XLA folds the window into a constant or a
# broadcast, dropping its start, and a check threaded into the start with it.
FOLDED_READS = {
    "closed-over zeros": lambda s: esb.dynamic_slice(jnp.zeros(4), (s,), (2,)),
    "closed-over ones ShiftBuffer": lambda s: esb.ShiftBuffer(
        jnp.ones((3, 4))
    ).dynamic_slice((0, s), (1, 2)),
    "zeros made inside": lambda s: esb.ShiftBuffer.zeros((4, 5)).dynamic_slice(
        (s, 0), (2, 1)
    ),
    "full made inside": lambda s: esb.read(jnp.full((4,), s * 1.0), (s,), (2,))[1],
}


@requires_raise
@pytest.mark.parametrize("read", list(FOLDED_READS))
def test_a_traced_out_of_range_read_of_a_constant_buffer_raises(read):
    run = jax.jit(FOLDED_READS[read])
    with pytest.raises(RUNTIME_ERRORS, match="out of range"):
        jax.block_until_ready(run(jnp.int32(3)))


def test_traced_index_in_range_runs_and_matches_numpy():
    x = buffer()
    run = jax.jit(lambda x, r, c: esb.insert(x, (r, c), 9.0))
    np.testing.assert_array_equal(
        run(x, 2, 3), ref.insert(np.asarray(x), (2, 3), 9.0, axis=1)
    )


# ---------------------------------------------------------------------------
# Index of the wrong type or length.


@pytest.mark.parametrize("op_name", list(OPS))
def test_python_float_index_is_a_type_error(op_name):
    op, argname, _ = OPS[op_name]
    with pytest.raises(
        TypeError,
        match=re.escape(f"`{argname}`[1] must be an integer; got the float 1.0"),
    ):
        op(buffer(), (0, 1.0))


@pytest.mark.parametrize("op_name", list(OPS))
def test_float32_array_index_is_a_type_error(op_name):
    op, argname, _ = OPS[op_name]
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"`{argname}`[1] must be an integer scalar; got an array of dtype float32."
        ),
    ):
        op(buffer(), (0, jnp.float32(1)))


def test_traced_float_index_is_a_type_error_at_trace_time():
    run = jax.jit(lambda x, i: esb.insert(x, (0, i), 1.0))
    with pytest.raises(
        TypeError, match=re.escape("`index`[1] must be an integer scalar")
    ):
        run(buffer(), jnp.float32(1))


def test_bool_index_is_a_type_error():
    with pytest.raises(
        TypeError, match=re.escape("`index`[1] must be an integer; got")
    ):
        esb.delete(buffer(), (0, True))


def test_non_scalar_index_is_a_type_error_that_suggests_vmap():
    with pytest.raises(
        TypeError,
        match=re.escape("`index`[1] must be a scalar (0-d); got an array of shape (2,)")
        + ".*vmap",
    ):
        esb.delete(buffer(), (0, jnp.array([1, 2])))


@pytest.mark.parametrize(
    "op_name, idx, expected",
    [
        (
            "insert",
            (1,),
            "`index` must have 2 entries (one per dimension up to and "
            "including axis 1); got 1.",
        ),
        (
            "pop",
            (0, 1, 2),
            "`index` must have 2 entries (one per dimension up to and "
            "including axis 1); got 3.",
        ),
        (
            "dynamic_slice",
            (0,),
            "`start_indices` must have 2 entries (one per buffer dimension); got 1.",
        ),
        (
            "dynamic_update_slice",
            (0, 0, 0),
            "`start_indices` must have 2 entries (one per buffer dimension); got 3.",
        ),
    ],
)
def test_wrong_number_of_index_entries_is_a_value_error(op_name, idx, expected):
    op, _, _ = OPS[op_name]
    with pytest.raises(ValueError, match=re.escape(expected)):
        op(buffer(), idx)


def test_bare_scalar_index_for_a_2d_line_is_a_type_error():
    with pytest.raises(
        TypeError,
        match=re.escape("`index` must be a tuple of 2 integer scalars") + ".*got 1",
    ):
        esb.delete(buffer(), 1)


# ---------------------------------------------------------------------------
# Values and updates of the wrong shape.


def test_insert_value_of_the_wrong_shape_is_a_value_error():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`value` must have shape () (the buffer's shape past axis 1); got shape (2,)."
        ),
    ):
        esb.insert(buffer(), (0, 1), jnp.ones(2))


def test_insert_feature_vector_of_the_wrong_shape_is_a_value_error():
    x = jnp.zeros((2, 5, 3))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`value` must have shape (3,) (the buffer's shape past axis 1); got shape (4,)."
        ),
    ):
        esb.insert(x, (0, 1), jnp.ones(4), axis=1)


def test_update_larger_than_the_buffer_is_a_value_error():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`update` of shape (4, 4) is larger than the buffer of shape (3, 4) "
            "along dimension 0."
        ),
    ):
        esb.dynamic_update_slice(buffer(), jnp.ones((4, 4)), (0, 0))


def test_update_of_the_wrong_rank_is_a_value_error():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`update` must have the buffer's rank 2; got shape (4,) for a buffer of "
            "shape (3, 4)."
        ),
    ):
        esb.dynamic_update_slice(buffer(), jnp.ones(4), (0, 0))


@pytest.mark.parametrize(
    "sizes, expected",
    [
        (
            (4, 1),
            "`slice_sizes`[0]=4 does not fit the buffer: valid sizes are 0 to 3 "
            "(buffer shape (3, 4)).",
        ),
        ((1, 5), "`slice_sizes`[1]=5 does not fit the buffer: valid sizes are 0 to 4"),
        ((1, -1), "`slice_sizes`[1]=-1 does not fit the buffer"),
    ],
    ids=["rows", "columns", "negative"],
)
def test_slice_sizes_that_do_not_fit_the_buffer_are_a_value_error(sizes, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        esb.dynamic_slice(buffer(), (0, 0), sizes)


def test_wrong_number_of_slice_sizes_is_a_value_error():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`slice_sizes` must have one entry per buffer dimension (2); got 1."
        ),
    ):
        esb.dynamic_slice(buffer(), (0, 0), (1,))


# ---------------------------------------------------------------------------
# `axis`.


def _axis_out_of_range(axis):
    return re.escape(
        f"`axis`={axis} is out of range for a buffer with 2 dimensions "
        "(valid: -2 to 1)."
    )


@pytest.mark.parametrize("axis", [2, -3])
def test_insert_axis_out_of_range_is_a_value_error(axis):
    with pytest.raises(
        ValueError,
        match=_axis_out_of_range(axis),
    ):
        esb.insert(buffer(), (0, 1), 1.0, axis=axis)


@pytest.mark.parametrize("axis", [2, -3])
def test_shift_buffer_from_array_axis_out_of_range_is_a_value_error(axis):
    with pytest.raises(
        ValueError,
        match=_axis_out_of_range(axis),
    ):
        esb.ShiftBuffer.from_array(buffer(), axis=axis)


def test_non_int_axis_is_a_type_error():
    with pytest.raises(
        TypeError, match=re.escape("`axis` must be a Python int; got 1.0")
    ):
        esb.insert(buffer(), (0, 1), 1.0, axis=1.0)


def test_axis_that_contradicts_a_shift_buffer_is_a_value_error():
    sb = esb.ShiftBuffer.from_array(buffer(), axis=1)
    with pytest.raises(
        ValueError,
        match=re.escape("`axis`=0 differs from the ShiftBuffer's own axis 1"),
    ):
        esb.insert(sb, 0, jnp.ones(4), axis=0)


# ---------------------------------------------------------------------------
# The buffer itself, and `fill`.


def test_buffer_that_is_not_an_array_is_a_type_error():
    with pytest.raises(
        TypeError, match="esb.insert: the buffer must be a JAX array.*; got list"
    ):
        esb.insert([0.0, 1.0], 0, 1.0)


def test_scalar_buffer_is_a_value_error():
    with pytest.raises(
        ValueError, match=re.escape("at least one dimension; got a scalar")
    ):
        esb.insert(jnp.float32(0), 0, 1.0)


def test_fill_not_representable_in_an_integer_buffer_is_a_type_error():
    with pytest.raises(
        TypeError,
        match=re.escape("`fill`=1.5 is not representable in the buffer's dtype int32."),
    ):
        esb.delete(buffer(jnp.int32), (0, 1), fill=1.5)


@pytest.mark.parametrize(
    "dtype, fill",
    [(jnp.uint8, -2), (jnp.int8, 300), (jnp.uint8, -2.0)],
    ids=["uint8--2", "int8-300", "uint8--2.0"],
)
def test_fill_out_of_an_integer_dtype_s_range_is_an_error_when_made(dtype, fill):
    # It was accepted, then wrapped (-2 filled a uint8 line with 254) or failed
    # inside the lowering with NumPy's OverflowError.
    with pytest.raises(OverflowError, match=re.escape(f"`fill`={int(fill)} is out")):
        esb.ShiftBuffer(jnp.ones((2, 3), dtype), axis=1, fill=fill)


def test_array_fill_is_a_type_error():
    with pytest.raises(TypeError, match=re.escape("`fill` must be a Python scalar")):
        esb.delete(buffer(), (0, 1), fill=jnp.float32(0))


# ---------------------------------------------------------------------------
# Integer buffers hold integers and are not differentiable.


def test_grad_with_respect_to_an_int32_buffer_is_a_type_error():
    loss = lambda x: esb.insert(x, (0, 1), 5).sum()
    with pytest.raises(TypeError, match="grad requires.*got int32"):
        jax.grad(loss)(buffer(jnp.int32))


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda x, p: esb.insert(x, (0, 1), p), id="insert"),
        pytest.param(
            lambda x, p: esb.dynamic_update_slice(x, jnp.full((1, 1), p), (0, 1)),
            id="dynamic_update_slice",
        ),
    ],
)
def test_grad_through_a_float_written_into_an_int32_buffer_is_a_type_error(write):
    loss = lambda p: write(buffer(jnp.int32), p).sum().astype(jnp.float32)
    with pytest.raises(
        TypeError,
        match=r"has floating dtype float\d+ but the buffer has dtype int32: an "
        r"integer buffer holds integers only",
    ):
        jax.grad(loss)(2.0)


def test_writing_a_float_into_an_int32_buffer_is_a_type_error_even_without_grad():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "`value` has floating dtype float32 but the buffer has dtype int32"
        ),
    ):
        esb.insert(buffer(jnp.int32), (0, 1), jnp.float32(2.0))


# Writes that would change a value, not only its type: `lax` refuses them, and
# `jnp`'s `.at[].set` warns that the complex one will be an error.
LOSSY_WRITES = {
    "complex into float32": (
        lambda: esb.insert(jnp.zeros(3, jnp.float32), (0,), jnp.complex64(1 + 2j)),
        TypeError,
        "`value` has complex dtype complex64 but the buffer has dtype float32: "
        "writing it would drop the imaginary part",
    ),
    "complex update into float32": (
        lambda: esb.dynamic_update_slice(
            jnp.zeros(3, jnp.float32), jnp.ones(1, jnp.complex64), (0,)
        ),
        TypeError,
        "`update` has complex dtype complex64",
    ),
    "300 into int8": (
        lambda: esb.insert(jnp.zeros(3, jnp.int8), (0,), 300),
        OverflowError,
        "`value` holds 300, which the buffer's dtype int8 cannot hold (its values "
        "are -128 to 127)",
    ),
    "-1 into uint8": (
        lambda: esb.ShiftBuffer(jnp.zeros(3, jnp.uint8)).insert(0, jnp.int32(-1)),
        OverflowError,
        "`value` holds -1, which the buffer's dtype uint8 cannot hold",
    ),
    "a float into a bool buffer": (
        lambda: esb.insert(jnp.zeros(3, bool), (0,), 0.5),
        TypeError,
        "but the buffer has dtype bool: a bool buffer holds bools only",
    ),
}


@pytest.mark.parametrize("write", list(LOSSY_WRITES))
def test_a_write_that_would_change_its_value_is_an_error(write):
    fn, error, message = LOSSY_WRITES[write]
    with pytest.raises(error, match=re.escape(message)):
        fn()


def test_values_that_fit_are_cast_to_the_buffer_s_dtype():
    got = esb.insert(jnp.zeros(3, jnp.int8), (0,), jnp.int32(-128))
    np.testing.assert_array_equal(got, np.array([-128, 0, 0], np.int8))
    got = esb.insert(jnp.zeros(3, jnp.bfloat16), (1,), jnp.float32(0.5))
    assert got.dtype == jnp.bfloat16 and float(got[1]) == 0.5


def test_zeros_takes_an_int_shape_as_jnp_zeros_does():
    assert esb.ShiftBuffer.zeros(5).shape == (5,)
    with pytest.raises(TypeError, match="`shape` must be an int or a sequence"):
        esb.ShiftBuffer.zeros(None)  # type: ignore[arg-type]


def test_an_int32_buffer_carried_through_grad_gets_a_float0_cotangent():
    # allow_int=True: the integer buffer is an input, its cotangent is symbolic zero.
    loss = lambda x: esb.insert(x, (0, 1), 5).astype(jnp.float32).sum()
    g = jax.grad(loss, allow_int=True)(buffer(jnp.int32))
    assert g.dtype == jax.dtypes.float0
    assert g.shape == (ROWS, CAPACITY)


# ---------------------------------------------------------------------------
# Integer and bool buffers work (without grad), exactly as the NumPy model.


def int_or_bool_buffer(dtype):
    x = buffer(jnp.int32)
    return (x % 3 == 0) if dtype == jnp.bool_ else x.astype(dtype)


DTYPES_AND_SCALARS = [
    pytest.param(jnp.int32, -5, id="int32"),
    pytest.param(jnp.bool_, True, id="bool"),
]


@pytest.mark.parametrize("dtype, value", DTYPES_AND_SCALARS)
@pytest.mark.parametrize("idx", [(0, 0), (1, 2), (2, 3)])
def test_integer_and_bool_insert_matches_numpy(dtype, value, idx):
    x = int_or_bool_buffer(dtype)
    out = esb.insert(x, idx, value)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, ref.insert(np.asarray(x), idx, value, axis=1))


@pytest.mark.parametrize("dtype, fill", DTYPES_AND_SCALARS)
@pytest.mark.parametrize("idx", [(0, 0), (1, 2), (2, 3)])
def test_integer_and_bool_delete_matches_numpy(dtype, fill, idx):
    x = int_or_bool_buffer(dtype)
    out = esb.delete(x, idx, fill=fill)
    assert out.dtype == dtype
    np.testing.assert_array_equal(
        out, ref.delete(np.asarray(x), idx, axis=1, fill=fill)
    )


@pytest.mark.parametrize("dtype, fill", DTYPES_AND_SCALARS)
@pytest.mark.parametrize("idx", [(0, 0), (1, 2), (2, 3)])
def test_integer_and_bool_pop_matches_numpy(dtype, fill, idx):
    x = int_or_bool_buffer(dtype)
    out, removed = esb.pop(x, idx, fill=fill)
    expected, expected_removed = ref.pop(np.asarray(x), idx, axis=1, fill=fill)
    assert out.dtype == removed.dtype == dtype
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(removed, expected_removed)


@pytest.mark.parametrize("dtype, value", DTYPES_AND_SCALARS)
def test_integer_and_bool_shift_buffer_in_a_scan_matches_numpy(dtype, value):
    x = int_or_bool_buffer(dtype)
    ops = [("insert", (0, 1)), ("pop", (1, 3)), ("insert", (2, 0)), ("pop", (0, 0))]

    def step(sb, k):
        kind, (r, c) = ops[k]
        if kind == "insert":
            return sb.insert((r, c), value), jnp.zeros((), dtype)
        return sb.pop((r, c))

    def body(sb, k):
        branches = [lambda sb, k=k: step(sb, k) for k in range(len(ops))]
        return lax.switch(k, branches, sb)

    sb, removed = lax.scan(body, esb.ShiftBuffer.from_array(x), jnp.arange(len(ops)))

    expected, expected_removed = np.asarray(x), []
    for kind, idx in ops:
        if kind == "insert":
            expected = ref.insert(expected, idx, value, axis=1)
            expected_removed.append(np.zeros((), dtype))
        else:
            expected, r = ref.pop(expected, idx, axis=1)
            expected_removed.append(r)
    np.testing.assert_array_equal(sb.array, expected)
    np.testing.assert_array_equal(removed, np.stack(expected_removed))


# ---------------------------------------------------------------------------
# A finished trace leaves nothing behind.


def test_a_jitted_read_of_a_closed_over_array_does_not_poison_later_calls():
    # Regression: the read token once recorded (in a trace-time table) for a concrete
    # array that a jitted function closed over was a tracer of that finished trace;
    # the next operation on the same array must not pick it up.
    x = jnp.arange(4.0)
    jax.jit(lambda i: esb.dynamic_slice(x, (i,), (1,)))(0)
    np.testing.assert_array_equal(esb.insert(x, 0, 9.0), [9.0, 0.0, 1.0, 2.0])


# `mode`


@pytest.mark.parametrize("op", ["insert", "delete", "pop", "slice", "update"])
def test_unknown_mode_is_an_error(op):
    buf = esb.ShiftBuffer.zeros((2, 4), jnp.float32)
    calls = {
        "insert": lambda: buf.insert((0, 1), 1.0, mode="clip"),
        "delete": lambda: buf.delete((0, 1), mode="clip"),
        "pop": lambda: buf.pop((0, 1), mode="clip"),
        "slice": lambda: buf.dynamic_slice((0, 1), (1, 2), mode="clip"),
        "update": lambda: buf.dynamic_update_slice(
            jnp.ones((1, 2)), (0, 1), mode="clip"
        ),
    }
    with pytest.raises(
        ValueError,
        match=re.escape("`mode` must be None or 'promise_in_bounds'; got 'clip'."),
    ):
        calls[op]()


def test_promise_in_bounds_still_checks_python_ints():
    buf = esb.ShiftBuffer.zeros((2, 4), jnp.float32)
    with pytest.raises(IndexError, match=re.escape("`index`[1]=4 is out of range")):
        buf.insert((0, 4), 1.0, mode="promise_in_bounds")


def test_promise_in_bounds_has_no_run_time_check():
    # The check is the only conditional in this program; promising removes it.
    def f(mode):
        return lambda b, i: esb.insert(b, (i, i), 1.0, mode=mode)

    b, i = jnp.zeros((2, 4)), jnp.int32(1)
    checked = jax.jit(f(None)).lower(b, i).as_text()
    promised = jax.jit(f("promise_in_bounds")).lower(b, i).as_text()
    assert "callback" in checked
    assert "callback" not in promised


@pytest.mark.parametrize(
    "start", [(5, 1), (-3, 1), (1, 9)], ids=["row+", "row-", "col+"]
)
def test_promised_window_ops_clamp_a_bad_start_as_lax_does(start):
    # A broken promise is the caller's bug, but the result is still lax's for a
    # start past the end, or one so negative that lax's wrapping lands it at 0: the
    # start is clamped (the read of a 1-wide window pairs it with a neighbour, and
    # the write widens it; neither may pick the wrong one).
    a = jnp.arange(12.0).reshape(3, 4)
    r, c = (jnp.int32(i) for i in start)
    read = jax.jit(
        lambda a, r, c: esb.dynamic_slice(a, (r, c), (1, 2), mode="promise_in_bounds")
    )
    np.testing.assert_array_equal(read(a, r, c), lax.dynamic_slice(a, (r, c), (1, 2)))
    upd = jnp.full((1, 2), -1.0)
    write = jax.jit(
        lambda a, r, c: esb.dynamic_update_slice(
            a, upd, (r, c), mode="promise_in_bounds"
        )
    )
    np.testing.assert_array_equal(
        write(a, r, c), lax.dynamic_update_slice(a, upd, (r, c))
    )


@pytest.mark.parametrize("op", ["dynamic_slice", "pop"])
def test_under_vmap_the_message_is_that_of_an_element_out_of_range(op):
    # One batch element is out of range in its second entry; the other is fine and
    # must not choose the message (nor may the buffer's error record, which is 0).
    calls = {
        "dynamic_slice": lambda x, r, c: esb.ShiftBuffer(x).dynamic_slice(
            (r, c), (1, 1)
        ),
        "pop": lambda x, r, c: esb.ShiftBuffer(x).pop((r, c))[1],
    }
    f = jax.jit(jax.vmap(calls[op], in_axes=(None, 0, 0)))
    rows, cols = jnp.zeros(2, jnp.int32), jnp.array([9, 0], jnp.int32)
    name = "start_indices" if op == "dynamic_slice" else "index"
    with pytest.raises(Exception, match=re.escape(f"`{name}`[1] is out of range")):
        jax.block_until_ready(f(jnp.ones((3, 4)), rows, cols))

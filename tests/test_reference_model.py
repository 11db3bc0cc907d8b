"""Every operation against the NumPy reference model, on random layouts and edits."""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax import lax

import eqx_shiftbuf as esb

from . import reference as ref
from .special import SPECIAL, special_array, WHERE
from .tiers import examples


# Per property test. The draws cover every layout, dtype, kind and position many
# times over at this count; more examples re-run the same code paths.
EXAMPLES = examples(100)

# (shape, axis): a flat line, rows of scalars, rows shifted as a whole, a stack of
# feature vectors, and a 3-D buffer shifted along its last axis.
LAYOUTS = [((7,), 0), ((3, 6), 1), ((4, 5), 0), ((2, 5, 3), 1), ((2, 3, 4), 2)]
DTYPES = [jnp.float32, jnp.float64, jnp.bfloat16, jnp.int32]


@st.composite
def buffers(draw, dtypes=DTYPES):
    shape, axis = draw(st.sampled_from(LAYOUTS))
    dtype = draw(st.sampled_from(dtypes))
    size = int(np.prod(shape))
    data = draw(st.lists(st.integers(-50, 50), min_size=size, max_size=size))
    array = np.asarray(data, dtype=np.float64).reshape(shape).astype(dtype)
    return array, axis, draw(st.booleans())


@st.composite
def line_index(draw, shape, axis):
    return tuple(draw(st.integers(0, shape[d] - 1)) for d in range(axis + 1))


def _value(draw, shape, axis, dtype):
    vshape = shape[axis + 1 :]
    n = int(np.prod(vshape))
    data = draw(st.lists(st.integers(-50, 50), min_size=n, max_size=n))
    return np.asarray(data, np.float64).reshape(vshape).astype(dtype)


def _window(draw, shape):
    sizes = tuple(draw(st.integers(0, n)) for n in shape)
    starts = tuple(draw(st.integers(0, n - s)) for n, s in zip(shape, sizes))
    return starts, sizes


def _wrap(array, axis, as_buffer):
    if as_buffer:
        return esb.ShiftBuffer.from_array(jnp.asarray(array), axis=axis)
    return jnp.asarray(array)


def _contents(x):
    return np.asarray(x.array if isinstance(x, esb.ShiftBuffer) else x)


def _apply(x, op, axis):
    """Apply one drawn op to the library buffer `x`; returns (x, output or None)."""
    kind = op[0]
    kw = {} if isinstance(x, esb.ShiftBuffer) else {"axis": axis}
    if kind == "insert":
        return esb.insert(x, op[1], jnp.asarray(op[2]), **kw), None
    if kind == "delete":
        return esb.delete(x, op[1], **kw), None
    if kind == "pop":
        return esb.pop(x, op[1], **kw)
    if kind == "slice":
        return x, esb.dynamic_slice(x, op[1], op[2])
    if kind == "update":
        return esb.dynamic_update_slice(x, jnp.asarray(op[2]), op[1]), None
    raise AssertionError(kind)


def _apply_ref(a, op, axis):
    kind = op[0]
    if kind == "insert":
        return ref.insert(a, op[1], op[2], axis), None
    if kind == "delete":
        return ref.delete(a, op[1], axis), None
    if kind == "pop":
        return ref.pop(a, op[1], axis)
    if kind == "slice":
        return a, ref.dynamic_slice(a, op[1], op[2])
    if kind == "update":
        return ref.dynamic_update_slice(a, op[2], op[1]), None
    raise AssertionError(kind)


@st.composite
def ops(draw, shape, axis, dtype, kinds=("insert", "delete", "pop", "slice", "update")):
    kind = draw(st.sampled_from(kinds))
    if kind in ("insert",):
        return (kind, draw(line_index(shape, axis)), _value(draw, shape, axis, dtype))
    if kind in ("delete", "pop"):
        return (kind, draw(line_index(shape, axis)))
    starts, sizes = _window(draw, shape)
    if kind == "slice":
        return (kind, starts, sizes)
    n = int(np.prod(sizes))
    data = draw(st.lists(st.integers(-50, 50), min_size=n, max_size=n))
    return (kind, starts, np.asarray(data, np.float64).reshape(sizes).astype(dtype))


def _check_one(data, kinds):
    array, axis, as_buffer = data.draw(buffers())
    op = data.draw(ops(array.shape, axis, array.dtype, kinds))
    x = _wrap(array, axis, as_buffer)
    x2, out = _apply(x, op, axis)
    a2, out_ref = _apply_ref(array, op, axis)
    assert type(x2) is type(x)
    np.testing.assert_array_equal(_contents(x2), a2)
    assert _contents(x2).dtype == array.dtype
    if out_ref is not None:
        np.testing.assert_array_equal(np.asarray(out), out_ref)
        assert out.shape == out_ref.shape


@pytest.mark.parametrize("kind", ["insert", "delete", "pop", "slice", "update"])
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_single_op_matches_numpy(kind, data):
    _check_one(data, (kind,))


@pytest.mark.heavy
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_random_op_sequence_matches_numpy(data):
    array, axis, as_buffer = data.draw(buffers())
    sequence = data.draw(
        st.lists(ops(array.shape, axis, array.dtype), min_size=1, max_size=8)
    )
    x = _wrap(array, axis, as_buffer)
    a = array
    for op in sequence:
        x, out = _apply(x, op, axis)
        a, out_ref = _apply_ref(a, op, axis)
        if out_ref is not None:
            np.testing.assert_array_equal(np.asarray(out), out_ref)
    np.testing.assert_array_equal(_contents(x), a)


def test_bool_buffer():
    a = np.array([[True, False, True], [False, False, True]])
    x = esb.insert(jnp.asarray(a), (1, 0), True)
    np.testing.assert_array_equal(np.asarray(x), ref.insert(a, (1, 0), True, 1))
    x, v = esb.pop(x, (0, 1))
    r, rv = ref.pop(ref.insert(a, (1, 0), True, 1), (0, 1), 1, False)
    np.testing.assert_array_equal(np.asarray(x), r)
    assert bool(v) == bool(rv)


def test_fill_value_is_shifted_in():
    buf = esb.ShiftBuffer.from_array(jnp.arange(6.0).reshape(2, 3), fill=-1.0)
    out = buf.delete((0, 0))
    np.testing.assert_array_equal(
        np.asarray(out.array), ref.delete(np.arange(6.0).reshape(2, 3), (0, 0), 1, -1.0)
    )
    np.testing.assert_array_equal(
        np.asarray(esb.delete(jnp.arange(3.0), (1,), fill=7.0)), [0.0, 2.0, 7.0]
    )


# Jitted once, at module level: one compile per dtype, shared by the cases below.
@jax.jit
def _jitted_pop(x, r, c):
    return esb.ShiftBuffer.from_array(x).pop((r, c))


@jax.jit
def _jitted_read(x, r, c):
    return esb.ShiftBuffer.from_array(x).dynamic_slice((r, c), (1, 2))


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("dtype, value", SPECIAL)
@pytest.mark.parametrize("others", ["same", "nan"], ids=["others-same", "others-nan"])
def test_pop_returns_any_value_bit_for_bit(dtype, value, others, where):
    # Jitted and traced: the run-time path.
    a = special_array(dtype, value, others, where)
    buf, got = _jitted_pop(jnp.asarray(a), *map(jnp.int32, where))
    expected, want = ref.pop(a, where, 1)
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes(), (got, want)
    np.testing.assert_array_equal(np.asarray(buf.array), expected)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("dtype, value", SPECIAL)
@pytest.mark.parametrize("others", ["same", "nan"], ids=["others-same", "others-nan"])
def test_dynamic_slice_returns_any_value_bit_for_bit(dtype, value, others, where):
    # A window read is a masked `max` over the window and a neighbouring row.
    r, c = where
    a = special_array(dtype, value, others, (r, slice(c - 1, c + 1)))
    got = np.asarray(_jitted_read(jnp.asarray(a), jnp.int32(r), jnp.int32(c - 1)))
    want = a[r : r + 1, c - 1 : c + 1]
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes(), (got, want)


# -- the same inside a jitted lax.scan, with traced, overlapping, out-of-order indices

STEPS = 12


def _scan_step(shape, axis):
    """One step: insert, dynamic_slice, pop, dynamic_update_slice, delete."""
    cap = shape[axis]
    lead = len(shape[:axis])

    def step(x, inp):
        ii, ip, iu, idel, v, u = inp
        x = esb.insert(x, tuple(ii), v)
        w = esb.dynamic_slice(x, tuple(iu), (1,) * len(shape))
        x, r = esb.pop(x, tuple(ip))
        x = esb.dynamic_update_slice(x, u + w, tuple(iu))
        x = esb.delete(x, tuple(idel))
        return x, (w, r)

    del cap, lead
    return step


def _scan_step_ref(shape, axis):
    def step(a, inp):
        ii, ip, iu, idel, v, u = inp
        a = ref.insert(a, tuple(ii), v, axis)
        w = ref.dynamic_slice(a, tuple(iu), (1,) * len(shape))
        a, r = ref.pop(a, tuple(ip), axis)
        a = ref.dynamic_update_slice(a, u + w, tuple(iu))
        a = ref.delete(a, tuple(idel), axis)
        return a, (w, r)

    return step


@st.composite
def scan_inputs(draw, shape, axis, dtype):
    def idx():
        return np.asarray(
            [draw(line_index(shape, axis)) for _ in range(STEPS)], np.int32
        )

    iu = np.asarray(
        [[draw(st.integers(0, n - 1)) for n in shape] for _ in range(STEPS)], np.int32
    )
    v = np.stack([_value(draw, shape, axis, dtype) for _ in range(STEPS)])
    u = (
        np.asarray(
            draw(st.lists(st.integers(-9, 9), min_size=STEPS, max_size=STEPS)),
            np.float64,
        )
        .reshape((STEPS,) + (1,) * len(shape))
        .astype(dtype)
    )
    return idx(), idx(), iu, idx(), v, u


@pytest.mark.parametrize("shape,axis", LAYOUTS)
@settings(max_examples=EXAMPLES // len(LAYOUTS) + 1)
@given(data=st.data())
def test_jitted_scan_of_edits_matches_numpy(shape, axis, data):
    dtype = np.float32
    array = np.asarray(
        data.draw(
            st.lists(
                st.integers(-50, 50),
                min_size=int(np.prod(shape)),
                max_size=int(np.prod(shape)),
            )
        ),
        np.float32,
    ).reshape(shape)
    xs = data.draw(scan_inputs(shape, axis, dtype))
    step = _scan_step(shape, axis)
    run = _jitted_scan(shape, axis)
    x, (ws, rs) = run(esb.ShiftBuffer.from_array(jnp.asarray(array), axis=axis), xs)
    a = array
    ref_step = _scan_step_ref(shape, axis)
    for t in range(STEPS):
        a, (w, r) = ref_step(a, tuple(z[t] for z in xs))
        np.testing.assert_array_equal(np.asarray(ws[t]), w)
        np.testing.assert_array_equal(np.asarray(rs[t]), r)
    np.testing.assert_array_equal(np.asarray(x.array), a)
    del step


_JITTED: dict = {}


def _jitted_scan(shape, axis):
    key = (shape, axis)
    if key not in _JITTED:
        step = _scan_step(shape, axis)
        _JITTED[key] = jax.jit(lambda x, xs: lax.scan(step, x, xs))
    return _JITTED[key]


@pytest.mark.parametrize("row", [0, 1, 2], ids=["first", "middle", "last"])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_shifts_at_every_row_position_in_a_scan(rows, row):
    # Shifts edit a line through a window of it and a neighbouring line (the last
    # line's neighbour is the one before it); a buffer of one line has no window.
    if row >= rows:
        pytest.skip("no such row")
    x0 = np.arange(rows * 5, dtype=np.float32).reshape(rows, 5)
    cols = np.array([0, 4, 2], np.int32)

    def step(b, c):
        b = b.insert((jnp.int32(row), c), 100.0 + c)
        b, out = b.pop((jnp.int32(row), (c + 1) % 5))
        return b.delete((jnp.int32(row), c)), out

    b, outs = jax.jit(lambda x, cs: lax.scan(step, esb.ShiftBuffer.from_array(x), cs))(
        x0, cols
    )
    expected, removed = x0, []
    for c in cols:
        expected = ref.insert(expected, (row, c), 100.0 + c, 1)
        expected, out = ref.pop(expected, (row, (c + 1) % 5), 1)
        expected = ref.delete(expected, (row, c), 1)
        removed.append(out)
    np.testing.assert_array_equal(b.array, expected)
    np.testing.assert_array_equal(outs, np.array(removed))

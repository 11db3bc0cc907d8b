"""State is threaded through values: nothing outlives its trace, no module is
mutated, one construction path, and a batch of buffers is a pytree like any other."""

import gc
import re
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_shiftbuf as esb


# ---------------------------------------------------------------------------
# Nothing outlives its trace.


def _live_tracers() -> int:
    gc.collect()
    return sum(isinstance(o, jax.core.Tracer) for o in gc.get_objects())


def test_eager_calls_keep_no_reference_to_their_arrays():
    refs = []
    for k in range(5):
        x = jnp.full((64, 256), float(k))
        refs.append(weakref.ref(x))
        esb.dynamic_slice(x, (1, 2), (1, 3))
        esb.pop(x, (1, 2))
        esb.insert(x, (0, 0), 1.0)
        buf = esb.ShiftBuffer.from_array(x)
        buf.read((0, 1), (2, 2))
        del x, buf
    gc.collect()
    assert [r() for r in refs] == [None] * 5


def _edit_and_read(buf, i):
    buf = buf.insert((i, i), 1.0)
    buf, w = buf.read((i, 0), (1, 2))
    w2 = buf.dynamic_slice((i, 1), (1, 2))
    buf, v = buf.pop((i, 0))
    return buf.delete((0, i)).array, w, w2, v


@pytest.mark.parametrize(
    "transform",
    [
        pytest.param(lambda f: f, id="plain"),
        pytest.param(
            lambda f: lambda b, i: jax.jvp(lambda b: f(b, i), (b,), (b,)),
            id="jvp",
            marks=pytest.mark.full,
        ),
        pytest.param(
            lambda f: lambda b, i: jax.grad(lambda b: f(b, i)[0].sum())(b),
            id="grad",  # a jvp, then its transpose
        ),
        pytest.param(
            lambda f: lambda b, i: jax.vmap(f, in_axes=(None, 0))(b, jnp.stack([i, i])),
            id="vmap",
            marks=pytest.mark.full,
        ),
    ],
)
def test_retracing_leaves_no_tracer_alive(transform):
    def trace(n):
        # Traced and lowered, as a call would; XLA's compile holds no tracer.
        buf = esb.ShiftBuffer.zeros((n, 6))
        jax.jit(transform(_edit_and_read)).lower(buf, jnp.int32(1))

    trace(3)  # JAX's own first-use caches
    before = _live_tracers()
    for n in range(4, 8):  # the old trace-time tables grew by ~100 per retrace
        trace(n)
    assert _live_tracers() <= before


def test_a_read_does_not_change_the_buffer_it_reads():
    seen = []

    @jax.jit
    def f(x, i):
        buf = esb.ShiftBuffer.from_array(x)
        storage = buf._storage
        buf.dynamic_slice((i, 0), (1, 2))
        _ = buf.array
        esb.dynamic_slice(buf, (i, 1), (1, 2))
        seen.append(buf._storage is storage)
        return buf.array

    f(jnp.ones((3, 4)), 1)
    assert seen == [True]


# ---------------------------------------------------------------------------
# Reads that return the buffer.


def test_read_returns_the_window_and_an_equal_buffer():
    x = jnp.arange(24.0).reshape(4, 6)
    buf = esb.ShiftBuffer.from_array(x, axis=1)
    buf2, w = jax.jit(lambda b, i: b.read((i, 2), (2, 3)))(buf, 1)
    np.testing.assert_array_equal(w, lax.dynamic_slice(x, (1, 2), (2, 3)))
    np.testing.assert_array_equal(buf2.array, x)
    assert jax.tree.structure(buf2) == jax.tree.structure(buf)


def test_read_without_a_window_returns_the_contents():
    x = jnp.arange(12.0).reshape(3, 4)
    buf = esb.ShiftBuffer.from_array(x).insert((1, 0), -1.0)
    buf2, contents = jax.jit(lambda b: b.read())(buf)
    np.testing.assert_array_equal(contents, buf.array)
    np.testing.assert_array_equal(buf2.array, buf.array)


def test_read_of_a_plain_array_returns_the_array():
    x = jnp.arange(12.0).reshape(3, 4)
    x2, w = esb.read(x, (1, 1), (2, 2))
    np.testing.assert_array_equal(x2, x)
    np.testing.assert_array_equal(w, x[1:3, 1:3])


def test_read_takes_both_a_start_and_sizes_or_neither():
    with pytest.raises(TypeError, match="give both `start_indices` and `slice_sizes`"):
        esb.read(jnp.zeros((3, 4)), (0, 0))


def test_read_raises_an_error_an_edit_recorded():
    buf = esb.ShiftBuffer.zeros((3, 4))
    f = jax.jit(lambda b, i: b.insert((i, 0), 1.0).read())
    with pytest.raises(Exception, match=re.escape("esb.insert: `index`[0]")):
        jax.block_until_ready(f(buf, 7))


def _read_then_write_step(buf, x):
    i, j, v = x
    buf, w = buf.read((i, 0), (1, 4))
    buf = buf.insert((j, 1), v)  # does not use `w`: ordered by the token only
    return buf, w.sum()


def _loss(arr, xs):
    buf, ys = lax.scan(_read_then_write_step, esb.ShiftBuffer.from_array(arr), xs)
    return (buf.array**2).sum() + ys.sum()


def _xs(steps, rows):
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.integers(0, rows, steps), jnp.int32),
        jnp.asarray(rng.integers(0, rows, steps), jnp.int32),
        jnp.asarray(rng.random(steps), jnp.float32),
    )


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: f,
        jax.grad,
        lambda f: lambda a, xs: jax.jvp(lambda a: f(a, xs), (a,), (a,)),
    ],
    ids=["forward", "grad", "jvp"],
)
def test_a_write_after_a_returned_read_is_in_place(transform):
    arr = jnp.ones((64, 128))
    copies = esb.find_loop_copies(
        jax.jit(transform(_loss)), arr, _xs(8, 64), min_bytes=arr.nbytes // 2
    )
    assert copies == []


def test_a_write_after_a_returned_read_has_plain_autodiff_gradients():
    def plain(arr, xs):
        def step(a, x):
            i, j, v = x
            zero = jnp.zeros_like(i)
            w = lax.dynamic_slice(a, (i, zero), (1, 4))
            line = lax.dynamic_slice(a, (j, zero), (1, a.shape[1]))[0]
            pos = jnp.arange(a.shape[1])
            line = jnp.where(pos < 1, line, jnp.where(pos == 1, v, jnp.roll(line, 1)))
            return lax.dynamic_update_slice(a, line[None], (j, zero)), w.sum()

        a, ys = lax.scan(step, arr, xs)
        return (a**2).sum() + ys.sum()

    arr = jnp.asarray(np.random.default_rng(1).random((8, 16)), jnp.float32)
    xs = _xs(20, 8)
    np.testing.assert_allclose(
        jax.grad(_loss)(arr, xs), jax.grad(plain)(arr, xs), rtol=1e-6
    )


# ---------------------------------------------------------------------------
# One way to build a ShiftBuffer.


def _edited(buf):
    if buf.axis == 0:
        return buf.insert(0, jnp.zeros(buf.shape[1:]))
    return buf.insert((0, 0), 0.0)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_every_constructor_builds_the_same_pytree(axis):
    x = jnp.zeros((3, 4))
    built = [
        esb.ShiftBuffer(x, axis=axis),
        esb.ShiftBuffer(x, axis),
        esb.ShiftBuffer.from_array(x, axis=axis),
        esb.ShiftBuffer.zeros((3, 4), axis=axis),
        _edited(esb.ShiftBuffer(x, axis=axis)),
    ]
    structures = {jax.tree.structure(b) for b in built}
    assert len(structures) == 1


def test_a_constructed_buffer_is_a_scan_carry_that_an_edit_returns():
    def step(b, i):
        return b.insert(i, jnp.full((2,), 1.0)), None

    buf, _ = lax.scan(step, esb.ShiftBuffer(jnp.zeros((5, 2)), axis=0), jnp.arange(3))
    np.testing.assert_array_equal(buf.array[:3], np.ones((3, 2)))


def test_a_model_deserialises_into_a_constructed_skeleton(tmp_path):
    saved = esb.ShiftBuffer.from_array(jnp.arange(6.0).reshape(3, 2), axis=0)
    saved = saved.insert(1, jnp.array([7.0, 8.0]))
    eqx.tree_serialise_leaves(tmp_path / "buf.eqx", saved)
    skeleton = esb.ShiftBuffer(jnp.zeros((3, 2)), axis=0)
    loaded = eqx.tree_deserialise_leaves(tmp_path / "buf.eqx", skeleton)
    np.testing.assert_array_equal(loaded.array, saved.array)


# ---------------------------------------------------------------------------
# A batch of buffers.


def _batch():
    a = jnp.arange(8 * 3 * 5, dtype=jnp.float32).reshape(8, 3, 5)
    return a, jax.vmap(esb.ShiftBuffer.from_array)(a)


def test_a_batch_of_buffers_has_its_contents_outside_vmap():
    a, bb = _batch()
    assert bb.batch_shape == (8,)
    assert bb.shape == (8, 3, 5)
    assert bb.capacity == 5
    np.testing.assert_array_equal(jax.jit(lambda b: b.array)(bb), a)
    np.testing.assert_array_equal(bb.array, a)


def test_a_batch_returned_by_a_vmapped_edit_has_its_contents_outside_vmap():
    a, bb = _batch()
    cols = jnp.arange(8, dtype=jnp.int32) % 5
    out = jax.jit(jax.vmap(lambda b, c: b.insert((1, c), -1.0)))(bb, cols)
    expected = np.stack([esb.insert(a[k], (1, int(cols[k])), -1.0) for k in range(8)])
    np.testing.assert_array_equal(jax.jit(lambda b: b.array)(out), expected)
    buf2, contents = jax.jit(lambda b: b.read())(out)
    np.testing.assert_array_equal(contents, expected)
    assert buf2.batch_shape == (8,)


def test_a_batch_raises_the_error_one_of_its_buffers_recorded():
    _, bb = _batch()
    cols = jnp.zeros(8, jnp.int32).at[5].set(9)
    f = jax.jit(lambda b, c: jax.vmap(lambda b, c: b.insert((1, c), -1.0))(b, c).array)
    jax.block_until_ready(f(bb, jnp.zeros(8, jnp.int32)))
    with pytest.raises(Exception, match=re.escape("esb.insert: `index`[1]")):
        jax.block_until_ready(f(bb, cols))


@pytest.mark.parametrize(
    "op",
    [
        lambda b: b.insert((0, 0), 1.0),
        lambda b: b.delete((0, 0)),
        lambda b: b.pop((0, 0)),
        lambda b: b.dynamic_slice((0, 0), (1, 1)),
        lambda b: b.read((0, 0), (1, 1)),
        lambda b: b.dynamic_update_slice(jnp.ones((1, 1)), (0, 0)),
    ],
    ids=["insert", "delete", "pop", "dynamic_slice", "read", "dynamic_update_slice"],
)
def test_an_edit_of_a_batch_outside_vmap_says_to_vmap_it(op):
    _, bb = _batch()
    with pytest.raises(
        TypeError, match=r"batch of buffers \(batch shape \(8,\).*jax\.vmap"
    ):
        op(bb)

"""A buffer of one line is stored as a ring (`_ops.Ring`): edits at either end move
one element. Its contents, reads, gradients and pytree behave as the logical array.
"""

from __future__ import annotations

import functools
import math

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax import lax
from jax.test_util import check_grads

import eqx_shiftbuf as esb

from . import reference as ref
from .tape import loop_bodies, loop_buffer_work, loop_instructions
from .tiers import examples


# (shape, axis) of buffers with one line: a flat line, a stack of feature vectors,
# one row, one row of vectors.
RINGS = [((7,), 0), ((6, 3), 0), ((1, 6), 1), ((1, 5, 2), 1)]


def _ends(shape, axis):
    """Index tuples of the two ends of the line, as Python ints."""
    lead = (0,) * axis
    return [lead + (0,), lead + (shape[axis] - 1,)]


@st.composite
def _op(draw, shape, axis):
    """An edit or read, with Python ints or traced indices (applied under
    `jax.jit`, so the head is unknown at trace time)."""
    kind = draw(st.sampled_from(["insert", "delete", "pop", "slice", "update"]))
    traced = draw(st.booleans())
    vshape = shape[axis + 1 :]
    value = np.float32(draw(st.integers(-50, 50))) + np.zeros(vshape, np.float32)
    if kind in ("insert", "delete", "pop"):
        # Python ints anywhere too: at an end the head moves; elsewhere a window
        # between the position and the nearer end moves (`_window_shift_side`).
        index = (0,) * axis + (draw(st.integers(0, shape[axis] - 1)),)
        if not traced and draw(st.booleans()):
            index = draw(st.sampled_from(_ends(shape, axis)))
        return kind, traced, index, value
    sizes = tuple(draw(st.integers(0, n)) for n in shape)
    starts = tuple(draw(st.integers(0, n - s)) for n, s in zip(shape, sizes))
    upd = np.asarray(
        draw(st.lists(st.integers(-9, 9), min_size=int(np.prod(sizes)))), np.float32
    )[: int(np.prod(sizes))].reshape(sizes)
    return kind, traced, starts, (sizes, upd)


def _run(b, i, kind, arg):
    if kind == "insert":
        return b.insert(i, arg), None
    if kind == "delete":
        return b.delete(i), None
    if kind == "pop":
        return b.pop(i)
    if kind == "slice":
        return b.read(i, arg)
    return b.dynamic_update_slice(arg, i), None


# One jitted function for every traced op: it compiles once per op kind and shape.
_run_traced = jax.jit(_run, static_argnames="kind")


def _apply(buf, op):
    kind, traced, index, arg = op
    arg = arg[0] if kind == "slice" else arg[1] if kind == "update" else arg
    if not traced:
        return _run(buf, index, kind, arg)
    index = tuple(map(jnp.int32, index))
    if kind == "slice":  # the sizes are static: close over them
        return jax.jit(lambda b, i: b.read(i, arg))(buf, index)
    return _run_traced(buf, index, kind, arg)


def _apply_ref(a, op, axis):
    kind, _, index, arg = op
    if kind == "insert":
        return ref.insert(a, index, arg, axis), None
    if kind == "delete":
        return ref.delete(a, index, axis), None
    if kind == "pop":
        return ref.pop(a, index, axis)
    if kind == "slice":
        return a, ref.dynamic_slice(a, index, arg[0])
    return ref.dynamic_update_slice(a, arg[1], index), None


@pytest.mark.parametrize(
    "shape, axis",
    # The quick run draws on a flat line and a row of vectors along axis 1.
    [
        r if r in (RINGS[0], RINGS[3]) else pytest.param(*r, marks=pytest.mark.full)
        for r in RINGS
    ],
)
@settings(max_examples=examples(10), deadline=None)
@given(data=st.data())
def test_edits_at_the_ends_and_anywhere_match_numpy(shape, axis, data):
    a = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 100
    buf = esb.ShiftBuffer(jnp.asarray(a), axis=axis)
    for op in data.draw(st.lists(_op(shape, axis), min_size=1, max_size=10)):
        buf, out = _apply(buf, op)
        a, want = _apply_ref(a, op, axis)
        if want is not None:
            assert np.shape(out) == np.shape(want)
            np.testing.assert_array_equal(np.asarray(out), want)
        np.testing.assert_array_equal(np.asarray(buf.array), a)


@pytest.mark.parametrize(
    "shape, axis, near",
    [((64,), 0, "front"), ((16, 3), 0, "back"), ((1, 64), 1, "back")]
    + [((1, 32, 2), 1, "front")],
)
def test_edits_between_the_ends_of_a_ring_match_numpy(shape, axis, near):
    # Moved as a window (`_window_shift_side`), the popped element was returned
    # with the window's leading dimensions: shape (1,) for a (1, n) line.
    a = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    p = 1 if near == "front" else shape[axis] - 2
    index = (0,) * axis + (p,)
    v = np.full(shape[axis + 1 :], -1.0, np.float32)

    def edits(b):
        b = b.insert((0,) * (axis + 1), v + 1)  # the head moves: the window wraps
        b = b.insert(index, v)
        return b.pop(index)

    b, got = jax.jit(edits)(esb.ShiftBuffer(jnp.asarray(a), axis=axis))
    want_a = ref.insert(ref.insert(a, (0,) * (axis + 1), v + 1, axis), index, v, axis)
    want_a, want = ref.pop(want_a, index, axis)
    assert got.shape == want.shape == shape[axis + 1 :]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(b.array, want_a)


def test_windows_of_a_complex_ring_match_numpy():
    # A complex window has no bit pattern to reduce over: read in a loop.
    a = (np.arange(16).reshape(8, 2) * (1 + 2j)).astype(np.complex64)

    def edits(b, i):
        b = b.insert(0, b.array[1])  # the head moves: the windows wrap
        b, w = b.read((i, 0), (3, 2))
        b = b.dynamic_update_slice(w[::-1], (i, 0))
        b, r = b.insert(2, w[0]).pop(6)
        return b.array, w, r

    got = jax.jit(edits)(esb.ShiftBuffer(jnp.asarray(a), axis=0), jnp.int32(5))
    want = ref.insert(a, (0,), a[1], 0)
    w = want[5:8].copy()
    want = ref.insert(ref.dynamic_update_slice(want, w[::-1], (5, 0)), (2,), w[0], 0)
    want, r = ref.pop(want, (6,), 0)
    for g, e in zip(got, (want, w, r), strict=True):
        np.testing.assert_array_equal(g, e)


def test_a_buffer_of_several_lines_is_not_a_ring():
    buf = esb.ShiftBuffer(jnp.zeros((2, 5)), axis=1).insert((0, 0), 1.0)
    # Its head is the NumPy zero it was made with: no edit moved it.
    assert isinstance(buf._head, np.ndarray)
    ring = esb.ShiftBuffer(jnp.zeros((5, 2)), axis=0).insert(0, jnp.ones(2))
    assert not isinstance(ring._head, np.ndarray)


def _loss(a, v, c):
    """A scan of pushes, pops at both ends, traced middle edits and wrapping window
    accesses on a ring, as a function of its initial contents and values."""

    def step(b, x):
        v, c = x
        k = b.shape[0]
        b = b.insert(0, jnp.sin(v))
        b = b.insert((c,), 0.5 * v)
        b, w = b.read((c % (k - 3), 0), (4, b.shape[1]))
        b = b.dynamic_update_slice(jnp.cos(w[::-1]), (c % (k - 3), 0))
        b, last = b.pop(k - 1)
        b, mid = b.pop((c,))
        return b, (w.sum() + last * mid).sum()

    b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=0), (v, c))
    return ys.sum() + (b.array**2).sum()


def _args(k=7, d=2, steps=9):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(k, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(steps, d)), jnp.float32)
    c = jnp.asarray(rng.integers(0, k, steps), jnp.int32)
    return a, v, c


def test_gradients_match_finite_differences():
    a, v, c = _args()
    a, v = a.astype(jnp.float64), v.astype(jnp.float64)
    with jax.enable_x64():
        f = jax.jit(lambda a, v: _loss(a, v, c))
        check_grads(f, (a, v), order=1, modes=("fwd", "rev"), atol=1e-5, rtol=1e-5)


def test_a_batch_of_rings_with_different_heads_matches_each_ring():
    # Each ring's wrapping window write is a scatter; batched, the scatters run in
    # a loop over the batch, each at its own head.
    a, v, c = _args()
    cs = jnp.stack([c, (c + 3) % 7, (c * 5) % 7])
    grad = jax.grad(_loss, argnums=(0, 1))
    got = jax.jit(jax.vmap(grad, in_axes=(None, None, 0)))(a, v, cs)
    for k in range(cs.shape[0]):
        want = jax.jit(grad)(a, v, cs[k])
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g[k], w, rtol=1e-6, atol=1e-6)


def test_vmapped_rings_with_different_heads():
    a, v, c = _args()
    # Each buffer of the batch pushes a different number of frames, so the heads
    # differ; `.array` of the batch and of each buffer agree with NumPy.
    counts = jnp.asarray([0, 1, 3, 8])

    def push(a, n):
        b = esb.ShiftBuffer(a, axis=0)
        return lax.fori_loop(0, n, lambda i, b: b.insert(0, jnp.full(2, i, a.dtype)), b)

    bufs = jax.jit(jax.vmap(push, in_axes=(None, 0)))(a, counts)
    for k, n in enumerate(np.asarray(counts)):
        want = np.asarray(a)
        for i in range(n):
            want = ref.insert(want, (0,), np.full(2, i, np.float32), 0)
        np.testing.assert_array_equal(np.asarray(bufs.array[k]), want)


def test_a_ring_crosses_serialisation_and_state(tmp_path):
    a, _, _ = _args()
    buf = esb.ShiftBuffer(a, axis=0).insert(0, jnp.ones(2)).insert(0, jnp.ones(2) * 2)
    path = tmp_path / "buf.eqx"
    eqx.tree_serialise_leaves(path, buf)
    back = eqx.tree_deserialise_leaves(path, esb.ShiftBuffer(jnp.zeros_like(a), axis=0))
    np.testing.assert_array_equal(back.array, buf.array)
    np.testing.assert_array_equal(back.pop(0)[1], jnp.ones(2) * 2)

    index = eqx.nn.StateIndex(esb.ShiftBuffer(a, axis=0))
    state = eqx.nn.State(index)
    step = eqx.filter_jit(lambda s, v: s.set(index, s.get(index).insert(0, v)))
    for i in range(3):
        state = step(state, jnp.full(2, float(i)))
    want = np.asarray(a)
    for i in range(3):
        want = ref.insert(want, (0,), np.full(2, float(i), np.float32), 0)
    np.testing.assert_array_equal(state.get(index).array, want)


def _all_patterns(dtype):
    """Rows of 4 elements holding bit patterns of `dtype` (NaN payloads, signalling
    NaNs, subnormals), at most 3072 of them."""
    width = np.dtype(dtype).itemsize
    bits = np.arange(2 ** (8 * width), dtype=np.int64)
    if bits.size > 4096:
        bits = bits[np.r_[0:1024, 32000:33024, 64512:65536]]
    return bits.astype({1: np.uint8, 2: np.uint16}[width]).view(dtype).reshape(-1, 4)


@pytest.mark.parametrize(
    "dtype",
    [jnp.bfloat16, jnp.float8_e5m2, jnp.float8_e4m3fn, jnp.float16],
    ids=lambda d: np.dtype(d).name,
)
@pytest.mark.parametrize("lines", [1, 3], ids=["ring", "rows"])
def test_shifts_and_writes_move_every_bit_pattern(dtype, lines):
    # A shift or a window write rewrites elements it does not change; they keep
    # their bits (NaN payloads, signalling NaNs, subnormals), on a ring (one line)
    # and on rows (three lines, shifted along axis 1).
    a = _all_patterns(dtype)
    k = a.shape[0]

    def edits(x):
        b = esb.ShiftBuffer(jnp.broadcast_to(x, (lines,) + x.shape), axis=1)
        line = (lines - 1,)
        b = b.insert(line + (0,), x[3])
        b, top = b.pop(line + (0,))
        b = b.insert(line + (0,), x[2]).insert(line + (jnp.int32(5),), x[1])
        b, mid = b.pop(line + (jnp.int32(7),))
        b = b.dynamic_update_slice(x[None, 9:12], line + (jnp.int32(k - 3), 0))
        b, w = b.read(line + (jnp.int32(k - 3), 0), (1, 3, 4))
        return b.array[-1], top, mid, w[0]

    want = ref.insert(np.asarray(a), (0,), a[3], 0)
    want, top = ref.pop(want, (0,), 0)
    want = ref.insert(ref.insert(want, (0,), a[2], 0), (5,), a[1], 0)
    want, mid = ref.pop(want, (7,), 0)
    want = ref.dynamic_update_slice(want, a[9:12], (k - 3, 0))
    expected = (want, top, mid, want[k - 3 :])
    got = jax.jit(edits)(jnp.asarray(a))
    for g, e in zip(got, expected, strict=True):
        g, e = np.asarray(g), np.asarray(e, dtype)
        assert g.tobytes() == e.tobytes()


# ---------------------------------------------------------------------------
# Reads of a ring at static positions (a delay line's taps) take the head and the
# position as an offset (`read_p`'s `wrap`): the same values and derivatives as a
# read at the computed start, and under `jax.grad` of a `lax.scan` one residual a
# step (the head) instead of one start per tap.

TAPS = (0, 1, 3, 5)


def _frame(v, shape):
    return jnp.tanh(v + jnp.arange(np.prod(shape), dtype=v.dtype).reshape(shape))


def _delay_step(taps, traced_tap: bool = False):
    def step(b, x):
        v, c = x
        k = b.shape[0]
        b = b.insert(0, _frame(v, b.shape[1:]))
        y = jnp.zeros((), v.dtype)
        for t in taps:
            b, w = b.read((t,) + (0,) * (b.ndim - 1), (1,) + b.shape[1:])
            y = y + jnp.sin(v * w).sum()
        if traced_tap:
            b, w = b.read((c % k,) + (0,) * (b.ndim - 1), (1,) + b.shape[1:])
            y = y + (v * w).sum()
        return b, y

    return step


def _delay_step_plain(taps, traced_tap: bool = False):
    def step(a, x):
        v, c = x
        k = a.shape[0]
        frame = _frame(v, a.shape[1:])
        a = jnp.concatenate([frame[None], a[:-1]])
        y = jnp.zeros((), v.dtype)
        for t in taps:
            y = y + jnp.sin(v * a[t : t + 1]).sum()
        if traced_tap:
            w = lax.dynamic_slice_in_dim(a, c % k, 1)
            y = y + (v * w).sum()
        return a, y

    return step


def _delay_loss(step, wrap):
    def loss(a, v, c):
        carry, ys = lax.scan(step, wrap(a), (v, c))
        arr = carry.array if isinstance(carry, esb.ShiftBuffer) else carry
        return (arr**2).sum() + ys.sum()

    return loss


def _delay_args(shape, steps=9, seed=3):
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(steps), jnp.float32)
    c = jnp.asarray(rng.integers(0, shape[0], steps), jnp.int32)
    return a, v, c


def _under(mode, loss):
    if mode == "fwd":
        return loss
    if mode == "grad":
        return jax.grad(loss, argnums=(0, 1))
    if mode == "jvp":
        return lambda a, v, c: jax.jvp(lambda a, v: loss(a, v, c), (a, v), (a, v))
    if mode == "vmap(grad)":
        return jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None, 0))
    assert mode == "jvp(vmap)"
    vl = jax.vmap(loss, in_axes=(0, None, 0))
    return lambda a, v, c: jax.jvp(lambda a, v: vl(a, v, c), (a, v), (a, v))


def _batched(mode, args):
    if "vmap" not in mode:
        return args
    a, v, c = args
    a = jnp.stack([a + k for k in range(3)])
    c = jnp.stack([(c + k) % a.shape[1] for k in range(3)])
    return a, v, c


def _assert_matches_plain_lax(mode, shape, step, step_plain):
    """`step` on a ring of `shape` and `step_plain` on the array, scanned under
    `mode` (`_under`), give the same values and derivatives."""
    args = _batched(mode, _delay_args(shape))
    lib = _delay_loss(step, lambda a: esb.ShiftBuffer(a, 0))
    plain = _delay_loss(step_plain, lambda a: a)
    got = jax.jit(_under(mode, lib))(*args)
    want = jax.jit(_under(mode, plain))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp", "vmap(grad)", "jvp(vmap)"])
@pytest.mark.parametrize("shape", [(8, 3), (8,)], ids=["frames", "flat"])
@pytest.mark.parametrize("traced_tap", [False, True], ids=["static", "mixed"])
def test_static_taps_of_a_ring_match_plain_lax(mode, shape, traced_tap):
    step, step_plain = (
        _delay_step(TAPS, traced_tap),
        _delay_step_plain(TAPS, traced_tap),
    )
    _assert_matches_plain_lax(mode, shape, step, step_plain)


ROWS = 3  # the windows' rows in `_window_step`


def _window_step(b, x):
    """A step of an (8, 3) ring whose head moves: windows of `ROWS` frames read at
    static offsets (wrapping round the storage as the head moves) and at a traced
    one, and edits at Python-int positions between the ends, near the front and
    near the back."""
    v, c = x
    k, lead = b.shape[0], (0,) * (b.ndim - 1)
    b = b.insert(0, _frame(v, b.shape[1:]))
    y = jnp.zeros((), v.dtype)
    for t in (0, 3, k - ROWS):
        b, w = b.read((t,) + lead, (ROWS,) + b.shape[1:])
        y = y + jnp.sin(v * w).sum()
    b, w = b.read((c % (k - ROWS + 1),) + lead, (ROWS,) + b.shape[1:])
    b = b.insert(2, jnp.cos(v) * jnp.ones(b.shape[1:], v.dtype))
    b, r = b.pop(5)
    b = b.delete(1).insert(6, r * v)
    b, s = b.pop(2)
    return b, y + (v * w).sum() + (r * s).sum()


def _window_step_plain(a, x):
    v, c = x
    k = a.shape[0]

    def insert(a, p, row):
        return jnp.concatenate([a[:p], row[None], a[p:-1]])

    def pop(a, p):
        return jnp.concatenate([a[:p], a[p + 1 :], jnp.zeros_like(a[:1])]), a[p]

    a = insert(a, 0, _frame(v, a.shape[1:]))
    y = jnp.zeros((), v.dtype)
    for t in (0, 3, k - ROWS):
        y = y + jnp.sin(v * a[t : t + ROWS]).sum()
    w = lax.dynamic_slice_in_dim(a, c % (k - ROWS + 1), ROWS)
    a = insert(a, 2, jnp.cos(v) * jnp.ones(a.shape[1:], v.dtype))
    a, r = pop(a, 5)
    a = insert(pop(a, 1)[0], 6, r * v)
    a, s = pop(a, 2)
    return a, y + (v * w).sum() + (r * s).sum()


# `jvp` gives the values too.
@pytest.mark.parametrize("mode", ["grad", "jvp", "vmap(grad)", "jvp(vmap)"])
def test_windows_and_edits_between_the_ends_of_a_ring_match_plain_lax(mode):
    # Each window is one gather whose rows wrap (`read_p`'s `ring`), at a static
    # offset from the head (`wrap`) or a traced start; each edit moves the window
    # between its position and the nearer end (`_ops._window_shift_side`).
    _assert_matches_plain_lax(mode, (8, 3), _window_step, _window_step_plain)


def _column_then_array_step(buf, x):
    v, c = x
    buf = buf.insert(0, jnp.full(3, v))
    buf, col = buf.read((c * 0, 1), (8, 1))  # the whole line, at a traced start
    return buf, col.sum() * v + buf.array[5:6, 1:3].sum()


def _column_then_array_step_plain(a, x):
    v, c = x
    a = jnp.concatenate([jnp.full((1, 3), v), a[:-1]])
    col = lax.dynamic_slice(a, (c * 0, c * 0 + 1), (8, 1))
    return a, col.sum() * v + a[5:6, 1:3].sum()


@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp", "vmap(grad)", "jvp(vmap)"])
def test_a_column_of_a_ring_then_its_array_match_plain_lax(mode):
    # The column is the whole line, so it is read and rotated by the head; the
    # rotation's deferral held the column's read, which the later `.array`
    # materialised and erased: a verifier error forward, a crash under `jvp`.
    step, step_plain = _column_then_array_step, _column_then_array_step_plain
    _assert_matches_plain_lax(mode, (8, 3), step, step_plain)


def test_an_edit_near_an_end_of_a_ring_moves_a_window_not_the_line():
    # An insert at K - 2 moves the last element and writes the value: a window of
    # two frames, where a shift of the whole line is a `select` over the buffer
    # and its roll, written first by a `reduce_window` (2.5-6x plain `lax`'s
    # forward on a (1024, 32) ring).
    def loss(a, xs):
        def step(b, v):
            b, r = b.pop(1020)
            return b.insert(3, r * v), r.sum()

        b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=0), xs)
        return b.array.sum() + ys.sum()

    a, xs = jnp.ones((1024, 32), jnp.float32), jnp.linspace(0.1, 1.0, 12)
    for fn in (loss, jax.grad(loss)):
        for body in loop_bodies(fn, a, xs).values():
            assert not [line for line in body if "reduce-window" in line]
        assert esb.find_loop_copies(fn, a, xs, min_bytes=a.nbytes // 2) == []


def test_a_window_moved_by_a_batch_of_rings_is_not_copied_under_jvp():
    # Batched, a ring's window is read in a loop, whose output started as a
    # constant broadcast; under `jvp(vmap)` the read and its tangent read started
    # from the one constant, and XLA copied it, the size of the window, every step.
    def loss(s, a, xs):
        def step(b, v):
            return b.insert(128, jnp.full((32,), v * s)), v

        b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=0), xs)
        return (b.array**2).sum() + ys.sum()

    a = jnp.ones((256, 32), jnp.float32)
    xs = jnp.stack([jnp.linspace(0.1, 1, 12), jnp.linspace(1, 2, 12)])
    vl = jax.vmap(loss, in_axes=(None, None, 0))
    fn = lambda s, a, xs: jax.jvp(lambda s, a: vl(s, a, xs), (s, a), (s, a))
    copies = esb.find_loop_copies(fn, jnp.float32(0.5), a, xs, min_bytes=4096)
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.heavy
def test_static_taps_of_a_ring_match_finite_differences():
    a, v, c = _delay_args((8, 3))
    loss = _delay_loss(_delay_step(TAPS, True), lambda a: esb.ShiftBuffer(a, 0))
    with jax.enable_x64():
        a, v = a.astype(jnp.float64), v.astype(jnp.float64)
        f = jax.jit(lambda a, v: loss(a, v, c))
        check_grads(f, (a, v), order=2, modes=("fwd", "rev"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bfloat16, jnp.float16])
def test_static_taps_of_a_ring_read_the_line_of_every_dtype(dtype):
    # Eager and jitted; bfloat16 reads through a reduction, the others as slices.
    a = jnp.arange(8 * 2).reshape(8, 2).astype(dtype)

    def taps(a):
        b = esb.ShiftBuffer(a, axis=0)
        for i in range(3):  # the head moves: 8 - 3 = 5
            b = b.insert(0, jnp.full((2,), 100 + i, dtype))
        return [b.dynamic_slice((t, 0), (1, 2)) for t in range(8)]

    want = np.asarray(a)
    for i in range(3):
        want = ref.insert(want, (0,), np.full((2,), 100 + i, want.dtype), 0)
    for got in (taps(a), jax.jit(taps)(a)):
        for t, w in enumerate(got):
            np.testing.assert_array_equal(np.asarray(w), want[t : t + 1])


def test_static_taps_of_a_batch_of_rings_with_different_heads():
    a = jnp.arange(6 * 2, dtype=jnp.float32).reshape(6, 2)
    counts = jnp.asarray([0, 1, 4, 7])

    def taps(n):
        b = esb.ShiftBuffer(a, axis=0)
        b = lax.fori_loop(0, n, lambda i, b: b.insert(0, jnp.full(2, i, a.dtype)), b)
        return jnp.concatenate([b.dynamic_slice((t, 0), (1, 2)) for t in (0, 2, 5)])

    got = jax.jit(jax.vmap(taps))(counts)
    for k, n in enumerate(np.asarray(counts)):
        want = np.asarray(a)
        for i in range(n):
            want = ref.insert(want, (0,), np.full(2, i, np.float32), 0)
        np.testing.assert_array_equal(np.asarray(got[k]), want[[0, 2, 5]])


def _per_step_residuals(taps) -> int:
    """How many arrays with one entry per step `jax.vjp` of a delay line's scan
    saves for its backward pass."""
    args = _delay_args((8, 3))
    loss = _delay_loss(_delay_step(taps), lambda a: esb.ShiftBuffer(a, 0))
    _, vjp = jax.vjp(lambda a, v: loss(a, v, args[2]), *args[:2])
    steps = args[1].shape[0]
    return sum(1 for r in jax.tree.leaves(vjp) if r.shape == (steps,))


def test_static_taps_of_a_ring_save_one_position_a_step_under_grad():
    # Each read at a start computed from the head saved its own start: one
    # residual per tap per step, a stacking kernel each in the compiled loop.
    assert _per_step_residuals((0, 1, 2, 3, 4, 5)) == _per_step_residuals((0,))


# (shape, window): a window of a ring as wide as every dimension of the buffer but
# the line's, so its write cannot be widened (`_xla.widened_write`).
RING_WINDOWS = [((4096,), (16,)), ((1024, 32), (4, 32))]


@pytest.mark.parametrize("start", ["python", "traced"])
@pytest.mark.parametrize("shape, window", RING_WINDOWS, ids=str)
def test_a_window_written_into_a_ring_is_in_place_under_grad(shape, window, start):
    # The write may wrap round the end of the storage, so it is two read-modify-
    # writes; transposed, each zeroes its window and adds a cotangent there.
    # Written at a Python-int start, the zeroing was fused into the addition's
    # read, which then read the older buffer: 2 copies a step.
    def loss(s, a, xs):
        def step(b, x):
            i, v = x
            i = 8 if start == "python" else i
            upd = jnp.full(window, v * s)
            return b.dynamic_update_slice(upd, (i,) + (0,) * (len(shape) - 1)), v

        b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=0), xs)
        return (b.array**2).sum() + ys.sum()

    t = jnp.arange(12, dtype=jnp.int32)
    xs = ((t * 37) % (shape[0] - window[0]), jnp.linspace(0.1, 1.0, 12))
    a = jnp.ones(shape, jnp.float32)
    fn = jax.grad(loss, argnums=(0, 1))
    copies = esb.find_loop_copies(fn, jnp.float32(0.5), a, xs, min_bytes=a.nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))


def test_a_window_written_into_a_ring_is_one_write():
    # A window of several rows of a ring may wrap round the end of the storage.
    # Written as read-modify-writes of the two windows at either end that hold it,
    # it took two reads and two writes of the buffer a step (1.8-2x plain `lax`'s
    # forward); it is one scatter (`swap_p`'s `ring`).
    def loss(a, xs):
        def step(b, x):
            i, v = x
            b = b.dynamic_update_slice(jnp.tanh(v + jnp.zeros((4, 32))), (8, 0))
            return b.dynamic_update_slice(jnp.cos(v + jnp.zeros((4, 32))), (i, 0)), v

        b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=0).insert(0, a[0]), xs)
        return b.array.sum() + ys.sum()

    t = jnp.arange(12, dtype=jnp.int32)
    xs = ((t * 37) % 1021, jnp.linspace(0.1, 1.0, 12))
    a = jnp.ones((1024, 32), jnp.float32)
    (body,) = loop_bodies(loss, a, xs).values()
    ops = ("fusion(", "scatter(", "dynamic-update-slice(", "copy(")
    writes = [
        line
        for line in body
        if "= f32[1024,32]" in line and any(op in line for op in ops)
    ]
    assert len(writes) == 2, "\n".join(writes)  # one each
    assert esb.find_loop_copies(loss, a, xs, min_bytes=a.nbytes // 2) == []


def test_a_window_read_at_a_python_int_start_of_a_batch_of_rings_is_in_place():
    # A window of several elements of a ring was read as the two windows at either
    # end of the storage that may hold it; batched, their transposes (two
    # accumulations in loops) copied the batch once a step. It is one gather, and
    # its transpose one scatter-add.
    def loss(s, a, xs):
        def step(b, v):
            return b, (b.dynamic_slice((3,), (16,)) * v * s).sum()

        b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=0), xs)
        return (b.array**2).sum() + ys.sum()

    xs = jnp.stack([jnp.linspace(0.1, 1, 12), jnp.linspace(1, 2, 12)])
    a = jnp.ones(4096, jnp.float32)
    fn = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, None, 0))
    copies = esb.find_loop_copies(fn, jnp.float32(0.5), a, xs, min_bytes=a.nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))


def test_a_pop_at_the_back_then_an_insert_at_a_traced_position_is_in_place():
    # Transposed, the insert is a shift of the cotangent (a `select` over the whole
    # buffer), then the pop a swap that reads an element of it: read through a
    # reduction, XLA fused the `select` into it, which then read the cotangent from
    # before the shift: a copy a step. The swap reads in a loop after such a shift.
    k = 64

    def loss(s, a, xs):
        def step(b, x):
            i, v = x
            b, r = b.pop(k - 1)
            return b.insert(i, r * v * s), r.sum()

        b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=0), xs)
        return (b.array**2).sum() + ys.sum()

    t = jnp.arange(12, dtype=jnp.int32)
    a, xs = jnp.ones((k, 32), jnp.float32), ((t * 37) % k, jnp.linspace(0.1, 1, 12))
    fn = jax.grad(loss, argnums=(0, 1))
    copies = esb.find_loop_copies(fn, jnp.float32(0.5), a, xs, min_bytes=a.nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))


def test_a_window_of_rows_of_a_ring_is_read_without_a_loop():
    # A window of several frames of a delay line has no dimension it is 1 wide in;
    # it is read through a reduction with the window one row further
    # (`_xla.window_by_reduce`). Such reads ran in loops of their own, two per
    # read of a ring (whose window may wrap): 4x plain `lax`'s forward.
    def loss(a, xs):
        def step(b, x):
            i, j, v = x
            b, w = b.read((i, 0), (4, 32))
            b = b.dynamic_update_slice(jnp.cos(w) * v, (j, 0))
            return b, w.sum()

        b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=0), xs)
        return b.array.sum() + ys.sum()

    t = jnp.arange(12, dtype=jnp.int32)
    xs = ((t * 37) % 1021, (t * 91) % 1021, jnp.linspace(0.1, 1.0, 12))
    a = jnp.ones((1024, 32), jnp.float32)
    bodies = loop_bodies(loss, a, xs)
    assert len(bodies) == 1
    nested = [line for b in bodies.values() for line in b if " while(" in line]
    assert nested == []
    assert esb.find_loop_copies(loss, a, xs, min_bytes=a.nbytes // 2) == []


@pytest.mark.parametrize("how", ["read", "array"])
def test_a_ring_whose_head_never_moves_is_read_whole_without_a_gather(how):
    # A cache edited by window writes only and attended over whole at every step:
    # its head stays the 0 it started as, which XLA finds in the loop's carry, and
    # the whole read's rotation folds away, in the forward and in the gradient's
    # forward loop. It was a gather a step: 1.8-2x plain `lax`'s forward on the
    # `kv_cache_attention` corpus body.
    def loss(s, a, xs):
        def step(b, x):
            t, v = x
            k = jnp.tanh(s * v + jnp.arange(16.0))[None]
            b = b.dynamic_update_slice(k, (t, 0))
            b, cache = b.read() if how == "read" else (b, b.array)
            w = jax.nn.softmax(cache @ jnp.cos(s * v - jnp.arange(16.0)))
            return b, (w @ cache).sum()

        _, ys = lax.scan(step, esb.ShiftBuffer.from_array(a, axis=0), xs)
        return ys.sum()

    t = jnp.arange(12, dtype=jnp.int32)
    args = (jnp.float32(0.5), jnp.zeros((20, 16)), (t % 20, jnp.linspace(0.1, 1, 12)))
    for fn in (loss, jax.grad(loss, argnums=(0, 1))):
        gathers = [line for line in loop_instructions(fn, *args) if " gather(" in line]
        # (The backward loop rotates the cotangent back: `rotate_p`'s `contents`.)
        assert [g for g in gathers if "transpose(" not in g] == [], gathers


@pytest.mark.parametrize("how", ["read", "array"])
def test_a_batch_of_rings_read_whole_makes_no_buffer_sized_array_per_step(how):
    # The same cache under `jax.vmap`: one initial cache for a batch of input
    # sequences. Each step read the batch of caches through a loop over the
    # batch, which started from zeros the size of all the caches, and rotated
    # them by their head broadcast to the batch, a gather: 2.5-3.2x plain `lax`'s
    # forward on the `kv_cache_attention` corpus body.
    def loss(s, a, xs, plain=False):
        def step(b, x):
            t, v = x
            k = jnp.tanh(s * v + jnp.arange(16.0))[None]
            if plain:
                b = cache = lax.dynamic_update_slice(b, k, (t, 0))
            else:
                b = b.dynamic_update_slice(k, (t, 0))
                b, cache = b.read() if how == "read" else (b, b.array)
            w = jax.nn.softmax(cache @ jnp.cos(s * v - jnp.arange(16.0)))
            return b, (w @ cache).sum()

        init = a if plain else esb.ShiftBuffer.from_array(a, axis=0)
        _, ys = lax.scan(step, init, xs)
        return ys.sum()

    t = jnp.arange(12, dtype=jnp.int32)
    a = jnp.zeros((20, 16))
    xs = (t % 20 + jnp.arange(4)[:, None], jnp.linspace(0.1, 1, 48).reshape(4, 12))
    args = (jnp.float32(0.5), a, xs)
    fwd = jax.vmap(loss, in_axes=(None, None, 0))
    assert loop_buffer_work(fwd, args, 4 * a.size) == []
    grad = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, None, 0))
    gathers = [line for line in loop_instructions(grad, *args) if " gather(" in line]
    assert [g for g in gathers if "transpose(" not in g] == [], gathers
    plain = jax.vmap(lambda *a: loss(*a, plain=True), in_axes=(None, None, 0))
    np.testing.assert_array_equal(fwd(*args), plain(*args))


@pytest.mark.parametrize("mode", ["vmap", "vmap(grad)"])
def test_a_batch_of_delay_lines_read_whole_matches_plain_lax(mode):
    # Every element of the batch pushes at the same end, so the heads move
    # together and stay one unbatched head: the batch is rotated by it as one
    # array (`_primitives._rotate_batch`).
    def loss(s, a, xs, plain=False):
        def step(b, v):
            frame = jnp.tanh(s * v + jnp.arange(4, dtype=jnp.float32))
            if plain:
                b = jnp.concatenate([frame[None], b[:-1]])
                whole = b
            else:
                b = b.insert(0, frame)
                whole = b.array
            w = jnp.arange(whole.shape[0], dtype=jnp.float32)[:, None]
            return b, (whole * w).sum()

        init = a if plain else esb.ShiftBuffer.from_array(a, axis=0)
        _, ys = lax.scan(step, init, xs)
        return ys.sum()

    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    xs = jnp.asarray(rng.normal(size=(3, 9)), jnp.float32)
    args = (jnp.float32(0.7), a, xs)
    lib, plain = loss, lambda *a: loss(*a, plain=True)
    if mode == "vmap(grad)":
        lib, plain = jax.grad(lib, argnums=(0, 1)), jax.grad(plain, argnums=(0, 1))
    got = jax.jit(jax.vmap(lib, in_axes=(None, None, 0)))(*args)
    want = jax.jit(jax.vmap(plain, in_axes=(None, None, 0)))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _read_then_insert(s, init, xs, first=True, jit=False, remat=False):
    """A delay line's step, its whole window read and summed, then a frame pushed
    at the front (`first`), or the other way round. `init`: a `ShiftBuffer`, or
    an array for plain `lax`. `jit`: the push in a `jax.jit` of its own. `remat`:
    the step under `jax.checkpoint`."""
    k, d = init.shape
    insert = lambda b, v: b.insert(0, v)
    insert = jax.jit(insert) if jit else insert

    def step(b, v):
        frame = jnp.tanh(s * v + jnp.arange(d, dtype=jnp.float32))
        w = jnp.cos(s * jnp.arange(k * d, dtype=jnp.float32)).reshape(k, d)
        if isinstance(b, esb.ShiftBuffer):
            b, whole = b.read() if first else insert(b, frame).read()
            b = insert(b, frame) if first else b
            return b, (whole * w).sum()
        y = (b * w).sum()
        b = jnp.concatenate([frame[None], b[:-1]])
        return b, y if first else (b * w).sum()

    _, ys = lax.scan(jax.checkpoint(step) if remat else step, init, xs)
    return ys.sum()


def _delay_line_args(batch: bool):
    """`(s, lines, xs)`: a (256, 64) float32 line, or a batch of two."""
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.normal(size=(256, 64)), jnp.float32)
    xs = jnp.asarray(rng.normal(size=(9,)), jnp.float32)
    if batch:
        a, xs = jnp.stack([a, 2 * a]), jnp.stack([xs, xs + 1])
    return jnp.float32(0.7), a, xs


@pytest.mark.parametrize(
    "mode",
    [
        "fwd",
        "grad",
        pytest.param("jvp", marks=pytest.mark.full),
        pytest.param("vmap", marks=pytest.mark.full),
        "vmap(grad)",
        "jit",
        "grad(checkpoint)",
    ],
)
def test_a_ring_read_whole_then_edited_at_its_front_is_in_place(mode):
    # A delay line's `read()` then `insert(0, x)`: the rotation that read is
    # fused into its readers, each a read of the storage that the insert's write
    # in place must follow. It is written out first, in a conditional, and the
    # insert waits for it (`_primitives.after_p`, `_xla.deferred_rotation`). It
    # copied the buffer every step (a (1024, 32) delay line: 2 forward, under
    # `grad` and under `jvp`, against plain `lax`'s 1, 2, 1; 2 under the vmap
    # modes). `jit`: the insert in a
    # `jax.jit` of its own, which waits for the read through the buffer's token.
    # `grad(checkpoint)`: the step under `jax.checkpoint`, whose rotation is saved,
    # not the window as read, the storage itself (`_rotate_partial_eval_custom`).
    batch = mode.startswith("vmap")
    s, a, xs = _delay_line_args(batch)
    ring = lambda a: esb.ShiftBuffer.from_array(a, axis=0)
    # Under `vmap`, a batch of lines, each with its own head.
    init = jax.vmap(ring)(a) if batch else ring(a)
    fn = functools.partial(
        _read_then_insert, jit=mode == "jit", remat=mode == "grad(checkpoint)"
    )
    if "grad" in mode:
        fn = jax.grad(fn)
    if mode == "jvp":
        fn = lambda s, init, xs, f=fn: jax.jvp(
            lambda s: f(s, init, xs), (s,), (jnp.float32(1),)
        )
    if batch:
        fn = jax.vmap(fn, in_axes=(None, 0, 0))
    assert esb.find_loop_copies(fn, s, init, xs, min_bytes=a.nbytes // 4) == []
    got, want = jax.jit(fn)(s, init, xs), jax.jit(fn)(s, a, xs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_a_ring_read_whole_that_no_edit_follows_is_not_in_a_conditional():
    # The other order (a delay line's `insert(0, x)` then `read()`): nothing
    # follows the read in the step, and its rotation stays fused into its one
    # reader (under `grad`, the stacking of it as a residual); in a conditional,
    # the gradient took 1.1-1.2x as long. The first order is the control.
    s, a, xs = _delay_line_args(batch=False)
    init = esb.ShiftBuffer.from_array(a, axis=0)
    conditionals = lambda fn: [
        i
        for i in loop_instructions(fn, s, init, xs)
        if " conditional(" in i and "f32[256,64]" in i
    ]
    for first in (False, True):
        loss = lambda s, init, xs, first=first: _read_then_insert(s, init, xs, first)
        for fn in (loss, jax.grad(loss)):
            assert (conditionals(fn) != []) == first


def test_two_whole_reads_of_a_complex_ring_then_a_traced_insert_are_in_place():
    # Found by fuzzing: under `grad`, the two reads' cotangents are accumulated
    # into the buffer's in two single-trip loops (complex), and the second
    # waited for the first loop's own trip count, a read of the storage from
    # before that loop wrote it in place: 1 copy a step (`_xla.user_reads_before`
    # no longer looks through loops). Plain `lax` copies nothing there.
    n = 256
    w = jnp.cos(jnp.arange(n) * 0.37).astype(jnp.float32)

    def loss(s, a, xs):
        def step(b, x):
            i, v = x
            value = (s * v + 1j * v).astype(jnp.complex64)
            if isinstance(b, esb.ShiftBuffer):
                b, w1 = b.read()
                b, w2 = b.read()
                b = b.insert(i, value)
            else:
                w1 = w2 = b
                pos = jnp.arange(n)
                rolled = jnp.roll(b, 1)
                b = jnp.where(pos < i, b, jnp.where(pos == i, value, rolled))
            y = (jnp.real(w1) * w).sum() + 2 * (jnp.imag(w2) * w).sum()
            return b, y

        _, ys = lax.scan(step, a, xs)
        return ys.sum()

    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.normal(size=n) + 1j * rng.normal(size=n), jnp.complex64)
    xs = (jnp.asarray(rng.integers(0, n, 6), jnp.int32), jnp.linspace(-1, 1, 6))
    s = jnp.float32(0.7)
    buf = esb.ShiftBuffer.from_array(a, axis=0).insert(0, a[5])
    moved = jnp.concatenate([a[5:6], a[:-1]])
    grad = jax.grad(loss)
    assert esb.find_loop_copies(grad, s, buf, xs, min_bytes=a.nbytes // 2) == []
    np.testing.assert_allclose(
        jax.jit(grad)(s, buf, xs), jax.jit(grad)(s, moved, xs), rtol=2e-5
    )


# (shape, axis, a static slice of `.array`): the window's rows wrap round the end
# of the storage for some heads; padded below along the other dimensions too.
ARRAY_SLICES = [
    ((8, 3), 0, np.s_[:4]),
    ((8, 3), 0, np.s_[5:8, 1:3]),
    ((1, 9), 1, np.s_[:, 2:7]),
    ((9,), 0, np.s_[6:]),
]


@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced"])
@pytest.mark.parametrize("shape, axis, index", ARRAY_SLICES, ids=str)
def test_a_slice_of_a_rings_array_has_plain_autodiff_gradients(
    shape, axis, index, traced
):
    """Under `grad`, the cotangent of a slice of a ring's `.array` (static, or at
    traced starts, clamped as `lax.dynamic_slice` clamps them) is added as the
    slice's window at its place in the storage, its rows wrapping
    (`_xla.rotated_window`), not rotated back whole: the gradients are plain
    autodiff's, for every head."""

    def loss(w, a, pushes, lib):
        b = _pushed(w, a, axis, pushes, lib)
        arr = b.array if lib else b
        if traced:  # the same window at run-time starts, one past the end
            window = arr[index]
            starts = [
                jnp.int32(0) if sl.start is None else jnp.int32(sl.start) + off
                for sl, off in zip(_slices(index, arr.ndim), (1, 0, 0), strict=False)
            ]
            return (jnp.sin(lax.dynamic_slice(arr, starts, window.shape)) * w).sum()
        return (jnp.sin(arr[index]) * w).sum()

    _assert_plain_autodiff_at_every_head(loss, shape, axis)


def _pushed(w, a, axis: int, pushes: int, lib: bool):
    """`a` (a ring's `ShiftBuffer` if `lib`, else the plain array) after `pushes`
    inserts at the front of its line, each moving the ring's head."""
    shape = a.shape
    v = jnp.tanh(w * jnp.arange(math.prod(shape[axis + 1 :]) or 1, dtype=jnp.float32))
    v = v.reshape(shape[axis + 1 :])
    b = esb.ShiftBuffer(a, axis=axis) if lib else a
    for k in range(pushes):
        if lib:
            b = b.insert((0,) * (axis + 1), v * (k + 1))
        else:
            front = jnp.expand_dims(v * (k + 1), tuple(range(axis + 1)))
            rest = lax.slice_in_dim(b, 0, shape[axis] - 1, axis=axis)
            b = jnp.concatenate([front, rest], axis=axis)
    return b


def _assert_plain_autodiff_at_every_head(loss, shape, axis: int) -> None:
    """`loss(w, a, pushes, lib)`'s gradients with respect to `w` and `a` are the
    same for the library (`lib`) as for plain `lax`, after 0 to `shape[axis]`
    pushes: every head of the ring."""
    a = jnp.arange(math.prod(shape), dtype=jnp.float32).reshape(shape) / 10
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=(2, 3))
    for pushes in range(shape[axis] + 1):
        got = grad(jnp.float32(0.7), a, pushes, True)
        want = grad(jnp.float32(0.7), a, pushes, False)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _slices(index, ndim: int) -> list:
    """`index` (a slice or a tuple of them) as one slice per dimension."""
    index = index if isinstance(index, tuple) else (index,)
    return list(index) + [slice(None)] * (ndim - len(index))


@pytest.mark.parametrize("how", ["array", "read", "dynamic_slice"])
@pytest.mark.parametrize("shape, axis", [((8, 3), 0), ((1, 9), 1), ((9,), 0)], ids=str)
def test_a_rings_whole_line_has_plain_autodiff_gradients(shape, axis, how):
    """Under `grad`, the cotangent of a ring's whole line read (weighted along the
    line, so that the rotation matters) is added to the storage's at its place,
    its rows wrapping (a scatter-add, `_xla.rotated_window`): the gradients are
    plain autodiff's, for every head."""
    weights = jnp.cos(jnp.arange(math.prod(shape), dtype=jnp.float32)).reshape(shape)

    def loss(w, a, pushes, lib):
        b = _pushed(w, a, axis, pushes, lib)
        if not lib:
            whole = b
        elif how == "array":
            whole = b.array
        elif how == "read":
            b, whole = b.read()
        else:
            whole = b.dynamic_slice((0,) * len(shape), shape)
        return (jnp.sin(whole) * weights * w).sum()

    _assert_plain_autodiff_at_every_head(loss, shape, axis)


@pytest.mark.parametrize("mode", ["grad", "vmap(grad)"])
def test_a_delay_line_read_whole_is_not_gathered_back_under_grad(mode):
    # The cotangent of the rotated line was rotated back, a gather of the whole
    # line written out every step, then added in a loop of one trip: the backward
    # pass 1.2-1.3x plain `lax`'s shift and add (`delay_whole`).
    def loss(s, a, xs):
        def step(b, x):
            b = b.insert(0, jnp.tanh(s * x + jnp.arange(8.0)))
            b, whole = b.read()
            return b, (whole * jnp.cos(jnp.arange(64.0))[:, None] * s).sum()

        _, ys = lax.scan(step, esb.ShiftBuffer.from_array(a, axis=0), xs)
        return ys.sum()

    a = jnp.zeros((64, 8))
    grad = jax.grad(loss, argnums=(0, 1))
    xs = jnp.linspace(-1, 1, 12)
    args = (jnp.float32(0.5), a, xs)
    if mode == "vmap(grad)":
        grad = jax.vmap(grad, in_axes=(None, None, 0))
        args = (args[0], a, jnp.stack([xs, -xs]))
    back = [
        line
        for line in loop_instructions(grad, *args)
        if " gather(" in line and "transpose(" in line  # the backward pass's
    ]
    assert [g for g in back if "[64,8]" in g or "[64,1,8]" in g] == [], back
    assert esb.find_loop_copies(grad, *args, min_bytes=a.nbytes // 2) == []

"""Reads that no access follows are plain slices; the others are ordered before it.

An unbatched read is lowered as a plain `dynamic_slice` (`_xla.deferred_read`), which
XLA fuses into its consumers as it does plain `lax` code, and the lowering of a later
access of the buffer turns it into a materialised read that the access waits for
(`_xla.materialise_deferred_reads`). These tests pin both halves: what stays plain,
and that every read an access follows, in the same function or across a `jax.jit`
inside the step, is ordered before it (no per-step copy).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_shiftbuf as esb
from eqx_shiftbuf import _xla

from . import natural
from .tape import loop_buffer_work


ROWS, COLS, STEPS = 64, 256, 20


def _loss(step, unroll=1, axis=1):
    def loss(a, xs):
        buf = esb.ShiftBuffer.from_array(a, axis=axis)
        buf, ys = lax.scan(step, buf, xs, unroll=unroll)
        return (buf.array**2).sum() + ys.sum()

    return loss


def _args():
    t = jnp.arange(STEPS, dtype=jnp.int32)
    return jnp.ones((ROWS, COLS)), (t % ROWS, t % 7, jnp.linspace(0.0, 1.0, STEPS))


def _deferred_in_lowering(fn) -> int:
    return jax.jit(fn).lower(*_args()).as_text().count(_xla._DEFERRED_READ)


def _write_then_taps(buf, x):
    i, j, v = x
    buf = buf.dynamic_update_slice(jnp.full((1, 16), v), (j, 0))
    y = jnp.zeros(())
    for k in range(3):
        buf, w = buf.read(((i + k) % ROWS, 0), (1, 16))
        y = y + jnp.tanh(w).sum()
    return buf, y


def _read_then_insert(buf, x):
    i, j, v = x
    buf, w = buf.read((i, 0), (1, 16))
    return buf.insert((j, 0), v), w.sum()


def _window_then_insert(buf, x):
    i, j, v = x
    w = buf.dynamic_slice((i, 0), (1, 16))  # the window only: no token
    return buf.insert((j, 0), v), w.sum()


def _insert_then_old_window(buf, x):
    i, j, v = x
    new = buf.insert((j, 0), v)
    w = buf.dynamic_slice((i, 0), (1, 16))  # the buffer from before the insert
    return new, w.sum()


def _insert_then_old_read(buf, x):
    i, j, v = x
    new = buf.insert((j, 0), v)
    _, w = buf.read((i, 0), (1, 16))  # the buffer from before the insert
    return new, w.sum()


@jax.jit
def _jitted_insert(buf, j, v):
    return buf.insert((j, 0), v)


@jax.jit
def _jitted_read(buf, i):
    return buf.read((i, 0), (1, 16))


@eqx.filter_jit
def _filter_jitted_read(buf, i):
    return buf.read((i, 0), (1, 16))


def _read_then_jitted_insert(buf, x):
    i, j, v = x
    buf, w = buf.read((i, 0), (1, 16))
    return _jitted_insert(buf, j, v), w.sum()


def _jitted_read_then_insert(buf, x):
    i, j, v = x
    buf, w = _jitted_read(buf, i)
    return buf.insert((j, 0), v), w.sum()


def _filter_jitted_read_then_insert(buf, x):
    i, j, v = x
    buf, w = _filter_jitted_read(buf, i)
    return buf.insert((j, 0), v), w.sum()


def test_reads_no_access_follows_stay_plain_slices():
    assert _deferred_in_lowering(_loss(_write_then_taps)) == 3


def test_a_read_an_access_follows_is_materialised():
    assert _deferred_in_lowering(_loss(_read_then_insert)) == 0


def test_reads_no_access_follows_copy_nothing():
    assert esb.find_loop_copies(jax.jit(_loss(_write_then_taps)), *_args()) == []


def _window_then_insert_in_a_jit(buf, x):
    # The whole step a `jax.jit` inside the scan's body (a jitted model method).
    i, j, v = x

    @jax.jit
    def inner(buf):
        w = buf.dynamic_slice((i, 0), (1, 16))
        return buf.insert((j, 0), v), w.sum()

    return inner(buf)


@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp"])
@pytest.mark.parametrize(
    "step",
    [_window_then_insert, _window_then_insert_in_a_jit],
    ids=["step", "jitted-step"],
)
def test_a_window_read_without_its_token_is_ordered_before_a_later_edit(step, mode):
    # Before reads were deferred, this step copied the buffer twice per step: the
    # insert did not wait for a read that returned no token. Under `jvp`, the
    # primal insert (in a called function: the scan's body) took the tangent read
    # too, and the tangent insert then had no read to wait for: 2 copies per step.
    copies = esb.find_loop_copies(jax.jit(_under(mode, _loss(step))), *_args())
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp"])
@pytest.mark.parametrize(
    "step", [_insert_then_old_window, _insert_then_old_read], ids=["window", "read"]
)
def test_a_read_of_the_old_buffer_after_its_edit_is_lowered_before_it(step, mode):
    # The read is traced after the insert but reads the buffer the insert was
    # given: lowered where it was traced, it kept that buffer alive past the
    # insert's in-place write, and XLA copied it (1 copy per step forward, 1
    # under grad, 2 under jvp on this buffer; 1-4 across shapes and modes). Its
    # lowering now goes before the insert's, whose token waits for it
    # (`_xla.edits_of`).
    copies = esb.find_loop_copies(jax.jit(_under(mode, _loss(step))), *_args())
    assert copies == [], "\n".join(map(str, copies))


_ACROSS_JIT = [
    _read_then_jitted_insert,
    _jitted_read_then_insert,
    _filter_jitted_read_then_insert,
]


def _under(mode, loss):
    if mode == "fwd":
        return loss
    if mode == "grad":
        return jax.grad(loss)
    return lambda a, xs: jax.jvp(lambda a: loss(a, xs), (a,), (a,))


@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp"])
@pytest.mark.parametrize("step", _ACROSS_JIT, ids=lambda f: f.__name__.strip("_"))
def test_reads_are_ordered_across_a_jit_inside_the_step(step, mode):
    fn = jax.jit(_under(mode, _loss(step)))
    copies = esb.find_loop_copies(fn, *_args())
    assert copies == [], "\n".join(map(str, copies))


# A step whose reads end it, called where the next step's first edit follows them
# in the same loop body: JAX lowers a function once however often it is called, so
# that edit was lowered before the reads it follows, and could not wait for them
# (a step of `lax.scan(..., unroll=2)`: 2 copies per step forward and under grad,
# 4 under jvp; a `jax.jit` step called twice: the same). A read at the end of a
# `jax.jit` step, then an edit after the call: below.
def _write_then_rows(buf, x):
    # `_write_then_taps` with whole rows (a delay line's frames, on the ring).
    i, j, v = x
    buf = buf.dynamic_update_slice(jnp.full((1, COLS), v), (j, 0))
    y = jnp.zeros(())
    for k in range(3):
        buf, w = buf.read(((i + k) % ROWS, 0), (1, COLS))
        y = y + jnp.tanh(w).sum()
    return buf, y


_jitted_write_then_taps = jax.jit(_write_then_rows)


def _jitted_taps_twice(buf, x):
    buf, y = _jitted_write_then_taps(buf, x)
    buf, z = _jitted_write_then_taps(buf, x)
    return buf, y + z


_CALLED = {
    "unrolled-scan": (_write_then_rows, 2),
    "jitted-step-twice": (_jitted_taps_twice, 1),
}
# Lines of 256 (axis 1), and one line of 64 rows, stored as a ring (axis 0).
AXES = [1, 0]


@pytest.mark.parametrize(
    "name, axis",
    [("unrolled-scan", 1), ("unrolled-scan", 0), ("jitted-step-twice", 0)],
    ids=["unrolled-scan-lines", "unrolled-scan-ring", "jitted-step-twice-ring"],
)
@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp"])
def test_reads_that_end_a_called_step_are_ordered_before_the_next_edit(
    name, axis, mode
):
    step, unroll = _CALLED[name]
    fn = jax.jit(_under(mode, _loss(step, unroll, axis)))
    copies = esb.find_loop_copies(fn, *_args())
    assert copies == [], "\n".join(map(str, copies))


def _plain_write_then_taps(a, x):
    i, j, v = x
    a = lax.dynamic_update_slice(a, jnp.full((1, 16), v), (j, jnp.int32(0)))
    y = jnp.zeros(())
    for k in range(3):
        y = (
            y
            + jnp.tanh(
                lax.dynamic_slice(a, ((i + k) % ROWS, jnp.int32(0)), (1, 16))
            ).sum()
        )
    return a, y


def _plain_read_then_insert(a, x):
    i, j, v = x
    w = lax.dynamic_slice(a, (i, jnp.int32(0)), (1, 16))
    row = jnp.concatenate([jnp.reshape(v, (1,)), a[j, :-1]])
    return a.at[j].set(row), w.sum()


_PLAIN = {
    _write_then_taps: _plain_write_then_taps,
    _window_then_insert: _plain_read_then_insert,
    _insert_then_old_window: _plain_read_then_insert,
    _insert_then_old_read: _plain_read_then_insert,
    **{step: _plain_read_then_insert for step in _ACROSS_JIT},
}


_ring_taps = natural.ROWS_BY_NAME["ring_taps"]
_jitted_ring_taps = jax.jit(lambda b, x, p: _ring_taps.step(natural.ESB, b, x, p))


def _jitted_ring_taps_then_write(ops, b, x, p):
    # The natural row `ring_taps` (a frame written, then eleven taps read: the
    # reads end it) as a `jax.jit` step, then a write after the call: the
    # write's lowering found no read to wait for, the reads being in the called
    # function, of a storage it did not return as it was given (2 copies per
    # step under grad and jvp; `_xla._aliases`).
    if ops is natural.ESB:
        b, y = _jitted_ring_taps(b, x, p)
    else:
        b, y = _ring_taps.step(ops, b, x, p)
    frame = jnp.full((1, ops.shape(b)[1]), y, jnp.float32)
    return ops.dynamic_update_slice(b, frame, (x["t"] % 7, jnp.int32(0))), y


@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp"])
def test_reads_that_end_a_jitted_step_are_ordered_before_an_edit_after_it(mode):
    row = dataclasses.replace(_ring_taps, step=_jitted_ring_taps_then_write)
    fn = natural.program(mode, natural.make_loss(row, natural.ESB))
    args = natural.args_for(row, mode, 12)
    copies = esb.find_loop_copies(fn, *args, min_bytes=natural.min_bytes(row))
    assert copies == [], "\n".join(map(str, copies))


def test_a_jitted_step_then_an_edit_has_plain_lax_values_and_gradients():
    row = dataclasses.replace(_ring_taps, step=_jitted_ring_taps_then_write)
    args = natural.args_for(row, "grad", 12)
    got = jax.jit(natural.program("grad", natural.make_loss(row, natural.ESB)))(*args)
    want = jax.jit(natural.program("grad", natural.make_loss(row, natural.PLAIN)))(
        *args
    )
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-5)


def _plain_write_then_rows(a, x):
    i, j, v = x
    a = lax.dynamic_update_slice(a, jnp.full((1, COLS), v), (j, jnp.int32(0)))
    rows = [lax.dynamic_slice_in_dim(a, (i + k) % ROWS, 1) for k in range(3)]
    return a, sum(jnp.tanh(w).sum() for w in rows)


def _plain_taps_twice(a, x):
    a, y = _plain_write_then_rows(a, x)
    a, z = _plain_write_then_rows(a, x)
    return a, y + z


@pytest.mark.parametrize(
    "name, plain_step",
    [
        ("unrolled-scan", _plain_write_then_rows),
        ("jitted-step-twice", _plain_taps_twice),
    ],
)
def test_called_steps_have_plain_lax_values_and_gradients(name, plain_step):
    step, unroll = _CALLED[name]

    def plain(a, xs):
        a, ys = lax.scan(plain_step, a, xs)
        return (a**2).sum() + ys.sum()

    want = jax.jit(jax.value_and_grad(plain))(*_args())
    for axis in AXES:
        got = jax.jit(jax.value_and_grad(_loss(step, unroll, axis)))(*_args())
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("step", list(_PLAIN), ids=lambda f: f.__name__.strip("_"))
def test_values_and_gradients_equal_plain_lax(step):
    def plain(a, xs):
        a, ys = lax.scan(_PLAIN[step], a, xs)
        return (a**2).sum() + ys.sum()

    got = jax.jit(jax.value_and_grad(_loss(step)))(*_args())
    want = jax.jit(jax.value_and_grad(plain))(*_args())
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_a_whole_window_reads_cotangent_is_added_in_place():
    # `dynamic_slice` drops the read's buffer, which is then used twice: JAX adds
    # the read's cotangent (the window's, accumulated onto zeros) to the rest's.
    # For a window of the whole buffer XLA:CPU fused that add into the next pop's
    # read and wrote it out of place (a copy per step); the next access folds it
    # into an in-place accumulation (`_xla.fold_cotangent_sum`). (For a smaller
    # window XLA itself turns the sum into an update of the window.)
    def loss(s, a, xs):
        def step(buf, x):
            i, j, v = x
            buf = buf.insert((j, 0), v)
            w = buf.dynamic_slice((0, 0), (ROWS, COLS))
            return buf, (w * s).sum()

        buf, ys = lax.scan(step, esb.ShiftBuffer.from_array(a), xs)
        return (buf.array**2).sum() + ys.sum()

    a, xs = _args()
    args = (jnp.float32(0.5), a.astype(jnp.float32), xs)
    fn = jax.grad(loss, (0, 1))
    work = loop_buffer_work(fn, args, f"f32[{ROWS},{COLS}]")
    assert work == [], "\n".join(work)


def _three_window_reads(buf, x):
    i, j, v = x
    buf = buf.insert((j, 0), v)
    w1 = buf.dynamic_slice((0, 0), (ROWS, COLS))
    w2 = buf.dynamic_slice((i, 0), (1, 16))
    w3 = buf.dynamic_slice((j, 0), (1, 16))
    return buf, (w1 * v).sum() + jnp.tanh(w2).sum() + (w3**2).sum()


def _window_reads_in_a_cond(buf, x):
    i, j, v = x
    buf = buf.insert((j, 0), v)
    w = lax.cond(
        v > 0.5,
        lambda: buf.dynamic_slice((i, 0), (1, 16)),
        lambda: buf.dynamic_slice((j, 0), (1, 16)) * 2.0,
    )
    whole = buf.dynamic_slice((0, 0), (ROWS, COLS))
    return buf, jnp.tanh(w).sum() + (whole * v).sum()


def _plain_insert(a, j, v):
    row = jnp.concatenate([jnp.reshape(v, (1,)), a[j, :-1]])
    return a.at[j].set(row)


def _plain_three_window_reads(a, x):
    i, j, v = x
    a = _plain_insert(a, j, v)
    w2 = lax.dynamic_slice(a, (i, jnp.int32(0)), (1, 16))
    w3 = lax.dynamic_slice(a, (j, jnp.int32(0)), (1, 16))
    return a, (a * v).sum() + jnp.tanh(w2).sum() + (w3**2).sum()


def _plain_window_reads_in_a_cond(a, x):
    i, j, v = x
    a = _plain_insert(a, j, v)
    w = lax.cond(
        v > 0.5,
        lambda: lax.dynamic_slice(a, (i, jnp.int32(0)), (1, 16)),
        lambda: lax.dynamic_slice(a, (j, jnp.int32(0)), (1, 16)) * 2.0,
    )
    return a, jnp.tanh(w).sum() + (a * v).sum()


@pytest.mark.parametrize(
    "step, plain_step",
    [
        (_three_window_reads, _plain_three_window_reads),
        (_window_reads_in_a_cond, _plain_window_reads_in_a_cond),
    ],
    ids=["three_window_reads", "window_reads_in_a_cond"],
)
def test_summed_cotangents_of_window_reads_equal_plain_lax(step, plain_step):
    # JAX sums the cotangents of a buffer that several reads drop; the fold of
    # such a sum (`_xla.fold_cotangent_sum`) must take exactly one accumulation.
    def plain(a, xs):
        a, ys = lax.scan(plain_step, a, xs)
        return (a**2).sum() + ys.sum()

    got = jax.jit(jax.value_and_grad(_loss(step)))(*_args())
    want = jax.jit(jax.value_and_grad(plain))(*_args())
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9)


def test_a_checked_read_of_the_old_buffer_moved_before_a_jitted_edit_lowers():
    # The read of the buffer from before a pop inside a nested `jax.jit` is
    # lowered before the pop, and its index check (a conditional whose branches
    # read values from around it) moves with it: moved without those values,
    # MLIR refused the program ("operand does not dominate this use") under the
    # gradient of a checkpointed `esb.scan` (found by a random-program fuzzer).
    def loss(kind):
        def f(a, init, cols):
            def step(b, c):
                new, v = jax.jit(lambda b: b.pop((0, c)))(b)
                w = b.dynamic_slice((0, 0), (1, 1))
                return new, v * a + w.sum()

            b0 = esb.ShiftBuffer.from_array(init, axis=1)
            if kind == "lax":
                b, ys = lax.scan(step, b0, cols)
            else:
                b, ys = esb.scan(step, b0, cols, kind="checkpointed")
            return ys.sum() + b.array.sum()

        return f

    init = jnp.arange(63.0).reshape(3, 21)
    cols = jnp.array([0, 5], jnp.int32)
    want = jax.grad(loss("lax"))(1.0, init, cols)
    got = jax.jit(jax.grad(loss("checkpointed")))(1.0, init, cols)
    np.testing.assert_allclose(got, want)

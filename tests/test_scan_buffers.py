"""`esb.scan(..., buffers=...)` against `equinox.internal.scan`, and the Equinox
buffer cases that fail or copy there passing under `esb.scan`."""

from __future__ import annotations

import functools

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_shiftbuf as esb

from .tape import loop_buffer_work
from .test_scan import _close


N = 16  # buffer rows; the scan writes rows 0..L-1 and reads the last row unwritten
L = 12


def _body(w):
    """Write row i; read row i-1 (written) or, at step 0, the never-written last row."""

    def body(carry, x):
        i, v, buf = carry
        prev = buf[jnp.where(i > 0, i - 1, buf.shape[0] - 1)]
        v = jnp.tanh(w * v + x + 0.5 * prev)
        buf = buf.at[i].set(v)
        return (i + 1, v, buf), v.sum()

    return body


def _loss(scan):
    def loss(w, buf0, xs):
        (_, v, buf), ys = scan(_body(w), (jnp.int32(0), jnp.ones(3), buf0), xs)
        return (buf**2).sum() + ys.sum() + v.sum()

    return loss


def _args():
    rng = np.random.default_rng(0)
    return 0.7, jnp.asarray(rng.normal(size=(N, 3))), jnp.linspace(0.0, 1.0, L)


def _third(c):
    return c[2]


ESB = {
    "lax": lambda f, c, x: esb.scan(f, c, x, kind="lax", buffers=_third),
    "ckpt-3": lambda f, c, x: esb.scan(f, c, x, checkpoints=3, buffers=_third),
    "ckpt-all": lambda f, c, x: esb.scan(f, c, x, checkpoints="all", buffers=_third),
    "ckpt-3-checked": lambda f, c, x: esb.scan(
        f, c, x, checkpoints=3, buffers=_third, check=True
    ),
}
EQXI = {
    "ckpt-3": lambda f, c, x: eqxi.scan(
        f, c, x, kind="checkpointed", checkpoints=3, buffers=_third
    ),
    "ckpt-all": lambda f, c, x: eqxi.scan(
        f, c, x, kind="checkpointed", checkpoints="all", buffers=_third
    ),
}


@functools.cache
def _grad(scan):
    """The value and gradient of `_loss(scan)` at `_args()`, jitted; computed once
    per scan (`ESB`, `EQXI`, `lax.scan`) for the tests that share it."""
    return jax.jit(jax.value_and_grad(_loss(scan), argnums=(0, 1, 2)))(*_args())


def _plain_autodiff():
    """The reference: lax.scan on the raw array (`buf[i]`, `buf.at[i].set` on jnp)."""
    return _grad(lax.scan)


@pytest.mark.parametrize("name", ESB)
def test_values_and_gradients_equal_plain_autodiff(name):
    _close(_grad(ESB[name]), _plain_autodiff())


@pytest.mark.parametrize("name", EQXI)
def test_same_values_and_gradients_as_equinox_except_its_initial_buffer_gradient(name):
    (v_e, (gw_e, gb_e, gx_e)), (v_q, (gw_q, gb_q, gx_q)) = (
        _grad(ESB[name]),
        _grad(EQXI[name]),
    )
    _close((v_e, gw_e, gx_e), (v_q, gw_q, gx_q))
    # Equinox passes the final-buffer cotangent through every write: its gradient
    # for the initial contents is wrong at written rows, ours is zero there.
    _, (_, gb_ref, _) = _plain_autodiff()
    _close(gb_e, gb_ref)
    np.testing.assert_array_equal(np.asarray(gb_e[:L]), 0.0)
    assert not np.allclose(np.asarray(gb_q[:L]), 0.0)


def test_equinox_differentiates_a_second_write_wrongly_and_esb_exactly():
    # Two writes to row 0 and no read in between: allowed for the gradient here
    # (writes transpose exactly), silently wrong in Equinox.
    def loss(scan, w, buf0):
        def body(buf, x):
            return buf.at[0].set(jnp.sin(w * x) * jnp.ones(3)), None

        buf, _ = scan(body, buf0, jnp.linspace(0.0, 1.0, 5))
        return (buf**2).sum()

    buf0 = jnp.ones((4, 3))
    grad = lambda scan: jax.jit(
        jax.grad(lambda w, b: loss(scan, w, b), argnums=(0, 1))
    )(0.3, buf0)
    ref = grad(lax.scan)
    ours = lambda f, c, x: esb.scan(f, c, x, buffers=lambda b: b, checkpoints=2)
    theirs = lambda f, c, x: eqxi.scan(
        f, c, x, buffers=lambda b: b, kind="checkpointed", checkpoints=2
    )
    _close(grad(ours), ref)
    got = grad(theirs)
    assert not np.allclose(np.asarray(got[1]), np.asarray(ref[1]))


def test_checked_mode_raises_on_a_second_write():
    def run(check):
        def body(buf, x):
            return buf.at[0].set(x * jnp.ones(3)), None

        return esb.scan(
            body, jnp.zeros((4, 3)), jnp.ones(3), buffers=lambda b: b, check=check
        )

    run(False)
    with pytest.raises(Exception, match="second write to a buffer position"):
        jax.block_until_ready(run(True))


def test_checked_mode_raises_on_a_read_before_write():
    # Step i reads row i + 1, which step i + 1 then writes.
    def body(buf, i):
        return buf.at[i].set(buf[i + 1] + 1.0), None

    run = lambda check: esb.scan(
        body, jnp.zeros((4,)), jnp.arange(3), buffers=lambda b: b, check=check
    )
    run(False)
    with pytest.raises(Exception, match="read before it was written"):
        jax.block_until_ready(run(True))


def test_checked_mode_allows_reading_positions_never_written():
    def body(buf, i):
        return buf.at[i].set(buf[3] + 1.0), None

    buf, _ = esb.scan(
        body, jnp.zeros((4,)), jnp.arange(3), buffers=lambda b: b, check=True
    )
    np.testing.assert_array_equal(np.asarray(buf), [1.0, 1.0, 1.0, 0.0])


def test_checked_mode_is_off_while_steps_are_rerun():
    # The reverse pass reruns steps against the final (fully written) buffer; the
    # checks must not fire there. (Differentiated with respect to `buf0` too: a
    # check that fired would raise.)
    _close(_grad(ESB["ckpt-3-checked"]), _plain_autodiff())


# Read-before-write wherever the read happens. Step i reads row i + 1 through
# `read(buf, j)` and writes row i; step i + 1 then writes the row step i read.


def _checked_run(read, **kwargs):
    def body(buf, i):
        return buf.at[i].set(read(buf, i + 1) + 1.0), None

    def run(buf0):
        buf, _ = esb.scan(
            body, buf0, jnp.arange(3), buffers=lambda b: b, check=True, **kwargs
        )
        return buf

    return run


def _read_in_cond(buf, j):
    return lax.cond(j > 0, lambda: buf[j], lambda: jnp.float32(0.0))


READ_BEFORE_WRITE = "read before it was written"


@pytest.mark.parametrize("kind", ["lax", "checkpointed"])
def test_checked_mode_raises_on_a_read_inside_cond_before_write(kind):
    run = jax.jit(_checked_run(_read_in_cond, kind=kind))
    with pytest.raises(Exception, match=READ_BEFORE_WRITE):
        jax.block_until_ready(run(jnp.zeros(4, jnp.float32)))


def test_checked_mode_raises_on_a_read_inside_cond_before_write_under_grad():
    loss = lambda b: (_checked_run(_read_in_cond, checkpoints=2)(b) ** 2).sum()
    with pytest.raises(Exception, match=READ_BEFORE_WRITE):
        jax.block_until_ready(jax.jit(jax.grad(loss))(jnp.zeros(4, jnp.float32)))


def test_checked_mode_raises_on_a_read_inside_switch_before_write():
    def read(buf, j):
        return lax.switch(j % 2, [lambda: buf[j], lambda: 2.0 * buf[j]])

    with pytest.raises(Exception, match=READ_BEFORE_WRITE):
        jax.block_until_ready(jax.jit(_checked_run(read))(jnp.zeros(4)))


def test_checked_mode_raises_on_a_read_inside_an_inner_fori_loop_before_write():
    def read(buf, j):
        return lax.fori_loop(0, 2, lambda k, acc: acc + buf[j], jnp.float32(0.0))

    with pytest.raises(Exception, match=READ_BEFORE_WRITE):
        jax.block_until_ready(jax.jit(_checked_run(read))(jnp.zeros(4, jnp.float32)))


def test_checked_mode_raises_on_a_read_inside_jax_checkpoint_before_write():
    read = lambda buf, j: jax.checkpoint(lambda: buf[j])()
    with pytest.raises(Exception, match=READ_BEFORE_WRITE):
        jax.block_until_ready(jax.jit(_checked_run(read))(jnp.zeros(4)))


def test_checked_mode_raises_on_a_read_before_write_under_vmap():
    run = jax.jit(jax.vmap(_checked_run(_read_in_cond)))
    with pytest.raises(Exception, match=READ_BEFORE_WRITE):
        jax.block_until_ready(run(jnp.zeros((2, 4), jnp.float32)))


def test_checked_mode_raises_on_a_read_in_an_inner_scan_before_the_outer_write():
    # The outer step k reads, in an inner esb.scan, the row that the outer step
    # k + 1 writes.
    def outer(buf, k):
        def inner(acc, j):
            return acc + buf[k + 1], None

        acc, _ = esb.scan(inner, jnp.float32(0.0), jnp.arange(2))
        return buf.at[k].set(acc), None

    run = lambda b: esb.scan(outer, b, jnp.arange(3), buffers=lambda b: b, check=True)
    with pytest.raises(Exception, match=READ_BEFORE_WRITE):
        jax.block_until_ready(jax.jit(run)(jnp.zeros(4, jnp.float32)))


def test_checked_mode_raises_on_a_read_before_write_inside_an_inner_scan():
    # The inner scan carries the outer buffer; its step j reads the row its step
    # j + 1 writes: a later write in the same outer step.
    def outer(buf, k):
        def inner(buf, j):
            return buf.at[3 * k + j].set(buf[3 * k + j + 1] + 1.0), None

        buf, _ = esb.scan(inner, buf, jnp.arange(2), buffers=lambda b: b)
        return buf, None

    run = lambda b: esb.scan(outer, b, jnp.arange(2), buffers=lambda b: b, check=True)
    with pytest.raises(Exception, match=READ_BEFORE_WRITE):
        jax.block_until_ready(jax.jit(run)(jnp.zeros(6, jnp.float32)))


def test_checked_mode_allows_reading_what_an_inner_scan_wrote_earlier_in_the_step():
    def loss(scan, w):
        def outer(buf, k):
            def inner(buf, j):
                return buf.at[2 * k + j].set(jnp.sin(w * (k + j))), None

            buf, _ = scan(inner, buf, jnp.arange(2))
            return buf, buf[2 * k] * buf[2 * k + 1]

        buf, ys = scan(outer, jnp.zeros(6), jnp.arange(3))
        return (buf**2).sum() + ys.sum()

    ours = lambda f, c, x: esb.scan(
        f, c, x, checkpoints=2, buffers=lambda b: b, check=True
    )
    grad = lambda scan: jax.jit(jax.value_and_grad(lambda w: loss(scan, w)))(0.3)
    _close(grad(ours), grad(lax.scan))


def test_checked_mode_raises_when_only_ys_are_used():
    # The check must not be dead code when the buffer itself is not returned.
    def body(buf, i):
        v = _read_in_cond(buf, i + 1)
        return buf.at[i].set(v), v

    run = lambda b: esb.scan(body, b, jnp.arange(3), buffers=lambda b: b, check=True)[1]
    with pytest.raises(Exception, match=READ_BEFORE_WRITE):
        jax.block_until_ready(jax.jit(run)(jnp.zeros(4, jnp.float32)))


def test_checked_mode_raises_on_a_second_write_inside_cond():
    def body(buf, x):
        write = lambda b: b.at[0].set(x * jnp.ones(3))
        return lax.cond(x > 0, write, lambda b: b, buf), None

    run = lambda b: esb.scan(body, b, jnp.ones(3), buffers=lambda b: b, check=True)
    with pytest.raises(Exception, match="second write to a buffer position"):
        jax.block_until_ready(jax.jit(run)(jnp.zeros((4, 3))))


def test_checked_mode_keeps_the_buffer_and_its_record_in_place():
    # The record of writes is updated in place by the run, and only read by the
    # replay: no copy per step of either array, forward or reverse.
    def loss(w, buf0):
        def body(carry, i):
            v, buf = carry
            buf = buf.at[i].set(jnp.sin(w * v))
            v = buf[jnp.where(i > 0, i - 1, buf.shape[0] - 1)]
            return (v, buf), None

        (v, buf), _ = esb.scan(
            body,
            (jnp.ones(16, jnp.float32), buf0),
            jnp.arange(4095),
            buffers=lambda c: c[1],
            check=True,
        )
        return (buf**2).sum() + v.sum()

    args = (jnp.float32(0.3), jax.ShapeDtypeStruct((4096, 16), jnp.float32))
    for f in (loss, jax.grad(loss)):
        assert esb.find_loop_copies(f, *args) == []


def _reads_in_cond_loss(scan, w, buf0):
    """Step i writes row i, then reads inside `cond` row i (written earlier in this
    step), row i - 1 (an earlier step) and the last row (never written)."""

    def body(carry, i):
        v, buf = carry
        last = buf.shape[0] - 1
        buf = buf.at[i].set(jnp.sin(w * v))
        v = lax.cond(
            i % 2 == 0,
            lambda: buf[i] + buf[jnp.maximum(i - 1, 0)] * buf[last],
            lambda: 2.0 * buf[i] - buf[last],
        )
        return (v, buf), v.sum()

    (v, buf), ys = scan(body, (jnp.ones(3), buf0), jnp.arange(5))
    return (buf**2).sum() + ys.sum() + v.sum()


@functools.cache
def _reads_in_cond_grad(scan):
    loss = lambda w, b: _reads_in_cond_loss(scan, w, b)
    buf0 = jnp.asarray(np.random.default_rng(1).normal(size=(6, 3)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(0.4, buf0)


@pytest.mark.parametrize("kind", ["lax", "checkpointed"])
def test_checked_mode_allows_reads_inside_cond_of_written_or_never_written_rows(kind):
    ours = lambda f, c, x: esb.scan(
        f, c, x, kind=kind, checkpoints=2, buffers=lambda c: c[1], check=True
    )
    _close(_reads_in_cond_grad(ours), _reads_in_cond_grad(lax.scan))


@pytest.mark.parametrize("kind", ["lax", "checkpointed"])
def test_body_sees_the_same_buffer_object_under_both_kinds(kind):
    seen = []

    def body(buf, x):
        seen.append(type(buf))
        return buf.at[0].set(x), None

    esb.scan(body, jnp.zeros(3), jnp.ones(1), kind=kind, buffers=lambda b: b)
    assert seen == [esb.WriteOnceBuffer]


def test_body_is_traced_once_with_buffers():
    traces = []

    def loss(w):
        def body(buf, x):
            traces.append(None)
            return buf.at[x].set(w), None

        buf, _ = esb.scan(body, jnp.zeros(4), jnp.arange(4), buffers=lambda b: b)
        return buf.sum()

    jax.grad(loss)(1.0)
    assert len(traces) == 1


def test_pred_writes_only_where_true():
    def body(buf, x):
        i, p = x
        return buf.at[i].set(1.0, pred=p), None

    xs = (jnp.arange(4), jnp.array([True, False, True, False]))
    for kind in ("lax", "checkpointed"):
        buf, _ = esb.scan(body, jnp.zeros(4), xs, kind=kind, buffers=lambda b: b)
        np.testing.assert_array_equal(np.asarray(buf), [1.0, 0.0, 1.0, 0.0])


def test_dynamic_slice_and_dynamic_update_slice_work_on_the_buffer():
    def loss(w):
        def body(carry, i):
            buf, acc = carry
            buf = esb.dynamic_update_slice(
                buf, jnp.sin(w * i) * jnp.ones((1, 2)), (i, 0)
            )
            window = esb.dynamic_slice(buf, (i, 0), (1, 2))
            return (buf, acc + window.sum()), None

        (buf, acc), _ = esb.scan(
            body, (jnp.zeros((5, 2)), 0.0), jnp.arange(5), buffers=lambda c: c[0]
        )
        return acc + (buf**2).sum()

    def ref(w):
        def body(carry, i):
            buf, acc = carry
            buf = lax.dynamic_update_slice(
                buf, jnp.sin(w * i) * jnp.ones((1, 2)), (i, 0)
            )
            return (buf, acc + lax.dynamic_slice(buf, (i, 0), (1, 2)).sum()), None

        (buf, acc), _ = lax.scan(body, (jnp.zeros((5, 2)), 0.0), jnp.arange(5))
        return acc + (buf**2).sum()

    _close(jax.value_and_grad(loss)(0.4), jax.value_and_grad(ref)(0.4))


def test_length_zero_with_buffers():
    buf, ys = esb.scan(
        lambda b, x: (b.at[0].set(x), x),
        jnp.ones(3),
        jnp.zeros((0,)),
        buffers=lambda b: b,
    )
    np.testing.assert_array_equal(np.asarray(buf), 1.0)
    assert ys.shape == (0,)


def test_forward_mode_with_buffers():
    args = _args()
    f = lambda scan: jax.jvp(lambda w: _loss(scan)(w, *args[1:]), (args[0],), (1.0,))
    _close(f(ESB["ckpt-3"]), f(lax.scan))


def test_vmap_of_grad_and_grad_of_vmap_with_buffers():
    _, buf0, xs = _args()
    ws = jnp.array([0.1, 0.5, 0.9])

    def vg(s, ws, buf0, xs):
        return jax.vmap(lambda w: jax.grad(_loss(s))(w, buf0, xs))(ws)

    def gv(s, ws, buf0, xs):
        return jax.grad(lambda ws: jax.vmap(lambda w: _loss(s)(w, buf0, xs))(ws).sum())(
            ws
        )

    for t in (vg, gv):
        run = jax.jit(t, static_argnums=0)
        _close(run(ESB["ckpt-3"], ws, buf0, xs), run(lax.scan, ws, buf0, xs))


def test_nested_scan_writes_into_an_outer_buffer():
    # The diffrax pattern: an inner loop steps a state; the outer loop saves it.
    def loss(scan, w):
        def outer(carry, t):
            y, saved = carry
            y, _ = scan(
                lambda y, _: (y + 0.1 * jnp.sin(w * y + t), None), y, jnp.zeros(4)
            )
            return (y, saved.at[t].set(y)), None

        (_, saved), _ = scan(outer, (jnp.ones(2), jnp.zeros((6, 2))), jnp.arange(6))
        return (saved**2).sum()

    ours = lambda f, c, x: esb.scan(
        f,
        c,
        x,
        checkpoints=2,
        buffers=(lambda c: c[1]) if isinstance(c, tuple) else None,
    )
    grad = lambda scan: jax.jit(jax.value_and_grad(lambda w: loss(scan, w)))(0.3)
    _close(grad(ours), grad(lax.scan))


def test_buffers_must_name_arrays():
    with pytest.raises(ValueError, match="at least one dimension"):
        esb.scan(
            lambda c, x: (c, x),
            (jnp.float64(0.0),),
            jnp.ones(2),
            buffers=lambda c: c[0],
        )


def test_index_must_be_integer_scalars():
    def body(buf, x):
        return buf.at[1:2].set(x), None

    with pytest.raises(TypeError, match="indexed by integer scalars"):
        esb.scan(body, jnp.zeros(4), jnp.ones(2), buffers=lambda b: b)


def test_buffers_are_not_stored_at_checkpoints():
    def temp(checkpoints, declare):
        def loss(w, buf0):
            def body(carry, i):
                v, buf = carry
                v = jnp.sin(w * v)
                return (v, buf.at[i].set(v)), None

            (v, buf), _ = esb.scan(
                body,
                (jnp.ones(64, jnp.float32), buf0),
                jnp.arange(4096),
                checkpoints=checkpoints,
                buffers=(lambda c: c[1]) if declare else None,
            )
            return (buf**2).sum() + v.sum()

        buf0 = jnp.zeros((4096, 64), jnp.float32)
        compiled = jax.jit(jax.grad(loss)).lower(jnp.float32(1.0), buf0).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    buffer_bytes, carry_bytes = 4096 * 64 * 4, 64 * 4
    declared = temp(64, True) - temp(8, True)
    # 56 more checkpoints store 56 more small carries, and no buffer.
    assert declared < buffer_bytes
    assert 56 * carry_bytes <= declared <= 60 * carry_bytes + 4096
    # Undeclared, the buffer is stored at every checkpoint.
    assert temp(64, False) - temp(8, False) >= 56 * buffer_bytes


def test_write_once_buffer_is_an_equinox_module():
    assert issubclass(esb.WriteOnceBuffer, eqx.Module)


def test_reverse_pass_reads_cost_a_window_not_the_buffer():
    # Equinox transposes a buffer read into zeros of the buffer's size, a window
    # update and a full-size add, on every backward step (O(buffer) per step,
    # quadratic in the length); compiled,
    # it copies the buffer every step. Here the compiled reverse pass accumulates the
    # window's cotangent in place: no buffer-sized work in the loop.
    def loss(scan):
        def f(w, buf0):
            def body(carry, i):
                c, buf = carry
                c = jnp.sin(w * c) + 0.1 * buf[jnp.maximum(i - 1, 0)]
                return (c, buf.at[i].set(c)), None

            (c, buf), _ = scan(body, (jnp.ones(8), buf0), jnp.arange(63))
            return (buf**2).sum() + c.sum()

        return f

    ours = lambda f, c, x: esb.scan(f, c, x, checkpoints="all", buffers=lambda c: c[1])
    theirs = lambda f, c, x: eqxi.scan(
        f, c, x, kind="checkpointed", checkpoints="all", buffers=lambda c: c[1]
    )
    args = (1.0, jnp.zeros((64, 8)))
    shape = {"float32": "f32", "float64": "f64"}[str(args[1].dtype)] + "[64,8]"
    assert loop_buffer_work(jax.grad(loss(ours)), args, shape) == []
    assert loop_buffer_work(jax.grad(loss(theirs)), args, shape)


# A schedule that reruns steps, and one that stores every step (the schedules
# themselves, and more checkpoint counts against lax.scan: tests/test_scan.py).
@pytest.mark.parametrize("checkpoints", [3, "all"])
def test_an_mlp_body_without_buffers_matches_equinox(checkpoints):
    mlp = eqx.nn.MLP(3, 3, 8, 2, key=jax.random.key(0))

    def loss(scan, mlp, c0, xs):
        def body(c, x):
            return c + 0.1 * mlp(c * x), jnp.tanh(c).sum()

        c, ys = scan(body, c0, xs)
        return (c**2).sum() + ys.sum()

    ours = lambda f, c, x: esb.scan(f, c, x, checkpoints=checkpoints)
    theirs = lambda f, c, x: eqxi.scan(
        f, c, x, kind="checkpointed", checkpoints=checkpoints
    )
    args = (mlp, jnp.ones(3), jnp.linspace(0.0, 1.0, 10)[:, None] * jnp.ones(3))
    grad = lambda s: eqx.filter_jit(
        eqx.filter_value_and_grad(lambda m, c, x: loss(s, m, c, x))
    )(*args)
    _close(grad(ours), grad(theirs))


def test_vmap_with_each_batch_element_writing_its_own_rows():
    def loss(w, buf0, rows):
        def body(buf, r):
            return buf.at[r].set(jnp.sin(w * r) * jnp.ones(2)), None

        buf, _ = esb.scan(body, buf0, rows, checkpoints=2, buffers=lambda b: b)
        return (buf**2).sum()

    def ref(w, buf0, rows):
        def body(buf, r):
            return buf.at[r].set(jnp.sin(w * r) * jnp.ones(2)), None

        return (lax.scan(body, buf0, rows)[0] ** 2).sum()

    rows = jnp.array([[0, 2, 4], [5, 3, 1]])
    buf0 = jnp.ones((2, 6, 2))
    batched = lambda f: jax.jit(
        jax.vmap(jax.value_and_grad(f, argnums=(0, 1)), in_axes=(None, 0, 0))
    )(0.3, buf0, rows)
    _close(batched(loss), batched(ref))
    grad = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, 0, 0)))
    assert esb.find_loop_copies(grad, 0.3, jnp.ones((2, 4096, 2)), rows) == []


N_OUTER, N_INNER = 4, 3


def _inner_writes_loss(scan, w, y0):
    """diffrax's pattern: an inner loop steps the state and writes every inner step
    into a buffer owned by the outer loop."""

    def outer(carry, k):
        y, saved = carry

        def inner(c, j):
            y, saved = c
            y = y + 0.1 * jnp.sin(w * y + k)
            return (y, saved.at[k * N_INNER + j].set(y)), None

        (y, saved), _ = scan(inner, (y, saved), jnp.arange(N_INNER))
        return (y, saved), y.sum()

    (y, saved), ys = scan(
        outer, (y0, jnp.zeros((N_OUTER * N_INNER, 2))), jnp.arange(N_OUTER)
    )
    return (saved**2).sum() + ys.sum() + y.sum()


@functools.cache
def _inner_writes_grad(scan):
    loss = lambda w, y: _inner_writes_loss(scan, w, y)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(0.3, jnp.ones(2))


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("checkpoints", [2, "all"])
def test_inner_scan_writes_into_the_outer_buffer(checkpoints, check):
    ours = lambda f, c, x: esb.scan(
        f, c, x, checkpoints=checkpoints, buffers=lambda c: c[1], check=check
    )
    _close(_inner_writes_grad(ours), _inner_writes_grad(lax.scan))


def test_a_shift_buffer_is_not_a_write_once_buffer():
    with pytest.raises(TypeError, match="leave it out of `buffers`"):
        esb.scan(
            lambda b, x: (b, x),
            esb.ShiftBuffer.zeros((3, 4)),
            jnp.ones(2),
            buffers=lambda b: b,
        )

"""`esb.scan`: `lax.scan` semantics, the binomial schedule, every transformation."""

from __future__ import annotations

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_shiftbuf as esb
from eqx_shiftbuf._schedule import binomial_steps, recomputed_steps, schedule

from .tape import loop_buffer_work, loop_instructions, taped_leaves, unstored_leaves


RTOL = 1e-10


# ---------------------------------------------------------------------------
# The schedule, without JAX.


@functools.cache
def _dp_reverse(n: int, free: int) -> int:
    """Fewest steps to reverse `n` steps, the first state in a slot, `free` more
    slots, no free sweep: the dynamic programme that defines the optimum."""
    if n == 1:
        return 0
    if free == 0:
        return n * (n - 1) // 2
    return min(
        m + _dp_reverse(n - m, free - 1) + _dp_reverse(m, free) for m in range(1, n)
    )


@functools.cache
def _dp_backward(n: int, free: int) -> int:
    """The same after a forward sweep that may store any state for free."""
    if n == 1:
        return 0
    if free == 0:
        return n * (n - 1) // 2
    return min(
        _dp_backward(n - m, free - 1) + _dp_reverse(m, free) for m in range(1, n)
    )


@pytest.mark.parametrize("slots", [1, 2, 3, 4, 6])
def test_binomial_formula_is_the_optimum(slots):
    for n in range(1, 40):
        assert binomial_steps(n, slots) == _dp_reverse(n, slots - 1)
        assert recomputed_steps(n, slots) == _dp_backward(n, slots - 1)


def _simulate(sched) -> list[int]:
    """Run a schedule on states named by their step number; return the states each
    reversal saw, asserting every load reads a slot holding a state."""
    slots: dict[int, int] = {}
    for k, s in enumerate(sched.primal_slot):
        if s >= 0:
            slots[int(s)] = k
    seen = []
    for j in range(sched.length):
        state = slots[int(sched.restore[j])]
        for g in range(sched.begin[j], sched.end[j]):
            assert sched.advance_step[g] == state
            state += 1
            if sched.advance_slot[g] >= 0:
                slots[int(sched.advance_slot[g])] = state
        assert sched.reverse[j] == state
        seen.append(state)
    return seen


@pytest.mark.parametrize(
    "length,checkpoints",
    [
        (1, 1),
        (2, 1),
        (7, 1),
        (7, 2),
        (20, 3),
        (50, 4),
        (100, 14),
        (300, 5),
        (64, 64),
        (9, 20),
    ],
)
def test_schedule_reverses_every_step_in_order_with_the_optimal_count(
    length, checkpoints
):
    sched = schedule(length, checkpoints)
    assert _simulate(sched) == list(range(length - 1, -1, -1))
    assert sched.recomputed == recomputed_steps(length, min(checkpoints, length))
    assert int((sched.primal_slot >= 0).sum()) <= checkpoints


# Equinox's recorded backward orders (tests/test_while_loop.py,
# `test_backward_checkpointed`; cases from Stumm & Walther, Fig. 2.2) as
# (checkpoints, steps, order). Where Stumm-Walther is optimal (steps <=
# (c+1)(c+2)/2) our offline schedule reruns as many steps; ties between optimal
# schedules are broken differently in some cases, so the counts are compared.
EQUINOX_ORDERS = [
    (9, 5, "4,3,2,1,0"),
    (2, 5, "3,4,3,0,1,2,1,0"),
    (4, 4, "3,2,1,0"),
    (4, 5, "3,4,3,2,1,0"),
    (4, 6, "5,2,3,4,3,2,1,0"),
    (4, 7, "6,5,2,3,4,3,2,0,1,0"),
    (4, 8, "7,6,5,0,1,2,3,4,3,2,1,0"),
    (4, 9, "7,8,7,6,5,0,1,2,3,4,3,2,1,0"),
    (4, 10, "9,6,7,8,7,6,5,0,1,2,3,4,3,2,1,0"),
    (4, 11, "10,9,5,6,7,8,7,6,5,0,1,2,3,4,3,2,1,0"),
    (4, 12, "10,11,10,9,5,6,7,8,7,6,5,0,1,2,3,4,3,2,1,0"),
    (4, 13, "12,9,10,11,10,9,5,6,7,8,7,6,5,0,1,2,3,4,3,2,1,0"),
    (4, 14, "12,13,12,9,10,11,10,9,5,6,7,8,7,6,5,0,1,2,3,4,3,2,1,0"),
]


@pytest.mark.parametrize("checkpoints,steps,order", EQUINOX_ORDERS)
def test_recomputations_match_equinox_where_it_is_optimal(checkpoints, steps, order):
    sched = schedule(steps, checkpoints)
    equinox_recomputed = len(order.split(",")) - steps
    assert sched.recomputed == equinox_recomputed
    assert len(sched.backward_order()) == len(order.split(","))


def test_equinox_beyond_its_optimal_range_reruns_more():
    # (3, 11): Equinox switches to Wang-Moin and reruns 11 steps; 10 is optimal.
    order = "10,4,5,6,7,8,9,7,8,7,4,5,6,5,4,0,1,2,3,2,1,0"
    assert (
        schedule(11, 3).recomputed == _dp_backward(11, 2) < len(order.split(",")) - 11
    )


# ---------------------------------------------------------------------------
# Semantics: the same results as lax.scan.


def _problem(length, seed=0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=(3, 3)) * 0.5)
    init = {"v": jnp.asarray(rng.normal(size=3)), "n": jnp.int32(0)}
    xs = (
        jnp.asarray(rng.normal(size=(length, 3))),
        jnp.arange(length, dtype=jnp.int32),
    )

    def body(w, carry, x):
        xv, xi = x
        v = jnp.tanh(w @ carry["v"] + xv) * (1 + 0.01 * xi)
        return {"v": v, "n": carry["n"] + xi}, (v.sum() * xv[0], carry["n"])

    def loss(w, init, xs, scan):
        carry, (ya, yb) = scan(functools.partial(body, w), init, xs)
        return (carry["v"] ** 2).sum() + jnp.sin(ya).sum() + 0.1 * carry["n"] + yb.sum()

    return loss, w, init, xs


SCANS = {
    "lax": lambda f, c, x: esb.scan(f, c, x, kind="lax"),
    "ckpt-1": lambda f, c, x: esb.scan(f, c, x, checkpoints=1),
    "ckpt-3": lambda f, c, x: esb.scan(f, c, x, checkpoints=3),
    "ckpt-default": lambda f, c, x: esb.scan(f, c, x),
    "ckpt-all": lambda f, c, x: esb.scan(f, c, x, checkpoints="all"),
    "ckpt-reverse-unroll": lambda f, c, x: esb.scan(
        f, c, x, checkpoints=3, reverse=True, unroll=2
    ),
}


def _lax_reverse(f, c, x):
    return lax.scan(f, c, x, reverse=True)


def _reference(name):
    return _lax_reverse if name == "ckpt-reverse-unroll" else lax.scan


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=1e-12)


# Each program is jitted, and each lax.scan reference computed once (cached by
# the scan function) for the tests and cases that share it.


@functools.cache
def _value_and_grad(scan, length):
    """The loss and its gradient (the float leaves) of `_problem(length)`."""
    loss, w, init, xs = _problem(length)
    grad = jax.value_and_grad(
        lambda w, init, xs: loss(w, init, xs, scan), argnums=(0, 1, 2), allow_int=True
    )
    value, (gw, ginit, gxs) = jax.jit(grad)(w, init, xs)
    return value, gw, ginit["v"], gxs[0]


@pytest.mark.parametrize("name", SCANS)
@pytest.mark.parametrize("length", [1, 2, 13])
def test_values_and_gradients_equal_lax_scan(name, length):
    _close(
        _value_and_grad(SCANS[name], length),
        _value_and_grad(_reference(name), length),
    )


@functools.cache
def _jvp(scan):
    loss, w, init, xs = _problem(9)
    f = lambda w, tw, init, xs: jax.jvp(lambda w: loss(w, init, xs, scan), (w,), (tw,))
    return jax.jit(f)(w, jnp.ones_like(w), init, xs)


@pytest.mark.parametrize("name", SCANS)
def test_jvp_equals_lax_scan(name):
    _close(_jvp(SCANS[name]), _jvp(_reference(name)))


@pytest.mark.parametrize(
    "name", ["ckpt-3", pytest.param("ckpt-reverse-unroll", marks=pytest.mark.full)]
)
def test_vmap_of_grad_and_grad_of_vmap_and_jacrev(name):
    loss, w, init, xs = _problem(8)
    ref = _reference(name)
    ws = jnp.stack([w, 2 * w, -w])

    def vg(s, ws, init, xs):
        return jax.vmap(lambda w: jax.grad(loss)(w, init, xs, s))(ws)

    def gv(s, ws, init, xs):
        return jax.grad(lambda ws: jax.vmap(lambda w: loss(w, init, xs, s))(ws).sum())(
            ws
        )

    def final(w, s, init, xs):
        carry, ys = s(lambda c, x: (jnp.tanh(w @ c + x[0]), c), init["v"], xs)
        return carry, ys

    def jr(s, w, init, xs):
        return jax.jacrev(final)(w, s, init, xs)

    for transform, a in ((vg, ws), (gv, ws), (jr, w)):
        run = jax.jit(transform, static_argnums=0)
        _close(run(SCANS[name], a, init, xs), run(ref, a, init, xs))


def test_vmap_over_xs_only_and_over_the_carry_only():
    loss, w, init, xs = _problem(6)
    xss = (jnp.stack([xs[0], 2 * xs[0]]), xs[1])
    inits = {"v": jnp.stack([init["v"], -init["v"]]), "n": init["n"]}
    for in_axes, args in [
        ((None, None, (0, None)), (w, init, xss)),
        ((None, {"v": 0, "n": None}, None), (w, inits, xs)),
    ]:
        run = jax.jit(
            lambda s, *a, in_axes=in_axes: jax.vmap(
                jax.grad(lambda *a: loss(*a, s)), in_axes
            )(*a),
            static_argnums=0,
        )
        _close(run(SCANS["ckpt-3"], *args), run(lax.scan, *args))


def test_length_zero_and_xs_none():
    body = lambda c, x: (c + x, 2 * c)
    carry, ys = esb.scan(body, jnp.float64(1.0), jnp.zeros((0,)))
    assert float(carry) == 1.0 and ys.shape == (0,)
    carry, ys = esb.scan(lambda c, _: (c + 1.0, c), jnp.float64(0.0), None, length=4)
    _close(
        (carry, ys),
        lax.scan(lambda c, _: (c + 1.0, c), jnp.float64(0.0), None, length=4),
    )
    g = jax.grad(lambda c: esb.scan(body, c, jnp.zeros((0,)))[0])(2.0)
    assert float(g) == 1.0


def test_body_is_traced_once():
    traces = []

    def body(c, x):
        traces.append(None)
        return jnp.sin(c * x), c

    xs = jnp.linspace(0, 1, 10)
    for transform in (
        lambda: esb.scan(body, 1.0, xs),
        lambda: jax.grad(lambda c: esb.scan(body, c, xs)[0])(1.0),
        lambda: jax.jvp(lambda c: esb.scan(body, c, xs)[0], (1.0,), (1.0,)),
        lambda: jax.vmap(jax.grad(lambda c: esb.scan(body, c, xs)[0]))(jnp.ones(3)),
    ):
        traces.clear()
        transform()
        assert len(traces) == 1


@pytest.mark.parametrize(
    "length,checkpoints", [(20, 3), (50, 5), (40, None), (10, "all")]
)
def test_backward_reruns_exactly_the_scheduled_steps(length, checkpoints):
    calls = []

    def loss(w, c0, xs):
        def body(c, x):
            jax.debug.callback(lambda: calls.append(None))
            return jnp.tanh(w * c + x), c.sum()

        c, ys = esb.scan(body, c0, xs, checkpoints=checkpoints)
        return c.sum() + ys.sum()

    grad = jax.jit(jax.grad(loss))
    calls.clear()
    jax.block_until_ready(grad(0.5, jnp.ones(4), jnp.linspace(0, 1, length)))
    jax.effects_barrier()
    slots = {None: esb._scan._default_checkpoints(length), "all": length}.get(
        checkpoints, checkpoints
    )
    # The forward pass, the reruns, and one evaluation per reversed step.
    assert len(calls) == 2 * length + recomputed_steps(length, slots)


def test_nested_scans():
    def loss(w, xs):
        def outer(c, x):
            inner, _ = esb.scan(
                lambda d, z: (jnp.sin(w * d + z), None), c, x, checkpoints=2
            )
            return inner, inner.sum()

        c, ys = esb.scan(outer, jnp.ones(2), xs, checkpoints=3)
        return c.sum() + ys.sum()

    def ref(w, xs):
        def outer(c, x):
            inner, _ = lax.scan(lambda d, z: (jnp.sin(w * d + z), None), c, x)
            return inner, inner.sum()

        c, ys = lax.scan(outer, jnp.ones(2), xs)
        return c.sum() + ys.sum()

    xs = jnp.asarray(np.random.default_rng(3).normal(size=(7, 5, 2)))
    _close(
        jax.value_and_grad(loss, argnums=(0, 1))(0.7, xs),
        jax.value_and_grad(ref, argnums=(0, 1))(0.7, xs),
    )


# ---------------------------------------------------------------------------
# A ShiftBuffer carry.


def _buffer_loss(scan, read: bool):
    def loss(p, init, xs, rows, cols):
        def body(buf, inp):
            x, r, c = inp
            buf = buf.insert((r, c), jnp.sin(p * x))
            if read:
                buf, out = buf.pop((r, (c + 3) % buf.capacity))
                return buf, jnp.cos(out)
            return buf.delete((r, (c + 3) % buf.capacity)), x

        buf, ys = scan(body, esb.ShiftBuffer.from_array(init), (xs, rows, cols))
        return (buf.array**2).sum() + (ys**3).sum()

    return loss


def _buffer_args(length=40, shape=(6, 9)):
    rng = np.random.default_rng(5)
    return (
        0.8,
        jnp.asarray(rng.normal(size=shape)),
        jnp.asarray(rng.normal(size=length)),
        jnp.asarray(rng.integers(0, shape[0], length), jnp.int32),
        jnp.asarray(rng.integers(0, shape[1], length), jnp.int32),
    )


@functools.cache
def _buffer_value_and_grad(scan, read):
    loss = jax.value_and_grad(_buffer_loss(scan, read), argnums=(0, 1, 2))
    return jax.jit(loss)(*_buffer_args())


@pytest.mark.parametrize("read", [False, True])
@pytest.mark.parametrize("name", ["lax", "ckpt-3", "ckpt-default", "ckpt-all"])
def test_shift_buffer_carry_gradients_equal_plain_autodiff(name, read):
    _close(
        _buffer_value_and_grad(SCANS[name], read),
        _buffer_value_and_grad(lax.scan, read),
    )


@functools.cache
def _buffer_grad(name, read):
    """The jitted gradient of a 41-step scan over a (64, 32) ShiftBuffer: one
    object, so that the tests that compile it share the compile."""
    return jax.jit(jax.grad(_buffer_loss(SCANS[name], read), argnums=(0, 1)))


@pytest.mark.parametrize("read", [False, True])
@pytest.mark.parametrize("name", ["ckpt-3", "ckpt-default", "ckpt-all"])
def test_shift_buffer_carry_has_no_copies_in_the_gradient(name, read):
    args = _buffer_args(length=41, shape=(64, 32))
    assert esb.find_loop_copies(_buffer_grad(name, read), *args) == []


@pytest.mark.parametrize("name", ["ckpt-default", "ckpt-all"])
def test_a_buffer_the_reverse_pass_does_not_read_is_not_stored(name):
    # Insert then delete: the reverse pass needs none of the stored buffers, so XLA
    # drops their store. Each stored leaf has its own conditional write: in one
    # conditional with the deferred-error record (which is read back), the dead
    # buffer store stayed alive (with checkpoints="all", every step stored it).
    length, shape = 41, (64, 32)
    args = _buffer_args(length=length, shape=shape)
    hlo = _buffer_grad(name, False).lower(*args).compile().as_text()
    assert re.search(rf"f64\[\d+,{shape[0]},{shape[1]}\]", hlo) is None


def _two_buffer_loss(scan):
    """Two ShiftBuffers and a float carry: `a` only edited and read (window,
    pop), its reads used nonlinearly; `b` also summed whole (a use other than an
    edit); an int32 buffer `n` of counts, edited and read."""

    def loss(p, a0, b0, xs, rows, cols):
        def body(carry, inp):
            a, b, n, h = carry
            x, r, c = inp
            a, w = a.read((r, 0), (1, 3))
            a = a.insert((r, c), jnp.sin(p * x + w.sum()))
            a, out = a.pop((r, (c + 3) % a.capacity))
            b = b.dynamic_update_slice(jnp.tanh(h * out)[None, None], (r, 0))
            n = n.insert((0, c), r)
            n, k = n.pop((0, (c + 1) % n.capacity))
            h = jnp.cos(h + out * b.array.sum() * 1e-3 + k)
            return (a, b, n, h), out**2

        n0 = esb.ShiftBuffer.from_array(jnp.zeros((1, 128), jnp.int32))
        init = (esb.ShiftBuffer.from_array(a0), esb.ShiftBuffer.from_array(b0), n0, p)
        (a, b, _, h), ys = scan(body, init, (xs, rows, cols))
        return (a.array**2).sum() + (b.array**3).sum() + ys.sum() + h

    return loss


def _two_buffer_args(length, shape):
    p, a0, xs, rows, cols = _buffer_args(length=length, shape=shape)
    b0 = jnp.asarray(np.random.default_rng(8).normal(size=(shape[0], 2)))
    return p, a0, b0, xs, rows, cols


# The flat carry leaves of the storage of `a`, `b` and `n` (a `ShiftBuffer` has 4).
A, B, N = 0, 4, 8


def _assert_taped_as_documented(scan, args):
    taped = taped_leaves(jax.grad(_two_buffer_loss(scan)), *args)
    assert A in taped and N in taped and B not in taped, taped


@pytest.mark.parametrize(
    "name",
    ["ckpt-1", "ckpt-3", pytest.param("ckpt-reverse-unroll", marks=pytest.mark.full)],
)
def test_a_buffer_carry_only_edited_is_replayed_exactly(name):
    # `a` and `n` are not stored at checkpoints: rerun steps replay what their
    # accesses returned in the forward pass (`_tape`). `b` is stored.
    args = _two_buffer_args(23, (8, 20))
    _assert_taped_as_documented(SCANS[name], args)
    grad = lambda scan: jax.jit(
        jax.value_and_grad(_two_buffer_loss(scan), argnums=(0, 1, 2, 3))
    )(*args)
    _close(grad(SCANS[name]), grad(_reference(name)))


@pytest.mark.heavy
@pytest.mark.parametrize(
    "order", ["fwd-over-rev", pytest.param("rev-over-fwd", marks=pytest.mark.full)]
)
def test_a_buffer_carry_only_edited_has_exact_second_derivatives(order):
    # Forward over reverse reruns steps with the tape's tangents (and a stand-in
    # storage); reverse over forward differentiates the tape's values.
    args = _two_buffer_args(11, (4, 6))
    _assert_taped_as_documented(SCANS["ckpt-3"], args)
    p, a0, b0, xs, rows, cols = args

    def second(scan):
        loss = lambda p, a0: _two_buffer_loss(scan)(p, a0, b0, xs, rows, cols)
        if order == "fwd-over-rev":
            g = jax.grad(loss, argnums=(0, 1))
            return jax.jvp(g, (p, a0), (0.3, a0))
        jvp = lambda p, a0: jax.jvp(loss, (p, a0), (0.3, a0))[1]
        return jax.grad(jvp, argnums=(0, 1))(p, a0)

    _close(jax.jit(second, static_argnums=0)(SCANS["ckpt-3"]), second(lax.scan))


def _edits(p, buf, x, r, c):
    buf = buf.insert((r, c), jnp.sin(p * x))
    return buf.pop((r, (c + 3) % buf.capacity))


def _sliced_then_edits(p, buf, x, r, c):
    y = jnp.sin(buf.array[:2, :3]).sum()  # read before the edits, used nonlinearly
    buf, out = _edits(p, buf, x, r, c)
    return buf, out + y


def _edits_then_sliced(p, buf, x, r, c):
    buf, out = _edits(p, buf, x, r, c)
    return buf, out * buf.array[r, :4].sum()  # a dynamic slice after them


# The step's edits as written, inside `jax.jit`, inside `eqx.filter_jit`, beside
# parts of `buf.array` (the tape holds the parts, not the buffer); and, the
# control, with a use of the whole buffer besides (it is then stored).
STEP_EDITS = {
    "edits": _edits,
    "jit": jax.jit(_edits),
    "filter_jit": eqx.filter_jit(_edits),
    "array sliced first": _sliced_then_edits,
    "array sliced after": _edits_then_sliced,
    "also summed whole": lambda *a: (lambda b, o: (b, o + b.array.sum()))(*_edits(*a)),
}
# The quick run leaves out `filter_jit`, the same step as `jit` through Equinox.
STEP_EDIT_CASES = [
    pytest.param(k, marks=pytest.mark.full) if k == "filter_jit" else k
    for k in STEP_EDITS
]


def _edit_loss(scan, edits: str):
    def loss(p, init, xs, rows, cols):
        def body(buf, inp):
            buf, out = STEP_EDITS[edits](p, buf, *inp)
            return buf, jnp.cos(out)

        buf, ys = scan(body, esb.ShiftBuffer.from_array(init), (xs, rows, cols))
        return (buf.array**2).sum() + ys.sum()

    return loss


@pytest.mark.parametrize("edits", STEP_EDIT_CASES)
def test_edits_however_called_have_lax_scan_gradients(edits):
    args = _buffer_args(length=19, shape=(4, 6))
    grad = lambda scan: jax.jit(
        jax.value_and_grad(_edit_loss(scan, edits), argnums=(0, 1, 2))
    )(*args)
    _close(grad(SCANS["ckpt-3"]), grad(lax.scan))


def _delay_line_loss(scan):
    """A delay line (a ring) pushed at its front, its oldest rows read as
    `buf.array[::-1][:4]` (the storage rotated by the head, reversed, then
    sliced) and used nonlinearly."""

    def loss(p, init, xs):
        def body(buf, x):
            buf = buf.insert(0, jnp.sin(p * x + jnp.arange(init.shape[1])))
            return buf, jnp.cos(buf.array[::-1][:4] * jnp.arange(1, 5)[:, None]).sum()

        buf, ys = scan(body, esb.ShiftBuffer.from_array(init, axis=0), xs)
        return ys.sum() + (buf.array**2).sum()

    return loss


def test_a_ring_whose_array_is_sliced_is_replayed_not_stored():
    # The tape holds the 4 rows read, not the rotated buffer (which, 23 steps of
    # it larger than 3 stored copies, would not be taped: the ring stored).
    rng = np.random.default_rng(5)
    args = (
        0.7,
        jnp.asarray(rng.normal(size=(64, 8))),
        jnp.asarray(rng.normal(size=23)),
    )
    loss = _delay_line_loss(SCANS["ckpt-3"])
    assert 0 in taped_leaves(jax.grad(loss, argnums=(0, 1)), *args)
    grad = lambda scan: jax.jit(
        jax.value_and_grad(_delay_line_loss(scan), argnums=(0, 1, 2))
    )(*args)
    _close(grad(SCANS["ckpt-3"]), grad(lax.scan))


# Steps that only read their carry: a plain array returned as it is, a
# `ShiftBuffer` read whole (`read` returns the buffer unchanged).
READ_ONLY = {
    "array": (lambda c: c, lambda c: (c, c)),
    "read()": (esb.ShiftBuffer.from_array, lambda b: b.read()),
}


def _read_only_loss(scan, how: str):
    wrap, read = READ_ONLY[how]

    def loss(p, init, xs):
        def body(c, x):
            c, w = read(c)
            return c, jnp.cos(w * x).sum() * p

        _, ys = scan(body, wrap(init), xs)
        return ys.sum()

    return loss


@pytest.mark.parametrize("how", READ_ONLY)
def test_a_carry_the_step_only_reads_is_not_stored_nor_copied(how):
    # Stored at checkpoints, the rerun steps wrote it back into the stack it was
    # loaded from, and XLA copied the whole stack twice a reversed step.
    rng = np.random.default_rng(6)
    args = (
        0.7,
        jnp.asarray(rng.normal(size=(16, 64))),
        jnp.asarray(rng.normal(size=23)),
    )
    grad = lambda scan: jax.grad(_read_only_loss(scan, how), argnums=(0, 1))
    assert esb.find_loop_copies(grad(SCANS["ckpt-3"]), *args, min_bytes=16 * 64) == []
    _close(jax.jit(grad(SCANS["ckpt-3"]))(*args), jax.jit(grad(lax.scan))(*args))


@pytest.mark.parametrize("how", READ_ONLY)
def test_a_carry_the_step_only_reads_is_not_broadcast_to_the_batch(how):
    # `jax.vmap` over the other operands: the carry stays one array, as under
    # `lax.scan` (it was broadcast to the batch: a batch's worth of memory).
    loss = _read_only_loss(SCANS["ckpt-3"], how)
    init = jnp.ones((16, 64))
    jaxpr = jax.make_jaxpr(jax.vmap(loss, in_axes=(0, None, None)))(
        jnp.ones(5), init, jnp.ones(23)
    )
    scans = [e for e in jaxpr.eqns if e.primitive.name == "esb_scan"]
    assert len(scans) == 1
    shapes = [v.aval.shape for v in scans[0].invars]
    assert (16, 64) in shapes and (5, 16, 64) not in shapes, shapes


@pytest.mark.parametrize("how", READ_ONLY)
def test_a_carry_the_step_only_reads_is_not_copied_under_vmap_of_grad(how):
    # Broadcast to the batch (of the other carry, `h`), its final value fed the
    # loop that reruns steps from a checkpoint, and XLA copied it on every trip
    # (`lax.scan`: none).
    wrap, read = READ_ONLY[how]

    def loss(scan):
        def f(p, init, h0, xs, rows):
            def body(c, x):
                a, h = c
                a, w = read(a)
                h = jnp.tanh(h * x[0] + w[x[1], :8])
                return (a, h), jnp.cos(w * x[0]).sum()

            (_, h), ys = scan(body, (wrap(init * p), h0), (xs, rows))
            return ys.sum() + h.sum()

        return jax.vmap(
            jax.grad(f, argnums=(0, 1)), in_axes=(None, None, 0, None, None)
        )

    rng = np.random.default_rng(7)
    args = (
        0.9,
        jnp.asarray(rng.normal(size=(32, 128))),
        jnp.asarray(rng.normal(size=(3, 8))),
        jnp.asarray(rng.normal(size=31)),
        jnp.asarray(rng.integers(0, 32, 31), jnp.int32),
    )
    fn = loss(SCANS["ckpt-3"])
    assert esb.find_loop_copies(fn, *args, min_bytes=32 * 128 * 8) == []
    _close(jax.jit(fn)(*args), jax.jit(loss(lax.scan))(*args))


def test_a_carry_stored_at_one_checkpoint_is_not_copied_by_the_reruns():
    # With one checkpoint every reversed step reruns the steps from the first,
    # and never stores what they compute: the stack was still carried through
    # the rerun loop (a `cond` that could write it, while the carry read from
    # it was live), and XLA copied it twice a reversed step.
    def loss(scan):
        def f(a0, xs, rows, cols):
            def body(c, x):
                buf, acc = c
                v, r, q = x
                buf = buf.insert((r, q), v)
                acc = acc + buf.array[r, :8]
                return (buf, acc), acc.sum()

            init = (esb.ShiftBuffer.from_array(a0), jnp.zeros(8, a0.dtype))
            (buf, _), ys = scan(body, init, (xs, rows, cols))
            return (buf.array**2).sum() + ys.sum()

        return jax.grad(f)

    rng = np.random.default_rng(8)
    args = (
        jnp.asarray(rng.normal(size=(6, 10))),
        jnp.asarray(rng.normal(size=9)),
        jnp.asarray(rng.integers(0, 6, 9), jnp.int32),
        jnp.asarray(rng.integers(0, 10, 9), jnp.int32),
    )
    fn = loss(SCANS["ckpt-1"])
    assert 0 not in unstored_leaves(fn, *args)  # the buffer is stored
    assert esb.find_loop_copies(fn, *args, min_bytes=6 * 10 * 8) == []
    _close(jax.jit(fn)(*args), jax.jit(loss(lax.scan))(*args))


def _edit_temp_bytes(checkpoints: int, edits: str) -> int:
    scan = lambda f, c, x: esb.scan(f, c, x, checkpoints=checkpoints)
    args = _buffer_args(length=256, shape=(64, 256))
    compiled = jax.jit(jax.grad(_edit_loss(scan, edits))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("edits", STEP_EDIT_CASES)
def test_a_buffer_carry_only_edited_costs_no_buffer_sized_work_per_step(edits):
    # Recorded, the buffer is neither stored nor reloaded: the compiled loops
    # touch it only by in-place updates of a window or line (here, its cotangent).
    scan = lambda f, c, x: esb.scan(f, c, x, checkpoints=8)
    grad = jax.grad(_edit_loss(scan, edits))
    work = loop_buffer_work(
        grad, _buffer_args(length=64, shape=(64, 256)), "f64[64,256]"
    )
    if edits == "also summed whole":  # the control: stored, and reloaded
        assert work
    else:
        assert work == [], work


@pytest.mark.parametrize("edits", STEP_EDIT_CASES)
def test_a_buffer_carry_only_edited_is_not_stored_at_checkpoints(edits):
    buffer_bytes = 64 * 256 * 8
    more = _edit_temp_bytes(32, edits) - _edit_temp_bytes(8, edits)
    if edits == "also summed whole":  # the control: stored at every checkpoint
        assert more >= 24 * buffer_bytes
    else:  # 24 more checkpoints: 24 more small carries (a few scalars), no buffer
        assert more < buffer_bytes // 4


# ---------------------------------------------------------------------------
# Memory.


def _temp_bytes(length, checkpoints, size=4096):
    def loss(w, c0):
        c, _ = esb.scan(
            lambda c, _: (jnp.sin(w * c) + 0.1, None),
            c0,
            None,
            length=length,
            checkpoints=checkpoints,
        )
        return c.sum()

    compiled = jax.jit(jax.grad(loss)).lower(1.0, jnp.ones(size, jnp.float32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_temp_memory_grows_with_checkpoints_not_length():
    carry = 4096 * 4
    few, many = _temp_bytes(4096, 8), _temp_bytes(4096, 64)
    # 56 more stored carries cost 56 carries (and no more than a few beyond).
    assert 56 * carry <= many - few <= 60 * carry
    assert _temp_bytes(1024, 8) == few
    # What lax.scan stores instead: a carry per step.
    assert few < 32 * carry < 4096 * carry


# ---------------------------------------------------------------------------
# Errors.


def test_bad_arguments_raise_clear_errors():
    body = lambda c, x: (c + x, c)
    with pytest.raises(ValueError, match="`kind` must be 'lax' or 'checkpointed'"):
        esb.scan(body, 0.0, jnp.zeros(3), kind="bounded")  # pyright: ignore
    with pytest.raises(
        ValueError, match="`checkpoints` must be None, 'all' or an int >= 1"
    ):
        esb.scan(body, 0.0, jnp.zeros(3), checkpoints=0)
    with pytest.raises(ValueError, match="must agree"):
        esb.scan(body, 0.0, jnp.zeros(3), length=4)
    with pytest.raises(TypeError, match="shapes and dtypes of `init`"):
        esb.scan(lambda c, x: (jnp.stack([c, c]), c), jnp.float64(0.0), jnp.zeros(3))
    with pytest.raises(ValueError, match="give `length`"):
        esb.scan(body, 0.0, None)


@pytest.mark.parametrize(
    "outer,inner",
    [(jax.jacfwd, jax.grad), (jax.jacfwd, jax.jacfwd), (jax.jacrev, jax.jacfwd)],
    ids=["fwd-over-rev", "fwd-over-fwd", "rev-over-fwd"],
)
def test_second_derivatives_equal_lax_scan(outer, inner):
    # Reverse over reverse is not supported: the reverse pass is a `while` loop.
    def loss(w, scan):
        c, ys = scan(
            lambda c, x: (jnp.tanh(w * c + x), c**2), jnp.ones(3), jnp.linspace(0, 1, 9)
        )
        return (c**2).sum() + ys.sum()

    run = jax.jit(outer(inner(loss)), static_argnums=1)
    _close(run(0.3, SCANS["ckpt-3"]), run(0.3, lax.scan))


def test_python_scalar_init_takes_the_body_dtype_as_in_lax_scan():
    body = lambda c, x: (c + x, 2 * c)
    xs = jnp.ones(3, jnp.float32)
    got, want = esb.scan(body, 0.0, xs), lax.scan(body, 0.0, xs)
    assert [a.dtype for a in jax.tree.leaves(got)] == [
        a.dtype for a in jax.tree.leaves(want)
    ]
    _close(got, want)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("length", [0, 5])
def test_kind_lax_is_lax_scan(reverse, length):
    body = lambda c, x: ({"a": c["a"] * 0.9 + x[0], "n": c["n"] + 1}, (x[1], c["a"]))
    init = {"a": jnp.float64(1.0), "n": jnp.int32(0)}
    xs = (jnp.arange(length, dtype=jnp.float64), jnp.arange(length, dtype=jnp.int32))
    got = esb.scan(body, init, xs, kind="lax", reverse=reverse, unroll=2)
    want = lax.scan(body, init, xs, reverse=reverse, unroll=2)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    _close(got, want)
    got = esb.scan(body, init, xs, reverse=reverse, unroll=2)
    _close(got, want)


@pytest.mark.parametrize(
    "first", [True, False], ids=["sum_then_insert", "insert_then_sum"]
)
def test_a_step_output_that_nothing_uses_is_not_computed_under_grad(first):
    """Under `grad`, the forward pass's per-step outputs (the loss's terms) are
    dropped (`_scan._scan_dce`), and a step rerun in the reverse pass computes only
    the carries it stores (`_scan._carries_body`): the user's sum of the whole
    buffer is taken only where its cotangent is (the transposed `reduce_sum`).

    Summed before an insert, the sum was kept by the insert, which waits for the
    user's reads before it: it was taken in the forward pass and in every rerun
    step (gradient 6.0x the forward, against 3.9x summed after the insert)."""

    def loss(s, a, xs, scan=esb.scan):
        def step(b, x):
            insert = lambda b: b.insert((x, 0), jnp.sin(s * x.astype(jnp.float32)))
            b = b if first else insert(b)
            b, w = b.read()
            y = (w * jnp.cos(s * jnp.arange(64.0))).sum()
            return (insert(b) if first else b), y

        kw = {"checkpoints": 3} if scan is esb.scan else {}
        b, ys = scan(step, esb.ShiftBuffer.from_array(a, axis=1), xs, **kw)
        return ys.sum() + (b.array**2).sum()

    args = (jnp.float32(0.5), jnp.zeros((16, 64)), jnp.arange(12, dtype=jnp.int32) % 16)
    grad = jax.grad(loss, argnums=(0, 1))
    sums = [
        m.group(1)
        for line in loop_instructions(grad, *args)
        if " reduce(" in line and (m := re.search(r'op_name="([^"]*)"', line))
    ]
    user = [s for s in sums if s.endswith("/reduce_sum")]
    assert user, sums  # (the transposed sum, the cotangent of `s`)
    assert [s for s in user if not s.endswith("transpose(jvp())/reduce_sum")] == []
    want = jax.grad(functools.partial(loss, scan=lax.scan), argnums=(0, 1))(*args)
    for g, w in zip(jax.jit(grad)(*args), want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-5)

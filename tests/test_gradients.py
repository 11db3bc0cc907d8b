"""Derivatives of every operation equal plain autodiff of the equivalent `jnp` program."""

from __future__ import annotations

import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from jax import lax
from jax.test_util import check_grads

import eqx_shiftbuf as esb

from . import reference as ref
from .tape import unstored_leaves
from .tiers import examples


LAYOUTS = [((7,), 0), ((3, 6), 1), ((4, 5), 0), ((2, 5, 3), 1)]
RTOL = 1e-10


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape))


def _ops_for(shape, axis):
    """Pairs (library op, jnp op) of (buffer, value-or-None) -> output pytree."""
    idx = tuple(min(1, shape[d] - 1) for d in range(axis)) + (shape[axis] // 2,)
    starts = tuple(1 if n > 2 else 0 for n in shape)
    sizes = tuple(min(2, n - s) for n, s in zip(shape, starts))
    vshape = shape[axis + 1 :]
    return {
        "insert": (
            vshape,
            lambda x, v: esb.insert(x, idx, v, axis=axis),
            lambda x, v: ref.jnp_insert(x, idx, v, axis),
        ),
        "delete": (
            None,
            lambda x, v: esb.delete(x, idx, axis=axis),
            lambda x, v: ref.jnp_pop(x, idx, axis)[0],
        ),
        "pop": (
            None,
            lambda x, v: esb.pop(x, idx, axis=axis),
            lambda x, v: ref.jnp_pop(x, idx, axis),
        ),
        "dynamic_slice": (
            None,
            lambda x, v: esb.dynamic_slice(x, starts, sizes),
            lambda x, v: ref.jnp_dynamic_slice(x, starts, sizes),
        ),
        "dynamic_update_slice": (
            sizes,
            lambda x, v: esb.dynamic_update_slice(x, v, starts),
            lambda x, v: ref.jnp_dynamic_update_slice(x, v, starts),
        ),
    }


OPS = ["insert", "delete", "pop", "dynamic_slice", "dynamic_update_slice"]


def _args(shape, vshape):
    x = _rand(shape, 0)
    v = _rand(vshape, 1) if vshape is not None else jnp.zeros(())
    return x, v


@pytest.mark.parametrize("shape,axis", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
def test_vjp_matches_plain_autodiff(op, shape, axis):
    vshape, f, g = _ops_for(shape, axis)[op]
    x, v = _args(shape, vshape)
    out, vjp = jax.vjp(f, x, v)
    out_ref, vjp_ref = jax.vjp(g, x, v)
    ct = jax.tree.map(lambda o: _rand(o.shape, 2), out_ref)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(out_ref)):
        np.testing.assert_allclose(a, b, rtol=RTOL)
    for a, b in zip(vjp(ct), vjp_ref(ct)):
        np.testing.assert_allclose(a, b, rtol=RTOL)


@pytest.mark.parametrize("shape,axis", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
def test_jvp_matches_plain_autodiff(op, shape, axis):
    vshape, f, g = _ops_for(shape, axis)[op]
    x, v = _args(shape, vshape)
    tx, tv = _rand(x.shape, 3), _rand(v.shape, 4)
    out, tout = jax.jvp(f, (x, v), (tx, tv))
    out_ref, tout_ref = jax.jvp(g, (x, v), (tx, tv))
    for a, b in zip(jax.tree.leaves((out, tout)), jax.tree.leaves((out_ref, tout_ref))):
        np.testing.assert_allclose(a, b, rtol=RTOL)


@pytest.mark.parametrize("op", OPS)
def test_grad_under_jit_matches_plain_autodiff(op):
    vshape, f, g = _ops_for((3, 6), 1)[op]
    x, v = _args((3, 6), vshape)
    w = jax.tree.map(lambda o: _rand(o.shape, 5), jax.eval_shape(g, x, v))

    def loss(fn):
        return lambda x, v: sum(
            (jnp.sin(o) * c).sum()
            for o, c in zip(jax.tree.leaves(fn(x, v)), jax.tree.leaves(w))
        )

    a = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, v)
    b = jax.grad(loss(g), argnums=(0, 1))(x, v)
    for p, q in zip(a, b):
        np.testing.assert_allclose(p, q, rtol=RTOL)


# Lines, and one line (a ring; the 1-D buffer is one too).
@pytest.mark.parametrize("shape,axis", LAYOUTS[1:3])
@pytest.mark.parametrize("op", OPS)
def test_check_grads_order_2(op, shape, axis):
    vshape, f, _ = _ops_for(shape, axis)[op]
    x, v = _args(shape, vshape)
    # A nonlinearity after the op, so that second derivatives are not all zero.
    h = lambda x, v: jax.tree.map(lambda o: jnp.sin(o) * o, f(x * x, v))
    check_grads(h, (x, v), order=2, modes=("fwd", "rev"))


def test_shiftbuffer_grad_wrt_initial_contents_and_values():
    def f(arr, v):
        buf = esb.ShiftBuffer.from_array(arr)
        buf = buf.insert((0, 1), v).insert((0, 0), 2 * v)
        buf, r = buf.pop((0, 3))
        return (buf.array**2).sum() + r * v

    def g(arr, v):
        arr = ref.jnp_insert(arr, (0, 1), v, 1)
        arr = ref.jnp_insert(arr, (0, 0), 2 * v, 1)
        arr, r = ref.jnp_pop(arr, (0, 3), 1)
        return (arr**2).sum() + r * v

    x, v = _rand((2, 5), 0), jnp.float64(0.7)
    for a, b in zip(jax.grad(f, (0, 1))(x, v), jax.grad(g, (0, 1))(x, v)):
        np.testing.assert_allclose(a, b, rtol=RTOL)


def test_grad_and_jvp_take_a_shiftbuffer_argument_like_an_array():
    # The buffer's deferred-error record is a leaf of its pytree; it must not stop
    # jax.grad / jax.jvp from taking the buffer itself, and its derivative is 0.
    def f(buf, v):
        buf = buf.insert((0, 1), v).delete((1, 2))
        return (buf.array**2).sum()

    def g(arr, v):
        arr = ref.jnp_insert(arr, (0, 1), v, 1)
        arr = ref.jnp_pop(arr, (1, 2), 1)[0]
        return (arr**2).sum()

    x, v = _rand((2, 5), 0), jnp.float64(0.7)
    buf = esb.ShiftBuffer.from_array(x)
    gbuf, gv = jax.grad(f, (0, 1))(buf, v)
    want_x, want_v = jax.grad(g, (0, 1))(x, v)
    np.testing.assert_allclose(gbuf.array, want_x, rtol=RTOL)
    np.testing.assert_allclose(gv, want_v, rtol=RTOL)
    assert float(gbuf._error) == 0.0

    tangent = esb.ShiftBuffer.from_array(_rand((2, 5), 1))
    _, got = jax.jvp(f, (buf, v), (tangent, jnp.float64(1.0)))
    _, want = jax.jvp(g, (x, v), (tangent.array, jnp.float64(1.0)))
    np.testing.assert_allclose(got, want, rtol=RTOL)


# Buffers whose head two pushes at the front moved where they are rings (one
# line), and a buffer of two lines (stored as it is) as the control; the last, a
# batch of two rings.
_MOVED = [
    ((7,), 0, ()),
    # Rings along a longer first axis and along axis 1, as `(7,)` is.
    pytest.param((6, 3), 0, (), marks=pytest.mark.full),
    pytest.param((1, 9), 1, (), marks=pytest.mark.full),
    ((2, 5), 1, ()),
    ((7,), 0, (2,)),
]


def _moved_buffer(shape, axis, batch):
    """`(buffer, loss)`: a buffer made from random contents with two values pushed
    at the front, and a loss of its contents through `lax.scan` of pops."""
    x = _rand(batch + shape, 0)
    front = (0,) * (axis + 1)
    vshape = shape[axis + 1 :]

    def make(x):
        b = esb.ShiftBuffer(x, axis=axis)
        for k in range(2):
            b = b.insert(front, jnp.full(vshape, 10.0 + k))
        return b

    make_all = make
    for _ in batch:
        make_all = jax.vmap(make_all)
    weights = jnp.cos(jnp.arange(np.prod(batch + shape))).reshape(batch + shape)

    def loss(buf):
        def step(b, c):
            b, y = b.pop((0,) * axis + (c,))
            return b, y.sum()

        pops = jnp.array([1, shape[axis] - 2], jnp.int32)
        pop_all = lambda b: lax.scan(step, b, pops)
        for _ in batch:
            pop_all = jax.vmap(pop_all)
        b, ys = pop_all(buf)
        return (weights * jnp.sin(b.array)).sum() + ys.sum()

    return make_all(x), loss


@pytest.mark.parametrize("shape, axis, batch", _MOVED)
def test_gradient_array_is_the_gradient_with_respect_to_the_contents(
    shape, axis, batch
):
    # The gradient with respect to a buffer is laid out as its storage, which for
    # a ring whose head moved is rotated: its own `.array` is not the gradient
    # with respect to the contents (with the head 0, the gradient's).
    buf, loss = _moved_buffer(shape, axis, batch)
    grad = jax.grad(loss)(buf)
    as_contents = lambda x: loss(_like(buf, x, axis, batch))
    want = jax.grad(as_contents)(buf.array)
    np.testing.assert_allclose(buf.gradient_array(grad), want, rtol=RTOL)


@pytest.mark.parametrize("shape, axis, batch", _MOVED)
def test_tangent_of_is_a_tangent_of_the_contents(shape, axis, batch):
    buf, loss = _moved_buffer(shape, axis, batch)
    t = _rand(buf.shape, 1)
    _, got = jax.jvp(loss, (buf,), (buf.tangent_of(t),))
    as_contents = lambda x: loss(_like(buf, x, axis, batch))
    _, want = jax.jvp(as_contents, (buf.array,), (t,))
    np.testing.assert_allclose(got, want, rtol=RTOL)
    np.testing.assert_allclose(buf.gradient_array(buf.tangent_of(t)), t, rtol=RTOL)


def _like(buf, x, axis, batch):
    """A buffer (a batch, as `buf`) holding the contents `x`, its head not moved."""
    make = lambda x: esb.ShiftBuffer(x, axis=axis)
    for _ in batch:
        make = jax.vmap(make)
    return make(x)


# -- through lax.scan of random edit sequences (overlapping, out-of-order indices)

STEPS = 10
SHAPE, AXIS = (3, 6), 1
KINDS = ["insert", "delete", "pop", "slice", "update"]


def _make_step(kinds, lib):
    ins = (
        (lambda x, i, v: esb.insert(x, i, v))
        if lib
        else (lambda x, i, v: ref.jnp_insert(x, i, v, AXIS))
    )
    pop = (
        (lambda x, i: esb.pop(x, i)) if lib else (lambda x, i: ref.jnp_pop(x, i, AXIS))
    )
    ds = esb.dynamic_slice if lib else ref.jnp_dynamic_slice
    dus = esb.dynamic_update_slice if lib else ref.jnp_dynamic_update_slice

    def step(carry, inp):
        x, acc = carry
        idx, val, p = inp
        outs = []
        for k, kind in enumerate(kinds):
            i = (idx[k, 0], idx[k, 1])
            if kind == "insert":
                x = ins(x, i, jnp.sin(p * val[k]))
            elif kind == "delete":
                x = pop(x, i)[0]
            elif kind == "pop":
                x, r = pop(x, i)
                acc = acc + r * val[k]
            elif kind == "slice":
                w = ds(x, (idx[k, 0], idx[k, 1] // 2), (1, 3))
                outs.append(jnp.tanh(w).sum())
            else:
                w = ds(x, (idx[k, 0], jnp.int32(0)), (1, 2))
                x = dus(
                    x, w * p + val[k], (idx[(k + 1) % len(kinds), 0], idx[k, 1] // 2)
                )
        return (x, acc), jnp.stack(outs) if outs else jnp.zeros(0)

    return step


def _loss(kinds, lib, scan=lax.scan):
    step = _make_step(kinds, lib)

    def loss(x0, p, idx, vals):
        x = esb.ShiftBuffer.from_array(x0) if lib else x0
        ps = jnp.broadcast_to(p, (STEPS,))
        (x, acc), ys = scan(step, (x, jnp.zeros((), x0.dtype)), (idx, vals, ps))
        arr = x.array if lib else x
        return (
            (jnp.cos(arr) * jnp.arange(arr.size).reshape(arr.shape)).sum()
            + acc
            + (ys**2).sum()
        )

    return loss


_COMPILED: dict = {}


def _compiled(kinds):
    if kinds not in _COMPILED:
        _COMPILED[kinds] = (
            jax.jit(jax.value_and_grad(_loss(kinds, True), argnums=(0, 1))),
            ref.jit_reference(jax.value_and_grad(_loss(kinds, False), argnums=(0, 1))),
        )
    return _COMPILED[kinds]


def _random_indices(rng, n_edits):
    """(STEPS, n_edits, 2) int32 (row, column) pairs, overlapping and out of order."""
    rows = rng.integers(0, SHAPE[0], (STEPS, n_edits))
    cols = rng.integers(0, SHAPE[1], (STEPS, n_edits))
    return jnp.asarray(np.stack([rows, cols], -1), jnp.int32)


# Each example with new `kinds` compiles two programs: 8 keep the suite short
# (new draws on every run; a local `--hypothesis-profile` run can try more).
# The fixed cases below (jvp, finite differences) cover every kind.
@settings(max_examples=examples(8))
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3).map(tuple),
    seed=st.integers(0, 2**31 - 1),
)
# Two reads that drop their buffer: JAX sums three cotangents of it, and folding
# the sum of two reads' accumulations as if it were one gave a wrong gradient.
@pytest.mark.heavy
@example(kinds=("insert", "slice", "slice"), seed=0)
def test_scan_of_random_edits_grad_matches_plain_autodiff(kinds, seed):
    lib, plain = _compiled(kinds)
    args = _random_case(kinds, seed)
    _assert_same_value_and_grad(lib(*args), plain(*args))


def _random_case(kinds, seed):
    """`(x0, p, idx, vals)` for `_loss(kinds, ...)`, drawn from `seed`."""
    rng = np.random.default_rng(seed)
    idx = _random_indices(rng, len(kinds))
    vals = jnp.asarray(rng.normal(size=(STEPS, len(kinds))))
    x0 = jnp.asarray(rng.normal(size=SHAPE))
    return x0, jnp.float64(rng.normal()), idx, vals


def _assert_same_value_and_grad(ours, theirs):
    (l1, g1), (l2, g2) = ours, theirs
    np.testing.assert_allclose(l1, l2, rtol=1e-10)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def _checkpointed(f, init, xs):
    # Half the steps: the buffer is small, and with fewer checkpoints storing it
    # takes less memory than recording its reads, so `esb.scan` would store it.
    return esb.scan(f, init, xs, checkpoints=STEPS // 2)


@pytest.mark.heavy
@settings(max_examples=examples(4))
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3).map(tuple),
    seed=st.integers(0, 2**31 - 1),
)
@example(kinds=("insert", "slice", "slice"), seed=0)  # as above; found here first
@example(kinds=("slice",), seed=0)  # the buffer only read
def test_checkpointed_esb_scan_of_random_edits_grad_matches_plain_autodiff(kinds, seed):
    # The buffer is not stored at checkpoints: rerun steps replay what its
    # accesses returned (`eqx_shiftbuf/_tape.py`), for any sequence of edits; a
    # step of reads alone (`("slice",)`) returns it unchanged, and rerun steps
    # read its final value.
    args = _random_case(kinds, seed)
    lib = jax.value_and_grad(_loss(kinds, True, _checkpointed), argnums=(0, 1))
    assert 0 in unstored_leaves(lib, *args)  # the buffer's storage
    _assert_same_value_and_grad(jax.jit(lib)(*args), _compiled(kinds)[1](*args))


@pytest.mark.parametrize("kinds", [("insert", "pop"), ("slice", "update", "delete")])
def test_scan_of_edits_jvp_matches_plain_autodiff(kinds):
    rng = np.random.default_rng(0)
    idx = _random_indices(rng, len(kinds))
    vals = jnp.asarray(rng.normal(size=(STEPS, len(kinds))))
    x0, t0 = jnp.asarray(rng.normal(size=SHAPE)), jnp.asarray(rng.normal(size=SHAPE))
    p = jnp.float64(0.3)
    f = jax.jit(lambda x, p: _loss(kinds, True)(x, p, idx, vals))
    g = lambda x, p: _loss(kinds, False)(x, p, idx, vals)
    a = jax.jvp(f, (x0, p), (t0, jnp.float64(1.0)))
    b = jax.jvp(g, (x0, p), (t0, jnp.float64(1.0)))
    np.testing.assert_allclose(a, b, rtol=1e-10)


@pytest.mark.heavy
def test_scan_grad_matches_finite_differences():
    kinds = ("insert", "slice", "pop")
    rng = np.random.default_rng(1)
    idx = _random_indices(rng, 3)
    vals = jnp.asarray(rng.normal(size=(STEPS, 3)))
    # Jitted: `check_grads` evaluates `f` and its derivatives many times.
    f = jax.jit(lambda x, p: _loss(kinds, True)(x, p, idx, vals))
    check_grads(
        f,
        (jnp.asarray(rng.normal(size=SHAPE)), jnp.float64(0.4)),
        order=2,
        modes=("fwd", "rev"),
    )


@pytest.mark.parametrize("mode", [None, "promise_in_bounds"])
def test_a_scans_gradient_saves_only_the_indices_of_an_insert(mode):
    # The cotangent accesses are ordered by the cotangent buffer's own reads, not by
    # the primal access's token: a saved token would be one more per-step residual
    # (one more kernel per step in the forward pass of the gradient).
    steps = 5
    r, c = jnp.arange(steps) % 3, jnp.arange(steps) % 4
    v = jnp.arange(steps, dtype=jnp.float32)
    kwargs = {} if mode is None else {"mode": mode}

    def loss(buf, p):
        def step(b, x):
            return esb.insert(b, (x[0], x[1]), jnp.sin(p * x[2]), **kwargs), None

        return lax.scan(step, esb.ShiftBuffer(buf, axis=1), (r, c, v))[0]

    _, vjp = jax.vjp(loss, jnp.zeros((3, 6), jnp.float32), jnp.float32(0.5))
    saved = [
        x
        for x in jax.tree.leaves(vjp)
        if x.shape[:1] == (steps,) and jnp.issubdtype(x.dtype, jnp.integer)
    ]
    assert len(saved) == 2  # the row and the column


@pytest.mark.parametrize("kind", ["ShiftBuffer", "promised array"])
def test_a_scans_gradient_saves_no_integers_when_the_indices_are_scan_inputs(kind):
    # JAX's scan forwards a residual that is a scan input instead of saving it every
    # step; the library must not turn the indices into a new value (a saved token,
    # or the indices packed together), or each step pays one more kernel. (A check
    # made at once, on a plain array, threads the indices through its conditional.)
    steps = 8
    # int32: an index of another dtype is cast, which makes it a new value.
    r = jnp.arange(steps, dtype=jnp.int32) % 3
    c = jnp.arange(steps, dtype=jnp.int32) % 4
    v = jnp.arange(steps, dtype=jnp.float32)
    kw = {} if kind == "ShiftBuffer" else {"mode": "promise_in_bounds"}

    def step(b, x, p):
        b = esb.insert(b, (x[0], x[1]), jnp.sin(p * x[2]), **kw)
        return esb.delete(b, x[:2], **kw), None

    def loss(buf, p):
        b0 = esb.ShiftBuffer.from_array(buf, axis=1) if kind == "ShiftBuffer" else buf
        b, _ = lax.scan(lambda b, x: step(b, x, p), b0, (r, c, v))
        return ((b.array if kind == "ShiftBuffer" else b) ** 2).sum()

    args = (jnp.zeros((3, 6), jnp.float32), jnp.float32(0.5))
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
    saved = re.findall(rf"%\S*dynamic-update-slice\S* = s32\[{steps}[,\]]", hlo)
    assert saved == []


def _narrow_ring_losses(op: str, p: int, n: int):
    """`(library loss, plain jnp loss)` of `(x, v)`: a shift at the Python-int
    position `p` of a 1-D buffer (a ring), read whole and weighted."""
    w = jnp.cos(jnp.arange(n, dtype=jnp.float32))

    def lib(x, v):
        b, r = esb.ShiftBuffer.from_array(x), jnp.float32(0)
        if op == "insert":
            b = b.insert(p, v.astype(x.dtype))
        elif op == "pop":
            b, r = b.pop(p)
            r = 5 * r.astype(jnp.float32)
        else:
            b = b.delete(p)
        return (w * b.array.astype(jnp.float32)).sum() + r

    def plain(x, v):
        v = v.astype(x.dtype).astype(jnp.float32)  # rounded as the library's is
        x, r = x.astype(jnp.float32), jnp.float32(0)
        if op == "insert":
            y = jnp.concatenate([x[:p], v[None], x[p:-1]])
        else:
            y = jnp.concatenate([x[:p], x[p + 1 :], jnp.zeros(1)])
            r = 5 * x[p] if op == "pop" else r
        return (w * y).sum() + r

    return lib, plain


@pytest.mark.parametrize("p", [1, 10], ids=["beside-front", "beside-back"])
@pytest.mark.parametrize("op", ["insert", "pop", "delete"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_a_narrow_ring_shift_beside_an_end_has_plain_autodiff_derivatives(dtype, op, p):
    # Beside an end, a ring's shift moves a window whose parts were joined as
    # bits (integers, a constant to autodiff): every element moved, and the
    # inserted value, had a zero gradient in bfloat16 and float8.
    lib, plain = _narrow_ring_losses(op, p, 12)
    x, v = jnp.arange(12, dtype=jnp.float32).astype(dtype), jnp.float32(1.0)
    for got, want in zip(jax.grad(lib, (0, 1))(x, v), jax.grad(plain, (0, 1))(x, v)):
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2
        )
    t = jnp.ones(12, dtype)
    got = jax.jvp(lambda x: lib(x, v), (x,), (t,))[1]
    want = jax.jvp(lambda x: plain(x, v), (x,), (t,))[1]
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)

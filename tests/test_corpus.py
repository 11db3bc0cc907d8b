"""The in-place corpus (`tests/corpus.py`): every body, under forward, grad, jvp and
vmap(grad), has no per-iteration copy of a buffer-sized array, and gives the values
and gradients of the same body written with plain `lax` ops."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_shiftbuf as esb
from eqx_shiftbuf._inspect import loop_copies_in_hlo

from . import corpus


ROWS, COLS, STEPS, BATCH = 64, 512, 8, 3
NAMES = [b.name for b in corpus.BODIES]


def _inputs(body, dtype=jnp.float32):
    return corpus.make_inputs(body, ROWS, COLS, STEPS, dtype=dtype)


def _args(body, mode, dtype=jnp.float32):
    p, init, xs = _inputs(body, dtype)
    if mode == "vmap(grad)":
        xs = corpus.batch_xs(xs, BATCH)
    return p, init, xs


def _min_bytes(init):
    # Half of one buffer: a copy of any single buffer (or of a batch of them) counts.
    return init.size * init.dtype.itemsize // 2


def _assert_no_copies(ops, name, mode):
    body = corpus.BODIES_BY_NAME[name]
    fn = corpus.program(mode, corpus.make_loss(body, ops))
    args = _args(body, mode)
    copies = esb.find_loop_copies(fn, *args, min_bytes=_min_bytes(args[1]))
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize("mode", corpus.MODES)
@pytest.mark.parametrize("name", NAMES)
def test_no_per_iteration_copies(name, mode):
    _assert_no_copies(corpus.ESB, name, mode)


@pytest.mark.parametrize("mode", ["forward", "grad"])
@pytest.mark.parametrize("name", NAMES)
def test_no_per_iteration_copies_without_index_checks(name, mode):
    # The run-time index checks are conditionals, which XLA does not fuse across:
    # without them (`mode="promise_in_bounds"`) more fusion is possible, and three
    # inserts in one step once copied that way.
    _assert_no_copies(corpus.ESB_PROMISE, name, mode)


@functools.cache
def _plain_autodiff(name, mode):
    """The body written with plain `lax` ops, under `mode`, in float64: the values
    and derivatives the library must give (shared by the tests below)."""
    body = corpus.BODIES_BY_NAME[name]
    args = _args(body, mode, jnp.float64)
    out = jax.jit(corpus.program(mode, corpus.make_loss(body, corpus.PLAIN)))(*args)
    return [np.asarray(x) for x in jax.tree.leaves(out)]


@pytest.mark.parametrize("mode", corpus.MODES)
@pytest.mark.parametrize("name", NAMES)
def test_matches_plain_autodiff(name, mode):
    body = corpus.BODIES_BY_NAME[name]
    args = _args(body, mode, jnp.float64)
    ours = jax.jit(corpus.program(mode, corpus.make_loss(body, corpus.ESB)))(*args)
    leaves, ref = jax.tree.leaves(ours), _plain_autodiff(name, mode)
    assert len(leaves) == len(ref)
    for a, b in zip(leaves, ref):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["grad", "jvp", "vmap(grad)"])
@pytest.mark.parametrize("name", NAMES)
def test_under_checkpointed_esb_scan(name, mode):
    # The ShiftBuffer carry is stored at 3 checkpoints and steps are rerun from them:
    # same values and gradients as plain autodiff of lax.scan, no per-iteration copy.
    body = corpus.BODIES_BY_NAME[name]
    scan = lambda f, c, x: esb.scan(f, c, x, checkpoints=3)
    ours = corpus.make_loss(body, corpus.ESB, scan=scan)
    args = _args(body, mode, jnp.float64)
    # One compile for both checks: the values, and the copies in its loops.
    compiled = jax.jit(corpus.program(mode, ours)).lower(*args).compile()
    got = compiled(*args)
    want = _plain_autodiff(name, mode)
    for a, b in zip(jax.tree.leaves(got), want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    copies = loop_copies_in_hlo(compiled.as_text(), _min_bytes(args[1]))
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize("name", NAMES)
def test_promise_in_bounds_gives_the_same_values(name):
    body = corpus.BODIES_BY_NAME[name]
    args = _args(body, "grad", jnp.float64)
    checked = jax.jit(jax.grad(corpus.make_loss(body, corpus.ESB)))(*args)
    promised = jax.jit(jax.grad(corpus.make_loss(body, corpus.ESB_PROMISE)))(*args)
    for a, b in zip(jax.tree.leaves(checked), jax.tree.leaves(promised)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["insert", "pop", "two_inserts", "mixed"])
def test_plain_lax_control_copies_under_grad(name):
    # The control: the same body written with plain lax ops copies the buffer on
    # every iteration of the compiled gradient, so the zero counts above are a
    # property of the library and these tests can fail.
    body = corpus.BODIES_BY_NAME[name]
    fn = corpus.program("grad", corpus.make_loss(body, corpus.PLAIN))
    args = _args(body, "grad")
    assert len(esb.find_loop_copies(fn, *args, min_bytes=_min_bytes(args[1]))) >= 1

"""The in-place corpus (`tests/corpus.py`): every body, under forward, grad, jvp and
vmap(grad), has no per-iteration copy of a buffer-sized array, and gives the values
and gradients of the same body written with plain `lax` ops."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_shiftbuf as esb

from . import corpus, reference


# On one xdist worker (`--dist loadgroup`): the tests share compiled programs
# (the caches below), which another worker would compile again.
pytestmark = pytest.mark.xdist_group("corpus")


ROWS, COLS, STEPS, BATCH = 64, 512, 8, 3
NAMES = [b.name for b in corpus.BODIES]


@pytest.fixture(scope="module", params=NAMES)
def name(request):
    """The corpus body. Module-scoped, so that pytest runs each body's tests
    together, and the programs they share are compiled once (the caches below,
    emptied when the next body starts)."""
    yield request.param
    _program.cache_clear()
    _outputs.cache_clear()


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


def _checkpointed(f, c, x):
    # The ShiftBuffer carry is stored at 3 checkpoints and steps are rerun from them.
    return esb.scan(f, c, x, checkpoints=3)


@functools.cache
def _program(name, mode, ops, dtype, scan=lax.scan):
    """`(jitted program, its arguments)`: `name`'s loss under `mode`, written with
    `ops`, its buffer of `dtype`. One jitted object, so that the tests that compile
    it (for its values, its copies) share one compile."""
    body = corpus.BODIES_BY_NAME[name]
    program = corpus.program(mode, corpus.make_loss(body, ops, scan=scan))
    jit = reference.jit_reference if ops is corpus.PLAIN else jax.jit
    return jit(program), _args(body, mode, dtype)


@functools.cache
def _outputs(name, mode, ops, dtype, scan=lax.scan):
    """The program's outputs, as NumPy arrays."""
    fn, args = _program(name, mode, ops, dtype, scan)
    return [np.asarray(x) for x in jax.tree.leaves(fn(*args))]


def _copies(name, mode, ops, dtype=jnp.float32, scan=lax.scan):
    fn, args = _program(name, mode, ops, dtype, scan)
    return esb.find_loop_copies(fn, *args, min_bytes=_min_bytes(args[1]))


def _plain_autodiff(name, mode):
    """The body written with plain `lax` ops, under `mode`, in float64: the values
    and derivatives the library must give (shared by the tests below)."""
    return _outputs(name, mode, corpus.PLAIN, jnp.float64)


def _assert_close(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", corpus.MODES)
def test_no_per_iteration_copies(name, mode):
    copies = _copies(name, mode, corpus.ESB)
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize("mode", ["forward", "grad"])
def test_no_per_iteration_copies_without_index_checks(name, mode):
    # The run-time index checks are conditionals, which XLA does not fuse across:
    # without them (`mode="promise_in_bounds"`) more fusion is possible, and three
    # inserts in one step once copied that way.
    copies = _copies(name, mode, corpus.ESB_PROMISE)
    assert copies == [], "\n".join(map(str, copies))


# (Not "forward": `jvp` returns the loss too.)
@pytest.mark.parametrize("mode", [m for m in corpus.MODES if m != "forward"])
def test_matches_plain_autodiff(name, mode):
    ours = _outputs(name, mode, corpus.ESB, jnp.float64)
    _assert_close(ours, _plain_autodiff(name, mode))


# (`jvp` through a checkpointed `esb.scan` is its forward pass with tangents:
# `tests/test_scan.py::test_jvp_equals_lax_scan`, and the natural patterns'
# `esb_scan` and `stack_scan*` rows in every mode.)
@pytest.mark.parametrize("mode", ["grad", "vmap(grad)"])
def test_under_checkpointed_esb_scan(name, mode):
    # The ShiftBuffer carry is stored at 3 checkpoints and steps are rerun from them:
    # same values and gradients as plain autodiff of lax.scan, no per-iteration copy.
    # One compile for both checks: the values, and the copies in its loops.
    f64 = jnp.float64
    ours = _outputs(name, mode, corpus.ESB, f64, _checkpointed)
    _assert_close(ours, _plain_autodiff(name, mode))
    copies = _copies(name, mode, corpus.ESB, f64, _checkpointed)
    assert copies == [], "\n".join(map(str, copies))


def test_promise_in_bounds_gives_the_same_values(name):
    checked = _outputs(name, "grad", corpus.ESB, jnp.float64)
    promised = _outputs(name, "grad", corpus.ESB_PROMISE, jnp.float64)
    assert len(checked) == len(promised)
    for a, b in zip(checked, promised):
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

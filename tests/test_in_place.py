"""In place: compiled scans of buffer edits have no per-iteration buffer copies.

Each step body runs inside `lax.scan` over a 64 x 512 float32 buffer (128 KiB); the
detector counts copies of at least 64 KiB in compiled while bodies. Indices and data
are jit arguments: closed-over constants would let XLA fold the loops away.
"""

from __future__ import annotations

import functools
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_shiftbuf as esb
from eqx_shiftbuf import _inspect

from . import corpus, natural
from .tape import loop_bodies, loop_buffer_work, loop_kernels


# On one xdist worker (`--dist loadgroup`): the tests share compiled programs
# (the caches below), which another worker would compile again.
pytestmark = pytest.mark.xdist_group("in_place")


ROWS, COLS, STEPS, K = 64, 512, 8, 16
MIN_BYTES = ROWS * COLS * 4 // 2


def _step_insert(buf, x, p):
    return buf.insert((x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"])), jnp.zeros(())


def _step_delete(buf, x, p):
    return buf.delete((x["r"][0], x["c"][0])), jnp.zeros(())


def _step_pop(buf, x, p):
    buf, removed = buf.pop((x["r"][0], x["c"][0]))
    return buf, removed * p["s"]


def _step_update(buf, x, p):
    upd = jnp.tanh(p["s"] * x["v"] + jnp.arange(K, dtype=jnp.float32))[None]
    return buf.dynamic_update_slice(
        upd, (x["r"][0], x["c"][0] % (COLS - K))
    ), jnp.zeros(())


def _step_slice_matmul(buf, x, p):
    w = buf.dynamic_slice((x["r"][0], jnp.int32(0)), (1, K))
    return buf, jnp.tanh(w @ p["W"]).sum()


def _step_insert_delete(buf, x, p):
    buf = buf.insert((x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"]))
    return buf.delete((x["r"][1], x["c"][1])), jnp.zeros(())


def _step_two_pops(buf, x, p):
    buf, a = buf.pop((x["r"][0], x["c"][0]))
    buf, b = buf.pop((x["r"][1], x["c"][1]))
    return buf, (a + b) * p["s"]


STEPS_BY_NAME = {
    "insert": _step_insert,
    "delete": _step_delete,
    "pop": _step_pop,
    "dynamic_update_slice": _step_update,
    "dynamic_slice_matmul": _step_slice_matmul,
    "insert_then_delete": _step_insert_delete,
    "two_pops": _step_two_pops,
}


def _loss(step):
    def loss(p, init, xs):
        buf, ys = lax.scan(lambda b, x: step(b, x, p), init, xs)
        return ((buf.array - 0.5) ** 2).mean() + ys.sum()

    return loss


def _inputs():
    rng = np.random.default_rng(0)
    xs = {
        "r": jnp.asarray(rng.integers(0, ROWS, (STEPS, 2)), jnp.int32),
        "c": jnp.asarray(rng.integers(0, COLS, (STEPS, 2)), jnp.int32),
        "v": jnp.asarray(rng.random(STEPS), jnp.float32),
    }
    p = {"s": jnp.float32(0.5), "W": jnp.asarray(rng.normal(size=(K, 4)), jnp.float32)}
    init = esb.ShiftBuffer.from_array(
        jnp.asarray(rng.random((ROWS, COLS)), jnp.float32)
    )
    return p, init, xs


@functools.cache
def _jitted(name, mode):
    """One jitted program per step and mode, so that the tests that compile it (in
    the same `jax_enable_x64` mode) share the compile."""
    return jax.jit(corpus.program(mode, _loss(STEPS_BY_NAME[name])))


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
@pytest.mark.parametrize("mode", ["forward", "grad", "jvp"])
@pytest.mark.parametrize("name", list(STEPS_BY_NAME))
def test_no_per_iteration_copies(name, mode, x64):
    with jax.enable_x64(x64):
        copies = esb.find_loop_copies(
            _jitted(name, mode), *_inputs(), min_bytes=MIN_BYTES
        )
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize(
    "name, mode",
    [
        ("pop", "forward"),
        ("insert", "grad"),
        ("two_pops", "forward"),
        ("two_pops", "grad"),
        ("insert_then_delete", "grad"),
        ("dynamic_update_slice", "grad"),
        ("dynamic_slice_matmul", "grad"),
    ],
)
def test_reads_need_no_inner_loop(name, mode):
    # Pops and window reads (forward, or transposed: an insert's gradient pops, an
    # overwrite's reads the old window) read through a reduction, and writes are
    # widened so that XLA does not fuse them into the next read: the compiled scan
    # has no `while` loop inside its loop bodies, only the scans themselves, even
    # for a read right after a write.
    # The program test_no_per_iteration_copies[...-x64] compiles (the suite runs
    # with jax_enable_x64).
    bodies = loop_bodies(_jitted(name, mode), *_inputs())
    assert bodies
    for body, lines in bodies.items():
        nested = [line for line in lines if " while(" in line]
        assert nested == [], f"{body}: {nested}"


class _PlainBuffer:
    """The same steps written with plain `lax` ops, as a control for the detector."""

    def __init__(self, array):
        self.array = array

    def insert(self, index, value):
        r, c = index
        row = lax.dynamic_slice(self.array, (r, jnp.int32(0)), (1, COLS))
        pos = jnp.arange(COLS)
        new = jnp.where(pos < c, row, jnp.where(pos == c, value, jnp.roll(row, 1, 1)))
        return _PlainBuffer(
            lax.dynamic_update_slice(self.array, new, (r, jnp.int32(0)))
        )


jax.tree_util.register_pytree_node(
    _PlainBuffer, lambda b: ((b.array,), None), lambda _, c: _PlainBuffer(*c)
)


def test_plain_lax_insert_copies_under_grad():
    # The control: without the library, the same insert step copies the buffer on
    # every iteration of the compiled gradient, so the zero
    # counts above are a property of the library, not of the test.
    p, init, xs = _inputs()
    plain = _PlainBuffer(init.array)
    fn = corpus.program("grad", _loss(_step_insert))
    assert len(esb.find_loop_copies(fn, p, plain, xs, min_bytes=MIN_BYTES)) >= 1


# -- the detector itself


def _pop_read_before_write(c, x):
    r, col = x
    v = c[r, col]  # read from the carry before shifting, and returned
    row = lax.dynamic_slice(c, (r, jnp.int32(0)), (1, COLS))
    pos = jnp.arange(COLS)
    new = jnp.where(
        pos < col, row, jnp.where(pos == COLS - 1, 0.0, jnp.roll(row, -1, 1))
    )
    return lax.dynamic_update_slice(c, new, (r, jnp.int32(0))), v


def _pop_read_after_write(c, x):
    r, col = x
    row = lax.dynamic_slice(c, (r, jnp.int32(0)), (1, COLS))
    pos = jnp.arange(COLS)
    new = jnp.where(
        pos < col, row, jnp.where(pos == COLS - 1, 0.0, jnp.roll(row, -1, 1))
    )
    c = lax.dynamic_update_slice(c, new, (r, jnp.int32(0)))
    return c, c[r, col]  # read after the write


def _scan(step):
    return lambda c, xs: lax.scan(step, c, xs)


def _pop_args():
    # One step more than the other tests: `lax.scan`'s stacking of the outputs is
    # traced once per shape and process, and keeps the source line of the first
    # program that traced it, which must be this file's for the test below.
    xs = (jnp.zeros(STEPS + 1, jnp.int32), jnp.ones(STEPS + 1, jnp.int32))
    return jnp.zeros((ROWS, COLS), jnp.float32), xs


def test_detector_reports_read_before_write_pop():
    copies = esb.find_loop_copies(_scan(_pop_read_before_write), *_pop_args())
    assert len(copies) >= 1
    for c in copies:
        assert c.nbytes == ROWS * COLS * 4
        assert c.shape == f"f32[{ROWS},{COLS}]"


def test_detector_finds_nothing_in_read_after_write_pop():
    assert esb.find_loop_copies(_scan(_pop_read_after_write), *_pop_args()) == []


def _rewrite_corner(start):
    # Read a 2x2 corner and write it back selected on the step's input: at a
    # constant start XLA reads it through a static `slice`, and the fusion that
    # writes the buffer is then not in place (it rewrites the whole buffer every
    # step, with no `copy` instruction); at a run-time start it is in place.
    def step(c, x):
        s = start(x)
        corner = lax.dynamic_slice(c, (s, s), (2, 2))
        corner = jnp.where(x[1] > 1, 0.0, corner)
        return lax.dynamic_update_slice(c, corner, (s, s)), None

    return step


def test_detector_reports_a_write_that_is_not_in_place():
    copies = esb.find_loop_copies(
        _scan(_rewrite_corner(lambda x: jnp.int32(0))), *_pop_args()
    )
    assert len(copies) == 1
    assert copies[0].shape == f"f32[{ROWS},{COLS}]"
    assert "out-of-place write" in copies[0].op_name
    assert str(copies[0]).startswith("rewrite of f32")


def test_detector_accepts_an_in_place_read_modify_write():
    step = _rewrite_corner(lambda x: x[0])
    assert esb.find_loop_copies(_scan(step), *_pop_args()) == []


def test_detector_ignores_small_copies():
    copies = esb.find_loop_copies(
        _scan(_pop_read_before_write), *_pop_args(), min_bytes=ROWS * COLS * 4 + 1
    )
    assert copies == []


def test_assert_in_place_reports_readably():
    with pytest.raises(
        AssertionError, match=r"per-iteration copies.*\n  - copy of f32"
    ):
        esb.assert_in_place(_scan(_pop_read_before_write), *_pop_args())
    esb.assert_in_place(_scan(_pop_read_after_write), *_pop_args())


def test_detector_accepts_jitted_functions_and_kwargs():
    f = jax.jit(lambda c, xs, *, extra: lax.scan(_pop_read_before_write, c + extra, xs))
    c, xs = _pop_args()
    assert len(esb.find_loop_copies(f, c, xs, extra=1.0)) >= 1


def test_detector_names_the_op_and_the_users_source_line():
    copies = esb.find_loop_copies(_scan(_pop_read_before_write), *_pop_args())
    assert copies
    for c in copies:
        assert c.op_name, c
        assert "test_in_place.py:" in c.source, c
        assert "test_in_place.py:" in str(c)


# -- vmap: a batch of buffers, each element editing its own rows


def _batched_inputs(batch=3):
    rng = np.random.default_rng(1)
    rows = jnp.asarray(rng.integers(0, ROWS, (batch, STEPS, 2)), jnp.int32)
    cols = jnp.asarray(rng.integers(0, COLS, (batch, STEPS, 2)), jnp.int32)
    vals = jnp.asarray(rng.random((batch, STEPS)), jnp.float32)
    init = jnp.asarray(rng.random((batch, ROWS, COLS)), jnp.float32)
    return jnp.float32(0.5), init, rows, cols, vals


def _insert_pop_loss(p, x0, r, c, v):
    def step(b, inp):
        ri, ci, vi = inp
        b = b.insert((ri[0], ci[0]), jnp.sin(p * vi))
        b, out = b.pop((ri[1], ci[1]))
        return b, out

    b, outs = lax.scan(step, esb.ShiftBuffer.from_array(x0), (r, c, v))
    return ((b.array - 0.5) ** 2).mean() + outs.sum()


_BATCHED = {
    "vmap": jax.vmap(_insert_pop_loss, (None, 0, 0, 0, 0)),
    "vmap(grad)": jax.vmap(jax.grad(_insert_pop_loss), (None, 0, 0, 0, 0)),
    "grad(vmap)": jax.grad(
        lambda p, *a: jax.vmap(_insert_pop_loss, (None, 0, 0, 0, 0))(p, *a).sum()
    ),
}


@pytest.mark.parametrize("mode", list(_BATCHED))
def test_batched_insert_pop_has_no_per_iteration_copies(mode):
    # min_bytes is one batch element's buffer: a copy of any single buffer counts.
    copies = esb.find_loop_copies(
        _BATCHED[mode], *_batched_inputs(), min_bytes=ROWS * COLS * 4
    )
    assert copies == [], "\n".join(map(str, copies))


def _fusions_writing(hlo: str, shape: str) -> list[str]:
    """The text of each fused computation of `hlo` (compiled HLO text) whose root
    has `shape` (e.g. `f32[256,64]`)."""
    root = re.compile(r"ROOT %\S+ = " + re.escape(shape) + r"[{ ]")
    return [
        "\n".join(lines)
        for name, lines in _inspect._parse(hlo).items()
        if name.startswith("fused") and any(root.match(line) for line in lines)
    ]


@pytest.mark.parametrize(
    "shape, axis", [((256, 64), 0), ((4096,), 0), ((1, 4096), 1)], ids=str
)
def test_a_long_line_shift_computes_its_value_once(shape, axis):
    # A traced insert is a `select` over the whole line. XLA:CPU fused the inserted
    # value's computation (here a `sin`) into it, recomputed for each element of
    # the line: 0.45 ms a step on a (256, 64) ring, where the select takes 0.01 ms.
    # The shift reads its value (and index scalars) through a reduction first.
    n = shape[axis]
    vshape = shape[axis + 1 :]

    def step(b, x):
        value = jnp.sin(x * jnp.arange(1, 1 + math.prod(vshape), dtype=jnp.float32))
        index = (0,) * axis + (x.astype(jnp.int32) % n,)
        return b.insert(index, value.reshape(vshape)), None

    def f(b, xs):
        return lax.scan(step, b, xs)[0].array

    b = esb.ShiftBuffer.zeros(shape, axis=axis)
    hlo = jax.jit(f).lower(b, jnp.arange(8.0)).compile().as_text()
    dims = ",".join(map(str, shape))
    fusions = _fusions_writing(hlo, f"f32[{dims}]")
    assert fusions, "no fusion writes the buffer: the test checks nothing"
    for text in fusions:
        assert " sine(" not in text, text


def _whiles_in_gradient(read_whole: bool) -> int:
    def step(buf, x):
        j, v, s = x
        buf = buf.insert((j, 0), v)
        if not read_whole:
            return buf, v * s
        buf, w = buf.read()
        return buf, (w * s).sum()

    def loss(a, s):
        t = jnp.arange(8, dtype=jnp.int32)
        xs = (t % 4, jnp.linspace(0.0, 1.0, 8), jnp.full((8,), s))
        buf, ys = lax.scan(step, esb.ShiftBuffer.from_array(a), xs)
        return (buf.array**2).sum() + ys.sum()

    args = (jnp.ones((4, 32)), jnp.float32(0.5))
    return (
        jax.jit(jax.grad(loss, (0, 1))).lower(*args).as_text().count("stablehlo.while")
    )


def test_a_whole_window_cotangent_from_scalars_is_added_without_a_loop():
    # The window's cotangent is a broadcast of a scalar: added in two in-place half
    # updates into which XLA fuses it (`_xla.added_in_halves`), not in a loop whose
    # operand XLA writes out first.
    assert _whiles_in_gradient(read_whole=True) == _whiles_in_gradient(read_whole=False)


# ---------------------------------------------------------------------------
# bfloat16 and float8 buffers are edited as bits (`_xla.carrier`): XLA:CPU computes
# those dtypes in float32, flushing subnormals and quieting NaNs. XLA writes the
# bits in place only when nothing else in the write's fusion reads the storage:
# a write that read back a neighbouring line (`_xla.widened_write`), a shift that
# read its 2-line window (`_xla.window2_edit`) and a batched accumulation that
# read its old windows each copied the buffer every step, on a buffer of several
# lines. Their reads now come first, on their own.

NARROW = [jnp.bfloat16, jnp.float8_e5m2]


def _narrow_edit(op, b, i, v, dtype):
    if op == "dynamic_update_slice":
        return b.dynamic_update_slice(jnp.full((1, 16), v, dtype), (i % 3, i)), v
    if op == "insert":
        return b.insert((i % 3, i), jnp.asarray(v, dtype)), v
    if op == "pop":
        b, x = b.pop((i % 3, i))
        return b, x.astype(jnp.float32) * v
    # a read: under vmap, its transpose is a batched accumulation
    return b, (b.dynamic_slice((i % 3, i), (1, 16)).astype(jnp.float32) * v).sum()


def _narrow_loss(op, dtype, lib: bool = True):
    def loss(s, a, xs):
        def step(b, x):
            i, v = x
            if lib:
                return _narrow_edit(op, b, i, v * s, dtype)
            assert op == "dynamic_update_slice"  # (the only plain version)
            w = jnp.full((1, 16), v * s, dtype)
            return lax.dynamic_update_slice(b, w, (i % 3, i)), v * s

        b0 = esb.ShiftBuffer(a, axis=1) if lib else a
        b, ys = lax.scan(step, b0, xs)
        return ((b.array if lib else b).astype(jnp.float32) ** 2).sum() + ys.sum()

    xs = (jnp.arange(STEPS, dtype=jnp.int32) * 37 % 1900, jnp.linspace(0.1, 1.0, STEPS))
    return loss, (jnp.float32(0.5), jnp.ones((3, 2000), dtype), xs)


NARROW_CASES = [
    (op, mode, jnp.bfloat16)
    for op, modes in (
        ("dynamic_update_slice", ("forward", "grad")),
        ("insert", ("forward", "grad")),
        ("pop", ("forward", "grad")),
        ("read", ("vmap(grad)",)),
    )
    for mode in modes
] + [("dynamic_update_slice", "grad", jnp.float8_e5m2)]


@pytest.mark.parametrize(
    "op, mode, dtype",
    NARROW_CASES,
    ids=[f"{o}-{m}-{jnp.dtype(d).name}" for o, m, d in NARROW_CASES],
)
def test_an_edit_of_a_narrow_float_buffer_of_several_lines_is_in_place(op, mode, dtype):
    loss, args = _narrow_loss(op, dtype)
    if mode == "grad":
        loss = jax.grad(loss, argnums=(0, 1))
    elif mode == "vmap(grad)":
        loss = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, None, 0))
        args = (*args[:2], jax.tree.map(lambda x: jnp.stack([x, x[::-1]]), args[2]))
    assert esb.find_loop_copies(loss, *args, min_bytes=args[1].nbytes // 2) == []


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: jnp.dtype(d).name)
def test_a_window_written_into_a_narrow_float_buffer_has_plain_lax_values(dtype):
    # The initial buffer's gradient (of its dtype) bit for bit; the loss and the
    # parameter's gradient, float32 sums, to rounding.
    lib, args = _narrow_loss("dynamic_update_slice", dtype)
    plain, _ = _narrow_loss("dynamic_update_slice", dtype, lib=False)
    both = [jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(*args) for f in (lib, plain)]
    (v1, (g1, b1)), (v2, (g2, b2)) = both
    assert np.asarray(b1).tobytes() == np.asarray(b2).tobytes()
    np.testing.assert_allclose([v1, g1], [v2, g2], rtol=1e-6)


# An edit of a narrow float buffer then a read of it in the same step: XLA fused
# the edit's computation into both the buffer's write and the read, which then
# read the buffer from before the write (1 copy a step forward, 2 under `jvp`,
# on every buffer of one to three lines; `_primitives._edited_bits`).
EDIT_THEN_READ_SHAPES = [((1024,), 0), ((3, 2000), 1), ((256, 16), 0)]


def _edit_then_read_loss(op, shape, axis, dtype, lib: bool = True):
    lead, tail = (0,) * axis, shape[axis + 1 :]
    sizes = (1,) * axis + (16,) + tail
    at = lambda k: tuple(jnp.int32(x) for x in lead + (k,) + (0,) * len(tail))

    def loss(s, a, xs):
        def step(b, x):
            i, j, v = x
            v = v * s
            if op == "insert" and lib:
                b = b.insert(lead + (i,), jnp.full(tail, v, dtype))
            elif op == "insert":  # plain `lax`: the line shifted with `where`
                line = b[lead] if axis else b
                pos = lax.broadcasted_iota(jnp.int32, line.shape, 0)
                new = jnp.where(pos == i, v.astype(dtype), jnp.roll(line, 1, 0))
                new = jnp.where(pos < i, line, new)
                b = b.at[lead].set(new) if axis else new
            elif lib:
                b = b.dynamic_update_slice(jnp.full(sizes, v, dtype), at(i))
            else:
                b = lax.dynamic_update_slice(b, jnp.full(sizes, v, dtype), at(i))
            if lib:
                b, w = b.read(at(j), sizes)
            else:
                w = lax.dynamic_slice(b, at(j), sizes)
            return b, (w.astype(jnp.float32) * v).sum()

        b0 = esb.ShiftBuffer(a, axis=axis) if lib else a
        b, ys = lax.scan(step, b0, xs)
        final = b.array if lib else b
        return (final.astype(jnp.float32) ** 2).sum() + ys.sum()

    n = shape[axis]
    steps = jnp.arange(STEPS, dtype=jnp.int32)
    xs = (steps * 37 % (n - 16), steps * 91 % (n - 16), jnp.linspace(0.1, 1.0, STEPS))
    a = jnp.asarray(np.random.default_rng(0).normal(size=shape), dtype)
    return loss, (jnp.float32(0.5), a, xs)


@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp"])
@pytest.mark.parametrize("shape, axis", EDIT_THEN_READ_SHAPES)
@pytest.mark.parametrize("op", ["insert", "dynamic_update_slice"])
def test_a_narrow_float_buffer_edited_then_read_copies_nothing(op, shape, axis, mode):
    loss, args = _edit_then_read_loss(op, shape, axis, jnp.bfloat16)
    fn = natural.program(mode, loss)
    assert esb.find_loop_copies(fn, *args, min_bytes=args[1].nbytes // 2) == []


def test_a_float8_buffer_overwritten_then_read_copies_nothing():
    loss, args = _edit_then_read_loss(
        "dynamic_update_slice", (3, 2000), 1, jnp.float8_e5m2
    )
    assert esb.find_loop_copies(loss, *args, min_bytes=args[1].nbytes // 2) == []


@pytest.mark.parametrize("shape, axis", EDIT_THEN_READ_SHAPES)
@pytest.mark.parametrize("op", ["insert", "dynamic_update_slice"])
def test_a_narrow_float_buffer_edited_then_read_has_plain_lax_values(op, shape, axis):
    # The reads and the final buffer, bfloat16 values moved and summed in float32
    # in the same order: the loss to rounding, the initial buffer's gradient.
    lib, args = _edit_then_read_loss(op, shape, axis, jnp.bfloat16)
    plain, _ = _edit_then_read_loss(op, shape, axis, jnp.bfloat16, lib=False)
    got, want = (jax.jit(jax.value_and_grad(f, (0, 1)))(*args) for f in (lib, plain))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1][0], want[1][0], rtol=1e-5)
    g, w = (np.asarray(x[1][1], np.float32) for x in (got, want))
    np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-2)


def _narrow_delay_line_loss(read: str):
    """A bfloat16 delay line `(1024, 32)`: `insert(0, x)` (its ring's head moves),
    then eleven taps at Python-int rows, or its whole window."""
    taps = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

    def loss(s, a, xs):
        def step(b, x):
            f = jnp.tanh(s * x + jnp.arange(32, dtype=jnp.float32))
            b = b.insert(0, f.astype(jnp.bfloat16))
            windows = []
            if read == "taps":
                for t in taps:
                    b, w = b.read((t, 0), (1, 32))
                    windows.append(w)
            else:
                b, w = b.read()
                windows.append(w)
            return b, sum((w.astype(jnp.float32) * s).sum() for w in windows)

        b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=0), xs)
        return ys.sum()

    return loss, (jnp.float32(0.5), jnp.zeros((1024, 32), jnp.bfloat16), jnp.ones(6))


@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp", "vmap(grad)"])
@pytest.mark.parametrize("read", ["taps", "whole"])
def test_a_narrow_float_delay_line_read_after_its_push_copies_nothing(read, mode):
    # The natural rows `delay_taps` and `delay_whole` in bfloat16: the reads of
    # the ring right after its push (`_primitives._edited_bits`; the whole window
    # through the ring's rotation).
    loss, (s, a, xs) = _narrow_delay_line_loss(read)
    if "vmap" in mode:
        xs = jnp.stack([xs, xs[::-1]])
    fn = natural.program(mode, loss)
    assert esb.find_loop_copies(fn, s, a, xs, min_bytes=a.nbytes // 2) == []


def _whole_slice_loss(dtype, lib: bool):
    """An insert, then a `dynamic_slice` of the whole buffer: under `grad`, JAX sums
    the buffer's two cotangents, which the next access folds
    (`_xla.fold_cotangent_sum`)."""

    def loss(s, a, xs):
        def step(b, x):
            r, c, v = x
            val = (v * s).astype(dtype)
            if lib:
                b = b.insert((r, c), val)
                w = b.dynamic_slice((0, 0), b.shape)
            else:
                b = corpus.PLAIN.insert(b, (r, c), val)
                w = b.array
            return b, jnp.real(w.astype(jnp.complex64) * s).sum()

        b0 = esb.ShiftBuffer(a, axis=1) if lib else corpus.PLAIN.wrap(a, 1)
        b, ys = lax.scan(step, b0, xs)
        final = b.array
        return jnp.real(final.astype(jnp.complex64) ** 2).sum() + ys.sum()

    xs = (
        jnp.arange(STEPS, dtype=jnp.int32) % 4,
        jnp.arange(STEPS, dtype=jnp.int32) * 5 % 32,
        jnp.linspace(0.1, 1.0, STEPS),
    )
    a = jnp.asarray(np.random.default_rng(0).random((4, 32)), dtype)
    return loss, (jnp.float32(0.5), a, xs)


@pytest.mark.parametrize(
    "dtype", [jnp.bfloat16, jnp.complex64], ids=lambda d: jnp.dtype(d).name
)
def test_a_whole_buffer_slice_of_any_dtype_has_plain_lax_gradients(dtype):
    # The cotangent sum's dtype was looked up among the deferrable reads' dtypes
    # only: a TypeError at trace time for a bfloat16 or complex buffer.
    lib, args = _whole_slice_loss(dtype, lib=True)
    plain, _ = _whole_slice_loss(dtype, lib=False)
    got = jax.jit(jax.grad(lib, argnums=(0, 1)))(*args)
    want = jax.jit(jax.grad(plain, argnums=(0, 1)))(*args)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(
            np.asarray(x, np.complex128), np.asarray(y, np.complex128), rtol=1e-2
        )


def test_a_static_slice_of_a_complex_buffer_s_array_copies_nothing_under_grad():
    """A complex (16, 64, 32) buffer, a traced insert, then `.array[0:1, :16]`: the
    slice's cotangent, padded with complex zeros, is accumulated unpadded
    (`_xla.unpadded_window`, which reads the padding's complex zero)."""
    shape = (16, 64, 32)

    def loss(s, a, xs):
        def step(b, x):
            c, v = x
            b = b.insert((0, c), jnp.full((32,), v * s, jnp.complex64))
            return b, (lax.real(b.array[0:1, :16]) * v * s).sum()

        b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=1), xs)
        return (lax.real(b.array) ** 2).sum() + ys.sum()

    a = jnp.ones(shape, jnp.complex64)
    xs = (jnp.arange(12, dtype=jnp.int32) * 37 % 64, jnp.linspace(0.1, 1, 12))
    grad = jax.grad(loss, argnums=(0, 1))
    copies = esb.find_loop_copies(
        grad, jnp.float32(0.5), a, xs, min_bytes=a.nbytes // 2
    )
    assert copies == [], copies


# A one-line overwrite of a 2-D buffer is written as its window, its new values
# computed in the write's own kernel, as plain `lax` writes it; one of a buffer of
# 3 dimensions or more through a window 2 wide in each of them
# (`_primitives._swap_impl`, `_xla.widened_write`).


def _scan_loss(step, shape):
    """`(loss, args)`: a `lax.scan` of `step(b, (i, j, v), s)` over a `ShiftBuffer`
    of `shape` shifted along its last axis, `i` and `j` traced positions."""

    def loss(s, a, xs):
        b, ys = lax.scan(
            lambda b, x: step(b, x, s), esb.ShiftBuffer(a, axis=len(shape) - 1), xs
        )
        return (b.array**2).sum() + ys.sum()

    xs = (
        jnp.arange(STEPS, dtype=jnp.int32) * 3,
        jnp.arange(STEPS, dtype=jnp.int32) * 5 % (shape[-1] - 16),
        jnp.linspace(0.1, 1.0, STEPS),
    )
    return loss, (jnp.float32(0.5), jnp.ones(shape, jnp.float32), xs)


def _overwrite_then_pop(shape):
    lead = (0,) * (len(shape) - 2)

    def step(b, x, s):
        i, j, v = x
        w = jnp.full((1,) * (len(shape) - 1) + (16,), jnp.tanh(v * s))
        b = b.dynamic_update_slice(w, lead + (i % shape[-2], j))
        b, removed = b.pop(lead + (i % shape[-2], j))
        return b, removed * s

    return _scan_loss(step, shape)


@pytest.mark.parametrize("shape", [(8, 64), (8, 32, 64), (8, 1, 64)])
@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp"])
def test_an_overwrite_then_a_pop_copies_nothing(shape, mode):
    # Written as its window into a buffer of 3 dimensions, the overwrite copied 2
    # a step under `jvp` (XLA duplicated it into the pop's read of the line).
    loss, args = _overwrite_then_pop(shape)
    fn = natural.program(mode, loss)
    assert esb.find_loop_copies(fn, *args, min_bytes=args[1].nbytes // 2) == []


def test_a_one_line_overwrite_of_a_2d_buffer_runs_plain_lax_s_kernels():
    # Through a window 2 wide, the new values were computed in a kernel of their
    # own: one more a step than plain `lax` (the corpus's `dynamic_update_slice`
    # forward 1.09-1.10x plain `lax`'s).
    body = corpus.BODIES_BY_NAME["dynamic_update_slice"]
    args = corpus.make_inputs(body, 100, 64, 50)
    (lib,) = loop_kernels(corpus.make_loss(body, corpus.ESB_PROMISE), *args)
    (plain,) = loop_kernels(corpus.make_loss(body, corpus.PLAIN), *args)
    assert lib <= plain


@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp", "jvp(vmap)"])
def test_a_row_written_then_a_window_of_rows_read_copies_nothing(mode):
    # A local-attention cache `(T, D)`: each step writes row `t` from the carried
    # state, then reads the last rows. Written as its window, the tangent's row
    # was fused by XLA into the tangent window's read, which then read the
    # tangent buffer from before the write: 2 copies a step under `jvp`.
    t_len, d, w = 128, 32, 8

    def loss(p, init, xs):
        def step(carry, inp):
            b, h = carry
            t, x = inp
            b = b.dynamic_update_slice((p @ h)[None], (t, 0))
            b, k = b.read((jnp.maximum(t - w + 1, 0), 0), (w, d))
            h = jnp.tanh(h + x + k.T @ (k @ x))
            return (b, h), (h**2).sum()

        carry = (esb.ShiftBuffer.from_array(init), jnp.zeros(d))
        return lax.scan(step, carry, xs)[1].sum()

    p = 0.1 * jnp.cos(jnp.arange(d * d, dtype=jnp.float32)).reshape(d, d)
    xs = (
        jnp.arange(t_len, dtype=jnp.int32),
        0.05 * jnp.sin(jnp.arange(t_len * d, dtype=jnp.float32)).reshape(t_len, d),
    )
    if "vmap" in mode:  # three sequences of inputs
        xs = (jnp.stack([xs[0]] * 3), jnp.stack([xs[1] * (k + 1) for k in range(3)]))
    fn = natural.program(mode, loss)
    copies = esb.find_loop_copies(fn, p, jnp.zeros((t_len, d)), xs, min_bytes=8192)
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize("shape", [(8, 64), (8, 32, 64), (4, 3, 5, 64)])
def test_an_insert_then_a_read_copies_nothing_under_grad(shape):
    # The read's cotangent is accumulated through a window 2 wide in each
    # dimension (`_xla.widened_write`): written as its window, the accumulation
    # copied 2 a step on the buffers of 3 and 4 dimensions (XLA duplicated it into
    # the insert's transpose).
    lead = (0,) * (len(shape) - 2)

    def step(b, x, s):
        i, j, v = x
        b = b.insert(lead + (i % shape[-2], j), jnp.sin(v * s))
        b, w = b.read(lead + (j % shape[-2], j), (1,) * (len(shape) - 1) + (16,))
        return b, (w * s).sum()

    loss, args = _scan_loss(step, shape)
    fn = natural.program("grad", loss)
    assert esb.find_loop_copies(fn, *args, min_bytes=args[1].nbytes // 2) == []


# ---------------------------------------------------------------------------
# A step that outputs its buffer as it was before an edit (`return buf.insert(...),
# buf.array`, a recorded history; under `grad`, a whole read before an insert,
# saved as a residual): `lax.scan` stacks the step's outputs after the step, so the
# old buffer must outlive the edit. XLA copied it twice a step for that; a snapshot
# taken before the edit, which waits for it, is one write of the buffer
# (`_xla._snapshot_returned`).

HISTORY_SHAPES = [(64, 512), (8, 16, 64), (2, 4096)]
HISTORY_DTYPES = [jnp.float32, jnp.int32, jnp.bfloat16, jnp.float8_e4m3fn]


def _history_loss(shape, dtype, lib: bool = True, scan=lax.scan, output=True):
    """`(loss, args)`: a step that inserts into its buffer and outputs the buffer
    from before the insert (`output`; else the step outputs nothing of it)."""
    lead = (0,) * (len(shape) - 2)
    ops = natural.ESB if lib else natural.PLAIN

    def loss(s, a, xs):
        def step(b, x):
            i, v = x
            at = lead + (i % shape[-2], i % shape[-1])
            new = ops.insert(b, at, jnp.sin(v * s).astype(dtype))
            return new, ops.unwrap(b) if output else v

        b, ys = scan(step, ops.wrap(a, len(shape) - 1), xs)
        final = ops.unwrap(b)
        return (final.astype(jnp.float32) ** 2).sum() + ys.astype(jnp.float32).sum()

    xs = (jnp.arange(STEPS, dtype=jnp.int32) * 37, jnp.linspace(0.1, 1.0, STEPS))
    a = (jnp.arange(math.prod(shape)) % 7).reshape(shape).astype(dtype)
    return loss, (jnp.float32(0.5), a, xs)


@pytest.mark.parametrize("shape", HISTORY_SHAPES)
@pytest.mark.parametrize("dtype", HISTORY_DTYPES)
def test_a_step_that_outputs_its_buffer_from_before_an_edit_copies_nothing(
    shape, dtype
):
    loss, args = _history_loss(shape, dtype)
    copies = esb.find_loop_copies(loss, *args, min_bytes=args[1].nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))
    # One write of the buffer a step more than the same step without the
    # output, the snapshot (XLA made two copies). (The step's own: none, but a
    # float8 shift of a buffer of two lines, which selects over both.)
    alone, _ = _history_loss(shape, dtype, output=False)
    size = math.prod(shape)
    work, base = loop_buffer_work(loss, args, size), loop_buffer_work(alone, args, size)
    assert len(work) == len(base) + 1


@pytest.mark.parametrize("shape", HISTORY_SHAPES)
@pytest.mark.parametrize("dtype", HISTORY_DTYPES)
def test_a_step_that_outputs_its_buffer_from_before_an_edit_has_plain_lax_values(
    shape, dtype
):
    loss, args = _history_loss(shape, dtype)
    ref, _ = _history_loss(shape, dtype, lib=False)
    np.testing.assert_array_equal(jax.jit(loss)(*args), jax.jit(ref)(*args))


CHECKPOINTED = functools.partial(esb.scan, kind="checkpointed")


@pytest.mark.parametrize("shape", HISTORY_SHAPES)
@pytest.mark.parametrize("scan", [lax.scan, CHECKPOINTED], ids=["lax", "esb"])
def test_the_gradient_through_a_buffer_output_from_before_an_edit_is_in_place(
    shape, scan
):
    # Nothing is written a step but the edits: the snapshot is not taken where
    # the step's output is not used (the forward pass of a gradient), and the
    # output's cotangent, added to the buffer's after the insert's transpose with
    # no access after it, is folded at the step's return (`_xla._finish`) and
    # added in halves (`_xla.added_in_halves_fused`), under `esb.scan` too,
    # whose step takes it through a call.
    loss, args = _history_loss(shape, jnp.float32, scan=scan)
    fn = jax.grad(loss, (0, 1))
    work = loop_buffer_work(fn, args, math.prod(shape))
    # (`esb.scan` loads each reversed step's checkpoint: a slice of its store.)
    assert [w for w in work if not w.startswith("%dynamic-slice_")] == []
    ref, _ = _history_loss(shape, jnp.float32, lib=False)
    got, want = jax.jit(fn)(*args), jax.jit(jax.grad(ref, (0, 1)))(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", HISTORY_SHAPES)
def test_the_batched_gradient_through_a_buffer_output_from_before_an_edit_is_in_place(
    shape,
):
    # Under `vmap(grad)`, the buffer shared by the batch: the output's cotangent
    # is the batch's, broadcast (`_xla.fold_cotangent_sum`), and still added in
    # halves (`_xla.added_in_halves_fused`): in a single-trip loop, XLA wrote
    # the broadcast out every step, 3.6x slower than unfolded.
    loss, args = _history_loss(shape, jnp.float32)
    xs = jax.tree.map(lambda a: jnp.stack([a, a[::-1], a, a]), args[2])
    fn = jax.vmap(jax.grad(loss, (0, 1)), in_axes=(None, None, 0))
    assert loop_buffer_work(fn, (args[0], args[1], xs), 4 * math.prod(shape)) == []
    ref, _ = _history_loss(shape, jnp.float32, lib=False)
    want = jax.vmap(jax.grad(ref, (0, 1)), in_axes=(None, None, 0))
    got, want = jax.jit(fn)(args[0], args[1], xs), jax.jit(want)(args[0], args[1], xs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(64, 512), (8, 16, 64)])
@pytest.mark.parametrize("mode", ["grad", "vmap(grad)"])
def test_a_weighted_whole_read_then_an_insert_copies_nothing_under_grad(shape, mode):
    # JAX's residual of `(w * c * v).sum()` for `v` is `w * c`, computed from the
    # buffer in the stacking after the step's insert: the snapshot is taken for
    # the elementwise operations the step returns (`_xla._returned_uses`).
    lead = (0,) * (len(shape) - 2)
    c = jnp.cos(jnp.arange(math.prod(shape), dtype=jnp.float32)).reshape(shape)

    def step(b, x, s):
        i, j, v = x
        b, w = b.read()
        y = (w * c * v * s).sum()
        return b.insert(lead + (i % shape[-2], j), jnp.sin(v * s)), y

    loss, args = _scan_loss(step, shape)
    fn = natural.program(mode, loss)
    if mode == "vmap(grad)":
        args = (
            args[0],
            args[1],
            jax.tree.map(lambda a: jnp.stack([a, a[::-1]]), args[2]),
        )
    assert esb.find_loop_copies(fn, *args, min_bytes=args[1].nbytes // 2) == []


# ---------------------------------------------------------------------------
# An edit inside a function the step calls (a `jax.jit` or `eqx.filter_jit`
# helper) is lowered before its call, where the reads the step made of the buffer
# before the call cannot be reached; once the step is lowered, the token the call
# passes in waits for them (`_xla._reads_before_call`). XLA copied the buffer
# before: 1-2 a step forward, 2-4 under `jvp`.

NESTED_READS = ["dynamic_slice", "array_slice", "array_sum", "read_whole"]
NESTED_SHAPES = [((64, 512), 1), ((1024, 32), 0)]  # lines; one line (a ring)


def _nested_jit_loss(read, shape, axis, jit=jax.jit, remat=False):
    """`(loss, args)`: a step that reads its buffer (`read`), then inserts
    through a helper wrapped by `jit` (`jax.jit`, `eqx.filter_jit`, or None: in
    line); with `remat`, the step under `jax.checkpoint`."""
    lead = (0,) * (len(shape) - 1)
    at = (lambda j: (j % shape[0], j)) if axis == 1 else (lambda j: (j,))
    helper = lambda b, j, x: b.insert(at(j), x)
    insert = helper if jit is None else jit(helper)
    tail = shape[axis + 1 :]

    def loss(s, a, xs):
        def step(b, x):
            i, v = x
            new = jnp.full(tail, jnp.sin(v * s))
            if read == "dynamic_slice":  # the window used after the edit
                w = b.dynamic_slice((0,) * len(shape), (1,) * (len(shape) - 1) + (8,))
                return insert(b, i % 100, new), (w * v).sum()
            if read == "array_slice":
                w = b.array[lead + (slice(0, 8),)]
                return insert(b, i % 100, new), (w * v).sum()
            if read == "array_sum":  # summed before the edit
                y = (b.array[lead + (slice(0, 8),)] * v).sum()
                return insert(b, i % 100, new), y
            b, w = b.read()
            y = (w * v).sum()
            return insert(b, i % 100, new), y

        body = jax.checkpoint(step) if remat else step
        b, ys = lax.scan(body, esb.ShiftBuffer(a, axis=axis), xs)
        return (b.array**2).sum() + ys.sum()

    xs = (jnp.arange(STEPS, dtype=jnp.int32) * 37, jnp.linspace(0.1, 1.0, STEPS))
    a = jnp.cos(jnp.arange(math.prod(shape), dtype=jnp.float32)).reshape(shape)
    return loss, (jnp.float32(0.5), a, xs)


@pytest.mark.parametrize("shape, axis", NESTED_SHAPES, ids=["lines", "ring"])
@pytest.mark.parametrize("read", NESTED_READS)
@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp"])
@pytest.mark.parametrize("jit", [jax.jit, eqx.filter_jit], ids=["jax", "eqx"])
def test_an_edit_in_a_nested_jit_waits_for_the_reads_before_its_call(
    shape, axis, read, mode, jit
):
    loss, args = _nested_jit_loss(read, shape, axis, jit)
    fn = natural.program(mode, loss)
    copies = esb.find_loop_copies(fn, *args, min_bytes=args[1].nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize("shape, axis", NESTED_SHAPES, ids=["lines", "ring"])
@pytest.mark.parametrize("read", NESTED_READS)
@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp"])
def test_an_edit_in_a_nested_jit_under_checkpoint_waits_for_the_reads_before_it(
    shape, axis, read, mode
):
    """The same with the step under `jax.checkpoint`, whose body JAX lowers as a
    function outside the module and inlines into its caller: its reads are found
    there (`_xla._all_marks`' `detached`), and it is finished before it is
    inlined (`_xla._function_cache`). XLA copied 1-2 a step forward, 2-4 under
    `jvp`."""
    loss, args = _nested_jit_loss(read, shape, axis, remat=True)
    fn = natural.program(mode, loss)
    copies = esb.find_loop_copies(fn, *args, min_bytes=args[1].nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize("shape, axis", NESTED_SHAPES, ids=["lines", "ring"])
@pytest.mark.parametrize("read", NESTED_READS)
@pytest.mark.parametrize("remat", [False, True], ids=["scan", "checkpoint"])
def test_an_edit_in_a_nested_jit_has_the_values_of_one_in_line(
    shape, axis, read, remat
):
    loss, args = _nested_jit_loss(read, shape, axis, remat=remat)
    ref, _ = _nested_jit_loss(read, shape, axis, jit=None, remat=remat)
    fn = jax.jit(jax.value_and_grad(loss, (0, 1)))
    want = jax.jit(jax.value_and_grad(ref, (0, 1)))(*args)
    for g, w in zip(jax.tree.leaves(fn(*args)), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)


# ---------------------------------------------------------------------------
# `lax.dynamic_slice(buf.array, ...)` before an insert, under `vmap(grad)`: JAX's
# cotangent of the slice is a scatter of the batch of windows into zeros the size
# of the batch of buffers, added to the buffers' cotangent; it is folded into an
# accumulation of each element's window (`_xla._zeros_around`). At Python-int
# starts on a buffer of three dimensions, XLA wrote that sum out of place: a copy
# a step (batches of 2; `copy_sweep.py`'s `arrds_ins` on `mid3` and `four`).


def _array_ds_then_insert_loss(static, shape):
    def loss(s, a, xs):
        def step(b, x):
            i, j, v = x
            st = (3, 5, 0) if static else (i % shape[0], j % (shape[1] - 15), 0)
            w = lax.dynamic_slice(
                b.array, [jnp.asarray(k, jnp.int32) for k in st], (1, 16, shape[2])
            )
            b = b.insert((i % shape[0], j % shape[1]), jnp.full(shape[2:], v * s))
            return b, (w * v).sum()

        b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=1), xs)
        return (b.array**2).sum() + ys.sum()

    return loss


@pytest.mark.parametrize("static", [True, False], ids=["pyint", "traced"])
@pytest.mark.parametrize("batch", [2, 4])
def test_a_dynamic_slice_of_array_then_an_insert_is_in_place_under_vmap_grad(
    static, batch
):
    shape = (16, 64, 32)
    loss = _array_ds_then_insert_loss(static, shape)
    fn = jax.vmap(jax.grad(loss, (0, 1)), in_axes=(None, None, 0))
    xs = (
        jnp.arange(batch * STEPS, dtype=jnp.int32).reshape(batch, STEPS) * 37,
        jnp.arange(batch * STEPS, dtype=jnp.int32).reshape(batch, STEPS) * 91,
        jnp.linspace(0.1, 1.0, batch * STEPS).reshape(batch, STEPS),
    )
    a = jnp.cos(jnp.arange(math.prod(shape), dtype=jnp.float32)).reshape(shape)
    args = (jnp.float32(0.5), a, xs)
    copies = esb.find_loop_copies(fn, *args, min_bytes=a.nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))
    assert loop_buffer_work(fn, args, batch * math.prod(shape)) == []

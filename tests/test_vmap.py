"""`vmap` of every operation: values equal the per-example reference, gradients too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_shiftbuf as esb

from . import corpus, natural, reference as ref
from .tape import loop_bodies, loop_kernels


B, SHAPE = 3, (4, 6)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(B,) + SHAPE))
    rows = jnp.asarray(rng.integers(0, SHAPE[0], B), jnp.int32)
    cols = jnp.asarray(rng.integers(0, SHAPE[1], B), jnp.int32)
    vals = jnp.asarray(rng.normal(size=B))
    return x, rows, cols, vals


OPS = {
    "insert": (
        lambda x, r, c, v: esb.insert(x, (r, c), v),
        lambda x, r, c, v: ref.jnp_insert(x, (r, c), v, 1),
    ),
    "pop": (
        lambda x, r, c, v: esb.pop(x, (r, c)),
        lambda x, r, c, v: ref.jnp_pop(x, (r, c), 1),
    ),
    "dynamic_slice": (
        lambda x, r, c, v: esb.dynamic_slice(x, (r, c // 2), (1, 3)),
        lambda x, r, c, v: lax.dynamic_slice(x, (r, c // 2), (1, 3)),
    ),
    "dynamic_update_slice": (
        lambda x, r, c, v: esb.dynamic_update_slice(
            x, jnp.full((1, 2), v), (r, c // 2)
        ),
        lambda x, r, c, v: lax.dynamic_update_slice(
            x, jnp.full((1, 2), v), (r, c // 2)
        ),
    ),
}

# Which arguments are batched: everything; only the indices (one shared buffer);
# only the buffer.
IN_AXES = [(0, 0, 0, 0), (None, 0, 0, None), (0, None, None, None)]


def _args_for(in_axes, x, r, c, v):
    return tuple(a if ax == 0 else a[0] for a, ax in zip((x, r, c, v), in_axes))


@pytest.mark.parametrize("in_axes", IN_AXES, ids=["all", "indices", "buffer"])
@pytest.mark.parametrize("op", list(OPS))
def test_vmap_matches_reference(op, in_axes):
    f, g = OPS[op]
    args = _args_for(in_axes, *_data())
    a = jax.vmap(f, in_axes)(*args)
    b = jax.vmap(g, in_axes)(*args)
    for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(p, q, rtol=1e-12)


def _loss(fn):
    return lambda x, r, c, v: sum(
        (jnp.sin(o) * (1 + jnp.arange(o.size).reshape(o.shape))).sum()
        for o in jax.tree.leaves(fn(x, r, c, v))
    )


@pytest.mark.parametrize("op", list(OPS))
def test_vmap_of_grad(op):
    f, g = OPS[op]
    x, r, c, v = _data(1)
    a = jax.jit(jax.vmap(jax.grad(_loss(f), argnums=(0, 3))))(x, r, c, v)
    b = ref.jit_reference(jax.vmap(jax.grad(_loss(g), argnums=(0, 3))))(x, r, c, v)
    for p, q in zip(a, b):
        np.testing.assert_allclose(p, q, rtol=1e-12)


@pytest.mark.parametrize("op", list(OPS))
def test_grad_of_vmap(op):
    f, g = OPS[op]
    x, r, c, v = _data(2)
    total = lambda fn: lambda x, r, c, v: jax.vmap(_loss(fn))(x, r, c, v).sum()
    a = jax.jit(jax.grad(total(f), argnums=(0, 3)))(x, r, c, v)
    b = ref.jit_reference(jax.grad(total(g), argnums=(0, 3)))(x, r, c, v)
    for p, q in zip(a, b):
        np.testing.assert_allclose(p, q, rtol=1e-12)


def test_vmap_inside_scan_of_shiftbuffers():
    x, _, _, _ = _data(3)
    rng = np.random.default_rng(3)
    rows = jnp.asarray(rng.integers(0, SHAPE[0], (5, B, 2)), jnp.int32)
    cols = jnp.asarray(rng.integers(0, SHAPE[1], (5, B, 2)), jnp.int32)

    def run(lib):
        def one(buf, r, c, p):
            if lib:
                buf = buf.insert((r[0], c[0]), p)
                buf, out = buf.pop((r[1], c[1]))
            else:
                buf = ref.jnp_insert(buf, (r[0], c[0]), p, 1)
                buf, out = ref.jnp_pop(buf, (r[1], c[1]), 1)
            return buf, out

        def loss(x, p):
            init = jax.vmap(esb.ShiftBuffer.from_array)(x) if lib else x
            step = lambda b, rc: jax.vmap(one, (0, 0, 0, None))(b, rc[0], rc[1], p)
            buf, outs = lax.scan(step, init, (rows, cols))
            arr = buf.array if lib else buf
            return (jnp.cos(arr)).sum() + (outs * outs).sum()

        jit = jax.jit if lib else ref.jit_reference
        return jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, jnp.float64(0.3))

    (l1, g1), (l2, g2) = run(True), run(False)
    np.testing.assert_allclose(l1, l2, rtol=1e-12)
    for p, q in zip(g1, g2):
        np.testing.assert_allclose(p, q, rtol=1e-12)


def _two_windows_loss(unroll: int, plain: bool = False, mode: str = "vmap(grad)"):
    """A step that reads two windows with `dynamic_slice` (the buffer dropped:
    each read's cotangent accumulates onto zeros), in a scan, under `mode`."""

    def loss(s, a, xs):
        def step(b, x):
            i, j, v = x
            if plain:
                w1 = lax.dynamic_slice(b, (i, jnp.int32(0)), (1, 16))
                w2 = lax.dynamic_slice(b, (j, jnp.int32(0)), (1, 16))
            else:
                w1 = b.dynamic_slice((i, 0), (1, 16))
                w2 = b.dynamic_slice((j, 0), (1, 16))
            return b, (w1 * w2 * v * s).sum()

        b = a if plain else esb.ShiftBuffer(a, axis=1)
        b, ys = lax.scan(step, b, xs, unroll=unroll)
        return ((b if plain else b.array) ** 2).sum() + ys.sum()

    return natural.program(mode, loss)


def _two_windows_args():
    t = jnp.arange(12, dtype=jnp.int32)
    xs = (t % 64, (t * 7) % 64, jnp.linspace(0.0, 1.0, 12, dtype=jnp.float32))
    xs = jax.tree.map(lambda x: jnp.stack([x, x[::-1]]), xs)  # a batch of 2
    a = jnp.asarray(np.random.default_rng(0).normal(size=(64, 256)), jnp.float32)
    return jnp.float32(0.5), a, xs


@pytest.mark.parametrize("unroll", [1, 2])
@pytest.mark.parametrize("mode", ["vmap(grad)", "grad(vmap)"])
def test_two_window_reads_under_vmap_and_grad_copy_nothing(mode, unroll):
    # Each window's cotangent is accumulated onto a broadcast of the dropped
    # buffer's zero cotangent: batched under `vmap(grad)`, onto one buffer at
    # batched starts under `grad(vmap)` (the buffer is one for the batch). XLA
    # merged the two equal broadcasts and copied one for each accumulation: 2
    # copies per step (4 with `unroll=2` under `vmap(grad)`; `_primitives._unmerged`).
    s, a, xs = _two_windows_args()
    fn = _two_windows_loss(unroll, mode=mode)
    copies = esb.find_loop_copies(fn, s, a, xs, min_bytes=a.nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize("mode", ["vmap(grad)", "grad(vmap)"])
def test_two_window_reads_under_vmap_and_grad_match_plain_lax(mode):
    args = _two_windows_args()
    got = jax.jit(_two_windows_loss(2, mode=mode))(*args)
    want = jax.jit(_two_windows_loss(1, plain=True, mode=mode))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def _window_then_insert_loss(unroll: int, dtype=jnp.float32, plain: bool = False):
    """A window read with `dynamic_slice` (no token), then an insert, in a scan;
    the buffer one for the batch under `vmap` (the insert makes it a batch)."""

    def loss(s, a, xs):
        def step(b, x):
            i, j, v = x
            if plain:
                w = lax.dynamic_slice(b, (i, jnp.int32(0)), (1, 16))
                row = jnp.concatenate([(v * s).astype(dtype)[None], b[j, :-1]])
                b = lax.dynamic_update_slice(b, row[None], (j, jnp.int32(0)))
            else:
                w = b.dynamic_slice((i, 0), (1, 16))
                b = b.insert((j, 0), (v * s).astype(dtype))
            return b, (w.astype(jnp.float32) * v * s).sum()

        b = a.astype(dtype)
        b = b if plain else esb.ShiftBuffer(b, axis=1)
        b, ys = lax.scan(step, b, xs, unroll=unroll)
        b = b if plain else b.array
        return (b.astype(jnp.float32) ** 2).sum() + ys.sum()

    return loss


_BATCHED_MODES = ["vmap", "vmap(grad)", "jvp(vmap)", "grad(vmap)"]


@pytest.mark.parametrize("mode", _BATCHED_MODES)
def test_a_window_then_an_insert_under_vmap_copy_nothing(mode):
    # A batched read is materialised (not deferred), and its token was dropped
    # with the buffer: the insert after it did not wait for it, and XLA copied
    # the buffer, 2 copies per step (4 under jvp(vmap)). The read's lowering now
    # marks its token for the insert's lowering (`_xla.marked_read`).
    s, a, xs = _two_windows_args()
    fn = natural.program(mode, _window_then_insert_loss(1))
    copies = esb.find_loop_copies(fn, s, a, xs, min_bytes=a.nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize("mode", ["fwd", "grad", "jvp"])
def test_a_window_then_an_insert_of_a_bfloat16_buffer_copy_nothing(mode):
    # A bfloat16 read is materialised too (not a deferrable dtype): 1 copy per
    # step forward, 1 under grad, 2 under jvp, before the mark.
    s, a, xs = _two_windows_args()
    xs = jax.tree.map(lambda x: x[0], xs)  # one sequence
    fn = natural.program(mode, _window_then_insert_loss(1, jnp.bfloat16))
    copies = esb.find_loop_copies(fn, s, a, xs, min_bytes=a.nbytes // 4)
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_window_then_an_insert_under_vmap_of_grad_match_plain_lax(dtype):
    args = _two_windows_args()
    mode = "vmap(grad)"
    got = jax.jit(natural.program(mode, _window_then_insert_loss(1, dtype)))(*args)
    want = jax.jit(
        natural.program(mode, _window_then_insert_loss(1, dtype, plain=True))
    )(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def _old_window_loss(s, a, xs):
    # An insert, then a window of the buffer from before it (lowered before the
    # insert: `_xla.edits_of`), two steps a loop trip.
    def step(b, x):
        i, j, v = x
        new = b.insert((j, 0), v * s)
        return new, (b.dynamic_slice((i, 0), (1, 16)) * v * s).sum()

    b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=1), xs, unroll=2)
    return (b.array**2).sum() + ys.sum()


def test_windows_of_dropped_buffers_under_grad_of_vmap_copy_nothing():
    # Under `grad(vmap)` each window's cotangent is accumulated, batched, onto
    # the zeros of the dropped buffer's cotangent, one in each step of the loop
    # trip: XLA merged their two zero broadcasts and copied one for each, 2
    # copies per step (`_primitives._unmerged`).
    s, a, xs = _two_windows_args()
    fn = natural.program("grad(vmap)", _old_window_loss)
    copies = esb.find_loop_copies(fn, s, a, xs, min_bytes=a.nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize("op", ["insert", "delete", "pop", "write", "ring_write"])
def test_a_batch_of_edits_of_each_elements_buffer_runs_no_loop_over_the_batch(op):
    # One line or window of each batch element's own buffer: gathered and
    # scattered back, all at once, as plain `lax` under `vmap` does (a loop over
    # the batch, each trip one edit, took 2.5-5x plain `lax`'s forward on the
    # corpus's insert, delete, pop and `dynamic_update_slice` bodies). In place,
    # and exact. (Window reads still loop: `_primitives`' module docstring.)
    def step(b, x):
        r, c, v = x
        if op == "insert":
            return b.insert((r, c), v), v
        if op == "delete":
            return b.delete((r, c)), v
        if op == "pop":
            return b.pop((r, c))
        return b.dynamic_update_slice(jnp.full((2, 4), v), (r % 15, c % 29)), v

    def run(a, xs):
        # A buffer of one line (along axis 0) is a ring, whose window may wrap.
        axis = 0 if op == "ring_write" else -1
        b, ys = lax.scan(step, esb.ShiftBuffer.from_array(a, axis=axis), xs)
        return b.array, ys

    rng = np.random.default_rng(2)
    n = 8  # (XLA unrolls a loop of a few trips)
    a = jnp.asarray(rng.normal(size=(n, 16, 32)), jnp.float32)
    xs = (
        jnp.asarray(rng.integers(0, 16, (n, 7)), jnp.int32),
        jnp.asarray(rng.integers(0, 32, (n, 7)), jnp.int32),
        jnp.asarray(rng.normal(size=(n, 7)), jnp.float32),
    )
    fn = jax.vmap(run)
    assert len(loop_bodies(fn, a, xs)) == 1  # the scan's
    assert esb.find_loop_copies(fn, a, xs, min_bytes=a.nbytes // 2) == []
    got = jax.jit(fn)(a, xs)
    for k in range(n):
        want = jax.jit(run)(a[k], tuple(x[k] for x in xs))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g[k], w)


_SHIFTED_EACH = ["insert", "delete", "pop", "two_inserts", "insert_then_delete"]


@pytest.mark.parametrize("name", _SHIFTED_EACH + ["whole_read"])
def test_a_batch_of_short_line_shifts_runs_no_more_kernels_a_step_than_plain_lax(
    name,
):
    # XLA:CPU runs a loop body of more than 8 kernels through its dataflow
    # executor, about 0.5 us more a step, so each kernel counts. A batch of inserts
    # took its values by each element's position in the batch, a gather of its
    # own where plain `lax` computes the value in the scattered window: one kernel
    # more a step (`whole_read` 9 against 8). `_primitives._each_element`.
    if name in corpus.BODIES_BY_NAME:
        body = corpus.BODIES_BY_NAME[name]
        p, init, xs = corpus.make_inputs(body, 100, 64, 50)
        args = (p, init, corpus.batch_xs(xs, 4))
        loss = lambda ops: corpus.make_loss(body, ops)
        plain = corpus.PLAIN
    else:
        row = natural.ROWS_BY_NAME[name]
        args = natural.args_for(row, "vmap", 50)
        loss = lambda ops: natural.make_loss(row, ops)
        plain = natural.PLAIN
    lib = jax.vmap(loss(corpus.ESB_PROMISE), in_axes=(None, None, 0))
    ref_ = jax.vmap(loss(plain), in_axes=(None, None, 0))
    (lib_kernels,) = loop_kernels(lib, *args)  # one loop: none over the batch
    (plain_kernels,) = loop_kernels(ref_, *args)
    assert lib_kernels <= plain_kernels


def test_a_batch_of_ring_windows_no_edit_follows_is_one_gather():
    # `block_write` under `vmap`: a `(4, 32)` block of each example's ring, read at
    # its own row, which no edit follows in the step, is one gather that XLA fuses
    # into its reader, as plain `lax`'s is, not a loop over the batch (1.6-1.8x
    # plain `lax`'s forward). `_primitives._deferrable_ring_batch`.
    row = natural.ROWS_BY_NAME["block_write"]
    args = natural.args_for(row, "vmap", 50)
    lib = jax.vmap(natural.make_loss(row, corpus.ESB_PROMISE), in_axes=(None, None, 0))
    assert len(loop_kernels(lib, *args)) == 1  # the scan's: none over the batch


def test_a_batch_of_ring_windows_saved_for_the_gradient_is_not_split_over_threads():
    # Under `vmap(grad)` the window read after a delay line's push is also saved
    # for the backward pass. As one gather, XLA writes it out in a kernel of its
    # own, which XLA:CPU splits over threads (`outer_dimension_partitions`): the
    # gradient took 1.4x as long. Such a read stays a loop over the batch.
    def loss(s, a, rows, vs):
        def step(b, rv):
            r, v = rv
            b = b.insert(0, jnp.full((32,), v), mode="promise_in_bounds")
            b, w = b.read((r, jnp.int32(0)), (4, 32), mode="promise_in_bounds")
            return b, (w * jnp.sin(w)).sum()

        b, ys = lax.scan(step, esb.ShiftBuffer(a * s, axis=0), (rows, vs * s))
        return ys.sum() + b.array.sum()

    a = jnp.zeros((1024, 32), jnp.float32)
    rows = jnp.arange(4 * 6, dtype=jnp.int32).reshape(4, 6) * 37
    vs = jnp.ones((4, 6), jnp.float32)
    fn = jax.vmap(jax.grad(loss), in_axes=(None, None, 0, 0))
    for body, lines in loop_bodies(fn, jnp.float32(0.5), a, rows, vs).items():
        split = [ln for ln in lines if "gather" in ln and "dimension_partitions" in ln]
        assert split == [], f"{body}: {split}"


# Rows whose accesses, under `vmap`, have indices the whole batch shares (Python
# ints; taps at static offsets from a ring's head, which the batch shares when
# its steps move every head alike): each is one access of a window across the
# batch (`_primitives._across_the_batch`), written the way plain `lax` writes it.
_SHARED_INDICES = ["pyint", "delay_taps", "taps_remat", "block_write", "front_stack"]


# (`jvp(vmap)` returns the forward values too.)
@pytest.mark.parametrize("mode", ["vmap(grad)", "jvp(vmap)"])
@pytest.mark.parametrize("row", _SHARED_INDICES)
def test_accesses_at_indices_the_batch_shares_match_plain_lax(row, mode):
    r = natural.ROWS_BY_NAME[row]
    args = natural.args_for(r, mode, 20)
    lib = natural.program(mode, natural.make_loss(r, corpus.ESB), r.batch_init)
    plain = natural.program(mode, natural.make_loss(r, natural.PLAIN), r.batch_init)
    got, want = jax.jit(lib)(*args), ref.jit_reference(plain)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("row", ["delay_taps", "taps_remat"])
def test_a_batch_of_delay_lines_reads_each_tap_across_the_batch(row):
    # Eleven taps at static offsets from the head the batch shares: each one
    # `dynamic_slice` of every element's row, fused into its consumer, as plain
    # `lax` reads them. Read per element, each tap was a loop over the batch:
    # eleven loops a step beside the scan's (forward 2.6x slower).
    r = natural.ROWS_BY_NAME[row]
    args = natural.args_for(r, "vmap", 50)
    lib = jax.vmap(natural.make_loss(r, corpus.ESB_PROMISE), in_axes=(None, None, 0))
    plain = jax.vmap(natural.make_loss(r, natural.PLAIN), in_axes=(None, None, 0))
    (lib_kernels,) = loop_kernels(lib, *args)  # one loop: none over the batch
    (plain_kernels,) = loop_kernels(plain, *args)
    assert lib_kernels <= plain_kernels


@pytest.mark.parametrize("name", [b.name for b in corpus.BODIES])
def test_a_batch_of_corpus_steps_copies_nothing(name):
    # The forward pass alone under `vmap` (`vmap(grad)` is in `test_corpus.py`). A
    # batch of windows read as one deferred gather, of a reshape of the storage,
    # made `mixed` copy its batch of buffers every step: the next edit did not find
    # the read, so did not wait for it (`_primitives`' module docstring).
    body = corpus.BODIES_BY_NAME[name]
    p, init, xs = corpus.make_inputs(body, 64, 128, 8)
    fn = jax.vmap(corpus.make_loss(body, corpus.ESB), in_axes=(None, None, 0))
    args = (p, init, corpus.batch_xs(xs, 3))
    copies = esb.find_loop_copies(fn, *args, min_bytes=init.nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize("shape, axis", [((4096,), 0), ((1, 4096), 1)])
def test_a_batch_of_reads_at_a_python_int_then_an_insert_copies_nothing(shape, axis):
    # A window near the back of a one-line buffer, read from the buffer an insert
    # then edits, both at Python ints: JAX adds the buffer's two cotangents. With
    # the read's cotangent accumulated as one window across the batch (as the read
    # is), that sum was not folded into the accumulation and XLA copied the batch
    # of buffers every step (`copy_sweep.py`'s `ds_ins`, `pyneg`): accumulations
    # stay one per example.
    n = shape[axis]
    lead = (0,) * axis

    def loss(s, a, xs):
        def step(b, v):
            w = b.dynamic_slice(lead + (n - 16,), (1,) * axis + (16,))
            return b.insert(lead + (n - 2,), v * s), (w * v).sum()

        b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=axis), xs)
        return (b.array**2).sum() + ys.sum()

    a = jnp.ones(shape, jnp.float32)
    xs = jnp.linspace(0.1, 1, 3 * 12, dtype=jnp.float32).reshape(3, 12)
    fn = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, None, 0))
    copies = esb.find_loop_copies(fn, jnp.float32(0.5), a, xs, min_bytes=a.nbytes)
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_a_batch_of_narrow_overwrites_at_a_python_int_then_a_read_copies_nothing(
    dtype,
):
    # A bfloat16 or float8 buffer is written as bits (`carrier`): overwritten as one
    # window across the batch, then read, it copied the batch of buffers every
    # step (1 under `vmap`, 2 under `jvp(vmap)`), so it keeps one access per
    # element (`_primitives._same_window_of_each_element`).
    def loss(s, a, xs):
        def step(b, v):
            b = b.dynamic_update_slice(jnp.full((1, 16), v * s, dtype), (1, 3))
            w = b.dynamic_slice((1, 3), (1, 16)).astype(jnp.float32)
            return b, (w * v).sum()

        b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=1), xs)
        return (b.array.astype(jnp.float32) ** 2).sum() + ys.sum()

    a = jnp.ones((2, 4096), dtype)
    xs = jnp.linspace(0.1, 1, 3 * 12, dtype=jnp.float32).reshape(3, 12)
    vl = jax.vmap(loss, in_axes=(None, None, 0))
    jvp = lambda s, a, xs: jax.jvp(lambda s: vl(s, a, xs), (s,), (s,))
    for fn in (vl, jvp):
        copies = esb.find_loop_copies(fn, jnp.float32(0.5), a, xs, min_bytes=a.nbytes)
        assert copies == [], "\n".join(map(str, copies))


# Bodies whose batched window read (one window of each example's buffer, at its
# own start) an edit of the buffer follows in the step.
_READ_THEN_EDIT = ["slice_matmul_write", "mixed"]


@pytest.mark.parametrize("name", _READ_THEN_EDIT)
def test_a_batch_of_window_reads_an_edit_follows_is_one_gather(name):
    # Read in a loop over the batch, the windows cost 8 kernels of the loop's
    # set-up a step more than plain `lax`'s gather (`slice_matmul_write`'s forward
    # 1.3x plain `lax`'s under `vmap`); the edit after them makes them one gather
    # (`_xla.deferred_loop_read`), and the step has no loop over the batch.
    body = corpus.BODIES_BY_NAME[name]
    p, init, xs = corpus.make_inputs(body, 100, 64, 50)
    args = (p, init, corpus.batch_xs(xs, 4))
    lib = jax.vmap(corpus.make_loss(body, corpus.ESB_PROMISE), in_axes=(None, None, 0))
    assert len(loop_kernels(lib, *args)) == 1  # the scan's: none over the batch


@pytest.mark.parametrize("ops", ["checked", "promise_in_bounds"])
@pytest.mark.parametrize("name", _READ_THEN_EDIT)
def test_a_batch_of_window_reads_an_edit_follows_match_plain_lax(name, ops):
    body = corpus.BODIES_BY_NAME[name]
    p, init, xs = corpus.make_inputs(body, 16, 24, 6)
    xs = corpus.batch_xs(xs, 3)
    lib_ops = corpus.ESB if ops == "checked" else corpus.ESB_PROMISE
    lib = jax.jit(jax.vmap(corpus.make_loss(body, lib_ops), in_axes=(None, None, 0)))
    plain = jax.vmap(corpus.make_loss(body, corpus.PLAIN), in_axes=(None, None, 0))
    np.testing.assert_array_equal(lib(p, init, xs), plain(p, init, xs))


def _taps_then_push(lib: bool):
    """A causal convolution's step: taps of a delay line read with
    `dynamic_slice` (values only, as users write it), then the new frame pushed
    with `insert(0, x)`."""
    k, d, taps = 256, 8, (1, 4, 16)

    def loss(w, xs):
        def step(b, x):
            h = jnp.zeros(d)
            for i, t in enumerate(taps):
                tap = b.dynamic_slice((t, 0), (1, d))[0] if lib else b[t]
                h = h + w[i] @ tap
            f = jnp.tanh(x + h)
            b = b.insert(0, f) if lib else jnp.concatenate([f[None], b[:-1]])
            return b, (f**2).sum()

        init = esb.ShiftBuffer.zeros((k, d), axis=0) if lib else jnp.zeros((k, d))
        return lax.scan(step, init, xs)[1].sum()

    w = 0.1 * jnp.cos(jnp.arange(len(taps) * d * d, dtype=jnp.float32))
    w = w.reshape(len(taps), d, d)
    xs = jnp.sin(jnp.arange(3 * 20 * d, dtype=jnp.float32)).reshape(3, 20, d)
    return jax.vmap(jax.grad(loss), in_axes=(None, 0)), (w, xs), k * d * 4


def test_a_batch_of_taps_read_with_dynamic_slice_before_a_push_copies_nothing():
    # Each tap's cotangent is its window accumulated onto zeros (its buffer was
    # dropped), which JAX adds to the buffer's; accumulated in a loop over the
    # batch, that sum was written out of place: a copy of the batch of delay
    # lines every step, 2.3-2.7x plain `lax`'s time at 4096 frames. Now one
    # scatter-add onto zeros, which XLA folds into the sum in place.
    fn, args, nbytes = _taps_then_push(lib=True)
    copies = esb.find_loop_copies(fn, *args, min_bytes=nbytes)
    assert copies == [], "\n".join(map(str, copies))


def test_a_batch_of_taps_read_with_dynamic_slice_before_a_push_match_plain_lax():
    lib, args, _ = _taps_then_push(lib=True)
    plain, _, _ = _taps_then_push(lib=False)
    np.testing.assert_allclose(jax.jit(lib)(*args), plain(*args), rtol=1e-5, atol=1e-6)


def _ring_batch_step(op: str):
    """A step of a buffer of one line (a ring): an edit at a traced position, or
    a read of a window of 5 at one for `op == "read"`, after a push at the front
    (a Python int: the ring's head moves, so that lines and windows wrap round
    the end of the storage)."""

    def step(b, x):
        r, q, v = x
        b = b.insert(0, jnp.cos(v))
        y = v
        if op == "insert":
            b = b.insert(r, v)
        elif op == "delete":
            b = b.delete(r)
        elif op == "pop":
            b, y = b.pop(r)
        else:
            b, w = b.read((q,), (5,))
            y = w.sum()
        return b, v * y

    return step


def _ring_batch(op: str, n: int, length: int):
    rng = np.random.default_rng(5)
    a = jnp.asarray(rng.normal(size=(n, length)), jnp.float32)
    xs = (
        jnp.asarray(rng.integers(0, length, (n, 9)), jnp.int32),
        jnp.asarray(rng.integers(0, length - 5, (n, 9)), jnp.int32),
        jnp.asarray(rng.normal(size=(n, 9)), jnp.float32),
    )

    def run(a, xs):
        b, ys = lax.scan(_ring_batch_step(op), esb.ShiftBuffer(a, axis=0), xs)
        return b.array, ys

    return run, a, xs


@pytest.mark.parametrize("op", ["insert", "delete", "pop", "read"])
def test_a_batch_of_short_rings_is_edited_and_read_with_no_loop_over_the_batch(op):
    # A batch of short buffers of one line each (rings), shifted at traced
    # positions, is one `select` over the batch (`_primitives._shift_each_line`),
    # and a window of each read at its own start one gather: a loop over the
    # batch, each trip one shift or read, took 1.6-2.8x plain `lax`'s forward
    # (a text buffer of 1024 characters, batches of 3 to 16). In place, and
    # exact, the head moving every step and the windows wrapping.
    run, a, xs = _ring_batch(op, 8, 256)
    fn = jax.vmap(run)
    assert len(loop_bodies(fn, a, xs)) == 1  # the scan's
    assert esb.find_loop_copies(fn, a, xs, min_bytes=a.nbytes // 2) == []
    got = jax.jit(fn)(a, xs)
    for k in range(a.shape[0]):
        want = jax.jit(run)(a[k], tuple(x[k] for x in xs))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g[k], w)


@pytest.mark.parametrize("op", ["insert", "delete", "pop", "read"])
def test_a_batch_of_short_rings_under_vmap_of_grad_matches_each_example(op):
    run, a, (r, q, v) = _ring_batch(op, 8, 256)

    def loss(a, v, r, q):
        final, ys = run(a, (r, q, v))
        return (final**2).sum() + ys.sum()

    fn = jax.vmap(jax.grad(loss, argnums=(0, 1)))
    assert esb.find_loop_copies(fn, a, v, r, q, min_bytes=a.nbytes // 2) == []
    got = jax.jit(fn)(a, v, r, q)
    each = jax.jit(jax.grad(loss, argnums=(0, 1)))  # (compiled once, not per example)
    for k in range(a.shape[0]):
        want = each(a[k], v[k], r[k], q[k])
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g[k], w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_batch_of_short_rings_read_then_shifted_under_vmap_of_grad_copy_nothing(
    dtype,
):
    # A window at a Python int (one access across the batch), then a delete at
    # each example's own position: as one select over a batch of bfloat16 rings
    # (moved as bits), the shift was copied every step under `vmap(grad)`,
    # before its cotangent's accumulation; bfloat16 keeps the loop over the batch.
    def loss(a, cols):
        def step(b, c):
            b, w = b.read((0,), (49,))
            return b.delete((c,)), w

        b, ws = lax.scan(step, esb.ShiftBuffer.from_array(a, axis=0), cols)
        return (b.array.astype(jnp.float32) ** 2).sum() + ws.astype(jnp.float32).sum()

    a = jnp.ones((2, 100), dtype)
    cols = jnp.full((2, 2), 3, jnp.int32)
    fn = jax.vmap(jax.grad(loss))
    assert esb.find_loop_copies(fn, a, cols, min_bytes=a.nbytes // 2) == []


def _one_edit_loss(edit: str):
    def loss(a, idx, xs):
        def step(b, inp):
            i, x = inp
            y = jnp.zeros((), jnp.float32)
            if edit == "pop":
                b, v = b.pop(i)
                y = v.astype(jnp.float32)
            elif edit == "insert":
                b = b.insert(i, x)
            elif edit == "ends":  # at the end of the only line, its row traced
                n = a.shape[-1] - 1
                b = b.delete((i * 0, n))
                b, v = b.pop((0, np.int64(n)), mode="promise_in_bounds")
                y = v.astype(jnp.float32)
            else:  # a delete at the front of the only line, at Python ints
                b = b.delete((0, 0))
            return b, y

        axis = a.ndim - 1
        b, ys = lax.scan(step, esb.ShiftBuffer.from_array(a, axis=axis), (idx, xs))
        return (b.array.astype(jnp.float32) ** 2).sum() + ys.sum()

    return loss


# Cases the fuzzer found (each copied the buffer every step with a batch of one,
# and none with a batch of two).
_BATCH_OF_ONE = [
    ((31,), jnp.float32, "pop", "vmap"),
    ((46,), jnp.bool_, "pop", "vmap"),
    ((21,), jnp.float32, "insert", "vmap(grad)"),
    ((1, 1805), jnp.bfloat16, "delete", "vmap"),
    # Found by the next fuzzer run, after a batch of one's window was first
    # written by indexing the batch's only element (2 copies a step).
    ((1, 1633), jnp.float32, "ends", "vmap"),
]


@pytest.mark.parametrize("shape, dtype, edit, mode", _BATCH_OF_ONE)
def test_a_batch_of_one_buffer_is_edited_in_place(shape, dtype, edit, mode):
    # XLA simplifies a gather or scatter of one window into a dynamic slice or
    # update: a pop's removed element, read as such, was recomputed after the
    # shift, and a bfloat16 ring's fill, written through a bounds check that
    # reads the storage, was not written in place (`_primitives._reduced_read`,
    # `_scattered`).
    loss = _one_edit_loss(edit)
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.normal(size=(1,) + shape) > 0).astype(dtype)
    idx = jnp.asarray(rng.integers(0, shape[-1] - 1, (1, 5)), jnp.int32)
    xs = jnp.asarray(rng.normal(size=(1, 5)) > 0).astype(dtype)
    fn = jax.vmap(loss) if mode == "vmap" else jax.vmap(jax.grad(loss))
    assert esb.find_loop_copies(fn, a, idx, xs, min_bytes=max(1, a.nbytes // 2)) == []
    got = jax.jit(fn)(a, idx, xs)
    want = (loss if mode == "vmap" else jax.grad(loss))(a[0], idx[0], xs[0])
    np.testing.assert_array_equal(got[0], want)


def _shared_windows_loss(lib: bool):
    # Reads only, of one buffer the batch shares: each example's windows are
    # at its own starts, and the (2, 4) window at the same place in all.
    def loss(p, a0, cols, rows):
        def step(b, x):
            c, r = x
            z = c * 0  # a traced zero
            if lib:
                b, w1 = b.read((z, 5), (2, 4))
                b, w2 = b.read((r, z), (1, 16))
            else:
                w1 = lax.dynamic_slice(b, (z, z + 5), (2, 4))
                w2 = lax.dynamic_slice(b, (r, z), (1, 16))
            return b, (
                w1.astype(jnp.float32).sum() + (w2.astype(jnp.float32) ** 2).sum()
            )

        b0 = esb.ShiftBuffer.from_array(a0, axis=1) if lib else a0
        _, ys = lax.scan(step, b0, (cols, rows))
        return p * ys.sum()

    return lambda p, a0, cols, rows: jax.grad(
        lambda p, a0: jax.vmap(loss, in_axes=(0, None, 0, 0))(p, a0, cols, rows).sum(),
        argnums=1,
    )(p, a0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_overlapping_windows_a_batch_reads_of_a_shared_buffer_add_their_cotangents(
    dtype,
):
    # The transpose is a batch of windows added into one cotangent, in a loop;
    # each old window was read before the loop, so where two examples' windows
    # overlap the later sum overwrote the earlier (a gradient wrong by 27 in the
    # fuzzer's case). Both examples here read the (2, 4) window at (0, 5).
    rng = np.random.default_rng(9)
    args = (
        jnp.asarray([1.0, 0.5, -2.0]),
        jnp.asarray(rng.normal(size=(2, 16)), dtype),
        jnp.asarray(rng.integers(0, 16, (3, 5)), jnp.int32),
        jnp.asarray(rng.integers(0, 2, (3, 5)), jnp.int32),
    )
    got = jax.jit(_shared_windows_loss(True))(*args)
    want = jax.jit(_shared_windows_loss(False))(*args)
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol
    )


def _whole_read_then_overwrite(lib: bool, shape, how: str = "read"):
    """A step that reads each element's whole buffer (`buf.read()` or
    `buf.array`), then overwrites all of it with a function of what it read, under
    `lax.scan`."""

    def step(buf, x):
        if lib and how == "read":
            buf, w = buf.read()
        elif lib:
            w = buf.array
        else:
            w = buf
        upd = jnp.sin(w) * x
        start = (0,) * len(shape)
        if lib:
            return buf.dynamic_update_slice(upd, start), (w * x).sum()
        return lax.dynamic_update_slice(buf, upd, start), (w * x).sum()

    def loss(p, a, xs):
        b = esb.ShiftBuffer.from_array(a, axis=0) if lib else a
        b, ys = lax.scan(lambda b, x: step(b, x * p), b, xs)
        return ys.sum() + ((b.array if lib else b) ** 2).sum()

    return jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, None, 0))


WHOLE_SHAPES = [(256,), (1, 256), (4, 64)]


def _whole_args(shape):
    n = int(np.prod(shape))
    a = jnp.asarray(np.linspace(-1, 1, n, dtype=np.float32).reshape(shape))
    xs = jnp.asarray(np.linspace(0.1, 0.3, 2 * 6 * n, dtype=np.float32))
    return jnp.float32(1.1), a, xs.reshape((2, 6) + shape)


@pytest.mark.parametrize("how", ["read", "array"])
@pytest.mark.parametrize("shape", WHOLE_SHAPES, ids=str)
def test_a_whole_read_of_a_batch_of_buffers_adds_its_cotangent_without_a_copy(
    shape, how
):
    """The buffer batched by its first overwrite, the read not: each element's
    whole cotangent is one add over the batch (`_accum_batch`), or, `.array`'s
    (whose buffer is dropped), the batch of windows itself
    (`_windows_onto_zeros`). An add per element in a loop over the batch, or a
    scatter-add into a batch of zeros, copied the batch of cotangents every step
    (3 against plain `lax`'s 2 for `(1, 256)`, 2 against 2 for the others)."""
    args = _whole_args(shape)
    min_bytes = 2 * int(np.prod(shape)) * 4 // 2
    lib = esb.find_loop_copies(
        _whole_read_then_overwrite(True, shape, how), *args, min_bytes=min_bytes
    )
    plain = esb.find_loop_copies(
        _whole_read_then_overwrite(False, shape), *args, min_bytes=min_bytes
    )
    # Both copy for the whole overwrite (which reads what it overwrites) and,
    # depending on the shape, for the add of the step's two cotangents; none for
    # the read's (no loop over the batch).
    assert len(lib) <= len(plain), (lib, plain)
    in_step = ("/body/closed_call/while", "/body/closed_call/scatter-add")
    accumulations = [c for c in lib if c.op_name.endswith(in_step)]
    assert accumulations == [], accumulations


@pytest.mark.parametrize("how", ["read", "array"])
@pytest.mark.parametrize("shape", WHOLE_SHAPES, ids=str)
def test_a_whole_read_of_a_batch_of_buffers_has_plain_lax_gradients(shape, how):
    args = _whole_args(shape)
    got = jax.jit(_whole_read_then_overwrite(True, shape, how))(*args)
    want = ref.jit_reference(_whole_read_then_overwrite(False, shape))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-5)

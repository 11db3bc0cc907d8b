"""The patterns users write without thinking about XLA: the corpus's second part.

Each row is a step body written the way a user writes it (Python-int and NumPy-int
indices, a delay line, one line, a 1-D buffer, a whole-buffer read, a `lax.cond`, a
checkpointed `esb.scan`, a batch of buffers), against the corpus's `Ops` (`corpus.ESB`
and `corpus.PLAIN`, the latter accepting the same index styles). The loss is the
corpus's (`corpus.make_loss`). `tests/test_natural_patterns.py` checks them;
`benchmarks/patterns.py` counts their copies under every mode and times them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import eqx_shiftbuf as esb

from . import corpus


BATCH = 4  # vmap modes: sequences of inputs
MODES = ("fwd", "grad", "jvp", "vmap(grad)", "jvp(vmap)")


# ---------------------------------------------------------------------------
# Plain `lax`, accepting the index styles users write (Python and NumPy ints, a bare
# scalar for axis 0), as `corpus.PLAIN` after converting them.


def _plain_index(index):
    if not isinstance(index, (tuple, list)):
        index = (index,)
    return tuple(jnp.asarray(i, jnp.int32) for i in index)


PLAIN = dataclasses.replace(
    corpus.PLAIN,
    insert=lambda b, i, v: corpus.PLAIN.insert(b, _plain_index(i), v),
    delete=lambda b, i: corpus.PLAIN.delete(b, _plain_index(i)),
    pop=lambda b, i: corpus.PLAIN.pop(b, _plain_index(i)),
)
ESB = corpus.ESB


def _dynamic_slice(ops, b, starts, sizes):
    """`dynamic_slice` that returns only the window (not the carry), as users write it."""
    if ops is PLAIN:
        return lax.dynamic_slice(b.array, starts, sizes)
    return b.dynamic_slice(starts, sizes)


# ---------------------------------------------------------------------------
# Step bodies: `step(ops, buf, x, p) -> (buf, y)`, `x` one step's inputs ("r", "c":
# 2 rows and 2 columns, "v": a float, "t": the step), `p` the parameters.


def _zero():
    return jnp.zeros((), jnp.float32)


def _insert_pop(r0, c0, r1, c1):
    """Insert `sin(s v)` at (r0, c0), pop (r1, c1), return the popped value * s."""

    def step(ops, b, x, p):
        ri = lambda r: r(x) if callable(r) else r
        b = ops.insert(b, (ri(r0), ri(c0)), jnp.sin(p["s"] * x["v"]))
        b, removed = ops.pop(b, (ri(r1), ri(c1)))
        return b, removed * p["s"]

    return step


def _insert_pop_1d(ops, b, x, p):
    b = ops.insert(b, x["c"][0], jnp.sin(p["s"] * x["v"]))
    b, removed = ops.pop(b, x["c"][1])
    return b, removed * p["s"]


def _insert_delete_1d(ops, b, x, p):
    """Two shifts with nothing read between them: an insert, then a delete."""
    b = ops.insert(b, x["c"][0], jnp.sin(p["s"] * x["v"]))
    b = ops.delete(b, x["c"][1])
    return b, p["s"] * x["v"]


def _text(ops, b, x, p):
    """A line of text (1-D, 1024): a character typed at the cursor, one deleted
    elsewhere, and the 4 characters at the cursor read. Under `vmap` (4 lines,
    4096 elements) the shifts are one `select` over the batch and the read one
    gather (`_primitives._shift_each_line`, `GATHER_RING_WINDOWS_UP_TO`)."""
    (n,) = ops.shape(b)
    b = ops.insert(b, x["c"][0], jnp.sin(p["s"] * x["v"]))
    b = ops.delete(b, x["c"][1])
    b, w = ops.read(b, (jnp.minimum(x["c"][0], n - 4),), (4,))
    return b, (w * p["s"]).sum()


def _frame(p, x, d):
    return jnp.tanh(p["s"] * x["v"] + jnp.arange(d, dtype=jnp.float32))


def _delay_whole(ops, b, x, p):
    k, d = ops.shape(b)
    b = ops.insert(b, 0, _frame(p, x, d))
    b, w = ops.read(b, (0, 0), (k, d))
    return b, (w * p["s"]).sum()


def _delay_read_first(ops, b, x, p):
    """`_delay_whole` in the other order: the whole window read, then the insert
    that moves the ring's head (the rotated read must be written out before it)."""
    k, d = ops.shape(b)
    b, w = ops.read(b, (0, 0), (k, d))
    b = ops.insert(b, 0, _frame(p, x, d))
    return b, (w * p["s"]).sum()


def _delay_fir(ops, b, x, p):
    """A delay line read whole and weighted along the line (an FIR filter): unlike
    `_delay_whole`'s scalar weight, the window's cotangent differs from frame to
    frame, so that a ring's rotation matters in the gradient."""
    shape = ops.shape(b)
    frame = _frame(p, x, math.prod(shape[1:])).reshape(shape[1:])
    b = ops.insert(b, 0, frame)
    b, w = ops.read(b, (0,) * len(shape), shape)
    taps = jnp.cos(0.01 * jnp.arange(math.prod(shape), dtype=jnp.float32))
    return b, (w * taps.reshape(shape) * p["s"]).sum()


TAPS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # 11 dilated taps


def _delay_taps(ops, b, x, p):
    k, d = ops.shape(b)
    b = ops.insert(b, 0, _frame(p, x, d))
    y = _zero()
    for t in TAPS:
        b, w = ops.read(b, (min(t, k - 1), 0), (1, d))
        y = y + jnp.tanh(p["s"] * w).sum()
    return b, y


def _ring_taps(ops, b, x, p):
    """`_delay_taps` in a ring: frame `t` is written at row `t % K` (O(frame), where
    `insert(0, x)` shifts the whole buffer), and tap `k` reads row `(t - k) % K`."""
    k, d = ops.shape(b)
    t = x["t"]
    b = ops.dynamic_update_slice(b, _frame(p, x, d)[None], (t % k, jnp.int32(0)))
    y = _zero()
    for tap in TAPS:
        b, w = ops.read(b, ((t - min(tap, k - 1)) % k, jnp.int32(0)), (1, d))
        y = y + jnp.tanh(p["s"] * w).sum()
    return b, y


def _whole_ds(how, first=False):
    """A traced insert, then a read of the whole buffer and its sum (`first`: the
    read and its sum, then the insert)."""

    def step(ops, b, x, p):
        n, m = ops.shape(b)
        insert = lambda b: ops.insert(
            b, (x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"])
        )
        b = b if first else insert(b)
        if how == "dynamic_slice":
            w = _dynamic_slice(ops, b, (0, 0), (n, m))
        elif how == "read":
            b, w = ops.read(b, (0, 0), (n, m))
        else:  # ".array"
            b, w = ops.read(b)
        y = (w * p["s"]).sum()
        b = insert(b) if first else b
        return b, y

    return step


def _history(ops, b, x, p):
    """A traced insert, and the buffer as it was before it output every step (a
    recorded history: `return buf.insert(...), buf.array`)."""
    new = ops.insert(b, (x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"]))
    _, w = ops.read(b)
    return new, w


def _array_slice(ops, b, x, p):
    """An insert, then a static slice of `buf.array` (the contents, not `read`)."""
    b = ops.insert(b, (x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"]))
    return b, (b.array[:8, :16] * p["s"]).sum()


def _array_dslice(ops, b, x, p):
    """An insert, then a row of `buf.array` at a traced index, `[r, :16]` (a
    `dynamic_slice` of the contents)."""
    b = ops.insert(b, (x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"]))
    return b, (b.array[x["r"][1], :16] * p["s"]).sum()


def _array_then_insert(ops, b, x, p):
    """A static slice of `buf.array` summed, then an insert of a value that does not
    depend on it: nothing but the library orders the sum before the insert."""
    y = b.array[:2, :8].sum()
    b = ops.insert(b, (x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"]))
    return b, y * p["s"]


def _array_row_first(ops, b, x, p):
    """A row of `buf.array` at a traced index, `[r, :16]`, then a traced insert; the
    row is used after the insert (under `vmap`, a batch of rows: a gather)."""
    w = b.array[x["r"][1], :16]
    b = ops.insert(b, (x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"]))
    return b, (w * p["s"]).sum()


def _array_row_sum_first(ops, b, x, p):
    """`_array_then_insert` with a row at a traced index: `buf.array[r, :16]`
    summed, then a traced insert."""
    y = (b.array[x["r"][1], :16] * p["s"]).sum()
    b = ops.insert(b, (x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"]))
    return b, y


def _array_window_first(ops, b, x, p):
    """`lax.dynamic_slice` of `buf.array` at Python-int starts, then a traced
    insert; the window is used after the insert (under `vmap`, a gather of one
    window of the batch of buffers)."""
    w = lax.dynamic_slice(b.array, (3, 0), (1, 16))
    b = ops.insert(b, (x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"]))
    return b, (w * p["s"]).sum()


def _array_block_first(ops, b, x, p):
    """A static block of `buf.array`, `[:8, :16]`, then a traced insert; the block
    is used after the insert."""
    w = b.array[:8, :16]
    b = ops.insert(b, (x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"]))
    return b, (w * p["s"]).sum()


def _ring_array_first(ops, b, x, p):
    """1-D: `buf.array[:8]` summed, then a traced insert. The buffer is a ring made
    inside the program, whose head XLA finds constant 0, so its rotation is
    dropped and the sum reads the storage."""
    y = (b.array[:8] * p["s"]).sum()
    b = ops.insert(b, x["c"][0], jnp.sin(p["s"] * x["v"]))
    return b, y


def _line_read_first(ops, b, x, p):
    """1-D (4096,): the whole line read and weighted along it, then a traced
    insert (a sorted list, a priority line). Only middle inserts edit it, so the
    ring it is stored as has a head XLA finds constant 0; under `grad` the window
    is saved as a residual."""
    b, w = ops.read(b)
    taps = jnp.cos(0.01 * jnp.arange(w.size, dtype=jnp.float32))
    y = (w * taps * p["s"]).sum()
    b = ops.insert(b, x["c"][0], jnp.sin(p["s"] * x["v"]))
    return b, y


def _array_ds_first(static):
    """3-D `(L0, n, D)` lines along axis 1: `lax.dynamic_slice(buf.array, ...)` of a
    `(1, 16, D)` window (at Python-int starts with `static`, else at traced ones),
    then an insert, the window used after it. Under `vmap(grad)` its cotangent is
    JAX's scatter of the batch of windows into zeros the size of the batch of
    buffers."""

    def step(ops, b, x, p):
        l0, n, d = ops.shape(b)
        if static:
            st = (3, 5, 0)
        else:
            st = (x["r"][1] % l0, x["c"][1] % (n - 15), 0)
        st = [jnp.asarray(k, jnp.int32) for k in st]
        w = lax.dynamic_slice(b.array, st, (1, 16, d))
        v = jnp.full((d,), jnp.sin(p["s"] * x["v"]))
        b = ops.insert(b, (x["r"][0] % l0, x["c"][0]), v)
        return b, (w * p["s"]).sum()

    return step


def _delay_array(ops, b, x, p):
    """A delay line's `insert(0, x)`, then its newest frames as `buf.array[:4]`,
    used linearly: under `vmap`, their cotangent is the same for every element."""
    k, d = ops.shape(b)
    b = ops.insert(b, 0, _frame(p, x, d))
    return b, (b.array[:4] * p["s"]).sum()


def _delay_array_row(ops, b, x, p):
    """A delay line's `insert(0, x)`, then a frame of `buf.array` at a traced
    index, `[r, :16]` (a dynamic slice of the rotated line)."""
    k, d = ops.shape(b)
    b = ops.insert(b, 0, _frame(p, x, d))
    return b, (b.array[x["c"][0], :16] * p["s"]).sum()


def _read_old(ops, b, x, p):
    """An insert, then a window of the buffer from *before* it (the `b` the insert
    was given), read after it in the program: `return b.insert(...), f(b...)`."""
    new = ops.insert(b, (x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"]))
    w = _dynamic_slice(ops, b, (x["r"][1], jnp.int32(0)), (1, 16))
    return new, (w * p["s"]).sum()


def _block_write(ops, b, x, p):
    """A ring `(K, D)`: overwrite a `(4, D)` block at a Python-int row, read
    another at a traced row."""
    k, d = ops.shape(b)
    blk = jnp.tanh(p["s"] * x["v"] + jnp.arange(4 * d, dtype=jnp.float32))
    b = ops.dynamic_update_slice(b, blk.reshape(4, d), (8, 0))
    b, w = ops.read(b, (x["c"][0] % (k - 3), jnp.int32(0)), (4, d))
    return b, (w * p["s"]).sum()


def _insert_pop_3d(ops, b, x, p):
    """Lines indexed by two dimensions `(L0, L1, n)`, shifted along the last."""
    l0 = ops.shape(b)[0]
    r, c = x["r"], x["c"]
    b = ops.insert(b, (r[0] % l0, r[1], c[0]), jnp.sin(p["s"] * x["v"]))
    b, removed = ops.pop(b, (r[1] % l0, r[0], c[1]))
    return b, removed * p["s"]


F = 8


def _stack(ops, b, x, p):
    # `b` is (stacks, capacity, F), shifted along axis 1: position 0 is the top.
    f = jnp.tanh(p["s"] * x["v"] + jnp.arange(F, dtype=jnp.float32))
    zero = jnp.zeros_like(x["c"][0])
    b = ops.insert(b, (x["r"][0], zero), f)
    b, top = ops.pop(b, (x["r"][1], zero))
    return b, (top * p["s"]).sum()


def _front_stack(ops, b, x, p):
    """One stack `(K, F)` shifted along axis 0, Python-int ends: push two frames at
    the top (0) and pop one, so the top drifts round a ring's storage."""
    f = jnp.tanh(p["s"] * x["v"] + jnp.arange(b_features(ops, b), dtype=jnp.float32))
    b = ops.insert(b, 0, f)
    b = ops.insert(b, 0, 2.0 * f)
    b, top = ops.pop(b, 0)
    return b, (top * p["s"]).sum()


def _queue(ops, b, x, p):
    """A FIFO queue `(K, F)`: push at the front (0), pop at the back (K - 1)."""
    k = ops.shape(b)[0]
    f = jnp.tanh(p["s"] * x["v"] + jnp.arange(b_features(ops, b), dtype=jnp.float32))
    b = ops.insert(b, 0, f)
    b, last = ops.pop(b, k - 1)
    return b, (last * p["s"]).sum()


def _ring_mix(ops, b, x, p):
    """Every kind of access on a line whose head moves: a push at the front, a pop
    at the back, a traced insert and pop in the middle, and a window read and
    write that may wrap round the end of a ring's storage."""
    k, d = ops.shape(b)
    f = jnp.sin(p["s"] * x["v"] + jnp.arange(d, dtype=jnp.float32))
    b = ops.insert(b, 0, f)
    b = ops.insert(b, (x["c"][0],), 0.5 * f)
    b, w = ops.read(b, (x["c"][1] % (k - 3), jnp.int32(0)), (4, d))
    b = ops.dynamic_update_slice(
        b, jnp.cos(w[::-1]), (x["c"][0] % (k - 3), jnp.int32(0))
    )
    b, last = ops.pop(b, k - 1)
    b, mid = ops.pop(b, (x["c"][1],))
    return b, (w * p["s"]).sum() + (last * mid).sum()


def b_features(ops, b):
    return ops.shape(b)[-1]


def _cond_stack(ops, b, x, p):
    f = jnp.tanh(p["s"] * x["v"] + jnp.arange(F, dtype=jnp.float32))
    zero = jnp.zeros_like(x["c"][0])

    def push(b):
        return ops.insert(b, (x["r"][0], zero), f), _zero()

    def pop(b):
        b, top = ops.pop(b, (x["r"][0], zero))
        return b, (top * p["s"]).sum()

    return lax.cond(x["v"] > 0.5, push, pop, b)


def _select_stack(ops, b, x, p):
    """`_cond_stack` without a `lax.cond` on the buffer: both edits every step, the
    one not chosen sent to a spare stack (the buffer's last), chosen by `where` on
    the stack index, and the output chosen by `where` on the value."""
    f = jnp.tanh(p["s"] * x["v"] + jnp.arange(F, dtype=jnp.float32))
    zero = jnp.zeros_like(x["c"][0])
    push = x["v"] > 0.5
    spare = ops.shape(b)[0] - 1
    r = x["r"][0]
    b = ops.insert(b, (jnp.where(push, r, spare), zero), f)
    b, top = ops.pop(b, (jnp.where(push, spare, r), zero))
    return b, jnp.where(push, _zero(), (top * p["s"]).sum())


def _checkpointed(f, init, xs):
    return esb.scan(f, init, xs, kind="checkpointed")


def _unrolled2(f, init, xs):
    return lax.scan(f, init, xs, unroll=2)


def _rematerialised(f, init, xs):
    return lax.scan(jax.checkpoint(f), init, xs)


# ---------------------------------------------------------------------------
# Rows.


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    what: str
    step: Callable
    shape: tuple[int, ...]
    axis: int
    rows: int  # range of "r"
    cols: int  # range of "c"
    scan: Callable = lax.scan  # the library's scan
    plain_scan: Callable = lax.scan  # plain `lax`'s (`esb.scan` takes no plain array)
    batch_init: bool = False  # vmap modes: a batch of initial buffers, not one


def _traced(k, i):
    return lambda x: x[k][i]


ROWS = (
    Row(
        "pyint",
        "insert((0, 0), v) then pop((0, 0)), Python ints, (100, 500)",
        _insert_pop(0, 0, 0, 0),
        (100, 500),
        1,
        100,
        500,
    ),
    Row(
        "npint",
        "same with NumPy int32 indices",
        _insert_pop(np.int32(0), np.int32(0), np.int32(0), np.int32(0)),
        (100, 500),
        1,
        100,
        500,
    ),
    Row(
        "traced0",
        "same with int32 zeros passed as data (control)",
        _insert_pop(*(lambda x: x["z"][0],) * 4),
        (100, 500),
        1,
        100,
        500,
    ),
    Row(
        "traced",
        "same at random traced (r, c) (the corpus style)",
        _insert_pop(_traced("r", 0), _traced("c", 0), _traced("r", 1), _traced("c", 1)),
        (100, 500),
        1,
        100,
        500,
    ),
    Row(
        "delay_whole",
        "delay line (1024, 32) axis=0, insert(0, x), read of the whole window",
        _delay_whole,
        (1024, 32),
        0,
        1,
        1024,
    ),
    Row(
        "delay_read_first",
        "delay line (1024, 32) axis=0, read of the whole window, then insert(0, x)",
        _delay_read_first,
        (1024, 32),
        0,
        1,
        1024,
    ),
    Row(
        "delay_fir",
        "delay line (1024, 32) axis=0, insert(0, x), the whole window weighted "
        "along the line (an FIR filter)",
        _delay_fir,
        (1024, 32),
        0,
        1,
        1024,
    ),
    Row(
        "delay_1d",
        "1-D delay line (4096,) (audio samples), insert(0, x), the whole window "
        "weighted along the line",
        _delay_fir,
        (4096,),
        0,
        1,
        4096,
    ),
    Row(
        "delay_taps",
        "delay line (1024, 32) axis=0, insert(0, x), 11 (1, 32) tap reads",
        _delay_taps,
        (1024, 32),
        0,
        1,
        1024,
    ),
    Row(
        "ring_taps",
        "the delay_taps step as a ring (1024, 32): write row t % K, taps read "
        "(t - k) % K (the O(frame) alternative to insert(0, x))",
        _ring_taps,
        (1024, 32),
        0,
        1,
        1024,
    ),
    Row(
        "one_line",
        "one line (1, 4096), traced insert + pop",
        _insert_pop(_traced("r", 0), _traced("c", 0), _traced("r", 1), _traced("c", 1)),
        (1, 4096),
        1,
        1,
        4096,
    ),
    Row(
        "one_d",
        "1-D (4096,), traced insert + pop",
        _insert_pop_1d,
        (4096,),
        0,
        1,
        4096,
    ),
    Row(
        "text",
        "1-D (1024,), traced insert + delete, then a read of 4 at the cursor",
        _text,
        (1024,),
        0,
        1,
        1024,
    ),
    Row(
        "one_d_del",
        "1-D (4096,), traced insert + delete (no read between the shifts)",
        _insert_delete_1d,
        (4096,),
        0,
        1,
        4096,
    ),
    Row(
        "two_lines",
        "two lines (2, 4096), traced insert + pop",
        _insert_pop(_traced("r", 0), _traced("c", 0), _traced("r", 1), _traced("c", 1)),
        (2, 4096),
        1,
        2,
        4096,
    ),
    Row(
        "whole_ds",
        "insert, then dynamic_slice((0, 0), (512, 64)) (the window only)",
        _whole_ds("dynamic_slice"),
        (512, 64),
        1,
        512,
        64,
    ),
    Row(
        "whole_read",
        "insert, then read((0, 0), (512, 64)) (buffer returned)",
        _whole_ds("read"),
        (512, 64),
        1,
        512,
        64,
    ),
    Row(
        "whole_read_first",
        "read((0, 0), (512, 64)) and its sum, then insert",
        _whole_ds("read", first=True),
        (512, 64),
        1,
        512,
        64,
    ),
    Row(
        "history",
        "insert, and read() (.array) of the buffer before it as the step's output",
        _history,
        (512, 64),
        1,
        512,
        64,
    ),
    Row(
        "whole_array",
        "insert, then read() (.array) (control)",
        _whole_ds("array"),
        (512, 64),
        1,
        512,
        64,
    ),
    Row(
        "array_slice",
        "(100, 500): traced insert, then a static slice of .array, [:8, :16]",
        _array_slice,
        (100, 500),
        1,
        100,
        500,
    ),
    Row(
        "array_dslice",
        "(100, 500): traced insert, then a row of .array at a traced index, [r, :16]",
        _array_dslice,
        (100, 500),
        1,
        100,
        500,
    ),
    Row(
        "array_then_insert",
        "(100, 500): .array[:2, :8].sum(), then a traced insert",
        _array_then_insert,
        (100, 500),
        1,
        100,
        500,
    ),
    Row(
        "array_row_first",
        "(100, 500): a row of .array at a traced index, [r, :16], then a traced "
        "insert, the row used after it",
        _array_row_first,
        (100, 500),
        1,
        100,
        500,
    ),
    Row(
        "array_row_sum_first",
        "(100, 500): a row of .array at a traced index, [r, :16], summed, then a "
        "traced insert",
        _array_row_sum_first,
        (100, 500),
        1,
        100,
        500,
    ),
    Row(
        "array_window_first",
        "(100, 500): lax.dynamic_slice(.array, (3, 0), (1, 16)), then a traced "
        "insert, the window used after it",
        _array_window_first,
        (100, 500),
        1,
        100,
        500,
    ),
    Row(
        "array_block_first",
        "(100, 500): .array[:8, :16], then a traced insert, the block used after it",
        _array_block_first,
        (100, 500),
        1,
        100,
        500,
    ),
    Row(
        "ring_array_first",
        "1-D (4096,): .array[:8] summed, then a traced insert",
        _ring_array_first,
        (4096,),
        0,
        1,
        4096,
    ),
    Row(
        "line_read_first",
        "1-D (4096,): read() weighted along the line, then a traced insert",
        _line_read_first,
        (4096,),
        0,
        1,
        4096,
    ),
    Row(
        "array_ds_first",
        "(16, 64, 32) axis=1: lax.dynamic_slice(.array) at traced starts, then an "
        "insert",
        _array_ds_first(False),
        (16, 64, 32),
        1,
        16,
        64,
    ),
    Row(
        "array_ds_pyint",
        "the same at Python-int starts",
        _array_ds_first(True),
        (16, 64, 32),
        1,
        16,
        64,
    ),
    Row(
        "delay_array",
        "delay line (1024, 32) axis=0, insert(0, x), then .array[:4]",
        _delay_array,
        (1024, 32),
        0,
        1,
        1024,
    ),
    Row(
        "delay_array_row",
        "delay line (1024, 32) axis=0, insert(0, x), then .array[r, :16]",
        _delay_array_row,
        (1024, 32),
        0,
        1,
        1024,
    ),
    Row(
        "read_old",
        "(100, 500): traced insert, then a (1, 16) window of the buffer from before "
        "it, read after it",
        _read_old,
        (100, 500),
        1,
        100,
        500,
    ),
    Row(
        "block_write",
        "ring (1024, 32) axis=0: dynamic_update_slice of a (4, 32) block at Python "
        "int (8, 0), read of a (4, 32) block at a traced row",
        _block_write,
        (1024, 32),
        0,
        1,
        1024,
    ),
    Row(
        "lines_3d",
        "(8, 32, 64) axis=2 (lines indexed by two dimensions), traced insert + pop",
        _insert_pop_3d,
        (8, 32, 64),
        2,
        32,
        64,
    ),
    Row(
        "stack",
        "stack (64, 64, 8) axis=1, push then pop at 0 (jvp(vmap) is the issue's row)",
        _stack,
        (64, 64, F),
        1,
        64,
        64,
    ),
    Row(
        "cond_stack",
        "stack (64, 64, 8), push or pop chosen by lax.cond",
        _cond_stack,
        (64, 64, F),
        1,
        64,
        64,
    ),
    Row(
        "select_stack",
        "the cond_stack step without lax.cond: both edits, the unchosen one on a "
        "spare stack (64 + 1, 64, 8)",
        _select_stack,
        (65, 64, F),
        1,
        64,
        64,
    ),
    Row(
        "front_stack",
        "one stack (512, 64) axis=0: push, push, pop at 0 (Python ints)",
        _front_stack,
        (512, 64),
        0,
        1,
        512,
    ),
    Row(
        "queue",
        "a queue (512, 64) axis=0: push at 0, pop at K - 1 (Python ints)",
        _queue,
        (512, 64),
        0,
        1,
        512,
    ),
    Row(
        "ring_mix",
        "(256, 64) axis=0: push at 0, traced insert, wrapping (4, 64) read and "
        "write, pop at K - 1, traced pop",
        _ring_mix,
        (256, 64),
        0,
        1,
        256,
    ),
    Row(
        "esb_scan",
        "traced insert + pop (100, 500) under checkpointed esb.scan",
        _insert_pop(_traced("r", 0), _traced("c", 0), _traced("r", 1), _traced("c", 1)),
        (100, 500),
        1,
        100,
        500,
        scan=_checkpointed,
    ),
)
ROWS_BY_NAME_0 = {r.name: r for r in ROWS}


def _under_checkpoint(of: str, name: str, what: str | None = None) -> Row:
    """The row `of` with its step under `jax.checkpoint`, in the library and in
    plain `lax`: `lax.scan(jax.checkpoint(step))`."""
    return dataclasses.replace(
        ROWS_BY_NAME_0[of],
        name=name,
        what=what or f"{of} under lax.scan(jax.checkpoint(step))",
        scan=_rematerialised,
        plain_scan=_rematerialised,
    )


ROWS += (
    dataclasses.replace(
        ROWS_BY_NAME_0["stack"],
        name="stack_b",
        what="the stack on a batch of buffers (vmap modes batch init and xs)",
        batch_init=True,
    ),
    dataclasses.replace(
        ROWS_BY_NAME_0["stack"],
        name="stack_scan",
        what="the stack under checkpointed esb.scan",
        scan=_checkpointed,
    ),
    dataclasses.replace(
        ROWS_BY_NAME_0["stack"],
        name="stack_scan_b",
        what="the stack under checkpointed esb.scan, a batch of buffers",
        scan=_checkpointed,
        batch_init=True,
    ),
    dataclasses.replace(
        ROWS_BY_NAME_0["front_stack"],
        name="front_stack_b",
        what="the front stack on a batch of buffers (vmap modes batch init and xs)",
        batch_init=True,
    ),
    dataclasses.replace(
        ROWS_BY_NAME_0["front_stack"],
        name="front_stack_scan",
        what="the front stack under checkpointed esb.scan",
        scan=_checkpointed,
    ),
    dataclasses.replace(
        ROWS_BY_NAME_0["delay_taps"],
        name="taps_unroll2",
        what="delay_taps under lax.scan(..., unroll=2): two steps a loop trip",
        scan=_unrolled2,
    ),
    _under_checkpoint(
        "traced",
        "traced_remat",
        "the traced row's step under jax.checkpoint: lax.scan(jax.checkpoint(step))",
    ),
    _under_checkpoint("whole_read_first", "first_remat"),
    _under_checkpoint("line_read_first", "line_first_remat"),
    _under_checkpoint("delay_taps", "taps_remat"),
)
ROWS_BY_NAME = {r.name: r for r in ROWS}


def inputs(row: Row, steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    xs = {
        "r": jnp.asarray(rng.integers(0, row.rows, (steps, 2)), jnp.int32),
        "c": jnp.asarray(rng.integers(0, row.cols, (steps, 2)), jnp.int32),
        "v": jnp.asarray(rng.random(steps), jnp.float32),
        "t": jnp.arange(steps, dtype=jnp.int32),
        "z": jnp.zeros((steps, 2), jnp.int32),  # zeros XLA cannot see are zeros
    }
    params = {"s": jnp.asarray(0.5, jnp.float32)}
    init = jnp.asarray(rng.random(row.shape), jnp.float32)
    return params, init, xs


def batched(xs, seed: int = 1):
    """`BATCH` different input sequences with the shapes of `xs` (as the corpus)."""
    out = corpus.batch_xs({k: v for k, v in xs.items() if k != "z"}, BATCH, seed)
    out["z"] = jnp.zeros((BATCH,) + xs["z"].shape, xs["z"].dtype)
    return out


def make_loss(row: Row, ops) -> Callable:
    body = corpus.Body(row.name, row.step, axis=row.axis)
    scan = row.plain_scan if ops is PLAIN else row.scan
    return corpus.make_loss(body, ops, scan=scan)


def program(mode: str, loss: Callable, batch_init: bool = False) -> Callable:
    """`loss` under `mode`, a function of `(params, init, xs)`; the `vmap` modes take
    batched `xs` (and a batch of `init`s with `batch_init`)."""
    axis = 0 if batch_init else None
    both = (0, 1)
    if mode == "fwd":
        return loss
    if mode == "grad":
        return jax.grad(loss, argnums=both)
    if mode == "jvp":
        return lambda p, a, xs: jax.jvp(lambda p, a: loss(p, a, xs), (p, a), (p, a))
    if mode == "vmap(grad)":
        return jax.vmap(jax.grad(loss, argnums=both), in_axes=(None, axis, 0))
    if mode == "jvp(vmap)":
        vl = jax.vmap(loss, in_axes=(None, axis, 0))
        return lambda p, a, xs: jax.jvp(lambda p, a: vl(p, a, xs), (p, a), (p, a))
    # Not in `MODES`: used by `benchmarks/experiments/copy_sweep.py`.
    if mode == "vmap":
        return jax.vmap(loss, in_axes=(None, axis, 0))
    if mode == "grad(vmap)":
        vl = jax.vmap(loss, in_axes=(None, axis, 0))
        return jax.grad(lambda p, a, xs: vl(p, a, xs).sum(), argnums=both)
    raise ValueError(mode)


def args_for(row: Row, mode: str, steps: int):
    p, init, xs = inputs(row, steps)
    if "vmap" in mode:
        xs = batched(xs)
        if row.batch_init:
            init = jnp.stack([init + k for k in range(BATCH)])
    return p, init, xs


def min_bytes(row: Row) -> int:
    return int(np.prod(row.shape)) * 4 // 2


def copies(row: Row, ops, mode: str, steps: int) -> list:
    fn = program(mode, make_loss(row, ops), row.batch_init)
    return esb.find_loop_copies(
        fn, *args_for(row, mode, steps), min_bytes=min_bytes(row)
    )

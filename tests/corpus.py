"""The in-place corpus: the scan step bodies every "in place" claim is checked on.

The design's list: insert; delete; pop returning the value; dynamic_update_slice
from parameters; read a slice, multiply by a parameter, write the result elsewhere;
insert then delete; two and three inserts; a stack of feature vectors with push and
pop; a cache written at a moving position and read by attention over the whole
cache; and a mixed step (insert, read, pop, insert a value built from both).

Each body is written once against a small set of buffer operations (`Ops`), with
two implementations: `ESB` (a `ShiftBuffer` carry and
this library's operations) and `PLAIN` (a plain array
carry and the natural `lax` code: whole-line `dynamic_slice`, `roll`/`where`,
`dynamic_update_slice`). The two give the same values and, under autodiff, the same
gradients; the tests check that, and count copies in both.

Every body edits rows and columns drawn at random for each step, so writes overlap
across steps: the same line is shifted, read and overwritten many times.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from eqx_shiftbuf import ShiftBuffer


K = 16  # window width of the slice bodies
F = 8  # feature size of the stack body


# ---------------------------------------------------------------------------
# The operations a body may use.


@dataclasses.dataclass(frozen=True)
class Ops:
    """The buffer operations of one implementation.

    `wrap(array, axis)` makes a carry from an array, `unwrap(carry)` returns its
    contents and `shape(carry)` their shape (a body that needs only the shape asks
    for it: reading a `ShiftBuffer`'s contents raises its recorded index errors,
    one check per call); `insert`, `delete`, `pop` and `dynamic_update_slice` have
    the semantics of the functions of the same name in `eqx_shiftbuf`, and `read`
    those of `eqx_shiftbuf.read` (`(carry, window)`, or `(carry, contents)` with no
    window): a body carries on with the carry a read returns, as it would with an
    `equinox.nn.State`.
    """

    name: str
    wrap: Callable[[Any, int], Any]
    unwrap: Callable[[Any], Any]
    insert: Callable[..., Any]
    delete: Callable[..., Any]
    pop: Callable[..., Any]
    read: Callable[..., Any]
    dynamic_update_slice: Callable[..., Any]
    shape: Callable[[Any], tuple[int, ...]] = lambda b: tuple(b.shape)


def _esb_ops(mode: str | None) -> Ops:
    return Ops(
        name="eqx_shiftbuf" if mode is None else f"eqx_shiftbuf ({mode})",
        wrap=lambda a, axis: ShiftBuffer.from_array(a, axis=axis),
        unwrap=lambda b: b.array,
        insert=lambda b, i, v: b.insert(i, v, mode=mode),
        delete=lambda b, i: b.delete(i, mode=mode),
        pop=lambda b, i: b.pop(i, mode=mode),
        read=lambda b, s=None, n=None: b.read(s, n, mode=mode),
        dynamic_update_slice=lambda b, u, s: b.dynamic_update_slice(u, s, mode=mode),
    )


ESB = _esb_ops(None)
"""This library: a `ShiftBuffer` carry, with run-time index checks."""

ESB_PROMISE = _esb_ops("promise_in_bounds")
"""This library without run-time index checks (`mode="promise_in_bounds"`)."""


class _Plain:
    """A plain array with its shift axis, for the plain `lax` implementation."""

    def __init__(self, array, axis):
        self.array, self.axis = array, axis

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)


jax.tree_util.register_pytree_node(
    _Plain, lambda b: ((b.array,), b.axis), lambda axis, c: _Plain(c[0], axis)
)


def _plain_line(b: _Plain, index):
    x, axis = b.array, b.axis
    *lead, col = index
    zero = jnp.zeros_like(col)
    start = list(lead) + [zero] * (x.ndim - axis)
    line = lax.dynamic_slice(x, start, (1,) * axis + x.shape[axis:])
    return start, line.reshape(x.shape[axis:]), col


def _plain_put(b: _Plain, start, line) -> _Plain:
    x, axis = b.array, b.axis
    line = line.astype(x.dtype).reshape((1,) * axis + x.shape[axis:])
    return _Plain(lax.dynamic_update_slice(x, line, start), axis)


def _plain_insert(b, index, value):
    start, line, col = _plain_line(b, index)
    pos = lax.broadcasted_iota(col.dtype, line.shape, 0)
    new = jnp.where(pos < col, line, jnp.where(pos == col, value, jnp.roll(line, 1, 0)))
    return _plain_put(b, start, new)


def _plain_pop(b, index):
    start, line, col = _plain_line(b, index)
    pos = lax.broadcasted_iota(col.dtype, line.shape, 0)
    last = line.shape[0] - 1
    removed = lax.dynamic_index_in_dim(line, col, 0, keepdims=False)
    new = jnp.where(pos < col, line, jnp.where(pos == last, 0, jnp.roll(line, -1, 0)))
    return _plain_put(b, start, new), removed


def _plain_read(b: _Plain, starts, sizes):
    if starts is None or sizes is None:
        return b.array
    return lax.dynamic_slice(b.array, starts, sizes)


PLAIN = Ops(
    name="plain lax",
    wrap=_Plain,
    unwrap=lambda b: b.array,
    insert=_plain_insert,
    delete=lambda b, i: _plain_pop(b, i)[0],
    pop=_plain_pop,
    read=lambda b, s=None, n=None: (b, _plain_read(b, s, n)),
    dynamic_update_slice=lambda b, u, s: _Plain(
        lax.dynamic_update_slice(b.array, u, s), b.axis
    ),
)
"""Plain `lax` ops on an array carry: what a user writes without this library."""


# ---------------------------------------------------------------------------
# The bodies. Each is `step(ops, buf, x, p) -> (buf, y)`, `x` one step's inputs:
# `x["r"]`, `x["c"]` (2 rows and 2 columns), `x["v"]` (a float), `x["t"]` (the step).


def _zero():
    return jnp.zeros((), jnp.float32)


def insert(ops, b, x, p):
    return ops.insert(b, (x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"])), _zero()


def delete(ops, b, x, p):
    return ops.delete(b, (x["r"][0], x["c"][0])), _zero()


def pop(ops, b, x, p):
    b, removed = ops.pop(b, (x["r"][0], x["c"][0]))
    return b, removed * p["s"]


def _window_col(b_cols, c):
    return c % (b_cols - K + 1)


def dynamic_update_slice(ops, b, x, p):
    cols = ops.shape(b)[1]
    upd = jnp.tanh(p["s"] * x["v"] + jnp.arange(K, dtype=jnp.float32))[None]
    start = (x["r"][0], _window_col(cols, x["c"][0]))
    return ops.dynamic_update_slice(b, upd.astype(p["s"].dtype), start), _zero()


def slice_matmul_write(ops, b, x, p):
    cols = ops.shape(b)[1]
    b, w = ops.read(b, (x["r"][0], _window_col(cols, x["c"][0])), (1, K))
    h = jnp.tanh(w @ p["W"])
    b = ops.dynamic_update_slice(b, h, (x["r"][1], _window_col(cols, x["c"][1])))
    return b, h.sum()


def insert_then_delete(ops, b, x, p):
    b = ops.insert(b, (x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"]))
    return ops.delete(b, (x["r"][1], x["c"][1])), _zero()


def two_inserts(ops, b, x, p):
    b = ops.insert(b, (x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"]))
    return ops.insert(b, (x["r"][1], x["c"][1]), jnp.cos(p["s"] * x["v"])), _zero()


def three_inserts(ops, b, x, p):
    b = ops.insert(b, (x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"]))
    b = ops.insert(b, (x["r"][1], x["c"][1]), jnp.cos(p["s"] * x["v"]))
    return ops.insert(b, (x["r"][0], x["c"][1]), p["s"] * x["v"]), _zero()


def stack_push_pop(ops, b, x, p):
    # `b` is (stacks, capacity, F), shifted along axis 1: position 0 is the top.
    f = jnp.tanh(p["s"] * x["v"] + jnp.arange(F, dtype=jnp.float32))
    b = ops.insert(b, (x["r"][0], jnp.zeros_like(x["c"][0])), f.astype(p["s"].dtype))
    b, top = ops.pop(b, (x["r"][1], jnp.zeros_like(x["c"][1])))
    return b, (top * p["s"]).sum()


def kv_cache_attention(ops, b, x, p):
    # `b` is a (length, d) cache; each step writes one entry at a moving position
    # (wrapping around, so entries are overwritten) and attends over the whole cache.
    length, d = ops.shape(b)
    pos = x["t"] % length
    ar = jnp.arange(d, dtype=p["s"].dtype)
    entry = jnp.tanh(p["s"] * x["v"] + ar)[None]
    b = ops.dynamic_update_slice(b, entry, (pos, jnp.zeros_like(pos)))
    b, cache = ops.read(b)
    q = jnp.cos(p["s"] * x["v"] - ar)
    weights = jax.nn.softmax(cache @ q / math.sqrt(d))
    return b, (weights @ cache).sum()


def mixed(ops, b, x, p):
    # Insert, read a window, compute, pop, insert a value built
    # from the read and the popped value.
    cols = ops.shape(b)[1]
    b = ops.insert(b, (x["r"][0], x["c"][0]), jnp.sin(p["s"] * x["v"]))
    b, w = ops.read(b, (x["r"][1], _window_col(cols, x["c"][1])), (1, K))
    b, removed = ops.pop(b, (x["r"][1], x["c"][1]))
    b = ops.insert(b, (x["r"][0], x["c"][1]), removed + p["s"] * w.sum())
    return b, removed


# ---------------------------------------------------------------------------
# The corpus: bodies with their buffer layouts.


@dataclasses.dataclass(frozen=True)
class Body:
    """A corpus entry: the step, its buffer layout and what "rows" scales."""

    name: str
    step: Callable
    axis: int = 1
    layout: str = "rows x cols"  # or "stacks x capacity x F", "length x d"

    def shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """The buffer shape for `rows` (what the growth benchmark scales) and `cols`."""
        if self.layout == "stacks x capacity x F":
            return (rows, cols, F)
        return (rows, cols)


BODIES = (
    Body("insert", insert),
    Body("delete", delete),
    Body("pop", pop),
    Body("dynamic_update_slice", dynamic_update_slice),
    Body("slice_matmul_write", slice_matmul_write),
    Body("insert_then_delete", insert_then_delete),
    Body("two_inserts", two_inserts),
    Body("three_inserts", three_inserts),
    Body("stack_push_pop", stack_push_pop, axis=1, layout="stacks x capacity x F"),
    Body("kv_cache_attention", kv_cache_attention, axis=0, layout="length x d"),
    Body("mixed", mixed),
)
BODIES_BY_NAME = {b.name: b for b in BODIES}


def make_inputs(
    body: Body,
    rows: int,
    cols: int,
    steps: int,
    *,
    active_rows: int | None = None,
    dtype: Any = jnp.float32,
    seed: int = 0,
):
    """`(params, init_array, xs)` for `body`; edits touch rows `[0, active_rows)`.

    With `active_rows` fixed and `rows` growing, the work per step is the same and
    only the buffer grows (except for the cache body, whose attention reads it all).
    """
    rng = np.random.default_rng(seed)
    active = rows if active_rows is None else active_rows
    xs = {
        "r": jnp.asarray(rng.integers(0, active, (steps, 2)), jnp.int32),
        "c": jnp.asarray(rng.integers(0, cols, (steps, 2)), jnp.int32),
        "v": jnp.asarray(rng.random(steps), dtype),
        "t": jnp.arange(steps, dtype=jnp.int32),
    }
    params = {
        "s": jnp.asarray(0.5, dtype),
        "W": jnp.asarray(rng.normal(size=(K, K)) / math.sqrt(K), dtype),
    }
    init = jnp.asarray(rng.random(body.shape(rows, cols)), dtype)
    return params, init, xs


def make_loss(
    body: Body, ops: Ops, *, active_rows: int | None = None, scan: Callable = lax.scan
) -> Callable:
    """`loss(params, init_array, xs)`: scan `body` over `xs`, then a scalar loss.

    The loss reads the first `active_rows` rows of the final buffer (all of them by
    default) and the sum of the per-step outputs. `scan` is `lax.scan` unless given
    (`esb.scan`, say).
    """

    def loss(params, init, xs):
        carry = ops.wrap(init, body.axis)
        carry, ys = scan(lambda b, x: body.step(ops, b, x, params), carry, xs)
        final = ops.unwrap(carry)[:active_rows]
        return ((final - 0.5) ** 2).mean() + ys.sum()

    return loss


MODES = ("forward", "grad", "jvp", "vmap(grad)")


def program(mode: str, loss: Callable) -> Callable:
    """`loss` under `mode`: a function of `(params, init, xs)` (batched `xs` for
    `"vmap(grad)"`: a leading batch axis on every leaf)."""
    if mode == "forward":
        return loss
    if mode == "grad":
        return jax.grad(loss, argnums=(0, 1))
    if mode == "jvp":
        return lambda p, init, xs: jax.jvp(
            lambda p, init: loss(p, init, xs), (p, init), (p, init)
        )
    if mode == "vmap(grad)":
        return jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, None, 0))
    raise ValueError(f"`mode` must be one of {MODES}; got {mode!r}.")


def batch_xs(xs, batch: int, seed: int = 1):
    """`batch` different index sequences with the same shapes as `xs`."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in xs.items():
        v = np.asarray(v)
        if k in ("r", "c"):
            hi = int(v.max()) + 1
            out[k] = jnp.asarray(rng.integers(0, hi, (batch,) + v.shape), v.dtype)
        elif k == "t":
            out[k] = jnp.broadcast_to(jnp.asarray(v), (batch,) + v.shape)
        else:
            out[k] = jnp.asarray(rng.random((batch,) + v.shape), v.dtype)
    return out

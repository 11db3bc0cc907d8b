"""Experiment (not used by the library): straight-line shift chains that stay in place.

Found this session by a helper session (see benchmarks/README.md, "Tried this session
and not kept"): writing a 2-row window instead of a [1, n] line stops XLA:CPU from
duplicating the write into the next shift's line read. Measured: 0 copies in forward and
jvp for chains of 2-4 shifts, 0 in grad with the custom_vjp below, 1.02-1.07x plain
forward (jax 0.10.2, CPU). Kept as the starting point for wiring it into
`eqx_shiftbuf._primitives._shift`.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax


def ins_line(line, c, v):
    pos = lax.broadcasted_iota(jnp.int32, line.shape, 0)
    return jnp.where(pos < c, line, jnp.where(pos == c, v, jnp.roll(line, 1, 0)))


def del_line(line, c, v):
    pos = lax.broadcasted_iota(jnp.int32, line.shape, 0)
    return jnp.where(
        pos < c, line, jnp.where(pos == line.shape[0] - 1, v, jnp.roll(line, -1, 0))
    )


def _edit_row(B, r, fn):
    """Replace row r of B (m >= 2) by fn(row), reading and writing a 2-row window.
    fn(line) -> (new_line, aux, tok); tok (int32 zero) is added to the write index."""
    m, n = B.shape
    r0 = jnp.minimum(r, m - 2)  # window rows r0, r0+1 always in range
    k = r - r0  # row r's place in the window (0 or 1)
    win = lax.dynamic_slice(B, (r0, 0), (2, n))
    line = lax.dynamic_index_in_dim(win, k, 0, keepdims=False)
    new, aux, tok = fn(line)
    ri = lax.broadcasted_iota(jnp.int32, (2, n), 0)
    win = jnp.where(ri == k, new[None, :].astype(B.dtype), win)
    return lax.dynamic_update_slice(B, win, (r0 + tok, 0)), aux


def shift_win2(B, r, c, v, kind):  # forward / jvp version (plain autodiff)
    f = ins_line if kind == "i" else del_line
    return _edit_row(B, r, lambda line: (f(line, c, v), None, 0))[0]


def _read_ordered(line, c):
    # The removed cotangent, read through a reduce: XLA:CPU won't duplicate a
    # reduce into the write's fusion, so it stays a materialised read and the
    # write (through tok) depends on it.
    pos = lax.broadcasted_iota(jnp.int32, line.shape, 0)
    x = jnp.sum(jnp.where(pos == c, line, jnp.zeros((), line.dtype)))
    return x, (x > jnp.inf).astype(jnp.int32)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def shift(B, r, c, v, kind):  # grad version (custom_vjp: no jvp)
    return shift_win2(B, r, c, v, kind)


def _fwd(B, r, c, v, kind):
    return shift_win2(B, r, c, v, kind), (r, c)


def _bwd(kind, res, ct):
    r, c = res
    n = ct.shape[1]
    z = jnp.zeros((), ct.dtype)
    if kind == "i":  # transpose of insert: delete at c (fill 0); ct_v = ct[r, c]
        fn = lambda line: (del_line(line, c, z), *_read_ordered(line, c))
    else:  # transpose of delete: insert 0 at c; ct_fill = ct[r, n-1]
        fn = lambda line: (ins_line(line, c, z), *_read_ordered(line, jnp.int32(n - 1)))
    ctB, ctv = _edit_row(ct, r, fn)
    return ctB, None, None, ctv.astype(jnp.result_type(ct))


shift.defvjp(_fwd, _bwd)

"""The NumPy reference model of every buffer operation (the semantics the README states)."""

from __future__ import annotations

import numpy as np


def insert(x: np.ndarray, index: tuple[int, ...], value, axis: int) -> np.ndarray:
    x = np.array(x, copy=True)
    *lead, col = index
    line = x[tuple(lead)]  # view: shift axis first
    n = line.shape[0]
    line[col + 1 :] = line[col : n - 1].copy()
    line[col] = value
    return x


def pop(x: np.ndarray, index: tuple[int, ...], axis: int, fill=0):
    x = np.array(x, copy=True)
    *lead, col = index
    line = x[tuple(lead)]
    n = line.shape[0]
    removed = line[col].copy()
    line[col : n - 1] = line[col + 1 :].copy()
    line[n - 1] = fill
    return x, removed


def delete(x, index, axis, fill=0):
    return pop(x, index, axis, fill)[0]


def dynamic_slice(x, starts, sizes):
    return np.array(x[tuple(slice(s, s + n) for s, n in zip(starts, sizes))])


def dynamic_update_slice(x, update, starts):
    x = np.array(x, copy=True)
    x[tuple(slice(s, s + n) for s, n in zip(starts, update.shape))] = update
    return x


# The same operations as plain `jnp` programs, for "plain autodiff" comparisons.


def jnp_insert(x, index, value, axis):
    import jax.numpy as jnp

    *lead, col = index
    line = x[tuple(lead)]
    pos = jnp.arange(line.shape[0]).reshape((-1,) + (1,) * (line.ndim - 1))
    new = jnp.where(pos < col, line, jnp.where(pos == col, value, jnp.roll(line, 1, 0)))
    return x.at[tuple(lead)].set(new)


def jnp_pop(x, index, axis, fill=0):
    import jax.numpy as jnp

    *lead, col = index
    line = x[tuple(lead)]
    n = line.shape[0]
    pos = jnp.arange(n).reshape((-1,) + (1,) * (line.ndim - 1))
    removed = line[col]
    new = jnp.where(
        pos < col, line, jnp.where(pos == n - 1, fill, jnp.roll(line, -1, 0))
    )
    return x.at[tuple(lead)].set(new.astype(x.dtype)), removed


def jnp_dynamic_slice(x, starts, sizes):
    from jax import lax

    return lax.dynamic_slice(x, starts, sizes)


def jnp_dynamic_update_slice(x, update, starts):
    from jax import lax

    return lax.dynamic_update_slice(x, update, starts)


def jit_reference(fn, **kwargs):
    """`jax.jit(fn)` for a reference program: plain `lax`/`jnp` autodiff, whose
    values the library's must match, that nothing else is checked on.

    Compiled at XLA's backend optimisation level 0 (LLVM's code generation without
    its optimisations), which halves the compile time of these programs; the
    values agree with the default level's to rounding. The library's own programs,
    whose compiled code and copies the tests check, are compiled as a user's are.
    """
    import jax

    return jax.jit(fn, compiler_options={"xla_backend_optimization_level": 0}, **kwargs)

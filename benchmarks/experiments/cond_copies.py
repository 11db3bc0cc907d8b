"""Experiment: XLA:CPU copies a carried buffer that both branches of a `lax.cond` edit.

Plain `lax`, no library: a 100-step `lax.scan` over a (64, 512) float32 carry whose
step is a `lax.cond` with the carry as operand. Prints the per-step copies that
`esb.find_loop_copies` finds for four steps:

- `both_edit`: each branch writes one row of the carry with `dynamic_update_slice`;
- `closure`: the same, the carry closed over instead of passed as the operand;
- `same_window`: both branches write the same row, different values;
- `one_identity`: one branch writes, the other returns the carry unchanged.

Measured (jax 0.10.2, CPU): 2, 2, 2 and 0 per step. So the `cond_stack` row of
`patterns.py` (a push or a pop chosen by `lax.cond`) copies in plain `lax` and in
the library alike, and no lowering of the edits inside the branches avoids it; the
step without a `lax.cond` on the buffer (`select_stack`) copies nothing.

    python benchmarks/experiments/cond_copies.py
"""

import jax.numpy as jnp
from jax import lax

import eqx_shiftbuf as esb


def _scan(branches, closure=False):
    def step(b, x):
        p, i = x
        if closure:
            t, f = branches(b, i)
            b = lax.cond(p, t, f)
        else:
            b = lax.cond(p, *branches(None, i), b)
        return b, None

    return lambda b, xs: lax.scan(step, b, xs)[0]


def _row(b, i, v):
    return lax.dynamic_update_slice(b, jnp.full((1, 512), v, b.dtype), (i, 0))


def both_edit(b, i):
    if b is None:
        return (lambda b: _row(b, i, 1.0)), (lambda b: _row(b, (i + 1) % 64, 0.0))
    return (lambda: _row(b, i, 1.0)), (lambda: _row(b, (i + 1) % 64, 0.0))


def same_window(_, i):
    return (lambda b: _row(b, i, 1.0)), (lambda b: _row(b, i, 0.0))


def one_identity(_, i):
    return (lambda b: _row(b, i, 1.0)), (lambda b: b)


def main():
    b = jnp.zeros((64, 512), jnp.float32)
    xs = (jnp.arange(100) % 2 == 0, (jnp.arange(100) * 7) % 64)
    steps = {
        "both_edit": _scan(both_edit),
        "closure": _scan(both_edit, closure=True),
        "same_window": _scan(same_window),
        "one_identity": _scan(one_identity),
    }
    for name, fn in steps.items():
        copies = esb.find_loop_copies(fn, b, xs, min_bytes=64 * 512 * 4 // 2)
        print(f"{name:13} {len(copies)} copies per step")


if __name__ == "__main__":
    main()

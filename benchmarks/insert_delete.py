"""Insert-then-delete scan: plain lax vs eqx_shiftbuf vs a hand-written custom_vjp.

    python benchmarks/insert_delete.py [--base-rows 100] [--multiplier 10]

Each of 1000 `lax.scan` steps inserts `sin(p * x_t)` into a row at a column and
deletes an element of another row (the step and loss of `eqx_shiftbuf.demo`). The
edits and the loss touch rows `[0, base_rows)` only; the buffer has `base_rows` rows,
then `base_rows * multiplier` rows. The work is the same at both sizes, so a time
that grows with the buffer means a per-iteration copy of the buffer.

Versions:

- `plain lax`: whole-row `dynamic_slice`, `where`/`roll`, `dynamic_update_slice`.
- `eqx_shiftbuf`: a `ShiftBuffer` carry, `.insert(...)` then `.delete(...)`.
- `custom_vjp`: the plain lax forward, with a hand-written backward that stashes the
  value's cotangent in a spare padding column and reads it after the row write
  ("stash then read last", as `fast` in the research `variants.py`). The buffer gets
  one padding column for this.

Prints times, grad/forward ratios, per-iteration buffer copies, and the acceptance
checks for eqx_shiftbuf: grad/forward <= 4 at both sizes, and
grad(large)/grad(small) <= 1.3.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eqx_shiftbuf import demo  # noqa: E402


# ---------------------------------------------------------------------------
# The hand-written custom_vjp baseline. Storage: the buffer plus one padding column.


def insert_row(buf, r, c, v, n):
    pos = jnp.arange(n)
    row = lax.dynamic_slice(buf, (r, 0), (1, n))[0]
    row = jnp.where(pos < c, row, jnp.where(pos == c, v, jnp.roll(row, 1)))
    return lax.dynamic_update_slice(buf, row[None], (r, 0))


def _delete_row(buf, r, c, n):
    pos = jnp.arange(n)
    row = lax.dynamic_slice(buf, (r, 0), (1, n))[0]
    row = jnp.where(pos < c, row, jnp.where(pos == n - 1, 0, jnp.roll(row, -1)))
    return lax.dynamic_update_slice(buf, row[None], (r, 0))


@jax.custom_vjp
def _edit(buf, v, r_ins, c_ins, r_del, c_del):
    n = buf.shape[1] - 1  # the last column is padding, never touched
    return _delete_row(insert_row(buf, r_ins, c_ins, v, n), r_del, c_del, n)


def _edit_fwd(buf, v, r_ins, c_ins, r_del, c_del):
    return _edit(buf, v, r_ins, c_ins, r_del, c_del), (r_ins, c_ins, r_del, c_del)


def insert_transpose(ct, r, c):
    """The backward of `insert_row` on a buffer with one padding column.

    The transpose of an insert is a delete, plus the value's cotangent `ct[r, c]`:
    stash it in the padding column with the same row write, and read it last.
    Returns `(ct, value's cotangent)`.
    """
    n = ct.shape[1] - 1
    pos = jnp.arange(n + 1)
    zero = jnp.zeros_like(r)
    row = lax.dynamic_slice(ct, (r, zero), (1, n + 1))[0]
    stash = lax.dynamic_index_in_dim(row, c, keepdims=False)
    tail = jnp.where(pos < n - 1, jnp.roll(row, -1), jnp.where(pos == n - 1, 0, stash))
    row = jnp.where(pos < c, row, tail)
    ct = lax.dynamic_update_slice(ct, row[None], (r, zero))
    return ct, ct[r, n]


def _edit_bwd(res, ct):
    r_ins, c_ins, r_del, c_del = res
    n = ct.shape[1] - 1
    # The transpose of a delete is an insert of 0.
    ct = insert_row(ct, r_del, c_del, 0.0, n)
    ct, ct_v = insert_transpose(ct, r_ins, c_ins)
    zero = lambda i: np.zeros(np.shape(i), jax.dtypes.float0)
    return ct, ct_v, zero(r_ins), zero(c_ins), zero(r_del), zero(c_del)


_edit.defvjp(_edit_fwd, _edit_bwd)


def custom_vjp_step(buf, inputs):
    return _edit(buf, *inputs), None


VERSIONS = dict(demo.VERSIONS)
VERSIONS["custom_vjp"] = demo.make_loss(
    custom_vjp_step, lambda a: jnp.pad(a, ((0, 0), (0, 1))), lambda b: b[:, :-1]
)


# ---------------------------------------------------------------------------


def check(name: str, ok: bool) -> str:
    return f"{'PASS' if ok else 'FAIL'}  {name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base-rows", type=int, default=100)
    parser.add_argument("--multiplier", type=int, default=10, help="rows multiplier")
    parser.add_argument("--cols", type=int, default=demo.N_COLS)
    parser.add_argument("--steps", type=int, default=demo.N_STEPS)
    parser.add_argument("--repeat", type=int, default=5)
    opts = parser.parse_args()
    sizes = [opts.base_rows, opts.base_rows * opts.multiplier]

    print(
        f"{opts.steps}-step scan, insert + delete per step, {opts.cols} columns, "
        f"edits on the first {opts.base_rows} rows; {jax.devices()[0].platform}, "
        f"jax {jax.__version__}"
    )
    print(f"{'rows':>5} " + demo.HEADER)
    results = {}
    for rows in sizes:
        args = demo.make_args(rows, opts.cols, opts.steps, active_rows=opts.base_rows)
        for name, loss in VERSIONS.items():
            m = demo.measure(loss, args, repeat=opts.repeat)
            results[name, rows] = m
            print(f"{rows:>5} " + demo.row(name, m), flush=True)

    small, large = sizes
    print()
    for name in VERSIONS:
        ratio = results[name, large]["grad_ms"] / results[name, small]["grad_ms"]
        print(f"{name:<14} grad({large} rows)/grad({small} rows) = {ratio:.2f}")

    ref = results["plain lax", small]
    agree = all(
        np.allclose(m["grad"], ref["grad"], rtol=1e-4, atol=1e-6)
        and np.allclose(m["value"], ref["value"], rtol=1e-4, atol=1e-6)
        for m in results.values()
    )
    grads = [float(m["grad"]) for m in results.values()]
    print(
        f"all versions and sizes agree on value and gradient: {agree} "
        f"(gradients {min(grads):.8g} to {max(grads):.8g})"
    )

    e = {rows: results["eqx_shiftbuf", rows] for rows in sizes}
    print("\nacceptance (eqx_shiftbuf):")
    for rows in sizes:
        r = e[rows]["grad_ms"] / e[rows]["fwd_ms"]
        print(check(f"grad/forward <= 4 at {rows} rows ({r:.2f})", r <= 4))
    r = e[large]["grad_ms"] / e[small]["grad_ms"]
    print(check(f"grad({large})/grad({small}) <= 1.3 ({r:.2f})", r <= 1.3))


if __name__ == "__main__":
    main()

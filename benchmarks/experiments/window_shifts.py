"""Experiment: a shift at a Python-int position of a ring, moved as a window
against shifted as a whole line, against plain `lax`.

A `ShiftBuffer` of one line is stored as a ring. An insert or pop at a Python-int
position `p` that is not an end moves the elements between `p` and the nearer end
through a window (a gather and a scatter where it may wrap round the storage,
`_ops._window_shift_side`); otherwise the whole line shifts (a `select` over the
buffer and its materialised roll). The step inserts at `P` and pops at `Q`, both
Python ints, 100-step `lax.scan`; the loss sums the popped values and the final
buffer's squares. "whole line" forces the whole-line shift (`_ops._ROW_COST`
set past every window). Prints forward and gradient ms and the copies the
gradient makes a step; all three versions' gradients are compared.

    python benchmarks/experiments/window_shifts.py [--cases 1024x32:512:600,4096:3:4090]

Measured (jax 0.10.2, this project's 2-core CPU, one run, 2026-12-07, the whole
line's roll written in a conditional (`_xla.rolled_in_branch`); columns: window,
whole line, plain lax, each "fwd / grad ms (copies a step in grad)"):

    (1024, 32)   P=512   Q=600   1.00 / 2.68 (0)  3.45 / 4.05 (0)  0.74 / 2.70 (1)
    (1024, 32)   P=900   Q=1000  0.22 / 0.53 (0)  3.46 / 4.28 (0)  0.74 / 2.66 (1)
    (4096,)      P=3900  Q=4000  0.12 / 0.23 (0)  0.24 / 0.44 (0)  0.15 / 0.30 (1)
    (4096,)      P=1024  Q=3000  0.24 / 0.44 (0)  0.24 / 0.43 (0)  0.15 / 0.31 (1)
    (1024, 4)    P=512   Q=600   0.29 / 0.53 (0)  0.26 / 0.49 (0)  0.08 / 0.36 (1)

(With the roll read through a `reduce_window`, the code before, the whole line
took 4.81 / 9.53 ms on the first row and 0.29 / 0.61 on the third.)

The (4096,) line at P=1024, Q=3000 takes the whole-line shift for both edits,
and the (1024, 4) one for the insert: `_ops._ROW_COST` moves a window of `m`
elements of `row` values where `m * (row + 5) <= K * row` (windows up to a sixth
of a 1-D line), fitted to where the two cost the same on this machine with the
`reduce_window` roll; the rows above still choose the faster of the two or one
within 10%. Where
plain `lax` does not copy (the forward), its static concatenations remain
faster than either but for windows of a few elements.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax import lax

import eqx_shiftbuf as esb
from eqx_shiftbuf import _ops


def _lib(shape, p, q):
    def loss(s, a, xs):
        def step(b, v):
            b = b.insert(p, jnp.full(shape[1:], v * s))
            b, r = b.pop(q)
            return b, r.sum()

        b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=0), xs)
        return (b.array**2).sum() + ys.sum()

    return loss


def _plain(shape, p, q):
    def loss(s, a, xs):
        def step(a, v):
            row = jnp.full((1,) + shape[1:], v * s)
            a = jnp.concatenate([a[:p], row, a[p:-1]])
            r = a[q]
            a = jnp.concatenate([a[:q], a[q + 1 :], jnp.zeros((1,) + shape[1:])])
            return a, r.sum()

        a, ys = lax.scan(step, a, xs)
        return (a**2).sum() + ys.sum()

    return loss


def _time(fn, args, repeat=5) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeat):
        t, n = time.perf_counter(), 0
        while time.perf_counter() - t < 0.05:
            jax.block_until_ready(fn(*args))
            n += 1
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--cases",
        default="1024x32:512:600,1024x32:900:1000,4096:3900:4000,4096:1024:3000,"
        "1024x4:512:600",
    )
    a = ap.parse_args()
    print(
        f"{jax.default_backend()}, jax {jax.__version__}; window, whole line, plain "
        "lax: fwd / grad ms (copies a step in grad), 100 steps"
    )
    row_cost = _ops._ROW_COST
    for case in a.cases.split(","):
        dims, p, q = case.split(":")
        shape = tuple(int(d) for d in dims.split("x"))
        p, q = int(p), int(q)
        k = shape[0]
        init = jnp.arange(k * (shape[1] if len(shape) > 1 else 1), dtype=jnp.float32)
        args = (jnp.float32(0.5), init.reshape(shape) / 1000, jnp.linspace(0.1, 1, 100))
        out, grads = [], []
        for make, cost in (
            (_lib, row_cost),  # window
            (_lib, 10**9),  # whole line
            (_plain, row_cost),
        ):
            _ops._ROW_COST = cost
            loss = make(shape, p, q)
            # Fresh functions, so that `jax.jit` traces each version anew.
            f = jax.jit(lambda *x, loss=loss: loss(*x))
            g = jax.jit(jax.grad(lambda *x, loss=loss: loss(*x), argnums=(0, 1)))
            grads.append(g(*args))
            cs = len(esb.find_loop_copies(g, *args, min_bytes=args[1].nbytes // 2))
            out.append(f"{_time(f, args):.2f} / {_time(g, args):.2f} ({cs})")
        _ops._ROW_COST = row_cost
        same = all(
            bool(jnp.allclose(x, y, rtol=1e-5, atol=1e-5))
            for other in grads[:2]
            for x, y in zip(other, grads[2], strict=True)
        )
        print(f"{str(shape):12s} P={p:<5d} Q={q:<5d}", "  ".join(out), "same:", same)


if __name__ == "__main__":
    main()

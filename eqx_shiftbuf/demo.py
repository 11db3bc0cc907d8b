"""Plain `lax` versus `eqx_shiftbuf` on an insert-then-delete `lax.scan`.

Run with `python -m eqx_shiftbuf.demo` (`--size small`: a 64 x 256 buffer and 20
steps, timed briefly, as the tests run it). Each of 1000 scan steps inserts
`sin(p * x_t)` into one row of a 1000 x 500 float32 buffer at some column, then
deletes the element at some column of another row; the loss is the mean squared
difference between the final buffer and a target. Rows, columns and data are jit
*arguments* (closed-over constants would let XLA fold the loop), and the gradient is
taken with respect to the scalar `p`.

The table shows forward and gradient times, and how many buffer-sized copies XLA
left inside the compiled loops (`esb.find_loop_copies`): a copy there runs on every
iteration, so its cost grows with the buffer.
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import eqx_shiftbuf as esb


N_STEPS, N_ROWS, N_COLS = 1000, 1000, 500
SIZES = {
    "full": dict(n_rows=N_ROWS, n_cols=N_COLS, n_steps=N_STEPS),
    "small": dict(n_rows=64, n_cols=256, n_steps=20),
}


def make_args(n_rows=N_ROWS, n_cols=N_COLS, n_steps=N_STEPS, active_rows=None, seed=0):
    """`(p, init, target, xs, ins_rows, ins_cols, del_rows, del_cols)` for `loss`.

    Edits touch rows `[0, active_rows)` only (default: all of them), and the target
    covers those rows, so a larger `n_rows` adds unused capacity but no work.
    """
    active = n_rows if active_rows is None else active_rows
    rng = np.random.default_rng(seed)
    f32 = lambda *s: jnp.asarray(rng.random(s, dtype=np.float32))
    i32 = lambda hi: jnp.asarray(rng.integers(0, hi, n_steps, dtype=np.int32))
    target, xs = f32(active, n_cols), f32(n_steps)
    idx = (i32(active), i32(n_cols), i32(active), i32(n_cols))
    init = f32(n_rows, n_cols)  # drawn last: its first rows do not depend on n_rows
    return (jnp.float32(1.5), init, target, xs, *idx)


def lax_step(buf, inputs):
    """Insert then delete, each as a whole-row read, `where`/`roll`, whole-row write."""
    v, r_ins, c_ins, r_del, c_del = inputs
    n = buf.shape[1]
    pos, zero = jnp.arange(n), jnp.zeros_like(r_ins)
    row = lax.dynamic_slice(buf, (r_ins, zero), (1, n))[0]
    row = jnp.where(pos < c_ins, row, jnp.where(pos == c_ins, v, jnp.roll(row, 1)))
    buf = lax.dynamic_update_slice(buf, row[None], (r_ins, zero))
    row = lax.dynamic_slice(buf, (r_del, zero), (1, n))[0]
    row = jnp.where(pos < c_del, row, jnp.where(pos == n - 1, 0, jnp.roll(row, -1)))
    return lax.dynamic_update_slice(buf, row[None], (r_del, zero)), None


def esb_step(buf, inputs):
    """The same step on a `ShiftBuffer` carried through the scan."""
    v, r_ins, c_ins, r_del, c_del = inputs
    return buf.insert((r_ins, c_ins), v).delete((r_del, c_del)), None


def make_loss(
    step: Callable,
    wrap: Callable = lambda a: a,
    unwrap=lambda b: b,
    scan: Callable = lax.scan,
):
    """`loss(p, init, target, xs, ins_rows, ins_cols, del_rows, del_cols)`; `scan` is
    `lax.scan` unless given (`esb.scan`, say)."""

    def loss(p, init, target, xs, ins_rows, ins_cols, del_rows, del_cols):
        values = jnp.sin(p * xs)
        buf, _ = scan(
            step, wrap(init), (values, ins_rows, ins_cols, del_rows, del_cols)
        )
        final = unwrap(buf)[: target.shape[0]]
        return ((target - final) ** 2).mean()

    return loss


VERSIONS = {
    "plain lax": make_loss(lax_step),
    "eqx_shiftbuf": make_loss(
        esb_step, lambda a: esb.ShiftBuffer.from_array(a, axis=-1), lambda b: b.array
    ),
}


def time_ms(fn, args, repeat=5, number=None) -> float:
    """Min-of-repeats time of one call in ms, after a warm-up call.

    Each repeat runs `number` calls, by default as many as `timeit` needs for about
    0.2 s.
    """
    call = lambda: jax.block_until_ready(fn(*args))
    call()
    timer = timeit.Timer(call)
    if number is None:
        number, _ = timer.autorange()
    return min(timer.repeat(number=number, repeat=repeat)) / number * 1e3


def measure(loss, args, repeat=5, number=None) -> dict:
    """Times, copy counts and results of one version's jitted loss and gradient."""
    f, g = jax.jit(loss), jax.jit(jax.grad(loss))
    return dict(
        fwd_ms=time_ms(f, args, repeat, number),
        grad_ms=time_ms(g, args, repeat, number),
        fwd_copies=len(esb.find_loop_copies(f, *args)),
        grad_copies=len(esb.find_loop_copies(g, *args)),
        value=float(f(*args)),
        grad=np.asarray(g(*args)),
    )


HEADER = (
    f"{'version':<14} {'forward ms':>10} {'grad ms':>9} {'grad/fwd':>8} "
    f"{'fwd copies':>10} {'grad copies':>11}"
)


def row(name: str, m: dict) -> str:
    return (
        f"{name:<14} {m['fwd_ms']:>10.2f} {m['grad_ms']:>9.2f} "
        f"{m['grad_ms'] / m['fwd_ms']:>8.2f} {m['fwd_copies']:>10d} "
        f"{m['grad_copies']:>11d}"
    )


def main(size: str = "full") -> dict:
    """Print the table for `size` ("full" or "small") and return the measurements
    of each version."""
    dims = SIZES[size]
    args = make_args(**dims)
    print(
        f"{dims['n_steps']}-step scan, insert + delete per step, "
        f"{dims['n_rows']} x {dims['n_cols']} float32 buffer, "
        f"{jax.devices()[0].platform}, jax {jax.__version__}"
    )
    print(HEADER)
    # At the small size, a few calls: the times are only shown.
    repeat, number = (5, None) if size == "full" else (2, 3)
    results = {}
    for name, loss in VERSIONS.items():
        results[name] = measure(loss, args, repeat, number)
        print(row(name, results[name]))
    a, b = results["plain lax"], results["eqx_shiftbuf"]
    grads_ok = np.allclose(a["grad"], b["grad"], rtol=1e-4, atol=1e-6)
    values_ok = np.allclose(a["value"], b["value"], rtol=1e-4, atol=1e-6)
    print(
        f"gradients agree: {grads_ok} ({a['grad']:.8g} vs {b['grad']:.8g}); "
        f"forward values agree: {values_ok} ({a['value']:.8g} vs {b['value']:.8g})"
    )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "demo").splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    main(parser.parse_args().size)

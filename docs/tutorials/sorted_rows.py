"""Tutorial 1: sorted rows, edited inside a `lax.scan`, and their gradient.

The problem that started `eqx_shiftbuf`. A buffer holds `rows` lines, each kept in
ascending order. Every step of a `lax.scan` inserts a new value into one line at its
sorted position (everything after it moves one place right, the largest element
falls off the end), and pops the smallest element of another line (everything moves
one place left, an "empty" marker enters at the end). The popped values are the
scan's outputs. The new values depend on a parameter `p`, and we want the gradient
of a loss with respect to `p`.

Written with plain `lax` ops, the forward pass edits the buffer in place, but the
gradient copies the whole buffer on every step. Written with a `ShiftBuffer`, the
same program stays in place under `jax.grad` too.

Run it by hand: `python docs/tutorials/sorted_rows.py` (realistic sizes) or
`python docs/tutorials/sorted_rows.py --size small` (what the tests run).
"""

from __future__ import annotations

import argparse
import timeit

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import eqx_shiftbuf as esb


SIZES = {
    "small": dict(rows=32, cols=256, steps=200),
    "full": dict(rows=1000, cols=500, steps=1000),
}
EMPTY = 2.0  # larger than any value: what a pop shifts in at the end of a line


def make_inputs(rows: int, cols: int, steps: int, seed: int = 0):
    """Sorted initial lines, and for each step: x, the line to insert into, the line
    to pop from. Indices are int32 arrays passed as arguments (closed-over constants
    would let XLA fold the loop away)."""
    rng = np.random.default_rng(seed)
    init = np.sort(rng.uniform(-1, 1, (rows, cols)).astype(np.float32), axis=1)
    init[:, cols // 2 :] = EMPTY  # half full
    xs = rng.uniform(0, 3, steps).astype(np.float32)
    ins_rows = rng.integers(0, rows, steps, dtype=np.int32)
    pop_rows = rng.integers(0, rows, steps, dtype=np.int32)
    return (
        jnp.asarray(init),
        jnp.asarray(xs),
        jnp.asarray(ins_rows),
        jnp.asarray(pop_rows),
    )


# --8<-- [start:lax]
def lax_step(buf, inputs):
    """One step with plain `lax` ops: read a line, edit it, write it back."""
    v, r_ins, r_pop = inputs
    n = buf.shape[1]
    pos = jnp.arange(n)
    line = lax.dynamic_slice(buf, (r_ins, 0), (1, n))[0]
    col = jnp.searchsorted(line, v)
    line = jnp.where(pos < col, line, jnp.where(pos == col, v, jnp.roll(line, 1)))
    buf = lax.dynamic_update_slice(buf, line[None], (r_ins, 0))
    line = lax.dynamic_slice(buf, (r_pop, 0), (1, n))[0]
    smallest = line[0]
    line = jnp.where(pos == n - 1, EMPTY, jnp.roll(line, -1))
    buf = lax.dynamic_update_slice(buf, line[None], (r_pop, 0))
    return buf, smallest


def lax_loss(p, init, xs, ins_rows, pop_rows):
    buf, popped = lax.scan(lax_step, init, (jnp.sin(p * xs), ins_rows, pop_rows))
    return jnp.where(buf < EMPTY, buf, 0.0).sum() + popped.sum()


# --8<-- [end:lax]


# --8<-- [start:esb]
def esb_step(buf: esb.ShiftBuffer, inputs):
    """The same step on a `ShiftBuffer`: read the line, insert, pop."""
    v, r_ins, r_pop = inputs
    buf, line = buf.read((r_ins, 0), (1, buf.capacity))  # carry on with `buf`
    col = jnp.searchsorted(line[0], v).astype(jnp.int32)
    buf = buf.insert((r_ins, col), v)
    buf, smallest = buf.pop((r_pop, 0))
    return buf, smallest


def esb_loss(p, init, xs, ins_rows, pop_rows):
    buf = esb.ShiftBuffer.from_array(init, axis=-1, fill=EMPTY)
    buf, popped = lax.scan(esb_step, buf, (jnp.sin(p * xs), ins_rows, pop_rows))
    final = buf.array
    return jnp.where(final < EMPTY, final, 0.0).sum() + popped.sum()


# --8<-- [end:esb]


def time_ms(fn, args, size: str) -> float:
    """Best time of one call, in ms, after a warm-up call: of 5 repeats of about
    0.2 s each ("full"), or of 2 repeats of 5 calls ("small", quick but noisy)."""
    call = lambda: jax.block_until_ready(fn(*args))
    call()
    timer = timeit.Timer(call)
    number, repeat = (5, 2) if size == "small" else (timer.autorange()[0], 5)
    return min(timer.repeat(number=number, repeat=repeat)) / number * 1e3


def main(size: str = "full") -> dict:
    """Run the comparison at `size` ("small" or "full"), print a table, and return
    the numbers."""
    dims = SIZES[size]
    args = (jnp.float32(1.5), *make_inputs(**dims))
    buffer_bytes = dims["rows"] * dims["cols"] * 4
    print(
        f"{dims['steps']} steps, {dims['rows']} x {dims['cols']} float32 buffer "
        f"({buffer_bytes / 2**20:.2f} MiB), jax {jax.__version__}, "
        f"{jax.devices()[0].platform}"
    )
    print(
        f"{'version':<13} {'forward ms':>10} {'grad ms':>9} {'grad/fwd':>8} "
        f"{'copies fwd':>10} {'copies grad':>11}"
    )
    results = {}
    for name, loss in [("plain lax", lax_loss), ("eqx_shiftbuf", esb_loss)]:
        f, g = jax.jit(loss), jax.jit(jax.grad(loss))
        # Copies of at least half the buffer, inside a compiled loop: each runs
        # on every step.
        min_bytes = buffer_bytes // 2
        copies = esb.find_loop_copies(g, *args, min_bytes=min_bytes)
        r = dict(
            value=float(f(*args)),
            grad=float(g(*args)),
            fwd_ms=time_ms(f, args, size),
            grad_ms=time_ms(g, args, size),
            fwd_copies=len(esb.find_loop_copies(f, *args, min_bytes=min_bytes)),
            grad_copies=len(copies),
            grad_copy_ops=[f"{c.op_name} at {c.source}" for c in copies],
        )
        results[name] = r
        print(
            f"{name:<13} {r['fwd_ms']:>10.2f} {r['grad_ms']:>9.2f} "
            f"{r['grad_ms'] / r['fwd_ms']:>8.2f} {r['fwd_copies']:>10d} "
            f"{r['grad_copies']:>11d}"
        )
    a, b = results["plain lax"], results["eqx_shiftbuf"]
    agree = bool(
        np.isclose(a["value"], b["value"], rtol=1e-5)
        and np.isclose(a["grad"], b["grad"], rtol=1e-4)
    )
    print(
        f"loss {a['value']:.6g} vs {b['value']:.6g}, gradient {a['grad']:.6g} vs "
        f"{b['grad']:.6g}: {'they agree' if agree else 'THEY DIFFER'}; the "
        f"gradient is {a['grad_ms'] / b['grad_ms']:.1f}x faster with eqx_shiftbuf"
    )
    results["agree"] = agree
    print("Where the plain version's gradient copies (esb.find_loop_copies):")
    for op in a["grad_copy_ops"]:
        print(f"  - {op}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    main(parser.parse_args().size)

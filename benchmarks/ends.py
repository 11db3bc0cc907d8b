"""Edits at the ends of a line: per-step cost against capacity (issue 16).

    python benchmarks/ends.py [--caps 256,512,1024,2048,4096] [--steps 2000]
                              [--repeat 5]

Two step bodies, each a `--steps`-step `lax.scan` over a line of capacity K of
32-float frames (`ShiftBuffer.zeros((K, 32), axis=0)`):

- `delay`: a delay line. Push frame `t` at the front (`insert(0, x)`), read four
  taps, frames `t - 1`, `t - 3`, `t - 7`, `t - 15` (`read((k, 0), (1, 32))`).
- `stack`: a stack whose top is position 0. Push two frames (`insert(0, x)`), pop
  one (`pop(0)`).

Each is written three ways: with `eqx_shiftbuf` (`esb`); in plain `lax` as a shift
(`shift`: `concatenate` and slices, what `insert(0, x)` means); and in plain `lax`
as a pointer (`pointer`: a head index carried beside the array, `dynamic_update_slice`
at it, reads at offsets from it, the O(frame) structure a user would otherwise
write by hand). The loss sums the step outputs and the squares of the final
contents; the gradient is taken with respect to the initial contents and a scale.

Prints, for each body, mode (`fwd`, `grad`) and K, the time per step of each version
(best of `--repeat`, in microseconds), and each version's time at the largest K
over its time at the smallest. Compare within one run, not across runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments._timing import best_ms  # noqa: E402

import eqx_shiftbuf as esb  # noqa: E402


D = 32
TAPS = (1, 3, 7, 15)


def _frame(s, t):
    return jnp.tanh(s * t.astype(jnp.float32) + jnp.arange(D, dtype=jnp.float32))


# -- delay line


def delay_esb(s, a, ts):
    def step(b, t):
        b = b.insert(0, _frame(s, t))
        y = jnp.zeros(())
        for k in TAPS:
            b, w = b.read((k, 0), (1, D))
            y = y + jnp.tanh(s * w).sum()
        return b, y

    b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=0), ts)
    return ys.sum() + (b.array**2).sum()


def delay_shift(s, a, ts):
    def step(b, t):
        b = jnp.concatenate([_frame(s, t)[None], b[:-1]])
        y = sum(jnp.tanh(s * b[k]).sum() for k in TAPS)
        return b, y

    b, ys = lax.scan(step, a, ts)
    return ys.sum() + (b**2).sum()


def _wrap(i, k):
    return jnp.where(i >= k, i - k, i)


def delay_pointer(s, a, ts):
    k = a.shape[0]

    def step(carry, t):
        b, h = carry
        h = _wrap(h + k - 1, k)  # the front moves back one
        b = lax.dynamic_update_slice(b, _frame(s, t)[None], (h, 0))
        y = sum(
            jnp.tanh(s * lax.dynamic_slice(b, (_wrap(h + j, k), 0), (1, D))).sum()
            for j in TAPS
        )
        return (b, h), y

    (b, h), ys = lax.scan(step, (a, jnp.int32(0)), ts)
    return ys.sum() + (b**2).sum()


# -- stack


def stack_esb(s, a, ts):
    def step(b, t):
        f = _frame(s, t)
        b = b.insert(0, f).insert(0, 2.0 * f)
        b, top = b.pop(0)
        return b, (s * top).sum()

    b, ys = lax.scan(step, esb.ShiftBuffer(a, axis=0), ts)
    return ys.sum() + (b.array**2).sum()


def stack_shift(s, a, ts):
    def push(b, v):
        return jnp.concatenate([v[None], b[:-1]])

    def step(b, t):
        f = _frame(s, t)
        b = push(push(b, f), 2.0 * f)
        top, b = b[0], jnp.concatenate([b[1:], jnp.zeros((1, D), b.dtype)])
        return b, (s * top).sum()

    b, ys = lax.scan(step, a, ts)
    return ys.sum() + (b**2).sum()


def stack_pointer(s, a, ts):
    # The top is at index h; a push moves h back one and writes there (over the
    # element that falls off the bottom); a pop reads at h, writes the fill (0)
    # there and moves h on.
    k = a.shape[0]

    def step(carry, t):
        b, h = carry
        f = _frame(s, t)
        for v in (f, 2.0 * f):
            h = _wrap(h + k - 1, k)
            b = lax.dynamic_update_slice(b, v[None], (h, 0))
        top = lax.dynamic_slice(b, (h, 0), (1, D))
        b = lax.dynamic_update_slice(b, jnp.zeros((1, D), b.dtype), (h, 0))
        h = _wrap(h + 1, k)
        return (b, h), (s * top).sum()

    (b, h), ys = lax.scan(step, (a, jnp.int32(0)), ts)
    # The pointer version's logical contents are its array rotated by the head.
    return ys.sum() + (jnp.roll(b, -h, 0) ** 2).sum()


BODIES = {
    "delay": {"esb": delay_esb, "shift": delay_shift, "pointer": delay_pointer},
    "stack": {"esb": stack_esb, "shift": stack_shift, "pointer": stack_pointer},
}
VERSIONS = ("esb", "shift", "pointer")


def _program(loss, mode):
    if mode == "fwd":
        return jax.jit(loss)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def check_equal(body, cap, steps=50):
    """The three versions give the same loss and gradient (to float tolerance)."""
    args = _args(cap, steps)
    outs = [_program(BODIES[body][v], "grad")(*args) for v in VERSIONS]
    for o in outs[1:]:
        for x, y in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(o), strict=True):
            assert jnp.allclose(x, y, rtol=1e-4, atol=1e-4), (body, cap)


def _args(cap, steps):
    a = jax.random.normal(jax.random.key(0), (cap, D), jnp.float32)
    return jnp.float32(0.5), a, jnp.arange(steps, dtype=jnp.int32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caps", default="256,512,1024,2048,4096")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    caps = [int(c) for c in args.caps.split(",")]
    print(
        f"{args.steps}-step lax.scan, frames of {D} float32; us per step "
        f"(best of {args.repeat}); {jax.default_backend()}, jax {jax.__version__}"
    )
    for body in BODIES:
        check_equal(body, min(caps))
        for mode in ("fwd", "grad"):
            times = {v: [] for v in VERSIONS}
            print(f"\n{body} {mode}")
            print(
                f"{'K':>6} " + " ".join(f"{v:>9}" for v in VERSIONS) + "  esb/pointer"
            )
            for cap in caps:
                a = _args(cap, args.steps)
                for v in VERSIONS:
                    fn = _program(BODIES[body][v], mode)
                    times[v].append(best_ms(fn, a, args.repeat) / args.steps * 1e3)
                row = " ".join(f"{times[v][-1]:9.2f}" for v in VERSIONS)
                print(
                    f"{cap:>6} {row}  {times['esb'][-1] / times['pointer'][-1]:11.2f}"
                )
            growth = " ".join(f"{times[v][-1] / times[v][0]:9.2f}" for v in VERSIONS)
            print(f"{'K=' + str(caps[-1]) + '/K=' + str(caps[0]):>6} {growth}")


if __name__ == "__main__":
    main()

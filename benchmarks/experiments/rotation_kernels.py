"""What XLA:CPU takes to read a ring's whole line rotated, element by element.

A 200-step `lax.fori_loop` whose step reads a line of `N` float32 (the argument)
rotated by a moving head, sums it weighted, and writes one element: the rotation
as a static shift (plain `lax`'s `insert(0, x)` of a delay line: `shift`), a
`dynamic_slice` of the line concatenated with itself (`dsconcat`), a gather of
the rotated positions (`gather`), `jnp.roll` at a run-time shift (`roll`), and a
mirrored ring, the line stored twice and written at both places, its window one
`dynamic_slice` (`mirror`). Prints microseconds a step and nanoseconds an
element.

    python benchmarks/experiments/rotation_kernels.py 4096

On the project's 2-core CPU (2026-12-07, jax 0.10.2), 4096 elements: shift 0.22
ns an element, dsconcat 0.68, gather 1.4, roll 0.66, mirror 0.46; 65536: 0.35,
0.47, 0.98, 0.62, 0.41. No run-time rotation reaches the static shift at 4096,
so a 1-D delay line read whole every step (`benchmarks/README.md`, `delay_1d`)
stays slower than plain `lax`, a mirrored layout included.
"""

import sys
import time

import jax
import jax.numpy as jnp
from jax import lax


N = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
T = 200
taps = jnp.cos(0.01 * jnp.arange(N, dtype=jnp.float32))


def shift(i, c):
    s, acc = c
    s = jnp.concatenate([acc[None], s[:-1]])
    return s, acc + (s * taps).sum()


def dsconcat(i, c):
    s, acc = c
    h = (i * 7) % N
    w = lax.dynamic_slice(jnp.concatenate([s, s]), (h,), (N,))
    s = s.at[h].set(acc)
    return s, acc + (w * taps).sum()


def gather(i, c):
    s, acc = c
    h = (i * 7) % N
    w = s[(jnp.arange(N) + h) % N]
    s = s.at[h].set(acc)
    return s, acc + (w * taps).sum()


def roll(i, c):
    s, acc = c
    h = (i * 7) % N
    w = jnp.roll(s, -h)
    s = s.at[h].set(acc)
    return s, acc + (w * taps).sum()


def mirror(i, c):
    s2, acc = c
    h = (i * 7) % N
    w = lax.dynamic_slice(s2, (h,), (N,))
    s2 = s2.at[jnp.stack([h, h + N])].set(acc, unique_indices=True)
    return s2, acc + (w * taps).sum()


def main():
    s = jnp.arange(N, dtype=jnp.float32)
    zero = jnp.float32(0)
    for name, body, init in [
        ("shift", shift, (s, zero)),
        ("dsconcat", dsconcat, (s, zero)),
        ("gather", gather, (s, zero)),
        ("roll", roll, (s, zero)),
        ("mirror", mirror, (jnp.concatenate([s, s]), zero)),
    ]:
        f = jax.jit(lambda c, body=body: lax.fori_loop(0, T, body, c))
        jax.block_until_ready(f(init))
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(f(init))
            best = min(best, time.perf_counter() - t)
        print(
            f"{N} {name:9s} {best / T * 1e6:.2f} us/step  {best / T / N * 1e9:.3f} ns/elem"
        )


if __name__ == "__main__":
    main()

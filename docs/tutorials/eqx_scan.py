"""Tutorial 5: from `equinox.internal.scan(buffers=...)` to `esb.scan`.

A recurrent cell records every hidden state into a write-once buffer `hs`, and reads
the state of the step before from it. With `equinox.internal.scan`, `hs` is named
in `buffers=` so that the checkpointed reverse pass does not store it at every
checkpoint. `esb.scan` takes the same arguments and the same step function; what
changes is what then works:

1. the results and the gradient with respect to the weights are the same;
2. forward mode (`jax.jvp`) works; Equinox's checkpointed scan is a `custom_vjp`;
3. the gradient with respect to the initial contents of the buffer is exact (zero
   where the scan overwrites them); Equinox's is not;
4. `check=True` raises on a step that writes an element twice, where Equinox's
   gradient is silently wrong.

The reference is `jax.lax.scan` on the same step: `hs[i]` and `hs.at[i].set(v)`
work on a plain array too, and plain autodiff of it is exact (it stores every step).

Run it by hand: `python docs/tutorials/eqx_scan.py [--size small]`.
"""

from __future__ import annotations

import argparse
import re
import timeit

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import eqx_shiftbuf as esb


SIZES = {"small": dict(n=64, d=16), "full": dict(n=2000, d=128)}


# --8<-- [start:model]
def make_step(w):
    def step(carry, x):
        i, hs = carry
        prev = hs[i]  # row i: h0, or what step i - 1 wrote
        h = jnp.tanh(w @ prev + x)
        hs = hs.at[i + 1].set(h)  # each row written once
        return (i + 1, hs), None

    return step


def loss(scan, w, hs0, xs):
    """`scan` is `lax.scan`, `equinox.internal.scan` or `esb.scan`."""
    (_, hs), _ = scan(make_step(w), (0, hs0), xs, buffers=lambda c: c[1])
    return (hs**2).mean()


# --8<-- [end:model]


# --8<-- [start:scans]
def eqx_scan(f, init, xs, buffers):
    return eqxi.scan(f, init, xs, buffers=buffers, kind="checkpointed")


def esb_scan(f, init, xs, buffers):
    return esb.scan(f, init, xs, buffers=buffers)  # kind="checkpointed" by default


def lax_scan(f, init, xs, buffers):
    return lax.scan(f, init, xs)  # the reference: plain autodiff


# --8<-- [end:scans]


SCANS = {"lax.scan": lax_scan, "equinox": eqx_scan, "esb.scan": esb_scan}


# --8<-- [start:bug]
def make_buggy_step(w):
    """A step with a bug: it writes row i + 1 twice."""

    def step(carry, x):
        i, hs = carry
        h = jnp.tanh(w @ hs[i] + x)
        hs = hs.at[i + 1].set(h)
        hs = hs.at[i + 1].set(0.5 * h)  # overwrites the write above
        return (i + 1, hs), None

    return step


# --8<-- [end:bug]


def buggy_loss(scan, w, hs0, xs, **kw):
    (_, hs), _ = scan(make_buggy_step(w), (0, hs0), xs, buffers=lambda c: c[1], **kw)
    return (hs**2).mean()


def rel_err(got, want) -> float:
    got, want = np.asarray(got), np.asarray(want)
    return float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))


def first_line(e: Exception) -> str:
    """The exception's type and the line of its message that names the library
    (an Equinox run-time error's message starts with a note on stack traces)."""
    text = str(e).strip()
    named = re.search(r"^(?:[\w.]*Error: )?(esb\.\S.*)$", text, re.M)
    line = named.group(1) if named else (text.splitlines() or [""])[0]
    return f"{type(e).__name__}: {line.strip()}"


def main(size: str = "full") -> dict:
    n, d = SIZES[size]["n"], SIZES[size]["d"]
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(0, 1 / np.sqrt(d), (d, d)), jnp.float32)
    hs0 = jnp.asarray(rng.normal(0, 1, (n + 1, d)), jnp.float32)
    xs = jnp.asarray(rng.normal(0, 0.1, (n, d)), jnp.float32)
    print(f"{n} steps, state {d}, buffer hs: {n + 1} x {d} float32")
    out: dict = {}

    # 1. Same results; gradient time and compiled temporary memory.
    print(f"{'scan':<9} {'grad w':>9} {'d/d hs0':>9} {'ms':>8} {'temp MiB':>9}")
    grads = {}
    for name, scan in SCANS.items():
        grad = jax.grad(lambda w, hs0, s=scan: loss(s, w, hs0, xs), argnums=(0, 1))
        g = jax.jit(grad).lower(w, hs0).compile()
        grads[name] = g(w, hs0)
        timer = timeit.Timer(lambda g=g: jax.block_until_ready(g(w, hs0)))
        number = 3 if size == "small" else timer.autorange()[0]
        ms = min(timer.repeat(number=number, repeat=3)) / number * 1e3
        memory = g.memory_analysis()
        mib = memory.temp_size_in_bytes / 2**20 if memory is not None else float("nan")
        ref = grads["lax.scan"]
        out[name] = dict(
            grad_w_err=rel_err(grads[name][0], ref[0]),
            grad_hs0_err=rel_err(grads[name][1], ref[1]),
            ms=ms,
            temp_mib=mib,
        )
        r = out[name]
        print(
            f"{name:<9} {r['grad_w_err']:>9.1e} {r['grad_hs0_err']:>9.1e} "
            f"{ms:>8.2f} {mib:>9.2f}"
        )
    print("(grad w, d/d hs0: largest error relative to lax.scan's gradient)")

    # 2. Forward mode.
    tangent = jnp.ones_like(w)
    for name, scan in SCANS.items():
        f = jax.jit(
            lambda w, t, s=scan: jax.jvp(lambda w: loss(s, w, hs0, xs), (w,), (t,))
        )
        try:
            out[name]["jvp"] = float(f(w, tangent)[1])
            print(f"jax.jvp through {name}: tangent {out[name]['jvp']:.6g}")
        except Exception as e:  # Equinox: a custom_vjp has no forward mode
            out[name]["jvp"] = first_line(e)
            print(f"jax.jvp through {name}: {out[name]['jvp']}")

    # 4. A step that writes an element twice.
    ref = jax.jit(jax.grad(lambda w: buggy_loss(lax_scan, w, hs0, xs)))(w)
    bad = jax.jit(jax.grad(lambda w: buggy_loss(eqx_scan, w, hs0, xs)))(w)
    out["equinox"]["double_write_err"] = rel_err(bad, ref)
    print(
        f"double write, equinox: no error; largest gradient entry "
        f"{np.abs(bad).max():.3g}, where lax.scan's is {np.abs(ref).max():.3g}"
    )
    try:
        checked = eqx.filter_jit(
            jax.grad(lambda w: buggy_loss(esb.scan, w, hs0, xs, check=True))
        )
        jax.block_until_ready(checked(w))
        out["esb.scan"]["double_write"] = "no error"
    except Exception as e:
        out["esb.scan"]["double_write"] = first_line(e)
    print(f"double write, esb.scan(check=True): {out['esb.scan']['double_write']}")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    main(parser.parse_args().size)

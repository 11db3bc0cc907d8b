"""Choosing a layout: measurements on the tutorials' models.

1. For the models of tutorials 2 (TCN), 3 (attention decoder) and 4 (stack RNN,
   both stacks): the gradient's compiled temporary memory (`memory_analysis()`)
   and time, with `lax.scan` and with a checkpointed `esb.scan`.
2. Edits at the ends of a line, as it grows: a delay line read at a few taps,
   written as a shift (`insert` at row 0, taps at fixed rows) and as a ring the
   user keeps (`dynamic_update_slice` at `t % length`, taps at moving rows), and a
   stack pushed and popped at row 0: gradient time per step and copies.

Run it by hand: `python docs/examples/layout.py [--size small]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import timeit

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

import eqx_shiftbuf as esb


HERE = pathlib.Path(__file__).resolve().parent
TAPS = (0, 1, 3, 7, 15)  # delays read from the line


def tutorial(name: str):
    """Import `docs/tutorials/<name>.py` (not a package)."""
    key = f"_esb_layout_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            key, HERE.parent / "tutorials" / f"{name}.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def measure(fn, args, size: str) -> tuple[float, float]:
    """Compiled temporary memory (MiB) and best time of one call (ms)."""
    compiled = jax.jit(fn).lower(*args).compile()
    memory = compiled.memory_analysis()
    mib = memory.temp_size_in_bytes / 2**20 if memory is not None else float("nan")
    call = lambda: jax.block_until_ready(compiled(*args))
    call()
    timer = timeit.Timer(call)
    number, repeat = (3, 2) if size == "small" else (timer.autorange()[0], 5)
    return mib, min(timer.repeat(number=number, repeat=repeat)) / number * 1e3


def models(size: str):
    """`(name, what, make_grad(scan), args)` for each tutorial model."""
    tcn = tutorial("streaming_conv")
    d = tcn.SIZES[size]
    model, state = eqx.nn.make_with_state(tcn.TCN)(
        d["k"], d["d"], d["hidden"], key=jax.random.key(0)
    )
    xs = jax.random.normal(jax.random.key(1), (d["length"], d["d"]))
    p, static = eqx.partition(model, eqx.is_inexact_array)
    yield (
        "TCN (tutorial 2)",
        f"{d['length']} steps, delay lines {d['k']} x {d['d']} and {d['k']} x {d['hidden']}",
        lambda scan: (
            lambda p, s, x: jax.grad(
                lambda p: tcn.loss(eqx.combine(p, static), s, x, x, scan)
            )(p)
        ),
        (p, state, xs),
    )

    kv = tutorial("kv_cache")
    d = kv.SIZES[size]
    model = kv.Decoder(d["vocab"], d["length"], d["d"], key=jax.random.key(0))
    tokens = kv.make_batch(
        jax.random.key(1), d["batch"], d["vocab"], d["period"], d["length"]
    )
    p, static = eqx.partition(model, eqx.is_inexact_array)
    yield (
        "decoder (tutorial 3)",
        f"{d['length'] - 1} steps, KV cache {d['batch']} x {d['length']} x {2 * d['d']}",
        lambda scan: (
            lambda p, t: jax.grad(
                lambda p: kv.loss(eqx.combine(p, static), t, d["period"], scan)
            )(p)
        ),
        (p, tokens),
    )

    rnn = tutorial("stack_rnn")
    d = rnn.SIZES[size]
    model = rnn.StackRNN(d["vocab"], d["width"], key=jax.random.key(0))
    data = rnn.make_batch(jax.random.key(1), d["batch"], d["vocab"], d["max_len"])
    p, static = eqx.partition(model, eqx.is_inexact_array)
    for kind, stack in [("pointer", rnn.PointerStack), ("shift", rnn.ShiftStack)]:
        empty = stack.empty(d["max_len"], d["width"])
        yield (
            f"stack RNN, {kind} (tutorial 4)",
            f"{2 * d['max_len']} steps, vmap over {d['batch']}, stack "
            f"{d['max_len']} x {d['width']}",
            lambda scan, empty=empty: (
                lambda p, *data: jax.grad(
                    lambda p: rnn.loss(eqx.combine(p, static), empty, *data, scan=scan)
                )(p)
            ),
            (p, *data),
        )


# --8<-- [start:delay]
def shift_step(line: esb.ShiftBuffer, inputs):
    t, x = inputs
    line = line.insert((0,), x)  # newest at row 0: the whole line moves
    y = 0.0
    for k in TAPS:  # x_{t-k} is at row k
        line, w = line.read((k, 0), (1, x.shape[0]))
        y = y + w.sum()
    return line, y


def ring_step(line: esb.ShiftBuffer, inputs):
    t, x = inputs
    n = line.shape[0]
    line = line.dynamic_update_slice(x[None], (t % n, 0))  # one row written
    y = 0.0
    for k in TAPS:  # x_{t-k} is at row (t - k) mod n
        line, w = line.read(((t - k) % n, 0), (1, x.shape[0]))
        y = y + w.sum()
    return line, y


def stack_step(stack: esb.ShiftBuffer, inputs):
    t, x = inputs
    stack = stack.insert(0, x).insert(0, 2.0 * x)  # push two rows
    stack, top = stack.pop(0)  # pop one
    return stack, top.sum()


# --8<-- [end:delay]


def delay_loss(step, p, xs, n):
    steps = jnp.arange(xs.shape[0], dtype=jnp.int32)
    line = esb.ShiftBuffer.zeros((n, xs.shape[1]), axis=0)
    _, ys = lax.scan(step, line, (steps, jnp.sin(p * xs)))
    return (ys**2).mean()


def main(size: str = "full") -> dict:
    out: dict = {"models": {}, "delay": {}}
    print("1. Gradient of each tutorial's model: lax.scan against esb.scan")
    print(
        f"{'model':<32} {'lax MiB':>8} {'esb MiB':>8} {'memory':>7} "
        f"{'lax ms':>8} {'esb ms':>8} {'time':>6}"
    )
    for i, (name, what, make_grad, args) in enumerate(models(size)):
        if size == "small" and i == 2:
            break  # the small size (what the tests run): the first two models only
        lax_mib, lax_ms = measure(make_grad(lax.scan), args, size)
        esb_mib, esb_ms = measure(make_grad(esb.scan), args, size)
        r = dict(
            what=what,
            lax_mib=lax_mib,
            esb_mib=esb_mib,
            lax_ms=lax_ms,
            esb_ms=esb_ms,
            memory_ratio=esb_mib / lax_mib,
            time_ratio=esb_ms / lax_ms,
        )
        out["models"][name] = r
        print(
            f"{name:<32} {lax_mib:>8.2f} {esb_mib:>8.2f} "
            f"{r['memory_ratio']:>6.2f}x {lax_ms:>8.2f} {esb_ms:>8.2f} "
            f"{r['time_ratio']:>5.2f}x"
        )
    for name, r in out["models"].items():
        print(f"  {name}: {r['what']}")
    print("(memory, time: esb.scan / lax.scan)")

    steps, d = (200, 8) if size == "small" else (2000, 16)
    lengths = (64,) if size == "small" else (256, 4096)
    xs = jax.random.normal(jax.random.key(0), (steps, d))
    print(
        f"\n2. Lines of {d} features, {steps} steps: a delay line read at delays "
        f"{TAPS}, shifted or as a ring, and a stack"
    )
    print(f"{'rows':>6} {'layout':<6} {'grad us/step':>12} {'copies':>6}")
    steps_by_name = [("shift", shift_step), ("ring", ring_step), ("stack", stack_step)]
    for n in lengths:
        for name, step in steps_by_name:
            grad = jax.grad(lambda p, xs, step=step, n=n: delay_loss(step, p, xs, n))
            _, ms = measure(grad, (1.0, xs), size)
            copies = esb.find_loop_copies(grad, 1.0, xs, min_bytes=n * d * 2)
            out["delay"][f"{name} {n}"] = dict(
                us_per_step=ms * 1e3 / steps, copies=len(copies)
            )
            print(f"{n:>6} {name:<6} {ms * 1e3 / steps:>12.3f} {len(copies):>6d}")
    if len(lengths) > 1:
        first, last = lengths[0], lengths[-1]
        print(f"time at {last} rows / at {first} rows:")
        for name, _ in steps_by_name:
            r = out["delay"]
            ratio = (
                r[f"{name} {last}"]["us_per_step"] / r[f"{name} {first}"]["us_per_step"]
            )
            out["delay"][f"{name} growth"] = ratio
            print(f"  {name}: {ratio:.2f}")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["small", "full"], default="full")
    main(parser.parse_args().size)

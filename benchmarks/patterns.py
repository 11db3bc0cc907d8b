"""The patterns of issue 13: copies per step and time against plain `lax`.

    python benchmarks/patterns.py [--rows pyint,delay_taps] [--modes fwd,grad]
                                  [--no-time] [--steps 100] [--repeat 5]
                                  [--split] [--vmap] [--hlo ROW MODE FILE]

Each row is a step body written the way a user writes it without thinking about XLA
(Python-int indices, a delay line, one line, a 1-D buffer, a whole-buffer read, a
`lax.cond`, a checkpointed `esb.scan`), run as a `--steps`-step `lax.scan` over a
buffer of at least 64 KiB. For each row and mode (`fwd`, `grad`, `jvp`,
`vmap(grad)`, `jvp(vmap)`) it prints the per-step copies that `esb.find_loop_copies`
finds in the compiled program, for the library (`ShiftBuffer` carry, `esb` ops) and
for the same step in plain `lax`/`jnp` on an array carry; then, unless `--no-time`,
the forward and gradient times of both and their ratio (library / plain, measured
in one run: compare within a run, not across runs), and for the library with
`mode="promise_in_bounds"` its forward over plain lax's (`p.fwd`) and its gradient
over its forward (`p.g/f`): issue 13 asks for at most 1.1 and 4. `s.g/f` is the
same ratio for the same step, `promise_in_bounds`, under `esb.scan` (checkpointed,
default checkpoints) instead of `lax.scan`: "-" for the rows already scanned so.

`--vmap` adds the same step under `jax.vmap` (`v.fwd`) and `jax.vmap(jax.grad)`
(`v.grad`), each the library with `promise_in_bounds` over plain `lax`.

`--split` adds the gradient's forward pass alone (`jax.vjp`, returning the
residuals it saves so that XLA keeps them) and its backward pass alone (the
returned function applied to the loss's cotangent), for the library with `promise_in_bounds` (`p.pass`, `p.bwd`) and
for plain `lax` (`l.pass`, `l.bwd`): under `lax.scan`, the forward pass saves every
step's residuals, one stacking kernel each.

The loss is the corpus's (`corpus.make_loss`): the sum of the per-step outputs plus
a function of the final buffer, differentiated with respect to the parameter and
the initial buffer. `vmap` modes batch the per-step inputs `xs` (4 sequences), so
the buffers become a batch of 4 buffers from the first write.

`--hlo ROW MODE FILE` writes the optimised HLO of the library's program to FILE
(and `FILE.plain` for plain `lax`), to read which instruction copies and why.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
from jax import lax


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from tests.corpus import ESB_PROMISE  # noqa: E402
from tests.natural import (  # noqa: E402  (the rows the tests check)
    _checkpointed as natural_checkpointed,
    args_for,
    copies,
    ESB,
    make_loss,
    MODES,
    PLAIN,
    program,
    Row,
    ROWS_BY_NAME,
)


def _time(fn, args, repeat: int) -> float:
    """Best of `repeat` batches of about 0.05 s, in ms per call."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = max(time.perf_counter() - t0, 1e-6)
    number = max(1, int(0.05 / once))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / number)
    return best * 1e3


def _checkpointed(row: Row) -> Row | None:
    """`row` under checkpointed `esb.scan` (None if it already is)."""
    if row.scan is not lax.scan:
        return None
    return dataclasses.replace(row, scan=natural_checkpointed)


def _forward_pass(loss):
    """The forward pass of `jax.grad(loss)`: the loss and the residuals it saves
    for the backward pass (returned, so that XLA keeps them)."""

    def fn(p, a, xs):
        return jax.vjp(lambda p, a: loss(p, a, xs), p, a)

    return fn


@jax.jit
def _backward_pass(out_and_vjp, args):
    """The backward pass of the gradient whose forward pass (`_forward_pass`)
    returned `out_and_vjp`: the cotangent 1 of the loss pulled back."""
    del args
    out, vjp = out_and_vjp
    return vjp(jax.numpy.ones_like(out))


def times(
    row: Row, steps: int, repeat: int, split: bool = False, vmap: bool = False
) -> dict[tuple[str, str], float]:
    """`(version, mode) -> ms` for fwd and grad, the versions' batches interleaved:
    the library (checked, and with `promise_in_bounds`), plain `lax`, and the
    library with `promise_in_bounds` under checkpointed `esb.scan` ("scan"). With
    `split`, also `"pass"`: the gradient's forward pass alone, for the promise
    version and plain `lax`. With `vmap`, also `"vmap"` and `"vmap(grad)"` (the
    inputs of 4 sequences), for the promise version and plain `lax`."""
    fns = {}
    for name, ops in (("esb", ESB), ("promise", ESB_PROMISE), ("plain", PLAIN)):
        for mode in ("fwd", "grad") + (("vmap", "vmap(grad)") if vmap else ()):
            if name == "esb" and "vmap" in mode:
                continue
            fns[name, mode] = jax.jit(
                program(mode, make_loss(row, ops), row.batch_init)
            )
        if split and name != "esb":
            fns[name, "pass"] = jax.jit(_forward_pass(make_loss(row, ops)))
            fns[name, "bwd"] = _backward_pass
    ck = _checkpointed(row)
    if ck is not None:
        for mode in ("fwd", "grad"):
            fns["scan", mode] = jax.jit(
                program(mode, make_loss(ck, ESB_PROMISE), row.batch_init)
            )
    args = args_for(row, "fwd", steps)
    batched = args_for(row, "vmap", steps) if vmap else None
    out = {k: float("inf") for k in fns}
    for _ in range(repeat):  # interleave, so that a slow spell hits all a little
        for k, fn in fns.items():
            if k[1] == "bwd":  # on the residuals of the version's forward pass
                a = (fns[k[0], "pass"](*args), args)
            elif "vmap" in k[1]:
                a = batched
            else:
                a = args
            out[k] = min(out[k], _time(fn, a, 1))
    return out


def _fmt(cs) -> str:
    return str(len(cs)) if isinstance(cs, list) else cs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS_BY_NAME))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--no-plain", action="store_true", help="skip plain lax's copies")
    ap.add_argument("--verbose", action="store_true", help="print each copy")
    ap.add_argument(
        "--split",
        action="store_true",
        help="also time the gradient's forward pass alone (promise and plain)",
    )
    ap.add_argument(
        "--vmap",
        action="store_true",
        help="also time vmap and vmap(grad) (promise and plain)",
    )
    ap.add_argument("--hlo", nargs=3, metavar=("ROW", "MODE", "FILE"))
    a = ap.parse_args(argv)

    if a.hlo:
        row = ROWS_BY_NAME[a.hlo[0]]
        mode = a.hlo[1]
        for ops, suffix in ((ESB, ""), (PLAIN, ".plain")):
            fn = program(mode, make_loss(row, ops), row.batch_init)
            text = jax.jit(fn).lower(*args_for(row, mode, a.steps)).compile().as_text()
            Path(a.hlo[2] + suffix).write_text(text)
        return

    rows = [ROWS_BY_NAME[n] for n in a.rows.split(",")]
    modes = a.modes.split(",")
    print(
        f"{a.steps}-step lax.scan, copies per step (library / plain lax); "
        f"{jax.default_backend()}, jax {jax.__version__}"
    )
    head = f"{'row':12} " + " ".join(f"{m:>11}" for m in modes)
    if not a.no_time:
        head += (
            f" {'fwd ms':>7} {'plain':>7} {'ratio':>6} {'grad ms':>8} {'plain':>8}"
            f" {'ratio':>6} {'p.fwd':>6} {'p.g/f':>6} {'s.g/f':>6}"
        )
        if a.split:
            head += f" {'p.pass':>7} {'p.bwd':>6} {'l.pass':>7} {'l.bwd':>6}"
        if a.vmap:
            head += f" {'v.fwd':>6} {'v.grad':>6}"
    print(head)
    for row in rows:
        cells = []
        details = []
        for mode in modes:
            try:
                lib = copies(row, ESB, mode, a.steps)
                details += [(mode, c) for c in lib]
            except Exception as e:  # noqa: BLE001  (a row that fails is reported)
                lib = f"E:{type(e).__name__}"
            plain = "-" if a.no_plain else copies(row, PLAIN, mode, a.steps)
            cells.append(f"{_fmt(lib)}/{_fmt(plain)}")
        line = f"{row.name:12} " + " ".join(f"{c:>11}" for c in cells)
        if not a.no_time:
            t = times(row, a.steps, a.repeat, a.split, a.vmap)
            s_gf = (
                f"{t['scan', 'grad'] / t['scan', 'fwd']:6.2f}"
                if ("scan", "fwd") in t
                else f"{'-':>6}"
            )
            line += (
                f" {t['esb', 'fwd']:7.3f} {t['plain', 'fwd']:7.3f}"
                f" {t['esb', 'fwd'] / t['plain', 'fwd']:6.2f}"
                f" {t['esb', 'grad']:8.3f} {t['plain', 'grad']:8.3f}"
                f" {t['esb', 'grad'] / t['plain', 'grad']:6.2f}"
                f" {t['promise', 'fwd'] / t['plain', 'fwd']:6.2f}"
                f" {t['promise', 'grad'] / t['promise', 'fwd']:6.2f} {s_gf}"
            )
            if a.split:
                for v in ("promise", "plain"):
                    line += f" {t[v, 'pass']:7.3f} {t[v, 'bwd']:6.3f}"
            if a.vmap:
                for m in ("vmap", "vmap(grad)"):
                    line += f" {t['promise', m] / t['plain', m]:6.2f}"
        print(line, flush=True)
        if a.verbose:
            for mode, c in details:
                print(f"    {mode}: {c}")


if __name__ == "__main__":
    main()

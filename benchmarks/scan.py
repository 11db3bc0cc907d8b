"""`esb.scan(kind="checkpointed")` against `lax.scan` and `equinox.internal.scan`.

Run from the repository root: `python benchmarks/scan.py` (about 3 minutes on
2 CPUs). Prints, for scans of 1k, 4k and 16k steps:

1. `grad` time and compiled temporary memory (`memory_analysis()`) of a scan whose
   carry is a 4096-float state, for `lax.scan` (stores every step),
   `equinox.internal.scan(kind="checkpointed")` and `esb.scan` with the same number
   of checkpoints (Equinox's default, about sqrt(2 * length)), and the number of
   body evaluations each one's gradient ran, counted at run time, against the
   binomial optimum;
2. the same scan with a write-once buffer (`buffers=`) written every step and read
   one row back, Equinox against `esb.scan`;
3. a `ShiftBuffer` carry doing insert then delete every step (the `demo` step),
   and insert then pop with the popped value read (the reverse pass needs what
   the buffer held), gradient / forward under `lax.scan` and `esb.scan`.

Times are the best of `--repeat` runs after a warm-up; compare within one run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import equinox.internal as eqxi  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import eqx_shiftbuf as esb  # noqa: E402
from eqx_shiftbuf import demo  # noqa: E402
from eqx_shiftbuf._scan import _default_checkpoints  # noqa: E402
from eqx_shiftbuf._schedule import recomputed_steps  # noqa: E402


STATE = 4096


def scans(length):
    c = _default_checkpoints(length)
    return c, {
        "lax.scan": lambda f, init, xs: lax.scan(f, init, xs),
        "equinox.internal.scan": lambda f, init, xs, **kw: eqxi.scan(
            f, init, xs, kind="checkpointed", checkpoints=c, **kw
        ),
        "esb.scan": lambda f, init, xs, **kw: esb.scan(
            f, init, xs, checkpoints=c, **kw
        ),
    }


def state_loss(scan, count=None):
    def loss(w, c0, xs):
        def body(c, x):
            if count is not None:
                jax.debug.callback(count)
            return jnp.sin(w * c) + x, None

        c, _ = scan(body, c0, xs)
        return (c**2).sum()

    return loss


def buffer_loss(scan):
    def loss(w, c0, buf0, xs):
        def body(carry, x):
            i, c, buf = carry
            prev = buf[jnp.where(i > 0, i - 1, buf.shape[0] - 1)]
            c = jnp.sin(w * c) + x + 0.1 * prev
            return (i + 1, c, buf.at[i].set(c)), None

        (_, c, buf), _ = scan(
            body, (jnp.int32(0), c0, buf0), xs, buffers=lambda carry: carry[2]
        )
        return (c**2).sum() + (buf**2).sum()

    return loss


def count_calls(loss, args):
    calls = []
    g = jax.jit(jax.grad(loss(lambda: calls.append(None))))
    jax.block_until_ready(g(*args))
    jax.effects_barrier()
    calls.clear()
    jax.block_until_ready(g(*args))
    jax.effects_barrier()
    return len(calls)


def temp_mb(fn, args):
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    assert analysis is not None, "this backend gives no memory analysis"
    return analysis.temp_size_in_bytes / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[1024, 4096, 16384])
    parser.add_argument("--repeat", type=int, default=3)
    args_ = parser.parse_args()
    print(
        f"{jax.devices()[0].platform}, jax {jax.__version__}, {jax.device_count()} device"
    )

    print(f"\n1. grad of a scan whose carry is a {STATE}-float state (16 KiB)")
    print(
        f"{'length':>6} {'ckpts':>5} {'version':<22} {'grad ms':>8} {'temp MiB':>8} "
        f"{'body evals':>10} {'rerun':>6} {'optimal rerun':>13}"
    )
    for length in args_.lengths:
        c, versions = scans(length)
        xs = jnp.asarray(
            np.random.default_rng(0).normal(size=(length, 1)) * 0.01, jnp.float32
        )
        args = (jnp.float32(0.9), jnp.ones(STATE, jnp.float32), xs)
        ref = None
        for name, scan in versions.items():
            g = jax.jit(jax.grad(state_loss(scan), argnums=(0, 1)))
            ms = demo.time_ms(g, args, args_.repeat)
            mem = temp_mb(jax.grad(state_loss(scan), argnums=(0, 1)), args)
            if name == "lax.scan":
                evals, rerun = "-", "-"  # stores every step's residuals, reruns none
            else:
                evals = count_calls(lambda cnt, s=scan: state_loss(s, cnt), args)
                rerun = evals - 2 * length
            grad = g(*args)
            ref = grad if ref is None else ref
            ok = np.allclose(np.asarray(grad[0]), np.asarray(ref[0]), rtol=1e-4)
            opt = recomputed_steps(length, c) if name != "lax.scan" else "-"
            print(
                f"{length:>6} {c:>5} {name:<22} {ms:>8.2f} {mem:>8.2f} {evals:>10} "
                f"{rerun:>6} {opt:>13}" + ("" if ok else "  GRADIENT DIFFERS")
            )

    print(
        "\n2. the same with a write-once buffer (length x 64 floats) written every step"
    )
    print(f"{'length':>6} {'ckpts':>5} {'version':<22} {'grad ms':>8} {'temp MiB':>8}")
    for length in args_.lengths:
        c, versions = scans(length)
        xs = jnp.asarray(
            np.random.default_rng(0).normal(size=(length, 1)) * 0.01, jnp.float32
        )
        args = (
            jnp.float32(0.9),
            jnp.ones(64, jnp.float32),
            jnp.zeros((length + 1, 64), jnp.float32),
            xs,
        )
        for name in ("equinox.internal.scan", "esb.scan"):
            fn = jax.grad(buffer_loss(versions[name]), argnums=(0, 1))
            print(
                f"{length:>6} {c:>5} {name:<22} {demo.time_ms(jax.jit(fn), args, args_.repeat):>8.2f} "
                f"{temp_mb(fn, args):>8.2f}"
            )

    wrap, unwrap = esb.ShiftBuffer.from_array, lambda b: b.array
    args = demo.make_args(n_rows=100)
    for title, make in [
        ("insert then delete", lambda scan: demo.make_loss(demo.esb_step, wrap, unwrap, scan=scan)),
        ("insert then pop, the popped value read", popped_loss),
    ]:  # fmt: skip
        print(f"\n3. ShiftBuffer carry, {title} per step (1000 steps, 100 x 500)")
        print(
            f"{'version':<34} {'fwd ms':>7} {'grad ms':>8} {'grad/fwd':>8} "
            f"{'copies':>6}"
        )
        for name, scan in [
            ("lax.scan", lax.scan),
            ("esb.scan (default checkpoints)", lambda f, c, x: esb.scan(f, c, x)),
            (
                "esb.scan (checkpoints='all')",
                lambda f, c, x: esb.scan(f, c, x, checkpoints="all"),
            ),
        ]:
            m = demo.measure(make(scan), args, args_.repeat)
            fwd, grad = m["fwd_ms"], m["grad_ms"]
            print(
                f"{name:<34} {fwd:>7.3f} {grad:>8.3f} {grad / fwd:>8.2f} "
                f"{m['grad_copies']:>6}"
            )


def popped_loss(scan):
    """`demo.make_loss`'s loss with a pop for the delete, whose value each step
    returns through `tanh`: the reverse pass needs what the buffer held."""

    def step(buf, inputs):
        v, r_ins, c_ins, r_del, c_del = inputs
        buf, out = buf.insert((r_ins, c_ins), v).pop((r_del, c_del))
        return buf, jnp.tanh(out)

    def loss(p, init, target, xs, ins_rows, ins_cols, del_rows, del_cols):
        values = jnp.sin(p * xs)
        inputs = (values, ins_rows, ins_cols, del_rows, del_cols)
        buf, ys = scan(step, esb.ShiftBuffer.from_array(init), inputs)
        final = buf.array[: target.shape[0]]
        return ((target - final) ** 2).mean() + ys.sum()

    return loss


if __name__ == "__main__":
    main()

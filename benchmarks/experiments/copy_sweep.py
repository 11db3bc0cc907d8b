"""Copy sweep: every step body below, on every shape, index style and mode, counted
with `esb.find_loop_copies` (copies per step of arrays at least half the buffer).

The corpus (`tests/corpus.py`, `tests/natural.py`) holds the patterns found so far;
this sweep is how new ones are found: shapes, index styles and step bodies nobody
designed for. A row ends in `<---` when any mode copies; a mode that raises prints
`E:` and the error (a Python-int window past the end raises at trace time, as it
should). Each body's step is `(buf, i, j, v) -> (buf, y)`, with `i`, `j` positions
along the shift axis (traced from the scan's inputs, or Python / NumPy ints) and
`v` a float the loss depends on through the parameter `s`.

    python benchmarks/experiments/copy_sweep.py                      # 13 shapes, traced int32
    python benchmarks/experiments/copy_sweep.py --styles pyint,npint,traced64 --shapes flat,ring
    python benchmarks/experiments/copy_sweep.py --kind esb           # under checkpointed esb.scan
    python benchmarks/experiments/copy_sweep.py --kind fori          # a lax.fori_loop
    python benchmarks/experiments/copy_sweep.py --unroll 2           # two steps a loop trip
    python benchmarks/experiments/copy_sweep.py --kind remat         # lax.scan(jax.checkpoint(step))
    python benchmarks/experiments/copy_sweep.py --kind nested        # a scan of scans
    python benchmarks/experiments/copy_sweep.py --kind outer_remat   # jax.checkpoint(scan)
    python benchmarks/experiments/copy_sweep.py --kind reverse       # lax.scan(reverse=True)
    python benchmarks/experiments/copy_sweep.py --kind while --modes fwd,jvp,vmap,"jvp(vmap)"
    python benchmarks/experiments/copy_sweep.py --kind eqxi --modes fwd,grad,vmap,"vmap(grad)"
    python benchmarks/experiments/copy_sweep.py --shapes last3 --bodies ins_del --detail

All shapes with traced int32 take about 25 minutes on the project's 2-core CPU.
Latest default sweep (13 shapes x 24 bodies x 7 modes, traced int32; 2026-12-08,
commit `b2c531d`): 0 on all 312 rows. Before it, on `35332cd`: 0 on every row
but `all_ins` on the five shapes of one line (`flat, line, col, ring, lead`: 1-2
a step under grad, vmap(grad), grad(vmap)), rings whose head XLA finds constant
0 read whole before an insert, the window saved as a residual, until
`_xla._rekeyed` kept that rotation (`--styles traced32,pyint --bodies
all_ins,ins_all,arr_ins,arr_jit,ds_ins,win_ins,read_ins`, 13 shapes, 182 rows: 0
on every row). `--kind remat` (`flat, ring, three, mid3, lead, two`,
`traced32,pyint`, 288 rows), 2026-12-08: on `6d7e197`, `all_ins`, `arr_ins` (1-2
under the gradient modes), `read_jit` and `arr_jit` (1-4 forward, jvp and under
vmap(grad)) copied on `flat` and `ring` (`jax.checkpoint`'s body is emitted
outside the module and inlined: not finished, and its reads not found by a
helper's edit); after `b2c531d`, 0 on every row but `arrds_ins` at Python ints
on `mid3` under vmap(grad) (1), which the same commit fixes (`--shapes
mid3,four,two,flat --bodies arrds_ins --styles pyint,traced32`: 0). `arr_jit` (an insert in a nested
`jax.jit` after a slice of `.array` summed) copied 1-4 a step on every shape and
mode before `_xla._reads_before_call`, and `all_ins` 1-2 on every shape under
the three gradient modes before `_xla._snapshot_returned`.
Earlier runs (2026-12-05, jax 0.10.2): 0 copies on every row of the default sweep (13
shapes x 12 bodies x 7 modes); of `--styles traced32,pyint,npint,pyneg` on the
rings (`flat,ring,line,col,lead`); of `--kind esb` (`flat,ring,line,lead`,
`pyint,traced32`) and of `--kind fori` (`flat,ring,line`, `pyint,traced32`).
2026-12-06: the same with `--styles traced64,npint,pyneg` on
`two,three,mid3,last3,wide,four`, `--kind esb` on the nine other shapes, and the
shapes `one3,twoA,mid4,long`: 0 everywhere. `--dtype float16` (six shapes): 0.
`--dtype bfloat16` (the default sweep) and `float8_e4m3fn` (five shapes, five
modes): 0 on every row but `ins_read` (1, 1, 2 copies forward, grad, jvp, on every
shape); with `--styles pyint,pyneg` on the rings, `ds_ins` too (README, known
limits). Before this day's fixes, bfloat16 copied on 69 of the 156 default rows.
Later on 2026-12-06: `--unroll 2` (the default sweep) copied on `ds` and `ds_ins`
under vmap(grad) and grad(vmap) on every shape (2 a step); the new body `win_ins`
(a `dynamic_slice` window, then an insert) copied under every vmap mode on every
shape (2, 2, 4, 2), and in bfloat16 forward too (1, 1, 2). After that day's
fixes: 0 on all of them but `ds` under grad(vmap) with `--unroll 2` (2: README,
known limits).
2026-12-06, later: `--kind remat` (each step under `jax.checkpoint`; `flat, ring,
three, mid3, lead, two`, `traced32,pyint`) copied under grad, vmap(grad) and
grad(vmap) on every body that reads (1-2 a step: JAX saved the buffer before each
step to rerun the step's accesses, and its stacking read the buffer unordered with
respect to the step's first edit). After `_primitives._edit_partial_eval_custom`:
0 on the default sweep with `--styles traced32,pyint`. `--kind nested` (a scan of
three scans, the same shapes and styles): 0 everywhere, before and after. After:
`--kind reverse` and `--kind outer_remat` (`flat, ring, three, mid3, lead, four`,
`traced32,pyint`) and `--kind while` (a `lax.while_loop`, the default shapes,
`traced32,pyint`, its four modes): 0 everywhere. `--kind eqxi` (Equinox's
checkpointed scan, the `ShiftBuffer` an ordinary carry; `flat, three, ring`): 1-2
a step under grad, 2 under vmap(grad) and grad(vmap), on every body but `ds`, as
for plain arrays there (an insert then a pop on a (4096,) line: 1 and 2 under
`grad`, 3 and 3 with `checkpoints="all"`; `esb.scan`: 0 and 2). The answer is
`esb.scan` (docs/migrating.md). `--unroll 2 --bodies ds,ds_ins,win_ins --modes
grad,"vmap(grad)","grad(vmap)"` (13 shapes): 0 everywhere, after the windows of
one buffer at batched starts got zeros of their own under grad(vmap)
(`_primitives._read_transpose`; `ds` copied 2 a step there before).
2026-12-07, later: the default sweep with the bodies `ins_all` and `all_ins` (13
shapes x 24 bodies x 7 modes): 0 on every row but `arr_jit` (README, known
limits) and `all_ins` under grad, vmap(grad) and grad(vmap) (1 a step on one
line, 2 on several; `whole_read_first`: JAX saves the window, the whole buffer,
as a residual, stacked after the step's insert). `ins_all` and `all_ins` with
`--styles traced32,pyint` on `flat,ring,line,col,lead,short,stack,two,mid3`,
and under `--kind esb` on `flat,ring,two`: the same.
2026-12-06, after batched shifts of short lines became one gather and one scatter
(`_each_element`) and batched window writes one scatter (`_scattered`): `--modes
vmap,"vmap(grad)","jvp(vmap)","grad(vmap)"` on the default sweep (13 shapes x 14
bodies) with each of `--styles traced32`, `pyint`, `npint`, `traced64`, `pyneg`:
0 on all 910 rows.
`--dtype int32 --modes fwd,vmap` (`flat, ring, three, mid3, lead, four`,
`traced32,pyint`): 0. `--dtype complex64` (`flat, three, ring`, traced32): the
one-line shapes copied 1, 2, 2 a step (fwd, grad, jvp) on every body that shifts
(the roll of a complex line was not materialised); after `_primitives._rolled`
materialised each part: 0 with traced32 and on `flat` with pyint; `ring` with
pyint still copies the moved window (c64[1,512,32], half the buffer) in the
complex read's loop, 1-2 a step on six bodies (README, known limits).
Later on 2026-12-06: the body `ins_arr` (an insert, then a static slice of
`.array`): 0 on the default sweep with `traced32,pyint`, and with `--kind esb`,
`--kind remat` and `--dtype complex64` (`flat,three,ring,mid3,lead,four`), after
`.array` read through `read_p` and its cotangent was folded and unpadded (before,
in a probe of the same step on four shapes: 1 a step under `vmap(grad)`, and
under `grad` on the two with several lines; complex64 `mid3`: 1 under `grad`). bfloat16 (1, 1, 2 forward, grad, jvp, with
traced indices) and `--unroll 2` (2-4 a step) copy as before (README, known
limits). `long,one3,mid4` with `traced32,pyint`: 0.
2026-12-06, later: new bodies `dus_read`, `dus_ds`, `dus_arr`, `dus_pop` (an
overwrite, then a read, a slice, `.array` or a pop). With every one-line
overwrite and accumulation written as its window, not widened (a probe): `ins_read`
and `ins_arr` copied 2 a step under grad on `last3`, `four`, `unit3`, and `dus_pop`
2 under jvp on the same shapes; nothing else. After overwrites of 2-D buffers only
were written as their window (`_primitives._swap_impl`): 0 on the default sweep
(13 shapes x 18 bodies), on `--styles pyint,pyneg` (`line, two, three, col,
ring, wide, lead`) and on `--kind esb` and `--kind remat` (`two, three, wide,
lead, ring`) for the six overwrite bodies.
2026-12-07: shapes `short, shortline, stack`, whose batches under `vmap` shift as
one `select` over the batch (`_primitives._shift_each_line`) and read small ring
windows as one gather: `--styles traced32,pyint --modes
vmap,vmap(grad),jvp(vmap),grad(vmap)`, 0 on all 108 rows.
2026-12-07, later: `--batch 1` (a batch of one under the vmap modes), shapes
`short,shortline,stack,flat,line,ring`, `traced32,pyint`, the four vmap modes:
float32 0 on all 216 rows (after `_primitives._reduced_read` and `_scattered`
took a batch of one as one buffer; the fuzzer's cases copied 1 a step before).
`--dtype bfloat16` on the default shapes and `short,stack` (15 shapes x 2 styles
x 18 bodies = 540 rows), `--modes fwd,grad,jvp,"vmap(grad)","jvp(vmap)"`, after a
read right after an edit of a narrow buffer went into a conditional
(`_primitives._edited_bits`): copies on 54 rows, 1/1/2 forward, grad, jvp: 20 on
`twotwo` and `unit3` (under 2 KiB, where the conditional is not used), 31 a static
slice of `.array` after an edit (`ins_arr`, `dus_arr`), 3 `ds_ins` at Python ints
(README, known limits). Before it, on the first 373 of those rows (four modes):
64 rows copied (`ins_read` 16, `dus_read` 10, `dus_ds` 10, `ins_arr` 16, `dus_arr`
10, `ds_ins` 2); after: 28 (`ins_arr`, `dus_arr`, `ds_ins`).
2026-12-07, last: bodies `arr_ins` and `arrds_ins` (a slice of `.array`, static or
at a start, taken before an insert and used after it) and `read_jit` (`read`,
then an insert inside a nested `jax.jit`), 13 shapes, `traced32,pyint,npint`: 0
on every row but `arrds_ins` at Python- or NumPy-int starts on the buffers of
three or more dimensions under vmap(grad) and grad(vmap) (1 a step: JAX's sum of
the buffer's two cotangents, the window's scattered into zeros, written out of
place). Before `_xla.user_slices_materialised`, `arr_ins` and `arrds_ins` copied
on every shape and mode (1-2 forward, 2-4 under jvp). `arr_jit` (an insert
inside a nested `jax.jit` after a sum of a slice of `.array`) copies on every
shape, 1-2 forward and 2-4 under jvp (README, known limits).
"""

import argparse
import functools
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import eqx_shiftbuf as esb


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests import natural  # noqa: E402  (the corpus's modes)


jax.config.update("jax_enable_x64", True)

SHAPES = {
    "flat": ((4096,), 0),
    "line": ((1, 4096), 1),
    "two": ((2, 4096), 1),
    "three": ((3, 2000), 1),
    "col": ((4096, 1), 0),
    "mid3": ((16, 64, 32), 1),
    "last3": ((8, 32, 64), 2),
    "ring": ((1024, 32), 0),
    "long": ((1 << 20,), 0),
    "wide": ((64, 512), 1),
    "lead": ((512, 64), 0),
    "unit3": ((8, 1, 64), 2),
    "twotwo": ((2, 2, 64), 2),
    "four": ((4, 3, 5, 64), 3),
    "one3": ((1, 32, 64), 2),
    "twoA": ((2, 32, 64), 2),
    "mid4": ((3, 8, 64, 4), 2),
    # Batches of these under `vmap` are small enough to shift as one `select`
    # (`_primitives.SELECT_LINES_UP_TO`).
    "short": ((1024,), 0),
    "shortline": ((1, 1024), 1),
    "stack": ((128, 16), 0),
}
STYLES = ("traced32", "traced64", "pyint", "npint", "pyneg")


def bodies(shape, axis, dtype):
    n = shape[axis]
    lead = lambda: tuple(0 for _ in range(axis))
    w = min(16, n)
    wsz = tuple(
        1 if d < axis else (w if d == axis else shape[d]) for d in range(len(shape))
    )

    def st(i):
        if isinstance(i, (int, np.integer)):  # a static start: keep the window in range
            i = min(int(i), n - w)
        lead, trail = (0,) * axis, (0,) * (len(shape) - axis - 1)
        return lead + (i,) + trail

    tail = shape[axis + 1 :]
    f32 = lambda x: x.astype(jnp.float32)  # (float8 values do not promote)
    val = lambda v: jnp.full(tail, v, dtype) if tail else jnp.asarray(v, dtype)
    B = {}
    B["insert"] = lambda b, i, j, v: (b.insert(lead() + (i,), val(v)), v)
    B["delete"] = lambda b, i, j, v: (b.delete(lead() + (i,)), v)
    B["pop"] = lambda b, i, j, v: (lambda r: (r[0], (f32(r[1]) * v).sum()))(
        b.pop(lead() + (i,))
    )
    B["dus"] = lambda b, i, j, v: (
        b.dynamic_update_slice(jnp.full(wsz, v, dtype), st(i)),
        v,
    )
    B["ds"] = lambda b, i, j, v: (b, (f32(b.dynamic_slice(st(i), wsz)) * v).sum())
    B["read_ins"] = lambda b, i, j, v: (
        lambda r: (r[0].insert(lead() + (j,), val(v)), (f32(r[1]) * v).sum())
    )(b.read(st(i), wsz))
    B["ins_pop"] = lambda b, i, j, v: (lambda r: (r[0], (f32(r[1]) * v).sum()))(
        b.insert(lead() + (i,), val(v)).pop(lead() + (j,))
    )
    B["ins_read"] = lambda b, i, j, v: (lambda r: (r[0], (f32(r[1]) * v).sum()))(
        b.insert(lead() + (i,), val(v)).read(st(j), wsz)
    )
    B["ins_del"] = lambda b, i, j, v: (
        b.insert(lead() + (i,), val(v)).delete(lead() + (j,)),
        v,
    )
    B["ds_ins"] = lambda b, i, j, v: (
        b.insert(lead() + (j,), val(v)),
        (f32(b.dynamic_slice(st(i), wsz)) * v).sum(),
    )
    B["win_ins"] = lambda b, i, j, v: (  # the window only (no token), then an edit
        (lambda w: (b.insert(lead() + (j,), val(v)), (f32(w) * v).sum()))(
            b.dynamic_slice(st(i), wsz)
        )
    )
    head = tuple(slice(0, 1) for _ in range(axis)) + (slice(0, w),)
    B["ins_arr"] = lambda b, i, j, v: (  # then a static slice of `.array`
        lambda nb: (nb, (f32(nb.array[head]) * v).sum())
    )(b.insert(lead() + (i,), val(v)))
    B["read_dus"] = lambda b, i, j, v: (
        lambda r: (
            r[0].dynamic_update_slice((jnp.cos(f32(r[1])) * v).astype(dtype), st(j)),
            f32(r[1]).sum(),
        )
    )(b.read(st(i), wsz))
    B["dus_read"] = lambda b, i, j, v: (lambda r: (r[0], (f32(r[1]) * v).sum()))(
        b.dynamic_update_slice(jnp.full(wsz, v, dtype), st(i)).read(st(j), wsz)
    )
    B["dus_ds"] = lambda b, i, j, v: (
        lambda nb: (nb, (f32(nb.dynamic_slice(st(j), wsz)) * v).sum())
    )(b.dynamic_update_slice(jnp.full(wsz, v, dtype), st(i)))
    B["dus_arr"] = lambda b, i, j, v: (
        lambda nb: (nb, (f32(nb.array[head]) * v).sum())
    )(b.dynamic_update_slice(jnp.full(wsz, v, dtype), st(i)))
    B["dus_pop"] = lambda b, i, j, v: (lambda r: (r[0], (f32(r[1]) * v).sum()))(
        b.dynamic_update_slice(jnp.full(wsz, v, dtype), st(i)).pop(lead() + (j,))
    )
    B["pop_ins"] = lambda b, i, j, v: (
        lambda r: (
            r[0].insert(lead() + (j,), (f32(r[1]) * v).astype(dtype)),
            f32(r[1]).sum(),
        )
    )(b.pop(lead() + (i,)))
    # A slice of `.array` (static, or at a traced start) taken before an edit and
    # used after it; and an edit inside a nested `jax.jit` after a read.
    B["arr_ins"] = lambda b, i, j, v: (
        lambda w: (b.insert(lead() + (j,), val(v)), (f32(w) * v).sum())
    )(b.array[head])
    B["arrds_ins"] = lambda b, i, j, v: (
        lambda w: (b.insert(lead() + (j,), val(v)), (f32(w) * v).sum())
    )(lax.dynamic_slice(b.array, [jnp.asarray(k, jnp.int32) for k in st(i)], wsz))
    # The whole contents read (a delay line's window), weighted along the line so
    # that a ring's rotation matters in the gradient, after or before an insert
    # (its sum taken before the insert: used after it, the old contents must
    # outlive the in-place edit, a copy in plain `lax` too).
    weights = jnp.cos(jnp.arange(math.prod(shape), dtype=jnp.float32)).reshape(shape)
    wsum = lambda w, v: (f32(w) * weights * v).sum()
    B["ins_all"] = lambda b, i, j, v: (lambda r: (r[0], wsum(r[1], v)))(
        b.insert(lead() + (i,), val(v)).read()
    )
    B["all_ins"] = lambda b, i, j, v: (
        lambda r: (lambda y: (r[0].insert(lead() + (j,), val(v)), y))(wsum(r[1], v))
    )(b.read())
    jit_insert = jax.jit(lambda b, j, x: b.insert(lead() + (j,), x))
    B["read_jit"] = lambda b, i, j, v: (
        lambda r: (jit_insert(r[0], j, val(v)), (f32(r[1]) * v).sum())
    )(b.read(st(i), wsz))
    B["arr_jit"] = lambda b, i, j, v: (lambda y: (jit_insert(b, j, val(v)), y))(
        (f32(b.array[head]) * v).sum()
    )
    return B


MODES = ("fwd", "grad", "jvp", "vmap", "vmap(grad)", "jvp(vmap)", "grad(vmap)")


def scanner(kind, unroll=1):
    if kind == "lax":
        return functools.partial(lax.scan, unroll=unroll)
    if kind == "esb":
        return lambda f, c, xs: esb.scan(f, c, xs, kind="checkpointed", unroll=unroll)
    if kind == "remat":  # each step rematerialised in the gradient
        return lambda f, c, xs: lax.scan(jax.checkpoint(f), c, xs, unroll=unroll)
    if kind == "outer_remat":  # the whole scan under jax.checkpoint
        return lambda f, c, xs: jax.checkpoint(
            lambda c, xs: lax.scan(f, c, xs, unroll=unroll)
        )(c, xs)
    if kind == "eqxi":  # Equinox's checkpointed scan, the buffer a plain carry
        import equinox.internal as eqxi

        return lambda f, c, xs: eqxi.scan(f, c, xs, kind="checkpointed")
    if kind == "reverse":
        return functools.partial(lax.scan, unroll=unroll, reverse=True)
    if kind == "nested":  # a scan of scans, as for chunked sequences

        def ns(f, c, xs):
            L = jax.tree.leaves(xs)[0].shape[0]
            chunks = jax.tree.map(lambda a: a.reshape((3, L // 3) + a.shape[1:]), xs)
            inner = lambda c, x: lax.scan(f, c, x, unroll=unroll)
            c, ys = lax.scan(inner, c, chunks)
            return c, ys.reshape((L,) + ys.shape[2:])

        return ns
    if kind == "while":  # a while_loop (a decode loop): no reverse mode

        def ws(f, c, xs):
            L = jax.tree.leaves(xs)[0].shape[0]

            def body(cy):
                t, c, acc = cy
                c, y = f(c, jax.tree.map(lambda a: a[t], xs))
                return t + 1, c, acc + y

            acc = jnp.zeros((), jnp.result_type(float))
            _, c, acc = lax.while_loop(lambda cy: cy[0] < L, body, (0, c, acc))
            return c, acc

        return ws
    if kind == "fori":

        def fs(f, c, xs):
            L = jax.tree.leaves(xs)[0].shape[0]

            def body(t, cy):
                c, acc = cy
                c, y = f(c, jax.tree.map(lambda a: a[t], xs))
                return c, acc + y

            c, acc = lax.fori_loop(
                0, L, body, (c, jnp.zeros((), jnp.result_type(float))), unroll=unroll
            )
            return c, acc

        return fs


def prog(mode, body, axis, style, n, kind, unroll=1):
    sc = scanner(kind, unroll)

    def loss(s, a, xs):
        def step(b, x):
            i, j, v = x
            if style == "pyint":
                i, j = 3, n // 2
            elif style == "npint":
                i, j = np.int32(3), np.int64(n // 2)
            elif style == "pyneg":
                i, j = n - 1, n - 2
            b, y = body(b, i, j, v * s)
            return b, jnp.asarray(y, jnp.result_type(float)).sum()

        b, ys = sc(step, esb.ShiftBuffer(a, axis=axis), xs)
        return (b.array.astype(jnp.float32) ** 2).sum() + ys.sum()

    return natural.program(mode, loss)  # the corpus's modes


DEFAULT_SHAPES = "flat,line,two,three,col,mid3,last3,ring,wide,lead,four,twotwo,unit3"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--styles", default="traced32")
    ap.add_argument("--bodies", default="")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--kind", default="lax")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--unroll", type=int, default=1, help="the loop's `unroll`")
    ap.add_argument(
        "--batch", type=int, default=2, help="the batch size of the `vmap` modes"
    )
    ap.add_argument("--detail", action="store_true")
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    for sname in args.shapes.split(","):
        shape, axis = SHAPES[sname]
        n = shape[axis]
        a = jnp.ones(shape, dtype)
        s = jnp.float32(0.5)
        for style in args.styles.split(","):
            it = jnp.int64 if style == "traced64" else jnp.int32
            xs = (
                (jnp.arange(12, dtype=it) * 37) % n,
                (jnp.arange(12, dtype=it) * 91) % n,
                jnp.linspace(0.1, 1.0, 12, dtype=jnp.float32),
            )
            bxs = jax.tree.map(
                lambda x: jnp.stack(
                    [
                        jnp.roll(x if k % 2 == 0 else x[::-1], k // 2)
                        for k in range(args.batch)
                    ]
                ),
                xs,
            )
            B = bodies(shape, axis, dtype)
            for bname in args.bodies.split(",") if args.bodies else B:
                row = []
                for m in args.modes.split(","):
                    if (
                        not jnp.issubdtype(dtype, jnp.inexact)
                        and m != "fwd"
                        and m != "vmap"
                    ):
                        row.append("-")
                        continue
                    try:
                        cs = esb.find_loop_copies(
                            prog(m, B[bname], axis, style, n, args.kind, args.unroll),
                            s,
                            a,
                            bxs if "vmap" in m else xs,
                            min_bytes=max(a.nbytes // 2, 1),
                        )
                        c = len(cs)
                        if args.detail:
                            for x in cs:
                                print("   ", m, x)
                    except Exception as e:
                        c = (
                            "E:"
                            + type(e).__name__
                            + ":"
                            + str(e)[:80].replace("\n", " ")
                        )
                    row.append(c)
                flag = "" if all(r in (0, "-") for r in row) else "   <---"
                print(
                    f"{args.kind:4} {sname:6} {style:8} {bname:9}",
                    row,
                    flag,
                    flush=True,
                )


if __name__ == "__main__":
    main()

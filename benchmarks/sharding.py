"""A batch of ShiftBuffers sharded over devices: the probes of issue 15.

    python benchmarks/sharding.py [--steps 200] [--repeat 5]

Runs on 4 forced CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=4`,
set here before JAX is imported). A batch of 8 buffers of 100 x 500 float32
(`jax.vmap(esb.ShiftBuffer.from_array)(a)`) is sharded along its batch axis over a
mesh of 4 devices, with per-element rows, columns and values sharded the same way.
Each of `--steps` `lax.scan` steps inserts a value into one row of each buffer and
deletes an element of another row (vmapped `insert`/`delete`); the loss compares the
final contents with a target, and its gradient is taken with respect to the
per-element scale `p` and the initial contents `a`.

Probes:

- `explicit`: `jit(grad(loss))` on inputs placed with `NamedSharding` on the
  default mesh (`jax.make_mesh((4,), ("b",))`: explicit axis types in jax 0.10).
- `auto`: the same on a mesh with `AxisType.Auto`.
- `.array`: `jit(lambda bb: bb.array)` on a sharded batch of buffers, both meshes.
- `shard_map`: `jax.shard_map` (default checks, `check_vma=True`) of the gradient
  of the same scan on each device's local elements, reading `.array` inside.
- `scan`: the gradient of the same loop as `esb.scan` with the sharded carry.

For each: whether it runs, whether values and gradients equal the unsharded run
(exactly), whether outputs keep the input's sharding, the collectives in the
compiled program (on buffer-sized operands, at least `--min-bytes`; of any size;
of any size inside a loop, which run at every step), and the per-step buffer
copies (`esb.find_loop_copies`). Then times, in one run: sharded over 4 devices
vs one device, and vs plain `jnp` (vmapped `dynamic_slice`/`where`/`roll`/
`dynamic_update_slice`) sharded the same way. The forced CPU devices share the
machine's cores, so sharding cannot be faster here; the target is a ratio of at
most 2 against one device.
"""

from __future__ import annotations

import os


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import argparse  # noqa: E402
import functools  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import timeit  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import eqx_shiftbuf as esb  # noqa: E402


B, ROWS, COLS = 8, 100, 500
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce")


def make_args(steps: int, seed: int = 0):
    """`(p, a, target, xs, ins_rows, ins_cols, del_rows, del_cols)`, per element."""
    rng = np.random.default_rng(seed)
    f32 = lambda *s: rng.random(s, dtype=np.float32)
    i32 = lambda hi: rng.integers(0, hi, (B, steps), dtype=np.int32)
    return (
        1.0 + f32(B),
        f32(B, ROWS, COLS),
        f32(B, ROWS, COLS),
        f32(B, steps),
        i32(ROWS),
        i32(COLS),
        i32(ROWS),
        i32(COLS),
    )


def esb_edit(b, v, ri, ci, rd, cd, mode=None):
    return b.insert((ri, ci), v, mode=mode).delete((rd, cd), mode=mode)


def lax_edit(buf, v, ri, ci, rd, cd):
    """The same edit of one (ROWS, COLS) array in plain `lax`."""
    n = buf.shape[1]
    pos, zero = jnp.arange(n), jnp.zeros_like(ri)
    row = lax.dynamic_slice(buf, (ri, zero), (1, n))[0]
    row = jnp.where(pos < ci, row, jnp.where(pos == ci, v, jnp.roll(row, 1)))
    buf = lax.dynamic_update_slice(buf, row[None], (ri, zero))
    row = lax.dynamic_slice(buf, (rd, zero), (1, n))[0]
    row = jnp.where(pos < cd, row, jnp.where(pos == n - 1, 0, jnp.roll(row, -1)))
    return lax.dynamic_update_slice(buf, row[None], (rd, zero))


def make_loss(kind: str):
    """`loss(p, a, target, xs, ir, ic, dr, dc)` over a batch (leading axis).

    `kind`: "lax", or "esb" / "esb.scan" (the scan used), with " promised" for edits
    with `mode="promise_in_bounds"`.
    """

    def loss(p, a, target, xs, ir, ic, dr, dc):
        values = jnp.sin(p[:, None] * xs)
        inputs = tuple(jnp.swapaxes(x, 0, 1) for x in (values, ir, ic, dr, dc))
        if kind == "lax":
            step = lambda buf, x: (jax.vmap(lax_edit)(buf, *x), None)
            final, _ = lax.scan(step, a, inputs)
        else:
            bb = jax.vmap(esb.ShiftBuffer.from_array)(a)
            mode = "promise_in_bounds" if kind.endswith("promised") else None
            edit = functools.partial(esb_edit, mode=mode)
            step = lambda bb, x: (jax.vmap(edit)(bb, *x), None)
            scan = esb.scan if kind.startswith("esb.scan") else lax.scan
            bb, _ = scan(step, bb, inputs)
            final = bb.array
        return ((target - final) ** 2).sum()

    return loss


def grad_fn(kind: str):
    return jax.jit(jax.grad(make_loss(kind), argnums=(0, 1)))


def shard_map_fn(mesh):
    """The gradient of the esb loss, each device on its own elements (default
    checks), reading `.array` inside."""
    g = jax.grad(make_loss("esb"), argnums=(0, 1))
    spec = P("b")
    return jax.jit(
        jax.shard_map(g, mesh=mesh, in_specs=(spec,) * 8, out_specs=(spec, spec))
    )


# ---------------------------------------------------------------------------
# Inspection.


def _bytes(shape_text: str) -> int:
    """Bytes of the largest array in an HLO result type like `f32[2,100,500]{...}`."""
    sizes = {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "pred": 1, "f16": 2}
    best = 0
    for dt, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape_text):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        best = max(best, n * sizes.get(dt, 4))
    return best


_CALLED = re.compile(
    r"\b(?:body|condition|calls|to_apply|true_computation|false_computation"
    r"|branch_computations)=\{?(%[\w.\-]+(?:,\s*%[\w.\-]+)*)\}?"
)


def _computations(text: str) -> dict[str, list[str]]:
    """The instruction lines of each computation of an HLO module's text."""
    comps: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in text.splitlines():
        m = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and not line.startswith(" "):
            lines = comps.setdefault(m.group(1), [])
        elif line.startswith(" "):
            lines.append(line)
    return comps


def _in_loops(comps: dict[str, list[str]]) -> set[str]:
    """The computations that run inside a `while` loop: the loops' bodies and
    conditions, and every computation they call, transitively."""
    todo = [
        name.lstrip("%")
        for lines in comps.values()
        for line in lines
        if " while(" in line
        for name in re.findall(r"\b(?:body|condition)=(%[\w.\-]+)", line)
    ]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in comps.get(name, ()):
            for group in _CALLED.findall(line):
                todo.extend(n.strip().lstrip("%") for n in group.split(","))
    return seen


def collectives(fn, args, min_bytes: int = 0, in_loops: bool = False) -> dict[str, int]:
    """Counts of collectives in the compiled program of `fn(*args)` whose result
    is at least `min_bytes` (with `in_loops`, only those that run inside a loop,
    at every step): `{op: count}` (only the nonzero ones)."""
    return collectives_in_hlo(fn.lower(*args).compile().as_text(), min_bytes, in_loops)


def collectives_in_hlo(
    text: str, min_bytes: int = 0, in_loops: bool = False
) -> dict[str, int]:
    """`collectives`, in the text of a compiled program."""
    comps = _computations(text)
    looped = _in_loops(comps) if in_loops else None
    counts: dict[str, int] = {}
    for name, lines in comps.items():
        if looped is not None and name not in looped:
            continue
        for line in lines:
            m = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([a-z\-]+)\(", line)
            if not m:
                continue
            result, op = m.group(1), m.group(2)
            op = op.removesuffix("-start")
            if op in COLLECTIVES and _bytes(result) >= min_bytes:
                counts[op] = counts.get(op, 0) + 1
    return counts


def time_ms(fn, args, repeat: int) -> float:
    call = lambda: jax.block_until_ready(fn(*args))
    call()
    timer = timeit.Timer(call)
    number, _ = timer.autorange()
    return min(timer.repeat(number=number, repeat=repeat)) / number * 1e3


def exact(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def keeps_sharding(out, sharding) -> bool:
    """Whether every batched output is sharded as the inputs are."""
    return all(
        x.sharding.is_equivalent_to(sharding, x.ndim)
        for x in jax.tree.leaves(out)
        if x.ndim >= 1
    )


def short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def probe(name, fn, args, ref, sharding, min_bytes, report) -> bool:
    try:
        out = jax.block_until_ready(fn(*args))
    except Exception as e:  # noqa: BLE001 - a probe reports what failed
        report.append(f"{name:<23} FAILS {short(e)}")
        if os.environ.get("ESB_TRACEBACK"):
            traceback.print_exc()
        return False
    big = sum(collectives(fn, args, min_bytes).values())
    small = sum(collectives(fn, args).values())
    looped = sum(collectives(fn, args, in_loops=True).values())
    copies = len(esb.find_loop_copies(fn, *args))
    report.append(
        f"{name:<23} runs  exact={exact(out, ref)!s:<5} "
        f"keeps sharding={keeps_sharding(out, sharding)!s:<5} "
        f"collectives: buffer-sized {big}, any size {small}, in loops {looped}; "
        f"loop copies {copies}"
    )
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--min-bytes", type=int, default=1 << 16)
    parser.add_argument("--no-time", action="store_true")
    opts = parser.parse_args()

    args = make_args(opts.steps)
    one = jax.devices()[0]
    args1 = jax.device_put(args, one)
    ref_grad = grad_fn("esb")(*args1)
    ref_lax = grad_fn("lax")(*args1)
    ref_array = jax.vmap(esb.ShiftBuffer.from_array)(args1[1]).array
    print(
        f"{len(jax.devices())} devices ({one.platform}), jax {jax.__version__}; "
        f"batch of {B} buffers of {ROWS} x {COLS} float32, {opts.steps} steps; "
        f"esb gradient equals plain lax's on one device: {exact(ref_grad, ref_lax)}"
    )

    report: list[str] = []
    meshes = {
        "explicit": jax.make_mesh((4,), ("b",)),
        "auto": jax.make_mesh((4,), ("b",), axis_types=(AxisType.Auto,)),
    }
    timed = {}
    for mname, mesh in meshes.items():
        sh = NamedSharding(mesh, P("b"))
        argsh = jax.device_put(args, sh)
        for kind in ("esb", "esb.scan"):
            ok = probe(
                f"{mname} grad {kind}",
                grad_fn(kind),
                argsh,
                ref_grad,
                sh,
                opts.min_bytes,
                report,
            )
            if ok and kind == "esb":
                timed[mname] = argsh
        bb = jax.vmap(esb.ShiftBuffer.from_array)(argsh[1])
        probe(
            f"{mname} .array",
            jax.jit(lambda bb: bb.array),
            (bb,),
            ref_array,
            sh,
            opts.min_bytes,
            report,
        )
        probe(
            f"{mname} shard_map grad",
            shard_map_fn(mesh),
            argsh,
            ref_grad,
            sh,
            opts.min_bytes,
            report,
        )
    print("\n".join(report))

    if opts.no_time:
        return
    g, gl = grad_fn("esb"), grad_fn("lax")
    t1 = time_ms(g, args1, opts.repeat)
    tl1 = time_ms(gl, args1, opts.repeat)
    print(f"one device: esb {t1:.2f} ms, plain jnp {tl1:.2f} ms")
    for mname, argsh in timed.items():
        ts = time_ms(g, argsh, opts.repeat)
        tl = time_ms(gl, argsh, opts.repeat)
        print(
            f"{mname} mesh, 4 devices: esb {ts:.2f} ms ({ts / t1:.2f}x one device), "
            f"plain jnp {tl:.2f} ms ({tl / tl1:.2f}x one device); "
            f"esb / plain jnp sharded {ts / tl:.2f}"
        )


if __name__ == "__main__":
    main()

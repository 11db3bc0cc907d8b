"""A batch of buffers sharded over 4 devices: exact, in place, no collective.

The test process has initialised JAX with one CPU device, so the checks run in a
subprocess with `--xla_force_host_platform_device_count=4` (the script below, in
three processes: a part of the checks each).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import contextlib, os, re, sys
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    )
    sys.path.insert(0, os.environ["ESB_ROOT"])
    sys.path.insert(0, os.path.join(os.environ["ESB_ROOT"], "benchmarks"))
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import eqx_shiftbuf as esb
    from eqx_shiftbuf._inspect import loop_copies_in_hlo
    import sharding as S

    assert len(jax.devices()) == 4
    PART = sys.argv[1]  # a mesh's name (the checks on it), or "other"

    def check(name, fn, a, ref, sh, sharded=lambda out: out):
        out = jax.block_until_ready(fn(*a))
        assert S.exact(out, ref), name
        assert S.keeps_sharding(sharded(out), sh), name
        cols = S.collectives(fn, a, 1 << 16)
        assert not cols, (name, cols)
        # Nor any collective, however small, at every step (a sharded batch's
        # tokens reduced across devices at each access: 3 all-reduces a step).
        cols = S.collectives(fn, a, in_loops=True)
        assert not cols, (name, "in loops", cols)
        assert not esb.find_loop_copies(fn, *a), name
        print("ok", name)

    all_meshes = {
        "explicit": jax.make_mesh((4,), ("b",)),
        "auto": jax.make_mesh((4,), ("b",), axis_types=(AxisType.Auto,)),
    }
    meshes = {PART: all_meshes[PART]} if PART in all_meshes else {}
    if meshes:
        args = S.make_args(12)
        one = jax.device_put(args, jax.devices()[0])
        ref = S.grad_fn("esb")(*one)
        assert S.exact(ref, S.grad_fn("lax")(*one))
    for mname, mesh in meshes.items():
        sh = NamedSharding(mesh, P("b"))
        a = jax.device_put(args, sh)
        check(mname + " jit grad", S.grad_fn("esb"), a, ref, sh)
        check(mname + " shard_map grad", S.shard_map_fn(mesh), a, ref, sh)
        bb = jax.vmap(esb.ShiftBuffer.from_array)(a[1])
        check(mname + " .array", jax.jit(lambda bb: bb.array), (bb,), one[1], sh)
        # Edits only, the buffers returned unread: no check, so no callback in the
        # program, which would make JAX tell the lowerings the devices anyway (the
        # accesses are split over them only if it does).
        edits = jax.jit(lambda bb, xs: lax.scan(
            lambda bb, x: (jax.vmap(S.esb_edit)(bb, *x), None), bb, xs)[0])
        xs = lambda a: tuple(jnp.swapaxes(x, 0, 1) for x in (a[3], *a[4:]))
        ref_bb = edits(jax.vmap(esb.ShiftBuffer.from_array)(one[1]), xs(one))
        # (On the Auto mesh XLA may replicate the small per-element record.)
        storage = lambda bb: bb._storage
        check(mname + " edits, unread", edits, (bb, xs(a)), ref_bb, sh, storage)

    # esb.scan with a sharded carry: on the explicit mesh its own values (stored
    # carries, cotangent accumulators, the per-step inputs) must be typed with the
    # carry's sharding.
    for mname, mesh in meshes.items():
        sh = NamedSharding(mesh, P("b"))
        a = jax.device_put(args, sh)
        check(mname + " esb.scan grad", S.grad_fn("esb.scan"), a, ref, sh)
        for kind in ("esb promised", "esb.scan promised"):
            check(f"{mname} {kind} grad", S.grad_fn(kind), a, ref, sh)

    if PART == "other":
        # A jax.vmap of a per-example loss that makes its own buffers and loops over
        # them: the data-parallel pattern. A ring (edits at its ends and at a traced
        # middle; a window read across its wrap) and a buffer of 3 lines, with checked
        # indices in a lax.scan (reading the whole buffer, which checks the record,
        # at every step) and promised ones in an esb.scan, in one program (one
        # compile each way). Exact against one device, sharded as its inputs, and no
        # collective on a buffer (at least one example's smaller buffer) nor per-step
        # copy of one, on an explicit mesh with none set in context and under
        # jax.set_mesh. (The checked steps all-reduce a few scalars at each step:
        # whether any example's index is out of range.)
        K, D = 32, 8

        def per_example(a, xs, ks):
            def step(mode):
                def f(bufs, inp):
                    ring, lines = bufs
                    x, k = inp
                    ring = ring.insert(0, x, mode=mode)
                    ring = ring.insert(k, jnp.cos(x), mode=mode)
                    ring, w = ring.read((k, 0), (2, D), mode=mode)
                    ring = ring.delete(k + 1, mode=mode)
                    ring, v = ring.pop(K - 1, mode=mode)
                    y = (w * w).sum() + jnp.sin(v).sum()
                    y = y + ring.dynamic_slice((0, 0), (4, D), mode=mode).sum()
                    lines = lines.insert((k % 3, k), x[0], mode=mode)
                    lines, c = lines.read((0, k), (3, 1), mode=mode)
                    lines, u = lines.pop((2 - k % 3, K - 1 - k), mode=mode)
                    y = y + (c * c).sum() + u
                    if mode is None:
                        lines, whole = lines.read()
                        y = y + whole.sum()
                    return (ring, lines), y

                return f

            loss = 0.0
            for mode, scan in ((None, lax.scan), ("promise_in_bounds", esb.scan)):
                ring = esb.ShiftBuffer.from_array(a, axis=0)  # one line: a ring
                lines = esb.ShiftBuffer.from_array(a.T[:3], axis=1)
                (ring, lines), ys = scan(step(mode), (ring, lines), (xs, ks))
                loss = loss + ys.sum() + (ring.array**2).sum() + jnp.cos(lines.array).sum()
            return loss

        vg = jax.jit(
            jax.grad(lambda *a: jax.vmap(per_example)(*a).sum(), argnums=(0, 1))
        )
        rng = np.random.default_rng(0)
        args = (
            rng.random((8, K, D), dtype=np.float32),
            rng.random((8, 6, D), dtype=np.float32),
            rng.integers(0, K - 2, (8, 6), dtype=np.int32),
        )
        ref = vg(*jax.device_put(args, jax.devices()[0]))
        mesh = all_meshes["explicit"]
        sh = NamedSharding(mesh, P("b"))
        a = jax.device_put(args, sh)
        buffer_bytes = 3 * K * 4
        for ctx in ("no mesh in context", "jax.set_mesh"):
            name = "vmap(per-example loss), " + ctx
            with jax.set_mesh(mesh) if ctx == "jax.set_mesh" else contextlib.nullcontext():
                compiled = vg.lower(*a).compile()
            out = jax.block_until_ready(compiled(*a))
            hlo = compiled.as_text()
            assert S.exact(out, ref), name
            assert S.keeps_sharding(out, sh), name
            cols = S.collectives_in_hlo(hlo, buffer_bytes)
            assert not cols, (name, cols)
            copies = loop_copies_in_hlo(hlo, buffer_bytes)
            assert not copies, (name, copies)
            print("ok", name, "scalar collectives:", S.collectives_in_hlo(hlo))

    # A sharding that splits each buffer's lines is refused when compiled, with
    # an error that names it (not all-gathers that would move the lines).
    for mname, mesh in meshes.items():
        a = jax.device_put(jnp.zeros((8, 16, 12)), NamedSharding(mesh, P(None, "b")))
        edit = lambda x, r: esb.ShiftBuffer.from_array(x).insert((r, 0), 1.0).array
        try:
            jax.jit(jax.vmap(edit))(a, jnp.zeros(8, jnp.int32))
        except Exception as e:
            assert "batch axes only" in str(e) and "P(None, 'b'" in str(e), str(e)
        else:
            raise AssertionError(mname + ": a sharded line was not refused")
        print("ok", mname, "a sharded line is refused")

    if PART == "other":
        # The stack tutorial's data-parallel training step (an Auto mesh: XLA
        # propagates the batch's sharding through the model), on the 4 devices.
        sys.path.insert(0, os.path.join(os.environ["ESB_ROOT"], "docs", "tutorials"))
        import stack_rnn
        dp = stack_rnn.check_data_parallel("small")
        assert dp["devices"] == 4 and dp["max_difference"] < 1e-5, dp
        assert dp["moves"] == 0 and dp["copies"] == 0 and dp["all_reduces"] >= 1, dp
        print("ok stack tutorial, data parallel", dp)

    print("ALL OK")
    """
)


# In three processes, so that two workers share them: the checks on each mesh, and
# the others (on the explicit mesh).
@pytest.mark.heavy
# The Auto mesh's checks are the explicit mesh's, where XLA, not JAX, propagates
# the sharding; "other" is the data-parallel per-example loss: `pytest --full`
# runs them (tests/tiers.py).
@pytest.mark.parametrize(
    "part",
    [
        "explicit",
        pytest.param("auto", marks=pytest.mark.full),
        pytest.param("other", marks=pytest.mark.full),
    ],
)
def test_sharded_batches_run_exactly_in_place_without_collectives(part):
    env = dict(os.environ, ESB_ROOT=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, part],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # A part that checked nothing would still print "ALL OK".
    checked = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert proc.returncode == 0 and "ALL OK" in proc.stdout and checked, (
        proc.stdout[-4000:] + proc.stderr[-4000:]
    )

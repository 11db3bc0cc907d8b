"""A batch of buffers sharded over 4 devices: exact, in place, no collective.

The test process has initialised JAX with one CPU device, so the checks run in a
subprocess with `--xla_force_host_platform_device_count=4` (the script below, one
process for all of them, to pay JAX's start-up once).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import os, re, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    sys.path.insert(0, os.environ["ESB_ROOT"])
    sys.path.insert(0, os.path.join(os.environ["ESB_ROOT"], "benchmarks"))
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import eqx_shiftbuf as esb
    import sharding as S

    assert len(jax.devices()) == 4
    args = S.make_args(12)
    one = jax.device_put(args, jax.devices()[0])
    ref = S.grad_fn("esb")(*one)
    assert S.exact(ref, S.grad_fn("lax")(*one))

    def check(name, fn, a, ref, sh):
        out = jax.block_until_ready(fn(*a))
        assert S.exact(out, ref), name
        assert S.keeps_sharding(out, sh), name
        cols = S.collectives(fn, a, 1 << 16)
        assert not cols, (name, cols)
        # Nor any collective, however small, at every step (a sharded batch's
        # tokens reduced across devices at each access: 3 all-reduces a step).
        cols = S.collectives(fn, a, in_loops=True)
        assert not cols, (name, "in loops", cols)
        assert not esb.find_loop_copies(fn, *a), name
        print("ok", name)

    meshes = {
        "explicit": jax.make_mesh((4,), ("b",)),
        "auto": jax.make_mesh((4,), ("b",), axis_types=(AxisType.Auto,)),
    }
    for mname, mesh in meshes.items():
        sh = NamedSharding(mesh, P("b"))
        a = jax.device_put(args, sh)
        check(mname + " jit grad", S.grad_fn("esb"), a, ref, sh)
        check(mname + " shard_map grad", S.shard_map_fn(mesh), a, ref, sh)
        bb = jax.vmap(esb.ShiftBuffer.from_array)(a[1])
        check(mname + " .array", jax.jit(lambda bb: bb.array), (bb,), one[1], sh)

    # esb.scan with a sharded carry: on the explicit mesh its own values (stored
    # carries, cotangent accumulators, the per-step inputs) must be typed with the
    # carry's sharding.
    for mname, mesh in meshes.items():
        sh = NamedSharding(mesh, P("b"))
        a = jax.device_put(args, sh)
        check(mname + " esb.scan grad", S.grad_fn("esb.scan"), a, ref, sh)

    print("ALL OK")
    """
)


def test_sharded_batches_run_exactly_in_place_without_collectives():
    env = dict(os.environ, ESB_ROOT=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, (
        proc.stdout[-4000:] + proc.stderr[-4000:]
    )
